"""``MiniMaxH3FlashInferProcessor``: H3 attention with FlashInfer's dense prefill kernel as its core.

The same math as diffusers' ``MiniMaxH3AttnProcessor`` (projections, QK RMSNorm, rotary and output are the base's);
only ``softmax(Q K^T / sqrt(d)) V`` runs in FlashInfer: FlashAttention-3 on Hopper, FlashAttention-2 on SM80+
(``backend="auto"``); at the H3 shape FlashInfer's FA3 bf16 kernel is faster than cuDNN (see
``docs/attention.md``). ``precision="fp8"`` runs FA3's FP8 kernel instead (Hopper only; E4M3 Q/K/V with one scale per
head, FP8 P·V): an approximation, like this package's dense FP8 attention, with coarser scales. FlashInfer is optional
(``pip install flashinfer-python``) and builds its kernels on first use.

Install it with :func:`enable_flashinfer_attention`, which checks the package and the GPU once, before anything
changes. The kernel is planned once per transformer call (:class:`FlashInferPlan`, shared by the blocks of one
``enable_flashinfer_attention``); refiner calls and context parallelism (Ulysses) follow
:class:`~.base.MiniMaxH3AttnProcessorBase`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from .._utils import cuda_capability
from ..kernels.attention.flashinfer_dense import (
    check_flashinfer_kernels,
    flashinfer_dense_attention_op,
    flashinfer_fp8_attention_op,
    flashinfer_kernel_choice,
    resolve_backend,
)
from .base import CallInputs, MiniMaxH3AttnProcessorBase, PlanForInputs
from .install import processor_entry_points, register_attention_processor


PRECISIONS = ("bf16", "fp8")


def _check_precision(precision: str, backend: Optional[str] = None) -> None:
    """A known precision, and (given a resolved backend) one that backend runs."""
    if precision not in PRECISIONS:
        raise ValueError(f"FlashInfer attention precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "fp8" and backend is not None and backend != "fa3":
        raise ValueError(f"FlashInfer FP8 attention runs on FA3 (Hopper) only, not {backend!r}: use precision='bf16' "
                         "or enable_low_precision_attention(pipe, LowPrecisionAttentionConfig('fp8'))")  # fmt: skip


@dataclass(frozen=True)
class FlashInferAttentionConfig:
    """The options of :func:`enable_flashinfer_attention`.

    Args:
        backend (`str`, defaults to `"auto"`): ``"fa3"`` (Hopper), ``"fa2"`` (SM80+) or ``"auto"`` (FA3 where the GPU
            runs it, else FA2).
        precision (`str`, defaults to `"bf16"`): ``"bf16"`` (16-bit Q/K/V as they come, exact) or ``"fp8"`` (FA3's
            FP8 kernel, Hopper only).
    """

    backend: str = "auto"
    precision: str = "bf16"

    def __post_init__(self):
        _check_precision(self.precision)


@dataclass(frozen=True)
class FlashInferPlan(PlanForInputs):
    """The FlashInfer processor's plan of one transformer call: the ``backend`` (``"fa2"`` / ``"fa3"``), ``precision``
    and ``smooth_k`` the core runs, their ``kernel`` choice, and the inputs it was made for."""

    backend: str
    precision: str
    smooth_k: bool

    def describe(self) -> str:
        return f"dense FlashInfer ({self.precision}): {self.kernel.describe()}"


@register_attention_processor("flashinfer_attention", FlashInferAttentionConfig, legacy_positional=("backend", "precision"))
class MiniMaxH3FlashInferProcessor(MiniMaxH3AttnProcessorBase):
    """Dense attention through FlashInfer. ``backend``: ``"fa3"`` or ``"fa2"`` (resolved from the GPU by
    :func:`enable_flashinfer_attention` when asked for ``"auto"``); ``precision``: ``"bf16"`` (16-bit Q/K/V as they
    come, exact) or ``"fp8"`` (FA3's FP8 kernel; ``smooth_k`` subtracts the per-head key mean first). ``config``: the
    :class:`FlashInferAttentionConfig` it was installed with (one object for every block, so that a transformer call
    plans them once; a processor made by hand has none and plans for itself)."""

    def __init__(self, backend: str = "fa3", precision: str = "bf16", smooth_k: bool = True, *,
                 kernel_source: Optional[str] = None, config: Optional[FlashInferAttentionConfig] = None):
        super().__init__()
        if backend not in ("fa2", "fa3"):
            raise ValueError(f"MiniMaxH3FlashInferProcessor backend must be 'fa2' or 'fa3', got {backend!r}")
        _check_precision(precision, backend)
        self.backend = backend
        self.precision = precision
        self.smooth_k = bool(smooth_k)
        self.kernel_source = kernel_source  # where FlashInfer's kernels come from, as checked when installed
        self.config = config

    # -- the plan of a call (made once per transformer call, outside the compiled blocks) -----------------------------
    plans_read_layout = False  # dense attention: the plan does not depend on the call's layout

    @property
    def plan_key(self):
        """The installed config (shared by the blocks of one ``enable_flashinfer_attention``), else the processor."""
        return self.config if self.config is not None else self

    def plan_call(self, call: CallInputs) -> FlashInferPlan:
        """The kernel a call with Q/K/V of ``call.dtype`` on ``call.device`` runs (:func:`flashinfer_kernel_choice`)."""
        kernel = flashinfer_kernel_choice(self.backend, self.precision, self.smooth_k, on_cuda=call.device.type == "cuda")
        return FlashInferPlan(kernel, call.device, call.dtype, call.head_dim, backend=self.backend,
                              precision=self.precision, smooth_k=self.smooth_k)  # fmt: skip

    # -- the core ----------------------------------------------------------------------------------------------------
    def core(self, query, key, value, attention_mask=None, **extras):
        if extras:
            raise TypeError(f"{type(self).__name__} takes no extras, got {sorted(extras)}")
        if attention_mask is not None:
            raise ValueError(f"{type(self).__name__}: FlashInfer dense attention takes no attention_mask (H3 passes none)")
        plan = self.current_plan(query)
        if plan.precision == "fp8":
            return flashinfer_fp8_attention_op(query, key, value, plan.smooth_k)
        return flashinfer_dense_attention_op(query, key, value, plan.backend)

    # -- installation ------------------------------------------------------------------------------------------------
    @classmethod
    def prepare(cls, config: FlashInferAttentionConfig, model, blocks) -> Tuple[str, str]:
        """Checks first, with one clear error and nothing changed: flashinfer-python is importable, its kernels can be
        built (a CUDA compiler) or loaded (``flashinfer-jit-cache``), and the model is on a CUDA GPU of SM80+ (``"fa3"``
        needs SM90, as does ``precision="fp8"``). Q/K/V must be bf16 or fp16 at call time (checked per call). Returns
        the resolved backend and where the kernels come from."""
        kernels = check_flashinfer_kernels()
        tensors = itertools.chain(blocks[0].parameters(), blocks[0].buffers()) if len(blocks) else iter(())
        device = next(tensors, torch.empty(0)).device  # a block without parameters reports its buffers' device
        resolved = resolve_backend(config.backend, cuda_capability(device))
        _check_precision(config.precision, resolved)
        return resolved, kernels

    @classmethod
    def for_block(cls, config: FlashInferAttentionConfig, prepared: Tuple[str, str], index: int, block):
        backend, kernels = prepared
        return cls(backend, config.precision, kernel_source=kernels, config=config)

    @classmethod
    def state(cls, found) -> Dict[str, Any]:
        """``blocks`` (with one), the resolved ``backend``, ``precision``, ``kernels`` (where FlashInfer's kernels come
        from, as checked when installed) and ``path`` (the first processor's ``describe_path()``)."""
        first = found[0][1]
        return {"blocks": len(found), "backend": first.backend, "precision": first.precision,
                "kernels": first.kernel_source, "path": first.describe_path()}  # fmt: skip


enable_flashinfer_attention, disable_flashinfer_attention, flashinfer_attention_state = processor_entry_points(
    MiniMaxH3FlashInferProcessor
)
