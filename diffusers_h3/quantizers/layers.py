"""Quantized ``Linear`` layers: :class:`W8A16Linear`, :class:`NVFP4Linear`, :class:`FP8Linear`.

All subclass :class:`QuantizedLinear`, the interface the LoRA (PEFT) integration builds on:

- ``in_features``, ``out_features``, ``bias`` (unquantized ``Parameter`` in ``compute_dtype``, or ``None``),
  ``compute_dtype``, ``quant_method`` (str; a class attribute set by ``register_format``);
- ``dequantize(dtype=None) -> Tensor[out, in]``: the effective weight;
- ``forward(x)``: any leading shape, returns ``compute_dtype``;
- ``describe_path() -> str``: one line, which path runs on the layer's device and why;
- ``from_linear(linear, config)`` and ``requantize_(dense_weight)`` (used to fuse / unfuse LoRA);
- ``weight``: **the packed storage buffer** (int8 codes for W8A16, uint8 E2M1 pairs ``[N, K/2]`` for NVFP4,
  ``float8_e4m3fn`` for FP8). It has the layer's device; its shape is the packed shape, not ``[out, in]`` -- use
  ``in_features`` / ``out_features`` / ``dequantize()`` for that. PEFT takes the adapter dtype from
  ``compute_dtype`` (it prefers that attribute over ``weight.dtype``).

The storage buffers keep their dtype under ``module.to(dtype)`` / ``.half()``: only their device follows; a floating
cast changes ``compute_dtype`` and the bias instead. State-dict names follow the ModelOpt export layout
(``weight``, ``weight_scale``, ``weight_scale_2``): :meth:`QuantizedLinear.load_quantized_` installs them and
:class:`~diffusers_h3.quantizers.diffusers_quantizer.QuantizerBase` reads them from ``from_pretrained`` checkpoints
(ours and ModelOpt-style exports).
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import nn

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


class QuantizedLinear(nn.Module):
    """Base class; subclasses define ``_storage_spec``, ``_quantize``, ``_select``, ``_run`` and ``dequantize``
    (``quant_method`` comes from ``register_format``)."""

    quant_method: str = ""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        compute_dtype: torch.dtype = torch.bfloat16,
        device=None,
        backend: str = "auto",
    ):
        super().__init__()
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.compute_dtype = compute_dtype
        self.backend = backend
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=compute_dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        for name, (shape, dtype) in self._storage_spec().items():
            self.register_buffer(name, torch.zeros(shape, dtype=dtype, device=device))

    # -- to be provided by subclasses --------------------------------------------------------------------------------
    def _storage_spec(self) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
        raise NotImplementedError

    def _quantize(self, dense: torch.Tensor) -> Dict[str, torch.Tensor]:
        raise NotImplementedError

    def _select(self, device: torch.device) -> Tuple[str, str]:
        """(backend, human-readable reason) for ``device``: what ``describe_path`` reports and the fallback warning
        says (the GEMM op itself resolves ``"auto"`` the same way)."""
        raise NotImplementedError

    def _run(self, x: torch.Tensor, backend: str) -> torch.Tensor:
        """The product; ``backend`` is the layer's configured ``backend`` (``"auto"`` or forced)."""
        raise NotImplementedError

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        raise NotImplementedError

    # -- construction ------------------------------------------------------------------------------------------------
    @classmethod
    def from_linear(cls, linear: nn.Linear, config) -> "QuantizedLinear":
        """Quantize a dense ``nn.Linear`` (its weight may be on any device; the result lives there)."""
        if linear.weight.device.type == "meta":
            raise ValueError("Cannot quantize a Linear whose weight is on the meta device; load its weight first.")
        compute_dtype = config.compute_dtype or linear.weight.dtype
        layer = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            compute_dtype=compute_dtype,
            device=linear.weight.device,
            **config.layer_kwargs(),
        )
        layer.requantize_(linear.weight)
        if linear.bias is not None:
            layer.bias.data = linear.bias.detach().to(compute_dtype)
        return layer

    @torch.no_grad()
    def requantize_(self, dense_weight: torch.Tensor) -> "QuantizedLinear":
        """Replace the stored weight by the quantization of ``dense_weight`` ``[out, in]`` (e.g. after LoRA fusing)."""
        if tuple(dense_weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"requantize_ expects a weight of shape {(self.out_features, self.in_features)}, "
                f"got {tuple(dense_weight.shape)}."
            )
        device = self.weight.device if self.weight.device.type != "meta" else dense_weight.device
        for name, value in self._quantize(dense_weight.to(device)).items():
            self._buffers[name] = value.to(device)
        return self

    def load_quantized_(self, tensors: Dict[str, torch.Tensor]) -> None:
        """Install pre-quantized storage (from a checkpoint) after checking names, shapes and dtypes."""
        spec = self._storage_spec()
        for name, value in tensors.items():
            if name not in spec:
                raise KeyError(f"{type(self).__name__} has no quantized tensor {name!r} (expected {sorted(spec)}).")
            shape, dtype = spec[name]
            value = self.normalize_loaded(name, value)
            if tuple(value.shape) != tuple(shape) or value.dtype != dtype:
                raise ValueError(
                    f"{type(self).__name__}.{name}: checkpoint tensor is {tuple(value.shape)} {value.dtype}, the layer "
                    f"({self.out_features}x{self.in_features}, {self.quant_method}) expects {tuple(shape)} {dtype}. "
                    "The checkpoint was quantized with another method or for another model config."
                )
            self._buffers[name] = value

    def normalize_loaded(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """Hook for accepting equivalent layouts of other exporters (e.g. ``[N, 1]`` scales)."""
        return value

    # -- fusing projections (``fuse_qkv_projections``) -------------------------------------------------------------
    def layer_options(self) -> Dict[str, object]:
        """The constructor options besides the shape (what :meth:`concatenate_outputs` copies and compares)."""
        return {"backend": self.backend}

    def concatenation_blocker(self) -> Optional[str]:
        """Why the stored weight cannot be stacked with other layers' along the output rows, or ``None`` (it can)."""
        return None

    @classmethod
    def concatenation_problem(cls, layers: Sequence[nn.Module]) -> Optional[str]:
        """One line saying why :meth:`concatenate_outputs` would refuse ``layers``, or ``None``."""
        kinds = sorted({type(layer).__name__ for layer in layers})
        if len(kinds) > 1 or not isinstance(layers[0], QuantizedLinear):
            return f"the projections are {' / '.join(kinds)}; only projections quantized alike can be fused"
        first = layers[0]
        blocker = first.concatenation_blocker()
        if blocker is not None:
            return blocker
        for layer in layers[1:]:
            if layer.in_features != first.in_features:
                return f"the projections take {first.in_features} and {layer.in_features} input features"
            if layer.layer_options() != first.layer_options() or layer.compute_dtype != first.compute_dtype:
                return "the projections were quantized with different options"
            if (layer.bias is None) != (first.bias is None):
                return "some projections have a bias and others do not"
        return None

    @classmethod
    @torch.no_grad()
    def concatenate_outputs(cls, layers: Sequence["QuantizedLinear"]) -> "QuantizedLinear":
        """One layer of the same format computing ``torch.cat([layer(x) for layer in layers], -1)``: the packed
        weights and their per-output-row scales stacked along the output rows, without re-quantizing (the outputs
        equal the separate layers'). Raises :class:`ValueError` with :meth:`concatenation_problem`'s line."""
        problem = cls.concatenation_problem(layers)
        if problem is not None:
            raise ValueError(f"Cannot fuse {type(layers[0]).__name__} projections into one layer: {problem}.")
        first = layers[0]
        out_features = sum(layer.out_features for layer in layers)
        fused = type(first)(first.in_features, out_features, bias=first.bias is not None,
                            compute_dtype=first.compute_dtype, device="meta", **first.layer_options())  # fmt: skip
        for name in first._storage_spec():
            fused._buffers[name] = torch.cat([layer._buffers[name] for layer in layers], 0)
        if first.bias is not None:
            fused.bias = nn.Parameter(torch.cat([layer.bias for layer in layers]), requires_grad=False)
        return fused

    # -- tensor-parallel sharding --------------------------------------------------------------------------------------
    def shard_ranges(self, dim: int, rank: int, world: int, chunks: int = 1):
        """The ``(start, stop)`` feature ranges ``shard_`` keeps; raises if a shard would split a scale group.

        ``dim`` 0 splits output rows (column parallel), 1 input columns (row parallel); the features are split into
        ``chunks`` equal parts first (e.g. 2 for a packed ``[up | gate]`` projection) and each part into ``world``.
        """
        if dim not in (0, 1):
            raise ValueError(f"shard_ dim must be 0 (output rows) or 1 (input columns), got {dim}.")
        features = self.out_features if dim == 0 else self.in_features
        if world < 1 or not 0 <= rank < world or features % (chunks * world):
            raise ValueError(
                f"{type(self).__name__}: {features} {'output' if dim == 0 else 'input'} features do not split into "
                f"{chunks} x {world} equal shards (rank {rank}); pick a degree that divides {features // chunks}."
            )
        width = features // (chunks * world)
        if dim == 1:
            for name in self._storage_spec():
                stored = self._buffers[name]
                if stored.dim() == 2 and (width * stored.shape[1]) % self.in_features:
                    group = self.in_features // stored.shape[1]
                    raise ValueError(
                        f"{type(self).__name__} ({self.quant_method}): a tensor-parallel shard of {width} input "
                        f"features would split a {name} group of {group}; use a degree for which "
                        f"{self.in_features // chunks} / degree is a multiple of {group}."
                    )
        part = features // chunks
        return [(c * part + rank * width, c * part + (rank + 1) * width) for c in range(chunks)]

    @torch.no_grad()
    def shard_(self, dim: int, rank: int, world: int, chunks: int = 1) -> "QuantizedLinear":
        """Keep this rank's slice of the stored weight and its scales (see :meth:`shard_ranges`), in place.

        Row scales follow their rows; 2-D scales of input groups (W8A16 ``group_size``, NVFP4 blocks of 16) follow
        their columns; per-tensor scales are kept whole. The bias follows output rows; with ``dim=1`` it is kept
        whole (the caller adds it once, after reducing the partial outputs).
        """
        ranges = self.shard_ranges(dim, rank, world, chunks)
        features = self.out_features if dim == 0 else self.in_features
        for name in self._storage_spec():
            stored = self._buffers[name]
            if stored.dim() <= dim:
                continue
            per_feature = stored.shape[dim] / features
            pieces = [stored.narrow(dim, int(a * per_feature), int((b - a) * per_feature)) for a, b in ranges]
            self._buffers[name] = torch.cat(pieces, dim).contiguous()
        kept = sum(b - a for a, b in ranges)
        if dim == 0:
            if self.bias is not None:
                self.bias = nn.Parameter(torch.cat([self.bias[a:b] for a, b in ranges]), requires_grad=False)
            self.out_features = kept
        else:
            self.in_features = kept
        return self

    # -- run ---------------------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The kernels are custom ops (diffusers_h3::*_linear) that resolve backend="auto" for the device themselves:
        # under torch.compile this is one graph node, and the cast before it fuses with the producer of ``x``.
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{type(self).__name__} expects {self.in_features} input features, got {x.shape[-1]}.")
        if not torch.compiler.is_compiling():
            self._warn_fallback(x.device)
        if x.dtype != self.compute_dtype:
            x = x.to(self.compute_dtype)
        if torch.is_autocast_enabled(x.device.type):
            # The layer computes in `compute_dtype` with its own scales: under fp16 autocast the emulated FP8 product
            # (E4M3 codes up to 448 each) and the dequantized GEMMs would run in fp16 and overflow.
            with torch.autocast(x.device.type, enabled=False):
                return self._run(x, self.backend)
        return self._run(x, self.backend)

    def _warn_fallback(self, device: torch.device) -> None:
        backend, reason = self._select(device)
        if backend == "dequant":
            warn_once(f"{self.quant_method}-dequant-{device.type}", f"{type(self).__name__}: {reason}")

    def describe_path(self) -> str:
        backend, reason = self._select(self.weight.device)
        return f"{type(self).__name__}[{self.quant_method}] on {self.weight.device.type}: {backend} -- {reason}"

    def quantized_nbytes(self) -> int:
        """Bytes of weight storage (packed codes + scales; bias excluded)."""
        return sum(self._buffers[n].numel() * self._buffers[n].element_size() for n in self._storage_spec())

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"compute_dtype={self.compute_dtype}, backend={self.backend}"
        )

    # -- dtype / device moves keep the packed storage ------------------------------------------------------------------
    def _apply(self, fn, recurse=True):
        probe32 = fn(torch.empty(0, dtype=torch.float32))
        probe16 = fn(torch.empty(0, dtype=torch.float16))
        storage = {name: self._buffers.pop(name) for name in self._storage_spec()}
        try:
            super()._apply(fn, recurse)
        finally:
            for name, buf in storage.items():
                if buf is not None and buf.device != probe32.device:
                    buf = buf.to(probe32.device)
                self._buffers[name] = buf
        if probe32.dtype == probe16.dtype and probe32.dtype.is_floating_point:
            self.compute_dtype = probe32.dtype
        return self


