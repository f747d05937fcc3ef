"""Block-sparse / dense flash attention (the Triton kernel through the router) vs block_sparse_attention_reference.

On a machine without CUDA the Triton kernels run under the interpreter (fp16/fp32 inputs only).
"""

import os

import torch


if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from diffusers_h3.attention_processors.tiling import build_tile_plan  # noqa: E402
from diffusers_h3.kernels.attention import (  # noqa: E402
    TuningOptions,
    block_sparse_attention,
    block_sparse_attention_reference,
)
from diffusers_h3.kernels.attention.vsa_pool import tile_pool_reference  # noqa: E402
from diffusers_h3.kernels.attention.vsa_select import build_block_mask, mask_to_index_reference  # noqa: E402
from diffusers_h3.kernels.numerics import (  # noqa: E402
    quantize_fp8_per_block,
    quantize_fp8_per_channel,
    quantize_fp8_per_token,
)

from ._inputs import DEVICE, DTYPE, layout, rel_l2  # noqa: E402
from ._inputs import poison as _poison  # noqa: E402


def _sparse_inputs(plan, b=2, h=2, d=32, dtype=DTYPE, sparsity_topk=3):
    # Two of each: batch and head strides are exercised; the interpreter's time grows with b * h.
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
                           backend="triton",
                           tuning=TuningOptions(tma=tma, rotate=rotate))
    ref = block_sparse_attention_reference(q, k, v, plan.slot_rows, plan.tile_counts, index, num, block=plan.block)
    assert not out.isnan().any()
    assert rel_l2(out, ref) < (2e-3 if dtype == torch.float16 else 1e-5)


def test_block_sparse_all_tiles_equals_dense_sdpa(plan):
    q, k, v, _, _ = _sparse_inputs(plan)
    n = plan.num_tiles
    b, h = q.shape[0], q.shape[2]
    index = torch.arange(n, device=DEVICE, dtype=torch.int32).expand(b, h, n, n).contiguous()
    num = torch.full((b, h, n), n, device=DEVICE, dtype=torch.int32)
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
    plan = build_tile_plan(layout(), tile=(2, 4, 4), device=DEVICE)  # FP8 P.V needs tiles of >= 32 rows on GPUs
    q, k, v, index, num = _sparse_inputs(plan)
    k = k - k.float().mean(1, keepdim=True).to(k.dtype)
    q8, qs = quantize_fp8_per_token(q)
    k8, ks = quantize_fp8_per_block(k, plan.block)  # one scale per key tile
    out = block_sparse_attention(q8, k8, v, plan.slot_rows, plan.tile_counts, index, num, block=plan.block,
                                 q_scale=qs, k_scale=ks, out_dtype=DTYPE, backend="triton",
                           tuning=TuningOptions(tma=tma, rotate=rotate))
    ref = block_sparse_attention_reference(q8, k8, v, plan.slot_rows, plan.tile_counts, index, num,
                                           block=plan.block, q_scale=qs, k_scale=ks, out_dtype=DTYPE)
    assert rel_l2(out, ref) < 2e-3
    exact = block_sparse_attention_reference(q, k, v, plan.slot_rows, plan.tile_counts, index, num, block=plan.block)
    assert 1e-4 < rel_l2(out, exact) < 8e-2  # FP8 Q/K: a real but small error
    # FP8 PV: V in E4M3 with per-channel scales, stored channel-major.
    v8, vs = quantize_fp8_per_channel(v, seq_dim=1)  # vs [B, H, D]
    v8_t = v8.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # channel-major strides, same logical shape
    out_pv = block_sparse_attention(q8, k8, v8_t, plan.slot_rows, plan.tile_counts, index, num, block=plan.block,
                                    q_scale=qs, k_scale=ks, v_scale=vs, out_dtype=DTYPE, backend="triton",
                                    tuning=TuningOptions(tma=tma, rotate=rotate))
    ref_pv = block_sparse_attention_reference(q8, k8, v8, plan.slot_rows, plan.tile_counts, index, num,
                                              block=plan.block, q_scale=qs, k_scale=ks, v_scale=vs, out_dtype=DTYPE)
    # The reference walks the tiles like the kernel (P is rounded against the running max); only exp2's last bits
    # differ, which flips an occasional P code.
    assert rel_l2(out_pv, ref_pv) < 5e-3
    assert rel_l2(out_pv, exact) < 1e-1


@pytest.mark.parametrize("tma,rotate,pv_fp8", [(False, False, False), (True, True, True)])
def test_int8_qk_matches_reference(tma, rotate, pv_fp8):
    plan = build_tile_plan(layout(), tile=(2, 4, 4), device=DEVICE)
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
                           k_scale=ks, v_scale=vs, out=out, backend="triton",
                           tuning=TuningOptions(tma=tma, rotate=rotate))
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
    block_sparse_attention(q, k, v, None, None, None, None, block=16, dense=True, out=out, backend="triton",
                           tuning=TuningOptions(tma=tma, rotate=rotate))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2)
    ).transpose(1, 2)
    assert not out.isnan().any()
    assert rel_l2(out, ref) < 2e-3


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
