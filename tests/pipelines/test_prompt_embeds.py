"""`prompt_embeds` / `text_token_tags` as `__call__` inputs and `encode_prompt` on its own: encode once and generate
many times, or encode with one pipeline and generate with another loaded without its text encoder. Oracle: the same
call with `prompt` (CPU, fp32, bitwise)."""

import numpy as np
import pytest
import torch
from PIL import Image

from diffusers_h3 import MiniMaxH3Pipeline
from diffusers_h3.testing.tiny import TINY_DURATION_LIMITS, TINY_NUM_FRAMES, tiny_components


RUN = {"height": 32, "width": 32, "num_frames": TINY_NUM_FRAMES, "num_inference_steps": 2, "output_type": "latent"}
NO_TEXT_ENCODER = {"text_encoder": None, "tokenizer": None, "processor": None}


@pytest.fixture(scope="module")
def components():
    # A short text encoder (H3 reads hidden state 2 of 3 here) keeps the many prompt encodes of this module cheap.
    return tiny_components(seed=11, text_encoder_layers=3, with_transformer_ref=False)


@pytest.fixture(scope="module")
def pipe(components):
    return MiniMaxH3Pipeline(**components, text_encoder_layer=2, **TINY_DURATION_LIMITS)


def _keyframe(seed, w=40, h=36):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _generate(pipe, seed=0, **kwargs):
    return pipe(**{**RUN, **kwargs}, generator=torch.Generator().manual_seed(seed))


def _assert_bitwise(a, b):
    assert torch.equal(a.frames, b.frames) and torch.equal(a.audio, b.audio)
    assert a.frames.std() > 0 and a.audio.std() > 0  # not a vacuous comparison


@pytest.mark.parametrize(
    "conditioning",
    [{}, {"image": _keyframe(1)}],
    ids=["t2va", "fl2va"],
)
def test_prompt_embeds_give_the_outputs_of_the_prompt(pipe, conditioning):
    prompt = "a red fox runs through snow"
    embeds, tags = pipe.encode_prompt(prompt, **conditioning, height=RUN["height"], width=RUN["width"])
    assert embeds.shape == (1, tags.shape[0], pipe.text_encoder.config.text_config.hidden_size)
    assert bool(conditioning) == bool((tags == 0).any())  # vision rows (tag 0) only with keyframes
    from_prompt = _generate(pipe, prompt=prompt, **conditioning)
    from_embeds = _generate(pipe, prompt_embeds=embeds, text_token_tags=tags, **conditioning)
    _assert_bitwise(from_embeds, from_prompt)
    if not conditioning:  # encode once, generate many times: the embeddings are not consumed
        _assert_bitwise(_generate(pipe, prompt_embeds=embeds, text_token_tags=tags), from_prompt)


def test_stacked_prompt_embeds_run_one_request_per_row(pipe):
    prompts = ["a fox in snow", "a cat on snow"]  # the same number of (byte) tokens, so the embeddings stack
    encoded = [pipe.encode_prompt(p) for p in prompts]
    embeds = torch.cat([e for e, _ in encoded])
    from_embeds = pipe(prompt_embeds=embeds, text_token_tags=encoded[0][1], **RUN,
                       generator=[torch.Generator().manual_seed(s) for s in (3, 3)])  # fmt: skip
    from_prompts = pipe(prompt=prompts, **RUN, generator=[torch.Generator().manual_seed(s) for s in (3, 3)])
    assert from_embeds.frames.shape[0] == 2 and from_embeds.audio.shape[0] == 4  # a left/right pair per clip
    _assert_bitwise(from_embeds, from_prompts)
    assert not torch.equal(from_embeds.frames[0], from_embeds.frames[1])  # same noise: row 1 is the second prompt


def test_pipeline_loaded_without_text_encoder_generates_from_embeds(pipe, components, tmp_path):
    # Encode with a pipeline that holds only the text side (no DiT) ...
    encoder_only = MiniMaxH3Pipeline(**{**components, "transformer": None}, text_encoder_layer=2, **TINY_DURATION_LIMITS)
    embeds, tags = encoder_only.encode_prompt("rain on a window")
    # ... and generate with one loaded without its text encoder, as diffusers pipelines allow.
    pipe.save_pretrained(tmp_path)
    generator_only = MiniMaxH3Pipeline.from_pretrained(tmp_path, **NO_TEXT_ENCODER)
    assert generator_only.text_encoder is None and generator_only.processor is None
    out = _generate(generator_only, prompt_embeds=embeds, text_token_tags=tags)
    expected = _generate(pipe, prompt_embeds=embeds, text_token_tags=tags)  # bitwise the prompt's output (above)
    # Same weights; CPU GEMMs may round differently for differently aligned (mmapped) buffers.
    assert torch.allclose(out.frames, expected.frames, atol=1e-5, rtol=0)
    assert torch.allclose(out.audio, expected.audio, atol=1e-5, rtol=0)

    with pytest.raises(ValueError, match="loaded without `text_encoder`, `tokenizer`, `processor`.*pass `prompt_embeds`"):
        _generate(generator_only, prompt="rain on a window")
    with pytest.raises(ValueError, match="cannot encode a prompt"):
        generator_only.encode_prompt("rain on a window")