def _triton_reason(what: str, large_m_rows: int) -> str:
    return (
        f"Triton {what}: fused GEMM with in-register dequantization below {large_m_rows} rows; "
        f"from {large_m_rows} rows (compute-bound) Triton dequantization to a 16-bit scratch weight + cuBLAS"
    )


def _fallback_reason(device: torch.device, what: str) -> str:
    cap = cuda_capability(device)
    return f"fallback: {what} not available on sm_{cap[0]}{cap[1]}; dequantize per call to fp16/bf16 + cuBLAS"


class W8A16Linear(QuantizedLinear):
    """Int8 weight ``[N, K]`` + fp32 scales ``[N]`` (per channel) or ``[N, K/group_size]``; 16-bit activations.

    Paths: Triton in-register dequant GEMM (CUDA SM80+), dequantize + cuBLAS (other GPUs, e.g. V100), torch reference
    (CPU).
    """

    def __init__(self, in_features, out_features, bias=True, compute_dtype=torch.bfloat16, device=None,
                 backend="auto", group_size: Optional[int] = None, large_m_rows: int = LARGE_M_ROWS):  # fmt: skip
        if group_size is not None and in_features % group_size:
            raise ValueError(f"group_size={group_size} does not divide in_features={in_features}.")
        self.group_size = group_size
        self.large_m_rows = large_m_rows
        super().__init__(in_features, out_features, bias, compute_dtype, device, backend)

    def _storage_spec(self):
        scale_shape = (self.out_features,) if self.group_size is None else (
            self.out_features, self.in_features // self.group_size)  # fmt: skip
        return {
            "weight": ((self.out_features, self.in_features), torch.int8),
            "weight_scale": (scale_shape, torch.float32),
        }

    def layer_options(self):
        return {"backend": self.backend, "group_size": self.group_size, "large_m_rows": self.large_m_rows}

    def _quantize(self, dense):
        q, s = w8a16_quantize(dense, self.group_size)
        return {"weight": q, "weight_scale": s}

    def normalize_loaded(self, name, value):
        if name == "weight_scale" and self.group_size is None and value.dim() == 2 and value.shape[1] == 1:
            return value.reshape(-1)
        return value

    def dequantize(self, dtype=None):
        return w8a16_dequantize(self.weight, self.weight_scale, dtype or self.compute_dtype)

    def _select(self, device):
        if self.backend != "auto":
            return self.backend, f"forced by config (backend={self.backend!r})"
        if device.type == "cuda":
            if triton_gemm_supported(device):
                return "auto", _triton_reason("W8A16", self.large_m_rows)
            return "dequant", _fallback_reason(device, "tensor-core Triton")
        return "torch", "torch reference (CPU)"

    def _run(self, x, backend):
        return w8a16_linear(x, self.weight, self.weight_scale, self.bias, backend=backend,
                            large_m_rows=self.large_m_rows)  # fmt: skip


class NVFP4Linear(QuantizedLinear):
    """NVFP4 weight: ``weight`` uint8 ``[N, K/2]`` (E2M1 pairs), ``weight_scale`` E4M3 ``[N, K/16]``,
    ``weight_scale_2`` fp32 ``[]``.

    Weight-only paths: Triton dequant GEMM (CUDA SM80+), dequantize + cuBLAS (other GPUs), torch reference (CPU).
    ``activation="nvfp4"``: flashinfer ``mm_fp4`` on SM100+ (**not run on hardware**), fp32 emulation elsewhere.
    """

    def __init__(self, in_features, out_features, bias=True, compute_dtype=torch.bfloat16, device=None,
                 backend="auto", activation: Optional[str] = None, large_m_rows: int = LARGE_M_ROWS):  # fmt: skip
        if in_features % 16:
            raise ValueError(f"NVFP4 needs in_features % 16 == 0, got {in_features}; keep this layer unquantized.")
        self.activation = activation
        self.large_m_rows = large_m_rows
        super().__init__(in_features, out_features, bias, compute_dtype, device, backend)

    def _storage_spec(self):
        return {
            "weight": ((self.out_features, self.in_features // 2), torch.uint8),
            "weight_scale": ((self.out_features, self.in_features // 16), torch.float8_e4m3fn),
            "weight_scale_2": ((), torch.float32),
        }

    def layer_options(self):
        return {"backend": self.backend, "activation": self.activation, "large_m_rows": self.large_m_rows}

    def concatenation_blocker(self):
        return (
            "each NVFP4 projection has its own per-tensor scale (weight_scale_2), which one fused layer cannot hold "
            "without re-quantizing the weights; keep the projections separate (skip fuse_qkv_projections)"
        )

    def _quantize(self, dense):
        p, s, g = nvfp4_quantize(dense)
        return {"weight": p, "weight_scale": s, "weight_scale_2": g}

    def normalize_loaded(self, name, value):
        if name == "weight_scale_2" and value.numel() == 1:
            return value.reshape(())
        return value

    def shard_ranges(self, dim, rank, world, chunks=1):
        if dim == 1 and self.activation == "nvfp4":
            raise ValueError(
                "NVFP4Linear with activation='nvfp4' (W4A4) cannot be split along its input: the activation's "
                "per-tensor scale would differ per shard. Use NVFP4Config(activation=None) under tensor parallelism."
            )
        return super().shard_ranges(dim, rank, world, chunks)

    def dequantize(self, dtype=None):
        return nvfp4_dequantize(self.weight, self.weight_scale, self.weight_scale_2, dtype or self.compute_dtype)

    def _select(self, device):
        if self.activation == "nvfp4":
            if self.backend not in ("auto", "flashinfer", "torch"):
                return self.backend, f"forced by config (backend={self.backend!r})"
            if self.backend == "flashinfer" or (self.backend == "auto" and flashinfer_fp4_available(device)):
                return "flashinfer", "W4A4 flashinfer mm_fp4 on FP4 tensor cores (not run on hardware)"
            return "torch", "W4A4 emulation in fp32 (no FP4 tensor cores / flashinfer here; slow)"
        if self.backend != "auto":
            return self.backend, f"forced by config (backend={self.backend!r})"
        if device.type == "cuda":
            if triton_gemm_supported(device):
                return "auto", _triton_reason("NVFP4 weight-only", self.large_m_rows)
            return "dequant", _fallback_reason(device, "tensor-core Triton")
        return "torch", "torch reference (CPU)"

    def _run(self, x, backend):
        return nvfp4_linear(
            x, self.weight, self.weight_scale, self.weight_scale_2, self.bias, activation=self.activation,
            backend=backend, large_m_rows=self.large_m_rows,
        )  # fmt: skip


class FP8Linear(QuantizedLinear):
    """E4M3 weight ``[N, K]`` + fp32 per-channel ``weight_scale`` ``[N]``; activations quantized per token at run time.

    Paths: fused Triton activation quantization + ``torch._scaled_mm`` row-wise (CUDA SM89+), dequantize + 16-bit
    GEMM (older GPUs; activations not quantized), fp32 emulation of the W8A8 numerics (CPU).
    """

    def __init__(self, in_features, out_features, bias=True, compute_dtype=torch.bfloat16, device=None,
                 backend="auto", use_fast_accum: bool = True):  # fmt: skip
        self.use_fast_accum = use_fast_accum
        # Set by tensor parallelism on a row-parallel layer: `x` is one shard of each activation row, and the
        # per-token scale must come from the whole row (a MAX all-reduce over this group), so that every shard
        # quantizes its part exactly as the unsplit layer would.
        self.input_shard_group = None
        super().__init__(in_features, out_features, bias, compute_dtype, device, backend)

    def _storage_spec(self):
        return {
            "weight": ((self.out_features, self.in_features), torch.float8_e4m3fn),
            "weight_scale": ((self.out_features,), torch.float32),
        }

    def layer_options(self):
        return {"backend": self.backend, "use_fast_accum": self.use_fast_accum}

    def concatenation_blocker(self):
        if self.input_shard_group is not None:
            return "a row-parallel tensor-parallel shard cannot be fused"
        return None

    def _quantize(self, dense):
        q, s = fp8_quantize_weight(dense)
        return {"weight": q, "weight_scale": s}

    def normalize_loaded(self, name, value):
        if name == "weight_scale":
            if value.numel() == 1:  # per-tensor scale (e.g. ModelOpt FP8): broadcast to per-channel
                return value.float().reshape(1).expand(self.out_features).contiguous()
            if value.dim() == 2 and value.shape[1] == 1:
                return value.reshape(-1)
        return value

    def dequantize(self, dtype=None):
        return fp8_dequantize(self.weight, self.weight_scale, dtype or self.compute_dtype)

    def _select(self, device):
        if self.backend != "auto":
            return self.backend, f"forced by config (backend={self.backend!r})"
        if device.type == "cuda":
            if fp8_scaled_mm_supported(device, self.out_features, self.in_features):
                return "scaled_mm", ("fused per-token FP8 quantization (Triton) + torch._scaled_mm row-wise "
                                      "(calls with < 64 rows: exact float32 product of the E4M3 codes)")
            if not has_fp8_tensor_cores(device):
                return "dequant", _fallback_reason(device, "FP8 tensor cores")
            return "dequant", "fallback: N or K not a multiple of 16 for torch._scaled_mm; dequantize + cuBLAS"
        return "torch", "fp32 emulation of the W8A8 numerics (CPU)"

    def _run(self, x, backend):
        if self.input_shard_group is not None:
            resolved = self._select(x.device)[0]
            if resolved in ("torch", "scaled_mm"):
                return self._run_on_row_shard(x, resolved)
        return fp8_linear(x, self.weight, self.weight_scale, self.bias, backend=backend,
                          use_fast_accum=self.use_fast_accum)  # fmt: skip

    def _run_on_row_shard(self, x, backend):
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
            out = (xq.float() @ self.weight.float().T) * xs * self.weight_scale.float().reshape(1, -1)
            if self.bias is not None:
                out = out + self.bias.float()
        elif xq.shape[0] < SCALED_MM_MIN_ROWS:
            out = fp8_small_m_product(xq, xs, self.weight, self.weight_scale, self.bias, out_dtype)
        else:
            out = torch._scaled_mm(
                xq, self.weight.t(), scale_a=xs, scale_b=self.weight_scale.float().reshape(1, -1),
                bias=self.bias.to(out_dtype) if self.bias is not None else None, out_dtype=out_dtype,
                use_fast_accum=self.use_fast_accum,
            )  # fmt: skip
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

