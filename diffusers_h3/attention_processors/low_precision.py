"""Dense low-precision attention for ``MiniMaxH3Attention``: FP8 / INT8 Q/K (optionally FP8 P·V), or emulated FP4.

:class:`MiniMaxH3LowPrecisionAttnProcessor` replaces the attention core with

* ``"fp8"``: E4M3 Q per token, K per key block (mean-centred with ``smooth_k``), through the dense mode of the
  block-sparse flash kernels (:func:`~diffusers_h3.kernels.attention.fp8_attention`); FP8 tensor cores (SM89+);
* ``"int8"``: the same with symmetric INT8 Q/K (SageAttention's choice): INT8 tensor cores (SM80+), less rounding error
  than E4M3 (docs/attention.md);
* ``"fp4"``: NVFP4-style E2M1 Q/K/V with 16-element E4M3 scales, and P emulated before P·V (``fp4_p``); always
  emulated (quantize-dequantize + 16-bit kernels): native FP4 attention is not implemented and not run on hardware.

Without the tensor cores of the precision the 8-bit numerics run as emulation (quantize-dequantize + SDPA) with a
one-time warning, or raise with ``strict=True``. :func:`enable_low_precision_attention` installs one processor per
transformer block; the VSA processor delegates its dense calls to the same core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .._utils import cuda_capability, has_fp4_tensor_cores, has_fp8_tensor_cores, warn_once
from ..kernels._triton_utils import HAS_TRITON, triton_interpreter_active
from ..kernels.attention.dense_quantized import fake_quantize_operands, fp8_attention, plan_fp8_attention
from ..kernels.attention.router import (
    AttentionOperands,
    KernelChoice,
    TuningOptions,
    block_sparse_attention,
    plan_kernel,
)
from ..kernels.numerics import fake_quant_fp4
from .base import CallInputs, MiniMaxH3AttnProcessorBase, PlanForInputs
from .install import processor_entry_points, register_attention_processor


PRECISIONS = ("fp8", "int8", "fp4")
PV_PRECISIONS = ("bf16", "fp8")
FP4_P_MODES = (None, "two_level", "single_level")
KERNELS = ("auto", "sm90", "triton")
BACKENDS = ("auto", "triton", "torch")
# The 8-bit Q/K precisions and their operand dtype (same kernels; INT8 rounds finer than E4M3, docs/attention.md).
QK_8BIT = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}


def triton_kernels_run_on(device: torch.device) -> bool:
    """Whether this package's Triton kernels run for inputs on ``device`` (CUDA, or the CPU interpreter)."""
    return HAS_TRITON and (device.type == "cuda" or triton_interpreter_active())


def _fp8_native(device: torch.device) -> bool:
    """FP8 ``tl.dot`` runs on SM89+ GPUs (and in the interpreter, which emulates it)."""
    if device.type == "cuda":
        return HAS_TRITON and has_fp8_tensor_cores(device)
    return triton_interpreter_active()


def _qk_native(precision: str, device: torch.device) -> bool:
    """Whether the 8-bit Q/K ``precision`` has tensor cores on ``device``: FP8 on SM89+, INT8 ``tl.dot`` on SM80+."""
    if precision != "int8":
        return _fp8_native(device)
    if device.type != "cuda":
        return triton_interpreter_active()
    cap = cuda_capability(device)
    return HAS_TRITON and cap is not None and tuple(cap) >= (8, 0)


