"""Tile mean pooling (and packing) for video sparse attention.

A tile plan gives every tile ``block`` slots (``slot_rows[t * block + i]`` is the packed row of slot ``i`` of tile
``t``) and a valid count (``tile_counts[t]``, valid slots come first). For ``x`` of shape ``[B, S, H, D]``:

* ``pooled[b, h, t] = mean(x[b, rows of t, h])`` in float32 (sum in float32, divided by the valid count);
* optionally ``packed[b, t * block + i, h] = x[b, slot_rows[t * block + i], h]`` (same dtype, pad slots hold zeros),
  the tile-ordered copy the fine attention kernel reads keys and values from.

:func:`tile_pool` is the entry point (Triton kernel on CUDA / under the interpreter); :func:`tile_pool_reference` is
the pure-torch reference with the same contract.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._triton_utils import HAS_TRITON, check_interpreter_dtype, triton_interpreter_active, use_triton
from ..numerics import qmax_of


if HAS_TRITON:
    import triton
    import triton.language as tl

    from .._numerics_triton import E4M3_MAX, INT8_MAX, round_to_e4m3

    @triton.jit
    def _tile_pool_kernel(
        X,
        SLOT_ROWS,
        TILE_COUNTS,
        POOLED,
        PACKED,
        SCALE,
        MEAN,
        H,
        D,
        stride_xb,
        stride_xs,
        stride_xh,
        stride_xd,
        stride_pb,
        stride_ps,
        stride_ph,
        stride_sb,
        stride_ss,
        stride_sh,
        BLOCK: tl.constexpr,
        BLOCK_D: tl.constexpr,
        WRITE_POOLED: tl.constexpr,
        WRITE_PACKED: tl.constexpr,
        QUANT_FP8: tl.constexpr,
        SUBTRACT: tl.constexpr,
        PER_TILE: tl.constexpr = False,
        SOFT_ROUND: tl.constexpr = False,
    ):
        tile = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        n_tiles = tl.num_programs(0)
        offs_m = tl.arange(0, BLOCK)
        offs_d = tl.arange(0, BLOCK_D)
        count = tl.load(TILE_COUNTS + tile)
        rows = tl.load(SLOT_ROWS + tile * BLOCK + offs_m).to(tl.int64)
        row_valid = offs_m < count
        valid = row_valid[:, None] & (offs_d < D)[None, :]
        ptrs = X + b.to(tl.int64) * stride_xb + rows[:, None] * stride_xs + h * stride_xh + offs_d[None, :] * stride_xd
        x = tl.load(ptrs, mask=valid, other=0.0)
        if WRITE_POOLED:
            mean = tl.sum(x.to(tl.float32), axis=0) / count.to(tl.float32)
            out = POOLED + (pid_bh.to(tl.int64) * n_tiles + tile) * D + offs_d
            tl.store(out, mean, mask=offs_d < D)
        if QUANT_FP8:
            xf = x.to(tl.float32)
            if SUBTRACT:
                xf = xf - tl.load(MEAN + pid_bh * D + offs_d, mask=offs_d < D, other=0.0)[None, :]
            xf = tl.where(valid, xf, 0.0)
            INT8: tl.constexpr = PACKED.dtype.element_ty == tl.int8
            QMAX: tl.constexpr = INT8_MAX if INT8 else E4M3_MAX
            if PER_TILE:  # one scale for the whole tile (quantize_fp8_per_block)
                scale = tl.maximum(tl.max(tl.max(tl.abs(xf), axis=1), axis=0), 1e-12) * (1.0 / QMAX)
                y = tl.math.div_rn(xf, tl.full([BLOCK, BLOCK_D], 1.0, tl.float32) * scale)
            else:  # one scale per row (quantize_fp8_per_token)
                scale = tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-12) * (1.0 / QMAX)
                y = tl.math.div_rn(xf, scale[:, None])
            y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
            if INT8:  # round half to even (torch.round), then an exact cast
                r = tl.floor(y + 0.5)
                odd_tie = ((r - y) == 0.5) & ((r - 2.0 * tl.floor(r * 0.5)) != 0.0)
                y = tl.where(odd_tie, r - 1.0, r)
            elif SOFT_ROUND:  # the interpreter's float8 cast truncates: round in software first (exact cast after)
                y = round_to_e4m3(y)
            x = y.to(PACKED.dtype.element_ty)  # GPUs: cvt.rn.satfinite, round to nearest even
        if WRITE_PACKED:
            # Packed output in tile order (pad slots get zeros), or, unpacked, back at the source rows.
            slots = tile.to(tl.int64) * BLOCK + offs_m
            dst = PACKED + b.to(tl.int64) * stride_pb + slots[:, None] * stride_ps + h * stride_ph + offs_d[None, :]
            tl.store(dst, x, mask=(offs_d < D)[None, :])
            if QUANT_FP8 and not PER_TILE:
                tl.store(SCALE + b.to(tl.int64) * stride_sb + slots * stride_ss + h * stride_sh, scale)
        elif QUANT_FP8:
            dst = PACKED + b.to(tl.int64) * stride_pb + rows[:, None] * stride_ps + h * stride_ph + offs_d[None, :]
            tl.store(dst, x, mask=valid)
            if not PER_TILE:
                tl.store(SCALE + b.to(tl.int64) * stride_sb + rows * stride_ss + h * stride_sh, scale, mask=row_valid)
        if QUANT_FP8 and PER_TILE:
            tl.store(SCALE + b.to(tl.int64) * stride_sb + tile * stride_ss + h * stride_sh, scale)


def valid_slots(tile_counts: torch.Tensor, block: int) -> torch.Tensor:
    """``bool [n_tiles * block]``: which slots hold a row (slot ``i`` of tile ``t`` is valid when ``i < tile_counts[t]``)."""
    return (torch.arange(block, device=tile_counts.device)[None, :] < tile_counts.long()[:, None]).reshape(-1)


def _check(x: torch.Tensor, slot_rows: torch.Tensor, tile_counts: torch.Tensor, block: int) -> None:
    if x.ndim != 4:
        raise ValueError(f"x must be [batch, seq, heads, head_dim], got shape {tuple(x.shape)}")
    if slot_rows.ndim != 1 or slot_rows.numel() != tile_counts.numel() * block:
        raise ValueError(
            f"slot_rows must hold tile_counts.numel() * block = {tile_counts.numel() * block} entries, got "
            f"{tuple(slot_rows.shape)}; build both with diffusers_h3.attention_processors.tiling.build_tile_plan"
        )
    if slot_rows.device != x.device or tile_counts.device != x.device:
        raise ValueError("slot_rows and tile_counts must live on the same device as x (move the tile plan)")


def tile_pool_reference(
    x: torch.Tensor, slot_rows: torch.Tensor, tile_counts: torch.Tensor, block: int, *, pooled: bool = True,
    packed: bool = False,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Pure-torch reference of :func:`tile_pool`."""
    _check(x, slot_rows, tile_counts, block)
    b, _, h, d = x.shape
    n_tiles = tile_counts.numel()
    gathered = x.index_select(1, slot_rows.long())  # [B, T * block, H, D]
    gathered = gathered * valid_slots(tile_counts, block).reshape(1, -1, 1, 1).to(gathered.dtype)
    pooled_out = packed_out = None
    if pooled:
        sums = gathered.float().view(b, n_tiles, block, h, d).sum(2)  # [B, T, H, D]
        pooled_out = (sums / tile_counts.float().view(1, -1, 1, 1)).permute(0, 2, 1, 3).contiguous()
    if packed:
        packed_out = gathered.contiguous()
    return pooled_out, packed_out


