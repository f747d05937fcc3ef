"""FlashInfer's Hopper attention kernels as peers of ours, on the attention suite's H3 inputs.

Same run, same seeded inputs as ``benchmarks/attention.py`` (38,222 packed rows, 56 heads x 128):

* ``cudnn_dense`` (baseline), our ``fp8_dense`` / ``int8_dense`` and ``vsa_bf16_sp0.8_fine_only``;
* ``peer_flashinfer_fa3_bf16_dense``: FlashInfer's FlashAttention-3 template (``single_prefill_with_kv_cache``,
  ``backend="fa3"``);
* ``peer_flashinfer_fa3_fp8_dense``: the same template in FP8 (E4M3 Q, K and V with one scale per head, K
  mean-centred as ours; FP8 P.V) -- the kernel alone, the torch quantization is not timed;
* ``peer_flashinfer_fa3_sp0.8``: ``VariableBlockSparseAttentionWrapper(backend="fa3")`` on our exact tiles and
  selection (rows reordered to tile order; token-level page table);
* ``peer_flashinfer_cake_{bf16,fp8}_k64`` vs ``ours_{bf16,fp8,int8}_k64``: FlashInfer's generated Hopper VSA kernel
  (``backend="cake"``) takes at most 64 selected 64-token key blocks per query block and only full blocks, so this
  pair runs on 675 full tiles (43,200 rows of the same distribution) with 64 tiles selected per query tile (top-64 of
  the pooled scores for every query tile), fine stage alone; the FP8 cake case includes its own fused quantizer
  (``sage_fp8_quantize_sm90``), ours their quantizers (``vsa_attention`` with no prefix tiles, which adds pooling and
  selection).

FlashInfer is not a dependency of diffusers-h3; this script needs ``flashinfer-python`` and CUDA's compiler for its
JIT (how to build it on a GPU host without network access: docs/benchmarking.md)::

    python benchmarks/flashinfer_peers.py --out benchmarks/results/attention_flashinfer_h200.json
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from diffusers_h3.attention_processors.tiling import TilePlan
from diffusers_h3.attention_processors.vsa import vsa_attention
from diffusers_h3.kernels.attention import block_sparse_attention, fp8_attention
from diffusers_h3.kernels.attention.flashinfer_dense import flashinfer_fp8_attention, fp8_per_head_operands
from diffusers_h3.kernels.attention.vsa_pool import tile_pool
from diffusers_h3.kernels.attention.vsa_select import mask_to_index, select_tiles

from _common import (
    AttentionCases,
    computed_pairs,
    cudnn_attention,
    dense_reference,
    error_heads,
    h3_inputs,
    require_cuda,
    result_header,
    selection,
    sparse_reference,
    write_json,
)


FP8 = torch.float8_e4m3fn


def full_tile_plan(num_tiles: int, device) -> TilePlan:
    """A plan of ``num_tiles`` full 64-row tiles in row order, all of them 'video' (top-k applies to every query)."""
    rows = torch.arange(num_tiles * 64, device=device)
    return TilePlan(block=64, seq_len=num_tiles * 64, slot_rows=rows.to(torch.int32),
                    tile_counts=torch.full((num_tiles,), 64, dtype=torch.int32, device=device),
                    row_tile=rows // 64, num_prefix_tiles=0, num_video_tiles=num_tiles)


def prebuild_fa3_modules() -> float:
    """Build FlashInfer's JIT modules for the FA3 cases concurrently (each ``build`` runs its own ninja; FlashInfer
    would otherwise build them one after another on first use). Returns the seconds it took."""
    from concurrent.futures import ThreadPoolExecutor

    from flashinfer.jit.attention.modules import gen_batch_prefill_module, gen_single_prefill_module

    bf16 = torch.bfloat16
    specs = [gen_single_prefill_module("fa3", bf16, bf16, bf16, 128, 128, 0, False, False, False),
             gen_single_prefill_module("fa3", FP8, FP8, bf16, 128, 128, 0, False, False, False),
             gen_batch_prefill_module("fa3", bf16, bf16, bf16, torch.int32, 128, 128, 0, False, False, False)]
    t0 = time.time()
    with ThreadPoolExecutor(len(specs)) as pool:
        list(pool.map(lambda spec: spec.build(), specs))
    return time.time() - t0


def sparse_peers(suite, q, k, v, plan, err_heads):
    """Sparsity 0.8 on the real tile plan: ours (fine stage alone) vs FlashInfer's generic variable-block FA3 path."""
    from flashinfer.sparse import VariableBlockSparseAttentionWrapper

    record, skip, notes = suite.record, suite.skip, suite.notes
    h, d = q.shape[2], q.shape[3]
    mask = selection(q, k, plan, 0.8)
    ref_sparse = sparse_reference(q, k, v, plan, mask, err_heads)
    sparse_pairs = computed_pairs(plan, mask)
    rows = (plan.slot_rows, plan.tile_counts, plan.block)
    _, kp = tile_pool(k, *rows, pooled=False, packed=True)
    _, vp = tile_pool(v, *rows, pooled=False, packed=True)
    index, num = mask_to_index(mask)
    record("vsa_bf16_sp0.8_fine_only",
           lambda: block_sparse_attention(q, kp, vp, plan.slot_rows, plan.tile_counts, index, num, block=64),
           ref_sparse, pairs=sparse_pairs, note="ours, fine stage alone")
    order = plan.slot_rows.long()[plan.valid_slots]  # packed rows in tile order, pads dropped
    qt, kt, vt = (x[0, order].transpose(0, 1).contiguous() for x in (q, k, v))  # HND in tile order
    sizes = plan.tile_counts[None].expand(h, -1).contiguous()

    def tile_order_to_rows(out_hnd):
        out = torch.empty_like(q)
        out[0, order] = out_hnd.transpose(0, 1).to(q.dtype)
        return out

    if not any(x in "peer_flashinfer_fa3_sp0.8" for x in skip):
        try:
            wrapper = VariableBlockSparseAttentionWrapper(
                torch.empty(256 * 2**20, dtype=torch.uint8, device=q.device), backend="fa3")
            t0 = time.time()
            wrapper.plan(mask[0].contiguous(), sizes, sizes, h, h, d, q_data_type=torch.bfloat16)
            notes["peer_flashinfer_fa3_sp0.8_plan_s"] = f"{time.time() - t0:.1f} s to plan (token-level page table)"
            record("peer_flashinfer_fa3_sp0.8", lambda: wrapper.run(qt, kt, vt), ref_sparse, pairs=sparse_pairs,
                   to_rows=tile_order_to_rows,
                   note="FlashInfer VariableBlockSparseAttentionWrapper(backend='fa3'), same tiles and selection, "
                        "fine stage alone")
            del wrapper
        except Exception as error:  # noqa: BLE001
            notes["peer_flashinfer_fa3_sp0.8"] = f"failed: {type(error).__name__}: {str(error)[:400]}"
            print("peer_flashinfer_fa3_sp0.8 FAILED", notes["peer_flashinfer_fa3_sp0.8"], flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--commit", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--heads", type=int, default=56)
    parser.add_argument("--error-heads", type=int, default=4)
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--skip", default="", help="comma list of name fragments of cases not to run")
    args = parser.parse_args(argv)
    require_cuda("benchmarks/flashinfer_peers.py")
    import flashinfer
    from flashinfer.sparse import VariableBlockSparseAttentionWrapper

    build_s = prebuild_fa3_modules()
    print(f"FlashInfer FA3 modules built in {build_s:.0f} s", flush=True)
    layout, plan, (q, k, v) = h3_inputs(args.heads)
    b, s, h, d = q.shape
    err_heads = error_heads(h, args.error_heads)
    suite = AttentionCases(err_heads, 4.0 * s * s * d * h, d, s, h, reps=args.iters, skip=args.skip.split(","))
    cases, notes = suite.cases, suite.notes
    ref_dense = dense_reference(q, k, v, err_heads)

    record = suite.record
    record("cudnn_dense", lambda: cudnn_attention(q, k, v), ref_dense)
    record("fp8_dense", lambda: fp8_attention(q, k, v), ref_dense,
           note="ours: E4M3 Q per row, K per 64-key block (mean-centred), bf16 P.V, incl. quantization")
    record("fp8_dense_pv8", lambda: fp8_attention(q, k, v, pv_fp8=True), ref_dense,
           note="ours: as fp8_dense plus E4M3 P and per-channel E4M3 V")
    record("int8_dense", lambda: fp8_attention(q, k, v, qk_dtype=torch.int8), ref_dense,
           note="ours: INT8 Q/K (amax/127), bf16 P.V, incl. quantization")

    qn, kn, vn = q[0], k[0], v[0]  # NHD [S, H, D]
    record("peer_flashinfer_fa3_bf16_dense",
           lambda: flashinfer.single_prefill_with_kv_cache(qn, kn, vn, causal=False, backend="fa3")[None],
           ref_dense, note="FlashInfer FA3 template, bf16")
    # E4M3 Q/K/V with one scale per head, K mean-centred: this package's FlashInfer FP8 operands (batch item 0).
    (q8, sq), (k8, sk), (v8, sv) = ((x8[0], scale[0]) for x8, scale in fp8_per_head_operands(q, k, v, smooth_k=True))
    record("peer_flashinfer_fa3_fp8_dense",
           lambda: flashinfer.single_prefill_with_kv_cache(q8, k8, v8, scale_q=sq, scale_k=sk, scale_v=sv,
                                                           o_dtype=torch.bfloat16, causal=False, backend="fa3")[None],
           ref_dense,
           note="FlashInfer FA3 template in FP8: E4M3 Q/K/V, one scale per head, K mean-centred, FP8 P.V; kernel "
                "alone (the quantization is not timed)")
    del q8, k8, v8
    record("flashinfer_fp8_dense_incl_quant", lambda: flashinfer_fp8_attention(q, k, v)[0], ref_dense,
           note="this package's FlashInfer FP8 path (MiniMaxH3FlashInferProcessor precision='fp8'): the same kernel "
                "with the per-head quantization and K mean-centring included")

    sparse_peers(suite, q, k, v, plan, err_heads)
    torch.cuda.empty_cache()

    # 64 selected tiles of 675 full ones: FlashInfer's generated Hopper VSA kernel vs ours on identical lists.
    t = plan.num_tiles
    fplan = full_tile_plan(t, q.device)
    gen = torch.Generator(device=q.device).manual_seed(1)
    qf, kf, vf = (torch.randn(1, t * 64, h, d, device=q.device, dtype=torch.bfloat16, generator=gen) for _ in range(3))
    kf = (kf + 0.5 * torch.randn(1, 1, h, d, device=q.device, generator=gen)).to(torch.bfloat16)
    frows = (fplan.slot_rows, fplan.tile_counts, 64)
    pq, _ = tile_pool(qf, *frows)
    pk, _ = tile_pool(kf, *frows)
    topk = 64
    sparsity = 1.0 - (topk - 0.5) / t  # select_tiles' ceil((1 - sparsity) * t) = 64
    idx64, num64 = select_tiles(pq @ pk.transpose(-1, -2) / math.sqrt(d), 0, topk)
    mask64 = torch.zeros(1, h, t, t, dtype=torch.bool, device=q.device)
    mask64.scatter_(-1, idx64[..., :topk].long(), True)
    assert int(mask64.sum(-1).min()) == topk == int(num64.min())
    ref64 = sparse_reference(qf, kf, vf, fplan, mask64, err_heads)
    pairs64 = computed_pairs(fplan, mask64)
    note64 = "675 full 64-row tiles, 64 selected per query tile (FlashInfer cake's limit), identical lists"
    record("ours_bf16_k64_fine_only",
           lambda: block_sparse_attention(qf, kf, vf, fplan.slot_rows, fplan.tile_counts, idx64, num64, block=64),
           ref64, pairs=pairs64, vs_baseline=False, note="ours, fine stage alone; " + note64)
    for prec in ("bf16", "fp8", "int8"):
        record(f"ours_{prec}_k64_core", lambda prec=prec: vsa_attention(qf, kf, vf, fplan, sparsity=sparsity,
                                                                          precision=prec)[0],
               ref64, pairs=pairs64, vs_baseline=False, note="ours, whole VSA core (pooling, selection, quantization, fine); " + note64)
    qh, kh, vh = (x[0].transpose(0, 1).contiguous() for x in (qf, kf, vf))
    sizes64 = torch.full((h, t), 64, dtype=torch.int32, device=q.device)

    def hnd_to_rows(out_hnd):
        return out_hnd.transpose(0, 1)[None]

    # Planning builds the cake kernels (minutes): only when its cases run.
    if not any(x in "peer_flashinfer_cake" for x in suite.skip):
        try:
            from flashinfer.cake_vsa_sm90 import sage_fp8_quantize_sm90

            cake = VariableBlockSparseAttentionWrapper(torch.empty(1, dtype=torch.uint8, device=q.device), backend="cake")
            cake.plan(mask64[0].contiguous(), sizes64, sizes64, h, h, d, q_data_type=torch.bfloat16)
            record("peer_flashinfer_cake_bf16_k64", lambda: cake.run(qh, kh, vh), ref64, pairs=pairs64, vs_baseline=False, to_rows=hnd_to_rows,
                   note="FlashInfer VariableBlockSparseAttentionWrapper(backend='cake'), SM90 generated kernel, bf16; "
                        + note64)
            q8, k8, v8, sq, sk, sv = sage_fp8_quantize_sm90(qh, kh, vh)
            cake8 = VariableBlockSparseAttentionWrapper(torch.empty(1, dtype=torch.uint8, device=q.device), backend="cake")
            cake8.plan(mask64[0].contiguous(), sizes64, sizes64, h, h, d, q_data_type=FP8, kv_data_type=FP8,
                       q_scale=sq, k_scale=sk, v_scale=sv)

            def cake_fp8():
                q8_, k8_, v8_, sq_, sk_, sv_ = sage_fp8_quantize_sm90(qh, kh, vh)
                sq.copy_(sq_), sk.copy_(sk_), sv.copy_(sv_)  # the plan binds its scale tensors
                return cake8.run(q8_, k8_, v8_)

            record("peer_flashinfer_cake_fp8_k64", cake_fp8, ref64, pairs=pairs64, vs_baseline=False, to_rows=hnd_to_rows,
                   note="FlashInfer cake, Sage FP8 (E4M3 Q per token, K per 16 tokens, V per channel; FP8 P.V), incl. its "
                        "fused quantizer; " + note64)
            record("peer_flashinfer_cake_fp8_k64_kernel_only", lambda: cake8.run(q8, k8, v8), ref64, pairs=pairs64, vs_baseline=False,
                   to_rows=hnd_to_rows, note="as peer_flashinfer_cake_fp8_k64, kernel alone")
        except Exception as error:  # noqa: BLE001
            notes["peer_flashinfer_cake"] = f"failed: {type(error).__name__}: {str(error)[:400]}"
            print("peer_flashinfer_cake FAILED", notes["peer_flashinfer_cake"], flush=True)

    result = {
        **result_header("attention_flashinfer", args.commit),
        "flashinfer": flashinfer.__version__,
        "shape": {"rows": s, "heads": h, "head_dim": d, "layout": layout.describe(), "tiles": plan.describe(),
                  "error_heads": err_heads},  # fmt: skip
        "reference": "fp32 attention (dense, or over the same selected tiles) on error_heads",
        "cases": cases,
        "notes": notes,
        "jit_build_s": round(build_s, 1),
    }
    if args.out:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
