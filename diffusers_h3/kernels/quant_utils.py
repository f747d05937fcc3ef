"""FP8 / FP4 quantization helpers for the attention kernels (pure torch: exact, deterministic, device-agnostic).

* :func:`quantize_fp8_per_token`: E4M3 with one float32 scale ``amax / 448`` per vector along ``dim`` (Q and K rows);
  with ``dtype=torch.int8`` symmetric INT8 instead (``amax / 127``, round to nearest even): the same bytes and
  tensor-core rate on Ampere/Hopper, ~4x smaller rounding error than E4M3 on Q/K (SageAttention's choice for ``Q K^T``).
* :func:`quantize_fp8_per_channel`: E4M3 with one scale per channel over the sequence (V for FP8 PV).
* :func:`quantize_fp8_per_block`: E4M3 with one scale per block of rows and head (K: one scale per key tile, so that
  the attention kernels apply it as one number per tile instead of one per key column).
* :func:`fake_quant_fp4`: NVFP4-style emulation: groups of 16 consecutive elements along ``dim`` share an E4M3 scale
  ``round_e4m3(amax / 6)``; values are rounded to E2M1 (``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``, ties to even) and
  multiplied back. This is the numerics of SageAttention3-style FP4 attention (FastVideo's Blackwell kernel); we run
  it as emulation everywhere (FP4 tensor-core execution is not implemented; not run on hardware).
"""

from __future__ import annotations

from typing import Tuple

import torch

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0
_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


INT8_MAX = 127.0
QK_8BIT_DTYPES = (torch.float8_e4m3fn, torch.int8)


def qmax_of(dtype: torch.dtype) -> float:
    """Largest code of an 8-bit attention operand dtype: 448 (E4M3) or 127 (INT8)."""
    if dtype not in QK_8BIT_DTYPES:
        raise ValueError(f"8-bit attention operands are float8_e4m3fn or int8, got {dtype}")
    return FP8_E4M3_MAX if dtype == torch.float8_e4m3fn else INT8_MAX


def _cast_8bit(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Scaled float32 ``y`` (within ``±qmax``) to ``dtype``, rounding to nearest even."""
    if dtype == torch.int8:
        return torch.round(y).to(torch.int8)
    return y.to(dtype)


def quantize_fp8_per_token(x: torch.Tensor, dim: int = -1, eps: float = 1e-12,
                           dtype: torch.dtype = torch.float8_e4m3fn) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(x8, scale)`` with ``x ≈ x8.float() * scale.unsqueeze(dim)``; ``scale = amax(|x|, dim) * (1 / 448)``
    (``1 / 127`` for ``dtype=torch.int8``).

    The scale is a float32 product with the float32 reciprocal (torch's CUDA division by a scalar does the same, so
    CPU, GPU and the Triton kernels agree bit for bit); ``x / scale`` is a true division, rounded to nearest even.
    """
    qmax = qmax_of(dtype)
    xf = x.float()
    scale = xf.abs().amax(dim=dim, keepdim=True).clamp_min(eps) * (1.0 / qmax)
    x8 = _cast_8bit((xf / scale).clamp(-qmax, qmax), dtype)
    return x8, scale.squeeze(dim)


def quantize_fp8_per_channel(x: torch.Tensor, seq_dim: int = 1, eps: float = 1e-12) -> Tuple[torch.Tensor, torch.Tensor]:
    """E4M3 with one scale per channel: the amax is taken over ``seq_dim`` only (``scale`` keeps the other dims)."""
    return quantize_fp8_per_token(x, dim=seq_dim, eps=eps)


def quantize_fp8_per_block(x: torch.Tensor, block: int, eps: float = 1e-12,
                           dtype: torch.dtype = torch.float8_e4m3fn) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x [B, N, H, D]`` -> ``(x8, scale [B, ceil(N / block), H])``: one ``amax / 448`` (``/ 127`` for int8) per
    ``block`` rows and head."""
    qmax = qmax_of(dtype)
    b, n, h, d = x.shape
    n_blocks = -(-n // block)
    xf = x.float()
    padded = torch.nn.functional.pad(xf, (0, 0, 0, 0, 0, n_blocks * block - n))
    amax = padded.view(b, n_blocks, block, h, d).abs().amax(dim=(2, 4))
    scale = amax.clamp_min(eps) * (1.0 / qmax)
    per_row = expand_block_scale(scale, block, n).unsqueeze(-1)  # [B, N, H, 1]
    x8 = _cast_8bit((xf / per_row).clamp(-qmax, qmax), dtype)
    return x8, scale


def expand_block_scale(scale: torch.Tensor, block: int, rows: int) -> torch.Tensor:
    """Per-block scales ``[B, T, H]`` as per-row scales ``[B, rows, H]``."""
    return scale.repeat_interleave(block, dim=1)[:, :rows]


def dequantize_fp8_per_block(x8: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """float32 values of :func:`quantize_fp8_per_block` output ``(x8 [B, N, H, D], scale [B, T, H])``."""
    return x8.float() * expand_block_scale(scale.float(), block, x8.shape[1]).unsqueeze(-1)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values to the nearest E2M1 value (ties to even mantissa), saturating at ±6."""
    grid = torch.tensor(_E2M1_GRID, device=x.device, dtype=torch.float32)
    mids = (grid[1:] + grid[:-1]) / 2
    a = x.abs().float().clamp_max(FP4_E2M1_MAX).contiguous()
    lower = torch.bucketize(a, mids, right=False)  # a tie goes to the smaller neighbour
    upper = torch.bucketize(a, mids, right=True)  # a tie goes to the larger neighbour
    # Even grid indices have an even mantissa bit (0, 1, 2, 4 and the subnormal-free 1.0); pick those on ties.
    idx = torch.where((lower != upper) & (upper % 2 == 0), upper, lower)
    return torch.copysign(grid[idx], x.float())


def fake_quant_fp4(x: torch.Tensor, dim: int = -1, group: int = 16) -> torch.Tensor:
    """NVFP4-style quantize-dequantize along ``dim`` in groups of ``group`` (E4M3 group scales, no global scale)."""
    dim = dim % x.ndim
    if x.shape[dim] % group:
        raise ValueError(f"fake_quant_fp4 needs the quantized dim ({x.shape[dim]}) to be a multiple of {group}")
    moved = x.float().movedim(dim, -1)
    g = moved.reshape(*moved.shape[:-1], -1, group)
    scale = (g.abs().amax(-1, keepdim=True) * (1.0 / FP4_E2M1_MAX)).to(torch.float8_e4m3fn).float()
    q = torch.where(scale > 0, round_e2m1(g / torch.where(scale > 0, scale, 1.0)), 0.0) * scale
    return q.reshape(moved.shape).movedim(-1, dim).to(x.dtype)


def fake_quant_fp8_per_token(x: torch.Tensor, dim: int = -1, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """Quantize-dequantize with :func:`quantize_fp8_per_token` (emulation / references)."""
    x8, scale = quantize_fp8_per_token(x, dim=dim, dtype=dtype)
    return (x8.float() * scale.unsqueeze(dim)).to(x.dtype)
