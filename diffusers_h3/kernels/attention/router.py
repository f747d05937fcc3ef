"""The public block-sparse / dense attention entry point: validation, the pure kernel choice, launch.

:func:`select_kernel` picks one implementation for a description of the operands (:class:`AttentionOperands`: head
dim, dtypes, layouts, scales; no tensors) and says why, as a :class:`KernelChoice`:

* ``"sm90-gluon"``: the Hopper kernel of :mod:`.bsa_sm90` (TMA ring, q in registers, asynchronous wgmma), in the
  variants ``"dense-warp-specialized"`` (128 query rows, two consumer warpgroups and a producer warp),
  ``"dense-one-warpgroup"``, ``"two-tile"`` (sparse, two query tiles per program, one K/V ring each) and
  ``"one-tile"`` (sparse);
* ``"triton"``: the portable Triton kernel of :mod:`.bsa_triton` (every precision, FP4 P emulation, the interpreter),
  variants ``"sparse"`` / ``"dense"``;
* ``"torch-reference"``: :func:`~.bsa_triton.block_sparse_attention_reference` (no CUDA device / no Triton, or
  ``backend="torch"``): :func:`plan_kernel`.

The choice is made before the call, from the call's description alone, so that it can be planned once per
transformer call outside any compiled region (the attention processors' call plan) and reported as planned. The
custom op runs exactly the choice it is given (an error when it cannot run these inputs) and writes nothing else.
Benchmark-only knobs travel in one :class:`TuningOptions`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import torch

from .._triton_utils import (
    check_interpreter_dtype,
    kernel_op,
    kernels_run_here,
    triton_interpreter_active,
)
from ..numerics import QK_8BIT_DTYPES
from ._launch import check_attention_args
from .bsa_sm90 import (
    DEFAULT_STAGES,
    block_sparse_attention_sm90,
    channel_major_rows,
    sm90_kernel_available,
    two_rings_fit,
)
from .bsa_triton import block_sparse_attention_reference, block_sparse_attention_triton
from .tuning import (
    DEFAULT_TUNING,
    KERNELS,
    P_FP4_MODES,
    KernelChoice,
    TuningOptions,
    launch_options,
    read_launch_options,
)


__all__ = [  # the choice and tuning types live in .tuning (the launchers take them too); callers import them here
    "DEFAULT_TUNING",
    "KERNELS",
    "AttentionOperands",
    "KernelChoice",
    "TuningOptions",
    "attention_out_dtype",
    "block_sparse_attention",
    "launch_options",
    "plan_kernel",
    "select_kernel",
    "sm90_available_for",
    "sm90_input_problem",
    "sm90_kernel_supports",
]


@dataclass(frozen=True)
class AttentionOperands:
    """What the kernel choice reads of one attention call's operands: ``head_dim``, the Q/K and V dtypes, the storage
    of K (contiguous or not) and V (``"contiguous"``, ``"channel-major"``: ``[B, H, D, N]`` storage with 16-byte
    rows, what FP8 P·V reads, or ``"strided"``), whether Q/K and V carry scales, and the FP4 P emulation. Built from
    tensors with :meth:`of`, or ahead of the call by whoever builds the tensors (the attention processors' plans)."""

    head_dim: int
    qk_dtype: torch.dtype
    v_dtype: torch.dtype
    k_contiguous: bool = True
    v_layout: str = "contiguous"
    q_scaled: bool = False
    v_scaled: bool = False
    p_fp4: Optional[str] = None

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_scale=None, v_scale=None,
           p_fp4: Optional[str] = None) -> "AttentionOperands":  # fmt: skip
        if _channel_major(v):
            layout = "channel-major"
        else:
            layout = "contiguous" if v.is_contiguous() else "strided"
        return cls(q.shape[-1], q.dtype, v.dtype, k.is_contiguous(), layout, q_scale is not None, v_scale is not None,
                   p_fp4)  # fmt: skip


def _channel_major(v: torch.Tensor) -> bool:
    """The strides of channel-major ``v`` with 16-byte aligned rows (:func:`~.bsa_sm90.channel_major_rows` also checks
    the storage's address, which the launch does)."""
    if v.ndim != 4:
        return False
    _, _, h, d = v.shape
    sb, ss, sh, sd = v.stride()
    return ss == 1 and sh == d * sd and sb == h * sh and (sd * v.element_size()) % 16 == 0


