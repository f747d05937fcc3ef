"""`parallel_vae_decode` on 2 and 4 gloo ranks equals the serial tiled decode of `AutoencoderKLMiniMaxH3`."""

import pytest
import torch

from diffusers_h3.testing.tiny import tiny_vae

from ._ranks import launch


# Two temporal chunks of 2x3 spatial tiles (12 tile decodes), batch 1 and batch 2 with slicing.
LATENT_SHAPES = [((1, 4, 9, 3, 4), False), ((2, 4, 6, 3, 4), True)]


def _vae(use_slicing):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        vae = tiny_vae()
    vae.enable_tiling(
        tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_min_overlap_height=16,
        tile_sample_min_overlap_width=16,
    )
    vae.use_slicing = use_slicing
    return vae


def _latents(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _rank_decode():
    import torch.distributed as dist

    from diffusers_h3.parallel.vae import parallel_vae_decode

    results = []
    for index, (shape, use_slicing) in enumerate(LATENT_SHAPES):
        vae = _vae(use_slicing)
        calls = []
        handle = vae.decoder.register_forward_pre_hook(lambda module, args: calls.append(1))
        out = parallel_vae_decode(vae, _latents(shape, index))
        handle.remove()
        with torch.no_grad():
            serial = vae.decode(_latents(shape, index)).sample if dist.get_rank() == 0 else None
        results.append({"out": out, "serial_same_process": serial, "decoder_calls": len(calls)})
    return results


def _tile_decodes(vae, shape):
    from diffusers_h3._vae_tiles import chunk_inputs, tile_layout

    per_item = sum(sum(len(row) for row in tile_layout(vae, c)[0]) for c in chunk_inputs(vae, torch.zeros(1, *shape[1:])))
    return per_item * shape[0]


@pytest.mark.parametrize("world_size", [2, 4])
def test_parallel_vae_decode_matches_serial(world_size):
    rank_results = launch(_rank_decode, world_size, timeout_s=300)
    for index, (shape, use_slicing) in enumerate(LATENT_SHAPES):
        vae = _vae(use_slicing)
        with torch.no_grad():
            expected = vae.decode(_latents(shape, index)).sample
        # Bitwise against the serial decode in the same process (same threads), <= 1e-6 rel-L2 against this one.
        first = rank_results[0][index]
        assert torch.equal(first["out"], first["serial_same_process"])
        for results in rank_results:
            out = results[index]["out"]
            assert out.shape == expected.shape
            assert ((out - expected).norm() / expected.norm()).item() <= 1e-6
        # Each rank decoded only its share of the tiles.
        total = _tile_decodes(vae, shape)
        per_item = total // shape[0]
        calls = [results[index]["decoder_calls"] for results in rank_results]
        expected_calls = [
            shape[0] * len(range(rank, per_item, world_size)) if use_slicing else len(range(rank, total, world_size))
            for rank in range(world_size)
        ]
        assert calls == expected_calls, (calls, expected_calls)
