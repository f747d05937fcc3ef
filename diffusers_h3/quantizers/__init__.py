"""Weight quantization for diffusers-h3: W8A16, NVFP4, FP8 configs, quantizers registered with diffusers, quantized
Linear layers and ``quantize(module, config)``."""

from .config import (
    DEFAULT_MODULES_TO_NOT_CONVERT,
    FP8Config,
    H3QuantizationConfigBase,
    H3QuantMethod,
    NVFP4Config,
    W8A16Config,
)
from .layers import FP8Linear, H3QuantizedLinear, NVFP4Linear, W8A16Linear
from .quantize import linears_to_quantize, quantization_summary, quantize
from .quantizer import FP8Quantizer, H3Quantizer, NVFP4Quantizer, W8A16Quantizer, register_quantizers

__all__ = [
    "DEFAULT_MODULES_TO_NOT_CONVERT",
    "FP8Config",
    "FP8Linear",
    "FP8Quantizer",
    "H3QuantMethod",
    "H3QuantizationConfigBase",
    "H3QuantizedLinear",
    "H3Quantizer",
    "NVFP4Config",
    "NVFP4Linear",
    "NVFP4Quantizer",
    "W8A16Config",
    "W8A16Linear",
    "W8A16Quantizer",
    "linears_to_quantize",
    "quantization_summary",
    "quantize",
    "register_quantizers",
]
