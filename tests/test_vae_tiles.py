"""`iter_decoded_chunks` is diffusers' `_decode` handed over chunk by chunk: concatenated, its pieces are bitwise the
whole-clip decode (fp32, CPU, tiny VAE with random decoder weights and small tiles), for the pipeline's 5n+2 latent
frames and for lengths whose last chunk is padded and trimmed."""

import pytest
import torch

from diffusers_h3 import FastVAEDecodeConfig
from diffusers_h3._vae_tiles import decode_from_tiles, iter_decoded_chunks, trimmed_tail_frames
from diffusers_h3.hooks.fast_vae_decode import chunk_decoder, enable_fast_vae_decode, fast_vae_decode_state, vae_decode
from diffusers_h3.testing.tiny import tiny_vae


def _random_vae(tiled=True):
    torch.manual_seed(0)
    vae = tiny_vae()
    with torch.no_grad():
        for param in vae.decoder.parameters():  # the released init makes the decoder blocks identities
            param.normal_(0.0, 0.3)
    if tiled:
        vae.enable_tiling(64, 64, 32, 32)  # 4x4-latent tiles: 2x3 tiles per chunk below
    else:
        vae.disable_tiling()
    return vae


def _latents(num_latent_frames, seed=1):
    return torch.randn(1, 4, num_latent_frames, 6, 7, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tiled", [True, False], ids=["tiled", "untiled"])
@pytest.mark.parametrize("num_latent_frames", [3, 7, 8, 11, 13, 22])
def test_the_chunks_concatenate_to_the_whole_decode_bitwise(num_latent_frames, tiled):
    # 7 and 22 are the pipeline's 5n+2 (22 frames, 73 frames); the others pad the last chunk and trim its tail.
    vae = _random_vae(tiled)
    z = _latents(num_latent_frames)
    with torch.no_grad():
        whole = vae.decode(z).sample
        pieces = list(iter_decoded_chunks(vae, z, vae._decode_clip))
    assert torch.equal(torch.cat(pieces, dim=2), whole)
    # One piece per temporal chunk (the last chunk's overflow goes with it), in the chunks' own sizes.
    num_chunks = (num_latent_frames + vae.config.token_drop + vae.tokens_chunk_size - 1) // vae.tokens_chunk_size - 1
    assert len(pieces) == num_chunks
    clip_frames = vae.tokens_chunk_size * vae.temporal_compression_ratio - vae.frame_pre_padding
    assert all(piece.shape[2] == clip_frames for piece in pieces[1:-1])


@pytest.mark.parametrize("tiled", [True, False], ids=["tiled", "untiled"])
def test_decode_from_tiles_is_the_whole_decode_bitwise(tiled):
    # The batched and parallel decodes decode these tiles their own way; decoded one by one, it is `vae.decode`.
    vae = _random_vae(tiled)
    z = torch.cat([_latents(8), _latents(8, seed=2)])  # two videos, the last chunk padded and its tail trimmed
    with torch.no_grad():
        out, tiles, chunks = decode_from_tiles(vae, z, lambda units: [vae.decoder(vae.post_quant_conv(u)) for u in units])
        assert torch.equal(out, vae.decode(z).sample)
    assert (tiles, chunks) == ((12, 2) if tiled else (2, 2))


def test_a_chunk_is_handed_over_before_the_next_one_decodes():
    vae = _random_vae()
    decoded = []

    def decode_clip(clip):
        decoded.append(clip.shape[2])
        return vae._decode_clip(clip)

    stream = iter_decoded_chunks(vae, _latents(22), decode_clip)
    with torch.no_grad():
        first = next(stream)
        assert len(decoded) == 1 and first.shape[2] == 17  # only the first chunk decoded so far
        rest = list(stream)
    assert len(decoded) == len(rest) + 1 == 4


@pytest.mark.parametrize("num_latent_frames, trimmed", [(7, 0), (22, 0), (8, 13), (3, 13), (11, 4)])
def test_trimmed_tail_is_what_the_whole_decode_cuts(num_latent_frames, trimmed):
    vae = _random_vae(tiled=False)
    assert trimmed_tail_frames(vae, num_latent_frames) == trimmed
    with torch.no_grad():
        frames = vae.decode(_latents(num_latent_frames)).sample.shape[2]
    padded = -(-(num_latent_frames + vae.config.token_drop) // vae.tokens_chunk_size)  # chunks incl. the dropped one
    chunk_frames = vae.tokens_chunk_size * vae.temporal_compression_ratio - vae.frame_pre_padding
    untrimmed = (padded - 1) * chunk_frames + vae.frame_overlap
    assert frames == untrimmed - trimmed


def test_batched_chunk_decode_equals_the_batched_whole_decode():
    # With enable_fast_vae_decode the chunk decoder batches one chunk's tiles; fp32 on the CPU gives the whole-clip
    # fast decode's values to within GEMM summation order (the whole clip's batches span chunks here).
    vae = _random_vae()
    enable_fast_vae_decode(vae, FastVAEDecodeConfig(batch_tiles=True))
    z = _latents(13)
    with torch.no_grad():
        whole = vae_decode(vae, z)
        streamed = torch.cat(list(iter_decoded_chunks(vae, z, chunk_decoder(vae))), dim=2)
    assert streamed.shape == whole.shape
    assert ((streamed - whole).norm() / whole.norm()).item() < 1e-6
    last_run = fast_vae_decode_state(vae).last_run
    assert "decoded chunk by chunk" in last_run and "(3 chunks" in last_run
