"""`parallel_vae_decode`'s tile split under non-square tiling options (`tile_sample_min_height != _width`), checked
in one process: the tiles it lays out, decoded one after another, must stitch to diffusers' serial tiled decode."""

import pytest
import torch

from diffusers_h3._vae_tiles import chunk_inputs, tile_layout
from diffusers_h3.parallel import vae as parallel_vae
from diffusers_h3.testing.tiny import tiny_vae


@pytest.mark.parametrize("tile_hw, overlap_hw", [((32, 48), (16, 16)), ((48, 32), (16, 8))])
def test_non_square_tiles_stitch_to_the_serial_decode(monkeypatch, tile_hw, overlap_hw):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        vae = tiny_vae()
    vae.enable_tiling(
        tile_sample_min_height=tile_hw[0], tile_sample_min_width=tile_hw[1],
        tile_sample_min_overlap_height=overlap_hw[0], tile_sample_min_overlap_width=overlap_hw[1],
    )  # fmt: skip
    latents = torch.randn(1, 4, 6, 5, 7, generator=torch.Generator().manual_seed(1))
    # the tiles of one rank group, decoded here one after another (no process group needed)
    monkeypatch.setattr(parallel_vae, "_decode_units_in_parallel",
                        lambda vae, units, group: [vae.decoder(vae.post_quant_conv(u)).contiguous() for u in units])
    rows, _, _ = tile_layout(vae, chunk_inputs(vae, latents)[0])
    assert len(rows) > 1 and len(rows[0]) > 1  # tiled in both axes
    with torch.no_grad():
        serial = vae.decode(latents).sample
        split = parallel_vae._parallel_decode_one(vae, latents, group=None)
    assert torch.equal(split, serial)
