"""Quantized weights as tensor subclasses: :class:`W8A16Tensor`, :class:`NVFP4Tensor`, :class:`FP8Tensor`.

A quantized layer stays an ``nn.Linear``; only its ``weight`` changes: an ``nn.Parameter`` holding one of these
tensors (torchao's design). The tensor looks like the dense weight (shape ``[out, in]``, dtype = the compute dtype)
and holds the packed codes and scales inside; ``F.linear`` on it runs the format's GEMM entry point
(``diffusers_h3.kernels.gemm``), so PEFT's ``lora.Linear``, diffusers' group offloading, ``state_dict``,
``torch.compile`` and slicing for fused / sharded projections see an ordinary ``nn.Linear``.

One class per format (not one class with a format field): each format has its own inner tensors and options, and
``register_format`` binds one class to one ``quant_method``, like torchao's per-format tensors. They are built on
``torch.Tensor._make_wrapper_subclass`` directly: torchao is not a dependency, and its base class would bring a
package for the few aten ops written here.

The operations the ecosystem needs are implemented (:data:`_OPS`): ``detach`` / ``alias``, ``_to_copy`` (a device
move keeps the packed dtypes; a floating dtype changes the compute dtype), ``clone``, ``copy_`` (from the same format:
the packed tensors; from a dense tensor: its quantization), ``slice`` along the output rows or (where no scale group
is split) the input columns, ``cat`` along the output rows, ``pin_memory`` / ``is_pinned`` / ``record_stream``, and
``add_`` / ``sub_`` with a dense delta (LoRA merge: dequantize, add, re-quantize; the last ``sub_`` restores the
packed tensors from before the first ``add_`` bit-exactly). ``.data = other`` takes ``other``'s inner tensors (PEFT
and diffusers' group offloading move parameters that way). Anything else raises one line naming the op.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from .._utils import cuda_capability, has_fp8_tensor_cores, warn_once
from ..kernels.gemm import (
    LARGE_M_ROWS,
    flashinfer_fp4_available,
    fp8_dequantize,
    fp8_linear,
    fp8_quantize_weight,
    fp8_scaled_mm_supported,
    nvfp4_dequantize,
    nvfp4_linear,
    nvfp4_quantize,
    triton_gemm_supported,
    w8a16_dequantize,
    w8a16_linear,
    w8a16_quantize,
)
from ..kernels.gemm.fp8 import _AMAX_EPS as FP8_AMAX_EPS
from ..kernels.gemm.fp8 import SCALED_MM_MIN_ROWS, fp8_small_m_product
from ..kernels.numerics import E4M3_MAX, to_e4m3


aten = torch.ops.aten

# state-dict name (ModelOpt export layout) -> inner tensor attribute
STORAGE_ATTRS = {"weight": "qdata", "weight_scale": "scale", "weight_scale_2": "scale_2"}


class _MergeState:
    """Shared by a weight and its aliases (``detach``, ``.data``): the packed tensors from before the first LoRA
    merge (on the CPU) and how many merges are applied."""

    def __init__(self):
        self.original: Optional[Dict[str, torch.Tensor]] = None
        self.depth = 0


class QuantizedTensor(torch.Tensor):
    """Base class; a format's subclass defines ``storage_spec``, ``pack``, ``_select``, ``_run`` and
    ``dequantize`` (``quant_method`` comes from ``register_format``)."""

    quant_method: str = ""
    layer_label: str = ""  # the layer name describe() lines start with (e.g. "W8A16Linear")
    option_names: Tuple[str, ...] = ("backend",)

    @staticmethod
    def __new__(cls, tensors: Dict[str, torch.Tensor], shape, dtype: torch.dtype, options: Dict[str, object]):
        qdata = tensors["qdata"]
        return torch.Tensor._make_wrapper_subclass(
            cls, tuple(shape), dtype=dtype, device=qdata.device, requires_grad=False
        )

    def __init__(self, tensors, shape, dtype, options):
        for name, value in tensors.items():
            setattr(self, name, value)
        self.options = dict(options)
        self._merge = _MergeState()
        self.input_shard_group = None

    # -- construction ------------------------------------------------------------------------------------------------
    @classmethod
    def storage_spec(cls, out_features: int, in_features: int, options) -> Dict[str, Tuple[tuple, torch.dtype]]:
        """``{state-dict name: (shape, dtype)}`` of the packed tensors of an ``[out, in]`` weight."""
        raise NotImplementedError

    @classmethod
    def check_options(cls, out_features: int, in_features: int, options) -> None:
        """Raise one line when an ``[out, in]`` weight cannot take this format with ``options``."""

    @classmethod
    def pack(cls, dense: torch.Tensor, options) -> Dict[str, torch.Tensor]:
        """Quantize a dense ``[out, in]`` weight: its packed tensors by state-dict name."""
        raise NotImplementedError

    @classmethod
    def from_float(cls, dense: torch.Tensor, dtype: Optional[torch.dtype] = None, **options) -> "QuantizedTensor":
        """Quantize a dense ``[out, in]`` weight; ``dtype`` (default: the weight's) is the compute dtype."""
        if dense.device.type == "meta":
            raise ValueError("Cannot quantize a weight on the meta device; load the weight first.")
        options = cls.full_options(options)
        cls.check_options(dense.shape[0], dense.shape[1], options)
        inner = {STORAGE_ATTRS[name]: t for name, t in cls.pack(dense, options).items()}
        return cls(inner, dense.shape, dtype or dense.dtype, options)

    @classmethod
    def full_options(cls, options) -> Dict[str, object]:
        defaults = {"backend": "auto"}
        defaults.update(cls._default_options())
        unknown = set(options) - set(defaults)
        if unknown:
            raise TypeError(f"{cls.__name__} takes the options {sorted(defaults)}, got {sorted(unknown)}.")
        return {**defaults, **options}

    @classmethod
    def _default_options(cls) -> Dict[str, object]:
        return {}

    @classmethod
    def normalize_loaded(cls, name: str, value: torch.Tensor, out_features: int) -> torch.Tensor:
        """Accept equivalent layouts of other exporters (e.g. ``[N, 1]`` scales)."""
        return value

    @classmethod
    def storage_mismatch(cls, out_features, in_features, options, name, shape, dtype) -> str:
        """The one-line error for a checkpoint tensor of the wrong shape / dtype ("" when it fits)."""
        spec = cls.storage_spec(out_features, in_features, options)
        if name not in spec:
            return f"{cls.__name__} has no quantized tensor {name!r} (expected {sorted(spec)})"
        expected_shape, expected_dtype = spec[name]
        if tuple(shape) == tuple(expected_shape) and dtype == expected_dtype:
            return ""
        return (
            f"the checkpoint holds shape {tuple(shape)} ({dtype}) but a {cls.quant_method} layer of this model "
            f"({out_features}x{in_features}) expects {tuple(expected_shape)} ({expected_dtype}). The checkpoint was "
            "quantized with another method or for another model config; load it with the config it was saved with "
            "(config.json 'quantization_config')."
        )

    @classmethod
    def from_storage(cls, tensors: Dict[str, torch.Tensor], out_features: int, in_features: int,
                     dtype: torch.dtype, **options) -> "QuantizedTensor":  # fmt: skip
        """Build a weight from its packed tensors by state-dict name (from a checkpoint), after checking them."""
        options = cls.full_options(options)
        cls.check_options(out_features, in_features, options)
        spec = cls.storage_spec(out_features, in_features, options)
        if set(tensors) != set(spec):
            raise ValueError(
                f"{cls.__name__}: the quantized tensors are {sorted(tensors)}, the {cls.quant_method} layout needs "
                f"{sorted(spec)}."
            )
        inner = {}
        for name, value in tensors.items():
            value = cls.normalize_loaded(name, value, out_features)
            problem = cls.storage_mismatch(out_features, in_features, options, name, value.shape, value.dtype)
            if problem:
                raise ValueError(f"{cls.__name__}.{name}: {problem}")
            inner[STORAGE_ATTRS[name]] = value
        return cls(inner, (out_features, in_features), dtype, options)

    # -- the inner tensors ---------------------------------------------------------------------------------------------
    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    def inner_names(self) -> Tuple[str, ...]:
        return tuple(STORAGE_ATTRS[name] for name in self.storage_spec(*self.shape, self.options))

    def storage(self) -> Dict[str, torch.Tensor]:
        """The packed tensors by state-dict name (``weight``, ``weight_scale``[, ``weight_scale_2``])."""
        return {name: getattr(self, STORAGE_ATTRS[name]) for name in self.storage_spec(*self.shape, self.options)}

    def quantized_nbytes(self) -> int:
        """Bytes of the packed codes and scales."""
        return sum(t.numel() * t.element_size() for t in self.storage().values())

    def nelement(self) -> int:
        """The packed bytes in units of the logical element size (rounded up), so that `nelement() * element_size()`
        — the footprint formula of diffusers' and transformers' `get_memory_footprint` — counts what the weight holds,
        not its dense size. `numel()` (the shape's element count, which everything else reads) is unchanged."""
        return -(-self.quantized_nbytes() // self.element_size())

    def _with(self, tensors=None, shape=None, dtype=None, share_merge: bool = True) -> "QuantizedTensor":
        inner = {name: getattr(self, name) for name in self.inner_names()}
        inner.update(tensors or {})
        new = type(self)(inner, shape or self.shape, dtype or self.dtype, self.options)
        new.input_shard_group = self.input_shard_group
        if share_merge:
            new._merge = self._merge
        return new

    def _map(self, fn, **kwargs) -> "QuantizedTensor":
        return self._with({name: fn(getattr(self, name)) for name in self.inner_names()}, **kwargs)

    def __tensor_flatten__(self):
        return list(self.inner_names()), (tuple(sorted(self.options.items())), self.dtype)

    @classmethod
    def __tensor_unflatten__(cls, inner_tensors, ctx, outer_size, outer_stride):
        options, dtype = ctx
        return cls(dict(inner_tensors), outer_size, dtype, dict(options))

    def __repr__(self):
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return (f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}, "
                f"{opts})")  # fmt: skip

    # ``param.data = other``: torch's setter replaces only the wrapper's metadata, not the inner tensors (PEFT and
    # diffusers' group offloading move parameters this way), so take ``other``'s inner tensors too.
    @property
    def data(self):
        return self.detach()

    @data.setter
    def data(self, other):
        if type(other) is not type(self) or tuple(other.shape) != tuple(self.shape):
            raise TypeError(
                f"Cannot set the data of a {type(self).__name__} {tuple(self.shape)} to a {type(other).__name__} "
                f"{tuple(other.shape)}; assign a new nn.Parameter to the module instead."
            )
        torch._C.TensorBase.data.__set__(self, other)
        for name in other.inner_names():
            setattr(self, name, getattr(other, name))
        self.options = dict(other.options)
        self._merge = other._merge
        self.input_shard_group = other.input_shard_group

    # -- the product ---------------------------------------------------------------------------------------------------
    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The effective dense weight ``[out, in]`` in ``dtype`` (default: the compute dtype)."""
        raise NotImplementedError

    def _select(self, device: torch.device) -> Tuple[str, str]:
        """(backend, human-readable reason) for ``device``: what ``describe_path`` reports and the fallback warning
        says (the GEMM op itself resolves ``"auto"`` the same way)."""
        raise NotImplementedError

    def _run(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def linear(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``F.linear(x, self, bias)``: any leading shape, returns the compute dtype."""
        # The kernels are custom ops (diffusers_h3::*_linear) that resolve backend="auto" for the device themselves:
        # under torch.compile this is one graph node, and the cast before it fuses with the producer of ``x``.
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.layer_label} expects {self.in_features} input features, got {x.shape[-1]}.")
        if not torch.compiler.is_compiling():
            self._warn_fallback(x.device)
        if x.dtype != self.dtype:
            x = x.to(self.dtype)
        if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
            # Training through a frozen quantized base: the forward is the format's own product (the Triton kernels
            # record no autograd), the backward the dequantized weight's (see _QuantizedLinearFunction).
            names = self.inner_names()
            return _QuantizedLinearFunction.apply(x, bias, self, names, *(getattr(self, n) for n in names))
        return self._run_in_own_precision(x, bias)

    def _run_in_own_precision(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            # The layer computes in its compute dtype with its own scales: under fp16 autocast the emulated FP8
            # product (E4M3 codes up to 448 each) and the dequantized GEMMs would run in fp16 and overflow.
            with torch.autocast(x.device.type, enabled=False):
                return self._run(x, bias)
        return self._run(x, bias)

    def _warn_fallback(self, device: torch.device) -> None:
        backend, reason = self._select(device)
        if backend == "dequant":
            warn_once(f"{self.quant_method}-dequant-{device.type}", f"{self.layer_label}: {reason}")

    def describe_path(self) -> str:
        """One line: which path runs on the weight's device and why."""
        backend, reason = self._select(self.device)
        return f"{self.layer_label}[{self.quant_method}] on {self.device.type}: {backend} -- {reason}"

    # -- slicing (fused and sharded projections) -------------------------------------------------------------------------
    def slice_problem(self, dim: int, start: int, stop: int) -> Optional[str]:
        """Why ``self[start:stop]`` along ``dim`` cannot be represented in this format, or ``None``."""
        if dim == 1:
            for name, stored in self.storage().items():
                if stored.dim() == 2 and ((start * stored.shape[1]) % self.in_features
                                          or (stop * stored.shape[1]) % self.in_features):  # fmt: skip
                    group = self.in_features // stored.shape[1]
                    return (
                        f"columns {start}:{stop} would split a {name} group of {group} input features; use a split "
                        f"whose boundaries are multiples of {group}"
                    )
        return None

    def concat_problem(self, others) -> Optional[str]:
        """Why ``torch.cat([self, *others])`` along the output rows cannot keep the packed tensors, or ``None``."""
        for other in others:
            if type(other) is not type(self):
                return f"the weights are {type(self).__name__} and {type(other).__name__}"
            if other.in_features != self.in_features:
                return f"the weights take {self.in_features} and {other.in_features} input features"
            if other.options != self.options or other.dtype != self.dtype:
                return "the weights were quantized with different options"
            if other.input_shard_group is not None or self.input_shard_group is not None:
                return "a row-parallel tensor-parallel shard cannot be concatenated"
        return None

    # -- dispatch -------------------------------------------------------------------------------------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if isinstance(weight, QuantizedTensor) and not isinstance(x, QuantizedTensor):
                return weight.linear(x, bias)
        if func in (torch.isfinite, torch.Tensor.isfinite) and isinstance(args[0], QuantizedTensor):
            return torch.isfinite(args[0].dequantize(torch.float32))  # PEFT's safe merge checks the merged weight
        if func is torch.Tensor.copy_ and _takes_quantized_copy(args[0], args[1]):
            # A new dense parameter filled from quantized weights (diffusers' fuse_projections builds the fused
            # nn.Linear and copies the concatenated weights into it): the parameter becomes the quantized weight.
            torch.utils.swap_tensors(args[0], args[1].clone())
            return args[0]
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        handler = _OPS.get(func)
        if handler is None:
            raise NotImplementedError(
                f"{cls.__name__} (a quantized weight) does not implement {func}; call .dequantize() for a dense copy."
            )
        return handler(func, args, kwargs or {})


class _QuantizedLinearFunction(torch.autograd.Function):
    """``F.linear(x, W, bias)`` over a frozen quantized ``W`` with gradients for ``x`` (and ``bias``).

    Forward: the format's product, exactly what inference runs (Triton kernels included, which record no autograd).
    Backward: ``grad_x = grad_out @ dequantize(W)``, the gradient of the dequantized layer; for formats that also
    quantize the activations (FP8, NVFP4 W4A4) that rounding is passed straight through. The weight never gets a
    gradient. The packed tensors are saved with ``save_for_backward`` (not the wrapper), so gradient checkpointing
    drops and recomputes them, and a weight streamed from its checkpoint (which swaps the wrapper's packed tensors out
    after the block runs) keeps the ones this product used until its backward has run.
    """

    @staticmethod
    def forward(ctx, x, bias, weight, names, *inner):
        # Only the metadata: a wrapper kept here would hold the packed tensors past checkpointing's drop.
        ctx.meta, ctx.names = (type(weight), tuple(weight.shape), weight.dtype, dict(weight.options)), names
        ctx.bias_shape = None if bias is None or not bias.requires_grad else bias.shape
        ctx.save_for_backward(*inner)
        return weight._run_in_own_precision(x, bias)

    @staticmethod
    def backward(ctx, grad_out):
        cls, shape, dtype, options = ctx.meta
        saved = ctx.saved_tensors  # read once: checkpointing's unpack hook allows one read
        weight = cls(dict(zip(ctx.names, saved)), shape, dtype, options)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.matmul(grad_out, weight.dequantize(grad_out.dtype))
        grad_bias = None
        if ctx.bias_shape is not None:
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0).reshape(ctx.bias_shape)
        return (grad_x, grad_bias, None, None) + (None,) * len(saved)


