"""Attention suite at the MiniMax-H3 shape (768x1344, 124 frames -> 38,222 packed rows, 56 heads x 128).

Cases (same run, same random bf16 inputs): cuDNN dense SDPA (baseline), our dense FP8 / INT8, our VSA core (pooling,
selection, fine stage, prefix rows) in bf16 / FP8 / INT8 / FP4-emulated at sparsity 0.8 and 0.9, the fine stage alone,
and as peers torch FlexAttention on the same tile lists and the public ``vsa`` package when its sources are given.
Errors are measured on a subset of heads against float32 references: dense cases against dense fp32 attention, sparse
cases against fp32 attention over the same selected tiles (the ``sp0`` cases check the kernel against dense fp32 with
every tile selected). Every kernel runs with the router's default choices; ``attention_sweep.py`` times the tuning
variants and ``attention_profile.py`` splits the VSA core into its kernels.

    python benchmarks/attention.py --out benchmarks/results/attention_h200.json
"""

from __future__ import annotations

import argparse
import importlib.util
import os

import torch

from diffusers_h3.attention_processors.vsa import vsa_attention
from diffusers_h3.kernels.attention import block_sparse_attention, fp8_attention
from diffusers_h3.kernels.attention.vsa_pool import tile_pool
from diffusers_h3.kernels.attention.vsa_select import mask_to_index

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


# (precision, sparsity, P.V precision) of the VSA core cases.
VSA_VARIANTS = [
    ("bf16", 0.8, "bf16"),
    ("fp8", 0.8, "bf16"),
    ("bf16", 0.9, "bf16"),
    ("fp8", 0.9, "bf16"),
    ("fp8", 0.8, "fp8"),
    ("fp8", 0.9, "fp8"),
    ("int8", 0.8, "bf16"),
    ("int8", 0.9, "bf16"),
    ("int8", 0.8, "fp8"),
    ("fp4", 0.8, "bf16"),
]


