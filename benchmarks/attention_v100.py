"""FA-V100 vs SDPA memory-efficient attention at the H3 shape, on whatever GPU runs it.

    python benchmarks/attention_v100.py --out benchmarks/results/fa_v100.json [--heads 56] [--seq 38222]

Cases (fp16, (batch, seq, heads, 128), non-causal): ``sdpa_efficient`` (baseline: SDPA's EFFICIENT_ATTENTION backend,
the xformers/CUTLASS kernel that supports sm_70), ``fa_v100`` (query tile 64), ``fa_v100_q128`` (query tile 128) and,
for context on sm_80+, ``sdpa_default`` (whatever SDPA picks: flash / cuDNN). Protocol: warm-up, then the median of
``--repeats`` timed runs with CUDA events, all cases in one process; ``ratio`` = baseline ms / case ms; ``rel_l2``
against an fp32 oracle on ``--check-rows`` random query rows.

Only a run on a V100 says anything about V100 speed. On other GPUs the JSON is labelled a correctness-and-proxy run:
WMMA on sm_80+ is not the fastest tensor-core path and SDPA's flash / cuDNN kernels are faster still.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from diffusers_h3.kernels.attention.fa_v100 import fa_v100_attention, fa_v100_reference, is_sm70_class, load_extension

from _common import cuda_median_ms, result_header, write_json


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=38222, help="packed rows (H3 768x1344x124f: 38,222)")
    parser.add_argument("--heads", type=int, default=56, help="heads (H3: 56; one TP4 rank: 14)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--check-rows", type=int, default=256)
    parser.add_argument("--commit", default=None, help="commit measured (the device copy has no .git)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        raise SystemExit("attention_v100.py needs a CUDA GPU.")
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = torch.device("cuda")
    capability = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    load_extension(device)

    torch.manual_seed(0)
    shape = (1, args.seq, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=torch.float16) for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    flops = 4.0 * args.seq * args.seq * args.head_dim * args.heads

    def sdpa_efficient():
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            return F.scaled_dot_product_attention(qt, kt, vt).transpose(1, 2)

    def sdpa_default():
        return F.scaled_dot_product_attention(qt, kt, vt).transpose(1, 2)

    cases = {
        "sdpa_efficient": sdpa_efficient,
        "fa_v100": lambda: fa_v100_attention(q, k, v, query_tile=64),
        "fa_v100_q128": lambda: fa_v100_attention(q, k, v, query_tile=128),
    }
    if capability >= (8, 0):
        cases["sdpa_default"] = sdpa_default

    rows = torch.randint(0, args.seq, (args.check_rows,), device=device)
    oracle = fa_v100_reference(q[:, rows].float(), k.float(), v.float(), round_probabilities=False)

    results = {}
    baseline_ms = None
    for case, fn in cases.items():
        out = fn()
        rel_l2 = ((out[:, rows].float() - oracle).norm() / oracle.norm()).item()
        del out
        torch.cuda.reset_peak_memory_stats(device)
        ms = cuda_median_ms(fn, args.warmup, args.repeats)
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        if case == "sdpa_efficient":
            baseline_ms = ms
        results[case] = {
            "ms": round(ms, 3),
            "baseline": "sdpa_efficient",
            "ratio": round(baseline_ms / ms, 4),
            "rel_l2": float(f"{rel_l2:.3e}"),
            "peak_gib": round(peak, 3),
            "tflops": round(flops / ms / 1e9, 1),
        }

    sm70 = is_sm70_class(device)
    report = {
        **result_header("fa_v100", args.commit, device=f"{name} (sm_{capability[0]}{capability[1]})"),
        "shape": {"batch": 1, "seq": args.seq, "heads": args.heads, "head_dim": args.head_dim, "dtype": "float16"},
        "reference": f"fp32 oracle (exact softmax) on {args.check_rows} random query rows",
        "protocol": f"median of {args.repeats} CUDA-event timings after {args.warmup} warm-ups, one process",
        "run_kind": "V100 measurement" if sm70 else "correctness-and-proxy run on a non-V100 GPU; not a V100 speed result",
        "goal": ">= 1.5x sdpa_efficient at 38k rows on a real V100: " + ("measured here" if sm70 else "open (needs a V100)"),
        "cases": results,
    }
    print(f"{report['device']}  shape {shape}  ({report['run_kind']})")
    print(f"{'case':16s} {'ms':>10s} {'ratio':>7s} {'TFLOP/s':>8s} {'rel_l2':>10s} {'peak GiB':>9s}")
    for case, r in results.items():
        print(f"{case:16s} {r['ms']:10.2f} {r['ratio']:7.3f} {r['tflops']:8.1f} {r['rel_l2']:10.2e} {r['peak_gib']:9.2f}")
    if args.out is not None:
        write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
