"""Tuning sweep of the attention fine kernels at the MiniMax-H3 shape (the inputs of ``benchmarks/attention.py``).

Times explicit kernel variants (no autotuning) passed through ``TuningOptions``: the VSA fine stage at sparsity 0.8 in
bf16 / FP8 / FP8 with FP8 P.V, and dense mode on all rows, for the portable Triton kernel and the Hopper kernel. The
result is a lab record, not a product number: it goes to ``docs/experiments/`` (see docs/experiments/attention_kernels.md
for what earlier sweeps found), and a variant that beats the router's default is a reason to change the default.

    python benchmarks/attention_sweep.py                              # -> docs/experiments/attention_sweep_latest.json
    python benchmarks/attention_sweep.py --only fp8,dense --out /tmp/sweep.json
"""

from __future__ import annotations

import argparse
from typing import Dict, NamedTuple, Optional

from diffusers_h3.kernels.attention import TuningOptions, block_sparse_attention, fp8_attention
from diffusers_h3.kernels.attention.vsa_pool import tile_pool, tile_quantize_fp8
from diffusers_h3.kernels.attention.vsa_select import mask_to_index
from diffusers_h3.kernels.numerics import quantize_fp8_per_channel

from _common import EXPERIMENTS, cuda_median_ms, h3_inputs, require_cuda, result_header, selection, write_json


class Variant(NamedTuple):
    kernel: str  # "triton": the portable Triton kernel; "sm90": the Hopper kernel (its warps follow block_m)
    precision: str  # "bf16" / "fp8" / "fp8pv8": VSA fine stage at sparsity 0.8; "dense_*": dense mode on all rows
    rotate: Optional[bool]
    num_warps: Optional[int]
    num_stages: int
    block_m: int
    block_n: int

    @property
    def name(self) -> str:
        if self.kernel == "sm90":
            return f"{self.precision}_sm90_s{self.num_stages}_m{self.block_m}_n{self.block_n}"
        return f"{self.precision}_r{int(self.rotate)}_w{self.num_warps}_s{self.num_stages}_m{self.block_m}_n{self.block_n}"

    def tuning(self) -> TuningOptions:
        dense = self.precision.startswith("dense")
        return TuningOptions(kernel=self.kernel, num_warps=self.num_warps, num_stages=self.num_stages,
                             rotate=self.rotate, block_m=self.block_m if dense else None)  # fmt: skip


VARIANTS = [
    *[Variant("triton", "bf16", True, 4, st, 64, 64) for st in (2, 3)],
    *[Variant("sm90", "bf16", None, None, st, 64, 64) for st in (2, 3)],
    *[Variant("triton", "fp8", True, 4, st, 64, 64) for st in (2, 3)],
    *[Variant("sm90", "fp8", None, None, st, 64, 64) for st in (2, 3)],
    Variant("triton", "fp8pv8", True, 4, 3, 64, 64),
    *[Variant("sm90", "fp8pv8", None, None, st, 64, 64) for st in (2, 3)],
    Variant("triton", "dense_fp8", False, 8, 3, 128, 64),
    *[Variant("sm90", "dense_fp8", None, None, st, bm, bn) for st, bm, bn in ((3, 64, 64), (3, 128, 64),
                                                                            (2, 128, 128), (3, 128, 128))],
    *[Variant("sm90", "dense_fp8pv8", None, None, st, 128, bn) for st, bn in ((3, 64), (3, 128), (4, 128))],
    Variant("triton", "dense_bf16", False, 8, 3, 128, 64),
    *[Variant("sm90", "dense_bf16", None, None, st, 128, bn) for st, bn in ((3, 64), (2, 128))],
]


