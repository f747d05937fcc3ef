"""W8A16 GEMM: the Triton kernels vs their torch reference; fresh random inputs, outputs poisoned with NaN, odd
sizes, partial tiles."""

import pytest
import torch

from diffusers_h3.kernels.gemm.w8a16 import (
    w8a16_dequantize,
    w8a16_dequantize_triton,
    w8a16_linear,
    w8a16_linear_reference,
    w8a16_linear_triton,
    w8a16_quantize,
)

from ._helpers import DEVICE, DTYPES, SHAPES, SMALL_TILE, rel, tol


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [None, 16])
@pytest.mark.parametrize("mnk", SHAPES)
def test_w8a16_triton_matches_reference(dtype, group_size, mnk):
    m, n, k = mnk
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    q, s = w8a16_quantize(torch.randn(n, k, device=DEVICE), group_size)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    out = torch.full((m, n), float("nan"), device=DEVICE, dtype=dtype)
    w8a16_linear_triton(x, q, s, bias, out=out, tile=SMALL_TILE)
    ref = w8a16_linear_reference(x, q, s, bias)
    assert out.dtype == dtype and out.shape == (m, n) and torch.isfinite(out).all()
    assert rel(out, ref) < tol(dtype)
    # the reference itself is the documented math: per-channel (x @ q.T) * s + b
    if group_size is None:
        direct = (x.float() @ q.float().T) * s + bias.float()
        assert rel(ref, direct) < tol(dtype)


def test_w8a16_swap_ab_tile_and_leading_dims():
    x = torch.randn(2, 3, 21, 64, device=DEVICE).to(DTYPES[0])
    q, s = w8a16_quantize(torch.randn(40, 64, device=DEVICE))
    tile = dict(SMALL_TILE, SWAP_AB=True)
    out = w8a16_linear_triton(x, q, s, None, tile=tile)
    assert out.shape == (2, 3, 21, 40)
    assert rel(out, w8a16_linear_reference(x, q, s)) < tol(DTYPES[0])


def test_w8a16_dequant_fallback_matches_reference():
    x = torch.randn(5, 64, device=DEVICE).to(DTYPES[0])
    q, s = w8a16_quantize(torch.randn(24, 64, device=DEVICE))
    assert rel(w8a16_linear(x, q, s, backend="dequant"), w8a16_linear_reference(x, q, s)) < tol(DTYPES[0]) * 2
    assert torch.equal(w8a16_dequantize(q, s, torch.float32), q.float() * s[:, None])


def test_w8a16_bad_inputs_raise_clearly():
    q, s = w8a16_quantize(torch.randn(8, 32))
    with pytest.raises(ValueError, match="input features"):
        w8a16_linear_triton(torch.randn(2, 16, device=DEVICE).to(DTYPES[0]), q.to(DEVICE), s.to(DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        w8a16_linear_triton(torch.randn(2, 32, device=DEVICE).to(DTYPES[0]), q.to(DEVICE), s.to(DEVICE),
                            out=torch.empty(3, 8, device=DEVICE, dtype=DTYPES[0]))  # fmt: skip
    with pytest.raises(ValueError, match="divide"):
        w8a16_quantize(torch.randn(8, 32), group_size=24)
    with pytest.raises(ValueError, match="Unknown W8A16 backend"):
        w8a16_linear(torch.randn(2, 32), q, s, backend="cutlass")


@pytest.mark.parametrize("dtype", DTYPES)
def test_w8a16_dequantize_kernel_is_bitwise_equal_to_reference(dtype):
    w = torch.randn(45, 96, device=DEVICE)
    w[2, :16] = 0
    for group_size in (None, 32):
        q, sc = w8a16_quantize(w, group_size)
        assert torch.equal(w8a16_dequantize_triton(q, sc, dtype), w8a16_dequantize(q, sc, dtype))


def test_w8a16_large_m_path_matches_reference():
    # backend="triton_dequant": Triton dequantization to a scratch weight, then the 16-bit GEMM.
    x = torch.randn(33, 64, device=DEVICE).to(DTYPES[0])
    q, s = w8a16_quantize(torch.randn(40, 64, device=DEVICE))
    out = w8a16_linear(x, q, s, backend="triton_dequant")
    assert rel(out, w8a16_linear_reference(x, q, s)) < tol(DTYPES[0]) * 2
