"""V for FP8 P·V: E4M3 with one scale per (batch, head, channel), stored channel-major.

The FP8 wgmma wants its B operand K-major, i.e. V with the keys contiguous: ``[B, H, D, N]`` storage, rows padded to
16 bytes so that TMA can read them. :func:`quantize_v_fp8_channel_major` returns that buffer as a ``[B, N, H, D]``
view (what the attention kernels take) plus the scales ``[B, H, D]``; one Triton pass quantizes and transposes (the
per-channel amax is two reductions before it). :func:`quantize_v_fp8_channel_major_reference` is the torch reference
(:func:`~diffusers_h3.kernels.numerics.quantize_fp8_per_channel` and a transposed copy), bit for bit the same codes.
"""

from __future__ import annotations

from typing import Tuple

import torch

from .._triton_utils import HAS_TRITON, check_interpreter_dtype, triton_interpreter_active, use_triton
from ..numerics import E4M3_MAX, quantize_fp8_per_channel


if HAS_TRITON:
    import triton
    import triton.language as tl

    from .._numerics_triton import scale_to_e4m3

    @triton.jit
    def _quantize_v_kernel(V, SCALE, OUT, N, H, stride_vb, stride_vn, stride_vh, stride_ob, stride_oh, stride_od,
                           D: tl.constexpr, BLOCK_N: tl.constexpr, SOFT_ROUND: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = (pid_bh // H).to(tl.int64)
        h = pid_bh % H
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D)
        valid = (offs_n < N)[:, None]
        x = tl.load(V + b * stride_vb + offs_n[:, None].to(tl.int64) * stride_vn + h * stride_vh + offs_d[None, :],
                    mask=valid, other=0.0).to(tl.float32)
        scale = tl.load(SCALE + (b * H + h) * D + offs_d)
        y = scale_to_e4m3(x, scale[None, :], SOFT_ROUND)
        dst = OUT + b * stride_ob + h * stride_oh + offs_d[:, None] * stride_od + offs_n[None, :]
        tl.store(dst, tl.trans(y.to(OUT.dtype.element_ty)), mask=tl.trans(valid))


def _empty_channel_major(v: torch.Tensor) -> torch.Tensor:
    b, n, h, d = v.shape
    rows = torch.zeros(b, h, d, -(-n // 16) * 16, device=v.device, dtype=torch.float8_e4m3fn)
    return rows[..., :n].permute(0, 3, 1, 2)  # [B, N, H, D] view of [B, H, D, N_padded] storage


def quantize_v_fp8_channel_major_reference(v: torch.Tensor, eps: float = 1e-12) -> Tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`quantize_v_fp8_channel_major`."""
    v8, scale = quantize_fp8_per_channel(v, seq_dim=1, eps=eps)
    out = _empty_channel_major(v)
    out.copy_(v8)
    return out, scale


def quantize_v_fp8_channel_major(v: torch.Tensor, *, eps: float = 1e-12,
                                 backend: str = "auto") -> Tuple[torch.Tensor, torch.Tensor]:
    """``v [B, N, H, D]`` -> ``(v8, scale [B, H, D])``: ``v8`` a channel-major ``[B, N, H, D]`` E4M3 view."""
    if v.ndim != 4:
        raise ValueError(f"v must be [batch, seq, heads, head_dim], got {tuple(v.shape)}")
    if not use_triton("quantize_v_fp8_channel_major", v, backend=backend):
        return quantize_v_fp8_channel_major_reference(v, eps)
    check_interpreter_dtype("quantize_v_fp8_channel_major", v)
    b, n, h, d = v.shape
    if d & (d - 1) or v.stride(-1) != 1:
        raise ValueError(f"v needs a power-of-two head_dim and a contiguous last dimension, got {tuple(v.shape)}")
    # amax |v| over the sequence from two reductions (no |v| temporary), scale = amax / 448 as in kernels.numerics.
    amax = torch.maximum(v.amax(dim=1), v.amin(dim=1).neg()).float()
    scale = amax.clamp_min(eps) * (1.0 / E4M3_MAX)
    out = _empty_channel_major(v)
    rows = out.permute(0, 2, 3, 1)  # [B, H, D, N] with the padded row stride
    block_n = 64
    _quantize_v_kernel[(triton.cdiv(n, block_n), b * h)](
        v, scale, rows, n, h, v.stride(0), v.stride(1), v.stride(2), rows.stride(0), rows.stride(1), rows.stride(2),
        D=d, BLOCK_N=block_n, SOFT_ROUND=triton_interpreter_active(),
    )
    return out, scale
