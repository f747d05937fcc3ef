"""CUDA time per kernel of one VSA core call (pooling, selection, quantization, fine stage) at the MiniMax-H3 shape.

Uses the inputs of ``benchmarks/attention.py`` and torch.profiler (mean of 5 calls after 3 warm-ups) for bf16, FP8
and FP8 with FP8 P.V. Where the time of the VSA core goes is a lab record: it goes to ``docs/experiments/``.

    python benchmarks/attention_profile.py                            # -> docs/experiments/vsa_profile_latest.json
"""

from __future__ import annotations

import argparse

import torch

from diffusers_h3.attention_processors.vsa import vsa_attention

from _common import EXPERIMENTS, h3_inputs, require_cuda, result_header, write_json


def profile_vsa(q, k, v, plan, sparsity=0.8, warmup=3, calls=5):
    """``{case: {"total_ms", "kernels_ms": {kernel: ms}}}``: CUDA time per kernel of one VSA core call."""
    from torch.profiler import ProfilerActivity, profile

    result = {}
    for prec, pv in (("bf16", "bf16"), ("fp8", "bf16"), ("fp8", "fp8")):

        def fn(prec=prec, pv=pv):
            return vsa_attention(q, k, v, plan, sparsity=sparsity, precision=prec, pv_precision=pv)[0]

        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        rows = sorted(((e.key, e.device_time_total / (calls * 1e3)) for e in prof.key_averages()), key=lambda r: -r[1])
        name = f"vsa_{prec}{'pv8' if pv == 'fp8' else ''}_sp{sparsity}"
        result[name] = {"total_ms": round(sum(ms for _, ms in rows), 3),
                        "kernels_ms": {key[:90]: round(ms, 3) for key, ms in rows if ms > 0.01}}  # fmt: skip
        print(name, result[name]["total_ms"], "ms", flush=True)
        for key, ms in rows[:10]:
            print(f"   {ms:8.3f} ms  {key[:100]}", flush=True)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--commit", default=None, help="commit measured (when the tree has no .git)")
    parser.add_argument("--out", default=str(EXPERIMENTS / "vsa_profile_latest.json"))
    parser.add_argument("--heads", type=int, default=56)
    parser.add_argument("--sparsity", type=float, default=0.8)
    args = parser.parse_args(argv)
    require_cuda("benchmarks/attention_profile.py")

    _, plan, (q, k, v) = h3_inputs(args.heads)
    cases = profile_vsa(q, k, v, plan, sparsity=args.sparsity)
    result = {
        **result_header("vsa_profile", args.commit),
        "shape": {"rows": q.shape[1], "heads": q.shape[2], "head_dim": q.shape[3], "sparsity": args.sparsity},
        "what": "CUDA time per kernel of one VSA core call (torch.profiler, mean of 5 calls after 3 warm-ups)",
        "cases": cases,
    }
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
