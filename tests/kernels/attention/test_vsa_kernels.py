"""VSA kernels (tile pooling, mask -> index lists, block-sparse / dense attention) vs their torch references.

On a machine without CUDA the Triton kernels run under the interpreter (fp16/fp32 inputs only).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from diffusers_h3.attention_processors.layout import LayoutSegment, PackedLayout  # noqa: E402
from diffusers_h3.attention_processors.tiling import build_tile_plan  # noqa: E402
from diffusers_h3.kernels.attention.bsa_triton import (  # noqa: E402
    block_sparse_attention,
    block_sparse_attention_reference,
)
from diffusers_h3.kernels.numerics import (  # noqa: E402
    quantize_fp8_per_block,
    quantize_fp8_per_channel,
    quantize_fp8_per_token,
)
from diffusers_h3.kernels.attention.vsa_pool import tile_pool, tile_pool_reference  # noqa: E402
from diffusers_h3.kernels.attention.vsa_select import (  # noqa: E402
    build_block_mask,
    mask_to_index,
    mask_to_index_reference,
    select_tiles,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.float16 if torch.cuda.is_available() else torch.float32


def rel_l2(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _layout():
    # ref2va-like interleaving with partial tiles everywhere: text, reference video, audio, target video, audio.
    segs = [
        LayoutSegment("text", "prompt", 0, 21),
        LayoutSegment("video", "reference", 21, 21 + 2 * 3 * 3, grid=(2, 3, 3)),
        LayoutSegment("audio", "reference", 39, 50, channels=2),
        LayoutSegment("video", "target", 50, 50 + 3 * 5 * 6, grid=(3, 5, 6)),
        LayoutSegment("audio", "target", 140, 157, channels=2),
    ]
    return PackedLayout(tuple(segs), seq_len=157)


@pytest.fixture
def plan():
    return build_tile_plan(_layout(), tile=(2, 2, 4), device=DEVICE)  # block 16


def _poison(t):
    return t.fill_(float("nan"))


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


def test_mask_to_index_matches_reference():
    scores = torch.randn(2, 3, 37, 37, device=DEVICE)
    mask = build_block_mask(scores, num_prefix_tiles=5, topk=7)
    index, num = mask_to_index(mask, backend="triton")
    ref_index, ref_num = mask_to_index_reference(mask)
    torch.testing.assert_close(num, ref_num)
    assert (num[:, :, :5] == 37).all() and (num[:, :, 5:] == 5 + 7).all()
    width = torch.arange(37, device=DEVICE)
    listed = width < num.unsqueeze(-1)
    assert torch.equal(torch.where(listed, index, -1), torch.where(listed, ref_index, -1))
    # Lists are ascending and name exactly the selected tiles.
    rebuilt = torch.zeros(2, 3, 37, 38, dtype=torch.bool, device=DEVICE)
    rebuilt.scatter_(-1, torch.where(listed, index, 37).long(), True)
    assert torch.equal(rebuilt[..., :37], mask)
    assert (index.gather(-1, (num - 1).clamp_min(0).unsqueeze(-1).long()) >= 0).all()


@pytest.mark.parametrize("b,h,t,prefix,topk", [(2, 3, 37, 5, 7), (1, 2, 20, 0, 4), (1, 1, 9, 9, 0),
                                                (1, 2, 40, 3, 37), (1, 1, 33, 4, 1)])
def test_select_tiles_matches_mask_then_index(b, h, t, prefix, topk):
    scores = torch.randn(b, h, t, t, device=DEVICE)
    scores[..., 2:6] = 0.5  # ties at and around the threshold: the lower tile index wins
    scores[..., 7] = -0.0
    scores[..., 8] = 0.0
    index, num = select_tiles(scores, prefix, topk, backend="triton")
    ref_index, ref_num = mask_to_index_reference(build_block_mask(scores, prefix, topk))
    assert torch.equal(num, ref_num)
    assert (num[:, :, prefix:] == prefix + topk).all()
    listed = torch.arange(t, device=DEVICE) < num.unsqueeze(-1)
    assert torch.equal(torch.where(listed, index, -1), torch.where(listed, ref_index, -1))


def test_select_tiles_rejects_a_topk_beyond_the_video_tiles():
    with pytest.raises(ValueError, match="topk must be in"):
        select_tiles(torch.randn(1, 1, 10, 10, device=DEVICE), 4, 7)


def _sparse_inputs(plan, b=2, h=3, d=32, dtype=DTYPE, sparsity_topk=3):
    q = torch.randn(b, plan.seq_len, h, d, device=DEVICE, dtype=dtype)
    k = torch.randn_like(q)
    v = torch.randn_like(q)
    pq, _ = tile_pool_reference(q, plan.slot_rows, plan.tile_counts, plan.block)
    pk, k_packed = tile_pool_reference(k, plan.slot_rows, plan.tile_counts, plan.block, packed=True)
    _, v_packed = tile_pool_reference(v, plan.slot_rows, plan.tile_counts, plan.block, pooled=False, packed=True)
    mask = build_block_mask(pq @ pk.transpose(-1, -2), plan.num_prefix_tiles, sparsity_topk)
    index, num = mask_to_index_reference(mask)
    return q, k_packed, v_packed, index, num


@pytest.mark.parametrize("dtype,tma,rotate", [(DTYPE, False, False), (torch.float32, False, True), (DTYPE, True, True)])
def test_block_sparse_attention_matches_reference(plan, dtype, tma, rotate):
    q, k, v, index, num = _sparse_inputs(plan, dtype=dtype)
    out = _poison(torch.empty_like(q))
    block_sparse_attention(q, k, v, plan.slot_rows, plan.tile_counts, index, num, block=plan.block, out=out,
                           backend="triton", tma=tma, rotate=rotate)
    ref = block_sparse_attention_reference(q, k, v, plan.slot_rows, plan.tile_counts, index, num, block=plan.block)
    assert not out.isnan().any()
    assert rel_l2(out, ref) < (2e-3 if dtype == torch.float16 else 1e-5)


def test_block_sparse_all_tiles_equals_dense_sdpa(plan):
    q, k, v, _, _ = _sparse_inputs(plan)
    n = plan.num_tiles
    index = torch.arange(n, device=DEVICE, dtype=torch.int32).expand(2, 3, n, n).contiguous()
    num = torch.full((2, 3, n), n, device=DEVICE, dtype=torch.int32)
    out = block_sparse_attention(q, k, v, plan.slot_rows, plan.tile_counts, index, num, block=plan.block,
                                 backend="triton")
    # Dense attention on the unpacked rows is the same thing when every tile is selected.
    k_rows = torch.empty_like(q)
    v_rows = torch.empty_like(q)
    valid = plan.valid_slots
    k_rows[:, plan.slot_rows.long()[valid]] = k[:, valid]
    v_rows[:, plan.slot_rows.long()[valid]] = v[:, valid]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2), k_rows.float().transpose(1, 2), v_rows.float().transpose(1, 2)
    ).transpose(1, 2)
    assert rel_l2(out, ref) < 2e-3


@pytest.mark.parametrize("tma,rotate", [(False, False), (True, True)])
def test_fp8_qk_and_pv_match_reference(tma, rotate):
    plan = build_tile_plan(_layout(), tile=(2, 4, 4), device=DEVICE)  # FP8 P.V needs tiles of >= 32 rows on GPUs
    q, k, v, index, num = _sparse_inputs(plan)
    k = k - k.float().mean(1, keepdim=True).to(k.dtype)
    q8, qs = quantize_fp8_per_token(q)
    k8, ks = quantize_fp8_per_block(k, plan.block)  # one scale per key tile
    out = block_sparse_attention(q8, k8, v, plan.slot_rows, plan.tile_counts, index, num, block=plan.block,
                                 q_scale=qs, k_scale=ks, out_dtype=DTYPE, backend="triton", tma=tma, rotate=rotate)
    ref = block_sparse_attention_reference(q8, k8, v, plan.slot_rows, plan.tile_counts, index, num,
                                           block=plan.block, q_scale=qs, k_scale=ks, out_dtype=DTYPE)
    assert rel_l2(out, ref) < 2e-3
    exact = block_sparse_attention_reference(q, k, v, plan.slot_rows, plan.tile_counts, index, num, block=plan.block)
    assert 1e-4 < rel_l2(out, exact) < 8e-2  # FP8 Q/K: a real but small error
    # FP8 PV: V in E4M3 with per-channel scales, stored channel-major.
    v8, vs = quantize_fp8_per_channel(v, seq_dim=1)  # vs [B, H, D]
    v8_t = v8.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # channel-major strides, same logical shape
    out_pv = block_sparse_attention(q8, k8, v8_t, plan.slot_rows, plan.tile_counts, index, num, block=plan.block,
                                    q_scale=qs, k_scale=ks, v_scale=vs, out_dtype=DTYPE, backend="triton", tma=tma,
                                    rotate=rotate)
    ref_pv = block_sparse_attention_reference(q8, k8, v8, plan.slot_rows, plan.tile_counts, index, num,
                                              block=plan.block, q_scale=qs, k_scale=ks, v_scale=vs, out_dtype=DTYPE)
    # The reference walks the tiles like the kernel (P is rounded against the running max); only exp2's last bits
    # differ, which flips an occasional P code.
    assert rel_l2(out_pv, ref_pv) < 5e-3
    assert rel_l2(out_pv, exact) < 1e-1


@pytest.mark.parametrize("tma,rotate,pv_fp8", [(False, False, False), (True, True, True)])
def test_int8_qk_matches_reference(tma, rotate, pv_fp8):
    plan = build_tile_plan(_layout(), tile=(2, 4, 4), device=DEVICE)
    q, k, v, index, num = _sparse_inputs(plan)
    k = k - k.float().mean(1, keepdim=True).to(k.dtype)
    q8, qs = quantize_fp8_per_token(q, dtype=torch.int8)
    k8, ks = quantize_fp8_per_block(k, plan.block, dtype=torch.int8)
    v_arg, vs, v_ref = v, None, v
    if pv_fp8:
        v8, vs = quantize_fp8_per_channel(v, seq_dim=1)
        v_arg, v_ref = v8.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2), v8
    out = _poison(torch.empty(q.shape, device=DEVICE, dtype=DTYPE))
    block_sparse_attention(q8, k8, v_arg, plan.slot_rows, plan.tile_counts, index, num, block=plan.block, q_scale=qs,
                           k_scale=ks, v_scale=vs, out=out, backend="triton", tma=tma, rotate=rotate)
    ref = block_sparse_attention_reference(q8, k8, v_ref, plan.slot_rows, plan.tile_counts, index, num,
                                           block=plan.block, q_scale=qs, k_scale=ks, v_scale=vs, out_dtype=DTYPE)
    assert not out.isnan().any()
    assert rel_l2(out, ref) < (5e-3 if pv_fp8 else 2e-3)
    exact = block_sparse_attention_reference(q, k, v, plan.slot_rows, plan.tile_counts, index, num, block=plan.block)
    assert 1e-5 < rel_l2(out, exact) < (1e-1 if pv_fp8 else 2e-2)


def test_8bit_qk_dtypes_are_checked(plan):
    q, k, v, index, num = _sparse_inputs(plan)
    q8, qs = quantize_fp8_per_token(q, dtype=torch.int8)
    k8, ks = quantize_fp8_per_block(k, plan.block)  # E4M3 keys with INT8 queries: refused
    with pytest.raises(ValueError, match="must both be float8_e4m3fn or both int8"):
        block_sparse_attention(q8, k8, v, plan.slot_rows, plan.tile_counts, index, num, block=plan.block,
                               q_scale=qs, k_scale=ks, backend="triton")
    with pytest.raises(ValueError, match="per-row scales"):
        block_sparse_attention(q8, k, v, plan.slot_rows, plan.tile_counts, index, num, block=plan.block,
                               backend="triton")
    with pytest.raises(ValueError, match="float8_e4m3fn or int8"):
        quantize_fp8_per_token(q, dtype=torch.float16)


@pytest.mark.parametrize("s,tma,rotate", [(77, False, True), (130, True, False)])
def test_dense_kernel_matches_sdpa(s, tma, rotate):
    q = torch.randn(2, s, 2, 32, device=DEVICE, dtype=DTYPE)
    k, v = torch.randn_like(q), torch.randn_like(q)
    out = _poison(torch.empty_like(q))
    block_sparse_attention(q, k, v, None, None, None, None, block=16, dense=True, out=out, backend="triton", tma=tma,
                           rotate=rotate)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2)
    ).transpose(1, 2)
    assert not out.isnan().any()
    assert rel_l2(out, ref) < 2e-3


@pytest.mark.parametrize("packed,per_tile,dtype", [(False, False, torch.float8_e4m3fn), (True, False, torch.float8_e4m3fn),
                                                   (False, True, torch.float8_e4m3fn), (True, True, torch.float8_e4m3fn),
                                                   (False, False, torch.int8), (True, True, torch.int8)])
def test_tile_quantize_fp8_is_bitwise_reference(plan, packed, per_tile, dtype):
    from diffusers_h3.kernels.attention.vsa_pool import tile_quantize_fp8, tile_quantize_fp8_reference

    x = torch.randn(2, plan.seq_len, 3, 32, device=DEVICE, dtype=DTYPE) * 3
    mean = torch.randn(2, 3, 32, device=DEVICE)
    args = (x, plan.slot_rows, plan.tile_counts, plan.block)
    kw = dict(pooled=True, packed=packed, subtract=mean, per_tile=per_tile, dtype=dtype)
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


@pytest.mark.parametrize("pv_fp8,qk_dtype", [(False, torch.float8_e4m3fn), (True, torch.float8_e4m3fn),
                                             (False, torch.int8), (True, torch.int8)])
def test_fp8_dense_attention_matches_reference(pv_fp8, qk_dtype):
    from diffusers_h3.kernels.attention.dense_quantized import fp8_attention, fp8_attention_reference

    q = torch.randn(1, 83, 2, 32, device=DEVICE, dtype=DTYPE)
    k = torch.randn_like(q) + 1.0
    v = torch.randn_like(q)
    out = fp8_attention(q, k, v, pv_fp8=pv_fp8, block_n=32, qk_dtype=qk_dtype, backend="triton")
    ref = fp8_attention_reference(q, k, v, pv_fp8=pv_fp8, block_n=32, qk_dtype=qk_dtype)
    exact = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2)
    ).transpose(1, 2)
    assert rel_l2(out, ref) < 5e-3
    assert 1e-4 < rel_l2(out, exact) < 0.1


def test_int8_qk_error_is_below_e4m3():
    """The reason for the INT8 option: on Gaussian Q/K, E4M3 rounding (3 mantissa bits) costs ~4x the error of INT8
    with per-row scales (measured 3.8e-2 vs 0.9e-2 at the H3 benchmark shape)."""
    from diffusers_h3.kernels.attention.dense_quantized import fp8_attention_reference

    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 512, 2, 64, generator=g)
    k = torch.randn(1, 512, 2, 64, generator=g) + 0.5 * torch.randn(1, 1, 2, 64, generator=g)
    v = torch.randn(1, 512, 2, 64, generator=g)
    exact = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                             v.transpose(1, 2)).transpose(1, 2)
    err = {dt: rel_l2(fp8_attention_reference(q, k, v, block_n=64, qk_dtype=dt), exact)
           for dt in (torch.float8_e4m3fn, torch.int8)}
    assert err[torch.int8] < 1.5e-2 < 3e-2 < err[torch.float8_e4m3fn]


@pytest.mark.parametrize("mode", ["two_level", "single_level"])
def test_fp4_p_emulation_matches_reference(plan, mode):
    from diffusers_h3.kernels.numerics import fake_quant_fp4

    q, k, v, index, num = _sparse_inputs(plan)
    q, k, v = (fake_quant_fp4(x) for x in (q, k, v))
    args = (q, k, v, plan.slot_rows, plan.tile_counts, index, num)
    out = block_sparse_attention(*args, block=plan.block, p_fp4=mode, backend="triton")
    ref = block_sparse_attention_reference(*args, block=plan.block, p_fp4=mode)
    plain = block_sparse_attention_reference(*args, block=plan.block)
    assert rel_l2(out, ref) < 5e-3
    assert 1e-3 < rel_l2(out, plain) < 0.3  # FP4 P is a real, bounded error


def test_fp4_p_reference_agrees_with_generic_fp4():
    from diffusers_h3.kernels.attention.bsa_triton import fake_quant_p_fp4_reference
    from diffusers_h3.kernels.numerics import fake_quant_fp4

    p = torch.rand(7, 64, generator=torch.Generator().manual_seed(7)) ** 3
    assert torch.equal(fake_quant_p_fp4_reference(p, two_level=False), fake_quant_fp4(p, dim=-1))
    # Rows of small probabilities: single-level group scales fall below E4M3's range, the two-level row stretch not.
    small = p * 1e-3
    two_err = rel_l2(fake_quant_p_fp4_reference(small, two_level=True), small)
    assert two_err < 0.2 < rel_l2(fake_quant_p_fp4_reference(small, two_level=False), small)


@pytest.mark.parametrize("n,dtype", [(77, DTYPE), (128, torch.float32), (5, DTYPE)])
def test_channel_major_fp8_v_is_bitwise_reference(n, dtype):
    from diffusers_h3.kernels.attention.v_fp8 import quantize_v_fp8_channel_major, quantize_v_fp8_channel_major_reference

    v = torch.randn(2, n, 3, 32, device=DEVICE, dtype=dtype) * torch.linspace(0.1, 4, 32, device=DEVICE).to(dtype)
    v8, scale = quantize_v_fp8_channel_major(v, backend="triton")
    r8, rscale = quantize_v_fp8_channel_major_reference(v)
    assert torch.equal(scale, rscale)
    # Keys contiguous ([B, H, D, N] storage) and rows padded to 16 bytes, as TMA reads them.
    assert v8.shape == v.shape and v8.stride(1) == 1 and v8.stride(3) % 16 == 0
    assert torch.equal(v8.view(torch.uint8), r8.view(torch.uint8))
    recon = v8.float() * scale.unsqueeze(1)
    assert ((recon - v.float()).abs() <= v.float().abs() * 0.0625 + scale.unsqueeze(1) * 2 ** -9).all()
