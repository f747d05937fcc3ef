"""Weight-quantized GEMMs: W8A16 (int8 weights), FP8 (E4M3 W8A8) and NVFP4 (weight-only, W4A4 on SM100+).

Each format has quantize / dequantize references, a ``*_linear(x, ...)`` entry point that picks the kernel per device
(``backend="auto"``) and a pure-torch reference with the same numerics."""

from ._common import LARGE_M_ROWS, triton_gemm_supported
from .fp8 import (
    fp8_dequantize,
    fp8_linear,
    fp8_linear_reference,
    fp8_quantize_per_token,
    fp8_quantize_weight,
    fp8_scaled_mm_supported,
)
from .nvfp4 import (
    flashinfer_fp4_available,
    nvfp4_dequantize,
    nvfp4_linear,
    nvfp4_linear_reference,
    nvfp4_quantize,
    nvfp4_w4a4_reference,
)
from .w8a16 import w8a16_dequantize, w8a16_linear, w8a16_linear_reference, w8a16_quantize


__all__ = [
    "LARGE_M_ROWS",
    "flashinfer_fp4_available",
    "fp8_dequantize",
    "fp8_linear",
    "fp8_linear_reference",
    "fp8_quantize_per_token",
    "fp8_quantize_weight",
    "fp8_scaled_mm_supported",
    "nvfp4_dequantize",
    "nvfp4_linear",
    "nvfp4_linear_reference",
    "nvfp4_quantize",
    "nvfp4_w4a4_reference",
    "triton_gemm_supported",
    "w8a16_dequantize",
    "w8a16_linear",
    "w8a16_linear_reference",
    "w8a16_quantize",
]
