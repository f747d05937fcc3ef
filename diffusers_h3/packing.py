"""The packed-sequence layout of one H3 request, as a :class:`PackedLayout` for attention processors.

diffusers' modular blocks build the packed sequence as index tensors (`video_indices`, `audio_indices`,
`text_indices`); processors need to know *what* each run of rows is (text, keyframe, reference image / video /
audio, target audio, target video) and the token grid of every video run. This module derives that description
from the same request structure and checks it against the index tensors, so the two can never disagree silently.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from .layout import LayoutSegment, PackedLayout


def _grid(latent_frames: int, latent_height: int, latent_width: int, patch_size: Tuple[int, int, int]):
    patch_t, patch_h, patch_w = patch_size
    return (latent_frames // patch_t, latent_height // patch_h, latent_width // patch_w)


def _rows(grid) -> int:
    return grid[0] * grid[1] * grid[2]


def build_layout(
    num_text_tokens: int,
    condition_blocks: Sequence[Tuple[str, object]],
    target_audio_rows: int,
    target_video_grid: Tuple[int, int, int],
    audio_channels: int,
) -> PackedLayout:
    """Segments of ``[text | condition blocks in order | target audio | target video]``.

    ``condition_blocks`` lists ``("keyframe", grid)``, ``("reference_video", grid)`` or ``("reference_audio",
    num_rows)`` in packed order.
    """
    segments: List[LayoutSegment] = [LayoutSegment("text", "prompt", 0, num_text_tokens)]
    row = num_text_tokens
    for kind, value in condition_blocks:
        if kind == "reference_audio":
            segments.append(LayoutSegment("audio", "reference", row, row + value, channels=audio_channels))
            row += value
        else:
            role = "keyframe" if kind == "keyframe" else "reference"
            segments.append(LayoutSegment("video", role, row, row + _rows(value), grid=tuple(value)))
            row += _rows(value)
    segments.append(LayoutSegment("audio", "target", row, row + target_audio_rows, channels=audio_channels))
    row += target_audio_rows
    segments.append(LayoutSegment("video", "target", row, row + _rows(target_video_grid), grid=tuple(target_video_grid)))
    row += _rows(target_video_grid)
    return PackedLayout(tuple(segments), row)


def check_layout_matches_indices(
    layout: PackedLayout, video_indices: torch.Tensor, audio_indices: torch.Tensor, text_indices: torch.Tensor
) -> None:
    """Raise if the layout and the transformer's index tensors describe different rows."""

    def rows_of(kind: str) -> torch.Tensor:
        parts = [torch.arange(s.start, s.stop) for s in layout.segments if s.kind == kind]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    for kind, indices in (("video", video_indices), ("audio", audio_indices), ("text", text_indices)):
        expected = rows_of(kind)
        if not torch.equal(expected, indices.detach().cpu().to(torch.long)):
            raise RuntimeError(
                f"internal error: the PackedLayout's {kind} rows disagree with the transformer's {kind}_indices; "
                "please report this with the request that triggered it."
            )


def t2va_fl2va_layout(
    num_text_tokens: int,
    num_keyframes: int,
    num_latent_frames: int,
    latent_height: int,
    latent_width: int,
    num_audio_latents: int,
    patch_size: Tuple[int, int, int],
    audio_channels: int,
) -> PackedLayout:
    keyframe_grid = _grid(patch_size[0], latent_height, latent_width, patch_size)
    return build_layout(
        num_text_tokens,
        [("keyframe", keyframe_grid)] * num_keyframes,
        num_audio_latents * audio_channels,
        _grid(num_latent_frames, latent_height, latent_width, patch_size),
        audio_channels,
    )


def ref2va_layout(
    num_text_tokens: int,
    references: Sequence[object],
    condition_latents: Sequence[torch.Tensor],
    audio_condition_latents: Sequence[torch.Tensor],
    num_latent_frames: int,
    latent_height: int,
    latent_width: int,
    num_audio_latents: int,
    patch_size: Tuple[int, int, int],
    audio_channels: int,
) -> PackedLayout:
    """Reference blocks in request order; a video reference's soundtrack rows come right before its video rows."""
    visual = iter(condition_latents)
    audio = iter(audio_condition_latents)
    blocks: List[Tuple[str, object]] = []
    for reference in references:
        if reference.kind == "audio":
            blocks.append(("reference_audio", next(audio).shape[0]))
            continue
        if reference.kind == "video" and reference.has_audio:
            blocks.append(("reference_audio", next(audio).shape[0]))
        frames, height, width = next(visual).shape[2:5]
        blocks.append(("reference_video", _grid(frames, height, width, patch_size)))
    return build_layout(
        num_text_tokens,
        blocks,
        num_audio_latents * audio_channels,
        _grid(num_latent_frames, latent_height, latent_width, patch_size),
        audio_channels,
    )
