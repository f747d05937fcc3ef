"""Q, K or V as E4M3 with one scale per (batch, head): the operand format of FlashAttention-3's FP8 kernel.

:func:`quantize_fp8_per_head_reference` is the torch definition: optionally subtract the per-(batch, head, channel)
mean over the sequence in fp32 (``center``: K smoothing, exact under softmax), then
:func:`~diffusers_h3.kernels.numerics.quantize_fp8_per_head` (``scale = amax / 448`` over all rows and channels of a
head). :func:`quantize_fp8_per_head` gives the same codes and scales bit for bit in two Triton passes over the
tensor: one reads it for the per-channel maximum and minimum (per chunk of rows; max and min are exact in any order),
the other quantizes. Centring is monotone, so the largest centred magnitude of a channel is ``max(hi - mean,
mean - lo)``, rounded as the reference rounds each element; the mean itself is torch's fp32 mean, as in the reference.
"""

from __future__ import annotations

from typing import Tuple

import torch

from .._triton_utils import HAS_TRITON, check_interpreter_dtype, triton_interpreter_active, use_triton
from ..numerics import E4M3_MAX
from ..numerics import quantize_fp8_per_head as _quantize_fp8_per_head_definition


if HAS_TRITON:
    import triton
    import triton.language as tl

    from .._numerics_triton import scale_to_e4m3

    @triton.jit
    def _channel_range_kernel(X, HI, LO, N, H, ROWS_PER_CHUNK, stride_xb, stride_xn, stride_xh,
                              D: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
        """Per (batch, chunk of rows, head, channel): the maximum and minimum over the chunk's rows, in fp32."""
        pid_c = tl.program_id(0)
        pid_bh = tl.program_id(1)
        chunks = tl.num_programs(0)
        b = (pid_bh // H).to(tl.int64)
        h = pid_bh % H
        offs_d = tl.arange(0, D)
        hi = tl.full([D], float("-inf"), tl.float32)
        lo = tl.full([D], float("inf"), tl.float32)
        first = pid_c * ROWS_PER_CHUNK
        last = tl.minimum(first + ROWS_PER_CHUNK, N)
        for start in range(first, last, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            valid = (offs_n < last)[:, None]
            x = tl.load(X + b * stride_xb + offs_n[:, None].to(tl.int64) * stride_xn + h * stride_xh + offs_d[None, :],
                        mask=valid, other=0.0).to(tl.float32)  # fmt: skip
            hi = tl.maximum(hi, tl.max(tl.where(valid, x, float("-inf")), axis=0))
            lo = tl.minimum(lo, tl.min(tl.where(valid, x, float("inf")), axis=0))
        out = ((b * chunks + pid_c) * H + h) * D + offs_d
        tl.store(HI + out, hi)
        tl.store(LO + out, lo)

    @triton.jit
    def _quantize_per_head_kernel(X, MEAN, SCALE, OUT, N, H, stride_xb, stride_xn, stride_xh, stride_ob, stride_on,
                                  stride_oh, D: tl.constexpr, BLOCK_N: tl.constexpr, CENTER: tl.constexpr,
                                  SOFT_ROUND: tl.constexpr):  # fmt: skip
        pid_n = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = (pid_bh // H).to(tl.int64)
        h = pid_bh % H
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D)
        valid = (offs_n < N)[:, None]
        rows = offs_n[:, None].to(tl.int64)
        x = tl.load(X + b * stride_xb + rows * stride_xn + h * stride_xh + offs_d[None, :], mask=valid,
                    other=0.0).to(tl.float32)  # fmt: skip
        if CENTER:
            x = x - tl.load(MEAN + (b * H + h) * D + offs_d)[None, :]
        y = scale_to_e4m3(x, tl.load(SCALE + b * H + h), SOFT_ROUND)
        dst = OUT + b * stride_ob + rows * stride_on + h * stride_oh + offs_d[None, :]
        tl.store(dst, y.to(OUT.dtype.element_ty), mask=valid)


def _check_shape(x: torch.Tensor) -> None:
    if x.ndim != 4:
        raise ValueError(f"expected [batch, seq, heads, head_dim], got {tuple(x.shape)}")


def _channel_range(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(max, min)`` over the sequence of every (batch, head, channel) of ``x [B, N, H, D]``: partial results per
    chunk of rows from one Triton pass (enough chunks to fill the GPU), then torch's max / min over the chunks."""
    b, n, h, d = x.shape
    chunks = max(1, min(triton.cdiv(n, 256), triton.cdiv(1024, b * h)))
    rows_per_chunk = triton.cdiv(triton.cdiv(n, chunks), 64) * 64
    chunks = triton.cdiv(n, rows_per_chunk)
    hi = torch.empty(b, chunks, h, d, device=x.device, dtype=torch.float32)
    lo = torch.empty_like(hi)
    _channel_range_kernel[(chunks, b * h)](
        x, hi, lo, n, h, rows_per_chunk, x.stride(0), x.stride(1), x.stride(2), D=d, BLOCK_N=64,
    )  # fmt: skip
    return hi.amax(dim=1), lo.amin(dim=1)


def quantize_fp8_per_head_reference(
    x: torch.Tensor, *, center: bool = False, eps: float = 1e-12
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Torch definition: ``x [B, N, H, D]`` -> ``(E4M3 x8 [B, N, H, D], scale [B, H])``; with ``center`` the fp32 mean
    over the sequence of every (batch, head, channel) is subtracted first."""
    _check_shape(x)
    xf = x.float()
    if center:
        xf = xf - x.mean(1, keepdim=True, dtype=torch.float32)
    return _quantize_fp8_per_head_definition(xf, eps)


def quantize_fp8_per_head(
    x: torch.Tensor, *, center: bool = False, eps: float = 1e-12, backend: str = "auto"
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_fp8_per_head_reference` bit for bit, with one Triton quantization pass (``x8`` contiguous)."""
    _check_shape(x)
    if not use_triton("quantize_fp8_per_head", x, backend=backend):
        return quantize_fp8_per_head_reference(x, center=center, eps=eps)
    check_interpreter_dtype("quantize_fp8_per_head", x)
    b, n, h, d = x.shape
    if d & (d - 1) or x.stride(-1) != 1:
        raise ValueError(f"x needs a power-of-two head_dim and a contiguous last dimension, got {tuple(x.shape)}")
    hi, lo = _channel_range(x)  # [B, H, D]
    if center:
        mean = x.mean(1, dtype=torch.float32)
        amax = torch.maximum(hi - mean, mean - lo).amax(dim=-1)
    else:
        mean = hi  # not read by the kernel
        amax = torch.maximum(hi, lo.neg()).amax(dim=-1)
    scale = amax.clamp_min(eps) * (1.0 / E4M3_MAX)
    out = torch.empty(x.shape, device=x.device, dtype=torch.float8_e4m3fn)
    block_n = 64
    _quantize_per_head_kernel[(triton.cdiv(n, block_n), b * h)](
        x, mean, scale, out, n, h, x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1), out.stride(2),
        D=d, BLOCK_N=block_n, CENTER=center, SOFT_ROUND=triton_interpreter_active(),
    )  # fmt: skip
    return out, scale
