"""Quantized layers are plain ``nn.Linear`` modules whose ``weight`` is a quantized tensor (:mod:`.tensors`).

This module holds what a layer needs beside its weight: installing a quantized weight on an ``nn.Linear`` (with the
state-dict hooks that keep the on-disk layout), recognising such layers, and their ``describe()`` line.

On disk the layout is ModelOpt's export layout, as before the weights became tensors: ``<layer>.weight`` holds the
packed codes (int8, E2M1 pairs in uint8, or E4M3), ``<layer>.weight_scale`` (and ``<layer>.weight_scale_2`` for
NVFP4) the scales, ``<layer>.bias`` the bias. Two hooks registered on the layer instance (not on ``nn.Linear``)
translate: ``state_dict()`` writes the packed tensors under those names, ``load_state_dict()`` reads them back into
the quantized weight. A state dict that holds a dense ``weight`` (no scales) is quantized on load.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .tensors import QuantizedTensor


def quantized_weight(module: nn.Module) -> Optional[QuantizedTensor]:
    """The quantized weight of ``module`` (an ``nn.Linear`` or a PEFT layer over one), or ``None``."""
    weight = getattr(module, "weight", None) if isinstance(module, nn.Module) else None
    return weight if isinstance(weight, QuantizedTensor) else None


def is_quantized_linear(module: nn.Module) -> bool:
    """True for an ``nn.Linear`` whose weight is a diffusers-h3 quantized tensor."""
    return isinstance(module, nn.Linear) and isinstance(module.weight, QuantizedTensor)


def _packed_state_dict(module, state_dict, prefix, local_metadata):
    """state_dict post-hook: the quantized weight is written as its packed tensors (``weight``, ``weight_scale``...)."""
    weight = state_dict.get(prefix + "weight")
    if isinstance(weight, QuantizedTensor):
        del state_dict[prefix + "weight"]
        for name, tensor in weight.storage().items():
            state_dict[prefix + name] = tensor if tensor.is_meta else tensor.detach()


def _packed_model_state_dict(module, state_dict, prefix, local_metadata):
    """state_dict post-hook of a quantized model: quantized weights of layers built after quantization (diffusers'
    ``fuse_qkv_projections`` makes ``to_qkv`` from the quantized q/k/v weights) are written as packed tensors too."""
    for key in [k for k, v in state_dict.items() if isinstance(v, QuantizedTensor)]:
        layer_prefix = key[: -len("weight")]
        _packed_state_dict(None, state_dict, layer_prefix, local_metadata)


def register_packed_state_dict(model: nn.Module) -> None:
    """Make ``model.state_dict()`` write every quantized weight in the packed layout, also of layers made later."""
    if _packed_model_state_dict not in model._state_dict_hooks.values():
        model.register_state_dict_post_hook(_packed_model_state_dict)


def _load_packed(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """load_state_dict pre-hook: packed tensors become one quantized weight (copied into the layer's)."""
    weight = module.weight
    if not isinstance(weight, QuantizedTensor) or prefix + "weight" not in state_dict:
        return
    spec = weight.storage_spec(*weight.shape, weight.options)
    present = [name for name in spec if prefix + name in state_dict]
    if present == ["weight"]:
        return  # a dense weight: copy_ quantizes it
    tensors = {name: state_dict.pop(prefix + name) for name in present}
    state_dict[prefix + "weight"] = type(weight).from_storage(
        {name: t.to(weight.device) for name, t in tensors.items()}, *weight.shape, weight.dtype, **weight.options
    )


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor holds: the packed codes and scales for a quantized weight (not its dense shape)."""
    if isinstance(tensor, QuantizedTensor):
        return tensor.quantized_nbytes()
    return tensor.numel() * tensor.element_size()


def install_quantized_weight(linear: nn.Linear, weight: QuantizedTensor) -> nn.Linear:
    """Make ``weight`` the weight of ``linear`` (an ``nn.Parameter`` without gradient) and register the state-dict
    hooks of the packed layout on this instance (once)."""
    if tuple(weight.shape) != (linear.out_features, linear.in_features):
        raise ValueError(
            f"A quantized weight of shape {tuple(weight.shape)} does not fit a Linear({linear.in_features}, "
            f"{linear.out_features})."
        )
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if _packed_state_dict not in linear._state_dict_hooks.values():
        linear.register_state_dict_post_hook(_packed_state_dict)
    if not any(getattr(h, "hook", None) is _load_packed for h in linear._load_state_dict_pre_hooks.values()):
        linear.register_load_state_dict_pre_hook(_load_packed)
    return linear


def quantize_linear_(linear: nn.Linear, weight_cls, compute_dtype: Optional[torch.dtype] = None, **options):
    """Quantize the weight of a dense ``nn.Linear`` in place (its device is kept); returns ``linear``."""
    compute_dtype = compute_dtype or linear.weight.dtype
    weight = weight_cls.from_float(linear.weight.detach(), compute_dtype, **options)
    install_quantized_weight(linear, weight)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach().to(compute_dtype), requires_grad=False)
    return linear


def describe_layer(module: nn.Module) -> Optional[str]:
    """The ``describe()`` line of a quantized layer (or of a PEFT LoRA layer over one), or ``None`` for anything
    else."""
    weight = quantized_weight(module)
    if weight is None:
        return None
    lora_a = getattr(module, "lora_A", None)
    if not lora_a:
        return weight.describe_path()
    adapters = ", ".join(f"{a}(r={module.r[a]}, alpha={module.lora_alpha[a]:g})" for a in lora_a)
    if module.merged:
        how = f"fused into the re-quantized weight ({', '.join(module.merged_adapters)})"
    else:
        how = "unfused: PEFT's LoRA on the unquantized input, added to the quantized layer's output"
    return f"LoRA [{adapters}] over {weight.describe_path()}; {how}"
