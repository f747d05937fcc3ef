"""Diffusers' pipeline and LoRA conventions, as properties of `MiniMaxH3Pipeline` (a guidance-distilled
video + audio pipeline): save/load round trip, optional components, dict vs tuple outputs, `components` re-use,
dtype and device moves, offload equivalence, callback tensor inputs, prompt lists and `num_videos_per_prompt`, and
LoRA load / fuse / unload / scale equivalences. Tiny model, two steps, a 32x32 canvas."""

import json

import numpy as np
import pytest
import torch

from diffusers_h3 import MiniMaxH3Pipeline
from diffusers_h3.testing.tiny import TINY_DURATION_LIMITS, TINY_NUM_FRAMES, tiny_components, tiny_pipeline


RUN = {"height": 32, "width": 32, "num_frames": TINY_NUM_FRAMES, "num_inference_steps": 2, "output_type": "latent"}


def _call(pipe, prompt="a fox in snow", seed=0, **kwargs):
    return pipe(prompt=prompt, **{**RUN, **kwargs}, generator=torch.Generator().manual_seed(seed))


def _assert_equal(a, b):
    assert torch.equal(a.frames, b.frames) and torch.equal(a.audio, b.audio)


def _assert_close(a, b, atol):
    assert torch.allclose(a.frames, b.frames, atol=atol, rtol=0)
    assert torch.allclose(a.audio, b.audio, atol=atol, rtol=0)


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline(seed=7, with_transformer_ref=False)


@pytest.fixture(scope="module")
def base(pipe):
    return _call(pipe)


# -- save / load, optional components, components re-use -------------------------------------------------------------


def test_save_load_round_trip_with_optional_component_absent(pipe, base, tmp_path):
    pipe.save_pretrained(tmp_path)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["transformer_ref"] == [None, None]  # an absent optional component is recorded as such
    loaded = MiniMaxH3Pipeline.from_pretrained(tmp_path)
    assert loaded.transformer_ref is None and loaded.config.text_encoder_layer == pipe.config.text_encoder_layer
    # Same weights; CPU GEMMs may round differently for differently aligned (mmapped) buffers.
    _assert_close(_call(loaded), base, atol=1e-5)


def test_optional_components_can_be_passed_and_left_out():
    components = tiny_components(seed=7, with_transformer_ref=False)
    assert "transformer_ref" in MiniMaxH3Pipeline._optional_components
    t2va_only = MiniMaxH3Pipeline(**components, **TINY_DURATION_LIMITS)
    assert t2va_only.transformer_ref is None
    with pytest.raises(ValueError, match="runs on the `transformer` partition"):
        MiniMaxH3Pipeline(**dict(components, transformer=None), **TINY_DURATION_LIMITS)(prompt="x", **RUN)


def test_components_reuse_gives_the_same_outputs(pipe, base):
    components = pipe.components
    assert {"text_encoder", "tokenizer", "processor", "vae", "audio_vae", "scheduler", "audio_scheduler"} <= set(
        components
    )
    rebuilt = MiniMaxH3Pipeline(**components, **TINY_DURATION_LIMITS)
    assert rebuilt.transformer is pipe.transformer
    _assert_equal(_call(rebuilt), base)


# -- outputs ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("output_type", ["latent", "np"])
def test_dict_and_tuple_outputs_are_equal(pipe, output_type):
    as_dict = _call(pipe, output_type=output_type)
    frames, audio, rate = _call(pipe, output_type=output_type, return_dict=False)
    assert rate == as_dict.sampling_rate == 32000
    np.testing.assert_array_equal(np.asarray(frames), np.asarray(as_dict.frames))
    np.testing.assert_array_equal(np.asarray(audio), np.asarray(as_dict.audio))


# -- dtype and device moves, offload --------------------------------------------------------------------------------


def test_to_float64_runs_and_stays_close(base):
    pipe = tiny_pipeline(seed=7, with_transformer_ref=False).to(torch.float64)
    assert pipe.transformer.dtype == pipe.text_encoder.dtype == torch.float64
    out = _call(pipe)
    assert torch.isfinite(out.frames).all() and torch.isfinite(out.audio).all()
    _assert_close(out, base, atol=1e-3)


def test_bfloat16_runs(base):
    pipe = tiny_pipeline(seed=7, with_transformer_ref=False).to(torch.bfloat16)
    assert pipe.transformer.dtype == torch.bfloat16
    out = _call(pipe)
    assert torch.isfinite(out.frames).all() and out.frames.shape == base.frames.shape


def test_to_cpu_keeps_outputs(base):
    pipe = tiny_pipeline(seed=7, with_transformer_ref=False).to("cpu")
    assert pipe.device.type == "cpu"
    _assert_equal(_call(pipe), base)


def test_model_cpu_offload_equivalence(base):
    """Offload hooks with the CPU as execution device (so it runs in CI). Sequential offload is not covered: on this
    CPU setup accelerate fails to re-materialize the audio VAE's weight-norm parameters."""
    pipe = tiny_pipeline(seed=7, with_transformer_ref=False)
    pipe.enable_model_cpu_offload(device="cpu")
    assert all(hasattr(getattr(pipe, name), "_hf_hook") for name in ("text_encoder", "transformer", "vae"))
    _assert_equal(_call(pipe), base)


# -- callbacks --------------------------------------------------------------------------------------------------------


def test_every_callback_tensor_input_is_passed(pipe):
    seen = []

    def callback(p, step, timestep, tensors):
        seen.append(set(tensors))
        return {}

    names = list(pipe._callback_tensor_inputs)
    _call(pipe, callback_on_step_end=callback, callback_on_step_end_tensor_inputs=names)
    assert seen == [set(names)]  # 2 sigma points -> one step


