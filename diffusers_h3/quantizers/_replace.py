"""Model surgery shared by ``quantize()`` and the diffusers / transformers quantizers: which ``nn.Linear`` layers a
config selects, the staged layout a loader fills (packed tensors in the checkpoint's names), folding it into
quantized weights after loading, the checks after loading, and dequantizing back to dense weights."""

from __future__ import annotations

from typing import Dict, Iterable, List, Type

import torch
from torch import nn

from .config import QuantizationConfigBase
from .layers import install_quantized_weight, is_quantized_linear
from .tensors import QuantizedTensor


def set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    """Replace the submodule at dotted path ``name`` of ``root`` by ``new``."""
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


def linears_to_quantize(
    module: nn.Module, config: QuantizationConfigBase, extra_skip: Iterable[str] = ()
) -> List[str]:
    """Dotted names of the ``nn.Linear`` layers ``config`` would quantize in ``module``."""
    extra_skip = list(extra_skip)
    return [name for name, sub in module.named_modules() if name and config.should_quantize(name, sub, extra_skip)]


def stage_for_loading(
    model: nn.Module, names: Iterable[str], weight_cls: Type[QuantizedTensor], config: QuantizationConfigBase,
    compute_dtype: torch.dtype,
) -> None:
    """Give the ``nn.Linear`` layers at ``names`` empty (meta) packed tensors under the checkpoint's names
    (``weight``, ``weight_scale``...), for a loader to fill; :func:`finish_loading` folds them into quantized weights."""
    options = weight_cls.full_options(config.layer_kwargs())
    for name in names:
        linear = model.get_submodule(name)
        weight_cls.check_options(linear.out_features, linear.in_features, options)
        for tensor_name, (shape, dtype) in weight_cls.storage_spec(linear.out_features, linear.in_features,
                                                                   options).items():  # fmt: skip
            empty = torch.empty(shape, dtype=dtype, device="meta")
            if tensor_name == "weight":
                linear.weight = nn.Parameter(empty, requires_grad=False)
            else:
                linear.register_buffer(tensor_name, empty)
        if linear.bias is not None:
            linear.bias = nn.Parameter(torch.empty_like(linear.bias, device="meta", dtype=compute_dtype),
                                       requires_grad=False)  # fmt: skip


def staged_tensors(linear: nn.Linear, weight_cls: Type[QuantizedTensor], config) -> Dict[str, torch.Tensor]:
    options = weight_cls.full_options(config.layer_kwargs())
    spec = weight_cls.storage_spec(linear.out_features, linear.in_features, options)
    return {name: linear.weight if name == "weight" else linear._buffers[name] for name in spec}


def finish_loading(model: nn.Module, names: Iterable[str], weight_cls: Type[QuantizedTensor], config,
                   compute_dtype: torch.dtype) -> List[str]:  # fmt: skip
    """Fold the staged packed tensors of the layers at ``names`` into quantized weights; return the state-dict keys
    that were never loaded (still on the meta device)."""
    missing = []
    for name in names:
        linear = model.get_submodule(name)
        if is_quantized_linear(linear):
            continue
        tensors = staged_tensors(linear, weight_cls, config)
        absent = [f"{name}.{key}" for key, t in tensors.items() if t.is_meta]
        if absent:
            missing += absent
            continue
        for key in tensors:
            if key != "weight":
                del linear._buffers[key]
        weight = weight_cls.from_storage({k: t.detach() for k, t in tensors.items()}, linear.out_features,
                                         linear.in_features, compute_dtype, **config.layer_kwargs())  # fmt: skip
        install_quantized_weight(linear, weight)
    return missing


def match_bias_dtype(model: nn.Module) -> None:
    """Biases of quantized layers in the compute dtype (a loader may have loaded them in another dtype)."""
    for module in model.modules():
        if is_quantized_linear(module) and module.bias is not None and module.bias.dtype != module.weight.dtype:
            module.bias = nn.Parameter(module.bias.detach().to(module.weight.dtype), requires_grad=False)


def storage_keys(model: nn.Module) -> List[str]:
    """State-dict keys of the packed storage (codes and scales) of every quantized layer of ``model``."""
    return [
        f"{name}.{key}"
        for name, module in model.named_modules()
        if is_quantized_linear(module)
        for key in module.weight.storage()
    ]


def raise_if_missing(missing: Iterable[str]) -> None:
    """The one error for quantized tensors a checkpoint should have held but did not."""
    missing = sorted(missing)
    if missing:
        raise ValueError(
            f"Quantized tensors missing from the checkpoint ({len(missing)}, e.g. {missing[:5]}). The checkpoint does "
            "not match this quantization config (another method, or a partial save)."
        )


def dequantize_layers(model: nn.Module, dtype=None) -> nn.Module:
    """Give every quantized layer of ``model`` a dense weight (its dequantized weight)."""
    for module in model.modules():
        if is_quantized_linear(module):
            dense_dtype = dtype or module.weight.dtype
            module.weight = nn.Parameter(module.weight.dequantize(dense_dtype))
            if module.bias is not None:
                module.bias = nn.Parameter(module.bias.detach().to(dense_dtype).clone())
    return model