def _takes_quantized_copy(dst, src) -> bool:
    """``dst.copy_(src)`` turns ``dst`` into a copy of ``src``: a dense leaf parameter of the same shape, device and
    dtype, nothing else referring to it."""
    return (
        isinstance(src, QuantizedTensor) and isinstance(dst, torch.nn.Parameter) and type(dst) is torch.nn.Parameter
        and tuple(dst.shape) == tuple(src.shape) and dst.dtype == src.dtype and dst.device == src.device
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------------
# aten ops
# ----------------------------------------------------------------------------------------------------------------------
_OPS = {}


def _implements(*ops):
    def register(fn):
        for op in ops:
            _OPS[op] = fn
        return fn

    return register


@_implements(aten.detach.default, aten.alias.default)
def _detach(func, args, kwargs):
    return args[0]._with()


@_implements(aten.clone.default)
def _clone(func, args, kwargs):
    return args[0]._map(torch.clone, share_merge=False)


@_implements(aten._to_copy.default)
def _to_copy(func, args, kwargs):
    self = args[0]
    dtype = kwargs.get("dtype")
    device = kwargs.get("device")
    non_blocking = kwargs.get("non_blocking", False)
    if dtype is not None and not dtype.is_floating_point:
        raise TypeError(f"{type(self).__name__} can only be cast to a floating compute dtype, got {dtype}.")
    moved = self._map(lambda t: t.to(device=device, non_blocking=non_blocking) if device is not None else t,
                      dtype=dtype, share_merge=False)  # fmt: skip
    if kwargs.get("pin_memory"):
        moved = moved._map(torch.Tensor.pin_memory)
    return moved


@_implements(aten.pin_memory.default, aten._pin_memory.default)
def _pin_memory(func, args, kwargs):
    return args[0]._map(torch.Tensor.pin_memory, share_merge=False)


@_implements(aten.is_pinned.default)
def _is_pinned(func, args, kwargs):
    self = args[0]
    return all(getattr(self, name).is_pinned() for name in self.inner_names())


@_implements(aten.record_stream.default)
def _record_stream(func, args, kwargs):
    self, stream = args[0], args[1]
    for name in self.inner_names():
        getattr(self, name).record_stream(stream)


@_implements(aten.copy_.default)
def _copy(func, args, kwargs):
    dst, src = args[0], args[1]
    if not isinstance(dst, QuantizedTensor):
        raise TypeError(
            f"Cannot copy a quantized {type(src).__name__} weight into a dense {dst.dtype} tensor {tuple(dst.shape)}: "
            "that would dequantize it. Use .dequantize() for a dense copy."
        )
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"copy_: shapes {tuple(src.shape)} and {tuple(dst.shape)} differ.")
    if isinstance(src, QuantizedTensor):
        if type(src) is not type(dst):
            raise TypeError(f"Cannot copy a {type(src).__name__} into a {type(dst).__name__}.")
        source = {name: getattr(src, name) for name in src.inner_names()}
    else:
        source = {STORAGE_ATTRS[n]: t for n, t in dst.pack(src.to(dst.device), dst.options).items()}
    with torch.no_grad():
        for name in dst.inner_names():
            getattr(dst, name).copy_(source[name])
    return dst


