"""E4M3 Q/K/V with one scale per head (kernels/attention/fp8_per_head.py, FA3 FP8's operands) vs its torch reference.

On a machine without CUDA the Triton kernel runs under the interpreter (fp16/fp32 inputs only).
"""

import os

import torch


if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from ._inputs import DEVICE, DTYPE  # noqa: E402


def _operand(n, dtype, offset, seed):
    gen = torch.Generator().manual_seed(seed)
    # Channels of different ranges and a per-channel offset (what K smoothing removes).
    x = torch.randn(2, n, 3, 32, generator=gen) * torch.linspace(0.05, 6, 32) + offset * torch.randn(3, 32, generator=gen)
    return x.to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("n,dtype,center", [(77, DTYPE, True), (77, DTYPE, False), (5, torch.float32, True),
                                            (130, torch.float32, False), (600, DTYPE, True)])  # fmt: skip
def test_per_head_fp8_is_bitwise_reference(n, dtype, center):
    from diffusers_h3.kernels.attention.fp8_per_head import quantize_fp8_per_head, quantize_fp8_per_head_reference

    x = _operand(n, dtype, offset=3.0, seed=n)
    x8, scale = quantize_fp8_per_head(x, center=center, backend="triton")
    r8, rscale = quantize_fp8_per_head_reference(x, center=center)
    assert x8.shape == x.shape and x8.dtype == torch.float8_e4m3fn and x8.is_contiguous()
    assert scale.shape == (2, 3) and torch.equal(scale, rscale)
    # Every row, the partial last tile of 64 rows (and at 600 rows the partial last chunk of 256) included (torch.empty output: a skipped row would show).
    assert torch.equal(x8.view(torch.uint8), r8.view(torch.uint8))
    # The scale reaches E4M3's top code in every head, and dequantized values are within half an E4M3 step.
    assert torch.equal(x8.float().abs().amax(dim=(1, 3)), torch.full((2, 3), 448.0, device=x8.device))
    xf = x.float() - (x.float().mean(1, keepdim=True) if center else 0)
    recon = x8.float() * scale[:, None, :, None]
    assert ((recon - xf).abs() <= xf.abs() * 0.0625 + scale[:, None, :, None] * 2**-9 + 1e-6).all()


def test_centring_lowers_the_error_of_an_offset_key():
    from diffusers_h3.kernels.attention.fp8_per_head import quantize_fp8_per_head

    x = _operand(64, DTYPE, offset=20.0, seed=3)
    errors = []
    for center in (False, True):
        x8, scale = quantize_fp8_per_head(x, center=center, backend="triton")
        xf = x.float() - (x.float().mean(1, keepdim=True) if center else 0)
        errors.append((x8.float() * scale[:, None, :, None] - xf).norm().item())  # absolute: scores see this
    assert errors[1] < 0.5 * errors[0]  # the offset no longer sets the scale


def test_per_head_fp8_rejects_other_shapes():
    from diffusers_h3.kernels.attention.fp8_per_head import quantize_fp8_per_head

    with pytest.raises(ValueError, match=r"\[batch, seq, heads, head_dim\]"):
        quantize_fp8_per_head(torch.zeros(3, 4, 32, device=DEVICE, dtype=DTYPE), backend="triton")
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        quantize_fp8_per_head(torch.zeros(1, 4, 2, 24, device=DEVICE, dtype=DTYPE), backend="triton")


def test_per_head_fp8_reads_strided_views():
    from diffusers_h3.kernels.attention.fp8_per_head import quantize_fp8_per_head, quantize_fp8_per_head_reference

    # Q/K/V as views of one fused projection: row stride 3 x heads x head_dim.
    packed = _operand(45, DTYPE, offset=1.0, seed=7).repeat(1, 1, 3, 1).view(2, 45, 3, 3, 32)
    key = packed[:, :, 1]
    assert not key.is_contiguous()
    x8, scale = quantize_fp8_per_head(key, center=True, backend="triton")
    r8, rscale = quantize_fp8_per_head_reference(key, center=True)
    assert torch.equal(scale, rscale) and torch.equal(x8.view(torch.uint8), r8.view(torch.uint8))


def test_per_head_fp8_writes_every_output(monkeypatch):
    """Outputs and partial reductions allocated poisoned (NaN): every element must be written by the kernels."""
    from diffusers_h3.kernels.attention import fp8_per_head

    x = _operand(600, DTYPE, offset=2.0, seed=11)  # three chunks of rows, the last one partial
    expected = fp8_per_head.quantize_fp8_per_head_reference(x, center=True)
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(tensor):
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(fp8_per_head.torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(fp8_per_head.torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))
    x8, scale = fp8_per_head.quantize_fp8_per_head(x, center=True, backend="triton")
    monkeypatch.undo()
    assert torch.equal(scale, expected[1]) and torch.equal(x8.view(torch.uint8), expected[0].view(torch.uint8))
