"""``diffusers_h3.quantize(module, config)``: quantize the ``nn.Linear`` layers of any ``nn.Module`` in place.

Works for diffusers models (the H3 transformer), transformers models (the Qwen3-VL text encoder) and plain modules.
For a diffusers ``ModelMixin`` or a transformers ``PreTrainedModel`` the config is recorded
(``model.config.quantization_config``, ``model.hf_quantizer``) so ``save_pretrained`` writes the packed tensors and
``config.json`` says how to read them: ``from_pretrained`` reloads them without re-quantizing.
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional, Union

import torch
from diffusers import ModelMixin
from torch import nn
from transformers import PreTrainedModel

from ._replace import linears_to_quantize
from .config import QuantizationConfigBase
from .layers import is_quantized_linear, quantize_linear_, register_packed_state_dict
from .registry import format_names, quantizer_for, transformers_quantizer_for, weight_class_for


@torch.no_grad()
def quantize(
    module: nn.Module,
    config: QuantizationConfigBase,
    keep_in_fp32_modules: Optional[Iterable[str]] = None,
    device: Union[str, torch.device, None] = None,
) -> nn.Module:
    """Quantize the weights of the selected ``nn.Linear`` layers of ``module`` (in place; returns ``module``): each
    keeps its class and gets a quantized tensor as its ``weight``.

    ``keep_in_fp32_modules`` (default: the model's ``_keep_in_fp32_modules`` if it has one) is always skipped, also
    with an explicit ``config.modules_to_not_convert``.

    ``device``: move ``module`` there while quantizing, one layer at a time: each selected linear moves in 16 bits and
    is quantized there (the quantized weights are the same as quantizing on either device), then the rest of the
    module follows. A model built or loaded on the CPU reaches the GPU quantized without its 16-bit weights ever
    being there whole.
    """
    if not isinstance(config, QuantizationConfigBase):
        raise TypeError(
            f"quantize() expects the config of a registered format ({', '.join(format_names())}: e.g. W8A16Config), "
            f"got {type(config).__name__}. For other methods use diffusers' / transformers' own quantizers."
        )
    if any(is_quantized_linear(m) for m in module.modules()):
        raise ValueError("This module already contains quantized layers; quantize the original dense module instead.")
    if keep_in_fp32_modules is None:
        keep_in_fp32_modules = getattr(module, "_keep_in_fp32_modules", None) or []
    cls = weight_class_for(config)
    for name in linears_to_quantize(module, config, keep_in_fp32_modules):
        linear = module.get_submodule(name)
        if linear.weight.device.type == "meta":
            raise ValueError(f"Cannot quantize {name}: its weight is on the meta device; load its weight first.")
        if device is not None:
            linear.to(device)
        quantize_linear_(linear, cls, config.compute_dtype, **config.layer_kwargs())
    if device is not None:
        module.to(device)
    register_packed_state_dict(module)
    _attach_to_model(module, config)
    return module


def _attach_to_model(module: nn.Module, config: QuantizationConfigBase) -> None:
    """Make a quantized diffusers / transformers model serializable like one loaded with ``quantization_config=``."""
    register_packed_state_dict(module)
    if isinstance(module, ModelMixin):
        module.hf_quantizer = quantizer_for(config, pre_quantized=False)
        module.register_to_config(quantization_config=config)
    elif isinstance(module, PreTrainedModel):
        module.hf_quantizer = transformers_quantizer_for(config, pre_quantized=False)
        module.config.quantization_config = config
    else:
        return
    module.is_quantized = True
    module.quantization_method = config.quant_method


def quantization_summary(module: nn.Module) -> Dict[str, object]:
    """Counts and bytes: quantized layers, their packed storage, and everything else (memory accounting)."""
    quantized = [m for m in module.modules() if is_quantized_linear(m)]
    q_bytes = sum(m.weight.quantized_nbytes() for m in quantized)
    q_ids = {id(m.weight) for m in quantized}
    other = 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in q_ids:
            other += t.numel() * t.element_size()
    return {
        "quantized_layers": len(quantized),
        "quantized_weight_bytes": q_bytes,
        "other_bytes": other,
        "total_bytes": q_bytes + other,
        "methods": sorted({m.weight.quant_method for m in quantized}),
    }
