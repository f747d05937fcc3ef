"""Pipeline behaviour beyond parity: bad input, text-encoder early exit, layout publishing, callbacks, outputs."""

import numpy as np
import pytest
import torch
from PIL import Image

from diffusers_h3 import MiniMaxH3AudioReference, MiniMaxH3ImageReference, current_packed_layout
from diffusers_h3.testing.tiny import TINY_NUM_FRAMES, tiny_pipeline


BASE = {"prompt": "a cat", "height": 32, "width": 32, "num_frames": TINY_NUM_FRAMES, "num_inference_steps": 2}


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline(seed=3)


def _image(w=40, h=36):
    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8))


# ---------------------------------------------------------------------------------------------------------------
# Bad input: each gets a ValueError naming the problem.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_frames": 5}, r"rounds up to 5 frames .* less than one VAE chunk.*0\.5–15 s"),  # real: test_request
        ({"num_frames": 346, "strict_duration": True}, r"rounds up to 362"),
        ({"num_frames": 0}, "positive int"),
        ({"height": 32, "width": 160}, "aspect ratios from 1:4 to 4:1"),
        ({"height": 48, "width": 64}, "multiples of 32"),
        ({"height": 32, "width": None}, "passed together"),
        ({"prompt": None}, "`prompt` must be a string"),
        ({"prompt": ""}, "`prompt` is empty"),
        ({"prompt": " \n\t"}, "`prompt` is empty"),
        ({"prompt": []}, "empty list"),
        ({"prompt": ["a", "  "]}, r"`prompt\[1\]` is empty"),
        ({"prompt": ["a", 3]}, r"`prompt\[1\]` must be a string"),
        ({"num_videos_per_prompt": 0}, "`num_videos_per_prompt` must be a positive int"),
        ({"prompt": ["a", "b"], "generator": [torch.Generator()]}, "one generator per clip"),
        ({"prompt": ["a", "b"], "latents": torch.randn(1, 4, 7, 2, 2)}, "the batch has 2 clips"),
        ({"output_type": "gif"}, "`output_type` must be one of"),
        ({"callback_on_step_end_tensor_inputs": ["noise"]}, "callback_on_step_end_tensor_inputs"),
        ({"audio_sigmas": [1.0, 0.0]}, "`audio_sigmas` needs `sigmas`"),
        ({"sigmas": [1.0, 0.5, 0.0], "audio_sigmas": [1.0, 0.0]}, "same length"),
        # Each of these ran before: NaN frames without a word, or a failure after the text encoder ran.
        ({"sigmas": [float("inf"), 0.5, 0.0]}, r"`sigmas` must hold finite values in \[0, 1\].*inf"),
        ({"sigmas": [1.0, float("nan"), 0.0]}, r"`sigmas` must hold finite values"),
        ({"sigmas": [1.5, 0.5, 0.0]}, r"`sigmas` must hold finite values in \[0, 1\]"),
        ({"sigmas": [1.0, 0.5, 0.0], "audio_sigmas": [1.0, float("inf"), 0.0]}, "`audio_sigmas` must hold finite"),
        ({"sigmas": [1.0, 0.5, 0.5, 0.0]}, "strictly decreasing"),
        ({"sigmas": 0.5}, "`sigmas` must be a list of numbers"),
        ({"flow_shift": float("nan")}, "`flow_shift` must be a finite number above 0"),
        ({"audio_flow_shift": float("inf")}, "`audio_flow_shift` must be a finite number above 0"),
        ({"flow_shift": 0.0}, "`flow_shift` must be a finite number above 0"),
        ({"num_inference_steps": float("nan")}, "`num_inference_steps` must be an int from 2 to 1000"),
        ({"num_inference_steps": 2.5}, "`num_inference_steps` must be an int"),
        ({"num_inference_steps": 10**12}, "`num_inference_steps` must be an int from 2 to 1000"),
        ({"num_inference_steps": 1}, "`num_inference_steps` must be an int from 2"),
        ({"height": float("nan"), "width": 32}, "`height` must be an int"),
        ({"height": 32, "width": 32.0}, "`width` must be an int"),
        ({"height": 10**9, "width": 10**9}, "more than this pipeline generates.*`max_canvas_pixels`"),
        ({"height": 4096, "width": 4096}, r"16,777,216 pixels, more than this pipeline generates \(2,088,960"),
        ({"generator": "seed0"}, "`generator` must be a torch.Generator"),
        ({"generator": [torch.Generator(), 0]}, r"`generator\[1\]` must be a torch.Generator"),
        ({"latents": torch.randn(4, 7, 2, 2)}, r"`latents` must be a float tensor \(batch, channels"),
        ({"latents": torch.full((1, 4, 7, 2, 2), float("nan"))}, "`latents` holds NaN or inf"),
        ({"audio_latents": torch.randn(2, 8)}, "`audio_latents` must be a float tensor"),
        ({"prompt": "caf\udce9"}, r"`prompt` is not valid UTF-8 text \(the lone surrogate '\\udce9' at character 3"),
        ({"prompt": b"a cat"}, r"`prompt` must be a string, got bytes: decode it"),
        ({"attention_kwargs": {"scale": float("nan")}}, r"`attention_kwargs\['scale'\]` .* must be a finite number"),
        ({"attention_kwargs": [("scale", 1.0)]}, "`attention_kwargs` must be a dict"),
        ({"callback_on_step_end": "print"}, "`callback_on_step_end` must be callable"),
    ],
)
def test_bad_input_raises_clear_error(pipe, overrides, message):
    calls = []
    hook = pipe.text_encoder.model.register_forward_pre_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(ValueError, match=message) as refused:
            pipe(**{**BASE, **overrides})
    finally:
        hook.remove()
    assert not calls, "bad input must be refused before any model runs"
    assert "\n" not in str(refused.value), "one line"


