"""Decision of the attention-side 8-bit quantizers that must not flip: their scales have an eps floor, so an all-zero
token row (or a whole all-zero key block) quantizes to zero codes with a finite scale, not 0/0."""

import pytest
import torch

from diffusers_h3.kernels.numerics import quantize_fp8_per_block, quantize_fp8_per_token


def _qkv_like():
    x = torch.randn(1, 8, 2, 16, generator=torch.Generator().manual_seed(0))  # [B, N, H, D]
    x[:, 4:] = 0  # the last 4 rows (one block of 4) are zero, as padded tokens are
    return x


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_zero_rows_and_blocks_quantize_to_zero(dtype):
    x = _qkv_like()
    for x8, scale in (quantize_fp8_per_token(x, dtype=dtype), quantize_fp8_per_block(x, 4, dtype=dtype)):
        codes = x8.float()
        assert not codes.isnan().any() and scale.isfinite().all() and (scale > 0).all()
        assert torch.equal(codes[:, 4:], torch.zeros_like(codes[:, 4:]))
        assert codes[:, :4].abs().amax() > 0
