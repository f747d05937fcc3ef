"""Module surgery shared by ``quantize()`` and the diffusers / transformers quantizers: which ``nn.Linear`` layers a
config selects, putting a new module at a dotted path, the empty quantized layers a loader fills, the checks after
loading, and dequantizing back to ``nn.Linear``."""

from __future__ import annotations

from typing import Iterable, List, Type

import torch
from torch import nn

from .config import QuantizationConfigBase
from .layers import QuantizedLinear


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


def swap_to_empty_quantized(
    model: nn.Module,
    names: Iterable[str],
    layer_cls: Type[QuantizedLinear],
    config: QuantizationConfigBase,
    compute_dtype: torch.dtype,
) -> None:
    """Put empty quantized layers (meta device) at ``names``; a loader fills their storage from a checkpoint."""
    for name in names:
        linear = model.get_submodule(name)
        with torch.device("meta"):
            layer = layer_cls(
                linear.in_features, linear.out_features, bias=linear.bias is not None, compute_dtype=compute_dtype,
                **config.layer_kwargs(),
            )  # fmt: skip
        set_submodule(model, name, layer)


def storage_keys(model: nn.Module) -> List[str]:
    """State-dict keys of the packed storage (codes and scales) of every quantized layer of ``model``."""
    return [
        f"{name}.{buffer}"
        for name, module in model.named_modules()
        if isinstance(module, QuantizedLinear)
        for buffer in module._storage_spec()
    ]


def storage_mismatch(layer: QuantizedLinear, tensor_name: str, shape, dtype) -> str:
    """The one-line error for a checkpoint tensor of the wrong shape / dtype for ``layer`` ("" when it fits)."""
    expected_shape, expected_dtype = layer._storage_spec()[tensor_name]
    if tuple(shape) == tuple(expected_shape) and dtype == expected_dtype:
        return ""
    return (
        f"the checkpoint holds shape {tuple(shape)} ({dtype}) but a {layer.quant_method} layer of this model "
        f"({layer.out_features}x{layer.in_features}) expects {tuple(expected_shape)} ({expected_dtype}). The checkpoint "
        "was quantized with another method or for another model config; load it with the config it was saved with "
        "(config.json 'quantization_config')."
    )


def raise_if_missing(missing: Iterable[str]) -> None:
    """The one error for quantized tensors a checkpoint should have held but did not."""
    missing = sorted(missing)
    if missing:
        raise ValueError(
            f"Quantized tensors missing from the checkpoint ({len(missing)}, e.g. {missing[:5]}). The checkpoint does "
            "not match this quantization config (another method, or a partial save)."
        )


def dequantize_layers(model: nn.Module, dtype=None) -> nn.Module:
    """Replace every quantized layer of ``model`` by a dense ``nn.Linear`` holding its dequantized weight."""
    for name, module in list(model.named_modules()):
        if isinstance(module, QuantizedLinear):
            dense_dtype = dtype or module.compute_dtype
            dense = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                              device=module.weight.device, dtype=dense_dtype)  # fmt: skip
            dense.weight.data = module.dequantize(dense_dtype)
            if module.bias is not None:
                dense.bias.data = module.bias.detach().to(dense_dtype).clone()
            set_submodule(model, name, dense)
    return model
