"""``fuse_qkv_projections()`` on models whose attention projections are diffusers-h3 quantized layers.

diffusers' ``AttentionModuleMixin.fuse_projections`` stacks ``to_q`` / ``to_k`` / ``to_v`` ``.weight`` into a new
``nn.Linear``, which fails on packed int8 / E4M3 storage. :func:`install_quantized_projection_fusion` wraps it (and
the model-level ``AttentionMixin.fuse_qkv_projections``) so that quantized projections are fused by
:meth:`~.layers.QuantizedLinear.concatenate_outputs`: the packed codes and their per-output-row scales are stacked,
nothing is re-quantized, and the fused layer runs the same kernel. W8A16 (per-channel or grouped scales) and FP8
(per-channel weight scales; the per-token activation scale depends on the input only) fuse exactly. NVFP4 is refused:
its per-tensor ``weight_scale_2`` differs per projection. A model that cannot be fused is refused with one line before
any attention module is changed. ``unfuse_qkv_projections()`` is diffusers' own (it drops ``to_qkv``).
Dense attention modules keep diffusers' code path unchanged.
"""

from __future__ import annotations

import functools
from typing import List, Optional, Tuple

import torch
from diffusers.models.attention import AttentionMixin, AttentionModuleMixin
from torch import nn

from .layers import QuantizedLinear


def _groups(attn: nn.Module) -> List[Tuple[str, Tuple[str, ...]]]:
    """``(fused name, projection names)`` that diffusers' ``fuse_projections`` builds for ``attn``."""
    groups = [("to_kv", ("to_k", "to_v")) if getattr(attn, "is_cross_attention", False) else
              ("to_qkv", ("to_q", "to_k", "to_v"))]  # fmt: skip
    added = ("add_q_proj", "add_k_proj", "add_v_proj")
    if all(getattr(attn, name, None) is not None for name in added):
        groups.append(("to_added_qkv", added))
    return groups


def _has_quantized_projection(attn: nn.Module) -> bool:
    from peft.tuners.tuners_utils import BaseTunerLayer

    for _, names in _groups(attn):
        for name in names:
            layer = getattr(attn, name, None)
            if isinstance(layer, BaseTunerLayer):
                layer = layer.get_base_layer()
            if isinstance(layer, QuantizedLinear):
                return True
    return False


def _fusion_problem(attn: nn.Module) -> Optional[str]:
    """Why the quantized projections of ``attn`` cannot be fused (one line), or ``None``."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for _, names in _groups(attn):
        layers = [getattr(attn, name) for name in names]
        if any(isinstance(layer, BaseTunerLayer) for layer in layers):
            return (
                "a LoRA adapter wraps the quantized projections; fuse_lora() and unload the adapter (or delete it) "
                "before fuse_qkv_projections()"
            )
        if all(type(layer) is nn.Linear for layer in layers):
            continue
        problem = QuantizedLinear.concatenation_problem(layers)
        if problem is not None:
            return problem
    return None


@torch.no_grad()
def _fuse_quantized_projections(attn: nn.Module) -> None:
    for fused_name, names in _groups(attn):
        layers = [getattr(attn, name) for name in names]
        if all(type(layer) is nn.Linear for layer in layers):  # a dense group beside a quantized one
            weight = torch.cat([layer.weight for layer in layers])
            fused = nn.Linear(weight.shape[1], weight.shape[0], bias=layers[0].bias is not None,
                              device=weight.device, dtype=weight.dtype)  # fmt: skip
            fused.weight.copy_(weight)
            if fused.bias is not None:
                fused.bias.copy_(torch.cat([layer.bias for layer in layers]))
        else:
            fused = QuantizedLinear.concatenate_outputs(layers)
        setattr(attn, fused_name, fused)
    attn.fused_projections = True


def _refusal(attn: nn.Module, problem: str) -> ValueError:
    return ValueError(f"fuse_qkv_projections() cannot fuse the quantized projections of {type(attn).__name__}: {problem}.")


def install_quantized_projection_fusion() -> None:
    """Make diffusers' ``fuse_qkv_projections()`` / ``fuse_projections()`` fuse diffusers-h3 quantized projections
    (idempotent; ``import diffusers_h3`` calls it)."""
    module_fuse = AttentionModuleMixin.fuse_projections
    if not getattr(module_fuse, "_diffusers_h3_quantized", False):

        @functools.wraps(module_fuse)
        def fuse_projections(self, *args, **kwargs):
            if (not self._supports_qkv_fusion or getattr(self, "fused_projections", False)
                    or not _has_quantized_projection(self)):  # fmt: skip
                return module_fuse(self, *args, **kwargs)
            problem = _fusion_problem(self)
            if problem is not None:
                raise _refusal(self, problem)
            _fuse_quantized_projections(self)

        fuse_projections._diffusers_h3_quantized = True
        AttentionModuleMixin.fuse_projections = fuse_projections

    model_fuse = AttentionMixin.fuse_qkv_projections
    if not getattr(model_fuse, "_diffusers_h3_quantized", False):

        @functools.wraps(model_fuse)
        def fuse_qkv_projections(self, *args, **kwargs):
            # Check every attention module first, so that a refusal leaves the whole model unfused.
            for module in self.modules():
                if (isinstance(module, AttentionModuleMixin) and module._supports_qkv_fusion
                        and not getattr(module, "fused_projections", False) and _has_quantized_projection(module)):  # fmt: skip
                    problem = _fusion_problem(module)
                    if problem is not None:
                        raise _refusal(module, problem)
            return model_fuse(self, *args, **kwargs)

        fuse_qkv_projections._diffusers_h3_quantized = True
        AttentionMixin.fuse_qkv_projections = fuse_qkv_projections