def _embeds(pipe, num_tokens=5, tag=1):
    width = pipe.transformer.config.text_dim
    return torch.zeros(1, num_tokens, width), torch.full((num_tokens,), tag, dtype=torch.long)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda e, t: {"prompt": "a cat", "prompt_embeds": e, "text_token_tags": t}, "either `prompt` or `prompt_embeds`"),
        (lambda e, t: {"prompt": None, "prompt_embeds": e}, "needs its `text_token_tags`.*shape \\(5,\\)"),
        (lambda e, t: {"prompt": None, "prompt_embeds": e, "text_token_tags": t[:4]}, "shape \\(5,\\).*got \\(4,\\)"),
        (lambda e, t: {"prompt": None, "prompt_embeds": e, "text_token_tags": t.float()}, "an integer tensor"),
        (lambda e, t: {"prompt": None, "prompt_embeds": e, "text_token_tags": t + 1}, "holds \\[2\\]"),
        (lambda e, t: {"prompt": None, "prompt_embeds": e[0], "text_token_tags": t}, "\\(batch, num_tokens, text_dim\\)"),
        (lambda e, t: {"prompt": None, "prompt_embeds": e[..., :3], "text_token_tags": t}, "width 3 but"),
        (lambda e, t: {"prompt": "a cat", "text_token_tags": t}, "belongs to `prompt_embeds`"),
        (lambda e, t: {"prompt": None}, "`prompt` must be a string.*or `prompt_embeds`"),
        (
            lambda e, t: {"prompt": None, "prompt_embeds": e, "text_token_tags": t, "image": _keyframe(1)},
            "encoded for t2va \\(no conditioning\\) but this request is fl2va",
        ),
        (
            lambda e, t: {"prompt": None, "prompt_embeds": e, "text_token_tags": torch.tensor([1, 0, 0, 0, 1])},
            "encoded for a conditioned task .* but this request is t2va",
        ),
    ],
)
def test_bad_prompt_embeds_are_refused_before_any_model_runs(pipe, make, message):
    embeds, tags = _embeds(pipe)
    calls = []
    hooks = [m.register_forward_pre_hook(lambda *a: calls.append(1)) for m in (pipe.text_encoder.model, pipe.transformer)]
    try:
        with pytest.raises(ValueError, match=message):
            pipe(**{**RUN, **make(embeds, tags)})
    finally:
        for hook in hooks:
            hook.remove()
    assert not calls


def test_encode_prompt_checks_its_inputs(pipe):
    with pytest.raises(ValueError, match="encodes one prompt, got list"):
        pipe.encode_prompt(["a", "b"])
    with pytest.raises(ValueError, match="`prompt` is empty"):
        pipe.encode_prompt("  ")
    with pytest.raises(ValueError, match="multiples of 32"):
        pipe.encode_prompt("a cat", image=_keyframe(1), height=48, width=64)
    with pytest.raises(ValueError, match="PIL images"):
        pipe.encode_prompt("a cat", image=np.zeros((4, 4, 3)))


def test_a_pipeline_holding_only_the_text_encoder_encodes(pipe, components, tmp_path):
    """`from_pretrained(..., vae=None, audio_vae=None, transformer=None)` (the text side alone, as docs/pipeline.md
    loads it): `encode_prompt` gives the full pipeline's embeddings, also for fl2va (canvas and frame checks run on
    the released geometry instead of reading the absent VAE)."""
    pipe.save_pretrained(tmp_path)
    text_only = MiniMaxH3Pipeline.from_pretrained(tmp_path, vae=None, audio_vae=None, transformer=None)
    assert text_only.vae is None and text_only.transformer is None
    for conditioning in ({}, {"image": _keyframe(3), "height": 32, "width": 32, "num_frames": TINY_NUM_FRAMES}):
        embeds, tags = text_only.encode_prompt("rain on a window", **conditioning)
        expected_embeds, expected_tags = pipe.encode_prompt("rain on a window", **conditioning)
        # Same weights; CPU GEMMs may round differently for differently aligned (mmapped) buffers.
        assert torch.allclose(embeds, expected_embeds, atol=1e-5, rtol=0) and torch.equal(tags, expected_tags)