def sm90_input_problem(operands: AttentionOperands, block: int = 64) -> str:
    """Why the Hopper kernel cannot run these operands (``""`` when it can), independent of the GPU at hand."""
    if operands.p_fp4 is not None:
        return "the FP4 P emulation runs on the Triton kernel"
    if operands.qk_dtype not in (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8):
        return f"it takes bf16/fp16 (or E4M3 / INT8 Q/K) inputs, got q {operands.qk_dtype}"
    if operands.v_scaled:
        if operands.v_dtype != torch.float8_e4m3fn or operands.v_layout != "channel-major":
            return "FP8 P.V needs a channel-major E4M3 v ([B, H, D, N] storage, 16-byte aligned rows)"
    elif operands.v_dtype not in (torch.bfloat16, torch.float16) or operands.v_layout != "contiguous":
        return f"it reads v by TMA and needs a contiguous bf16/fp16 v, got {operands.v_dtype}"
    if operands.head_dim not in (64, 128) or block not in (64, 128):
        return (f"it is built for head_dim 64/128 and 64/128-row tiles, got head_dim {operands.head_dim} and "
                f"{block}-row tiles")  # fmt: skip
    if not operands.k_contiguous:
        return "it reads k by TMA and needs it contiguous"
    return ""


def sm90_available_for(device: torch.device) -> bool:
    """Whether the Hopper kernel can run on ``device`` at all (not under the Triton interpreter)."""
    return not triton_interpreter_active() and sm90_kernel_available(device)


def sm90_kernel_supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, v_scale=None, p_fp4=None,
                         block: int = 64) -> Tuple[bool, str]:
    """``(True, "")`` when the Hopper kernel can run these inputs here, else ``(False, reason)``."""
    if not sm90_available_for(q.device):
        return False, "it needs a compute capability 9.x GPU (Hopper) and Triton >= 3.6 (Gluon)"
    problem = sm90_input_problem(AttentionOperands.of(q, k, v, v_scale=v_scale, p_fp4=p_fp4), block)
    return not problem, problem


def select_kernel(
    operands: AttentionOperands,
    *,
    block: int,
    dense: bool = False,
    tuning: TuningOptions = DEFAULT_TUNING,
    sm90_available: bool,
) -> KernelChoice:
    """The GPU kernel (and variant) that runs these operands, and why; ``sm90_available`` says whether this device
    runs the Hopper kernel at all (a parameter, so that the choice is testable anywhere). A pure function of its
    arguments.

    Raises ``ValueError`` when ``tuning`` forces something that cannot run these inputs.
    """
    problem = sm90_input_problem(operands, block)
    if not sm90_available:
        problem = "no compute capability 9.x GPU with Gluon (Triton >= 3.6) here"
    if tuning.kernel == "sm90":
        if problem:
            raise ValueError(f"TuningOptions(kernel='sm90') cannot run here: {problem}; pass kernel='triton'")
        if tuning.triton_knobs:
            raise ValueError("num_warps, tma and rotate are knobs of the Triton kernel; kernel='sm90' takes block_m, "
                             "num_stages and two_tiles")
    use_sm90 = tuning.kernel == "sm90" or (tuning.kernel == "auto" and not problem and not tuning.triton_knobs)
    if not use_sm90:
        if tuning.two_tiles is not None:
            raise ValueError("two_tiles is a knob of the SM90 sparse kernel, which does not run these inputs")
        if tuning.kernel == "triton":
            reason = "TuningOptions(kernel='triton')"
        elif tuning.triton_knobs and not problem:
            reason = "Triton tuning knobs (num_warps / tma / rotate) given"
        else:
            reason = f"the Hopper kernel does not run this: {problem}"
        return KernelChoice("triton", "dense" if dense else "sparse", reason)

    if dense:
        if tuning.two_tiles is not None:
            raise ValueError("two_tiles applies to the sparse mode; the dense SM90 kernel takes block_m 64 or 128")
        block_m = tuning.block_m or 128
        if block_m not in (64, 128):
            raise ValueError(f"the SM90 dense kernel takes block_m 64 or 128, got {block_m}")
        if block_m == 128:
            return KernelChoice("sm90-gluon", "dense-warp-specialized",
                                "128 query rows per program: two consumer warpgroups fed by a TMA producer warp")
        return KernelChoice("sm90-gluon", "dense-one-warpgroup", "block_m=64: one warpgroup per program")
    stages = tuning.num_stages or DEFAULT_STAGES
    k_bytes, v_bytes = operands.qk_dtype.itemsize, operands.v_dtype.itemsize
    fits = two_rings_fit(stages, block, operands.head_dim, k_bytes, v_bytes)
    if tuning.two_tiles and not fits:
        raise ValueError(f"two_tiles needs two rings of {stages} K/V slots, more than the shared memory holds; pass "
                         "fewer num_stages or two_tiles=False")
    if tuning.two_tiles is not None:
        two = tuning.two_tiles
        reason = f"TuningOptions(two_tiles={two})"
    elif not fits:
        two, reason = False, f"two rings of {stages} {block}-row K/V slots do not fit the shared memory"
    elif operands.q_scaled:
        two, reason = False, "8-bit Q/K: one query tile per program is faster"
    else:
        two, reason = True, "16-bit Q/K: two query tiles per program, one K/V ring each, TMA producer warp"
    return KernelChoice("sm90-gluon", "two-tile" if two else "one-tile", reason)


