"""The public block-sparse / dense attention entry point: validation, kernel choice, launch.

:func:`block_sparse_attention` checks its inputs once, then :func:`select_kernel` picks one implementation and says
why, as a :class:`KernelChoice`:

* ``"sm90-gluon"``: the Hopper kernel of :mod:`.bsa_sm90` (TMA ring, q in registers, asynchronous wgmma), in the
  variants ``"dense-warp-specialized"`` (128 query rows, two consumer warpgroups and a producer warp),
  ``"dense-one-warpgroup"``, ``"two-tile"`` (sparse, two query tiles per program, one K/V ring each) and
  ``"one-tile"`` (sparse);
* ``"triton"``: the portable Triton kernel of :mod:`.bsa_triton` (every precision, FP4 P emulation, the interpreter),
  variants ``"sparse"`` / ``"dense"``;
* ``"torch-reference"``: :func:`~.bsa_triton.block_sparse_attention_reference` (no CUDA tensors / no Triton, or
  ``backend="torch"``).

Callers that report what ran (``describe()``) pass ``return_choice=True`` and keep the record; nothing re-derives it.
Benchmark-only knobs travel in one :class:`TuningOptions`.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch

from ...layout import record_kernel
from .._triton_utils import (
    call_recording,
    check_interpreter_dtype,
    kernel_op,
    triton_interpreter_active,
    use_triton,
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
from .tuning import DEFAULT_TUNING, KERNELS, KernelChoice, TuningOptions, tuning_op_fields


__all__ = [  # the choice and tuning types live in .tuning (the launchers take them too); callers import them here
    "DEFAULT_TUNING",
    "KERNELS",
    "KernelChoice",
    "TuningOptions",
    "attention_out_dtype",
    "block_sparse_attention",
    "select_kernel",
    "sm90_available_for",
    "sm90_input_problem",
    "sm90_kernel_supports",
    "tuning_op_fields",
]


def sm90_input_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, v_scale=None, p_fp4=None,
                       block: int = 64) -> str:
    """Why the Hopper kernel cannot run these inputs (``""`` when it can), independent of the GPU at hand."""
    if p_fp4 is not None:
        return "the FP4 P emulation runs on the Triton kernel"
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8):
        return f"it takes bf16/fp16 (or E4M3 / INT8 Q/K) inputs, got q {q.dtype}"
    if v_scale is not None:
        if v.dtype != torch.float8_e4m3fn or channel_major_rows(v) is None:
            return "FP8 P.V needs a channel-major E4M3 v ([B, H, D, N] storage, 16-byte aligned rows)"
    elif v.dtype not in (torch.bfloat16, torch.float16) or not v.is_contiguous():
        return f"it reads v by TMA and needs a contiguous bf16/fp16 v, got {v.dtype}"
    if q.shape[-1] not in (64, 128) or block not in (64, 128):
        return f"it is built for head_dim 64/128 and 64/128-row tiles, got head_dim {q.shape[-1]} and {block}-row tiles"
    if not k.is_contiguous():
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
    problem = sm90_input_problem(q, k, v, v_scale=v_scale, p_fp4=p_fp4, block=block)
    return not problem, problem


def select_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block: int,
    dense: bool = False,
    q_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    p_fp4: Optional[str] = None,
    tuning: TuningOptions = DEFAULT_TUNING,
    sm90_available: bool,
) -> KernelChoice:
    """The GPU kernel (and variant) that runs these validated inputs, and why; ``sm90_available`` says whether this
    device runs the Hopper kernel at all (a parameter, so that the choice is testable anywhere).

    Raises ``ValueError`` when ``tuning`` forces something that cannot run these inputs.
    """
    problem = sm90_input_problem(q, k, v, v_scale=v_scale, p_fp4=p_fp4, block=block)
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
    fits = two_rings_fit(stages, block, q.shape[-1], k.element_size(), v.element_size())
    if tuning.two_tiles and not fits:
        raise ValueError(f"two_tiles needs two rings of {stages} K/V slots, more than the shared memory holds; pass "
                         "fewer num_stages or two_tiles=False")
    if tuning.two_tiles is not None:
        two = tuning.two_tiles
        reason = f"TuningOptions(two_tiles={two})"
    elif not fits:
        two, reason = False, f"two rings of {stages} {block}-row K/V slots do not fit the shared memory"
    elif q_scale is not None:
        two, reason = False, "8-bit Q/K: one query tile per program is faster"
    else:
        two, reason = True, "16-bit Q/K: two query tiles per program, one K/V ring each, TMA producer warp"
    return KernelChoice("sm90-gluon", "two-tile" if two else "one-tile", reason)


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
    return_choice: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, KernelChoice]]:
    """Block-sparse (or, with ``dense=True``, dense) attention; the contract is in :mod:`.bsa_triton`.

    ``backend``: ``"auto"`` (kernels on CUDA tensors or under the Triton interpreter, else the torch reference with a
    one-time warning), ``"triton"`` (kernels or an error), ``"torch"`` (the reference). ``p_fp4``
    (``"two_level"`` / ``"single_level"``) emulates SageAttention3's FP4 P before P·V. ``tuning`` carries benchmark
    knobs (:class:`TuningOptions`).

    ``v`` may be any strided view (FP8 P·V wants it channel-major: ``v.transpose`` of a ``[B, H, D, N]`` buffer).
    Returns ``out [B, S, H, D]`` (``out_dtype`` defaults to ``out``'s dtype, else ``q``'s, bfloat16 for 8-bit ``q``;
    with ``out`` the result is copied there), and with ``return_choice`` also the :class:`KernelChoice` that ran. The work runs in
    the custom op ``diffusers_h3::block_sparse_attention`` (one node under ``torch.compile``).
    """
    fields = tuning_op_fields(tuning)
    if out is not None and out_dtype is None:
        out_dtype = out.dtype  # the kernels write ``out``'s precision
    result, choice = call_recording(
        block_sparse_attention_op, q, k, v, slot_rows, tile_counts, kv_index, kv_num, block, scale, q_scale, k_scale,
        v_scale, dense, out_dtype, p_fp4, backend, *fields,
    )
    if out is not None:
        if out.shape != result.shape or out.stride(-1) != 1:
            raise ValueError(f"out must be a [B, S, H, D] tensor with a contiguous last dim, got {tuple(out.shape)}")
        out.copy_(result)
        result = out
    return (result, choice) if return_choice else result


def attention_out_dtype(q: torch.Tensor, out_dtype: Optional[torch.dtype]) -> torch.dtype:
    """The output dtype of the attention kernels: ``out_dtype``, else ``q``'s (bfloat16 for 8-bit ``q``)."""
    return out_dtype or (torch.bfloat16 if q.dtype in QK_8BIT_DTYPES else q.dtype)


