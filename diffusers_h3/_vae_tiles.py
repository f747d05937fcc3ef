"""How diffusers' `AutoencoderKLMiniMaxH3._decode` splits latents into temporal chunks and spatial tiles.

The batched-tile decode (`hooks/fast_vae_decode.py`) and the parallel decode (`parallel/vae.py`) both decode the tiles
diffusers would decode one by one in their own way, then let diffusers' `_stitch_tiles` and `_decode` blend them
(:func:`decode_from_tiles`); this is the one copy of that split. It mirrors diffusers 0.42.1 (`_decode` and
`_decode_clip`); the tests compare both decodes with diffusers' serial one.
"""

from __future__ import annotations

from typing import Callable, List, Tuple

import torch


def chunk_inputs(vae, z: torch.Tensor) -> List[torch.Tensor]:
    """The latent slices diffusers' `_decode` hands to `_decode_clip`, in call order (same end padding)."""
    tokens_chunk_size = vae.tokens_chunk_size
    token_drop = vae.config.token_drop
    num_tokens = z.shape[2] + token_drop
    pad_tokens = (-num_tokens) % tokens_chunk_size
    num_chunks = (num_tokens + pad_tokens) // tokens_chunk_size - int(token_drop > 0)
    if pad_tokens > 0:
        z = torch.cat([z, z[:, :, -1:].repeat(1, 1, pad_tokens, 1, 1)], dim=2)
    return [
        z[:, :, i * tokens_chunk_size : i * tokens_chunk_size + tokens_chunk_size + vae.token_overlap]
        for i in range(num_chunks)
    ]


def tile_layout(vae, clip: torch.Tensor) -> Tuple[List[List[torch.Tensor]], List[int], List[int]]:
    """The latent tiles of one chunk (rows of columns) and the pixel overlaps, laid out as diffusers' `_decode_clip`."""
    if not vae.use_tiling:
        return [[clip]], [], []
    ratio = vae.spatial_compression_ratio
    y_indices, y_lengths, y_overlaps = vae._split_tiles(
        clip.shape[-2] * ratio, vae.tile_sample_min_height, vae.tile_sample_min_overlap_height
    )
    x_indices, x_lengths, x_overlaps = vae._split_tiles(
        clip.shape[-1] * ratio, vae.tile_sample_min_width, vae.tile_sample_min_overlap_width
    )
    rows = [
        [
            clip[..., i // ratio : i // ratio + h // ratio, j // ratio : j // ratio + w // ratio]
            for j, w in zip(x_indices, x_lengths)
        ]
        for i, h in zip(y_indices, y_lengths)
    ]
    return rows, y_overlaps, x_overlaps


def decode_from_tiles(
    vae,
    z: torch.Tensor,
    decode_tiles: Callable[[List[torch.Tensor]], List[torch.Tensor]],
    run_decode: Callable[[torch.Tensor], torch.Tensor],
    who: str,
) -> Tuple[torch.Tensor, int, int]:
    """diffusers' `_decode` of `z` (``run_decode``: temporal cross-fade, padding trim), its per-chunk
    `_decode_clip` answered from tiles that ``decode_tiles`` decodes all at once (list in, list out, same order) and
    diffusers' `_stitch_tiles` blends. Returns the video, the number of tiles and of chunks."""
    layouts = [tile_layout(vae, clip) for clip in chunk_inputs(vae, z)]
    tiles = [tile for rows, _, _ in layouts for row in rows for tile in row]
    decoded = iter(decode_tiles(tiles))
    stitched = []
    for rows, y_overlaps, x_overlaps in layouts:
        grid = [[next(decoded) for _ in row] for row in rows]
        stitched.append(vae._stitch_tiles(grid, y_overlaps, x_overlaps) if vae.use_tiling else grid[0][0])
    answers = iter(stitched)

    def decode_clip_from_tiles(clip: torch.Tensor) -> torch.Tensor:
        answer = next(answers, None)
        if answer is None:
            raise RuntimeError(f"{who}: diffusers' _decode asked for more chunks than laid out; please report.")
        return answer

    vae._decode_clip = decode_clip_from_tiles
    try:
        out = run_decode(z)
    finally:
        del vae._decode_clip
    if next(answers, None) is not None:
        raise RuntimeError(f"{who}: diffusers' _decode used fewer chunks than laid out; please report.")
    return out, len(tiles), len(layouts)
