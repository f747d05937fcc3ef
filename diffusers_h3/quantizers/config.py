"""Quantization configs of diffusers-h3: ``W8A16Config``, ``NVFP4Config``, ``FP8Config``.

They subclass both diffusers' and transformers' ``QuantizationConfigMixin`` (one config for the DiT and the text
encoder; each library's auto maps know the method once registered); their ``quant_method`` is a :class:`QuantMethod` (a string
with diffusers' ``.value``). The method names carry an ``h3_`` prefix so they never clash with methods diffusers or
transformers already own (transformers owns ``"nvfp4"`` and ``"fp8"``). A config class gets its method when its format
is registered (:func:`diffusers_h3.quantizers.registry.register_format`), the one place that names it.

Which ``nn.Linear`` layers are quantized (:meth:`QuantizationConfigBase.should_quantize`):

- ``modules_to_not_convert=None`` (default): every ``nn.Linear`` except input / output projections and embedders
  (:data:`DEFAULT_MODULES_TO_NOT_CONVERT`, which includes H3's ``_keep_in_fp32_modules``), every module whose name
  has a component containing ``"norm"`` (e.g. ``norm_out.linear``), and, when loading through ``from_pretrained``,
  the model's own ``_keep_in_fp32_modules``.
- An explicit list replaces the defaults: the listed names are kept (a name matches a module when it equals the
  module's dotted name, one of its dotted components, or a dotted sub-path of it), and still, as diffusers' own
  quantizers do, the model's ``_keep_in_fp32_modules`` and every layer whose shape the format cannot hold.

The AdaLN projections ``transformer_blocks.*.adaln_proj.linear`` (a large share of H3's parameters) **are quantized**
by default: without them the weights cannot shrink to about half (W8A16) or under a third (NVFP4) of bf16's
(docs/quantization.md), and their GEMM has one row per distinct timestep, so quantizing them costs no speed. Add
``"adaln_proj"`` to ``modules_to_not_convert`` to keep them in 16-bit.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional

import torch
from diffusers.quantizers.quantization_config import QuantizationConfigMixin
from transformers.utils.quantization_config import QuantizationConfigMixin as TransformersQuantizationConfigMixin


DEFAULT_MODULES_TO_NOT_CONVERT: List[str] = [
    # MiniMaxH3Transformer3DModel._keep_in_fp32_modules
    "proj_in",
    "audio_proj_in",
    "time_embedder",
    "proj_out",
    "audio_proj_out",
    "rope",
    # other input projections / embedders / heads
    "context_embedder",
    "time_proj",
    "lm_head",
    "embed_tokens",
]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class QuantMethod(str):
    """The ``quant_method`` of a config: the string diffusers stores in ``config.json`` and keys its auto maps with,
    with the ``.value`` diffusers reads from its own ``QuantizationMethod`` enum members."""

    __slots__ = ()

    @property
    def value(self) -> str:
        return str(self)

    def __repr__(self) -> str:
        return f"QuantMethod({str(self)!r})"


def _dtype_from(value) -> Optional[torch.dtype]:
    if value is None or isinstance(value, torch.dtype):
        return value
    name = str(value).replace("torch.", "")
    if name not in _DTYPES:
        raise ValueError(f"compute_dtype must be one of {sorted(_DTYPES)} (or None), got {value!r}.")
    return _DTYPES[name]


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}.")
    return value


def module_name_matches(name: str, patterns: Iterable[str]) -> bool:
    """True when ``name`` (dotted module path) matches a pattern: full name, a component, or a dotted sub-path."""
    dotted = f".{name}."
    return any(p and (p == name or f".{p}." in dotted) for p in patterns)


class QuantizationConfigBase(QuantizationConfigMixin, TransformersQuantizationConfigMixin):
    """A config of both libraries (diffusers' and transformers' ``QuantizationConfigMixin``): the same object
    quantizes the DiT and the text encoder, and travels in each one's ``config.json``.

    Shared fields: ``modules_to_not_convert``, ``compute_dtype`` (None: the dtype of each dense weight),
    ``backend`` (``"auto"`` picks the kernel per device; others force one path, see each layer's docstring).

    ``quant_method`` is a class attribute set by ``register_format``."""

    quant_method: Optional[QuantMethod] = None
    allowed_backends = ("auto", "torch", "dequant")

    def __init__(
        self,
        modules_to_not_convert: Optional[List[str]] = None,
        compute_dtype: Optional[torch.dtype] = None,
        backend: str = "auto",
        **kwargs,
    ):
        kwargs.pop("quant_method", None)
        if type(self).quant_method is None:
            raise TypeError(
                f"{type(self).__name__} has no quant_method: register its format first "
                "(diffusers_h3.quantizers.register_format(...))."
            )
        if kwargs:
            raise TypeError(f"{type(self).__name__} got unexpected arguments {sorted(kwargs)}.")
        if modules_to_not_convert is not None and (
            isinstance(modules_to_not_convert, str) or not all(isinstance(m, str) for m in modules_to_not_convert)
        ):
            raise TypeError("modules_to_not_convert must be a list of module names (strings) or None.")
        if backend not in self.allowed_backends:
            raise ValueError(
                f"{type(self).__name__} backend must be one of {self.allowed_backends}, got {backend!r}."
            )
        self.modules_to_not_convert = list(modules_to_not_convert) if modules_to_not_convert is not None else None
        self.compute_dtype = _dtype_from(compute_dtype)
        self.backend = backend

    # -- selection -------------------------------------------------------------------------------------------------
    def should_quantize(self, name: str, module: torch.nn.Module, extra_skip: Iterable[str] = ()) -> bool:
        """Whether the module at dotted path ``name`` is replaced by a quantized layer."""
        if type(module) is not torch.nn.Linear or type(module.weight) not in (torch.Tensor, torch.nn.Parameter):
            return False  # not a dense nn.Linear (a subclass, or already quantized)
        # `extra_skip`: the model's `_keep_in_fp32_modules`, kept whatever the list says (as diffusers' quantizers do).
        if module_name_matches(name, list(extra_skip)):
            return False
        if self.modules_to_not_convert is not None:
            if module_name_matches(name, self.modules_to_not_convert):
                return False
        elif module_name_matches(name, DEFAULT_MODULES_TO_NOT_CONVERT) or any("norm" in p for p in name.split(".")):
            return False
        return self.supports_shape(module.in_features, module.out_features)

    def supports_shape(self, in_features: int, out_features: int) -> bool:
        return True

    # -- serialization -----------------------------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        out = dict(self.__dict__)
        out["quant_method"] = str(self.quant_method)
        out["compute_dtype"] = None if self.compute_dtype is None else str(self.compute_dtype).replace("torch.", "")
        return out

    def to_diff_dict(self) -> Dict[str, Any]:
        return self.to_dict()

    def layer_kwargs(self) -> Dict[str, Any]:
        return {"backend": self.backend}


class W8A16Config(QuantizationConfigBase):
    """Int8 weights, per-output-channel fp32 scales (or one scale per ``group_size`` input columns), 16-bit
    activations.

    On SM80+ GPUs, calls with fewer than ``large_m_rows`` rows run the fused Triton GEMM (int8 dequantized in
    registers); from ``large_m_rows`` rows on (compute-bound prefill, e.g. H3's 38k rows) a Triton kernel dequantizes
    the layer into a 16-bit scratch weight and cuBLAS does the GEMM (faster there than the fused kernel; docs/quantization.md).
    Other GPUs (V100): dequantize + cuBLAS fallback, reported by ``describe()``. CPU: the torch reference.
    ``backend`` forces one path: ``"triton"``, ``"triton_dequant"``, ``"torch"``, ``"dequant"``."""

    allowed_backends = ("auto", "triton", "triton_dequant", "torch", "dequant")

    def __init__(self, group_size: Optional[int] = None, large_m_rows: int = 1024, **kwargs):
        if group_size is not None and (not isinstance(group_size, int) or group_size <= 0 or group_size % 16):
            raise ValueError(f"group_size must be None or a positive multiple of 16, got {group_size!r}.")
        self.group_size = group_size
        self.large_m_rows = _positive_int("large_m_rows", large_m_rows)
        super().__init__(**kwargs)

    def supports_shape(self, in_features, out_features):
        return self.group_size is None or in_features % self.group_size == 0

    def layer_kwargs(self):
        return {"backend": self.backend, "group_size": self.group_size, "large_m_rows": self.large_m_rows}


class NVFP4Config(QuantizationConfigBase):
    """NVFP4 weights (E2M1 + E4M3 per-16 scales + fp32 tensor scale; ModelOpt layout).

    ``activation=None`` (default): weight-only, same numerics on every device -- on SM80+ the fused Triton GEMM below
    ``large_m_rows`` rows and Triton dequantization + cuBLAS from there (as :class:`W8A16Config`); dequantize + cuBLAS
    on other GPUs; the torch reference on CPU. ``activation="nvfp4"``: W4A4 through flashinfer ``mm_fp4`` on SM100+
    (**not run on hardware**: emulation-tested), fp32 emulation elsewhere. Layers with ``in_features % 16 != 0`` stay
    unquantized."""

    allowed_backends = ("auto", "triton", "triton_dequant", "torch", "dequant", "flashinfer")

    def __init__(self, activation: Optional[str] = None, large_m_rows: int = 1024, **kwargs):
        if activation not in (None, "nvfp4"):
            raise ValueError(f"activation must be None (weight-only) or 'nvfp4' (W4A4), got {activation!r}.")
        self.activation = activation
        self.large_m_rows = _positive_int("large_m_rows", large_m_rows)
        super().__init__(**kwargs)

    def supports_shape(self, in_features, out_features):
        return in_features % 16 == 0

    def layer_kwargs(self):
        return {"backend": self.backend, "activation": self.activation, "large_m_rows": self.large_m_rows}


class FP8Config(QuantizationConfigBase):
    """E4M3 weights with per-output-channel scales; activations quantized per token at run time (fused Triton
    kernel) and multiplied with ``torch._scaled_mm`` on SM89+. Elsewhere the weight is dequantized (16-bit GEMM)."""

    allowed_backends = ("auto", "scaled_mm", "torch", "dequant")

    def __init__(self, use_fast_accum: bool = True, **kwargs):
        self.use_fast_accum = bool(use_fast_accum)
        super().__init__(**kwargs)

    def layer_kwargs(self):
        return {"backend": self.backend, "use_fast_accum": self.use_fast_accum}