def test_too_many_references(pipe):
    refs = [MiniMaxH3ImageReference(image=_image()) for _ in range(10)]
    with pytest.raises(ValueError, match="at most 9 image references"):
        pipe(**BASE, references=refs)


def test_audio_only_references(pipe):
    refs = [MiniMaxH3AudioReference(audio=torch.zeros(1, 3200), sample_rate=32000)]
    with pytest.raises(ValueError, match="cannot be used on their own"):
        pipe(**BASE, references=refs)


def test_reference_of_wrong_type(pipe):
    with pytest.raises(ValueError, match=r"references\[0\]"):
        pipe(**BASE, references=["subject.png"])


def test_references_and_keyframes_together(pipe):
    with pytest.raises(ValueError, match="cannot be combined"):
        pipe(**BASE, image=_image(), references=[MiniMaxH3ImageReference(image=_image())])


def test_wrong_noise_shape(pipe):
    with pytest.raises(ValueError, match="pass noise shaped like"):
        pipe(**BASE, latents=torch.randn(1, 4, 2, 2, 2))


# ---------------------------------------------------------------------------------------------------------------
# Text encoder: same hidden state as the full model, but later layers and the LM head never run.
# ---------------------------------------------------------------------------------------------------------------


def test_text_encoder_early_exit_matches_full_model_and_skips_later_layers(pipe):
    token_ids = pipe.tokenizer("the quick brown fox", add_special_tokens=False)["input_ids"]
    layers = pipe._language_layers()
    calls = []
    handles = [layer.register_forward_hook(lambda m, a, o, i=i: calls.append(i)) for i, layer in enumerate(layers)]
    head_calls = []
    handles.append(pipe.text_encoder.lm_head.register_forward_hook(lambda *a: head_calls.append(1)))
    try:
        ours = pipe.encode_presentation(token_ids)
    finally:
        for handle in handles:
            handle.remove()
    assert calls == list(range(50)), "decoder layers after the one H3 reads must not run"
    assert not head_calls

    input_ids = torch.tensor([token_ids])
    full = pipe.text_encoder.model(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        mm_token_type_ids=torch.zeros_like(input_ids),
        use_cache=False,
        output_hidden_states=True,
    )
    assert torch.equal(ours, full.hidden_states[50])
    assert not torch.equal(ours, full.hidden_states[51])


def test_configurable_text_encoder_layer():
    small = tiny_pipeline(seed=0, text_encoder_layers=3)
    assert small.config.text_encoder_layer == 2
    out = small(**BASE, output_type="latent")
    assert torch.isfinite(out.frames).all()
    small.register_to_config(text_encoder_layer=3)
    with pytest.raises(ValueError, match="more than 3 decoder layers"):
        small(**BASE)


# ---------------------------------------------------------------------------------------------------------------
# Layout side channel, callbacks, interrupt, output types, schedules.
# ---------------------------------------------------------------------------------------------------------------


def test_layout_is_published_during_transformer_calls(pipe):
    seen = []
    hook = pipe.transformer.register_forward_pre_hook(lambda module, args: seen.append(current_packed_layout()))
    try:
        pipe(**BASE, image=_image(), output_type="latent")
    finally:
        hook.remove()
    assert current_packed_layout() is None
    assert [layout.step_index for layout in seen] == [0]
    layout = seen[0]
    kinds = [(s.kind, s.role) for s in layout.segments]
    assert kinds == [("text", "prompt"), ("video", "keyframe"), ("audio", "target"), ("video", "target")]
    target = layout.select("video", "target")[0]
    assert target.grid == (7, 1, 1)  # 22 = 17*1+5 frames -> 5*1+2 latent frames; 32x32 px -> 1x1 patches
    assert layout.select("audio", "target")[0].length == 2 * 37


