"""`callback_on_step_end` returning new tensors: diffusers' contract is that the returned latents replace the
pipeline's. Oracle: the same change made between two pipeline runs, the first stopped after step 1 (diffusers'
`interrupt`, `output_type="latent"`) and the second resuming from the changed latents on the rest of the sigma grid
(explicit `sigmas`, which must end at 0)."""

import pytest
import torch
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback

from diffusers_h3.testing.tiny import TINY_NUM_FRAMES, tiny_pipeline


CALL = {"prompt": "a cat", "height": 32, "width": 32, "num_frames": TINY_NUM_FRAMES}
SIGMAS = [1.0, 0.8, 0.55, 0.3, 0.0]
AUDIO_SIGMAS = [1.0, 0.7, 0.5, 0.2, 0.0]
CHANGE_AT = 1  # the callback of step 1 (after the second scheduler step: the state is at SIGMAS[2])


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline(seed=3)


@pytest.fixture(scope="module")
def noise():
    g = torch.Generator().manual_seed(7)
    return torch.randn(1, 4, 7, 2, 2, generator=g), torch.randn(2, 8, 37, generator=g)


def _change_video(x):
    return x * 0.5 + 0.25


def _change_audio(x):
    return x * -0.75


def _stop_after(step):
    def callback(p, i, t, tensors):  # reads nothing, returns nothing: only stops the loop
        if i == step:
            p._interrupt = True

    return callback


def _run(pipe, noise, sigmas, audio_sigmas, **kwargs):
    latents, audio_latents = noise
    return pipe(
        **CALL, sigmas=sigmas, audio_sigmas=audio_sigmas, latents=latents.clone(), audio_latents=audio_latents.clone(),
        output_type="latent", **kwargs,
    )


@pytest.mark.parametrize("replace", [("latents",), ("audio_latents",), ("latents", "audio_latents")])
def test_returned_latents_replace_the_pipeline_latents(pipe, noise, replace):
    def callback(p, i, t, tensors):
        if i != CHANGE_AT:
            return {}
        out = {}
        if "latents" in replace:
            out["latents"] = _change_video(tensors["latents"])  # new tensors, not in-place edits
        if "audio_latents" in replace:
            out["audio_latents"] = _change_audio(tensors["audio_latents"])
        return out

    got = _run(pipe, noise, SIGMAS, AUDIO_SIGMAS, callback_on_step_end=callback,
               callback_on_step_end_tensor_inputs=list(replace))

    # Oracle: stop after step CHANGE_AT (the state is then at SIGMAS[CHANGE_AT + 1]), change the (unpacked) latents,
    # resume on the remaining sigmas. The changes
    # are elementwise, so applying them to the unpacked latents equals applying them to the packed rows.
    cut = CHANGE_AT + 1
    first = _run(pipe, noise, SIGMAS, AUDIO_SIGMAS, callback_on_step_end=_stop_after(CHANGE_AT))
    video, audio = first.frames, first.audio
    if "latents" in replace:
        video = _change_video(video)
    if "audio_latents" in replace:
        audio = _change_audio(audio)
    expected = _run(pipe, (video, audio), SIGMAS[cut:], AUDIO_SIGMAS[cut:])

    assert torch.equal(got.frames, expected.frames)
    assert torch.equal(got.audio, expected.audio)
    # The change is visible at all: without it the result differs.
    plain = _run(pipe, noise, SIGMAS, AUDIO_SIGMAS)
    if "latents" in replace:
        assert (got.frames - plain.frames).abs().max() > 1e-2
    if "audio_latents" in replace:
        assert (got.audio - plain.audio).abs().max() > 1e-2


def test_split_run_reproduces_the_uninterrupted_run(pipe, noise):
    """The oracle's premise: stopping after a step and resuming on the rest of the grid is bitwise the same run."""
    cut = CHANGE_AT + 1
    first = _run(pipe, noise, SIGMAS, AUDIO_SIGMAS, callback_on_step_end=_stop_after(CHANGE_AT))
    resumed = _run(pipe, (first.frames, first.audio), SIGMAS[cut:], AUDIO_SIGMAS[cut:])
    whole = _run(pipe, noise, SIGMAS, AUDIO_SIGMAS)
    assert torch.equal(resumed.frames, whole.frames) and torch.equal(resumed.audio, whole.audio)


# -- diffusers' PipelineCallback: the pipeline reads the callback's own `tensor_inputs` --------------------------------


class _ScaleAudioAt(PipelineCallback):
    """A diffusers `PipelineCallback` that asks for `audio_latents` only (not the pipeline's default `latents`)."""

    tensor_inputs = ["audio_latents"]

    def callback_fn(self, pipeline, step_index, timestep, callback_kwargs):
        if step_index == self.config.cutoff_step_index:
            callback_kwargs["audio_latents"] = _change_audio(callback_kwargs["audio_latents"])
        return callback_kwargs


def test_pipeline_callback_gets_its_tensor_inputs(pipe, noise):
    sigmas = [1.0, 0.5, 0.0]
    got = _run(pipe, noise, sigmas, sigmas, callback_on_step_end=_ScaleAudioAt(cutoff_step_ratio=None,
               cutoff_step_index=0))  # fmt: skip

    # The same change through a plain function given the tensor names explicitly.
    def plain(p, i, t, tensors):
        return {"audio_latents": _change_audio(tensors["audio_latents"])} if i == 0 else {}

    expected = _run(pipe, noise, sigmas, sigmas, callback_on_step_end=plain,
                    callback_on_step_end_tensor_inputs=["audio_latents"])  # fmt: skip
    assert torch.equal(got.audio, expected.audio) and torch.equal(got.frames, expected.frames)
    assert not torch.equal(got.audio, _run(pipe, noise, sigmas, sigmas).audio)  # the change is visible at all


def test_multi_pipeline_callbacks_get_every_callbacks_tensor_inputs(pipe, noise):
    seen = []

    class _Record(PipelineCallback):
        tensor_inputs = ["latents", "prompt_embeds"]

        def callback_fn(self, pipeline, step_index, timestep, callback_kwargs):
            seen.append(sorted(callback_kwargs))
            return callback_kwargs

    callbacks = MultiPipelineCallbacks([_Record(), _ScaleAudioAt(cutoff_step_ratio=None, cutoff_step_index=99)])
    _run(pipe, noise, [1.0, 0.0], [1.0, 0.0], callback_on_step_end=callbacks)
    assert seen == [["audio_latents", "latents", "prompt_embeds"]]


def test_pipeline_callback_with_unknown_tensor_input_is_refused_before_any_model_runs(pipe, noise):
    class _AsksForNoise(_ScaleAudioAt):
        tensor_inputs = ["noise_pred"]

    calls = []
    hook = pipe.text_encoder.model.register_forward_pre_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(ValueError, match=r"\['noise_pred'\]; allowed"):
            _run(pipe, noise, SIGMAS, AUDIO_SIGMAS, callback_on_step_end=_AsksForNoise())
    finally:
        hook.remove()
    assert not calls
