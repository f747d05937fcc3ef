"""LoRA on diffusers-h3's quantized linears, through PEFT's custom-module dispatch.

PEFT wraps only layer types it knows (``nn.Linear``, bitsandbytes, GPTQ, ...); for anything else
``LoraModel._create_new_module`` raises "Target module ... is not supported" unless the ``LoraConfig`` carries a
custom mapping (``LoraConfig._register_custom_module``). This module provides

- :class:`QuantizedLoraLinear`, the PEFT ``LoraLayer`` that wraps one quantized linear: the base weight stays
  quantized and runs its own GEMM; the LoRA factors run on the *unquantized* input ``x`` in their own dtype and each
  delta is added to the base output inside one fp32-accumulating ``addmm``, before anything reduces the output
  (a tensor-parallel all-reduce included, since the sum happens inside the layer);
- :func:`register_quantized_lora_modules`, which adds that mapping to a ``LoraConfig`` (for PEFT's own
  ``get_peft_model`` / ``inject_adapter_in_model`` on a model with quantized layers);
- :func:`install_add_adapter_dispatch` (``import diffusers_h3`` calls it): diffusers' ``model.add_adapter(config)``
  registers that mapping on ``config`` itself when the model holds quantized layers, so PEFT's own injection path
  works on them (``set_adapters``, ``disable_adapters`` / ``enable_adapters``, ``delete_adapters``, ``fuse_lora`` /
  ``unfuse_lora`` and training then go through PEFT's usual layer API);
- :func:`quantized_lora_dispatch`, a context manager under which every ``LoraConfig`` diffusers builds while loading
  a LoRA (``load_lora_adapter`` / ``load_lora_weights``) carries the mapping. ``MiniMaxH3LoraMixin`` uses it.

Fusing (``fuse_lora``) into a quantized layer dequantizes the weight to float32, adds ``B @ A * scaling`` and
re-quantizes it with the layer's own ``requantize_`` (so the fused model keeps the quantized memory footprint and
kernel). The quantized tensors from before the first fuse are kept on the CPU, so ``unfuse_lora`` restores them
bit-exactly instead of subtracting the delta from an already re-quantized weight. That CPU copy costs the size of the
quantized weights of every fused layer; ``unfuse_lora`` releases it. Fusing costs accuracy: the fused weight is
rounded to the quantized format once more, while the unfused LoRA adds its delta exactly; the coarser the format,
the larger the loss (numbers per format in docs/lora.md). Prefer unfused LoRA on NVFP4 layers.

The quantized layer interface (``diffusers_h3.quantizers.layers.QuantizedLinear``): ``in_features``,
``out_features``, ``bias``, ``compute_dtype``, ``quant_method``, ``dequantize(dtype=None) -> Tensor[out, in]``,
``forward(x)``, ``describe_path()``, ``requantize_(dense_weight)``. Any module that implements it is dispatched here.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from diffusers.utils import logging
from peft.tuners.lora import LoraConfig, LoraLayer
from peft.tuners.tuners_utils import BaseTunerLayer, check_adapters_to_merge
from torch import nn

from .layers import QuantizedLinear


logger = logging.get_logger(__name__)

_INTERFACE = ("in_features", "out_features", "quant_method", "dequantize", "requantize_")


def is_quantized_linear(module: nn.Module) -> bool:
    """True for diffusers-h3 quantized linears (``QuantizedLinear`` or any module implementing its interface)."""
    if isinstance(module, BaseTunerLayer) or isinstance(module, nn.Linear):
        return False
    if isinstance(module, QuantizedLinear):
        return True
    return all(hasattr(module, name) for name in _INTERFACE)


def _quantized_types(model: Optional[nn.Module] = None) -> List[type]:
    types = [QuantizedLinear]
    if model is not None:
        for module in model.modules():
            if is_quantized_linear(module) and not any(isinstance(module, t) for t in types):
                types.append(type(module))
    return types


class QuantizedLoraLinear(nn.Module, LoraLayer):
    """PEFT LoRA layer over a diffusers-h3 quantized linear (W8A16, NVFP4, FP8).

    ``forward(x) = base(x) + sum_a scaling_a * B_a(A_a(x))``: ``base(x)`` is the quantized layer's own path (its
    kernel and numerics are unchanged, activation quantization included for FP8 / NVFP4-W4A4); each LoRA term runs on
    the original, unquantized ``x`` in the LoRA factors' dtype (the model's compute dtype, e.g. bf16: higher precision
    than the quantized base). ``B``'s product is fused with the add into one ``addmm`` on the base output (fp32
    accumulation, the add done in the GEMM epilogue, one rounding to the output dtype), in place under ``no_grad``:
    no extra output-sized buffer, which matters for H3's 28672-wide up-projection at ~38k rows. The whole sum happens
    inside this layer, so anything that reduces its output afterwards (a tensor-parallel all-reduce of a row-parallel
    shard) reduces base and LoRA together.
    """

    def __init__(
        self,
        base_layer: nn.Module,
        adapter_name: str,
        config: LoraConfig,
        r: int = 0,
        lora_alpha: int = 1,
        **kwargs: Any,
    ) -> None:
        if config.lora_bias:
            raise ValueError(
                "`lora_bias=True` is not supported on diffusers-h3 quantized layers: the bias lives in the quantized "
                "base layer. Load the LoRA without a `lora_B` bias."
            )
        super().__init__()
        LoraLayer.__init__(self, base_layer)
        self.fan_in_fan_out = False
        self._unmerged_state: Optional[Dict[str, torch.Tensor]] = None
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

    # --- PEFT plumbing -------------------------------------------------------------------------------------------
    def _get_in_out_features(self, module: nn.Module) -> Tuple[int, int]:
        return module.in_features, module.out_features

    def _get_base_layer_device_and_dtype(self, base_layer: nn.Module):
        device = None
        for tensor in list(base_layer.parameters()) + list(base_layer.buffers()):
            device = tensor.device
            break
        return device, getattr(base_layer, "compute_dtype", None)

    def resolve_lora_variant(self, *, config: LoraConfig, **kwargs):
        if config.use_dora or getattr(config, "velora_config", None) is not None:
            raise ValueError(
                "DoRA / LoRA variants are not supported on diffusers-h3 quantized layers. Load the base model "
                "unquantized (bf16) to use them."
            )
        return None

    # --- forward -------------------------------------------------------------------------------------------------
    def _add_lora_(self, result: torch.Tensor, x: torch.Tensor, adapters: List[str]) -> torch.Tensor:
        """``result + sum_a scaling_a * B_a(A_a(x))``, each term fused into one ``addmm`` (fp32 accumulation, the add
        in the GEMM epilogue, one rounding to the output dtype), in place when autograd does not need ``result``."""
        out = result.reshape(-1, self.out_features)
        in_place = not (torch.is_grad_enabled() and result.requires_grad)
        for adapter in adapters:
            lora_A, lora_B = self.lora_A[adapter], self.lora_B[adapter]
            h = lora_A(self.lora_dropout[adapter](x.to(lora_A.weight.dtype)))
            h = h.reshape(-1, h.shape[-1])  # not lora_A.out_features: hotswap preparation pads the rank in place
            weight_B, scaling = lora_B.weight, self.scaling[adapter]
            if h.dtype != out.dtype:
                h, weight_B = h.to(out.dtype), weight_B.to(out.dtype)
            if isinstance(scaling, torch.Tensor):  # hotswap-prepared layers keep scaling as a tensor
                h, scaling = h * scaling.to(h.dtype), 1.0
            if in_place:
                out.addmm_(h, weight_B.t(), alpha=scaling)
            else:
                out = torch.addmm(out, h, weight_B.t(), alpha=scaling)
        return out.reshape(result.shape)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._check_forward_args(x, *args, **kwargs)
        if kwargs.pop("adapter_names", None) is not None:
            raise ValueError(
                "Mixed-batch LoRA inference (`adapter_names=`) is not supported on diffusers-h3 quantized layers; "
                "use `set_adapters` instead."
            )
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        result = self.base_layer(x, *args, **kwargs)
        if self.merged:
            return result
        adapters = [a for a in self.active_adapters if a in self.lora_A]
        return self._add_lora_(result, x, adapters) if adapters else result

    # --- fuse / unfuse -------------------------------------------------------------------------------------------
    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        """``scaling * B @ A`` in float32, shape ``[out_features, in_features]``."""
        weight_A = self.lora_A[adapter].weight.float()
        weight_B = self.lora_B[adapter].weight.float()
        return (weight_B @ weight_A) * self.scaling[adapter]

    def merge(self, safe_merge: bool = False, adapter_names: Optional[List[str]] = None) -> None:
        """Fuse adapters into the quantized weight: ``requantize_(dequantize(float32) + sum of deltas)``."""
        adapter_names = check_adapters_to_merge(self, adapter_names)
        adapter_names = [a for a in adapter_names if a in self.lora_A]
        if not adapter_names:
            return
        base = self.get_base_layer()
        if not callable(getattr(base, "requantize_", None)):
            raise ValueError(
                f"Cannot fuse a LoRA into {type(base).__name__}: it has no `requantize_(dense_weight)`. Keep the "
                "LoRA unfused (it runs beside the quantized GEMM), or load the model unquantized to fuse."
            )
        weight = base.dequantize(torch.float32).float()
        for adapter in adapter_names:
            weight = weight + self.get_delta_weight(adapter).to(weight.device)
        if safe_merge and not torch.isfinite(weight).all():
            raise ValueError(f"NaNs or infs in the fused weight; the adapter(s) {adapter_names} seem to be broken.")
        if self._unmerged_state is None:
            self._unmerged_state = {k: v.detach().to("cpu", copy=True) for k, v in base.state_dict().items()}
        base.requantize_(weight)
        self.merged_adapters.extend(adapter_names)

    def unmerge(self) -> None:
        """Restore the quantized tensors saved before the first fuse (bit-exact)."""
        if not self.merged:
            logger.warning("Already unmerged. Nothing to do.")
            return
        base = self.get_base_layer()
        saved = self._unmerged_state
        if saved is None:
            raise RuntimeError("Internal error: a fused quantized LoRA layer lost its saved weights.")
        with torch.no_grad():
            for name, tensor in base.state_dict().items():
                tensor.copy_(saved[name].to(tensor.device))
        self.merged_adapters.clear()
        self._unmerged_state = None

    # --- reporting -----------------------------------------------------------------------------------------------
    def describe_path(self) -> str:
        base = self.get_base_layer()
        base_path = base.describe_path() if callable(getattr(base, "describe_path", None)) else type(base).__name__
        adapters = ", ".join(f"{a}(r={self.r[a]}, alpha={self.lora_alpha[a]:g})" for a in self.lora_A)
        if self.merged:
            how = f"fused into the re-quantized weight ({', '.join(self.merged_adapters)})"
        else:
            how = "unfused: LoRA on the unquantized input, added to the base output in one fp32-accumulating addmm"
        return f"LoRA [{adapters}] over {base_path}; {how}"

    def __repr__(self) -> str:
        return "lora." + super().__repr__()


def register_quantized_lora_modules(config: LoraConfig, model: Optional[nn.Module] = None) -> LoraConfig:
    """Make ``config`` dispatch diffusers-h3 quantized linears (of ``model``, if given) to
    :class:`QuantizedLoraLinear`. Use before ``model.add_adapter(config)``; returns ``config``."""
    mapping = dict.fromkeys(_quantized_types(model), QuantizedLoraLinear)
    if mapping:
        config._register_custom_module(mapping)
    return config


_PATCH_LOCK = threading.RLock()


@contextlib.contextmanager
def quantized_lora_dispatch(model: Optional[nn.Module] = None) -> Iterator[None]:
    """While active, every ``LoraConfig`` diffusers creates when loading a LoRA (``load_lora_adapter``) dispatches
    diffusers-h3 quantized linears to :class:`QuantizedLoraLinear`.

    diffusers builds that config inside ``load_lora_adapter`` (``diffusers.loaders.peft._create_lora_config``) with no
    hook for custom modules, so the function is wrapped for the duration of the block. The wrapper only *adds* a
    mapping for quantized layer types; configs for models without them are unchanged.
    """
    import diffusers.loaders.peft as diffusers_peft

    types = _quantized_types(model)
    with _PATCH_LOCK:
        original = diffusers_peft._create_lora_config
        if types:

            def _create_lora_config_with_quantized(*args, **kwargs):
                config = original(*args, **kwargs)
                config._register_custom_module(dict.fromkeys(types, QuantizedLoraLinear))
                return config

            diffusers_peft._create_lora_config = _create_lora_config_with_quantized
        try:
            yield
        finally:
            diffusers_peft._create_lora_config = original


def install_add_adapter_dispatch() -> None:
    """Make diffusers' ``PeftAdapterMixin.add_adapter`` dispatch diffusers-h3 quantized linears to
    :class:`QuantizedLoraLinear` (idempotent).

    PEFT's documented extension point for layer types it does not know is the config's custom-module mapping
    (``LoraConfig._register_custom_module``); diffusers passes the user's ``LoraConfig`` straight to PEFT, so the
    mapping is added to that config here, and only when the model holds quantized layers (configs for other models
    are passed on unchanged).
    """
    from diffusers.loaders.peft import PeftAdapterMixin

    add_adapter = PeftAdapterMixin.add_adapter
    if getattr(add_adapter, "_diffusers_h3_quantized", False):
        return

    @functools.wraps(add_adapter)
    def add_adapter_with_quantized_layers(self, adapter_config, *args, **kwargs):
        if isinstance(adapter_config, LoraConfig) and any(is_quantized_linear(m) for m in self.modules()):
            register_quantized_lora_modules(adapter_config, self)
        return add_adapter(self, adapter_config, *args, **kwargs)

    add_adapter_with_quantized_layers._diffusers_h3_quantized = True
    PeftAdapterMixin.add_adapter = add_adapter_with_quantized_layers