def plan_kernel(
    operands: AttentionOperands,
    device: torch.device,
    *,
    block: int,
    dense: bool = False,
    backend: str = "auto",
    tuning: Optional[TuningOptions] = None,
    op: str = "block_sparse_attention",
) -> KernelChoice:
    """The :class:`KernelChoice` of a call with these operands on ``device``: the torch reference where the kernels do
    not run (``backend="torch"``, or ``"auto"`` without a CUDA device or Triton; ``op`` names the call in the
    one-time warning), else :func:`select_kernel`. Checks the options that cannot go together first."""
    tuning = tuning if tuning is not None else DEFAULT_TUNING
    if not isinstance(tuning, TuningOptions):
        raise TypeError(f"tuning must be a TuningOptions, got {type(tuning).__name__}")
    if operands.p_fp4 not in P_FP4_MODES:
        raise ValueError(f"p_fp4 must be None, 'two_level' or 'single_level', got {operands.p_fp4!r}")
    if operands.p_fp4 is not None and operands.v_scaled:
        raise ValueError("p_fp4 (FP4 P) and v_scale (FP8 P.V) exclude each other")
    if tuning.block_m is not None and not dense:
        raise ValueError("TuningOptions.block_m applies to dense=True; sparse query tiles have `block` rows")
    if not kernels_run_here(op, device.type == "cuda", backend):
        if tuning != DEFAULT_TUNING:
            raise ValueError("TuningOptions are knobs of the GPU kernels; the torch reference runs here (no CUDA "
                             "tensors or backend='torch')")
        why = "backend='torch'" if backend == "torch" else "no CUDA tensors or no triton"
        return KernelChoice("torch-reference", "dense" if dense else "sparse", why)
    return select_kernel(operands, block=block, dense=dense, tuning=tuning, sm90_available=sm90_available_for(device))


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_rows: Optional[torch.Tensor],
    tile_counts: Optional[torch.Tensor],
    kv_index: Optional[torch.Tensor],
    kv_num: Optional[torch.Tensor],
    *,
    block: int,
    scale: Optional[float] = None,
    q_scale: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    dense: bool = False,
    out: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    p_fp4: Optional[str] = None,
    backend: str = "auto",
    tuning: Optional[TuningOptions] = None,
    choice: Optional[KernelChoice] = None,
    return_choice: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, KernelChoice]]:
    """Block-sparse (or, with ``dense=True``, dense) attention; the contract is in :mod:`.bsa_triton`.

    ``backend``: ``"auto"`` (kernels on CUDA tensors or under the Triton interpreter, else the torch reference with a
    one-time warning), ``"triton"`` (kernels or an error), ``"torch"`` (the reference). ``p_fp4``
    (``"two_level"`` / ``"single_level"``) emulates SageAttention3's FP4 P before P·V. ``tuning`` carries benchmark
    knobs (:class:`TuningOptions`). ``choice``: the :class:`KernelChoice` planned for this call (by default
    :func:`plan_kernel` of these inputs; callers that planned it pass it, and the call runs it or raises).

    ``v`` may be any strided view (FP8 P·V wants it channel-major: ``v.transpose`` of a ``[B, H, D, N]`` buffer).
    Returns ``out [B, S, H, D]`` (``out_dtype`` defaults to ``out``'s dtype, else ``q``'s, bfloat16 for 8-bit ``q``;
    with ``out`` the result is copied there), and with ``return_choice`` also the :class:`KernelChoice` that ran. The
    work runs in the custom op ``diffusers_h3::block_sparse_attention`` (one node under ``torch.compile``).
    """
    if choice is None:
        operands = AttentionOperands.of(q, k, v, q_scale=q_scale, v_scale=v_scale, p_fp4=p_fp4)
        choice = plan_kernel(operands, q.device, block=block, dense=dense, backend=backend, tuning=tuning)
    if out is not None and out_dtype is None:
        out_dtype = out.dtype  # the kernels write ``out``'s precision
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    tiles = [None] * 4 if dense else [slot_rows, tile_counts, kv_index, kv_num]
    result = block_sparse_attention_op(q, k, v, tiles, [q_scale, k_scale, v_scale], block, scale, out_dtype,
                                       choice.launch, launch_options(tuning, p_fp4))  # fmt: skip
    if out is not None:
        if out.shape != result.shape or out.stride(-1) != 1:
            raise ValueError(f"out must be a [B, S, H, D] tensor with a contiguous last dim, got {tuple(out.shape)}")
        out.copy_(result)
        result = out
    return (result, choice) if return_choice else result


