"""Tile selection for video sparse attention: block mask from pooled scores, then compact per-query-tile lists.

* :func:`build_block_mask` (torch): tiles ``[0, num_prefix_tiles)`` are non-video. A non-video query tile selects
  every key tile; a video query tile selects every non-video key tile plus the ``topk`` video key tiles with the
  highest score (equal scores: the lower tile index wins).
* :func:`mask_to_index` (Triton kernel, torch reference :func:`mask_to_index_reference`): a boolean
  ``[B, H, Tq, Tk]`` mask becomes ``index [B, H, Tq, Tk]`` int32 whose first ``num[b, h, q]`` entries are the selected
  key tiles in ascending order (the rest are left unspecified), and ``num [B, H, Tq]`` int32.
* :func:`select_tiles` (Triton kernel): both in one pass over the scores, the path the VSA processor runs; its
  reference is ``mask_to_index_reference(build_block_mask(...))``. The top-k is a 32-step bisection on the scores'
  order-preserving integer keys (no sort, which costs more than the bisection at H3's tile counts).
"""

from __future__ import annotations

import math
from typing import Tuple

import torch

from .._triton_utils import HAS_TRITON, use_triton


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _mask_to_index_kernel(MASK, INDEX, NUM, TK, BLOCK_K: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_K)
        in_range = offs < TK
        m = tl.load(MASK + row * TK + offs, mask=in_range, other=0).to(tl.int32)
        position = tl.cumsum(m, axis=0) - 1
        tl.store(INDEX + row * TK + position, offs.to(tl.int32), mask=(m != 0) & in_range)
        tl.store(NUM + row, tl.sum(m, axis=0))

    @triton.jit
    def _select_tiles_kernel(SCORES, INDEX, NUM, T, P, TOPK, BLOCK_K: tl.constexpr):
        """One (batch, head, query tile) row: the listed key tiles in ascending order and their count."""
        row = tl.program_id(0).to(tl.int64)
        q_tile = tl.program_id(0) % T
        offs = tl.arange(0, BLOCK_K)
        in_range = offs < T
        video = in_range & (offs >= P)
        x = tl.load(SCORES + row * T + offs, mask=in_range, other=0.0).to(tl.float32) + 0.0  # -0.0 -> +0.0
        # Order-preserving unsigned key of each float32 (negative: all bits flipped; positive: sign bit set).
        bits = x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        key = tl.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits + 0x80000000)
        key = tl.where(video, key, -1)  # non-video and padding never count
        # Largest threshold t with at least TOPK video keys >= t, built bit by bit from the top.
        t = tl.zeros([], tl.int64)
        one = tl.full([], 1, tl.int64)  # (an int32 1 << 31 would wrap negative)
        for bit in range(31, -1, -1):
            candidate = t | (one << bit)
            if tl.sum((key >= candidate).to(tl.int32), axis=0) >= TOPK:
                t = candidate
        above = key > t
        tied = key == t
        # Equal scores at the threshold: the lowest tile indices fill the remaining places.
        room = TOPK - tl.sum(above.to(tl.int32), axis=0)
        take_tied = tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= room)
        chosen = (above | take_tied) & (TOPK > 0)
        keep = in_range & ((q_tile < P) | (offs < P) | chosen)
        m = keep.to(tl.int32)
        position = tl.cumsum(m, axis=0) - 1
        tl.store(INDEX + row * T + position, offs.to(tl.int32), mask=keep)
        tl.store(NUM + row, tl.sum(m, axis=0))


def topk_for_sparsity(sparsity: float, num_video_tiles: int) -> int:
    """``clamp(ceil((1 - sparsity) * n_video), 1, n_video)`` video key tiles kept per query tile (FastH3 rule)."""
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
    if num_video_tiles == 0:
        return 0
    # Round before ceil so that 0.2 * 10 does not become 3 through float error.
    return min(max(math.ceil(round((1.0 - sparsity) * num_video_tiles, 6)), 1), num_video_tiles)


