"""NVFP4: quantize / dequantize reference, a Triton weight-only GEMM (Ampere / Hopper), and W4A4 through flashinfer
``mm_fp4`` on SM100+.

Format (the standard NVFP4 / ModelOpt layout, so ModelOpt-style exports load unchanged):

- ``packed``  uint8 ``[N, K/2]``: E2M1 codes, two per byte, the even element in the low nibble.
- ``block_scale`` ``float8_e4m3fn`` ``[N, K/16]``: one E4M3 scale per 16 consecutive weights of a row.
- ``global_scale`` fp32 scalar (ModelOpt's ``weight_scale_2``): ``amax(|W|) / (448 * 6)``.
- Weight value = ``e2m1 * (float(block_scale) * global_scale)`` (the product of the two scales rounded once in fp32).

Quantization (:func:`nvfp4_quantize`): ``block_scale = e4m3(amax(block) / 6 / global_scale)`` (RNE, saturating at
448), then ``e2m1 = RNE(w / (float(block_scale) * global_scale))`` saturating at +-6; blocks whose scale is 0 encode 0.

Weight-only GEMM contract (:func:`nvfp4_linear` with ``activation=None``): ``out = x @ W.T + bias`` where ``W`` is the
dequantized weight rounded to ``x.dtype``, fp32 accumulation. The Triton kernel decodes E2M1 and E4M3 with integer
ops in registers (no dense weight copy).

W4A4 contract (``activation="nvfp4"``): activations are quantized per row in 16-element blocks with a dynamic
per-tensor global scale (same recipe as the weights); ``out = deq(x_q) @ deq(W).T`` in fp32. On SM100/103/110/120/121
this runs through ``flashinfer.mm_fp4`` -- that path is **not run on hardware here** (no Blackwell GPU): only its
numerics are tested, by the emulation :func:`nvfp4_w4a4_reference`.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..._utils import has_fp4_tensor_cores, is_package_available, warn_once
from .._triton_utils import HAS_TRITON, kernel_op
from ..numerics import E2M1_MAX, E4M3_MAX, e2m1_decode, e2m1_encode, pack_nibbles, to_e4m3, unpack_nibbles
from ._common import (
    LARGE_M_ROWS,
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

NVFP4_BLOCK = 16


# ----------------------------------------------------------------------------------------------------------------
# Reference quantization


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """Per-tensor fp32 scale ``amax / (448 * 6)`` (1.0 for an all-zero tensor)."""
    amax = amax.float()
    return torch.where(amax > 0, amax / (E4M3_MAX * E2M1_MAX), torch.ones_like(amax))


def nvfp4_quantize(weight: torch.Tensor, global_scale: Optional[torch.Tensor] = None):
    """``[N, K]`` float tensor -> (packed uint8 ``[N, K/2]``, E4M3 block scales ``[N, K/16]``, fp32 global scale).

    ``global_scale`` defaults to ``amax / (448 * 6)`` of the whole tensor.
    """
    if weight.dim() != 2:
        raise ValueError(f"nvfp4_quantize expects a 2-D [rows, K] tensor, got shape {tuple(weight.shape)}.")
    n, k = weight.shape
    if k % NVFP4_BLOCK:
        raise ValueError(
            f"NVFP4 needs the reduction dimension to be a multiple of {NVFP4_BLOCK}, got K={k}; "
            "keep this layer unquantized (modules_to_not_convert) or pad it."
        )
    w = weight.detach().float()
    if global_scale is None:
        global_scale = nvfp4_global_scale(w.abs().amax())
    global_scale = global_scale.float().reshape(())
    blocks = w.reshape(n, k // NVFP4_BLOCK, NVFP4_BLOCK)
    block_scale = to_e4m3(blocks.abs().amax(dim=-1) / E2M1_MAX / global_scale)
    scale = (block_scale.float() * global_scale)[..., None]
    scaled = torch.where(scale > 0, blocks / scale, torch.zeros_like(blocks))
    codes = e2m1_encode(scaled).reshape(n, k)
    return pack_nibbles(codes), block_scale, global_scale


def nvfp4_dequantize(
    packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`nvfp4_quantize`: the effective ``[N, K]`` weight, rounded once to ``dtype``."""
    n = packed.shape[0]
    values = e2m1_decode(unpack_nibbles(packed)).reshape(n, -1, NVFP4_BLOCK)
    scale = block_scale.float() * global_scale.float().reshape(())
    return (values * scale[..., None]).reshape(n, -1).to(dtype)