def variant_calls(q, k, v, plan):
    """``{precision: fn(variant) -> output}`` on the prepared inputs of each precision (prepared once, untimed)."""
    rows = (plan.slot_rows, plan.tile_counts, plan.block)
    index, num = mask_to_index(selection(q, k, plan, 0.8))
    pk, kp = tile_pool(k, *rows, packed=True)
    _, vp = tile_pool(v, *rows, pooled=False, packed=True)
    _, q8, qs = tile_quantize_fp8(q, *rows)
    counts = plan.tile_counts.float()
    mean = (pk * counts[:, None]).sum(2) / counts.sum()
    _, k8, ks = tile_quantize_fp8(k, *rows, packed=True, subtract=mean, per_tile=True)
    v8, vs = quantize_fp8_per_channel(vp, seq_dim=1)
    v8t = v8.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    lists = (plan.slot_rows, plan.tile_counts, index, num)
    return {
        "bf16": lambda var: block_sparse_attention(q, kp, vp, *lists, block=64, tuning=var.tuning()),
        "fp8": lambda var: block_sparse_attention(q8, k8, vp, *lists, block=64, q_scale=qs, k_scale=ks,
                                                  tuning=var.tuning()),  # fmt: skip
        "fp8pv8": lambda var: block_sparse_attention(q8, k8, v8t, *lists, block=64, q_scale=qs, k_scale=ks,
                                                     v_scale=vs, tuning=var.tuning()),  # fmt: skip
        "dense_fp8": lambda var: fp8_attention(q, k, v, block_n=var.block_n, tuning=var.tuning()),
        "dense_fp8pv8": lambda var: fp8_attention(q, k, v, pv_fp8=True, block_n=var.block_n, tuning=var.tuning()),
        "dense_bf16": lambda var: block_sparse_attention(q, k, v, None, None, None, None, block=var.block_n, dense=True,
                                                         tuning=var.tuning()),  # fmt: skip
    }


def sweep(q, k, v, plan, reps=5, only=None, on_result=None) -> Dict[str, dict]:
    """Time every :data:`VARIANTS` entry whose name contains one of the comma-separated ``only`` fragments."""
    calls = variant_calls(q, k, v, plan)
    results = {}
    for var in VARIANTS:
        if only and not any(part in var.name for part in only.split(",")):
            continue
        entry = var._asdict()
        try:
            entry["ms"] = round(cuda_median_ms(lambda var=var: calls[var.precision](var), warmup=2, reps=reps), 3)
        except Exception as error:  # noqa: BLE001 - a variant the compiler rejects is recorded, not fatal
            entry["ms"] = None
            entry["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        results[var.name] = entry
        print(f"{var.name:32s} {entry['ms']} ms {entry.get('error', '')}", flush=True)
        if on_result is not None:
            on_result(results)
    return results


def fastest(results: Dict[str, dict]) -> Dict[str, str]:
    """The fastest variant name per precision."""
    best = {}
    for name, entry in results.items():
        if entry.get("ms") is not None:
            current = best.get(entry["precision"])
            if current is None or entry["ms"] < results[current]["ms"]:
                best[entry["precision"]] = name
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--commit", default=None, help="commit measured (when the tree has no .git)")
    parser.add_argument("--out", default=str(EXPERIMENTS / "attention_sweep_latest.json"),
                        help="JSON written after every variant (default: docs/experiments/attention_sweep_latest.json)")  # fmt: skip
    parser.add_argument("--heads", type=int, default=56)
    parser.add_argument("--reps", type=int, default=5, help="timed runs per variant (the median is recorded)")
    parser.add_argument("--only", default=None, help="comma list of name fragments: time only the matching variants")
    args = parser.parse_args(argv)
    require_cuda("benchmarks/attention_sweep.py")

    layout, plan, (q, k, v) = h3_inputs(args.heads)
    header = {
        **result_header("attention_sweep", args.commit),
        "shape": {"rows": q.shape[1], "heads": q.shape[2], "head_dim": q.shape[3], "sparsity": 0.8,
                  "tiles": plan.describe()},  # fmt: skip
        "what": "fine-stage kernel variants (explicit TuningOptions, no autotuning), median ms of CUDA-event timings",
    }

    def save(results):
        write_json(args.out, {**header, "variants": results, "fastest": fastest(results)})

    results = sweep(q, k, v, plan, reps=args.reps, only=args.only, on_result=save)
    print("fastest per precision:", fastest(results))
    return results


if __name__ == "__main__":
    main()