def test_callback_can_read_and_replace_tensors_and_interrupt(pipe):
    steps = []

    def callback(p, i, t, tensors):
        steps.append((i, float(t), tuple(tensors)))
        p._interrupt = True  # stop after the first step
        return {"audio_latents": torch.zeros_like(tensors["audio_latents"])}

    out = pipe(
        **{**BASE, "num_inference_steps": 4},
        output_type="latent",
        callback_on_step_end=callback,
        callback_on_step_end_tensor_inputs=["latents", "audio_latents"],
    )
    assert len(steps) == 1 and steps[0][2] == ("latents", "audio_latents")
    assert torch.count_nonzero(out.audio) == 0


@pytest.mark.parametrize("output_type", ["np", "pt", "pil", "latent"])
def test_output_types(pipe, output_type):
    out = pipe(**BASE, output_type=output_type, generator=torch.Generator().manual_seed(0))
    if output_type == "np":
        assert out.frames.shape == (1, 22, 32, 32, 3) and isinstance(out.audio, np.ndarray)
        assert out.audio.shape == (1, 2, 37 * 800)
    elif output_type == "pt":
        assert out.frames.shape == (1, 22, 3, 32, 32) and out.audio.shape == (1, 2, 37 * 800)
    elif output_type == "pil":
        assert len(out.frames) == 1 and len(out.frames[0]) == 22 and isinstance(out.frames[0][0], Image.Image)
    else:
        assert out.frames.shape == (1, 4, 7, 2, 2) and out.audio.shape == (2, 8, 37)
    assert out.sampling_rate == 32000


def test_latents_round_trip_and_generator_reproducible(pipe):
    first = pipe(**BASE, output_type="latent", generator=torch.Generator().manual_seed(5))
    again = pipe(**BASE, output_type="latent", generator=torch.Generator().manual_seed(5))
    other = pipe(**BASE, output_type="latent", generator=torch.Generator().manual_seed(6))
    assert torch.equal(first.frames, again.frames) and torch.equal(first.audio, again.audio)
    assert not torch.equal(first.frames, other.frames)


def test_flow_shift_applies_per_call_and_does_not_leak(pipe):
    call = {**BASE, "num_inference_steps": 4, "output_type": "latent"}
    pipe(**call, flow_shift=6.0, audio_flow_shift=2.0)
    shifted, audio_shifted = pipe.scheduler.sigmas.clone(), pipe.audio_scheduler.sigmas.clone()
    pipe(**call)
    default, audio_default = pipe.scheduler.sigmas.clone(), pipe.audio_scheduler.sigmas.clone()
    assert not torch.equal(shifted, default) and not torch.equal(audio_shifted, audio_default)
    pipe.scheduler.set_shift(12.0)
    pipe.scheduler.set_timesteps(4)
    assert torch.equal(default, pipe.scheduler.sigmas)
    pipe.scheduler.set_shift(6.0)
    pipe.scheduler.set_timesteps(4)
    assert torch.equal(shifted, pipe.scheduler.sigmas)


def test_explicit_sigmas_are_used_verbatim(pipe):
    sigmas = [1.0, 0.7, 0.2, 0.0]
    pipe(**BASE, output_type="latent", sigmas=sigmas, audio_sigmas=[1.0, 0.5, 0.25, 0.0])
    assert torch.allclose(pipe.scheduler.sigmas, torch.tensor(sigmas))
    assert pipe.num_timesteps == 3


def test_model_cpu_offload_hooks_give_identical_output():
    """Offload hooks (accelerate) on every component, with the CPU as execution device so this runs in CI: the
    text-encoder hook is fired by hand (we call `text_encoder.model`), and the output is unchanged."""
    plain = tiny_pipeline(seed=8)
    expected = plain(**BASE, output_type="latent", generator=torch.Generator().manual_seed(1))
    offloaded = tiny_pipeline(seed=8)
    offloaded.enable_model_cpu_offload(device="cpu")
    assert hasattr(offloaded.text_encoder, "_hf_hook")
    fired = []
    original = offloaded.text_encoder._hf_hook.pre_forward
    offloaded.text_encoder._hf_hook.pre_forward = lambda module, *a, **k: (fired.append(1), original(module, *a, **k))[1]
    out = offloaded(**BASE, output_type="latent", generator=torch.Generator().manual_seed(1))
    assert fired, "the text encoder's offload hook must be fired before encoding"
    assert torch.equal(out.frames, expected.frames) and torch.equal(out.audio, expected.audio)