@_implements(aten.slice.Tensor)
def _slice(func, args, kwargs):
    self, dim, start, stop, step = (list(args) + [0, None, None, 1][len(args) - 1:])[:5]
    dim = dim % 2
    size = self.shape[dim]
    start, stop, _ = slice(start, stop, step).indices(size)
    if step != 1:
        raise ValueError(f"{type(self).__name__} slices take step 1, got {step}.")
    problem = self.slice_problem(dim, start, stop)
    if problem is not None:
        raise ValueError(f"Cannot slice a {type(self).__name__} along dim {dim}: {problem}.")
    inner = {}
    for name in self.inner_names():
        stored = getattr(self, name)
        if stored.dim() <= dim:
            inner[name] = stored
            continue
        per = stored.shape[dim] / size
        inner[name] = stored.narrow(dim, int(start * per), int((stop - start) * per))
    shape = list(self.shape)
    shape[dim] = stop - start
    return self._with(inner, shape=tuple(shape), share_merge=False)


@_implements(aten.cat.default)
def _cat(func, args, kwargs):
    tensors = list(args[0])
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    first = tensors[0]
    if dim not in (0, -2) or not all(isinstance(t, QuantizedTensor) for t in tensors):
        raise ValueError(
            f"{type(first).__name__} weights concatenate along the output rows (dim 0) only, with other quantized "
            "weights of the same format."
        )
    problem = first.concat_problem(tensors[1:])
    if problem is not None:
        raise ValueError(f"Cannot concatenate {type(first).__name__} weights: {problem}.")
    inner = {}
    for name in first.inner_names():
        parts = [getattr(t, name) for t in tensors]
        inner[name] = torch.cat(parts, 0) if parts[0].dim() else parts[0]
    out = sum(t.shape[0] for t in tensors)
    return first._with(inner, shape=(out, first.in_features), share_merge=False)


