"""Parallel decode of the MiniMax-H3 video VAE: its tiles are split over the ranks, gathered, and stitched serially.

`AutoencoderKLMiniMaxH3` decodes in temporal chunks (`tokens_chunk_size + token_overlap` latent frames each) and, with
tiling on (the released default), each chunk in overlapping spatial tiles (28 at 768x1344). Every (chunk, tile)
decode is independent; only the blending is not. Here each rank decodes every W-th tile, the decoded tiles are
broadcast to all ranks, diffusers' `_stitch_tiles` blends each chunk's tiles and `_decode`'s own loop
(`_vae_tiles.iter_decoded_chunks`) cross-fades the chunks and trims the tail, so the result equals the serial tiled
decode.
"""

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .._vae_tiles import decode_from_tiles


def _decode_units_in_parallel(vae, units: List[torch.Tensor], group) -> List[torch.Tensor]:
    """Decode `units[k]` on rank `k % W`, then broadcast every decoded unit to all ranks."""
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    mine: Dict[int, torch.Tensor] = {}
    for k in range(rank, len(units), world_size):
        mine[k] = vae.decoder(vae.post_quant_conv(units[k])).contiguous()
    # Decoded shapes are exchanged first so that receivers can allocate (every rank holds one small list).
    shapes: List[Optional[Dict[int, Tuple[torch.Size, torch.dtype]]]] = [None] * world_size
    dist.all_gather_object(shapes, {k: (tuple(t.shape), t.dtype) for k, t in mine.items()}, group=group)
    decoded = []
    for k in range(len(units)):
        owner = k % world_size
        if owner == rank:
            tensor = mine[k]
        else:
            shape, dtype = shapes[owner][k]
            tensor = torch.empty(shape, dtype=dtype, device=units[k].device)
        dist.broadcast(tensor, group_src=owner, group=group)
        decoded.append(tensor)
    return decoded


def _parallel_decode_one(vae, z: torch.Tensor, group) -> torch.Tensor:
    # `_decode`'s loop (temporal cross-fade, padding trim) over chunks stitched from the tiles decoded over the ranks.
    out, _, _ = decode_from_tiles(vae, z, lambda tiles: _decode_units_in_parallel(vae, tiles, group))
    return out


@torch.no_grad()
def parallel_vae_decode(vae, latents: torch.Tensor, group=None) -> torch.Tensor:
    """Decode `latents` `(B, C, T, H, W)` with `AutoencoderKLMiniMaxH3`, its tiles split over the ranks of `group`.

    Call it in every rank with the same latents; every rank returns the full decoded video, equal to
    `vae.decode(latents).sample` (same tiles, same blending). Without an initialized process group, or with one
    rank, it is `vae.decode`.
    """
    from diffusers import AutoencoderKLMiniMaxH3

    if not isinstance(vae, AutoencoderKLMiniMaxH3):
        raise TypeError(f"parallel_vae_decode expects AutoencoderKLMiniMaxH3, got {type(vae).__name__}.")
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return vae.decode(latents).sample
    latents = latents.to(next(vae.post_quant_conv.parameters()).dtype)
    if vae.use_slicing and latents.shape[0] > 1:
        return torch.cat([_parallel_decode_one(vae, z, group) for z in latents.split(1)])
    return _parallel_decode_one(vae, latents, group)
