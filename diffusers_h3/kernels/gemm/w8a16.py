"""W8A16 GEMM: int8 weights with per-output-channel (or per-group) fp32 scales, 16-bit activations.

Entry point :func:`w8a16_linear` computes ``x @ dequant(W).T + bias``.

Numerics contract (shared by the Triton kernel and :func:`w8a16_linear_reference`):

- Quantization (:func:`w8a16_quantize`): symmetric, ``scale = amax / 127`` per output row (or per ``group_size``
  input columns), ``q = clamp(round_half_even(w / scale), -127, 127)``; all-zero rows get scale 1 and code 0.
- Per-channel GEMM: ``out = (x @ q.T) * scale + bias``, products of 16-bit activations and exact int8 values, fp32
  accumulation, the scale applied in fp32 to the accumulator, one rounding to the output dtype.
- Per-group GEMM: ``w = (q * scale).to(x.dtype)`` (fp32 product, one rounding), then ``x @ w.T`` with fp32 accumulation.

The Triton kernel dequantizes in registers (int8 -> 16-bit tile, no dense copy of the weight), feeds ``tl.dot`` and
is autotuned over a few large tiles for the compute-bound prefill shapes of video DiTs. It needs a tensor-core GPU
(SM80+); on CPU it runs under ``TRITON_INTERPRET=1`` (tests, fp16/fp32 only).
"""

from __future__ import annotations

from typing import Optional

import torch

from .._triton_utils import HAS_TRITON, kernel_op
from ._common import (
    LARGE_M_ROWS,
    check_2d_weight,
    dequant_tile,
    gemm_configs,
    launch_gemm,
    linear_fake,
    m_bucket,
    prepare_gemm_io,
    triton_gemm_supported,
)


if HAS_TRITON:
    import triton
    import triton.language as tl

    from ._tiles import accumulate_dot, grouped_tile_ids, store_output_tile


# ----------------------------------------------------------------------------------------------------------------
# Quantization and torch reference