def test_bad_callback_tensor_input_is_refused_before_any_model_runs(pipe):
    calls = []
    hook = pipe.text_encoder.model.register_forward_pre_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(ValueError, match=r"\['noise_pred'\]; allowed"):
            _call(pipe, callback_on_step_end=lambda *a: {}, callback_on_step_end_tensor_inputs=["noise_pred"])
    finally:
        hook.remove()
    assert not calls


def test_callback_replacing_latents_changes_the_result(pipe, base):
    def zero_audio(p, step, timestep, tensors):
        return {"audio_latents": torch.zeros_like(tensors["audio_latents"])}

    out = _call(pipe, callback_on_step_end=zero_audio, callback_on_step_end_tensor_inputs=["audio_latents"])
    assert torch.count_nonzero(out.audio) == 0 and torch.equal(out.frames, base.frames)


# -- prompt lists and num_videos_per_prompt ---------------------------------------------------------------------------


def test_prompt_list_equals_single_calls_with_matching_generators(pipe):
    prompts = ["a fox in snow", "rain on a window"]
    batch = pipe(prompt=prompts, **RUN, generator=[torch.Generator().manual_seed(s) for s in (3, 4)])
    singles = [_call(pipe, prompt, seed) for prompt, seed in zip(prompts, (3, 4))]
    assert batch.frames.shape[0] == 2 and batch.audio.shape[0] == 4  # latent audio: a left/right pair per clip
    assert torch.equal(batch.frames, torch.cat([s.frames for s in singles]))
    assert torch.equal(batch.audio, torch.cat([s.audio for s in singles]))


def test_one_generator_advances_through_the_batch(pipe):
    prompts = ["a fox in snow", "rain on a window"]
    batch = pipe(prompt=prompts, **RUN, generator=torch.Generator().manual_seed(5))
    shared = torch.Generator().manual_seed(5)
    singles = [pipe(prompt=p, **RUN, generator=shared) for p in prompts]
    assert torch.equal(batch.frames, torch.cat([s.frames for s in singles]))
    assert not torch.equal(batch.frames[0], batch.frames[1])


def test_num_videos_per_prompt_stacks_like_diffusers(pipe):
    # Two prompts x two videos, in latent space (the stacking is the same for every output type) ...
    out = pipe(prompt=["a", "b"], num_videos_per_prompt=2, **{**RUN, "output_type": "latent"},
               generator=[torch.Generator().manual_seed(s) for s in range(4)])  # fmt: skip
    assert len(out.frames) == 4 and out.audio.shape[0] == 8  # audio latents: one item per stereo channel
    single = pipe(prompt="b", **{**RUN, "output_type": "latent"}, generator=torch.Generator().manual_seed(3))
    assert torch.equal(out.frames[3], single.frames[0]) and torch.equal(out.audio[6:8], single.audio)
    assert not torch.equal(out.frames[2], out.frames[3])  # the second video of a prompt has its own noise
    # ... and decoded: one prompt, two videos, stacked like diffusers' numpy output.
    decoded = pipe(prompt="a", num_videos_per_prompt=2, **{**RUN, "output_type": "np"},
                   generator=[torch.Generator().manual_seed(s) for s in range(2)])  # fmt: skip
    assert decoded.frames.shape == (2, TINY_NUM_FRAMES, 32, 32, 3) and decoded.audio.shape[:2] == (2, 2)


# -- LoRA -------------------------------------------------------------------------------------------------------------


@pytest.fixture
def lora_file(pipe, tmp_path):
    from tests.loaders._lora_helpers import canonical_lora, save_lora, tiny_transformer, write_layout

    shape = ("attention_head_dim", "num_attention_heads")
    reference = tiny_transformer(**{k: pipe.transformer.config[k] for k in shape})
    return save_lora(tmp_path / "style.safetensors", write_layout(canonical_lora(reference, seed=60), "native"))


def test_lora_scale_and_unload_equivalences(pipe, base, lora_file):
    pipe.load_lora_weights(lora_file, "style")
    try:
        loaded = _call(pipe)
        assert not torch.allclose(loaded.frames, base.frames, atol=1e-4), "the LoRA must change the output"
        pipe.set_adapters("style", 0.0)
        _assert_close(_call(pipe), base, atol=1e-6)  # scale 0 == base
    finally:
        pipe.unload_lora_weights()
    _assert_equal(_call(pipe), base)  # unload restores the base output bitwise


def test_lora_fuse_equivalences(base, lora_file):
    pipe = tiny_pipeline(seed=7, with_transformer_ref=False)
    pipe.load_lora_weights(lora_file, "style")
    loaded = _call(pipe)
    pipe.set_adapters("style", 0.5)
    half = _call(pipe)
    pipe.set_adapters("style", 1.0)
    pipe.fuse_lora(components=["transformer"], lora_scale=1.0)
    _assert_close(_call(pipe), loaded, atol=1e-4)  # fused == unfused
    pipe.unfuse_lora(components=["transformer"])
    _assert_close(_call(pipe), loaded, atol=1e-5)
    pipe.fuse_lora(components=["transformer"], lora_scale=0.5)
    _assert_close(_call(pipe), half, atol=1e-4)  # fused at 0.5 == unfused at adapter weight 0.5
    pipe.unfuse_lora(components=["transformer"])
    pipe.unload_lora_weights()
    # Unfusing subtracts the delta again, so the weights (and outputs) come back up to fp32 round-off only.
    _assert_close(_call(pipe), base, atol=1e-5)