def build_block_mask(scores: torch.Tensor, num_prefix_tiles: int, topk: int) -> torch.Tensor:
    """Boolean ``[B, H, T, T]`` tile mask from pooled ``scores [B, H, T, T]`` (see module docstring)."""
    if scores.ndim != 4 or scores.shape[-1] != scores.shape[-2]:
        raise ValueError(f"scores must be [batch, heads, tiles, tiles], got {tuple(scores.shape)}")
    n = scores.shape[-1]
    p = num_prefix_tiles
    if not 0 <= topk <= n - p:
        raise ValueError(f"topk must be in [0, {n - p}] (the number of video tiles), got {topk}")
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    mask[:, :, :p, :] = True
    mask[:, :, p:, :p] = True
    if topk > 0 and n > p:
        # A stable descending sort: equal scores keep index order, so the lower tile index wins (as in select_tiles).
        chosen = torch.sort(scores[:, :, p:, p:], dim=-1, descending=True, stable=True).indices[..., :topk] + p
        mask[:, :, p:].scatter_(-1, chosen, True)
    return mask


def mask_to_index_reference(mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference of :func:`mask_to_index` (unselected tail entries are filled with the unselected tiles)."""
    if mask.dtype != torch.bool or mask.ndim != 4:
        raise ValueError(f"mask must be a bool [B, H, Tq, Tk] tensor, got {mask.dtype} {tuple(mask.shape)}")
    order = torch.sort((~mask).to(torch.int8), dim=-1, stable=True).indices
    return order.to(torch.int32), mask.sum(-1, dtype=torch.int32)


def mask_to_index(mask: torch.Tensor, *, backend: str = "auto") -> Tuple[torch.Tensor, torch.Tensor]:
    """Compact ``index, num`` lists of the selected key tiles of every (batch, head, query tile)."""
    if not use_triton("mask_to_index", mask, backend=backend):
        return mask_to_index_reference(mask)
    if mask.dtype != torch.bool or mask.ndim != 4:
        raise ValueError(f"mask must be a bool [B, H, Tq, Tk] tensor, got {mask.dtype} {tuple(mask.shape)}")
    mask = mask.contiguous()
    b, h, tq, tk = mask.shape
    index = torch.empty(b, h, tq, tk, device=mask.device, dtype=torch.int32)
    num = torch.empty(b, h, tq, device=mask.device, dtype=torch.int32)
    if mask.numel() == 0:
        num.zero_()
        return index, num
    _mask_to_index_kernel[(b * h * tq,)](mask.view(torch.uint8), index, num, tk, BLOCK_K=triton.next_power_of_2(tk))
    return index, num


def select_tiles(scores: torch.Tensor, num_prefix_tiles: int, topk: int, *,
                 backend: str = "auto") -> Tuple[torch.Tensor, torch.Tensor]:
    """``index, num`` lists of :func:`mask_to_index` for the mask of :func:`build_block_mask`, in one kernel."""
    if scores.ndim != 4 or scores.shape[-1] != scores.shape[-2]:
        raise ValueError(f"scores must be [batch, heads, tiles, tiles], got {tuple(scores.shape)}")
    b, h, t, _ = scores.shape
    if not 0 <= topk <= t - num_prefix_tiles:
        raise ValueError(f"topk must be in [0, {t - num_prefix_tiles}] (the number of video tiles), got {topk}")
    if not use_triton("select_tiles", scores, backend=backend):
        return mask_to_index_reference(build_block_mask(scores, num_prefix_tiles, topk))
    scores = scores.contiguous()
    index = torch.empty(b, h, t, t, device=scores.device, dtype=torch.int32)
    num = torch.empty(b, h, t, device=scores.device, dtype=torch.int32)
    if scores.numel() == 0:
        num.zero_()
        return index, num
    _select_tiles_kernel[(b * h * t,)](scores, index, num, t, num_prefix_tiles, topk,
                                       BLOCK_K=triton.next_power_of_2(t))
    return index, num