def _block_sparse_attention_fake(q, k, v, slot_rows, tile_counts, kv_index, kv_num, block, scale, q_scale, k_scale,
                                 v_scale, dense, out_dtype, *p_fp4_backend_and_tuning) -> torch.Tensor:
    return q.new_empty(q.shape, dtype=attention_out_dtype(q, out_dtype))


@kernel_op("block_sparse_attention", _block_sparse_attention_fake)
def block_sparse_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_rows: Optional[torch.Tensor],
    tile_counts: Optional[torch.Tensor],
    kv_index: Optional[torch.Tensor],
    kv_num: Optional[torch.Tensor],
    block: int,
    scale: Optional[float],
    q_scale: Optional[torch.Tensor],
    k_scale: Optional[torch.Tensor],
    v_scale: Optional[torch.Tensor],
    dense: bool,
    out_dtype: Optional[torch.dtype],
    p_fp4: Optional[str],
    backend: str,
    kernel: str,
    block_m: Optional[int],
    num_warps: Optional[int],
    num_stages: Optional[int],
    tma: Optional[bool],
    rotate: Optional[bool],
    two_tiles: Optional[bool],
) -> torch.Tensor:
    """:func:`block_sparse_attention` over tensors and scalars (the :class:`TuningOptions` as its fields); records the
    :class:`KernelChoice` that ran."""
    tuning = TuningOptions.from_op_fields(kernel, block_m, num_warps, num_stages, tma, rotate, two_tiles)
    out, choice = _run_block_sparse_attention(
        q, k, v, slot_rows, tile_counts, kv_index, kv_num, block=block, scale=scale, q_scale=q_scale,
        k_scale=k_scale, v_scale=v_scale, dense=dense, out_dtype=out_dtype, p_fp4=p_fp4, backend=backend,
        tuning=tuning,
    )
    record_kernel("block_sparse_attention", choice)
    return out


def _run_block_sparse_attention(q, k, v, slot_rows, tile_counts, kv_index, kv_num, *, block, scale, q_scale,
                                k_scale, v_scale, dense, out_dtype, p_fp4, backend,
                                tuning) -> Tuple[torch.Tensor, KernelChoice]:
    if p_fp4 not in (None, "two_level", "single_level"):
        raise ValueError(f"p_fp4 must be None, 'two_level' or 'single_level', got {p_fp4!r}")
    if p_fp4 is not None and v_scale is not None:
        raise ValueError("p_fp4 (FP4 P) and v_scale (FP8 P.V) exclude each other")
    if tuning.block_m is not None and not dense:
        raise ValueError("TuningOptions.block_m applies to dense=True; sparse query tiles have `block` rows")
    mode = "dense" if dense else "sparse"
    if not use_triton("block_sparse_attention", q, k, v, backend=backend):
        if tuning != DEFAULT_TUNING:
            raise ValueError("TuningOptions are knobs of the GPU kernels; the torch reference runs here (no CUDA "
                             "tensors or backend='torch')")
        result = block_sparse_attention_reference(
            q, k, v, slot_rows, tile_counts, kv_index, kv_num, block=block, scale=scale, q_scale=q_scale,
            k_scale=k_scale, v_scale=v_scale, dense=dense, out_dtype=out_dtype, p_fp4=p_fp4,
        )
        why = "backend='torch'" if backend == "torch" else "no CUDA tensors or no triton"
        return result.contiguous(), KernelChoice("torch-reference", mode, why)

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
    choice = select_kernel(q, k, v, block=block, dense=dense, q_scale=q_scale, v_scale=v_scale, p_fp4=p_fp4,
                           tuning=tuning, sm90_available=sm90_available_for(q.device))
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty(b, s, h, d, device=q.device, dtype=attention_out_dtype(q, out_dtype))
    args = (q, k, v, slot_rows, tile_counts, kv_index, kv_num, out)
    scales = {"q_scale": q_scale, "k_scale": k_scale, "v_scale": v_scale}
    if choice.kernel == "sm90-gluon":
        block_sparse_attention_sm90(*args, block=block, scale=scale, dense=dense, tuning=tuning,
                                    two_tiles=choice.variant == "two-tile", **scales)
    else:
        block_sparse_attention_triton(*args, block=block, scale=scale, dense=dense, p_fp4=p_fp4, tuning=tuning,
                                      **scales)
    return out, choice