def _merge_delta(func, args, kwargs, sign: int):
    """``weight += delta`` / ``weight -= delta`` (LoRA merge / unmerge), in place on the packed tensors."""
    self, delta = args[0], args[1]
    alpha = kwargs.get("alpha", 1)
    if isinstance(delta, QuantizedTensor) or not isinstance(delta, torch.Tensor):
        raise TypeError(f"{type(self).__name__} adds dense float deltas only (LoRA merge).")
    state = self._merge
    with torch.no_grad():
        if sign < 0 and state.depth == 1 and state.original is not None:
            restored = {name: t.to(self.device) for name, t in state.original.items()}
            state.original, state.depth = None, 0
        else:
            if sign > 0 and state.depth == 0:
                state.original = {name: getattr(self, name).detach().to("cpu", copy=True) for name in self.inner_names()}
            state.depth = max(0, state.depth + sign)
            dense = self.dequantize(torch.float32) + sign * alpha * delta.to(self.device, torch.float32)
            restored = {STORAGE_ATTRS[n]: t for n, t in self.pack(dense, self.options).items()}
        for name in self.inner_names():
            getattr(self, name).copy_(restored[name])
    return self


@_implements(aten.add_.Tensor)
def _add_(func, args, kwargs):
    return _merge_delta(func, args, kwargs, +1)


