"""Helpers shared by the kernels of this package: import guard, interpreter detection, backend choice, and the
registration of kernel entry points as ``torch.library`` custom ops (the ``torch.compile`` boundary)."""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import torch

from .._utils import is_package_available, warn_once


HAS_TRITON = is_package_available("triton")

# Kernel entry points do host-side work (TMA descriptors, autotuning, shape dispatch, library calls) that
# torch.compile must not trace. Each one is a custom op ``diffusers_h3::<name>`` over tensors and plain scalars: dynamo
# puts one node per call in the graph (no graph break), its fake implementation gives the output's shape, dtype and
# strides, and inductor fuses the norms, casts and elementwise work around it. docs/architecture.md, "Kernels as custom
# ops", says how to add one.
OP_NAMESPACE = "diffusers_h3"


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
        return call

    return register


def _records_autograd(args, kwargs) -> bool:
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    return any(t.requires_grad for t in tensors)


def triton_interpreter_active() -> bool:
    """True when Triton runs its CPU interpreter (CI sets ``TRITON_INTERPRET=1`` before importing triton)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(op: str, *tensors: torch.Tensor, backend: str = "auto") -> bool:
    """Decide between the Triton kernel and the torch reference of ``op`` for these tensors
    (:func:`kernels_run_here`)."""
    return kernels_run_here(op, all(t.is_cuda for t in tensors), backend)


def kernels_run_here(op: str, on_cuda: bool, backend: str = "auto", *, warn: bool = True) -> bool:
    """Whether ``op`` runs its Triton kernel (True) or its torch reference (False), for inputs on CUDA (``on_cuda``)
    or not: a function of the arguments, so that callers can decide before the tensors exist.

    ``backend="triton"`` demands the kernel (error if it cannot run), ``"torch"`` demands the reference, ``"auto"``
    runs the kernel on CUDA tensors (or under the Triton interpreter) and otherwise the reference, warning once.
    """
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if backend == "torch":
        return False
    runnable = HAS_TRITON and (on_cuda or triton_interpreter_active())
    if backend == "triton":
        if not runnable:
            raise RuntimeError(
                f"{op}: backend='triton' needs CUDA tensors and the triton package (or TRITON_INTERPRET=1 for the "
                "CPU interpreter); pass backend='torch' to run the reference implementation"
            )
        return True
    if not runnable and warn:
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
