"""Dense FP8 attention (a training-free speedup for base checkpoints): E4M3 Q/K, bf16 (or E4M3) P·V.

``fp8_attention(q, k, v)`` on ``[B, S, H, D]`` rows:

1. with ``smooth_k`` the per-head key mean over the sequence is subtracted (softmax is invariant to it, and the
   centred keys quantize with less error);
2. Q is quantized to E4M3 with one float32 scale per row and head (``amax / 448``), K with one per key block of
   ``block_n`` rows and head (the kernel folds it into the softmax scale); ``qk_dtype=torch.int8`` quantizes both to
   symmetric INT8 instead (``amax / 127``): same speed on Ampere/Hopper tensor cores, less rounding error
   (docs/attention.md);
3. with ``pv_fp8`` V is quantized per channel and ``P`` is rounded to E4M3 inside the kernel (``e4m3(448 p)``);
4. the dense mode of the block-sparse flash kernels (:func:`.router.block_sparse_attention`, which picks the Hopper
   or the Triton kernel) computes the attention with a float32 online softmax.

:func:`fp8_attention_reference` is the torch reference with the same quantization and math.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple, Union

import torch

from .._triton_utils import kernel_op, kernels_run_here
from ..numerics import (
    dequantize_fp8_per_block,
    quantize_fp8_per_block,
    quantize_fp8_per_channel,
    quantize_fp8_per_token,
)
from .bsa_triton import block_sparse_attention_reference
from .router import (
    AttentionOperands,
    KernelChoice,
    TuningOptions,
    block_sparse_attention_op,
    launch_options,
    plan_kernel,
    sm90_available_for,
)
from .v_fp8 import quantize_v_fp8_channel_major
from .vsa_pool import tile_quantize_fp8


def _quantize(q, k, v, smooth_k: bool, pv_fp8: bool, block_n: int,
              qk_dtype: torch.dtype) -> Tuple[torch.Tensor, ...]:
    if q.ndim != 4 or q.shape != k.shape or k.shape != v.shape:
        raise ValueError(f"q, k, v must be [batch, seq, heads, head_dim] of one shape, got {q.shape}, {k.shape}, {v.shape}")
    if smooth_k:
        k = k.float() - torch.mean(k, dim=1, dtype=torch.float32).unsqueeze(1)
    q8, q_scale = quantize_fp8_per_token(q, dtype=qk_dtype)
    k8, k_scale = quantize_fp8_per_block(k, block_n, dtype=qk_dtype)
    v_scale = None
    if pv_fp8:
        v, v_scale = quantize_fp8_per_channel(v, seq_dim=1)
    return q8, k8, v, q_scale, k_scale, v_scale


def fake_quantize_operands(q, k, v, *, smooth_k: bool = True, pv_fp8: bool = False, block_n: int = 64,
                           qk_dtype: torch.dtype = torch.float8_e4m3fn) -> Tuple[torch.Tensor, ...]:
    """Q, K, V rounded as :func:`fp8_attention` rounds its operands (K centred, per-token Q and per-key-block K
    scales, per-channel E4M3 V with ``pv_fp8``), returned dequantized in ``q.dtype``: a fast emulation for devices
    without 8-bit tensor cores. P's own E4M3 rounding (``pv_fp8``) is not emulated here."""
    q8, k8, v_, qs, ks, vs = _quantize(q, k, v, smooth_k, pv_fp8, block_n, qk_dtype)
    q_ = (q8.float() * qs.unsqueeze(-1)).to(q.dtype)
    k_ = dequantize_fp8_per_block(k8, ks, block_n).to(q.dtype)
    v_ = v if vs is None else (v_.float() * vs.unsqueeze(1)).to(v.dtype)
    return q_, k_, v_


def _default_block_n(q: torch.Tensor, kernel: str = "auto") -> int:
    """The fastest key block (and K-scale block) per kernel (docs/attention.md): 128 keys on the warp-specialized
    Hopper kernel, 64 on the Triton kernel."""
    return default_block_n(q.device, kernel)


def default_block_n(device: torch.device, kernel: str = "auto") -> int:
    """:func:`_default_block_n` for inputs on ``device`` (``kernel``: ``TuningOptions.kernel``)."""
    if kernel != "triton" and device.type == "cuda" and sm90_available_for(device):
        return 128
    return 64


def plan_fp8_attention(head_dim: int, device: torch.device, *, pv_fp8: bool = False, block_n: Optional[int] = None,
                       qk_dtype: torch.dtype = torch.float8_e4m3fn, out_dtype: torch.dtype = torch.bfloat16,
                       backend: str = "auto", tuning: Optional[TuningOptions] = None,
                       v_contiguous: bool = True) -> Tuple[KernelChoice, int]:
    """``(choice, block_n)`` of an :func:`fp8_attention` call with these options on ``device``, decided before the
    call (what the attention processors plan once per transformer call): the operands the call quantizes are
    known from the options (8-bit Q/K with scales; V as it comes, or channel-major E4M3 with ``pv_fp8``). Returns
    ``block_n`` 0 for the torch reference (which picks its own)."""
    tuning = tuning if tuning is not None else TuningOptions()
    if not kernels_run_here("fp8_attention", device.type == "cuda", backend):
        return plan_kernel(AttentionOperands(head_dim, qk_dtype, out_dtype), device, dense=True, backend=backend,
                           block=block_n or default_block_n(device), tuning=tuning, op="fp8_attention"), block_n or 0
    block_n = block_n or default_block_n(device, tuning.kernel)
    v_layout = "contiguous" if v_contiguous else "strided"
    v_dtype, v_layout = (torch.float8_e4m3fn, "channel-major") if pv_fp8 else (out_dtype, v_layout)
    operands = AttentionOperands(head_dim, qk_dtype, v_dtype, v_layout=v_layout, q_scaled=True, v_scaled=pv_fp8)
    return plan_kernel(operands, device, block=block_n, dense=True, backend="triton", tuning=tuning), block_n


