"""Decision of `enable_fast_vae_decode` that must not flip: `batch_tiles=1` is a valid int (one tile per decoder call,
the same as `batch_tiles=False`: useful with `compile=True`), not rejected as out of range."""

import pytest
import torch

from diffusers_h3 import FastVAEDecodeConfig, enable_fast_vae_decode
from diffusers_h3.hooks.fast_vae_decode import fast_vae_decode_state
from diffusers_h3.testing.tiny import tiny_vae


def _tiled_vae():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        vae = tiny_vae()
    vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_min_overlap_height=16,
                      tile_sample_min_overlap_width=16)  # fmt: skip
    return vae


def test_one_tile_per_batch_is_accepted_with_compile(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda module, **kwargs: module)  # the decision, not Inductor, is tested
    vae = _tiled_vae()
    latents = torch.randn((1, 4, 3, 2, 4), generator=torch.Generator().manual_seed(0))  # 3 tiles
    with torch.no_grad():
        native = vae.decode(latents).sample
    state = fast_vae_decode_state(enable_fast_vae_decode(vae, FastVAEDecodeConfig(batch_tiles=1, compile=True)))
    assert state.tiles_per_batch == 1
    sizes = []
    handle = vae.decoder.register_forward_pre_hook(lambda module, args: sizes.append(args[0].shape[0]))
    try:
        with torch.no_grad():
            fast = vae.decode(latents).sample
    finally:
        handle.remove()
    assert sizes == [1, 1, 1]
    torch.testing.assert_close(fast, native)


def test_one_tile_per_batch_without_compile_is_the_no_op_error_not_a_range_error():
    vae = _tiled_vae()
    for batch_tiles in (1, False):
        with pytest.raises(ValueError, match="would change nothing"):
            enable_fast_vae_decode(vae, FastVAEDecodeConfig(batch_tiles=batch_tiles, compile=False))
    with pytest.raises(ValueError, match="positive int"):
        enable_fast_vae_decode(vae, FastVAEDecodeConfig(batch_tiles=0, compile=True))
