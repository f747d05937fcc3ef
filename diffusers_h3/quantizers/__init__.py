"""Weight quantization for diffusers-h3: the formats W8A16, NVFP4 and FP8 (configs, quantized weight tensors held by
plain ``nn.Linear`` layers, their diffusers and transformers quantizers), one registry of formats (:mod:`.registry`) and ``quantize(module, config)``."""

from ._replace import linears_to_quantize
from .apply import quantization_summary, quantize
from .checkpoint import check_checkpoint_quantization
from .config import (
    DEFAULT_MODULES_TO_NOT_CONVERT,
    FP8Config,
    NVFP4Config,
    QuantizationConfigBase,
    QuantMethod,
    W8A16Config,
)
from .diffusers_quantizer import QuantizerBase
from .layers import (
    describe_layer,
    install_quantized_weight,
    is_quantized_linear,
    quantized_weight,
    register_packed_state_dict,
    tensor_nbytes,
)
from .registry import (
    QuantFormat,
    format_names,
    formats,
    get_format,
    register_format,
    register_quantizers,
    unregister_format,
)
from .tensors import FP8Tensor, NVFP4Tensor, QuantizedTensor, W8A16Tensor
from .transformers_quantizer import TransformersQuantizerBase


__all__ = [
    "DEFAULT_MODULES_TO_NOT_CONVERT",
    "FP8Config",
    "FP8Tensor",
    "NVFP4Config",
    "NVFP4Tensor",
    "QuantFormat",
    "QuantMethod",
    "QuantizationConfigBase",
    "QuantizedTensor",
    "QuantizerBase",
    "TransformersQuantizerBase",
    "W8A16Config",
    "W8A16Tensor",
    "describe_layer",
    "check_checkpoint_quantization",
    "format_names",
    "formats",
    "get_format",
    "install_quantized_weight",
    "is_quantized_linear",
    "linears_to_quantize",
    "quantization_summary",
    "quantized_weight",
    "quantize",
    "register_format",
    "register_packed_state_dict",
    "register_quantizers",
    "tensor_nbytes",
    "unregister_format",
]
