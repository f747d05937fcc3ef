"""Helpers shared by the kernels of this package: import guard, interpreter detection, backend choice, and the
registration of kernel entry points as ``torch.library`` custom ops (the ``torch.compile`` boundary)."""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Optional, Tuple

import torch

from .._utils import is_package_available, warn_once
from ..layout import ForwardRecord, active_forward_record, current_forward_record


HAS_TRITON = is_package_available("triton")

# Kernel entry points do host-side work (TMA descriptors, autotuning, shape dispatch, library calls) that
# torch.compile must not trace. Each one is a custom op ``diffusers_h3::<name>`` over tensors and plain scalars: dynamo
# puts one node per call in the graph (no graph break), its fake implementation gives the output's shape, dtype and
# strides, and inductor fuses the norms, casts and elementwise work around it. docs/architecture.md, "Kernels as custom
# ops", says how to add one.
OP_NAMESPACE = "diffusers_h3"


class PendingChoice:
    """What the custom op ``op`` runs in a call that ``torch.compile`` traces, where the op's implementation only runs
    after tracing: the processor keeps this stand-in and reads the choice from the :class:`~diffusers_h3.layout.
    ForwardRecord` of its last call when described (:meth:`resolve`). One constant object per op, so that every traced
    call stores the same value."""

    def __init__(self, op: str):
        self.op = op

    def resolve(self, record: Optional[ForwardRecord]) -> Any:
        """The choice the op recorded in ``record`` (``None``: not run in that call, or no record)."""
        return None if record is None else record.kernels.get(self.op)

    def __repr__(self) -> str:
        return f"PendingChoice({self.op!r})"


def kernel_op(name: str, fake: Callable[..., Any]):
    """Decorator: register a kernel entry point as the custom op ``diffusers_h3::<name>`` (no argument mutated) with
    ``fake`` as its fake (meta) implementation; returns a function with the entry point's signature (the op is its
    ``.op``).

    The function takes tensors, ints, floats, bools, strings, dtypes and lists / ``Optional`` of those (type-annotated)
    and returns fresh tensors (never a view of an input) with the exact shape, dtype and strides ``fake`` returns.
    Richer Python arguments (plans, tuning objects) stay in a wrapper with the public signature, which splits them.

    The op has no autograd formula: calls that record autograd (grad mode on and an input that requires grad, i.e.
    training) run the function itself, as before it was an op (differentiable where it is pure torch, such as the
    torch references; the Triton kernels' outputs carry no gradient). Inference (``torch.no_grad`` /
    ``torch.inference_mode``) runs the op.
    """

    def register(impl: Callable[..., Any]):
        op = torch.library.custom_op(f"{OP_NAMESPACE}::{name}", impl, mutates_args=())
        op.register_fake(fake)

        @functools.wraps(impl)
        def call(*args, **kwargs):
            if torch.is_grad_enabled() and _records_autograd(args, kwargs):
                return impl(*args, **kwargs)
            return op(*args, **kwargs)

        call.op = op
        call.op_name = name
        call.pending_choice = PendingChoice(name)
        return call

    return register


def _records_autograd(args, kwargs) -> bool:
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    return any(t.requires_grad for t in tensors)


def call_recording(op_call: Callable[..., Any], *args: Any) -> Tuple[Any, Any]:
    """``(op_call(*args), what its op ran)`` for a function made by :func:`kernel_op`. The op's implementation notes
    its choice in the running call's :class:`~diffusers_h3.layout.ForwardRecord` (:func:`~diffusers_h3.layout.
    record_kernel`; a private record outside a recorded call); in eager mode the choice is read back from it, under
    ``torch.compile`` (where the op has not run yet when the caller is traced) the op's :class:`PendingChoice`; ``None``
    when the op ran only its fake implementation (``FakeTensorMode``)."""
    if torch.compiler.is_compiling():
        return op_call(*args), op_call.pending_choice
    record = current_forward_record()
    if record is None:
        with active_forward_record(ForwardRecord()) as record:
            return op_call(*args), record.kernels.get(op_call.op_name)
    return op_call(*args), record.kernels.get(op_call.op_name)  # None: the op ran its fake (FakeTensorMode)


def triton_interpreter_active() -> bool:
    """True when Triton runs its CPU interpreter (CI sets ``TRITON_INTERPRET=1`` before importing triton)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(op: str, *tensors: torch.Tensor, backend: str = "auto") -> bool:
    """Decide between the Triton kernel and the torch reference of ``op``.

    ``backend="triton"`` demands the kernel (error if it cannot run), ``"torch"`` demands the reference, ``"auto"``
    runs the kernel on CUDA tensors (or under the Triton interpreter) and otherwise the reference, warning once.
    """
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if backend == "torch":
        return False
    on_cuda = all(t.is_cuda for t in tensors)
    runnable = HAS_TRITON and (on_cuda or triton_interpreter_active())
    if backend == "triton":
        if not runnable:
            raise RuntimeError(
                f"{op}: backend='triton' needs CUDA tensors and the triton package (or TRITON_INTERPRET=1 for the "
                "CPU interpreter); pass backend='torch' to run the reference implementation"
            )
        return True
    if not runnable:
        warn_once(
            f"{op}-torch",
            f"{op}: running the pure-torch reference (no CUDA tensors or no triton); it is exact but slow",
        )
    return runnable


def check_interpreter_dtype(op: str, *tensors: torch.Tensor) -> None:
    """The Triton interpreter computes bf16 on raw bit patterns: refuse bf16 there instead of returning garbage."""
    if triton_interpreter_active() and any(t.dtype == torch.bfloat16 for t in tensors):
        raise TypeError(
            f"{op}: bfloat16 inputs are wrong under the Triton interpreter (TRITON_INTERPRET=1); pass float16/float32 "
            "tensors on CPU, or run on a GPU"
        )
