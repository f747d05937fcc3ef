"""Attention benchmark at the MiniMax-H3 shape (768x1344, 124 frames -> 38,222 packed rows, 56 heads x 128).

Cases (same run, same random bf16 inputs): cuDNN dense SDPA (baseline), our dense FP8, our VSA core (pooling,
selection, fine stage, prefix rows) in bf16 / FP8 / FP4-emulated at sparsity 0.8 and 0.9, and the public ``vsa``
package as a peer when it is importable. Errors are measured on a subset of heads against float32 references:
dense cases against dense fp32 attention, sparse cases against fp32 attention over the same selected tiles (the
``sp0`` cases check the kernel against dense fp32 with every tile selected).

    python benchmarks/attention.py --out benchmarks/results/attention_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from typing import Dict, Optional

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from diffusers_h3.attention_processors.tiling import build_tile_plan  # noqa: E402
from diffusers_h3.attention_processors.vsa import vsa_attention  # noqa: E402
from diffusers_h3.kernels.attention.bsa_sm90 import sm90_kernel_available  # noqa: E402
from diffusers_h3.kernels.attention.dense_quantized import fp8_attention  # noqa: E402
from diffusers_h3.kernels.attention.vsa_pool import tile_pool  # noqa: E402
from diffusers_h3.kernels.attention.vsa_select import build_block_mask, mask_to_index, topk_for_sparsity  # noqa: E402
from diffusers_h3.pipelines.packing import t2va_fl2va_layout  # noqa: E402
from diffusers_h3.testing.benchmarking import cuda_median_ms, git_commit  # noqa: E402


def h3_inputs(heads: int = 56, device="cuda"):
    """``(layout, plan, (q, k, v))``: the benchmark's packed H3 sequence and its seeded random bf16 ``[1, S, H, 128]``
    inputs (shared by every attention benchmark so that their cases are comparable)."""
    torch.manual_seed(0)
    # [text | audio | target video] as the t2va pipeline packs 768x1344x124 (37 latent frames of 48x84 latents).
    layout = t2va_fl2va_layout(512, 0, 37, 48, 84, 207, (1, 2, 2), 2)
    dev = torch.device(device)
    plan = build_tile_plan(layout, (4, 4, 4), device=dev)
    q = torch.randn(1, layout.seq_len, heads, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn_like(q)
    v = torch.randn_like(q)
    # Give the keys a shared offset (real H3 keys are far from zero-mean; K smoothing exists for that).
    k = (k + 0.5 * torch.randn(1, 1, heads, 128, device=dev)).to(torch.bfloat16)
    return layout, plan, (q, k, v)


def errors(out: torch.Tensor, ref: torch.Tensor) -> Dict[str, float]:
    a, b = out.float().flatten(), ref.float().flatten()
    return {
        "rel_l2": ((a - b).norm() / b.norm()).item(),
        "cosine": torch.nn.functional.cosine_similarity(a, b, dim=0).item(),
        "rel_l1": ((a - b).abs().sum() / b.abs().sum()).item(),
    }


def dense_reference(q, k, v, heads):
    """fp32 dense attention for the chosen heads: ``[B, S, len(heads), D]``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qh, kh, vh = (x[:, :, heads].float().transpose(1, 2) for x in (q, k, v))
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh)
    return out.transpose(1, 2)


def selection(q, k, plan, sparsity):
    rows = (plan.slot_rows, plan.tile_counts, plan.block)
    pq, _ = tile_pool(q, *rows)
    pk, _ = tile_pool(k, *rows)
    scores = pq @ pk.transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = build_block_mask(scores, plan.num_prefix_tiles, topk_for_sparsity(sparsity, plan.num_video_tiles))
    return mask


