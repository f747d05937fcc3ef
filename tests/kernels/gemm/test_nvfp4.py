"""NVFP4 GEMM: the weight-only Triton kernels vs the torch reference, and the W4A4 emulation; fresh random inputs,
outputs poisoned with NaN, odd sizes, partial tiles."""

import pytest
import torch

from diffusers_h3.kernels.gemm.nvfp4 import (
    nvfp4_dequantize,
    nvfp4_dequantize_triton,
    nvfp4_linear,
    nvfp4_linear_reference,
    nvfp4_linear_triton,
    nvfp4_quantize,
    nvfp4_w4a4_reference,
)

from ._helpers import DEVICE, DTYPES, SHAPES, SMALL_TILE, rel, tol


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
    nvfp4_linear_triton(x, p, s, g, bias, out=out, tile=SMALL_TILE)
    ref = nvfp4_linear_reference(x, p, s, g, bias)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel(out, ref) < tol(dtype)


def test_nvfp4_kernel_decodes_every_code_and_scale():
    # Identity activations read back the dequantized weight exactly: all 16 E2M1 codes and many E4M3 scales.
    n, k = 32, 64
    codes = torch.arange(n * k, device=DEVICE).remainder(16).to(torch.uint8).reshape(n, k)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scale_bits = torch.randint(1, 0x7F, (n, k // 16), device=DEVICE, dtype=torch.uint8)  # positive finite E4M3
    scale = scale_bits.view(torch.float8_e4m3fn)
    g = torch.tensor(0.37, device=DEVICE)
    eye = torch.eye(k, device=DEVICE, dtype=torch.float32 if DEVICE == "cpu" else torch.float16)
    out = nvfp4_linear_triton(eye, packed, scale, g, tile=SMALL_TILE)
    expected = nvfp4_dequantize(packed, scale, g, eye.dtype).T
    assert torch.equal(out, expected)


def test_w4a4_emulation_is_close_to_weight_only():
    x = torch.randn(9, 64, device=DEVICE)
    p, s, g = nvfp4_quantize(torch.randn(24, 64, device=DEVICE))
    wo = nvfp4_linear(x, p, s, g, backend="torch")
    w4a4 = nvfp4_w4a4_reference(x, p, s, g)
    assert 0.01 < rel(w4a4, wo) < 0.2  # activations quantized too: different, but close


def test_nvfp4_dequant_fallback_matches_reference():
    x = torch.randn(5, 64, device=DEVICE).to(DTYPES[0])
    p, ps, g = nvfp4_quantize(torch.randn(24, 64, device=DEVICE))
    assert rel(nvfp4_linear(x, p, ps, g, backend="dequant"), nvfp4_linear_reference(x, p, ps, g)) < 1e-2


def test_nvfp4_bad_inputs_raise_clearly():
    with pytest.raises(ValueError, match="activation"):
        nvfp4_linear(torch.randn(2, 32), *nvfp4_quantize(torch.randn(8, 32)), activation="fp8")
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_quantize(torch.randn(8, 40))
    with pytest.raises(ValueError, match="Unknown NVFP4 backend"):
        nvfp4_linear(torch.randn(2, 32), *nvfp4_quantize(torch.randn(8, 32)), backend="cutlass")


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_dequantize_kernel_is_bitwise_equal_to_reference(dtype):
    w = torch.randn(45, 96, device=DEVICE)
    w[2, :16] = 0
    p, s, g = nvfp4_quantize(w)
    assert torch.equal(nvfp4_dequantize_triton(p, s, g, dtype), nvfp4_dequantize(p, s, g, dtype))


def test_nvfp4_large_m_path_matches_reference():
    # backend="triton_dequant": Triton dequantization to a scratch weight, then the 16-bit GEMM.
    x = torch.randn(33, 64, device=DEVICE).to(DTYPES[0])
    p, ps, g = nvfp4_quantize(torch.randn(40, 64, device=DEVICE))
    out = nvfp4_linear(x, p, ps, g, backend="triton_dequant")
    assert rel(out, nvfp4_linear_reference(x, p, ps, g)) < tol(DTYPES[0]) * 2
