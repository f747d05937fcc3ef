"""FP8 (E4M3) W8A8 GEMM: per-output-channel weight scales, per-token activation scales computed at run time.

Entry point :func:`fp8_linear`. The activation quantization is one fused Triton kernel per row (amax, scale,
round, cast, store ``x_q`` and its scale); the GEMM is ``torch._scaled_mm`` with row-wise scales
(``scale_a`` ``[M, 1]``, ``scale_b`` ``[1, N]``), which needs SM89+ (Ada / Hopper / Blackwell).

Numerics contract (shared with the torch references):

- Weights (:func:`fp8_quantize_weight`): ``scale_w[n] = amax(|W[n]|) / 448`` (1 for zero rows),
  ``W_q = e4m3(W / scale_w)`` (RNE, saturating).
- Activations (:func:`fp8_quantize_per_token`): ``amax = max(amax(|x[m]|), 1e-12)``, ``scale_x[m] = amax / 448``,
  ``x_q = e4m3(clamp(x * (448 / amax), -448, 448))``. The kernel rounds to the E4M3 grid with integer ops before the
  cast, so the interpreter and the GPU agree; its fp32 division may differ from torch's by an ulp, which can move a
  value that sits on a rounding boundary by one E4M3 step (tests allow that, nothing else).
- GEMM: ``out = (x_q @ W_q.T) * scale_x * scale_w + bias``, fp32 accumulation (``use_fast_accum=True`` trades the
  periodic fp32 promotion for speed; see pytorch#147971).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..._utils import has_fp8_tensor_cores
from .._triton_utils import HAS_TRITON, kernel_op, triton_interpreter_active
from ..numerics import E4M3_MAX, to_e4m3
from ._common import check_2d_weight, linear_fake


if HAS_TRITON:
    import triton
    import triton.language as tl

    from .._numerics_triton import round_to_e4m3

_AMAX_EPS = 1e-12


def fp8_quantize_weight(weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` float weight -> (``float8_e4m3fn`` ``[N, K]``, fp32 per-row scale ``[N]``)."""
    check_2d_weight("weight", weight)
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return to_e4m3(w / scale[:, None]), scale


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale.float().reshape(-1, 1)).to(dtype)


def fp8_quantize_per_token_reference(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``[M, K]`` -> (``float8_e4m3fn`` ``[M, K]``, fp32 ``[M, 1]``), see the module docstring."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=_AMAX_EPS)
    inv = E4M3_MAX / amax
    return to_e4m3(xf * inv), amax / E4M3_MAX


if HAS_TRITON:

    @triton.jit
    def _quant_row_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_K)
        if ONE_PASS:
            # The whole row stays in registers: one read of x.
            mask = offs < K
            x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
            a = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12)
            inv = tl.fdiv(448.0, a, ieee_rounding=True)
            tl.store(s_ptr + row, tl.fdiv(a, 448.0, ieee_rounding=True))
            v = tl.minimum(tl.maximum(x * inv, -448.0), 448.0)
            tl.store(q_ptr + row * stride_q + offs, round_to_e4m3(v).to(q_ptr.dtype.element_ty), mask=mask)
        else:
            amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=(k0 + offs) < K, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            a = tl.maximum(tl.max(amax, axis=0), 1e-12)
            inv = tl.fdiv(448.0, a, ieee_rounding=True)
            tl.store(s_ptr + row, tl.fdiv(a, 448.0, ieee_rounding=True))
            for k0 in range(0, K, BLOCK_K):
                mask = (k0 + offs) < K
                x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=mask, other=0.0).to(tl.float32)
                v = tl.minimum(tl.maximum(x * inv, -448.0), 448.0)
                tl.store(q_ptr + row * stride_q + k0 + offs, round_to_e4m3(v).to(q_ptr.dtype.element_ty), mask=mask)


ONE_PASS_MAX_K = 16384


