"""The attention kernels' small value types: which kernel runs a call (:class:`KernelChoice`, decided before the call
by the router's pure :func:`~.router.select_kernel` and passed to the op, which runs exactly that) and the one frozen
tuning object the benchmarks pass (:class:`TuningOptions`). Custom ops take tensors and a few ints and strings, so at
an op's boundary a choice travels as its ``launch`` string and the knobs as one list of ints
(:func:`launch_options`, :func:`read_launch_options`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple


KERNELS = ("auto", "sm90", "triton")
# The FP4 emulations of P before P·V (None: 16-bit P), by their code in an op's launch options.
P_FP4_MODES = (None, "two_level", "single_level")


@dataclass(frozen=True)
class KernelChoice:
    """What one attention call ran: ``kernel`` (``"sm90-gluon"``, ``"triton"``, ``"torch-reference"``), its
    ``variant`` and the ``reason`` it was chosen."""

    kernel: str
    variant: str
    reason: str

    def describe(self) -> str:
        return f"{self.kernel} kernel ({self.variant}; {self.reason})"

    @property
    def launch(self) -> str:
        """``"<kernel>:<variant>"``: what an op needs to run this choice (the reason stays with the caller)."""
        return f"{self.kernel}:{self.variant}"


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

    @property
    def triton_knobs(self) -> bool:
        """Whether a knob that only the Triton kernel has is set."""
        return self.num_warps is not None or self.tma is not None or self.rotate is not None


DEFAULT_TUNING = TuningOptions()


def launch_options(tuning: Optional[TuningOptions], p_fp4: Optional[str] = None) -> List[int]:
    """The knobs an attention op reads besides its kernel choice, as ints (``-1``: unset): the FP4 P mode (its index in
    :data:`P_FP4_MODES`), then ``tuning``'s ``block_m``, ``num_warps``, ``num_stages``, ``tma`` and ``rotate``. Its
    ``kernel`` and ``two_tiles`` are part of the choice. Plain attribute reads: traced code calls this."""
    tuning = tuning if tuning is not None else DEFAULT_TUNING
    if not isinstance(tuning, TuningOptions):
        raise TypeError(f"tuning must be a TuningOptions, got {type(tuning).__name__}")
    if p_fp4 not in P_FP4_MODES:
        raise ValueError(f"p_fp4 must be None, 'two_level' or 'single_level', got {p_fp4!r}")
    knobs = (tuning.block_m, tuning.num_warps, tuning.num_stages, tuning.tma, tuning.rotate)
    return [P_FP4_MODES.index(p_fp4) - 1, *(-1 if k is None else int(k) for k in knobs)]


def read_launch_options(options: Sequence[int], choice: str) -> Tuple[Optional[str], TuningOptions]:
    """``(p_fp4, tuning)`` back from :func:`launch_options` inside an op, for the choice ``"<kernel>:<variant>"``."""
    p_code, block_m, num_warps, num_stages, tma, rotate = (None if x < 0 else int(x) for x in options)
    kernel, _, variant = choice.partition(":")
    two_tiles = {"two-tile": True, "one-tile": False}.get(variant) if kernel == "sm90-gluon" else None
    tuning = TuningOptions(
        kernel={"sm90-gluon": "sm90", "triton": "triton"}.get(kernel, "auto"), block_m=block_m, num_warps=num_warps,
        num_stages=num_stages, tma=None if tma is None else bool(tma), rotate=None if rotate is None else bool(rotate),
        two_tiles=two_tiles,
    )
    return P_FP4_MODES[p_code + 1] if p_code is not None else None, tuning