def peer_vsa(peer_dir):
    """The public ``vsa`` package's Triton forward (FastVideo) loaded from its sources, or ``(None, why)``.

    Its package ``__init__`` imports a CUDA extension built for one Python / torch ABI, so only the pure Triton
    module is loaded, by path.
    """
    if not peer_dir:
        return None, "public vsa package not given (--peer-dir)"
    try:
        path = os.path.join(peer_dir, "vsa", "block_sparse_attn_triton.py")
        spec = importlib.util.spec_from_file_location("peer_vsa_block_sparse_attn_triton", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.triton_block_sparse_attn_forward, None
    except Exception as error:  # noqa: BLE001 - any import failure means "peer not available"
        return None, f"public vsa Triton kernel not importable ({type(error).__name__}: {error})"


def flex_block_sparse(plan, mask):
    """``fn(q, k, v)`` running torch FlexAttention over the tile lists of ``mask`` on packed ``[B, H, T*64, D]`` rows.

    Full tiles go in the BlockMask's full lists (no mask_mod); tiles with pad slots in the partial lists, where the
    mask_mod hides the pad keys. Returns ``None`` when FlexAttention is not available.
    """
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention
    except ImportError:
        return None
    block = plan.block
    full_tile = plan.tile_counts == block
    full_idx, full_num = mask_to_index(mask & full_tile)
    part_idx, part_num = mask_to_index(mask & ~full_tile)
    slot_valid = plan.valid_slots

    def key_is_real(b, h, q_idx, kv_idx):  # (the tile test only matters to eager flex, which ignores block lists)
        return slot_valid[kv_idx] & mask[b, h, q_idx // block, kv_idx // block]

    n = plan.num_tiles * block
    block_mask = BlockMask.from_kv_blocks(part_num, part_idx, full_num, full_idx, BLOCK_SIZE=block,
                                          mask_mod=key_is_real, seq_lengths=(n, n))  # fmt: skip
    compiled = torch.compile(flex_attention, dynamic=False)
    options = {"BLOCK_M": block, "BLOCK_N": block}
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask, kernel_options=options)


def fine_stage_and_peers(suite: AttentionCases, q, k, v, plan, mask, ref_sparse, pairs, peer_dir):
    """The fine kernel alone at one selection, and the peers on the same packed tiles and lists."""
    rows = (plan.slot_rows, plan.tile_counts, plan.block)
    _, kp = tile_pool(k, *rows, pooled=False, packed=True)
    _, vp = tile_pool(v, *rows, pooled=False, packed=True)
    index, num = mask_to_index(mask)
    suite.record("vsa_bf16_sp0.8_fine_only",
                 lambda: block_sparse_attention(q, kp, vp, plan.slot_rows, plan.tile_counts, index, num,
                                                block=plan.block),
                 ref_sparse, pairs=pairs, note="fine kernel alone (no pooling / selection)")  # fmt: skip
    # Peers on the packed tile-ordered rows ([B, H, T*64, D], pad slots zero): timed alone like fine_only.
    _, qp = tile_pool(q, *rows, pooled=False, packed=True)
    qh, kh, vh = (x.transpose(1, 2).contiguous() for x in (qp, kp, vp))
    slots = plan.slot_rows.long()
    valid = plan.valid_slots

    def packed_to_rows(out_h):
        out = torch.zeros_like(q)
        out[:, slots[valid]] = out_h.transpose(1, 2)[:, valid].to(q.dtype)
        return out

    fn, why = peer_vsa(peer_dir)
    if fn is None:
        suite.not_measured("peer_vsa_sp0.8", why)
    else:
        idx, cnt, counts = index.contiguous(), num.contiguous(), plan.tile_counts.to(torch.int32)
        suite.record("peer_vsa_sp0.8", lambda: fn(qh, kh, vh, idx, cnt, counts)[0], ref_sparse, pairs=pairs,
                     to_rows=packed_to_rows,
                     note="public vsa Triton forward (_attn_fwd_sparse, its own autotuning), fine stage alone on the "
                     "same packed tiles and lists; compare with vsa_bf16_sp0.8_fine_only")  # fmt: skip
    flex = flex_block_sparse(plan, mask)
    if flex is not None:
        suite.record("flex_attention_sp0.8", lambda: flex(qh, kh, vh), ref_sparse, pairs=pairs, to_rows=packed_to_rows,
                     note="torch FlexAttention (torch.compile'd) with a BlockMask of the same tile lists (64x64 "
                     "blocks, full tiles without mask_mod, partial tiles masked): fine stage alone")  # fmt: skip


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--commit", default=None, help="commit measured (when the tree has no .git)")
    parser.add_argument("--out", default=None, help="write the JSON here")
    parser.add_argument("--heads", type=int, default=56)
    parser.add_argument("--error-heads", type=int, default=4, help="heads used for the fp32 error references")
    parser.add_argument("--iters", type=int, default=7, help="timed runs per case (the median is recorded)")
    parser.add_argument("--quick", action="store_true", help="fewer cases (smoke run)")
    parser.add_argument("--peer-dir", default=None,
                        help="folder holding the public vsa package's python sources (vsa/block_sparse_attn_triton.py)")  # fmt: skip
    args = parser.parse_args(argv)
    require_cuda("benchmarks/attention.py")

    layout, plan, (q, k, v) = h3_inputs(args.heads)
    b, s, h, d = q.shape
    err_heads = error_heads(h, args.error_heads)
    suite = AttentionCases(err_heads, 4.0 * s * s * d * h, d, s, h, reps=args.iters)
    ref_dense = dense_reference(q, k, v, err_heads)

    suite.record("cudnn_dense", lambda: cudnn_attention(q, k, v), ref_dense)
    suite.record("fp8_dense", lambda: fp8_attention(q, k, v), ref_dense,
                 note="E4M3 Q per-token and K per-key-block scales, K mean-centred, bf16 PV, fp32 softmax")  # fmt: skip
    suite.record("fp8_dense_pv8", lambda: fp8_attention(q, k, v, pv_fp8=True), ref_dense,
                 note="as fp8_dense plus E4M3 P and per-channel E4M3 V")  # fmt: skip
    suite.record("int8_dense", lambda: fp8_attention(q, k, v, qk_dtype=torch.int8), ref_dense,
                 note="as fp8_dense with symmetric INT8 Q/K (amax/127 scales; INT8 MMA, int32 sums)")  # fmt: skip

    # Accuracy gates: every tile selected (sparsity 0) vs dense fp32.
    for prec in ("bf16", "fp8", "int8"):
        suite.record(f"vsa_{prec}_sp0", lambda prec=prec: vsa_attention(q, k, v, plan, sparsity=0.0, precision=prec)[0],
                     ref_dense, note="every tile selected: checks the sparse kernel against dense fp32")  # fmt: skip

    variants = VSA_VARIANTS[:2] if args.quick else VSA_VARIANTS
    for sparsity in sorted({sp for _, sp, _ in variants}):
        mask = selection(q, k, plan, sparsity)
        ref_sparse = sparse_reference(q, k, v, plan, mask, err_heads)
        pairs = computed_pairs(plan, mask)
        for prec, sp, pv in variants:
            if sp != sparsity:
                continue
            note = {"fp4": "FP4 (E2M1, 16-element E4M3 scales) Q/K/V emulated with quantize-dequantize + bf16 "
                           "kernel; native FP4 not run on hardware (H200 has no FP4 MMA)"}.get(prec)  # fmt: skip
            suite.record(f"vsa_{prec}{'pv8' if pv == 'fp8' else ''}_sp{sp}",
                         lambda prec=prec, sp=sp, pv=pv: vsa_attention(q, k, v, plan, sparsity=sp, precision=prec,
                                                                       pv_precision=pv)[0],
                         ref_sparse, pairs=pairs, note=note)  # fmt: skip
        if sparsity == 0.8:
            fine_stage_and_peers(suite, q, k, v, plan, mask, ref_sparse, pairs, args.peer_dir)
        del ref_sparse, mask

    result = {
        **result_header("attention", args.commit),
        "triton": __import__("triton").__version__,
        "shape": {"batch": b, "rows": s, "heads": h, "head_dim": d, "layout": layout.describe(),
                  "tiles": plan.describe(), "error_heads": err_heads},  # fmt: skip
        "reference": "fp32 attention (dense, or over the same selected tiles for sparse cases) on error_heads",
        "protocol": f"1 untimed call (compile, error), then the median of {args.iters} CUDA-event timings after 3 "
        "warm-ups; baseline cudnn_dense in the same run",
        "cases": suite.cases,
        "notes": suite.notes,
    }
    if args.out:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