def fp8_quantize_per_token(
    x: torch.Tensor, backend: str = "auto", one_pass_max_k: int = ONE_PASS_MAX_K
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-row E4M3 quantization of ``x`` ``[M, K]``: fused Triton kernel on CUDA (or the interpreter), else torch.

    Rows up to ``one_pass_max_k`` elements are read once (kept in registers); longer rows take two passes."""
    if x.dim() != 2:
        raise ValueError(f"fp8_quantize_per_token expects [M, K], got shape {tuple(x.shape)}.")
    use_triton = backend == "triton" or (backend == "auto" and HAS_TRITON and x.is_cuda)
    if not use_triton:
        if backend not in ("auto", "torch"):
            raise ValueError(f"Unknown backend {backend!r}; use 'auto', 'triton' or 'torch'.")
        return fp8_quantize_per_token_reference(x)
    if not HAS_TRITON or not (x.is_cuda or triton_interpreter_active()):
        raise RuntimeError(
            "The Triton activation quantizer needs CUDA (or TRITON_INTERPRET=1 on CPU); use backend='torch'."
        )
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), device=x.device, dtype=torch.float8_e4m3fn)
    s = torch.empty((m, 1), device=x.device, dtype=torch.float32)
    if m:
        one_pass = k <= one_pass_max_k
        block = triton.next_power_of_2(max(k, 16)) if one_pass else min(triton.next_power_of_2(one_pass_max_k), 4096)
        warps = 16 if block >= 8192 else 8 if block >= 2048 else 4
        _quant_row_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0), BLOCK_K=block, ONE_PASS=one_pass, num_warps=warps)
    return q, s


def fp8_linear_reference(
    x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Emulation of :func:`fp8_linear` in fp32 (exact products of E4M3 values, fp32 accumulation)."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = fp8_quantize_per_token_reference(x2)
    out = (xq.float() @ wq.float().T) * xs * w_scale.float().reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], wq.shape[0])


# cuBLASLt finds no row-wise-scaled FP8 algorithm for a handful of rows (CUDA 13: NOT_SUPPORTED at M=1, and at M=1
# zero-padded to 16 rows with a bias), so calls with fewer rows take the exact small-M product below instead.
SCALED_MM_MIN_ROWS = 64


def fp8_small_m_product(
    xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor],
    out_dtype: torch.dtype, chunk: int = 2048,
) -> torch.Tensor:
    """``(xq @ wq.T) * xs * w_scale + bias`` for a few rows: E4M3 codes upcast to float32 (exact), float32 GEMM.

    The same math as the FP8 tensor-core GEMM (exact products, float32 accumulation) without cuBLASLt's FP8 path;
    the weight is upcast ``chunk`` output rows at a time to bound the scratch memory. Memory-bound, like any GEMM
    with a few rows.
    """
    m, n = xq.shape[0], wq.shape[0]
    x32 = xq.float()
    out = torch.empty(m, n, device=xq.device, dtype=torch.float32)
    for a in range(0, n, chunk):
        out[:, a:a + chunk] = x32 @ wq[a:a + chunk].float().T
    out = out * xs.float() * w_scale.float().reshape(1, n)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def fp8_scaled_mm_supported(device: torch.device, n: int, k: int) -> bool:
    return device.type == "cuda" and has_fp8_tensor_cores(device) and n % 16 == 0 and k % 16 == 0


def fp8_linear_scaled_mm(
    x: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    use_fast_accum: bool = True,
    quant_backend: str = "auto",
) -> torch.Tensor:
    """Fused per-token quantization + ``torch._scaled_mm`` (row-wise scales). CUDA SM89+ only.

    Calls with fewer than :data:`SCALED_MM_MIN_ROWS` rows use :func:`fp8_small_m_product` (same math, no cuBLASLt FP8).
    """
    n, k = wq.shape
    if not fp8_scaled_mm_supported(x.device, n, k):
        raise RuntimeError(
            f"torch._scaled_mm FP8 needs a CUDA GPU with compute capability >= 8.9 and N, K multiples of 16 "
            f"(got device {x.device}, N={n}, K={k}). Use backend='dequant' or 'torch'."
        )
    x2 = x.reshape(-1, k)
    xq, xs = fp8_quantize_per_token(x2, backend=quant_backend)
    out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    if xq.shape[0] < SCALED_MM_MIN_ROWS:
        out = fp8_small_m_product(xq, xs, wq, w_scale, bias, out_dtype)
        return out.to(x.dtype).reshape(*x.shape[:-1], n)
    out = torch._scaled_mm(
        xq,
        wq.t(),
        scale_a=xs,
        scale_b=w_scale.float().reshape(1, n),
        bias=bias.to(out_dtype) if bias is not None else None,
        out_dtype=out_dtype,
        use_fast_accum=use_fast_accum,
    )
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


@kernel_op("fp8_linear", linear_fake)
def fp8_linear(
    x: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    backend: str = "auto",
    use_fast_accum: bool = True,
) -> torch.Tensor:
    """FP8 linear. ``backend``: ``"scaled_mm"`` (fused quant kernel + ``torch._scaled_mm``), ``"torch"`` (emulation,
    same numerics), ``"dequant"`` (dequantize the weight to ``x.dtype``, 16-bit GEMM: fallback for GPUs without
    FP8 tensor cores; activations are not quantized) or ``"auto"``."""
    if backend == "auto":
        if fp8_scaled_mm_supported(x.device, *wq.shape):
            backend = "scaled_mm"
        else:
            backend = "dequant" if x.device.type == "cuda" else "torch"
    if backend == "scaled_mm":
        return fp8_linear_scaled_mm(x, wq, w_scale, bias, use_fast_accum)
    if backend == "torch":
        return fp8_linear_reference(x, wq, w_scale, bias)
    if backend == "dequant":
        w = fp8_dequantize(wq, w_scale, x.dtype)
        return torch.nn.functional.linear(x, w, bias.to(x.dtype) if bias is not None else None)
    raise ValueError(f"Unknown FP8 backend {backend!r}; use 'auto', 'scaled_mm', 'torch' or 'dequant'.")
