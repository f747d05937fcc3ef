"""Tile pooling, packing and the fused FP8/INT8 tile quantization (kernels/attention/vsa_pool.py) vs their torch references.

On a machine without CUDA the Triton kernels run under the interpreter (fp16/fp32 inputs only).
"""

import os

import torch


if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from diffusers_h3.kernels.attention.vsa_pool import tile_pool, tile_pool_reference  # noqa: E402

from ._inputs import DEVICE, DTYPE, rel_l2  # noqa: E402


def test_tile_pool_matches_reference(plan):
    x = torch.randn(2, plan.seq_len, 3, 32, device=DEVICE, dtype=DTYPE)
    pooled, packed = tile_pool(x, plan.slot_rows, plan.tile_counts, plan.block, packed=True, backend="triton")
    ref_pooled, ref_packed = tile_pool_reference(x, plan.slot_rows, plan.tile_counts, plan.block, packed=True)
    assert pooled.shape == (2, 3, plan.num_tiles, 32) and packed.shape == (2, plan.padded_rows, 3, 32)
    torch.testing.assert_close(pooled, ref_pooled, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed, ref_packed, rtol=0, atol=0)
    # An independent check of the mean: the tile that owns row r averages r's value with its tile mates.
    row = plan.seq_len - 1
    t = int(plan.row_tile[row])
    mates = (plan.row_tile == t).nonzero().squeeze(1)
    torch.testing.assert_close(pooled[:, :, t], x[:, mates].float().mean(1), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("packed,per_tile,dtype", [(False, False, torch.float8_e4m3fn), (True, False, torch.float8_e4m3fn),
                                                   (False, True, torch.float8_e4m3fn), (True, True, torch.float8_e4m3fn),
                                                   (False, False, torch.int8), (True, True, torch.int8)])
def test_tile_quantize_fp8_is_bitwise_reference(plan, packed, per_tile, dtype):
    from diffusers_h3.kernels.attention.vsa_pool import tile_quantize_fp8, tile_quantize_fp8_reference

    x = torch.randn(2, plan.seq_len, 3, 32, device=DEVICE, dtype=DTYPE) * 3
    mean = torch.randn(2, 3, 32, device=DEVICE)
    args = (x, plan.slot_rows, plan.tile_counts, plan.block)
    kw = {"pooled": True, "packed": packed, "subtract": mean, "per_tile": per_tile, "dtype": dtype}
    pooled, x8, scale = tile_quantize_fp8(*args, backend="triton", **kw)
    rp, r8, rs = tile_quantize_fp8_reference(*args, **kw)
    torch.testing.assert_close(pooled, rp, rtol=1e-5, atol=1e-5)
    valid = plan.valid_slots
    if packed:
        x8, r8 = x8[:, valid], r8[:, valid]
        if not per_tile:
            scale, rs = scale[:, valid], rs[:, valid]
    assert torch.equal(x8.view(torch.uint8), r8.view(torch.uint8))
    assert torch.equal(scale, rs)
    assert scale.shape == ((2, plan.num_tiles, 3) if per_tile else (2, x8.shape[1], 3))
    # Dequantized values approximate the centred input (an independent sanity check of the reference).
    if not packed:
        row_scale = scale
        if per_tile:  # per-tile scale of each source row
            row_tile = torch.empty(plan.seq_len, dtype=torch.long, device=DEVICE)
            row_tile[plan.slot_rows.long()[valid]] = torch.arange(plan.num_tiles, device=DEVICE).repeat_interleave(
                plan.block)[valid]
            row_scale = scale[:, row_tile]
        deq = x8.float() * row_scale.unsqueeze(-1)
        assert rel_l2(deq, x.float() - mean.unsqueeze(1)) < (0.02 if dtype == torch.int8 else 0.05)
    assert x8.dtype == dtype


def test_int8_rounding_is_half_to_even():
    from diffusers_h3.kernels.attention.vsa_pool import tile_quantize_fp8

    # One 16-row tile whose per-row amax is 127: values k + 0.5 must round to the even neighbour, as torch.round.
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.0] * 2, dtype=torch.float32, device=DEVICE)
    x = x.view(1, 1, 1, 16).expand(1, 16, 1, 16).contiguous().to(DTYPE)
    slot_rows = torch.arange(16, dtype=torch.int32, device=DEVICE)
    counts = torch.tensor([16], dtype=torch.int32, device=DEVICE)
    _, x8, scale = tile_quantize_fp8(x, slot_rows, counts, 16, dtype=torch.int8, backend="triton")
    assert torch.equal(scale, torch.ones_like(scale) * (127.0 * (1.0 / 127.0)))
    assert x8[0, 0, 0, :8].tolist() == [0, 2, 2, 0, -2, -2, 126, 127]