def sparse_reference(q, k, v, plan, mask, heads, chunk=8192):
    """fp32 attention restricted to the selected tiles, for the chosen heads (chunked over query rows)."""
    s, d = q.shape[1], q.shape[-1]
    out = torch.empty(q.shape[0], s, len(heads), d, device=q.device, dtype=torch.float32)
    row_tile = plan.row_tile
    for bi in range(q.shape[0]):
        for hi, h in enumerate(heads):
            kf, vf = k[bi, :, h].float(), v[bi, :, h].float()
            tile_mask = mask[bi, h]
            for a in range(0, s, chunk):
                qf = q[bi, a:a + chunk, h].float()
                scores = (qf @ kf.T) / math.sqrt(d)
                allowed = tile_mask[row_tile[a:a + chunk]][:, row_tile]
                scores.masked_fill_(~allowed, float("-inf"))
                out[bi, a:a + chunk, hi] = torch.softmax(scores, -1) @ vf
    return out


def computed_pairs(plan, mask):
    """Valid (query row, key row) pairs the sparse kernel computes, summed over heads."""
    counts = plan.tile_counts.to(torch.float64)
    keys_per_qtile = (mask.to(torch.float64) * counts).sum(-1)  # [B, H, T]
    return float((keys_per_qtile * counts).sum())


# Fine-kernel variants timed by --sweep: (kernel, precision, rotate, num_warps, num_stages, block_m, block_n).
# "bf16", "fp8" and "fp8pv8" run the VSA fine stage at sparsity 0.8, "dense_*" the dense mode on the unpacked rows.
# kernel "triton" is the portable Triton kernel, "sm90" the Hopper Gluon kernel (no rotate / warps knobs: its warps
# follow block_m). Register caps for the SM90 kernel measured no gain (attention_sweep_h200.json runs 6, 9, 10).
# Earlier sweeps (two query tiles per program, lazy rescaling, register caps, Triton warp specialization: all slower or
# equal) are in benchmarks/results/attention_sweep_h200.json.
SWEEP = [
    *[("triton", "bf16", True, 4, st, 64, 64) for st in (2, 3)],
    *[("sm90", "bf16", None, None, st, 64, 64) for st in (2, 3)],
    *[("triton", "fp8", True, 4, st, 64, 64) for st in (2, 3)],
    *[("sm90", "fp8", None, None, st, 64, 64) for st in (2, 3)],
    ("triton", "fp8pv8", True, 4, 3, 64, 64),
    *[("sm90", "fp8pv8", None, None, st, 64, 64) for st in (2, 3)],
    ("triton", "dense_fp8", False, 8, 3, 128, 64),
    *[("sm90", "dense_fp8", None, None, st, bm, bn) for st, bm, bn in ((3, 64, 64), (3, 128, 64), (2, 128, 128),
                                                                       (3, 128, 128))],
    *[("sm90", "dense_fp8pv8", None, None, st, 128, bn) for st, bn in ((3, 64), (3, 128), (4, 128))],
    ("triton", "dense_bf16", False, 8, 3, 128, 64),
    *[("sm90", "dense_bf16", None, None, st, 128, bn) for st, bn in ((3, 64), (2, 128))],
]


def _sweep_name(kernel, prec, rotate, warps, stages, block_m, block_n):
    if kernel == "sm90":
        return f"{prec}_sm90_s{stages}_m{block_m}_n{block_n}"
    return f"{prec}_r{int(rotate)}_w{warps}_s{stages}_m{block_m}_n{block_n}"


def _kernel_kwargs(kernel, rotate, warps, stages):
    if kernel == "sm90":
        return dict(kernel="sm90", num_stages=stages)
    return dict(kernel="triton", rotate=rotate, num_warps=warps, num_stages=stages)


