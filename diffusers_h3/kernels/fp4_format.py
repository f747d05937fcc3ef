"""Generic E2M1 (FP4) and E4M3 (FP8) helpers in pure torch: value tables, round-to-nearest-even, saturation, nibble
packing. They know nothing about layers or models; quantizers and attention kernels build on them.

Conventions (the NVIDIA / OCP ones, so ModelOpt-style NVFP4 exports read back unchanged):

- E2M1 code: bit 3 is the sign, bits 2..0 the magnitude index into ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``.
- Two E2M1 codes per byte, the element with the even index in the **low** nibble.
- E4M3 is ``torch.float8_e4m3fn`` (bias 7, no infinities, max 448). Casts here saturate to +-448 instead of
  producing NaN, and round to nearest, ties to even.
"""

from __future__ import annotations

import torch

E2M1_MAX = 6.0
E4M3_MAX = 448.0

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
