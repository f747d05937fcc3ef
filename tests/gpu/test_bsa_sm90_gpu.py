"""The Hopper (Gluon) block-sparse attention kernel against the torch reference and the Triton kernel.

Run on an SM90 GPU with ``pytest -m gpu tests/gpu/test_bsa_sm90_gpu.py``.
"""

import math

import pytest
import torch

from diffusers_h3.attention_processors.tiling import build_tile_plan
from diffusers_h3.kernels.attention import (
    TuningOptions,
    block_sparse_attention,
    block_sparse_attention_reference,
    sm90_kernel_supports,
)
from diffusers_h3.kernels.attention.bsa_sm90 import block_sparse_attention_sm90
from diffusers_h3.kernels.attention.vsa_pool import tile_pool_reference
from diffusers_h3.kernels.attention.vsa_select import build_block_mask, mask_to_index_reference
from diffusers_h3.kernels.numerics import quantize_fp8_per_block, quantize_fp8_per_token
from diffusers_h3.layout import LayoutSegment, PackedLayout


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs an SM90 GPU"
    ),
]


def rel_l2(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _plan():
    # ref2va-like interleaving; every segment leaves partial 4x4x4 tiles or partial 64-row chunks.
    segs = (
        LayoutSegment("text", "prompt", 0, 100),
        LayoutSegment("video", "reference", 100, 100 + 2 * 5 * 7, grid=(2, 5, 7)),
        LayoutSegment("audio", "reference", 170, 207, channels=2),
        LayoutSegment("video", "target", 207, 207 + 5 * 9 * 11, grid=(5, 9, 11)),
        LayoutSegment("audio", "target", 702, 742, channels=2),
    )
    return build_tile_plan(PackedLayout(segs, seq_len=742), device="cuda")


def _inputs(plan, b=2, h=3, d=128, topk=4, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(b, plan.seq_len, h, d, device="cuda", dtype=torch.bfloat16)
    k = (torch.randn_like(q) + 0.3).to(torch.bfloat16)
    v = torch.randn_like(q)
    rows = (plan.slot_rows, plan.tile_counts, plan.block)
    pq, _ = tile_pool_reference(q, *rows)
    pk, k_packed = tile_pool_reference(k, *rows, packed=True)
    _, v_packed = tile_pool_reference(v, *rows, pooled=False, packed=True)
    mask = build_block_mask(pq @ pk.transpose(-1, -2) / math.sqrt(d), plan.num_prefix_tiles, topk)
    index, num = mask_to_index_reference(mask)
    return q, k_packed, v_packed, index, num


@pytest.mark.parametrize("d,stages", [(128, 3), (64, 2), (128, 4)])
def test_sparse_bf16_matches_reference(d, stages):
    plan = _plan()
    q, k, v, index, num = _inputs(plan, d=d)
    assert sm90_kernel_supports(q, k, v)[0]
    out = torch.full_like(q, float("nan"))
    block_sparse_attention(q, k, v, plan.slot_rows, plan.tile_counts, index, num, block=64, out=out, tuning=TuningOptions(kernel="sm90", num_stages=stages))
    ref = block_sparse_attention_reference(q, k, v, plan.slot_rows, plan.tile_counts, index, num, block=64,
                                           out_dtype=torch.float32)
    assert not out.isnan().any()
    assert rel_l2(out, ref) < 5e-3


def test_sparse_fp8_qk_matches_reference():
    plan = _plan()
    q, k, v, index, num = _inputs(plan, seed=1)
    k = k - k.float().mean(1, keepdim=True).to(k.dtype)
    q8, qs = quantize_fp8_per_token(q)
    k8, ks = quantize_fp8_per_block(k, 64)
    out = torch.full_like(q, float("nan"))
    block_sparse_attention(q8, k8, v, plan.slot_rows, plan.tile_counts, index, num, block=64, q_scale=qs,
                           k_scale=ks, out=out, tuning=TuningOptions(kernel="sm90"))
    ref = block_sparse_attention_reference(q8, k8, v, plan.slot_rows, plan.tile_counts, index, num, block=64,
                                           q_scale=qs, k_scale=ks, out_dtype=torch.float32)
    assert not out.isnan().any()
    assert rel_l2(out, ref) < 5e-3


# block_m=128 is the warp-specialized kernel (two consumer warpgroups + a TMA producer warp), 64 the plain one.
@pytest.mark.parametrize("s,block_m,block_n,fp8", [(333, 128, 64, False), (1000, 64, 64, False),
                                                   (1000, 128, 64, True), (1000, 128, 128, True),
                                                   (70, 128, 128, False), (4099, 128, 128, False)])
def test_dense_matches_reference(s, block_m, block_n, fp8):
    torch.manual_seed(2)
    q = torch.randn(1, s, 2, 128, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    kw = {}
    if fp8:
        q, qs = quantize_fp8_per_token(q)
        k, ks = quantize_fp8_per_block(k, block_n)
        kw = {"q_scale": qs, "k_scale": ks}
    out = torch.full(v.shape, float("nan"), device="cuda", dtype=torch.bfloat16)
    block_sparse_attention(q, k, v, None, None, None, None, block=block_n, dense=True, out=out, tuning=TuningOptions(kernel="sm90", block_m=block_m), **kw)
    ref = block_sparse_attention_reference(q, k, v, None, None, None, None, block=block_n, dense=True,
                                           out_dtype=torch.float32, **kw)
    assert not out.isnan().any()
    assert rel_l2(out, ref) < 5e-3


def test_sm90_and_triton_kernels_agree_at_h3_length():
    segs = (
        LayoutSegment("text", "prompt", 0, 512),
        LayoutSegment("audio", "target", 512, 926, channels=2),
        LayoutSegment("video", "target", 926, 926 + 37 * 24 * 42, grid=(37, 24, 42)),
    )
    plan = build_tile_plan(PackedLayout(segs, seq_len=926 + 37 * 24 * 42), device="cuda")
    q, k, v, index, num = _inputs(plan, b=1, h=2, topk=132, seed=3)
    args = (q, k, v, plan.slot_rows, plan.tile_counts, index, num)
    a = block_sparse_attention(*args, block=64, tuning=TuningOptions(kernel="sm90"))
    b = block_sparse_attention(*args, block=64, tuning=TuningOptions(kernel="triton"))
    assert rel_l2(a, b) < 2e-3


def test_sm90_refuses_what_it_cannot_run():
    plan = _plan()
    q, k, v, index, num = _inputs(plan)
    with pytest.raises(ValueError, match="cannot run here"):
        block_sparse_attention(q, k, v.float(), plan.slot_rows, plan.tile_counts, index, num, block=64,
                               tuning=TuningOptions(kernel="sm90"))
    with pytest.raises(ValueError, match="knobs of the Triton kernel"):
        block_sparse_attention(q, k, v, plan.slot_rows, plan.tile_counts, index, num, block=64, tuning=TuningOptions(kernel="sm90", rotate=True))


@pytest.mark.parametrize("block_n", [64, 128])
def test_fp8_attention_through_the_sm90_kernel(block_n):
    from diffusers_h3.kernels.attention.dense_quantized import fp8_attention, fp8_attention_reference

    torch.manual_seed(4)
    q = torch.randn(1, 2999, 2, 128, device="cuda", dtype=torch.bfloat16)
    k = (torch.randn_like(q) + 0.7).to(torch.bfloat16)
    v = torch.randn_like(q)
    out = fp8_attention(q, k, v, block_n=block_n, tuning=TuningOptions(kernel="sm90"))
    ref = fp8_attention_reference(q, k, v, block_n=block_n)
    assert rel_l2(out, ref) < 5e-3


def _channel_major(v8):
    return v8.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)


def test_sparse_fp8_pv_matches_reference():
    from diffusers_h3.kernels.numerics import quantize_fp8_per_channel

    plan = _plan()
    q, k, v, index, num = _inputs(plan, seed=5)
    k = k - k.float().mean(1, keepdim=True).to(k.dtype)
    q8, qs = quantize_fp8_per_token(q)
    k8, ks = quantize_fp8_per_block(k, 64)
    v8, vs = quantize_fp8_per_channel(v, seq_dim=1)
    out = torch.full_like(q, float("nan"))
    block_sparse_attention(q8, k8, _channel_major(v8), plan.slot_rows, plan.tile_counts, index, num, block=64,
                           q_scale=qs, k_scale=ks, v_scale=vs, out=out, tuning=TuningOptions(kernel="sm90"))
    ref = block_sparse_attention_reference(q8, k8, v8, plan.slot_rows, plan.tile_counts, index, num, block=64,
                                           q_scale=qs, k_scale=ks, v_scale=vs, out_dtype=torch.float32)
    exact = block_sparse_attention_reference(q, k, v, plan.slot_rows, plan.tile_counts, index, num, block=64,
                                             out_dtype=torch.float32)
    assert not out.isnan().any()
    # P is rounded to E4M3 against the running max like the reference; exp2's last bits flip an occasional code.
    assert rel_l2(out, ref) < 1e-2
    assert rel_l2(out, exact) < 1e-1


@pytest.mark.parametrize("block_m,block_n", [(128, 128), (128, 64), (64, 64)])
def test_dense_fp8_pv_matches_reference(block_m, block_n):
    from diffusers_h3.kernels.attention.dense_quantized import fp8_attention, fp8_attention_reference

    torch.manual_seed(6)
    q = torch.randn(1, 2999, 2, 128, device="cuda", dtype=torch.bfloat16)
    k = (torch.randn_like(q) + 0.7).to(torch.bfloat16)
    v = torch.randn_like(q)
    out = fp8_attention(q, k, v, pv_fp8=True, block_n=block_n, tuning=TuningOptions(kernel="sm90", block_m=block_m))
    ref = fp8_attention_reference(q, k, v, pv_fp8=True, block_n=block_n)
    assert not out.isnan().any()
    assert rel_l2(out, ref) < 1e-2


@pytest.mark.parametrize("kernel", ["sm90", "triton"])
def test_sparse_int8_qk_matches_reference(kernel):
    plan = _plan()
    q, k, v, index, num = _inputs(plan, seed=7)
    k = k - k.float().mean(1, keepdim=True).to(k.dtype)
    q8, qs = quantize_fp8_per_token(q, dtype=torch.int8)
    k8, ks = quantize_fp8_per_block(k, 64, dtype=torch.int8)
    out = torch.full_like(q, float("nan"))
    block_sparse_attention(q8, k8, v, plan.slot_rows, plan.tile_counts, index, num, block=64, q_scale=qs,
                           k_scale=ks, out=out, tuning=TuningOptions(kernel=kernel))
    ref = block_sparse_attention_reference(q8, k8, v, plan.slot_rows, plan.tile_counts, index, num, block=64,
                                           q_scale=qs, k_scale=ks, out_dtype=torch.float32)
    exact = block_sparse_attention_reference(q, k, v, plan.slot_rows, plan.tile_counts, index, num, block=64,
                                             out_dtype=torch.float32)
    assert not out.isnan().any()
    assert rel_l2(out, ref) < 5e-3
    assert rel_l2(out, exact) < 2e-2  # INT8 Q/K: well under E4M3's ~4e-2 on Gaussian inputs


@pytest.mark.parametrize("block_m,block_n,pv_fp8", [(128, 128, False), (64, 64, False), (128, 128, True)])
def test_dense_int8_qk_through_the_sm90_kernel(block_m, block_n, pv_fp8):
    from diffusers_h3.kernels.attention.dense_quantized import fp8_attention, fp8_attention_reference

    torch.manual_seed(8)
    q = torch.randn(1, 2999, 2, 128, device="cuda", dtype=torch.bfloat16)
    k = (torch.randn_like(q) + 0.7).to(torch.bfloat16)
    v = torch.randn_like(q)
    out = fp8_attention(q, k, v, pv_fp8=pv_fp8, block_n=block_n, qk_dtype=torch.int8,
                        tuning=TuningOptions(kernel="sm90", block_m=block_m))
    ref = fp8_attention_reference(q, k, v, pv_fp8=pv_fp8, block_n=block_n, qk_dtype=torch.int8)
    assert not out.isnan().any()
    assert rel_l2(out, ref) < (1e-2 if pv_fp8 else 5e-3)


@pytest.mark.parametrize("qk,stages", [(None, 3), (None, 2), (torch.float8_e4m3fn, 3)])
def test_two_tile_program_is_bitwise_the_one_tile_program(qk, stages):
    # Two query tiles per program (a producer warp and one ring per consumer warpgroup) change only the schedule.
    segs = (
        LayoutSegment("text", "prompt", 0, 100),
        LayoutSegment("video", "reference", 100, 100 + 2 * 5 * 7, grid=(2, 5, 7)),
        LayoutSegment("audio", "reference", 170, 207, channels=2),
        LayoutSegment("video", "target", 207, 207 + 5 * 9 * 11, grid=(5, 9, 11)),
    )
    plan = build_tile_plan(PackedLayout(segs, seq_len=702), device="cuda")
    assert plan.tile_counts.numel() % 2 == 1  # the last program holds one tile
    q, k, v, index, num = _inputs(plan, topk=7, seed=4)
    kw = {}
    if qk is not None:
        k = k - k.float().mean(1, keepdim=True).to(k.dtype)
        q, qs = quantize_fp8_per_token(q)
        k, ks = quantize_fp8_per_block(k, 64)
        kw = {"q_scale": qs, "k_scale": ks}
    outs = []
    for two in (False, True):
        out = torch.full(q.shape, float("nan"), device="cuda", dtype=torch.bfloat16)
        block_sparse_attention_sm90(q, k, v, plan.slot_rows, plan.tile_counts, index, num, out, block=64,
                                    scale=q.shape[-1] ** -0.5, tuning=TuningOptions(num_stages=stages), two_tiles=two,
                                    **kw)
        outs.append(out)
    assert not outs[1].isnan().any()
    assert torch.equal(outs[0], outs[1])
    ref = block_sparse_attention_reference(q, k, v, plan.slot_rows, plan.tile_counts, index, num, block=64,
                                           out_dtype=torch.float32, **kw)
    assert rel_l2(outs[1], ref) < (5e-3 if qk is None else 2e-2)