def tile_pool(
    x: torch.Tensor,
    slot_rows: torch.Tensor,
    tile_counts: torch.Tensor,
    block: int,
    *,
    pooled: bool = True,
    packed: bool = False,
    backend: str = "auto",
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Mean-pool ``x [B, S, H, D]`` per tile (``[B, H, T, D]`` float32) and/or pack it in tile order.

    Returns ``(pooled, packed)``; ``packed`` is ``[B, T * block, H, D]`` in ``x``'s dtype with zero pad slots.
    """
    if not use_triton("tile_pool", x, backend=backend):
        return tile_pool_reference(x, slot_rows, tile_counts, block, pooled=pooled, packed=packed)
    _check(x, slot_rows, tile_counts, block)
    check_interpreter_dtype("tile_pool", x)
    b, _, h, d = x.shape
    n_tiles = tile_counts.numel()
    pooled_out = torch.empty(b, h, n_tiles, d, device=x.device, dtype=torch.float32) if pooled else None
    packed_out = torch.empty(b, n_tiles * block, h, d, device=x.device, dtype=x.dtype) if packed else None
    if n_tiles == 0:
        return pooled_out, packed_out
    dummy = x.new_empty(1)
    dummy_f = torch.empty(1, device=x.device, dtype=torch.float32)
    _tile_pool_kernel[(n_tiles, b * h)](
        x, slot_rows, tile_counts, pooled_out if pooled else dummy_f, packed_out if packed else dummy, dummy_f,
        dummy_f, h, d, *x.stride(), *(packed_out.stride()[:3] if packed else (0, 0, 0)), 0, 0, 0,
        BLOCK=block, BLOCK_D=triton.next_power_of_2(d), WRITE_POOLED=pooled, WRITE_PACKED=packed, QUANT_FP8=False,
        SUBTRACT=False, num_warps=4,
    )
    return pooled_out, packed_out


def tile_quantize_fp8_reference(
    x: torch.Tensor, slot_rows: torch.Tensor, tile_counts: torch.Tensor, block: int, *, pooled: bool = False,
    packed: bool = False, subtract: Optional[torch.Tensor] = None, per_tile: bool = False,
    dtype: torch.dtype = torch.float8_e4m3fn,
) -> Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Pure-torch reference of :func:`tile_quantize_fp8`."""
    from ..numerics import quantize_fp8_per_block, quantize_fp8_per_token

    pooled_out, _ = tile_pool_reference(x, slot_rows, tile_counts, block, pooled=pooled)
    xf = x.float()
    if subtract is not None:
        xf = xf - subtract.float().unsqueeze(1)  # [B, H, D] -> [B, 1, H, D]
    if per_tile:
        _, xp = tile_pool_reference(xf, slot_rows, tile_counts, block, pooled=False, packed=True)  # zero pads
        x8p, scale = quantize_fp8_per_block(xp, block, dtype=dtype)
        if packed:
            return pooled_out, x8p, scale
        valid = valid_slots(tile_counts, block)
        x8 = torch.empty(x.shape, device=x.device, dtype=torch.uint8)
        x8[:, slot_rows.long()[valid]] = x8p.view(torch.uint8)[:, valid]
        return pooled_out, x8.view(dtype), scale
    x8, scale = quantize_fp8_per_token(xf, dtype=dtype)
    if packed:
        _, x8p = tile_pool_reference(x8.view(torch.uint8), slot_rows, tile_counts, block, pooled=False, packed=True)
        _, sp = tile_pool_reference(scale.unsqueeze(-1), slot_rows, tile_counts, block, pooled=False, packed=True)
        valid = valid_slots(tile_counts, block).reshape(1, -1, 1)
        sp = torch.where(valid, sp.squeeze(-1), torch.tensor(1e-12, dtype=torch.float32) * (1.0 / qmax_of(dtype)))
        return pooled_out, x8p.view(dtype), sp
    return pooled_out, x8, scale


def tile_quantize_fp8(
    x: torch.Tensor,
    slot_rows: torch.Tensor,
    tile_counts: torch.Tensor,
    block: int,
    *,
    pooled: bool = False,
    packed: bool = False,
    subtract: Optional[torch.Tensor] = None,
    per_tile: bool = False,
    dtype: torch.dtype = torch.float8_e4m3fn,
    backend: str = "auto",
) -> Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """FP8 E4M3 (or, with ``dtype=torch.int8``, symmetric INT8: ``amax / 127``, round to nearest even) per-(row, head)
    quantization of ``x [B, S, H, D]`` fused with tile pooling / packing.

    With ``per_tile`` one scale covers each (tile, head) instead (``scale [B, T, H]``, as
    :func:`~diffusers_h3.kernels.numerics.quantize_fp8_per_block` of the packed tiles): the key side of the FP8
    attention kernels, which then scale a whole key tile's scores by one number.

    ``subtract [B, H, D]`` is removed from every row first (key smoothing). Returns ``(pooled, x8, scale)``: the float32
    tile means of the *unsubtracted* ``x`` when ``pooled``; ``x8`` and ``scale`` (``amax / 448`` per row and head) at the
    source rows (``[B, S, H, D]`` / ``[B, S, H]``), or, with ``packed``, in tile order (``[B, T*block, H, D]`` /
    ``[B, T*block, H]``; pad slots hold zeros and scale ``1e-12 / 448``).
    """
    if not use_triton("tile_quantize_fp8", x, backend=backend):
        return tile_quantize_fp8_reference(x, slot_rows, tile_counts, block, pooled=pooled, packed=packed,
                                           subtract=subtract, per_tile=per_tile, dtype=dtype)
    qmax_of(dtype)  # raises for anything but float8_e4m3fn / int8
    _check(x, slot_rows, tile_counts, block)
    check_interpreter_dtype("tile_quantize_fp8", x)
    b, s, h, d = x.shape
    n_tiles = tile_counts.numel()
    rows = n_tiles * block if packed else s
    pooled_out = torch.empty(b, h, n_tiles, d, device=x.device, dtype=torch.float32) if pooled else None
    x8 = torch.empty(b, rows, h, d, device=x.device, dtype=dtype)
    if per_tile:
        scale = torch.empty(b, n_tiles, h, device=x.device, dtype=torch.float32)
    elif packed:  # head-major, so that the attention kernel reads one key tile's scales with one coalesced load
        scale = torch.empty(b, h, rows, device=x.device, dtype=torch.float32).permute(0, 2, 1)
    else:
        scale = torch.empty(b, rows, h, device=x.device, dtype=torch.float32)
    if n_tiles == 0:
        return pooled_out, x8, scale
    dummy_f = torch.empty(1, device=x.device, dtype=torch.float32)
    mean = subtract.float().contiguous() if subtract is not None else dummy_f
    if subtract is not None and subtract.shape != (b, h, d):
        raise ValueError(f"subtract must be [B, H, D] = {(b, h, d)}, got {tuple(subtract.shape)}")
    _tile_pool_kernel[(n_tiles, b * h)](
        x, slot_rows, tile_counts, pooled_out if pooled else dummy_f, x8, scale, mean, h, d, *x.stride(),
        *x8.stride()[:3], *scale.stride(),
        BLOCK=block, BLOCK_D=triton.next_power_of_2(d), WRITE_POOLED=pooled, WRITE_PACKED=packed, QUANT_FP8=True,
        SUBTRACT=subtract is not None, PER_TILE=per_tile, SOFT_ROUND=triton_interpreter_active(), num_warps=4,
    )
    return pooled_out, x8, scale