@_implements(aten.sub_.Tensor)
def _sub_(func, args, kwargs):
    return _merge_delta(func, args, kwargs, -1)


# ----------------------------------------------------------------------------------------------------------------------
# formats
# ----------------------------------------------------------------------------------------------------------------------
def _triton_reason(what: str, large_m_rows: int) -> str:
    return (
        f"Triton {what}: fused GEMM with in-register dequantization below {large_m_rows} rows; "
        f"from {large_m_rows} rows (compute-bound) Triton dequantization to a 16-bit scratch weight + cuBLAS"
    )


def _fallback_reason(device: torch.device, what: str) -> str:
    cap = cuda_capability(device)
    return f"fallback: {what} not available on sm_{cap[0]}{cap[1]}; dequantize per call to fp16/bf16 + cuBLAS"


class W8A16Tensor(QuantizedTensor):
    """Int8 weight ``[N, K]`` + fp32 scales ``[N]`` (per channel) or ``[N, K/group_size]``; 16-bit activations.

    Paths: Triton in-register dequant GEMM (CUDA SM80+), dequantize + cuBLAS (other GPUs, e.g. V100), torch reference
    (CPU).
    """

    layer_label = "W8A16Linear"

    @classmethod
    def _default_options(cls):
        return {"group_size": None, "large_m_rows": LARGE_M_ROWS}

    @classmethod
    def check_options(cls, out_features, in_features, options):
        group_size = options["group_size"]
        if group_size is not None and in_features % group_size:
            raise ValueError(f"group_size={group_size} does not divide in_features={in_features}.")

    @classmethod
    def storage_spec(cls, out_features, in_features, options):
        group_size = options["group_size"]
        scale_shape = (out_features,) if group_size is None else (out_features, in_features // group_size)
        return {"weight": ((out_features, in_features), torch.int8), "weight_scale": (scale_shape, torch.float32)}

    @classmethod
    def pack(cls, dense, options):
        q, s = w8a16_quantize(dense, options["group_size"])
        return {"weight": q, "weight_scale": s}

    @classmethod
    def normalize_loaded(cls, name, value, out_features):
        if name == "weight_scale" and value.dim() == 2 and value.shape[1] == 1:
            return value.reshape(-1)
        return value

    def dequantize(self, dtype=None):
        return w8a16_dequantize(self.qdata, self.scale, dtype or self.dtype)

    def _select(self, device):
        backend = self.options["backend"]
        if backend != "auto":
            return backend, f"forced by config (backend={backend!r})"
        if device.type == "cuda":
            if triton_gemm_supported(device):
                return "auto", _triton_reason("W8A16", self.options["large_m_rows"])
            return "dequant", _fallback_reason(device, "tensor-core Triton")
        return "torch", "torch reference (CPU)"

    def _run(self, x, bias):
        return w8a16_linear(x, self.qdata, self.scale, bias, backend=self.options["backend"],
                            large_m_rows=self.options["large_m_rows"])  # fmt: skip


class NVFP4Tensor(QuantizedTensor):
    """NVFP4 weight: ``weight`` uint8 ``[N, K/2]`` (E2M1 pairs), ``weight_scale`` E4M3 ``[N, K/16]``,
    ``weight_scale_2`` fp32 ``[]``.

    Weight-only paths: Triton dequant GEMM (CUDA SM80+), dequantize + cuBLAS (other GPUs), torch reference (CPU).
    ``activation="nvfp4"``: flashinfer ``mm_fp4`` on SM100+ (**not run on hardware**), fp32 emulation elsewhere.
    """

    layer_label = "NVFP4Linear"

    @classmethod
    def _default_options(cls):
        return {"activation": None, "large_m_rows": LARGE_M_ROWS}

    @classmethod
    def check_options(cls, out_features, in_features, options):
        if in_features % 16:
            raise ValueError(f"NVFP4 needs in_features % 16 == 0, got {in_features}; keep this layer unquantized.")

    @classmethod
    def storage_spec(cls, out_features, in_features, options):
        return {
            "weight": ((out_features, in_features // 2), torch.uint8),
            "weight_scale": ((out_features, in_features // 16), torch.float8_e4m3fn),
            "weight_scale_2": ((), torch.float32),
        }

    @classmethod
    def pack(cls, dense, options):
        p, s, g = nvfp4_quantize(dense)
        return {"weight": p, "weight_scale": s, "weight_scale_2": g}

    @classmethod
    def normalize_loaded(cls, name, value, out_features):
        if name == "weight_scale_2" and value.numel() == 1:
            return value.reshape(())
        return value

    def slice_problem(self, dim, start, stop):
        if dim == 1 and self.options["activation"] == "nvfp4":
            return (
                "with activation='nvfp4' (W4A4) the activation's per-tensor scale would differ per column shard; use "
                "NVFP4Config(activation=None) to split the input"
            )
        return super().slice_problem(dim, start, stop)

    def concat_problem(self, others):
        problem = super().concat_problem(others)
        if problem is None and any(not torch.equal(o.scale_2, self.scale_2) for o in others):
            return (
                "each NVFP4 weight has its own per-tensor scale (weight_scale_2), which one fused weight cannot hold "
                "without re-quantizing; keep the projections separate (skip fuse_qkv_projections), or fuse them "
                "before quantizing"
            )
        return problem

    def dequantize(self, dtype=None):
        return nvfp4_dequantize(self.qdata, self.scale, self.scale_2, dtype or self.dtype)

    def _select(self, device):
        backend = self.options["backend"]
        if self.options["activation"] == "nvfp4":
            if backend not in ("auto", "flashinfer", "torch"):
                return backend, f"forced by config (backend={backend!r})"
            if backend == "flashinfer" or (backend == "auto" and flashinfer_fp4_available(device)):
                return "flashinfer", "W4A4 flashinfer mm_fp4 on FP4 tensor cores (not run on hardware)"
            return "torch", "W4A4 emulation in fp32 (no FP4 tensor cores / flashinfer here; slow)"
        if backend != "auto":
            return backend, f"forced by config (backend={backend!r})"
        if device.type == "cuda":
            if triton_gemm_supported(device):
                return "auto", _triton_reason("NVFP4 weight-only", self.options["large_m_rows"])
            return "dequant", _fallback_reason(device, "tensor-core Triton")
        return "torch", "torch reference (CPU)"

    def _run(self, x, bias):
        return nvfp4_linear(
            x, self.qdata, self.scale, self.scale_2, bias, activation=self.options["activation"],
            backend=self.options["backend"], large_m_rows=self.options["large_m_rows"],
        )  # fmt: skip


class FP8Tensor(QuantizedTensor):
    """E4M3 weight ``[N, K]`` + fp32 per-channel ``weight_scale`` ``[N]``; activations quantized per token at run time.

    Paths: fused Triton activation quantization + ``torch._scaled_mm`` row-wise (CUDA SM89+), dequantize + 16-bit
    GEMM (older GPUs; activations not quantized), fp32 emulation of the W8A8 numerics (CPU).

    ``input_shard_group`` is set by tensor parallelism on a row-parallel weight: ``x`` is one shard of each activation
    row, and the per-token scale must come from the whole row (a MAX all-reduce over this group), so that every shard
    quantizes its part exactly as the unsplit weight would.
    """

    layer_label = "FP8Linear"

    @classmethod
    def _default_options(cls):
        return {"use_fast_accum": True}

    @classmethod
    def storage_spec(cls, out_features, in_features, options):
        return {
            "weight": ((out_features, in_features), torch.float8_e4m3fn),
            "weight_scale": ((out_features,), torch.float32),
        }

    @classmethod
    def pack(cls, dense, options):
        q, s = fp8_quantize_weight(dense)
        return {"weight": q, "weight_scale": s}

    @classmethod
    def normalize_loaded(cls, name, value, out_features):
        if name == "weight_scale":
            if value.numel() == 1:  # per-tensor scale (e.g. ModelOpt FP8): broadcast to per-channel
                return value.float().reshape(1).expand(out_features).contiguous()
            if value.dim() == 2 and value.shape[1] == 1:
                return value.reshape(-1)
        return value

    def dequantize(self, dtype=None):
        return fp8_dequantize(self.qdata, self.scale, dtype or self.dtype)

    def _select(self, device):
        backend = self.options["backend"]
        if backend != "auto":
            return backend, f"forced by config (backend={backend!r})"
        if device.type == "cuda":
            if fp8_scaled_mm_supported(device, self.out_features, self.in_features):
                return "scaled_mm", ("fused per-token FP8 quantization (Triton) + torch._scaled_mm row-wise "
                                      "(calls with < 64 rows: exact float32 product of the E4M3 codes)")
            if not has_fp8_tensor_cores(device):
                return "dequant", _fallback_reason(device, "FP8 tensor cores")
            return "dequant", "fallback: N or K not a multiple of 16 for torch._scaled_mm; dequantize + cuBLAS"
        return "torch", "fp32 emulation of the W8A8 numerics (CPU)"

    def _run(self, x, bias):
        if self.input_shard_group is not None:
            resolved = self._select(x.device)[0]
            if resolved in ("torch", "scaled_mm"):
                return self._run_on_row_shard(x, bias, resolved)
        return fp8_linear(x, self.qdata, self.scale, bias, backend=self.options["backend"],
                          use_fast_accum=self.options["use_fast_accum"])  # fmt: skip

    def _run_on_row_shard(self, x, bias, backend):
        """Per-token FP8 quantization with the amax of the whole (unsplit) row, then this shard's partial product."""
        import torch.distributed as dist

        x2 = x.reshape(-1, x.shape[-1])
        xf = x2.float()
        amax = xf.abs().amax(dim=-1, keepdim=True)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.input_shard_group)
        amax = amax.clamp(min=FP8_AMAX_EPS)
        xq, xs = to_e4m3(xf * (E4M3_MAX / amax)), amax / E4M3_MAX
        out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        if backend == "torch":
            out = (xq.float() @ self.qdata.float().T) * xs * self.scale.float().reshape(1, -1)
            if bias is not None:
                out = out + bias.float()
        elif xq.shape[0] < SCALED_MM_MIN_ROWS:
            out = fp8_small_m_product(xq, xs, self.qdata, self.scale, bias, out_dtype)
        else:
            out = torch._scaled_mm(
                xq, self.qdata.t(), scale_a=xs, scale_b=self.scale.float().reshape(1, -1),
                bias=bias.to(out_dtype) if bias is not None else None, out_dtype=out_dtype,
                use_fast_accum=self.options["use_fast_accum"],
            )  # fmt: skip
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
