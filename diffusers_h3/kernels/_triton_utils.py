"""Helpers shared by the kernels of this package: import guard, interpreter detection, backend choice, and the
``torch.compile`` boundary."""

from __future__ import annotations

import os

import torch

from .._utils import is_package_available, warn_once


HAS_TRITON = is_package_available("triton")

# Kernel entry points do host-side work (TMA descriptors, autotuning, shape dispatch) that torch.compile should not
# trace: under torch.compile (e.g. diffusers' ``transformer.compile_repeated_blocks()``) they run as eager islands and
# the surrounding projections, norms and elementwise ops compile around them.
opaque_to_compile = torch.compiler.disable


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
