"""From a :class:`PackedLayout` to the tile plan that the VSA kernels consume.

Every row of the packed sequence belongs to exactly one tile of at most ``block = prod(tile)`` rows:

* rows of ``video`` segments with role ``target`` are cut into ``tile``-shaped cubes of the ``(T, H, W)`` token grid,
  visited t-outer, then h, then w; inside a cube the rows keep their (t, h, w) row-major order. Edge cubes are partial;
* all other rows (text, keyframe and reference video, audio) are cut into segment-pure chunks of ``block`` rows; the
  last chunk of a segment is partial. These are the "prefix" (non-video) tiles.

Prefix tiles come first (in row order), then video tiles. A tile owns ``block`` *slots*; its valid rows fill the first
``tile_counts[t]`` slots and the rest are padding (``slot_rows`` points pads at the tile's first row; kernels mask them
with the count). The plan knows nothing about attention; the kernels know nothing about layouts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Tuple

import torch

from ..kernels.attention.vsa_pool import valid_slots
from ..layout import PackedLayout


@dataclass(frozen=True)
class TilePlan:
    """Tile geometry of one packed sequence (all tensors on ``device``).

    Attributes:
        block: rows per tile (the tile volume; also the kernels' block size).
        slot_rows: ``int32 [n_tiles * block]``: packed row of every slot (pads repeat the tile's first row).
        tile_counts: ``int32 [n_tiles]``: valid rows per tile (1..block).
        row_tile: ``int64 [seq_len]``: the tile of every packed row.
        num_prefix_tiles: tiles ``[0, num_prefix_tiles)`` are non-video; the rest are target-video tiles.
    """

    block: int
    seq_len: int
    slot_rows: torch.Tensor
    tile_counts: torch.Tensor
    row_tile: torch.Tensor
    num_prefix_tiles: int
    num_video_tiles: int

    @property
    def num_tiles(self) -> int:
        return self.num_prefix_tiles + self.num_video_tiles

    @property
    def padded_rows(self) -> int:
        return self.num_tiles * self.block

    @property
    def valid_slots(self) -> torch.Tensor:
        """``bool [padded_rows]``: which slots hold a row (the rest are tile padding)."""
        return valid_slots(self.tile_counts, self.block)

    def describe(self) -> str:
        return (
            f"TilePlan(block={self.block}, tiles={self.num_tiles} = {self.num_prefix_tiles} prefix + "
            f"{self.num_video_tiles} video, rows={self.seq_len}, slots={self.padded_rows})"
        )


def _video_tiles(start: int, grid: Tuple[int, int, int], tile: Tuple[int, int, int]) -> torch.Tensor:
    """``[n_tiles, block]`` packed rows of one target video segment, ``-1`` for missing rows, valid rows first."""
    t, h, w = grid
    tt, th, tw = tile
    nt, nh, nw = math.ceil(t / tt), math.ceil(h / th), math.ceil(w / tw)
    rows = torch.full((nt * tt, nh * th, nw * tw), -1, dtype=torch.int64)
    rows[:t, :h, :w] = torch.arange(t * h * w, dtype=torch.int64).view(t, h, w) + start
    rows = rows.view(nt, tt, nh, th, nw, tw).permute(0, 2, 4, 1, 3, 5).reshape(nt * nh * nw, tt * th * tw)
    # Stable sort by "is padding" keeps the (t, h, w) order of the valid rows and moves pads to the end.
    order = torch.sort((rows < 0).to(torch.int8), dim=1, stable=True).indices
    return torch.gather(rows, 1, order)


def _chunk_tiles(start: int, stop: int, block: int) -> torch.Tensor:
    n = math.ceil((stop - start) / block)
    rows = torch.arange(start, start + n * block, dtype=torch.int64).view(n, block)
    rows[rows >= stop] = -1
    return rows


def build_tile_plan(layout: PackedLayout, tile: Tuple[int, int, int] = (4, 4, 4), device=None) -> TilePlan:
    """The :class:`TilePlan` of ``layout`` with video cubes of shape ``tile`` and prefix chunks of ``prod(tile)``."""
    tile = tuple(int(x) for x in tile)
    if len(tile) != 3 or min(tile) < 1:
        raise ValueError(f"tile must be three positive ints (t, h, w), got {tile}")
    block = tile[0] * tile[1] * tile[2]
    if block < 16 or block & (block - 1):
        raise ValueError(
            f"the tile volume prod(tile) must be a power of two >= 16 (the kernels' block size), got {tile} = {block}; "
            "use tile=(4, 4, 4) as FastH3 does"
        )
    prefix, video = [], []
    for segment in layout.segments:
        if segment.kind == "video" and segment.role == "target":
            video.append(_video_tiles(segment.start, segment.grid, tile))
        else:
            prefix.append(_chunk_tiles(segment.start, segment.stop, block))
    prefix_rows = torch.cat(prefix) if prefix else torch.empty(0, block, dtype=torch.int64)
    video_rows = torch.cat(video) if video else torch.empty(0, block, dtype=torch.int64)
    rows = torch.cat([prefix_rows, video_rows])
    valid = rows >= 0
    counts = valid.sum(1)
    slot_rows = torch.where(valid, rows, rows[:, :1])
    row_tile = torch.empty(layout.seq_len, dtype=torch.int64)
    tile_ids = torch.arange(rows.shape[0]).unsqueeze(1).expand_as(rows)
    row_tile[rows[valid]] = tile_ids[valid]
    if int(counts.sum()) != layout.seq_len:  # pragma: no cover - guarded by PackedLayout's own checks
        raise RuntimeError(f"tile plan covers {int(counts.sum())} rows but the layout has {layout.seq_len}")
    return TilePlan(
        block=block,
        seq_len=layout.seq_len,
        slot_rows=slot_rows.reshape(-1).to(device=device, dtype=torch.int32),
        tile_counts=counts.to(device=device, dtype=torch.int32),
        row_tile=row_tile.to(device=device),
        num_prefix_tiles=prefix_rows.shape[0],
        num_video_tiles=video_rows.shape[0],
    )


class TilePlanCache:
    """Keeps the plan of the last few layouts per device (a layout is rebuilt per call but rarely changes)."""

    def __init__(self, max_entries: int = 4):
        self.max_entries = max_entries
        self._plans: Dict[tuple, TilePlan] = {}

    def get(self, layout: PackedLayout, tile: Tuple[int, int, int], device) -> TilePlan:
        key = (layout.segments, layout.seq_len, tuple(tile), str(device))
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= self.max_entries:
                self._plans.pop(next(iter(self._plans)))
            plan = self._plans[key] = build_tile_plan(layout, tile, device=device)
        return plan
