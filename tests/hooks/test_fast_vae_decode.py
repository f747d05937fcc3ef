"""Batched-tile decode of the MiniMax-H3 video VAE equals diffusers' tile-by-tile decode, with fewer decoder calls."""

from __future__ import annotations

import pytest
import torch

import diffusers_h3
from diffusers_h3 import FastVAEDecodeConfig, disable_fast_vae_decode, enable_fast_vae_decode, vae_decode
from diffusers_h3.hooks.fast_vae_decode import DEFAULT_TILES_PER_BATCH, describe_vae_decode, fast_vae_decode_state
from diffusers_h3.testing.tiny import tiny_vae


def _random_vae(seed=0):
    """The tiny VAE with every decoder weight random (the released init zeroes the residual scales, which would make
    the decoder blocks identities) and tiles small enough that a few latents already tile: 4x4-latent tiles, 2-latent
    overlaps."""
    torch.manual_seed(seed)
    vae = tiny_vae()
    with torch.no_grad():
        for param in vae.decoder.parameters():
            param.normal_(0.0, 0.3)
    vae.enable_tiling(64, 64, 32, 32)
    return vae


def _latents(shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


class _CallCounter:
    def __init__(self, module):
        self.calls, self.batch_sizes = 0, []
        self.handle = module.register_forward_pre_hook(self)

    def __call__(self, module, args):
        self.calls += 1
        self.batch_sizes.append(args[0].shape[0])


def _decode(vae, z):
    counter = _CallCounter(vae.decoder)
    try:
        out = vae_decode(vae, z)
    finally:
        counter.handle.remove()
    assert torch.isfinite(out).all()
    return out, counter


@pytest.mark.parametrize("batch_tiles, expected_calls", [(True, 1), (3, 6), (5, 4)])
def test_batched_tiles_equal_the_native_tiled_decode(batch_tiles, expected_calls):
    vae = _random_vae()
    # 9 latent frames (padded to 2 temporal chunks, the tail trimmed) of 6x9 latents: 2x4 tiles per chunk, one pair of
    # tiles overlapping wider than the rest.
    z = _latents((1, 4, 9, 6, 9))
    native, native_calls = _decode(vae, z)
    assert native_calls.calls == 16 and set(native_calls.batch_sizes) == {1}

    enable_fast_vae_decode(vae, FastVAEDecodeConfig(batch_tiles=batch_tiles))
    fast, fast_calls = _decode(vae, z)
    assert fast.shape == native.shape == (1, 3, 30, 96, 144)
    assert _rel_l2(fast, native) <= 1e-6
    assert fast_calls.calls == expected_calls
    assert sum(fast_calls.batch_sizes) == 16 and max(fast_calls.batch_sizes) - min(fast_calls.batch_sizes) <= 1
    report = describe_vae_decode(vae)
    assert "batched tiles" in report and f"16 tiles in {expected_calls} decoder calls (2 chunks)" in report


def test_untiled_chunks_and_several_videos_are_batched_too():
    vae = _random_vae(seed=2)
    vae.disable_tiling()
    z = _latents((2, 4, 12, 2, 3), seed=3)  # two videos, 12 latent frames = 2 chunks each, one decoder call per chunk
    native, native_calls = _decode(vae, z)
    enable_fast_vae_decode(vae)
    fast, fast_calls = _decode(vae, z)
    assert _rel_l2(fast, native) <= 1e-6
    assert native_calls.calls == 2 and fast_calls.calls == 1 and fast_calls.batch_sizes == [4]


def test_disable_restores_the_native_decode_and_report():
    vae = _random_vae(seed=4)
    z = _latents((1, 4, 7, 6, 5), seed=5)
    assert describe_vae_decode(vae).startswith("diffusers native tiled decode")
    state = fast_vae_decode_state(enable_fast_vae_decode(vae))
    assert state.tiles_per_batch == DEFAULT_TILES_PER_BATCH and "last decode: none yet" in describe_vae_decode(vae)
    _, fast_calls = _decode(vae, z)
    disable_fast_vae_decode(vae)
    disable_fast_vae_decode(vae)  # idempotent
    _, native_calls = _decode(vae, z)
    assert fast_calls.calls == 1 and native_calls.calls == 4
    assert describe_vae_decode(vae).startswith("diffusers native tiled decode")


def test_vae_decode_itself_stays_diffusers_own():
    """Nothing on the VAE is replaced: `vae.decode` decodes tile by tile while the fast decode is on, and
    `vae_decode` is `vae.decode` when it is off."""
    vae = _random_vae(seed=6)
    z = _latents((1, 4, 7, 2, 2), seed=7)
    native, native_calls = _decode(vae, z)
    enable_fast_vae_decode(vae)
    assert not {"decode", "_decode", "_decode_clip"} & set(vars(vae))
    counter = _CallCounter(vae.decoder)
    try:
        direct = vae.decode(z).sample
    finally:
        counter.handle.remove()
    assert torch.equal(direct, native) and counter.calls == native_calls.calls
    assert "last decode: none yet" in describe_vae_decode(vae)


def test_the_context_parallel_decode_is_reported_once_warned(h3_logs):
    """Under context parallelism the pipeline decodes with `parallel_vae_decode` (tiles split over the ranks): the
    fast decode stands aside, warns once and the report says so."""
    from diffusers_h3.hooks.fast_vae_decode import note_parallel_decode

    vae = _random_vae(seed=6)
    note_parallel_decode(vae)  # fast decode off: nothing to report
    assert describe_vae_decode(vae).startswith("diffusers native tiled decode")
    enable_fast_vae_decode(vae)
    with h3_logs.expect("context-parallel"):
        note_parallel_decode(vae)
    with h3_logs.expect_none():  # once
        note_parallel_decode(vae)
    assert "deferred to the context-parallel decode" in describe_vae_decode(vae)


def test_bad_options_raise_one_clear_error():
    vae = _random_vae()
    with pytest.raises(ValueError, match="positive int"):
        enable_fast_vae_decode(vae, FastVAEDecodeConfig(batch_tiles=0))
    with pytest.raises(ValueError, match="would change nothing"):
        enable_fast_vae_decode(vae, FastVAEDecodeConfig(batch_tiles=False))
    with pytest.raises(ValueError, match="`compile` must be True or False"):
        enable_fast_vae_decode(vae, FastVAEDecodeConfig(compile="yes"))
    with pytest.raises(TypeError, match="pass `pipe` or `pipe.vae`"):
        enable_fast_vae_decode(torch.nn.Linear(2, 2))
    assert "_decode" not in vae.__dict__


def test_pipeline_decode_uses_it_and_describe_reports_it():
    from diffusers_h3.testing.tiny import tiny_pipeline

    pipe = tiny_pipeline(seed=0, with_transformer_ref=False)
    with torch.no_grad():
        for param in pipe.vae.decoder.parameters():
            param.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(8))
    pipe.vae.enable_tiling(32, 32, 16, 16)
    latents = _latents((1, 4, 7, 3, 4), seed=9)
    # `_decode_video` is the pipeline's decode stage (denormalize latents, decode, back to [0, 1]).
    native = pipe._decode_video(latents, "pt", torch.device("cpu"))
    pipe.enable_fast_vae_decode(FastVAEDecodeConfig(batch_tiles=True))
    counter = _CallCounter(pipe.vae.decoder)
    fast = pipe._decode_video(latents, "pt", torch.device("cpu"))
    counter.handle.remove()
    assert counter.calls == 1 and counter.batch_sizes == [6]  # 2x3 tiles of one chunk, one decoder call
    assert _rel_l2(fast, native) <= 1e-6
    decode = diffusers_h3.describe(pipe)["components"]["vae"]["decode"]
    assert decode.startswith("batched tiles") and "6 tiles in 1 decoder calls" in decode


