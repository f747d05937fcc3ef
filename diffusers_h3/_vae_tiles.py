"""How diffusers' `AutoencoderKLMiniMaxH3._decode` splits latents into temporal chunks and spatial tiles.

The batched-tile decode (`hooks/fast_vae_decode.py`) and the parallel decode (`parallel/vae.py`) both decode the tiles
diffusers would decode one by one in their own way, then let diffusers' `_stitch_tiles` blend them and `_decode`'s
loop (:func:`iter_decoded_chunks`) cross-fade the chunks (:func:`decode_from_tiles`); this is the one copy of that
split, and nothing on the VAE is replaced for it. It mirrors diffusers 0.42.1 (`_decode` and `_decode_clip`); the
tests compare both decodes with diffusers' serial one.
"""

from __future__ import annotations

from typing import Callable, Iterator, List, Tuple

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
    vae, z: torch.Tensor, decode_tiles: Callable[[List[torch.Tensor]], List[torch.Tensor]]
) -> Tuple[torch.Tensor, int, int]:
    """diffusers' `_decode` of `z` (:func:`iter_decoded_chunks`: its chunks, temporal cross-fade and tail trim) with
    the tiles of every chunk decoded by ``decode_tiles`` all at once (list in, list out, same order) and blended by
    diffusers' `_stitch_tiles`. Returns the video, the number of tiles and of chunks."""
    layouts = [tile_layout(vae, clip) for clip in chunk_inputs(vae, z)]
    tiles = [tile for rows, _, _ in layouts for row in rows for tile in row]
    decoded = iter(decode_tiles(tiles))
    stitched = []
    for rows, y_overlaps, x_overlaps in layouts:
        grid = [[next(decoded) for _ in row] for row in rows]
        stitched.append(vae._stitch_tiles(grid, y_overlaps, x_overlaps) if vae.use_tiling else grid[0][0])
    answers = iter(stitched)  # `iter_decoded_chunks` asks for the chunks in the order `chunk_inputs` lays them out
    out = torch.cat(list(iter_decoded_chunks(vae, z, lambda clip: next(answers))), dim=2)
    return out, len(tiles), len(layouts)


def trimmed_tail_frames(vae, num_latent_frames: int) -> int:
    """How many decoded frames diffusers' `_decode` cuts off the end of `num_latent_frames` latents: the frames of
    the latent frames it repeated to fill the last chunk."""
    tokens_chunk_size = vae.tokens_chunk_size
    temporal_ratio = vae.temporal_compression_ratio
    pad_tokens = (-(num_latent_frames + vae.config.token_drop)) % tokens_chunk_size
    intra_tail = vae.config.clip_length % temporal_ratio
    return sum(
        intra_tail if intra_tail and (num_latent_frames + k) % tokens_chunk_size == 0 else temporal_ratio
        for k in range(pad_tokens)
    )


def iter_decoded_chunks(
    vae, z: torch.Tensor, decode_clip: Callable[[torch.Tensor], torch.Tensor]
) -> Iterator[torch.Tensor]:
    """diffusers' `_decode` of `z` `(1, C, T, h, w)`, one temporal chunk at a time: yields `(1, 3, f, H, W)` pieces of
    the decoded video, in order, as soon as they are final; concatenated along the frames they are `_decode(z)`.

    It is `_decode`'s own loop (same latent slices through ``decode_clip``, the per-chunk decode, same cross-fade by
    `vae._blend`, same tail trim), rearranged to hand over each chunk once the next one no longer changes it: the
    first `frame_overlap` frames of a chunk are cross-faded with the previous chunk's overflow, its overflow waits for
    the next chunk, and the frames the end padding produced are never yielded. Every value is computed by the same
    operations on the same inputs as in `_decode`, so the pieces are bitwise those of the whole-clip decode
    (tests/test_vae_tiles.py).
    """
    chunk_num_frames = vae.tokens_chunk_size * vae.temporal_compression_ratio
    has_overflow = vae.config.token_drop > 0
    drop_at_end = trimmed_tail_frames(vae, z.shape[2])
    held: List[torch.Tensor] = []  # decoded frames that may still be trimmed off the end

    def release(pieces: List[torch.Tensor]) -> Iterator[torch.Tensor]:
        held.extend(pieces)
        ready = sum(piece.shape[2] for piece in held) - drop_at_end
        out = []
        while held and ready > 0:
            piece = held.pop(0)
            if piece.shape[2] > ready:  # its tail may be trimmed: keep it back
                held.insert(0, piece[:, :, ready:])
                piece = piece[:, :, :ready]
            ready -= piece.shape[2]
            out.append(piece)
        if out:
            yield out[0] if len(out) == 1 else torch.cat(out, dim=2)

    overlap = None
    clips = chunk_inputs(vae, z)
    for index, clip_latents in enumerate(clips):
        clip = decode_clip(clip_latents)
        chunk = clip[:, :, :chunk_num_frames][:, :, vae.frame_pre_padding :]
        if overlap is not None:
            chunk = vae._blend(overlap, chunk, vae.frame_overlap, dim=-3)
        if has_overflow:
            overlap = clip[:, :, chunk_num_frames : 2 * chunk_num_frames][:, :, vae.frame_pre_padding :]
        last = index == len(clips) - 1
        # The last chunk's overflow ends the video: handed over with it.
        yield from release([chunk, overlap] if last and overlap is not None else [chunk])