def w8a16_quantize(weight: torch.Tensor, group_size: Optional[int] = None):
    """``[N, K]`` float weight -> (int8 codes ``[N, K]``, fp32 scales ``[N]`` or ``[N, K / group_size]``)."""
    check_2d_weight("weight", weight)
    n, k = weight.shape
    w = weight.detach().float()
    if group_size is None:
        amax = w.abs().amax(dim=1)
        scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return q, scale
    if group_size <= 0 or k % group_size:
        raise ValueError(
            f"group_size={group_size} must be positive and divide in_features={k}; pick a divisor or group_size=None."
        )
    g = w.reshape(n, k // group_size, group_size)
    amax = g.abs().amax(dim=2)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(g / scale[..., None]).clamp(-127, 127).to(torch.int8).reshape(n, k)
    return q, scale


def w8a16_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Effective weight ``(q * scale)`` rounded once to ``dtype``."""
    if scale.dim() == 1:
        return (q.float() * scale.float()[:, None]).to(dtype)
    n, k = q.shape
    groups = scale.shape[1]
    w = q.float().reshape(n, groups, k // groups) * scale.float()[..., None]
    return w.reshape(n, k).to(dtype)


def w8a16_linear_reference(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Pure-torch reference of the kernel's numerics (fp32 math, output in ``x.dtype``)."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    if scale.dim() == 1:
        out = (x2 @ q.float().T) * scale.float()[None, :]
    else:
        out = x2 @ w8a16_dequantize(q, scale, x.dtype).float().T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], q.shape[0])


# ----------------------------------------------------------------------------------------------------------------
# Triton kernel

if HAS_TRITON:

    @triton.jit
    def _w8a16_kernel(
        x_ptr, w_ptr, s_ptr, b_ptr, o_ptr,
        M, N, K, M_BUCKET,
        stride_xm, stride_wn, stride_sn, stride_om,
        GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        SWAP_AB: tl.constexpr,
    ):  # fmt: skip
        pid_m, pid_n = grouped_tile_ids(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m = offs_m < M
        mask_n = offs_n < N
        x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask_k = (k0 + offs_k) < K
            x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            q = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0)
            if GROUP_K > 0:
                s = tl.load(
                    s_ptr + offs_n[:, None] * stride_sn + ((k0 + offs_k) // GROUP_K)[None, :],
                    mask=mask_n[:, None] & mask_k[None, :],
                    other=0.0,
                )
                w = (q.to(tl.float32) * s).to(x.dtype)
            else:
                w = q.to(x.dtype)
            acc = accumulate_dot(x, w, acc, SWAP_AB, IEEE)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if SWAP_AB:
            acc = tl.trans(acc)
        if GROUP_K == 0:
            s = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)
            acc = acc * s[None, :]
        store_output_tile(acc, o_ptr, b_ptr, offs_m, offs_n, mask_m, mask_n, stride_om, HAS_BIAS)

    _w8a16_autotuned = triton.autotune(configs=gemm_configs(), key=["N", "K", "M_BUCKET", "GROUP_K"])(_w8a16_kernel)

    @triton.jit
    def _w8a16_dequant_kernel(w_ptr, s_ptr, o_ptr, N, K, stride_wn, stride_sn, stride_on,
                              GROUP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
        q = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :], mask=mask, other=0)
        if GROUP_K > 0:
            s = tl.load(s_ptr + offs_n[:, None] * stride_sn + (offs_k // GROUP_K)[None, :], mask=mask, other=0.0)
        else:
            s = tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0)[:, None]
        w = q.to(tl.float32) * s
        o_ptrs = o_ptr + offs_n[:, None].to(tl.int64) * stride_on + offs_k[None, :]
        tl.store(o_ptrs, w.to(o_ptr.dtype.element_ty), mask=mask)


def w8a16_linear_triton(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    tile: Optional[dict] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Triton path of :func:`w8a16_linear` (no dispatch; raises if Triton cannot run here)."""
    n, k = q.shape
    x2, out = prepare_gemm_io("W8A16", x, n, k, out)
    m = x2.shape[0]
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    group_k = 0 if scale.dim() == 1 else k // scale.shape[1]
    q = q.contiguous()
    scale = scale.float().contiguous()
    b = bias.contiguous() if bias is not None else scale
    args = (x2, q, scale, b, out, m, n, k, m_bucket(m), x2.stride(0), q.stride(0), scale.stride(0), out.stride(0))
    meta = {"GROUP_K": group_k, "HAS_BIAS": bias is not None, "IEEE": x.dtype == torch.float32}
    launch_gemm(_w8a16_kernel, _w8a16_autotuned, args, m, n, meta, tile)
    return out.reshape(*x.shape[:-1], n)


def w8a16_dequantize_triton(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Triton version of :func:`w8a16_dequantize` (same fp32 product, one rounding to ``dtype``: bitwise equal)."""
    if not triton_gemm_supported(q.device):
        raise RuntimeError(f"The Triton dequantize kernel needs CUDA SM80+ (or TRITON_INTERPRET=1); got {q.device}.")
    n, k = q.shape
    q = q.contiguous()
    scale = scale.float().contiguous()
    out = torch.empty((n, k), device=q.device, dtype=dtype)
    group_k = 0 if scale.dim() == 1 else k // scale.shape[1]
    bn, bk = dequant_tile()
    grid = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    _w8a16_dequant_kernel[grid](q, scale, out, n, k, q.stride(0), scale.stride(0), out.stride(0),
                                GROUP_K=group_k, BLOCK_N=bn, BLOCK_K=bk)  # fmt: skip
    return out


@kernel_op("w8a16_linear", linear_fake)
def w8a16_linear(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    backend: str = "auto",
    large_m_rows: int = LARGE_M_ROWS,
) -> torch.Tensor:
    """``x @ dequant(q, scale).T + bias`` with int8 ``q`` ``[N, K]``.

    ``backend``: ``"triton"`` (in-register dequantization GEMM), ``"triton_dequant"`` (Triton dequantization into a
    16-bit scratch weight, then cuBLAS: faster for compute-bound M), ``"torch"`` (the reference), ``"dequant"``
    (torch dequantization + cuBLAS / ATen: the fallback for GPUs without tensor-core Triton, e.g. V100), or
    ``"auto"`` (on SM80+: ``triton`` below ``large_m_rows`` rows, ``triton_dequant`` from there; ``dequant`` on other
    GPUs; the reference on CPU).
    """
    if backend == "auto":
        if triton_gemm_supported(x.device) and x.device.type == "cuda":
            rows = x.numel() // max(x.shape[-1], 1)
            backend = "triton_dequant" if rows >= large_m_rows else "triton"
        else:
            backend = "dequant" if x.device.type == "cuda" else "torch"
    if backend == "triton":
        return w8a16_linear_triton(x, q, scale, bias)
    if backend == "triton_dequant":
        w = w8a16_dequantize_triton(q, scale, x.dtype)
        return torch.nn.functional.linear(x, w, bias.to(x.dtype) if bias is not None else None)
    if backend == "torch":
        return w8a16_linear_reference(x, q, scale, bias)
    if backend == "dequant":
        w = w8a16_dequantize(q, scale, x.dtype)
        return torch.nn.functional.linear(x, w, bias.to(x.dtype) if bias is not None else None)
    raise ValueError(
        f"Unknown W8A16 backend {backend!r}; use 'auto', 'triton', 'triton_dequant', 'torch' or 'dequant'."
    )