@pytest.mark.gpu
def test_compiled_batched_decode_on_gpu_matches_native():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    vae = _random_vae(seed=10).cuda()
    z = _latents((1, 4, 9, 6, 9), seed=11).cuda()
    native, _ = _decode(vae, z)
    state = fast_vae_decode_state(enable_fast_vae_decode(vae, FastVAEDecodeConfig(batch_tiles=8, compile=True)))
    fast, calls = _decode(vae, z)
    again, _ = _decode(vae, z)
    assert calls.calls == 2 and state.compile_seconds is not None and state.compile_seconds > 0
    # Inductor fuses and reorders reductions (and may pick other GEMM algorithms): the bound is the 1e-2.
    assert _rel_l2(fast, native) <= 1e-2 and torch.equal(fast, again)
    assert "torch.compile" in describe_vae_decode(vae) and "first compiled call" in describe_vae_decode(vae)


def test_fp8_decoder_linears_are_the_fp8_quantization_of_the_decoder():
    from diffusers_h3.quantizers import FP8Config, is_quantized_linear, quantize

    z = _latents((1, 4, 9, 6, 9))
    bf16_like, _ = _decode(_random_vae(), z)

    by_hand = _random_vae()  # the same quantization applied by hand, decoded by the batched path without the option
    quantize(by_hand.decoder, FP8Config(modules_to_not_convert=["proj_in"]))
    # already quantized: kept, not re-quantized
    enable_fast_vae_decode(by_hand, FastVAEDecodeConfig(batch_tiles=True, fp8_linears=True))
    expected, _ = _decode(by_hand, z)

    vae = _random_vae()
    state = fast_vae_decode_state(enable_fast_vae_decode(vae, FastVAEDecodeConfig(batch_tiles=True, fp8_linears=True)))
    got, counter = _decode(vae, z)
    assert counter.calls == 1 and state.fp8_linears
    kinds = {name: type(m).__name__ for name, m in vae.decoder.named_modules() if isinstance(m, torch.nn.Linear)}
    assert kinds["proj_in"] == "Linear" and all(is_quantized_linear(vae.decoder.get_submodule(n))
                                                for n in kinds if n != "proj_in")  # fmt: skip
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert 1e-4 < _rel_l2(got, bf16_like) < 0.2  # an approximation, and a small one
    assert "FP8 decoder linears" in describe_vae_decode(vae)

    disable_fast_vae_decode(vae)  # the tile batching goes; the FP8 linears stay, and the report says so
    assert "FP8 decoder linears" in describe_vae_decode(vae)
    with pytest.raises(ValueError, match="already quantized .* cannot be undone"):
        enable_fast_vae_decode(vae, FastVAEDecodeConfig(batch_tiles=True))
    with pytest.raises(ValueError, match="`fp8_linears` must be True or False"):
        enable_fast_vae_decode(_random_vae(), FastVAEDecodeConfig(fp8_linears="yes"))