def check_low_precision_options(precision: str, *, pv_precision: str = "bf16", fp4_p: Optional[str] = "two_level",
                                strict: bool = False, backend: str = "auto", kernel: str = "auto",
                                allowed: Sequence[str] = PRECISIONS) -> None:
    """One clear error for a bad option of the low-precision attention (shared with ``VSAConfig``)."""
    if precision not in allowed:
        raise ValueError(f"precision must be one of {tuple(allowed)}, got {precision!r}")
    if pv_precision not in PV_PRECISIONS:
        raise ValueError(f"pv_precision must be one of {PV_PRECISIONS}, got {pv_precision!r}")
    if pv_precision == "fp8" and precision not in QK_8BIT:
        raise ValueError("pv_precision='fp8' needs precision='fp8' or 'int8'")
    if fp4_p not in FP4_P_MODES:
        raise ValueError(f"fp4_p must be 'two_level', 'single_level' or None (bf16 P), got {fp4_p!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if precision == "fp4" and strict:
        raise NotImplementedError(
            "precision='fp4' with strict=True: native FP4 attention is not implemented (FP4 numerics are emulated "
            "with quantize-dequantize and 16-bit kernels); pass strict=False to run the emulation"
        )


def precision_label(precision: str, *, smooth_k: bool, pv_precision: str, fp4_p: Optional[str],
                    emulated: Optional[bool]) -> str:
    """The numerics of ``precision`` in words; ``emulated`` is what the last call ran (``None``: not called yet)."""
    if precision in QK_8BIT:
        name = "FP8 E4M3" if precision == "fp8" else "INT8"
        label = f"{name} Q per token, K per tile{' (mean-centred)' if smooth_k else ''}, {pv_precision} PV"
        if emulated:
            label += f" [emulated here: no {name.split()[0]} tensor cores]"
        return label
    if precision == "fp4":
        p_part = f"{fp4_p.replace('_', '-')} FP4 P" if fp4_p else "bf16 P"
        label = (f"FP4 E2M1/E4M3-16 Q/K/V + {p_part} emulated (quantize-dequantize + 16-bit kernels; native FP4 "
                 "attention not implemented, not run on hardware)")
        if torch.cuda.is_available() and has_fp4_tensor_cores(torch.device("cuda")):
            label += " [this GPU has FP4 tensor cores, unused]"
        return label
    return "bf16"


def fake_quant_fp4_seq(value: torch.Tensor) -> torch.Tensor:
    """FP4 emulation of V along the sequence (groups of 16 tokens per channel), padding the tail group with zeros."""
    s = value.shape[1]
    pad = (-s) % 16
    if pad:
        value = torch.cat([value, value.new_zeros(value.shape[0], pad, *value.shape[2:])], dim=1)
    return fake_quant_fp4(value, dim=1)[:, :s]


@dataclass(frozen=True)
class LowPrecisionAttentionConfig:
    """The options of :func:`enable_low_precision_attention`, those of :class:`MiniMaxH3LowPrecisionAttnProcessor`
    (validated when built).

    Args:
        precision (`str`, defaults to `"fp8"`): ``"fp8"``, ``"int8"`` or ``"fp4"`` (emulated; see the module docstring).
        smooth_k (`bool`, defaults to `True`): subtract the per-head key mean before quantizing (exact under softmax).
        pv_precision (`str`, defaults to `"bf16"`): ``"fp8"`` also runs P·V in E4M3 (with an 8-bit ``precision``).
        fp4_p (`str`, defaults to `"two_level"`): with ``precision="fp4"``, how P is emulated before P·V
            (``"two_level"``, ``"single_level"`` or ``None``: 16-bit P).
        strict (`bool`, defaults to `False`): raise when installing, instead of emulating with a one-time warning,
            where the GPU lacks the precision's tensor cores.
        backend (`str`, defaults to `"auto"`): ``"triton"``, ``"torch"`` (reference kernels) or ``"auto"``.
        kernel (`str`, defaults to `"auto"`): ``"sm90"`` (Hopper Gluon kernel), ``"triton"`` or ``"auto"``.
    """

    precision: str = "fp8"
    smooth_k: bool = True
    pv_precision: str = "bf16"
    fp4_p: Optional[str] = "two_level"
    strict: bool = False
    backend: str = "auto"
    kernel: str = "auto"

    def __post_init__(self):
        check_low_precision_options(self.precision, pv_precision=self.pv_precision, fp4_p=self.fp4_p,
                                    strict=self.strict, backend=self.backend, kernel=self.kernel)  # fmt: skip


@dataclass(frozen=True)
class LowPrecisionPlan(PlanForInputs):
    """The low-precision processor's plan of one transformer call: ``path`` (``"fp8_attention"``: the 8-bit flash
    kernels; ``"fp4_kernel"``: the FP4 P emulation on the Triton kernel; ``"sdpa"``: SDPA over quantize-dequantized
    operands), its ``kernel``, the key block ``block_n`` of the 8-bit kernels (0: the reference's own), the benchmark
    ``tuning``, whether the numerics are ``emulated``, and the inputs it was made for."""

    path: str
    block_n: int
    tuning: Optional[TuningOptions]
    emulated: bool

    def describe(self) -> str:
        return f"dense low-precision ({self.path}): {self.kernel.describe()}"


@register_attention_processor("low_precision_attention", LowPrecisionAttentionConfig, legacy_positional=("precision",))
class MiniMaxH3LowPrecisionAttnProcessor(MiniMaxH3AttnProcessorBase):
    r"""
    Dense attention in FP8 / INT8 (tensor cores) or emulated FP4 for ``MiniMaxH3Attention`` (install one per block
    with :func:`enable_low_precision_attention`, or with ``transformer.set_attn_processor``).

    Args:
        precision (`str`, defaults to `"fp8"`): ``"fp8"`` (E4M3 Q per token, K per key block; SM89+), ``"int8"``
            (symmetric INT8 Q/K; SM80+) or ``"fp4"`` (E2M1 with 16-element E4M3 scales; always emulated).
        smooth_k (`bool`, defaults to `True`): subtract the per-head key mean before quantization (exact under softmax).
        pv_precision (`str`, defaults to `"bf16"`): ``"fp8"`` also runs P·V in E4M3 (per-channel V scales).
        fp4_p (`str`, defaults to `"two_level"`): with ``"fp4"``, how P is emulated before P·V (``"two_level"``,
            ``"single_level"`` or ``None`` = 16-bit P).
        strict (`bool`, defaults to `False`): raise instead of emulating when the GPU lacks the precision's tensor cores.
        backend (`str`, defaults to `"auto"`): ``"triton"`` / ``"torch"`` (reference kernels) / ``"auto"``.
        kernel (`str`, defaults to `"auto"`): the flash kernel: ``"sm90"`` (Hopper Gluon), ``"triton"`` or ``"auto"``.
    """

    def __init__(
        self,
        precision: str = "fp8",
        *,
        smooth_k: bool = True,
        pv_precision: str = "bf16",
        fp4_p: Optional[str] = "two_level",
        strict: bool = False,
        backend: str = "auto",
        kernel: str = "auto",
    ):
        super().__init__()
        check_low_precision_options(precision, pv_precision=pv_precision, fp4_p=fp4_p, strict=strict, backend=backend,
                                    kernel=kernel)
        self.precision = precision
        self.smooth_k = bool(smooth_k)
        self.pv_precision = pv_precision
        self.fp4_p = fp4_p
        self.strict = bool(strict)
        self.backend = backend
        self.kernel = kernel
        self.config = LowPrecisionAttentionConfig(precision, smooth_k=self.smooth_k, pv_precision=pv_precision,
                                                  fp4_p=fp4_p, strict=self.strict, backend=backend, kernel=kernel)
        self._who = type(self).__name__  # the processor named in warnings and errors (VSA when it delegates here)

    @classmethod
    def for_block(cls, config: "LowPrecisionAttentionConfig", prepared, index: int, block):
        processor = cls(config.precision, smooth_k=config.smooth_k, pv_precision=config.pv_precision,
                        fp4_p=config.fp4_p, strict=config.strict, backend=config.backend, kernel=config.kernel)
        processor.config = config  # one object for every block (the call plan files their plan under it)
        if config.strict:
            processor.emulated(next(block.parameters()).device)  # raise now rather than mid-denoising
        return processor

    # -- emulation policy -------------------------------------------------------------------------------------------
    def emulated(self, device: torch.device) -> bool:
        """Whether the numerics run as quantize-dequantize emulation on ``device`` (warns once, or raises when
        strict)."""
        if self.precision not in QK_8BIT or _qk_native(self.precision, device):
            return self.precision == "fp4"
        cap = cuda_capability(device) if device.type == "cuda" else None
        where = f"sm_{cap[0]}{cap[1]}" if cap else device.type
        name, needs = ("FP8", "SM89+") if self.precision == "fp8" else ("INT8", "SM80+")
        if self.strict:
            raise RuntimeError(
                f"precision={self.precision!r} needs {name} tensor cores ({needs}) and Triton; {where} has none. Pass "
                f"strict=False to run the {name} numerics as emulation (quantize-dequantize + 16-bit kernels), or use "
                "precision='bf16'"
            )
        warn_once(f"{self._who}-{self.precision}-emulated-{where}", f"{self._who}: no {name} tensor cores on "
                  f"{where}; {name} attention runs as emulation (quantize-dequantize + 16-bit kernels)")
        return True

    def _tuning(self, device: torch.device) -> Optional[TuningOptions]:
        if self.kernel == "auto" or self.backend == "torch" or not triton_kernels_run_on(device):
            return None
        return TuningOptions(kernel=self.kernel)

    # -- the plan of a call (made once per transformer call, outside the compiled blocks) -----------------------------
    plans_read_layout = False  # dense attention: the plan depends on the device, dtype and head dim only

    def plan_call(self, call: CallInputs) -> "LowPrecisionPlan":
        """Which path a call with Q/K/V of ``call.dtype`` on ``call.device`` takes, and its kernel: the 8-bit flash
        kernels (:func:`~diffusers_h3.kernels.attention.dense_quantized.plan_fp8_attention`), the FP4 emulation on the
        Triton kernel, or SDPA over quantize-dequantized operands; decides the emulation (warns once, or raises when
        strict)."""
        device, head_dim = call.device, call.head_dim
        emulate = self.emulated(device)
        tuning = self._tuning(device)
        operands = None
        block_n = 0
        if self.precision in QK_8BIT and not emulate and triton_kernels_run_on(device):
            path = "fp8_attention"
            kernel, block_n = plan_fp8_attention(head_dim, device, pv_fp8=self.pv_precision == "fp8",
                                                 qk_dtype=QK_8BIT[self.precision], out_dtype=call.dtype,
                                                 backend=self.backend, tuning=tuning)  # fmt: skip
        elif self.precision == "fp4" and self.fp4_p is not None and triton_kernels_run_on(device) and self.backend != "torch":
            path = "fp4_kernel"
            # V rounded over the sequence comes back channel-major (fake_quant_fp4_seq)
            operands = AttentionOperands(head_dim, call.dtype, call.dtype, v_layout="channel-major", p_fp4=self.fp4_p)
            kernel = plan_kernel(operands, device, block=64, dense=True, backend="triton")
        else:
            path = "sdpa"
            if self.precision == "fp4":
                reason = "FP4 emulation with 16-bit P" if self.fp4_p is None else "FP4 emulation, no Triton kernels here"
            else:
                reason = f"{self.precision.upper()} emulation (the kernel's operand rounding; P stays 16-bit)"
            kernel = KernelChoice("torch-sdpa", "dense", reason)
        return LowPrecisionPlan(kernel, call.device, call.dtype, head_dim, path=path, block_n=block_n, tuning=tuning,
                                emulated=emulate)  # fmt: skip

    # -- the core ----------------------------------------------------------------------------------------------------
    def core(self, query, key, value, attention_mask=None, **extras):
        if extras:
            raise TypeError(f"{self._who}: dense low-precision attention takes no extras, got {sorted(extras)}")
        return self.attend_planned(self.current_plan(query), query, key, value, attention_mask)

    def attend_planned(self, plan: "LowPrecisionPlan", query, key, value, attention_mask=None):
        """The attention of ``plan``'s path (the VSA processor's dense calls come here with its plan)."""
        if attention_mask is not None:
            raise ValueError(f"{self._who}: FP8/INT8/FP4 dense attention takes no attention_mask (H3 passes none)")
        value = value.contiguous()
        if plan.path == "fp8_attention":
            return fp8_attention(query, key, value, smooth_k=self.smooth_k, pv_fp8=self.pv_precision == "fp8",
                                 qk_dtype=QK_8BIT[self.precision], block_n=plan.block_n or None, tuning=plan.tuning,
                                 choice=plan.kernel)  # fmt: skip
        if self.precision == "fp4":
            if self.smooth_k:
                key = key - key.float().mean(1, keepdim=True).to(key.dtype)
            query, key, value = fake_quant_fp4(query), fake_quant_fp4(key), fake_quant_fp4_seq(value)
            if plan.path == "fp4_kernel":
                return block_sparse_attention(query, key, value, None, None, None, None, block=64, dense=True,
                                              p_fp4=self.fp4_p, choice=plan.kernel)  # fmt: skip
        else:
            query, key, value = fake_quantize_operands(
                query, key, value, smooth_k=self.smooth_k, pv_fp8=self.pv_precision == "fp8",
                qk_dtype=QK_8BIT[self.precision],
            )  # fmt: skip
        out = torch.nn.functional.scaled_dot_product_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        ).transpose(1, 2)
        return out

    def precision_label(self) -> str:
        emulated = self.last_plan.emulated if self.last_plan is not None else None
        return precision_label(self.precision, smooth_k=self.smooth_k, pv_precision=self.pv_precision,
                               fp4_p=self.fp4_p, emulated=emulated)

    def describe_path(self) -> str:
        choice = self.last_choice
        kernel = choice.describe() if choice is not None else "kernel chosen on the first call"
        return f"dense low-precision attention ({self.precision_label()}) via {kernel}"


enable_low_precision_attention, disable_low_precision_attention, low_precision_attention_state = (
    processor_entry_points(MiniMaxH3LowPrecisionAttnProcessor)
)