def attention_out_dtype(q: torch.Tensor, out_dtype: Optional[torch.dtype]) -> torch.dtype:
    """The output dtype of the attention kernels: ``out_dtype``, else ``q``'s (bfloat16 for 8-bit ``q``)."""
    return out_dtype or (torch.bfloat16 if q.dtype in QK_8BIT_DTYPES else q.dtype)


def _block_sparse_attention_fake(q, k, v, tiles, scales, block, scale, out_dtype, launch, options) -> torch.Tensor:
    return q.new_empty(q.shape, dtype=attention_out_dtype(q, out_dtype))


@kernel_op("block_sparse_attention", _block_sparse_attention_fake)
def block_sparse_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tiles: List[Optional[torch.Tensor]],
    scales: List[Optional[torch.Tensor]],
    block: int,
    scale: float,
    out_dtype: Optional[torch.dtype],
    launch: str,
    options: List[int],
) -> torch.Tensor:
    """:func:`block_sparse_attention` over tensors and scalars: ``tiles`` = ``[slot_rows, tile_counts, kv_index,
    kv_num]`` (all ``None``: dense), ``scales`` = ``[q_scale, k_scale, v_scale]``, ``launch`` = the planned
    :attr:`KernelChoice.launch`, ``options`` = :func:`~.tuning.launch_options`. Runs that kernel; records nothing."""
    p_fp4, tuning = read_launch_options(options, launch)
    slot_rows, tile_counts, kv_index, kv_num = tiles
    q_scale, k_scale, v_scale = scales
    dense = slot_rows is None
    kernel = launch.partition(":")[0]
    if kernel == "torch-reference":
        return block_sparse_attention_reference(
            q, k, v, slot_rows, tile_counts, kv_index, kv_num, block=block, scale=scale, q_scale=q_scale,
            k_scale=k_scale, v_scale=v_scale, dense=dense, out_dtype=out_dtype, p_fp4=p_fp4,
        ).contiguous()
    if kernel not in ("sm90-gluon", "triton"):
        raise ValueError(f"unknown attention kernel choice {launch!r}")
    kernels_run_here("block_sparse_attention", q.is_cuda, "triton")  # the error when the planned kernel cannot run
    check_attention_args(q, k, v, slot_rows, tile_counts, kv_index, kv_num, block, q_scale, k_scale, v_scale, dense)
    check_interpreter_dtype("block_sparse_attention", q, k, v)
    b, s, h, d = q.shape
    if d & (d - 1) or d < 16:
        raise ValueError(f"head_dim must be a power of two >= 16 for the attention kernels, got {d}")
    for name, t in (("q", q), ("k", k)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    if q_scale is not None and q_scale.stride(2) != 1:
        raise ValueError("q_scale must be [B, S, H] with a contiguous head dimension")
    if v_scale is not None and block < 32:
        raise ValueError(f"FP8 P.V needs key blocks of at least 32 rows (the FP8 MMA K dimension), got {block}")
    out = torch.empty(b, s, h, d, device=q.device, dtype=attention_out_dtype(q, out_dtype))
    args = (q, k, v, slot_rows, tile_counts, kv_index, kv_num, out)
    scales = {"q_scale": q_scale, "k_scale": k_scale, "v_scale": v_scale}
    if kernel == "sm90-gluon":
        problem = sm90_input_problem(AttentionOperands.of(q, k, v, v_scale=v_scale, p_fp4=p_fp4), block)
        if v_scale is not None and not problem and channel_major_rows(v) is None:
            problem = "FP8 P.V needs v's channel-major storage 16-byte aligned"
        if problem:
            raise ValueError(f"block_sparse_attention was planned on the Hopper kernel, which cannot run these inputs: "
                             f"{problem}")  # fmt: skip
        block_sparse_attention_sm90(*args, block=block, scale=scale, dense=dense, tuning=tuning,
                                    two_tiles=bool(tuning.two_tiles), **scales)  # fmt: skip
    else:
        block_sparse_attention_triton(*args, block=block, scale=scale, dense=dense, p_fp4=p_fp4, tuning=tuning,
                                      **scales)
    return out
