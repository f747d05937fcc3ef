"""A/B of the Hopper kernel's copy schedules on the VSA fine stage at the H3 shape (one process, alternating rounds).

``ring``: the one-tile program requests K and V of tile ``j + STAGES - 1`` together at the top of step ``j``;
``split``: K of tile ``j + 1 + STAGES`` right after ``S_{j+1}`` and V of tile ``j + STAGES`` right after ``P_j V_j``
(every slot prefetches, so two slots suffice and a 168-register cap fits three programs per multiprocessor);
``two``: two query tiles per program with a producer warp (the 16-bit default). Fine stage alone, sparsity 0.8,
the benchmark's inputs (``attention.h3_inputs``); median of ``--reps`` CUDA-event runs per round.

    python benchmarks/attention_schedule.py --rounds 2 --out benchmarks/results/attention_schedule_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from attention import fine_stage_inputs, h3_inputs  # noqa: E402

from diffusers_h3.kernels.block_sparse_attention_sm90 import block_sparse_attention_sm90  # noqa: E402
from diffusers_h3.testing.benchmarking import cuda_median_ms, git_commit  # noqa: E402

# (precision, schedule, stages, maxnreg)
VARIANTS = [
    ("bf16", "two", 3, None), ("bf16", "ring", 3, None), ("bf16", "split", 3, None), ("bf16", "split", 2, None),
    ("fp8", "ring", 3, None), ("fp8", "split", 3, None), ("fp8", "split", 2, None), ("fp8", "split", 2, 168),
    ("fp8", "split", 3, 168),
    ("int8", "ring", 3, None), ("int8", "split", 3, None), ("int8", "split", 2, 168), ("int8", "split", 3, 168),
    ("fp8pv8", "ring", 3, None), ("fp8pv8", "split", 3, None), ("fp8pv8", "split", 2, 168),
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--heads", type=int, default=56)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    layout, plan, (q, k, v) = h3_inputs(args.heads)
    fp8 = fine_stage_inputs(q, k, v, plan)
    int8 = fine_stage_inputs(q, k, v, plan, qk_dtype=torch.int8)
    index, num, kp, vp = fp8[:4]
    operands = {
        "bf16": (q, kp, vp, {}),
        "fp8": (fp8[4], fp8[6], vp, dict(q_scale=fp8[5], k_scale=fp8[7])),
        "int8": (int8[4], int8[6], vp, dict(q_scale=int8[5], k_scale=int8[7])),
        "fp8pv8": (fp8[4], fp8[6], fp8[8], dict(q_scale=fp8[5], k_scale=fp8[7], v_scale=fp8[9])),
    }
    outs, times = {}, {}
    for rnd in range(args.rounds):
        for prec, schedule, stages, maxnreg in VARIANTS:
            name = f"{prec}_{schedule}_s{stages}" + (f"_r{maxnreg}" if maxnreg else "")
            qq, kk, vv, kw = operands[prec]
            out = torch.empty(q.shape, device=q.device, dtype=torch.bfloat16)

            def fn():
                return block_sparse_attention_sm90(
                    qq, kk, vv, plan.slot_rows, plan.tile_counts, index, num, out, block=64, scale=128 ** -0.5,
                    stages=stages, two_tiles=schedule == "two", split_issue=schedule == "split", maxnreg=maxnreg,
                    **kw)
            try:
                ms = cuda_median_ms(fn, warmup=2, reps=args.reps)
            except Exception as error:  # noqa: BLE001 - a variant that fails to compile is recorded, not fatal
                times.setdefault(name, []).append(None)
                print(f"{name:24s} FAILED {type(error).__name__}: {str(error)[:200]}", flush=True)
                continue
            times.setdefault(name, []).append(round(ms, 3))
            if rnd == 0:
                outs[name] = out.clone()
            print(f"round {rnd} {name:24s} {ms:8.3f} ms", flush=True)
    cases = {}
    for name, ts in times.items():
        prec = name.split("_")[0]
        base = f"{prec}_ring_s3"
        ok = [t for t in ts if t]
        base_ok = [t for t in times.get(base, []) if t]
        cases[name] = {
            "ms": min(ok) if ok else None, "rounds_ms": ts, "baseline": base,
            "ratio": round(min(base_ok) / min(ok), 3) if ok and base_ok else None,
            "bitwise_equal_to_baseline": bool(torch.equal(outs[name], outs[base])) if name in outs and base in outs
            else None,
        }
    for name, c in cases.items():
        print(f"{name:24s} {c['ms']} ms  x{c['ratio']} vs {c['baseline']}  equal={c['bitwise_equal_to_baseline']}")
    result = {
        "suite": "attention_schedule", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": __import__("triton").__version__, "commit": git_commit(args.commit),
        "date": datetime.date.today().isoformat(),
        "command": "python3 benchmarks/attention_schedule.py " + " ".join(argv or sys.argv[1:]),
        "shape": {"rows": plan.seq_len, "heads": args.heads, "head_dim": 128, "sparsity": 0.8},
        "what": __doc__.split("\n\n")[1].replace("\n", " "),
        "cases": cases,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
