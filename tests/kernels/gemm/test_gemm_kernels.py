"""Triton kernels vs their torch references (CPU: Triton interpreter with fp16 / fp32; GPU: the same tests run on
hardware). Fresh random inputs, outputs poisoned with NaN where the API takes an output, odd sizes, partial tiles."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from diffusers_h3.kernels.gemm.fp8 import (  # noqa: E402
    fp8_linear,
    fp8_linear_reference,
    fp8_quantize_per_token,
    fp8_quantize_per_token_reference,
    fp8_quantize_weight,
)
from diffusers_h3.kernels.gemm.nvfp4 import (  # noqa: E402
    nvfp4_dequantize,
    nvfp4_linear,
    nvfp4_linear_reference,
    nvfp4_linear_triton,
    nvfp4_quantize,
    nvfp4_w4a4_reference,
)
from diffusers_h3.kernels.gemm.w8a16 import (  # noqa: E402
    w8a16_dequantize,
    w8a16_linear,
    w8a16_linear_reference,
    w8a16_linear_triton,
    w8a16_quantize,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float16, torch.float32] if DEVICE == "cpu" else [torch.bfloat16, torch.float16]
# Odd sizes: partial M/N/K tiles for the interpreter tile (16, 32, 32) and the GPU tiles.
SHAPES = [(1, 17, 48), (37, 45, 96), (19, 70, 80)]


def _tol(dtype):
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def _tile_kwargs():
    # On CPU the interpreter tile is used; on GPU force a small tile too so partial tiles are exercised.
    return {"tile": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2, "SWAP_AB": False}}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [None, 16])
@pytest.mark.parametrize("mnk", SHAPES)
def test_w8a16_triton_matches_reference(dtype, group_size, mnk):
    m, n, k = mnk
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    q, s = w8a16_quantize(torch.randn(n, k, device=DEVICE), group_size)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    out = torch.full((m, n), float("nan"), device=DEVICE, dtype=dtype)
    w8a16_linear_triton(x, q, s, bias, out=out, **_tile_kwargs())
    ref = w8a16_linear_reference(x, q, s, bias)
    assert out.dtype == dtype and out.shape == (m, n) and torch.isfinite(out).all()
    assert _rel(out, ref) < _tol(dtype)
    # the reference itself is the documented math: per-channel (x @ q.T) * s + b
    if group_size is None:
        direct = (x.float() @ q.float().T) * s + bias.float()
        assert _rel(ref, direct) < _tol(dtype)


def test_w8a16_swap_ab_tile_and_leading_dims():
    x = torch.randn(2, 3, 21, 64, device=DEVICE).to(DTYPES[0])
    q, s = w8a16_quantize(torch.randn(40, 64, device=DEVICE))
    tile = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2, "SWAP_AB": True}
    out = w8a16_linear_triton(x, q, s, None, tile=tile)
    assert out.shape == (2, 3, 21, 40)
    assert _rel(out, w8a16_linear_reference(x, q, s)) < _tol(DTYPES[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mnk", SHAPES)
def test_nvfp4_triton_matches_reference(dtype, mnk):
    m, n, k = mnk
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    w = torch.randn(n, k, device=DEVICE)
    w[1, :16] = 0  # a zero block
    w[2, 5] = 40.0  # an outlier
    p, s, g = nvfp4_quantize(w)
    bias = torch.randn(n, device=DEVICE).to(dtype) if n % 2 else None
    out = torch.full((m, n), float("nan"), device=DEVICE, dtype=dtype)
    nvfp4_linear_triton(x, p, s, g, bias, out=out, **_tile_kwargs())
    ref = nvfp4_linear_reference(x, p, s, g, bias)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert _rel(out, ref) < _tol(dtype)


def test_nvfp4_kernel_decodes_every_code_and_scale():
    # Identity activations read back the dequantized weight exactly: all 16 E2M1 codes and many E4M3 scales.
    n, k = 32, 64
    codes = torch.arange(n * k, device=DEVICE).remainder(16).to(torch.uint8).reshape(n, k)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scale_bits = torch.randint(1, 0x7F, (n, k // 16), device=DEVICE, dtype=torch.uint8)  # positive finite E4M3
    scale = scale_bits.view(torch.float8_e4m3fn)
    g = torch.tensor(0.37, device=DEVICE)
    eye = torch.eye(k, device=DEVICE, dtype=torch.float32 if DEVICE == "cpu" else torch.float16)
    out = nvfp4_linear_triton(eye, packed, scale, g, **_tile_kwargs())
    expected = nvfp4_dequantize(packed, scale, g, eye.dtype).T
    assert torch.equal(out, expected)


@pytest.mark.parametrize("mk", [(1, 16), (13, 100), (6, 333)])
def test_fp8_activation_quant_kernel_matches_reference(mk):
    m, k = mk
    x = (torch.randn(m, k, device=DEVICE) * torch.rand(m, 1, device=DEVICE) * 30).to(DTYPES[0])
    if m > 2:
        x[2] = 0
    q, s = fp8_quantize_per_token(x, backend="triton")
    qr, sr = fp8_quantize_per_token_reference(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (m, 1)
    torch.testing.assert_close(s, sr, rtol=2e-7, atol=0)
    # identical codes except (rarely) one E4M3 step at a rounding boundary when the fp32 division differs by an ulp
    diff = q.float() != qr.float()
    assert diff.float().mean().item() <= 1e-2
    if diff.any():
        step = torch.where(qr.float().abs() >= 2**-6, qr.float().abs() / 8, torch.full_like(qr.float(), 2**-9))
        assert ((q.float() - qr.float()).abs()[diff] <= step[diff] * 2).all()


def test_fp8_linear_emulation_and_dispatch():
    x = torch.randn(3, 7, 64, device=DEVICE).to(DTYPES[0])
    wq, ws = fp8_quantize_weight(torch.randn(48, 64, device=DEVICE))
    bias = torch.randn(48, device=DEVICE).to(DTYPES[0])
    ref = fp8_linear_reference(x, wq, ws, bias)
    manual_q, manual_s = fp8_quantize_per_token_reference(x.reshape(-1, 64))
    manual = (manual_q.float() @ wq.float().T) * manual_s * ws + bias.float()
    assert _rel(ref.reshape(-1, 48), manual) < _tol(DTYPES[0])
    out = fp8_linear(x, wq, ws, bias)  # auto: scaled_mm on SM89+, emulation on CPU
    assert out.shape == (3, 7, 48) and _rel(out, ref) < 2e-2
    with pytest.raises(ValueError, match="Unknown FP8 backend"):
        fp8_linear(x, wq, ws, backend="nope")


@pytest.mark.parametrize("rows,chunk", [(1, 2048), (5, 48)])
def test_fp8_small_m_product_matches_emulation(rows, chunk):
    from diffusers_h3.kernels.gemm.fp8 import fp8_quantize_per_token_reference, fp8_small_m_product

    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    wq, ws = fp8_quantize_weight(torch.randn(130, 96))
    bias = torch.randn(130, dtype=torch.bfloat16)
    xq, xs = fp8_quantize_per_token_reference(x)
    out = torch.full((rows, 130), float("nan"), dtype=torch.bfloat16)
    out.copy_(fp8_small_m_product(xq, xs, wq, ws, bias, torch.bfloat16, chunk=chunk))
    torch.testing.assert_close(out, fp8_linear_reference(x, wq, ws, bias), rtol=0, atol=0)


def test_w4a4_emulation_is_close_to_weight_only():
    x = torch.randn(9, 64, device=DEVICE)
    p, s, g = nvfp4_quantize(torch.randn(24, 64, device=DEVICE))
    wo = nvfp4_linear(x, p, s, g, backend="torch")
    w4a4 = nvfp4_w4a4_reference(x, p, s, g)
    assert 0.01 < _rel(w4a4, wo) < 0.2  # activations quantized too: different, but close


def test_dequant_fallbacks_match_reference():
    x = torch.randn(5, 64, device=DEVICE).to(DTYPES[0])
    q, s = w8a16_quantize(torch.randn(24, 64, device=DEVICE))
    assert _rel(w8a16_linear(x, q, s, backend="dequant"), w8a16_linear_reference(x, q, s)) < _tol(DTYPES[0]) * 2
    assert torch.equal(w8a16_dequantize(q, s, torch.float32), q.float() * s[:, None])
    p, ps, g = nvfp4_quantize(torch.randn(24, 64, device=DEVICE))
    assert _rel(nvfp4_linear(x, p, ps, g, backend="dequant"), nvfp4_linear_reference(x, p, ps, g)) < 1e-2


def test_bad_inputs_raise_clearly():
    q, s = w8a16_quantize(torch.randn(8, 32))
    with pytest.raises(ValueError, match="input features"):
        w8a16_linear_triton(torch.randn(2, 16, device=DEVICE).to(DTYPES[0]), q.to(DEVICE), s.to(DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        w8a16_linear_triton(torch.randn(2, 32, device=DEVICE).to(DTYPES[0]), q.to(DEVICE), s.to(DEVICE),
                            out=torch.empty(3, 8, device=DEVICE, dtype=DTYPES[0]))
    with pytest.raises(ValueError, match="divide"):
        w8a16_quantize(torch.randn(8, 32), group_size=24)
    with pytest.raises(ValueError, match="Unknown W8A16 backend"):
        w8a16_linear(torch.randn(2, 32), q, s, backend="cutlass")
    with pytest.raises(ValueError, match="activation"):
        nvfp4_linear(torch.randn(2, 32), *nvfp4_quantize(torch.randn(8, 32)), activation="fp8")


def test_fp8_activation_quant_two_pass_matches_one_pass():
    x = (torch.randn(7, 300, device=DEVICE) * 3).to(DTYPES[0])
    q1, s1 = fp8_quantize_per_token(x, backend="triton")
    q2, s2 = fp8_quantize_per_token(x, backend="triton", one_pass_max_k=64)
    assert torch.equal(s1, s2) and torch.equal(q1.view(torch.uint8), q2.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_kernels_are_bitwise_equal_to_reference(dtype):
    from diffusers_h3.kernels.gemm.nvfp4 import nvfp4_dequantize_triton
    from diffusers_h3.kernels.gemm.w8a16 import w8a16_dequantize_triton

    w = torch.randn(45, 96, device=DEVICE)
    w[2, :16] = 0
    p, s, g = nvfp4_quantize(w)
    assert torch.equal(nvfp4_dequantize_triton(p, s, g, dtype), nvfp4_dequantize(p, s, g, dtype))
    for group_size in (None, 32):
        q, sc = w8a16_quantize(w, group_size)
        assert torch.equal(w8a16_dequantize_triton(q, sc, dtype), w8a16_dequantize(q, sc, dtype))


def test_large_m_path_matches_reference():
    # backend="triton_dequant": Triton dequantization to a scratch weight, then the 16-bit GEMM.
    x = torch.randn(33, 64, device=DEVICE).to(DTYPES[0])
    q, s = w8a16_quantize(torch.randn(40, 64, device=DEVICE))
    out = w8a16_linear(x, q, s, backend="triton_dequant")
    assert _rel(out, w8a16_linear_reference(x, q, s)) < _tol(DTYPES[0]) * 2
    p, ps, g = nvfp4_quantize(torch.randn(40, 64, device=DEVICE))
    out = nvfp4_linear(x, p, ps, g, backend="triton_dequant")
    assert _rel(out, nvfp4_linear_reference(x, p, ps, g)) < _tol(DTYPES[0]) * 2
