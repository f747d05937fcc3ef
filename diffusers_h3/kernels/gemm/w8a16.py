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

from ..._utils import cuda_capability
from .._triton_utils import HAS_TRITON as _TRITON
from .._triton_utils import opaque_to_compile, triton_interpreter_active

if _TRITON:
    import triton
    import triton.language as tl

    from ._tiles import accumulate_dot, grouped_tile_ids, store_output_tile


def triton_gemm_supported(device: torch.device) -> bool:
    """Triton tensor-core GEMMs: CUDA SM80+ (SM70 has no tensor-core ``tl.dot``), or CPU under the interpreter."""
    if not _TRITON:
        return False
    if device.type == "cuda":
        cap = cuda_capability(device)
        return cap is not None and cap >= (8, 0)
    return device.type == "cpu" and triton_interpreter_active()


def check_2d_weight(name: str, weight: torch.Tensor) -> None:
    if weight.dim() != 2:
        raise ValueError(f"{name} must be a 2-D [out_features, in_features] tensor, got shape {tuple(weight.shape)}.")
    if not weight.is_floating_point():
        raise TypeError(f"{name} must be a floating point tensor to quantize, got {weight.dtype}.")


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

if _TRITON:

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

    def gemm_configs():
        """A few large tiles for compute-bound prefill GEMMs (M in the tens of thousands) plus small ones."""
        cfg = []
        # Winners on an H200 at M = 38k were (128, 128, 64, 4 stages, 8 warps) and (256, 128, 64, 3, 8); the swapped
        # (weight-as-A) and BLOCK_K = 128 variants never won and were dropped to keep autotuning short.
        for bm, bn, bk, stages, warps, swap in (
            (128, 128, 64, 4, 8, False),
            (256, 128, 64, 3, 8, False),
            (128, 256, 64, 3, 8, False),
            (64, 128, 64, 4, 4, False),
        ):
            cfg.append(
                triton.Config(
                    {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "SWAP_AB": swap},
                    num_stages=stages,
                    num_warps=warps,
                )
            )
        return cfg

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


def _m_bucket(m: int) -> int:
    """Autotune key for M: the next power of two (re-tune per size class, not per exact row count)."""
    return 1 << max(m - 1, 0).bit_length()


INTERPRETER_TILE = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2, "SWAP_AB": False}


def _launch(kernel_jit, kernel_tuned, args, m, n, meta, tile=None):
    """Run a GEMM kernel: autotuned on GPU, a fixed small tile in the interpreter (or a caller-fixed tile)."""
    if tile is None and triton_interpreter_active():
        tile = INTERPRETER_TILE
    if tile is not None:
        grid = (triton.cdiv(m, tile["BLOCK_M"]) * triton.cdiv(n, tile["BLOCK_N"]),)
        kernel_jit[grid](*args, **meta, **tile)
    else:

        def grid(cfg):
            return (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)

        kernel_tuned[grid](*args, **meta)


def prepare_gemm_io(op: str, x: torch.Tensor, n: int, k: int, out: Optional[torch.Tensor]):
    """Host-side checks shared by the weight-only Triton GEMMs: device, activation dtype and width; returns the
    activations as contiguous rows ``[M, K]`` and the (validated or new) output ``[M, N]``."""
    if not triton_gemm_supported(x.device):
        raise RuntimeError(
            f"The Triton {op} GEMM needs a CUDA GPU with compute capability >= 8.0 (or CPU with TRITON_INTERPRET=1); "
            f"got device {x.device}. Use backend='torch' or the dequantize fallback."
        )
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"{op} activations must be fp16, bf16 or fp32, got {x.dtype}.")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features but the {op} weight has {k}.")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if out is None:
        out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    elif out.shape != (m, n) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {(m, n)} {x.dtype} tensor, got {tuple(out.shape)} {out.dtype}.")
    return x2, out


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
    args = (x2, q, scale, b, out, m, n, k, _m_bucket(m), x2.stride(0), q.stride(0), scale.stride(0), out.stride(0))
    meta = {"GROUP_K": group_k, "HAS_BIAS": bias is not None, "IEEE": x.dtype == torch.float32}
    _launch(_w8a16_kernel, _w8a16_autotuned, args, m, n, meta, tile)
    return out.reshape(*x.shape[:-1], n)


# Rows from which a compute-bound GEMM is faster as "Triton dequantize to a 16-bit scratch weight + cuBLAS" than as
# the fused in-register dequantization GEMM (the dequantization pass costs ~0.1 ms per H3 layer on an H200, the fused
# kernel runs at ~0.6x of cuBLAS; see benchmarks/results/gemm_h200.json).
LARGE_M_ROWS = 1024


def w8a16_dequantize_triton(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Triton version of :func:`w8a16_dequantize` (same fp32 product, one rounding to ``dtype``: bitwise equal)."""
    if not triton_gemm_supported(q.device):
        raise RuntimeError(f"The Triton dequantize kernel needs CUDA SM80+ (or TRITON_INTERPRET=1); got {q.device}.")
    n, k = q.shape
    q = q.contiguous()
    scale = scale.float().contiguous()
    out = torch.empty((n, k), device=q.device, dtype=dtype)
    group_k = 0 if scale.dim() == 1 else k // scale.shape[1]
    bn, bk = (16, 32) if triton_interpreter_active() else (32, 256)
    grid = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    _w8a16_dequant_kernel[grid](q, scale, out, n, k, q.stride(0), scale.stride(0), out.stride(0),
                                GROUP_K=group_k, BLOCK_N=bn, BLOCK_K=bk)  # fmt: skip
    return out


@opaque_to_compile
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