def kernel_sweep(q, k, v, plan, iters=5, out_path=None, only=None):
    """Time the :data:`SWEEP` variants (explicit warps / stages, no autotuning); returns ``{name: result}``."""
    from diffusers_h3.kernels.attention import bsa_triton as bsa
    from diffusers_h3.kernels.numerics import quantize_fp8_per_channel
    from diffusers_h3.kernels.attention.vsa_pool import tile_quantize_fp8

    rows = (plan.slot_rows, plan.tile_counts, plan.block)
    mask = selection(q, k, plan, 0.8)
    index, num = mask_to_index(mask)
    pk, kp = tile_pool(k, *rows, packed=True)
    _, vp = tile_pool(v, *rows, pooled=False, packed=True)
    _, q8, qs = tile_quantize_fp8(q, *rows)
    counts = plan.tile_counts.float()
    mean = (pk * counts[:, None]).sum(2) / counts.sum()
    _, k8, ks = tile_quantize_fp8(k, *rows, packed=True, subtract=mean, per_tile=True)
    v8, vs = quantize_fp8_per_channel(vp, seq_dim=1)
    v8t = v8.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    results = {}
    for kernel, prec, rotate, warps, stages, block_m, block_n in SWEEP:
        name = _sweep_name(kernel, prec, rotate, warps, stages, block_m, block_n)
        if only and not any(part in name for part in only.split(",")):
            continue
        kw = _kernel_kwargs(kernel, rotate, warps, stages)
        if prec == "bf16":
            fn = lambda kw=kw: bsa.block_sparse_attention(q, kp, vp, *rows[:2], index, num, block=64, **kw)  # noqa
        elif prec == "fp8":
            fn = lambda kw=kw: bsa.block_sparse_attention(q8, k8, vp, *rows[:2], index, num, block=64,  # noqa
                                                          q_scale=qs, k_scale=ks, **kw)
        elif prec == "fp8pv8":
            fn = lambda kw=kw: bsa.block_sparse_attention(q8, k8, v8t, *rows[:2], index, num, block=64,  # noqa
                                                          q_scale=qs, k_scale=ks, v_scale=vs, **kw)
        elif prec in ("dense_fp8", "dense_fp8pv8"):
            fn = lambda kw=kw, bm=block_m, bn=block_n, pv8=prec.endswith("pv8"): fp8_attention(  # noqa
                q, k, v, pv_fp8=pv8, block_m=bm, block_n=bn, **kw)
        else:
            fn = lambda kw=kw, bm=block_m, bn=block_n: bsa.block_sparse_attention(  # noqa
                q, k, v, None, None, None, None, block=bn, block_m=bm, dense=True, **kw)
        entry = {"kernel": kernel, "precision": prec, "rotate": rotate, "num_warps": warps, "num_stages": stages,
                 "block_m": block_m, "block_n": block_n}
        try:
            entry["ms"] = round(cuda_median_ms(fn, warmup=2, reps=iters), 3)
        except Exception as error:  # noqa: BLE001 - a variant the compiler rejects is recorded, not fatal
            entry["ms"] = None
            entry["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        results[name] = entry
        print(f"sweep {name:32s} {entry['ms']} ms {entry.get('error', '')}", flush=True)
        if out_path:
            with open(out_path, "w") as f:
                json.dump(results, f, indent=2)
    return results


def kernel_options(sweep, prec):
    """Fastest swept options for ``prec`` (keyword arguments of the kernel entry points), ``{}`` if none ran."""
    timed = [r for r in sweep.values() if r["precision"] == prec and r.get("ms")]
    if not timed:
        return {}
    r = min(timed, key=lambda r: r["ms"])
    opts = _kernel_kwargs(r.get("kernel", "triton"), r["rotate"], r["num_warps"], r["num_stages"])
    if prec.startswith("dense"):
        opts.update(block_m=r["block_m"], block_n=r["block_n"])
    return opts


def peer_vsa(peer_dir):
    """The public ``vsa`` package's Triton forward (FastVideo) loaded from its sources, or ``(None, why)``.

    Its package ``__init__`` imports a CUDA extension built for one Python / torch ABI, so only the two pure Triton
    modules are loaded, by path.
    """
    import importlib.util

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
                                          mask_mod=key_is_real, seq_lengths=(n, n))
    compiled = torch.compile(flex_attention, dynamic=False)
    options = {"BLOCK_M": block, "BLOCK_N": block}
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask, kernel_options=options)


