"""Number formats, one copy each: E4M3 (FP8), E2M1 (FP4) and symmetric INT8 (pure torch: exact, deterministic,
device-agnostic). Kernels, quantizers and attention processors build on these; the Triton twins of the rounding
helpers live in :mod:`diffusers_h3.kernels._numerics_triton`.

Conventions (the NVIDIA / OCP ones, so ModelOpt-style NVFP4 exports read back unchanged):

- E4M3 is ``torch.float8_e4m3fn`` (bias 7, no infinities, max 448). Saturating casts here clamp to +-448 instead of
  producing NaN, and round to nearest, ties to even.
- E2M1 code: bit 3 is the sign, bits 2..0 the magnitude index into ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``; two codes per
  byte, the element with the even index in the **low** nibble.
- Attention operands: :func:`quantize_fp8_per_token` (one scale per row: Q and K), :func:`quantize_fp8_per_channel`
  (one scale per channel over the sequence: V for FP8 P.V), :func:`quantize_fp8_per_block` (one scale per key tile);
  with ``dtype=torch.int8`` the same with ``amax / 127`` (SageAttention's choice for ``Q K^T``: smaller rounding
  error than E4M3 at the same bytes and tensor-core rate; docs/attention.md).
- :func:`fake_quant_fp4`: NVFP4-style emulation (groups of 16 share an E4M3 scale ``amax / 6``), run as emulation
  everywhere for attention (not run on FP4 hardware).
"""

from __future__ import annotations

from typing import Tuple, Union

import torch


E4M3_MAX = 448.0
E2M1_MAX = 6.0
INT8_MAX = 127.0
LOG2E = 1.4426950408889634  # exp(x) = exp2(x * LOG2E): the kernels' softmax runs in base 2

QK_8BIT_DTYPES = (torch.float8_e4m3fn, torch.int8)

# ---------------------------------------------------------------------------------------------------------------------
# E2M1 (FP4) and E4M3 (FP8) element formats

# Values of the 16 E2M1 codes (code 8 is -0.0).
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32
)


def e2m1_values(device=None, dtype=torch.float32) -> torch.Tensor:
    """The 16 E2M1 values indexed by code, on ``device``."""
    return E2M1_VALUES.to(device=device, dtype=dtype)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round fp values onto the E2M1 grid (nearest, ties to even mantissa), saturating at +-6. Returns float32."""
    x = x.float()
    mag = x.abs().clamp(max=E2M1_MAX)
    # Grid spacing: 0.5 on [0, 2), 1 on [2, 4), 2 on [4, 6]. torch.round is round-half-to-even; on each segment
    # the even multiples of the spacing are exactly the codes with mantissa bit 0, so this is RNE in E2M1.
    r = torch.where(
        mag < 2.0,
        torch.round(mag * 2.0) / 2.0,
        torch.where(mag < 4.0, torch.round(mag), torch.round(mag / 2.0) * 2.0),
    )
    return torch.copysign(r, x)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """fp values -> 4-bit E2M1 codes (uint8, one code per element), RNE with saturation at +-6.

    Negative zero and values that round to zero from below encode as code 8 (-0), like the hardware conversion.
    """
    x = x.float()
    mag = round_to_e2m1(x).abs()
    # Magnitude index: 0,0.5,1,1.5 -> 0..3 (2*mag); 2,3 -> 4,5 (mag+2); 4,6 -> 6,7 (mag/2+4).
    idx = torch.where(mag < 2.0, mag * 2.0, torch.where(mag < 4.0, mag + 2.0, mag / 2.0 + 4.0)).to(torch.uint8)
    sign = torch.signbit(x).to(torch.uint8) << 3
    return idx | sign


def e2m1_decode(codes: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """4-bit E2M1 codes (any integer dtype, values 0..15) -> values."""
    return e2m1_values(codes.device, dtype)[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes ``[..., K]`` (K even) into bytes ``[..., K/2]``, even element in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles needs an even last dimension, got {tuple(codes.shape)}; pad it to even first.")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: bytes ``[..., K/2]`` -> codes ``[..., K]`` (uint8)."""
    packed = packed.to(torch.uint8)
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Saturating cast to ``float8_e4m3fn`` (RNE; +-inf and values beyond +-448 become +-448, NaN stays NaN)."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Values of :func:`to_e4m3` as float32 (what a kernel that rounds in registers must reproduce)."""
    return to_e4m3(x).float()