def nvfp4_linear_reference(
    x: torch.Tensor,
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Weight-only reference: ``x @ deq(W).to(x.dtype).T`` in fp32, output in ``x.dtype``."""
    w = nvfp4_dequantize(packed, block_scale, global_scale, x.dtype).float()
    out = x.reshape(-1, x.shape[-1]).float() @ w.T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], packed.shape[0])


def nvfp4_w4a4_reference(
    x: torch.Tensor,
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Emulation of W4A4 (what ``flashinfer.mm_fp4`` computes): activations fake-quantized to NVFP4, fp32 GEMM."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs, xg = nvfp4_quantize(x2)
    xd = nvfp4_dequantize(xq, xs, xg)
    out = xd @ nvfp4_dequantize(packed, block_scale, global_scale).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], packed.shape[0])


# ----------------------------------------------------------------------------------------------------------------
# Triton weight-only GEMM

if HAS_TRITON:

    @triton.jit
    def _dequantize_nvfp4_tile(p, sb, g, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """fp32 weights of a (BLOCK_N, BLOCK_K) tile from packed E2M1 pairs `p` and E4M3 block-scale bits `sb`;
        `g` is half the global scale (the integer decode yields 2 * |e2m1|)."""
        # E4M3 block scale from its bits: normal (1 + m/8) * 2^(e-7), subnormal m * 2^-9.
        sb = sb.to(tl.int32)
        s_exp = (sb >> 3) & 15
        s_man = sb & 7
        s_norm = ((s_exp + 120) << 23) | (s_man << 20)
        s_val = tl.where(s_exp == 0, s_man.to(tl.float32) * 0.001953125, s_norm.to(tl.float32, bitcast=True))
        s_val = tl.where((sb & 128) != 0, -s_val, s_val) * g
        # E2M1 codes: interleave low / high nibbles back into K order.
        p = p.to(tl.int32)
        c = tl.reshape(tl.join(p & 15, (p >> 4) & 15), (BLOCK_N, BLOCK_K))
        # 2 * |value| for magnitude codes 0..7 = {0, 1, 2, 3, 4, 6, 8, 12}: nibble LUT 0xC8643210.
        v2 = (-932957680 >> ((c & 7) * 4)) & 15
        v2 = tl.where((c & 8) != 0, -v2, v2).to(tl.float32)
        return tl.reshape(tl.reshape(v2, (BLOCK_N, BLOCK_K // 16, 16)) * s_val[:, :, None], (BLOCK_N, BLOCK_K))

    @triton.jit
    def _nvfp4_wo_kernel(
        x_ptr, w_ptr, s_ptr, g_ptr, b_ptr, o_ptr,
        M, N, K, M_BUCKET,
        stride_xm, stride_wn, stride_sn, stride_om,
        HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        SWAP_AB: tl.constexpr,
    ):  # fmt: skip
        pid_m, pid_n = grouped_tile_ids(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        offs_kp = tl.arange(0, BLOCK_K // 2)
        offs_ks = tl.arange(0, BLOCK_K // 16)
        mask_m = offs_m < M
        mask_n = offs_n < N
        # Half of the global scale: the integer decode below yields 2 * |e2m1|.
        g = tl.load(g_ptr) * 0.5
        x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_kp[None, :]
        s_ptrs = s_ptr + offs_n[:, None].to(tl.int64) * stride_sn + offs_ks[None, :]
        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptrs, mask=mask_m[:, None] & ((k0 + offs_k) < K)[None, :], other=0.0)
            p = tl.load(w_ptrs, mask=mask_n[:, None] & ((k0 // 2 + offs_kp) < K // 2)[None, :], other=0)
            sb = tl.load(s_ptrs, mask=mask_n[:, None] & ((k0 // 16 + offs_ks) < K // 16)[None, :], other=0)
            w = _dequantize_nvfp4_tile(p, sb, g, BLOCK_N, BLOCK_K).to(x.dtype)
            acc = accumulate_dot(x, w, acc, SWAP_AB, IEEE)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K // 2
            s_ptrs += BLOCK_K // 16
        if SWAP_AB:
            acc = tl.trans(acc)
        store_output_tile(acc, o_ptr, b_ptr, offs_m, offs_n, mask_m, mask_n, stride_om, HAS_BIAS)

    _nvfp4_wo_autotuned = triton.autotune(configs=gemm_configs(), key=["N", "K", "M_BUCKET"])(_nvfp4_wo_kernel)

    @triton.jit
    def _nvfp4_dequant_kernel(w_ptr, s_ptr, g_ptr, o_ptr, N, K, stride_wn, stride_sn, stride_on,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = tl.program_id(1) * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        offs_kp = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        offs_ks = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        mask_n = offs_n < N
        g = tl.load(g_ptr) * 0.5
        p = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_kp[None, :],
                    mask=mask_n[:, None] & (offs_kp < K // 2)[None, :], other=0)  # fmt: skip
        sb = tl.load(s_ptr + offs_n[:, None].to(tl.int64) * stride_sn + offs_ks[None, :],
                     mask=mask_n[:, None] & (offs_ks < K // 16)[None, :], other=0)  # fmt: skip
        w = _dequantize_nvfp4_tile(p, sb, g, BLOCK_N, BLOCK_K)
        mask = mask_n[:, None] & (offs_k < K)[None, :]
        o_ptrs = o_ptr + offs_n[:, None].to(tl.int64) * stride_on + offs_k[None, :]
        tl.store(o_ptrs, w.to(o_ptr.dtype.element_ty), mask=mask)


def nvfp4_linear_triton(
    x: torch.Tensor,
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    tile: Optional[dict] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Triton weight-only NVFP4 GEMM (dequantization in registers, 16-bit ``tl.dot``)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    if k % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 needs K % 16 == 0, got K={k}.")
    x2, out = prepare_gemm_io("NVFP4", x, n, k, out)
    m = x2.shape[0]
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    packed = packed.contiguous()
    sbits = block_scale.contiguous().view(torch.uint8)
    g = global_scale.float().reshape(1).contiguous()
    b = bias.contiguous() if bias is not None else g
    strides = (x2.stride(0), packed.stride(0), sbits.stride(0), out.stride(0))
    args = (x2, packed, sbits, g, b, out, m, n, k, m_bucket(m), *strides)
    meta = {"HAS_BIAS": bias is not None, "IEEE": x.dtype == torch.float32}
    launch_gemm(_nvfp4_wo_kernel, _nvfp4_wo_autotuned, args, m, n, meta, tile)
    return out.reshape(*x.shape[:-1], n)


def nvfp4_dequantize_triton(
    packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Triton version of :func:`nvfp4_dequantize` (bitwise equal): the scratch weight of the large-M path."""
    if not triton_gemm_supported(packed.device):
        raise RuntimeError(
            f"The Triton NVFP4 dequantize kernel needs CUDA SM80+ (or TRITON_INTERPRET=1); got {packed.device}."
        )
    n, k = packed.shape[0], packed.shape[1] * 2
    packed = packed.contiguous()
    sbits = block_scale.contiguous().view(torch.uint8)
    g = global_scale.float().reshape(1).contiguous()
    out = torch.empty((n, k), device=packed.device, dtype=dtype)
    bn, bk = dequant_tile()
    grid = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    _nvfp4_dequant_kernel[grid](packed, sbits, g, out, n, k, packed.stride(0), sbits.stride(0), out.stride(0),
                                BLOCK_N=bn, BLOCK_K=bk)  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------------------------------
# W4A4 through flashinfer (SM100+; not run on hardware here)


def flashinfer_fp4_available(device: torch.device) -> bool:
    return device.type == "cuda" and has_fp4_tensor_cores(device) and is_package_available("flashinfer")


def nvfp4_w4a4_flashinfer(
    x: torch.Tensor,
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:  # pragma: no cover - needs a Blackwell GPU
    """W4A4 GEMM through ``flashinfer.mm_fp4`` (cutlass backend) with dynamic per-tensor activation scales.

    **Not run on hardware**: written against the flashinfer API documentation (``fp4_quantize`` with 128x4 swizzled
    scales, ``mm_fp4(a, b.T, a_sf, b_sf.T, alpha)``); its numerics are those of :func:`nvfp4_w4a4_reference`.
    """
    import flashinfer

    n, k = packed.shape[0], packed.shape[1] * 2
    x2 = x.reshape(-1, k).to(torch.bfloat16).contiguous()
    # flashinfer's global scale is the reciprocal convention: 448 * 6 / amax.
    x_global = nvfp4_global_scale(x2.abs().amax())
    x_q, x_sf = flashinfer.fp4_quantize(
        x2, (1.0 / x_global).reshape(1), sf_vec_size=NVFP4_BLOCK, is_sf_swizzled_layout=True
    )
    w_sf = flashinfer.block_scale_interleave(block_scale.contiguous().view(torch.uint8))
    rows_pad = -(-n // 128) * 128
    cols_pad = -(-(k // NVFP4_BLOCK) // 4) * 4
    w_sf = w_sf.reshape(rows_pad, cols_pad).view(torch.float8_e4m3fn)
    alpha = (x_global * global_scale.float()).reshape(1)
    out = flashinfer.mm_fp4(x_q, packed.T, x_sf, w_sf.T, alpha=alpha, out_dtype=torch.bfloat16, backend="cutlass")
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


@kernel_op("nvfp4_linear", linear_fake)
def nvfp4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: Optional[str] = None,
    backend: str = "auto",
    large_m_rows: int = LARGE_M_ROWS,
) -> torch.Tensor:
    """NVFP4 linear. ``activation=None``: weight-only (W4A16); ``"nvfp4"``: W4A4.

    ``backend`` (weight-only): ``"triton"`` (fused in-register dequantization GEMM), ``"triton_dequant"`` (Triton
    dequantization into a 16-bit scratch weight + cuBLAS; faster for compute-bound M), ``"torch"`` (reference),
    ``"dequant"`` (torch dequantization + cuBLAS: the fallback for GPUs without tensor-core Triton) or ``"auto"``
    (SM80+: ``triton`` below ``large_m_rows`` rows, ``triton_dequant`` from there). W4A4: ``"flashinfer"`` /
    ``"torch"`` / ``"auto"``.
    """
    if activation not in (None, "nvfp4"):
        raise ValueError(f"activation must be None (weight-only) or 'nvfp4' (W4A4), got {activation!r}.")
    if activation == "nvfp4":
        if backend == "auto":
            backend = "flashinfer" if flashinfer_fp4_available(x.device) else "torch"
            if backend == "torch" and x.device.type == "cuda":
                warn_once(
                    "nvfp4-w4a4-emulated",
                    "NVFP4 W4A4 needs FP4 tensor cores (SM100+) and flashinfer; emulating it in fp32 on this GPU "
                    "(slow). Use NVFP4Config(activation=None) for the weight-only Triton kernel.",
                )
        if backend == "flashinfer":
            return nvfp4_w4a4_flashinfer(x, packed, block_scale, global_scale, bias)
        if backend == "torch":
            return nvfp4_w4a4_reference(x, packed, block_scale, global_scale, bias)
        raise ValueError(f"W4A4 supports backends 'auto', 'flashinfer' and 'torch', got {backend!r}.")
    if backend == "auto":
        if x.device.type == "cuda" and triton_gemm_supported(x.device):
            rows = x.numel() // max(x.shape[-1], 1)
            backend = "triton_dequant" if rows >= large_m_rows else "triton"
        else:
            backend = "dequant" if x.device.type == "cuda" else "torch"
    if backend == "triton":
        return nvfp4_linear_triton(x, packed, block_scale, global_scale, bias)
    if backend == "triton_dequant":
        w = nvfp4_dequantize_triton(packed, block_scale, global_scale, x.dtype)
        return torch.nn.functional.linear(x, w, bias.to(x.dtype) if bias is not None else None)
    if backend == "torch":
        return nvfp4_linear_reference(x, packed, block_scale, global_scale, bias)
    if backend == "dequant":
        w = nvfp4_dequantize(packed, block_scale, global_scale, x.dtype)
        return torch.nn.functional.linear(x, w, bias.to(x.dtype) if bias is not None else None)
    raise ValueError(
        f"Unknown NVFP4 backend {backend!r}; use 'auto', 'triton', 'triton_dequant', 'torch', 'dequant' or "
        "'flashinfer'."
    )