def profile_vsa(q, k, v, plan, out_path, sparsity=0.8):
    """CUDA time per kernel of one VSA core call (pooling, selection, quantization, fine stage) per precision."""
    from torch.profiler import ProfilerActivity, profile

    result = {}
    for prec, pv in (("bf16", "bf16"), ("fp8", "bf16"), ("fp8", "fp8")):
        def fn(prec=prec, pv=pv):
            return vsa_attention(q, k, v, plan, sparsity=sparsity, precision=prec, pv_precision=pv)[0]
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        rows = sorted(((e.key, e.device_time_total / 5e3) for e in prof.key_averages()), key=lambda r: -r[1])
        name = f"vsa_{prec}{'pv8' if pv == 'fp8' else ''}_sp{sparsity}"
        result[name] = {"total_ms": round(sum(ms for _, ms in rows), 3),
                        "kernels_ms": {key[:90]: round(ms, 3) for key, ms in rows if ms > 0.01}}
        print(name, result[name]["total_ms"], "ms", flush=True)
        for key, ms in rows[:10]:
            print(f"   {ms:8.3f} ms  {key[:100]}", flush=True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=2)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--commit", default=None, help="commit measured (the device copy has no .git)")
    parser.add_argument("--out", default=None, help="write the JSON here")
    parser.add_argument("--heads", type=int, default=56)
    parser.add_argument("--error-heads", type=int, default=4, help="heads used for the fp32 error references")
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="fewer cases (CI smoke)")
    parser.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True,
                        help="time the fine-kernel variants first and use the fastest (else the defaults)")
    parser.add_argument("--sweep-only", action="store_true", help="stop after the sweep")
    parser.add_argument("--sweep-out", default=None, help="write the sweep results here as they come")
    parser.add_argument("--profile-vsa", default=None, metavar="JSON",
                        help="only profile the VSA core (CUDA time per kernel, torch.profiler) and write it here")
    parser.add_argument("--sweep-only-cases", default=None,
                        help="comma list of name fragments: time only the sweep variants whose name contains one")
    parser.add_argument("--peer-dir", default=None,
                        help="folder holding the public vsa package's python sources (vsa/block_sparse_attn_triton.py)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/attention.py needs a CUDA GPU")

    layout, plan, (q, k, v) = h3_inputs(args.heads)
    b, s, h, d = q.shape
    err_heads = torch.linspace(0, h - 1, args.error_heads).round().long().tolist()
    dense_flops = 4.0 * s * s * d * h

    cases: Dict[str, Dict[str, Optional[float]]] = {}
    notes: Dict[str, str] = {}

    def not_measured(name, why):
        cases[name] = {"ms": None, "baseline": "cudnn_dense", "ratio": None, "rel_l2": None, "peak_gib": None}
        notes[name] = why

    def record(name, fn, ref, pairs=None, note=None, baseline_ms=None, to_rows=None):
        """Time ``fn`` and measure its error; ``to_rows`` maps an output in another layout to ``[B, S, H, D]`` rows
        for the error only (the timed call stays ``fn`` alone)."""
        try:
            return _record(name, fn, ref, pairs, note, baseline_ms, to_rows)
        except Exception as error:  # noqa: BLE001 - one failing case must not lose the others
            not_measured(name, f"failed: {type(error).__name__}: {str(error)[:300]}")
            print(f"{name:24s} FAILED {notes[name]}", flush=True)
            return None

    def _record(name, fn, ref, pairs, note, baseline_ms, to_rows):
        torch.cuda.reset_peak_memory_stats()
        base_mem = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base_mem) / 2**30
        if to_rows is not None:
            out = to_rows(out)
        err = errors(out[:, :, err_heads], ref) if ref is not None else {}
        ms = cuda_median_ms(fn, reps=args.iters)
        flops = dense_flops if pairs is None else 4.0 * pairs * d
        cases[name] = {
            "ms": round(ms, 3),
            "baseline": "cudnn_dense",
            "ratio": None if not baseline_ms else round(baseline_ms / ms, 3),
            "rel_l2": None if not err else err["rel_l2"],
            "cosine": err.get("cosine"),
            "rel_l1": err.get("rel_l1"),
            "peak_gib": round(peak, 3),
            "tflops": round(flops / ms / 1e9, 1),
            "density": None if pairs is None else round(pairs / (float(s) * s * h), 4),
        }
        if note:
            notes[name] = note
        print(f"{name:24s} {ms:8.2f} ms  ratio {cases[name]['ratio']}  rel_l2 {cases[name]['rel_l2']}  "
              f"cos {cases[name]['cosine']}  {cases[name]['tflops']} TF/s", flush=True)
        del out
        return ms

    if args.profile_vsa:
        return profile_vsa(q, k, v, plan, args.profile_vsa)
    ref_dense = dense_reference(q, k, v, err_heads)
    sweep = kernel_sweep(q, k, v, plan, iters=5, out_path=args.sweep_out, only=args.sweep_only_cases) if args.sweep else {}
    opts = {prec: kernel_options(sweep, prec) for prec in ("bf16", "fp8", "fp8pv8", "dense_fp8", "dense_fp8pv8")}
    if not opts["fp8pv8"]:
        opts["fp8pv8"] = opts["fp8"]
    print("kernel options:", opts, flush=True)
    if args.sweep_only:
        return {"kernel_sweep": sweep, "kernel_options": opts}

    def cudnn():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            ).transpose(1, 2)

    base = record("cudnn_dense", cudnn, ref_dense)
    if base is not None:
        cases["cudnn_dense"]["ratio"] = 1.0
    record("fp8_dense", lambda: fp8_attention(q, k, v, **opts["dense_fp8"]), ref_dense, baseline_ms=base,
           note="E4M3 Q per-token and K per-64-row-block scales, K mean-centred, bf16 PV, fp32 softmax")
    record("fp8_dense_pv8", lambda: fp8_attention(q, k, v, pv_fp8=True, **(opts["dense_fp8pv8"] or opts["dense_fp8"])),
           ref_dense,
           baseline_ms=base,
           note="as fp8_dense plus E4M3 P and per-channel E4M3 V")
    record("int8_dense", lambda: fp8_attention(q, k, v, qk_dtype=torch.int8, **opts["dense_fp8"]), ref_dense,
           baseline_ms=base, note="as fp8_dense with symmetric INT8 Q/K (amax/127 scales; INT8 wgmma, int32 sums)")

    # Accuracy gates: every tile selected (sparsity 0) vs dense fp32.
    for prec in ("bf16", "fp8", "int8"):
        record(f"vsa_{prec}_sp0", lambda prec=prec: vsa_attention(q, k, v, plan, sparsity=0.0, precision=prec)[0],
               ref_dense, baseline_ms=base, note="every tile selected: checks the sparse kernel against dense fp32")

    variants = [("bf16", 0.8, "bf16"), ("fp8", 0.8, "bf16"), ("bf16", 0.9, "bf16"), ("fp8", 0.9, "bf16"),
                ("fp8", 0.8, "fp8"), ("fp8", 0.9, "fp8"), ("int8", 0.8, "bf16"), ("int8", 0.9, "bf16"),
                ("int8", 0.8, "fp8"), ("fp4", 0.8, "bf16")]
    if args.quick:
        variants = variants[:2]
    for sparsity in sorted({sp for _, sp, _ in variants}):
        mask = selection(q, k, plan, sparsity)
        ref_sparse = sparse_reference(q, k, v, plan, mask, err_heads)
        pairs = computed_pairs(plan, mask)
        for prec, sp, pv in variants:
            if sp != sparsity:
                continue
            name = f"vsa_{prec}{'pv8' if pv == 'fp8' else ''}_sp{sp}"
            note = {"fp4": "FP4 (E2M1, 16-element E4M3 scales) Q/K/V emulated with quantize-dequantize + bf16 "
                           "kernel; native FP4 not run on hardware (H200 has no FP4 MMA)"}.get(prec)
            ko = opts["fp8pv8" if pv == "fp8" else ("fp8" if prec in ("fp8", "int8") else "bf16")]
            record(name, lambda prec=prec, sp=sp, pv=pv, ko=ko: vsa_attention(
                       q, k, v, plan, sparsity=sp, precision=prec, pv_precision=pv, kernel_options=ko)[0],
                   ref_sparse, pairs=pairs, baseline_ms=base, note=note)
        if sparsity == 0.8:
            from diffusers_h3.kernels.attention.bsa_triton import block_sparse_attention

            rows = (plan.slot_rows, plan.tile_counts, plan.block)
            _, kp = tile_pool(k, *rows, pooled=False, packed=True)
            _, vp = tile_pool(v, *rows, pooled=False, packed=True)
            index, num = mask_to_index(mask)
            record("vsa_bf16_sp0.8_fine_only",
                   lambda: block_sparse_attention(q, kp, vp, plan.slot_rows, plan.tile_counts, index, num,
                                                  block=plan.block, **opts["bf16"]),
                   ref_sparse, pairs=pairs, baseline_ms=base, note="fine kernel alone (no pooling / selection)")
            # Peers on the packed tile-ordered rows ([B, H, T*64, D], pad slots zero): timed alone like fine_only.
            _, qp = tile_pool(q, *rows, pooled=False, packed=True)
            qh, kh, vh = (x.transpose(1, 2).contiguous() for x in (qp, kp, vp))
            slots = plan.slot_rows.long()
            valid = plan.valid_slots

            def packed_to_rows(out_h):
                out = torch.zeros_like(q)
                out[:, slots[valid]] = out_h.transpose(1, 2)[:, valid].to(q.dtype)
                return out

            fn, why = peer_vsa(args.peer_dir)
            if fn is None:
                not_measured("peer_vsa_sp0.8", why)
                print("peer_vsa_sp0.8           skipped:", why)
            else:
                idx, cnt, counts = index.contiguous(), num.contiguous(), plan.tile_counts.to(torch.int32)
                record("peer_vsa_sp0.8", lambda: fn(qh, kh, vh, idx, cnt, counts)[0], ref_sparse, pairs=pairs,
                       baseline_ms=base, to_rows=packed_to_rows,
                       note="public vsa 0.0.4 Triton forward (_attn_fwd_sparse, its own autotuning), fine stage alone "
                            "on the same packed tiles and lists; compare with vsa_bf16_sp0.8_fine_only")
            flex = flex_block_sparse(plan, mask)
            if flex is not None:
                record("flex_attention_sp0.8", lambda: flex(qh, kh, vh), ref_sparse, pairs=pairs, baseline_ms=base,
                       to_rows=packed_to_rows,
                       note="torch FlexAttention (torch.compile'd) with a BlockMask of the same tile lists (64x64 "
                            "blocks, full tiles without mask_mod, partial tiles masked): torch's own block-sparse "
                            "kernel as a second peer; fine stage alone")
            del qp, qh, kh, vh
            del kp, vp, index, num
        del ref_sparse, mask

    commit = git_commit(args.commit) or "unknown"
    result = {
        "suite": "attention_h200",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python3 " + " ".join(sys.argv),
        "shape": {"batch": b, "rows": s, "heads": h, "head_dim": d, "layout": layout.describe(),
                  "tiles": plan.describe(), "error_heads": err_heads},
        "reference": "fp32 attention (dense, or over the same selected tiles for sparse cases) on error_heads",
        "cases": cases,
        "notes": notes,
        "kernel_sweep": sweep,
        "kernel_options": opts,
        "flash_kernel": ("Hopper Gluon kernels (block_sparse_attention_sm90: TMA ring, async wgmma; dense FP8 "
                         "warp-specialized) unless a case's kernel_options say otherwise; FP4 emulation on Triton"
                         if sm90_kernel_available(q.device) else "Triton kernels"),
    }
    text = json.dumps(result, indent=2)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return result


if __name__ == "__main__":
    main()
