"""GPU checks of the quantized GEMM kernels (bf16 / fp16 on hardware) against their torch references.

Run on the device machine: ``python -m pytest tests/gpu/test_quant_gpu.py -m gpu -q``.
"""

import pytest
import torch


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _poisoned(shape, dtype):
    return torch.full(shape, float("nan"), device="cuda", dtype=dtype)


# A fixed tensor-core tile (no autotuning in tests) that leaves partial tiles on every shape below.
TILE = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "SWAP_AB": False}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_size", [None, 64])
@pytest.mark.parametrize("mnk", [(1, 48, 64), (333, 200, 320), (1030, 520, 1024)])
def test_w8a16_triton_gpu(dtype, group_size, mnk):
    from diffusers_h3.kernels.gemm.w8a16 import w8a16_linear_reference, w8a16_linear_triton, w8a16_quantize

    m, n, k = mnk
    x = torch.randn(2, m, k, device="cuda", dtype=dtype)
    q, s = w8a16_quantize(torch.randn(n, k, device="cuda"), group_size)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    out = _poisoned((2 * m, n), dtype)
    w8a16_linear_triton(x, q, s, bias, tile=TILE, out=out)
    out = out.reshape(2, m, n)
    ref = w8a16_linear_reference(x, q, s, bias)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mnk", [(5, 40, 64), (333, 200, 320), (1030, 520, 1024)])
def test_nvfp4_triton_gpu(dtype, mnk):
    from diffusers_h3.kernels.gemm.nvfp4 import nvfp4_linear_reference, nvfp4_linear_triton, nvfp4_quantize

    m, n, k = mnk
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    p, s, g = nvfp4_quantize(torch.randn(n, k, device="cuda"))
    out = _poisoned((m, n), dtype)
    nvfp4_linear_triton(x, p, s, g, tile=TILE, out=out)
    ref = nvfp4_linear_reference(x, p, s, g)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 1e-2


def test_dequant_kernels_bitwise_bf16_gpu():
    from diffusers_h3.kernels.gemm.nvfp4 import nvfp4_dequantize, nvfp4_dequantize_triton, nvfp4_quantize
    from diffusers_h3.kernels.gemm.w8a16 import w8a16_dequantize, w8a16_dequantize_triton, w8a16_quantize

    w = torch.randn(300, 544, device="cuda")
    p, s, g = nvfp4_quantize(w)
    assert torch.equal(nvfp4_dequantize_triton(p, s, g, torch.bfloat16), nvfp4_dequantize(p, s, g, torch.bfloat16))
    for group_size in (None, 32):
        q, sc = w8a16_quantize(w, group_size)
        assert torch.equal(w8a16_dequantize_triton(q, sc, torch.bfloat16), w8a16_dequantize(q, sc, torch.bfloat16))


@pytest.mark.parametrize("mk", [(1, 16), (77, 5376), (300, 14336), (9, 100), (5, 20000)])
def test_fp8_activation_quant_gpu(mk):
    from diffusers_h3.kernels.gemm.fp8 import fp8_quantize_per_token, fp8_quantize_per_token_reference

    m, k = mk
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * torch.rand(m, 1, device="cuda", dtype=torch.bfloat16) * 8
    q, s = fp8_quantize_per_token(x, backend="triton")
    qr, sr = fp8_quantize_per_token_reference(x)
    torch.testing.assert_close(s, sr, rtol=2e-7, atol=0)
    # The kernel multiplies by the reciprocal scale where the reference divides: a value on a rounding tie may land on
    # the neighbouring E4M3 value. Allowed: a few such values (0.2 %, at least two in a small tensor), one step apart
    # (E4M3: 3 mantissa bits, a step of 1/8 of the larger value's power of two; 2^-9 below the normal range).
    qf, qrf = q.float(), qr.float()
    differ = qf != qrf
    count = int(differ.sum())
    assert count <= max(2, int(2e-3 * q.numel())), (count, q.numel())
    if count:
        larger = torch.maximum(qf.abs(), qrf.abs())[differ]
        step = torch.where(larger < 2.0**-6, torch.full_like(larger, 2.0**-9), 2.0 ** torch.floor(torch.log2(larger)) / 8)
        assert bool(((qf - qrf).abs()[differ] <= step).all()), ((qf - qrf).abs()[differ] / step).max().item()


def test_fp8_scaled_mm_gpu():
    from diffusers_h3._utils import has_fp8_tensor_cores
    from diffusers_h3.kernels.gemm.fp8 import fp8_linear_reference, fp8_linear_scaled_mm, fp8_quantize_weight

    if not has_fp8_tensor_cores():
        pytest.skip("needs SM89+")
    x = torch.randn(3, 111, 512, device="cuda", dtype=torch.bfloat16)
    wq, ws = fp8_quantize_weight(torch.randn(256, 512, device="cuda"))
    bias = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    out = fp8_linear_scaled_mm(x, wq, ws, bias, use_fast_accum=False)
    ref = fp8_linear_reference(x, wq, ws, bias)
    assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("rows", [1, 7, 16, 63, 64, 65, 333])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_scaled_mm_every_row_count(rows, with_bias):
    # Few rows take the exact small-M product, many the cuBLASLt FP8 GEMM: both must run and match the emulation.
    from diffusers_h3._utils import has_fp8_tensor_cores
    from diffusers_h3.kernels.gemm.fp8 import fp8_linear_reference, fp8_linear_scaled_mm, fp8_quantize_weight

    if not has_fp8_tensor_cores():
        pytest.skip("needs SM89+")
    x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
    wq, ws = fp8_quantize_weight(torch.randn(6144, 2048, device="cuda"))
    bias = torch.randn(6144, device="cuda", dtype=torch.bfloat16) if with_bias else None
    out = fp8_linear_scaled_mm(x, wq, ws, bias, use_fast_accum=False)
    assert out.shape == (rows, 6144) and not out.isnan().any()
    assert _rel(out, fp8_linear_reference(x, wq, ws, bias)) < 1e-2


@pytest.mark.parametrize("rows", [200, 1500])
@pytest.mark.parametrize("method", ["w8a16", "nvfp4", "fp8"])
def test_layers_pick_kernels_on_gpu(method, rows):
    from diffusers_h3.quantizers import FP8Config, NVFP4Config, W8A16Config, quantize

    cfg = {"w8a16": W8A16Config(), "nvfp4": NVFP4Config(), "fp8": FP8Config()}[method]
    dense = torch.nn.Sequential(torch.nn.Linear(256, 384)).cuda().to(torch.bfloat16)
    x = torch.randn(4, rows // 4, 256, device="cuda", dtype=torch.bfloat16)
    ref = dense(x)
    q = quantize(dense, cfg)
    layer = q[0]
    path = layer.weight.describe_path()
    assert ("triton" in path.lower()) or ("scaled_mm" in path)
    out = q(x)
    assert out.dtype == torch.bfloat16
    # fp8: both operands in E4M3 (3 mantissa bits) give ~3.7% rel-L2 on Gaussian data (see gemm_h200.json notes)
    assert _rel(out, ref) < {"w8a16": 1e-2, "nvfp4": 1.2e-1, "fp8": 5e-2}[method]
