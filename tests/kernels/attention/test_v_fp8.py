"""Channel-major E4M3 V for FP8 P·V (kernels/attention/v_fp8.py) vs its torch reference.

On a machine without CUDA the Triton kernels run under the interpreter (fp16/fp32 inputs only).
"""

import os

import torch


if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from ._inputs import DEVICE, DTYPE  # noqa: E402


@pytest.mark.parametrize("n,dtype", [(77, DTYPE), (128, torch.float32), (5, DTYPE)])
def test_channel_major_fp8_v_is_bitwise_reference(n, dtype):
    from diffusers_h3.kernels.attention.v_fp8 import (
        quantize_v_fp8_channel_major,
        quantize_v_fp8_channel_major_reference,
    )

    v = torch.randn(2, n, 3, 32, device=DEVICE, dtype=dtype) * torch.linspace(0.1, 4, 32, device=DEVICE).to(dtype)
    v8, scale = quantize_v_fp8_channel_major(v, backend="triton")
    r8, rscale = quantize_v_fp8_channel_major_reference(v)
    assert torch.equal(scale, rscale)
    # Keys contiguous ([B, H, D, N] storage) and rows padded to 16 bytes, as TMA reads them.
    assert v8.shape == v.shape and v8.stride(1) == 1 and v8.stride(3) % 16 == 0
    assert torch.equal(v8.view(torch.uint8), r8.view(torch.uint8))
    recon = v8.float() * scale.unsqueeze(1)
    assert ((recon - v.float()).abs() <= v.float().abs() * 0.0625 + scale.unsqueeze(1) * 2 ** -9).all()