def fp8_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, smooth_k: bool = True, pv_fp8: bool = False,
    scale: Optional[float] = None, block_n: Optional[int] = None, qk_dtype: torch.dtype = torch.float8_e4m3fn,
) -> torch.Tensor:
    """Torch reference of :func:`fp8_attention` (materialises the score matrix: small inputs only).

    ``block_n`` is the key block of the K scales (and, with ``pv_fp8``, of P's rounding against the running max).
    """
    block_n = block_n or _default_block_n(q)
    q8, k8, v_, qs, ks, vs = _quantize(q, k, v, smooth_k, pv_fp8, block_n, qk_dtype)
    return block_sparse_attention_reference(
        q8, k8, v_, None, None, None, None, block=block_n, scale=scale, q_scale=qs,
        k_scale=ks, v_scale=vs, dense=True, out_dtype=q.dtype,
    )


def fp8_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    smooth_k: bool = True,
    pv_fp8: bool = False,
    scale: Optional[float] = None,
    block_n: Optional[int] = None,
    qk_dtype: torch.dtype = torch.float8_e4m3fn,
    backend: str = "auto",
    tuning: Optional[TuningOptions] = None,
    choice: Optional[KernelChoice] = None,
    return_choice: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, KernelChoice]]:
    """Dense attention with E4M3 (or ``qk_dtype=torch.int8``: INT8) Q/K and optionally E4M3 P·V; returns
    ``[B, S, H, D]`` in ``q``'s dtype, and with ``return_choice`` also the :class:`~.router.KernelChoice` that ran.

    ``tuning`` (benchmarks only) picks and tunes the flash kernel, see :class:`~.router.TuningOptions`. ``choice`` and
    ``block_n``: as planned by :func:`plan_fp8_attention` (by default planned here). Quantization and attention run in
    the custom op ``diffusers_h3::fp8_attention`` (one node under ``torch.compile``).
    """
    if choice is None:
        choice, planned_block_n = plan_fp8_attention(q.shape[-1], q.device, pv_fp8=pv_fp8, block_n=block_n,
                                                     qk_dtype=qk_dtype, out_dtype=q.dtype, backend=backend,
                                                     tuning=tuning, v_contiguous=v.is_contiguous())  # fmt: skip
        block_n = planned_block_n or block_n
    out = fp8_attention_op(q, k, v, smooth_k, pv_fp8, scale, block_n, qk_dtype, choice.launch,
                           launch_options(tuning))  # fmt: skip
    return (out, choice) if return_choice else out


def _fp8_attention_fake(q, k, v, *options) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@kernel_op("fp8_attention", _fp8_attention_fake)
def fp8_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    smooth_k: bool,
    pv_fp8: bool,
    scale: Optional[float],
    block_n: Optional[int],
    qk_dtype: torch.dtype,
    launch: str,
    options: List[int],
) -> torch.Tensor:
    """:func:`fp8_attention` over tensors and scalars, running the planned ``launch`` (:attr:`KernelChoice.launch`)
    with ``options`` (:func:`~.tuning.launch_options`); records nothing."""
    if launch.startswith("torch-reference:"):
        out = fp8_attention_reference(q, k, v, smooth_k=smooth_k, pv_fp8=pv_fp8, scale=scale, block_n=block_n,
                                      qk_dtype=qk_dtype)
        return out.contiguous()
    kernels_run_here("fp8_attention", q.is_cuda, "triton")  # the error when the planned kernel cannot run here
    if q.ndim != 4 or q.shape != k.shape or k.shape != v.shape:
        raise ValueError(f"q, k, v must be [batch, seq, heads, head_dim] of one shape, got {q.shape}, {k.shape}, {v.shape}")
    if block_n is None:
        raise ValueError("fp8_attention_op needs the planned block_n (plan_fp8_attention)")
    # Quantize with the fused Triton pass over key-block chunks (same rounding as quantize_fp8_per_token / _per_block).
    s = q.shape[1]
    n_chunks = -(-s // block_n)
    slot_rows = torch.arange(n_chunks * block_n, device=q.device, dtype=torch.int32).clamp_max(s - 1)
    counts = torch.full((n_chunks,), block_n, device=q.device, dtype=torch.int32)
    counts[-1] = s - block_n * (n_chunks - 1)
    mean = torch.mean(k, dim=1, dtype=torch.float32) if smooth_k else None
    _, q8, qs = tile_quantize_fp8(q, slot_rows, counts, block_n, dtype=qk_dtype, backend="triton")
    _, k8, ks = tile_quantize_fp8(k, slot_rows, counts, block_n, subtract=mean, per_tile=True, dtype=qk_dtype,
                                  backend="triton")
    v_, vs = v, None
    if pv_fp8:  # channel-major E4M3 (rows padded to 16 bytes) for the FP8 P.V MMA
        v_, vs = quantize_v_fp8_channel_major(v, backend="triton")
    tiles = [None] * 4
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return block_sparse_attention_op(q8, k8, v_, tiles, [qs, ks, vs], block_n, scale, q.dtype, launch, options)
