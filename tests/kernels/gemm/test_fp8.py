"""FP8 (E4M3) W8A8 GEMM: the fused per-token activation quantizer vs its reference, the emulation and dispatch of
``fp8_linear``, and the exact small-M product."""

import pytest
import torch

from diffusers_h3.kernels.gemm.fp8 import (
    fp8_linear,
    fp8_linear_reference,
    fp8_quantize_per_token,
    fp8_quantize_per_token_reference,
    fp8_quantize_weight,
    fp8_small_m_product,
)

from ._helpers import DEVICE, DTYPES, rel, tol


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
    assert rel(ref.reshape(-1, 48), manual) < tol(DTYPES[0])
    out = fp8_linear(x, wq, ws, bias)  # auto: scaled_mm on SM89+, emulation on CPU
    assert out.shape == (3, 7, 48) and rel(out, ref) < 2e-2
    with pytest.raises(ValueError, match="Unknown FP8 backend"):
        fp8_linear(x, wq, ws, backend="nope")


@pytest.mark.parametrize("rows,chunk", [(1, 2048), (5, 48)])
def test_fp8_small_m_product_matches_emulation(rows, chunk):
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    wq, ws = fp8_quantize_weight(torch.randn(130, 96))
    bias = torch.randn(130, dtype=torch.bfloat16)
    xq, xs = fp8_quantize_per_token_reference(x)
    out = torch.full((rows, 130), float("nan"), dtype=torch.bfloat16)
    out.copy_(fp8_small_m_product(xq, xs, wq, ws, bias, torch.bfloat16, chunk=chunk))
    torch.testing.assert_close(out, fp8_linear_reference(x, wq, ws, bias), rtol=0, atol=0)


def test_fp8_activation_quant_two_pass_matches_one_pass():
    x = (torch.randn(7, 300, device=DEVICE) * 3).to(DTYPES[0])
    q1, s1 = fp8_quantize_per_token(x, backend="triton")
    q2, s2 = fp8_quantize_per_token(x, backend="triton", one_pass_max_k=64)
    assert torch.equal(s1, s2) and torch.equal(q1.view(torch.uint8), q2.view(torch.uint8))


def test_fp8_bad_inputs_raise_clearly():
    with pytest.raises(ValueError, match="2-D"):
        fp8_quantize_weight(torch.randn(4, 8, 16))
    with pytest.raises(TypeError, match="floating point"):
        fp8_quantize_weight(torch.ones(4, 16, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        fp8_quantize_per_token(torch.randn(2, 3, 16))
