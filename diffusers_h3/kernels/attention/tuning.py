"""The attention kernels' two small value types: what a call ran (:class:`KernelChoice`) and the one frozen
tuning object the benchmarks pass (:class:`TuningOptions`), which travels unchanged from the public entry points
through the router to the launchers. Custom ops take tensors and scalars, so at an op's boundary it travels as its
fields (:func:`tuning_op_fields`, :meth:`TuningOptions.from_op_fields`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple


KERNELS = ("auto", "sm90", "triton")


@dataclass(frozen=True)
class KernelChoice:
    """What one attention call ran: ``kernel`` (``"sm90-gluon"``, ``"triton"``, ``"torch-reference"``), its
    ``variant`` and the ``reason`` it was chosen."""

    kernel: str
    variant: str
    reason: str

    def describe(self) -> str:
        return f"{self.kernel} kernel ({self.variant}; {self.reason})"


@dataclass(frozen=True)
class TuningOptions:
    """Benchmark and tuning knobs of the attention kernels (the defaults are what production runs).

    Args:
        kernel: ``"auto"`` (the Hopper kernel where it runs, else Triton), ``"sm90"`` or ``"triton"`` (force one;
            an error when it cannot run these inputs).
        block_m: query rows per program of the dense mode (Triton: any power of two; SM90: 64 or 128).
        num_warps: Triton kernel warps (disables autotuning).
        num_stages: Triton software-pipeline stages (disables autotuning) or the SM90 K/V ring depth.
        tma: Triton kernel: TMA descriptor loads of K/V (default: on compute capability 9+).
        rotate: Triton kernel: issue the next key tile's QK product before the current softmax (default: on for
            sparse attention on GPUs).
        two_tiles: SM90 sparse kernel: two query tiles per program (default: for 16-bit Q/K when two K/V rings fit
            the shared memory).
    """

    kernel: str = "auto"
    block_m: Optional[int] = None
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None
    tma: Optional[bool] = None
    rotate: Optional[bool] = None
    two_tiles: Optional[bool] = None

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise ValueError(f"TuningOptions.kernel must be one of {KERNELS}, got {self.kernel!r}")

    @classmethod
    def from_op_fields(cls, *fields: Any) -> "TuningOptions":
        """The object back from :func:`tuning_op_fields` (inside a custom op)."""
        return cls(*fields)

    @property
    def triton_knobs(self) -> bool:
        """Whether a knob that only the Triton kernel has is set."""
        return self.num_warps is not None or self.tma is not None or self.rotate is not None


DEFAULT_TUNING = TuningOptions()


def tuning_op_fields(tuning: Optional[TuningOptions]) -> Tuple[Any, ...]:
    """``tuning`` (``None``: the defaults) as the custom ops take it: its fields in declaration order, which the ops
    pass back to :meth:`TuningOptions.from_op_fields` (plain attribute reads: traced code calls this)."""
    tuning = tuning if tuning is not None else DEFAULT_TUNING
    if not isinstance(tuning, TuningOptions):
        raise TypeError(f"tuning must be a TuningOptions, got {type(tuning).__name__}")
    return (tuning.kernel, tuning.block_m, tuning.num_warps, tuning.num_stages, tuning.tma, tuning.rotate,
            tuning.two_tiles)  # fmt: skip