def e4m3_decode_bits(bits: torch.Tensor) -> torch.Tensor:
    """Decode raw E4M3 bytes (uint8) to float32 without relying on the fp8 dtype (mirror of the in-kernel decode)."""
    b = bits.to(torch.int32)
    sign = torch.where((b & 0x80) != 0, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    mant = (b & 0x7).float()
    normal = (1.0 + mant / 8.0) * torch.exp2(exp.float() - 7.0)
    sub = mant * 2.0**-9
    value = torch.where(exp == 0, sub, normal)
    value = torch.where((b & 0x7F) == 0x7F, torch.full_like(value, float("nan")), value)
    return sign * value


# ---------------------------------------------------------------------------------------------------------------------
# Scaled 8-bit / 4-bit operands for attention

QK_8BIT_DTYPES = (torch.float8_e4m3fn, torch.int8)


def qmax_of(dtype: torch.dtype) -> float:
    """Largest code of an 8-bit attention operand dtype: 448 (E4M3) or 127 (INT8)."""
    if dtype not in QK_8BIT_DTYPES:
        raise ValueError(f"8-bit attention operands are float8_e4m3fn or int8, got {dtype}")
    return E4M3_MAX if dtype == torch.float8_e4m3fn else INT8_MAX


def _cast_8bit(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Scaled float32 ``y`` (within ``±qmax``) to ``dtype``, rounding to nearest even."""
    if dtype == torch.int8:
        return torch.round(y).to(torch.int8)
    return y.to(dtype)


def quantize_fp8_per_token(x: torch.Tensor, dim: Union[int, Tuple[int, ...]] = -1, eps: float = 1e-12,
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


def quantize_fp8_per_head(x: torch.Tensor, eps: float = 1e-12) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x [B, N, H, D]`` -> ``(E4M3 x8, scale [B, H])``: one ``amax / 448`` per batch item and head over all rows and
    channels (FlashInfer FA3's FP8 operand format): :func:`quantize_fp8_per_token` over the sequence and channel dims."""
    return quantize_fp8_per_token(x, dim=(1, 3), eps=eps)


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


def fake_quant_fp4(x: torch.Tensor, dim: int = -1, group: int = 16) -> torch.Tensor:
    """NVFP4-style quantize-dequantize along ``dim`` in groups of ``group`` (E4M3 group scales, no global scale)."""
    dim = dim % x.ndim
    if x.shape[dim] % group:
        raise ValueError(f"fake_quant_fp4 needs the quantized dim ({x.shape[dim]}) to be a multiple of {group}")
    moved = x.float().movedim(dim, -1)
    g = moved.reshape(*moved.shape[:-1], -1, group)
    scale = (g.abs().amax(-1, keepdim=True) * (1.0 / E2M1_MAX)).to(torch.float8_e4m3fn).float()
    q = torch.where(scale > 0, round_to_e2m1(g / torch.where(scale > 0, scale, 1.0)), 0.0) * scale
    return q.reshape(moved.shape).movedim(-1, dim).to(x.dtype)


def fake_quant_fp8_per_token(x: torch.Tensor, dim: int = -1, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """Quantize-dequantize with :func:`quantize_fp8_per_token` (emulation / references)."""
    x8, scale = quantize_fp8_per_token(x, dim=dim, dtype=dtype)
    return (x8.float() * scale.unsqueeze(dim)).to(x.dtype)
