"""Probe (GPU): how fast can the video decoder's GEMMs run, in bf16, FP8 and INT8, at the batched-decode shapes?

The batched decode runs the 36-layer decoder on 28 tiles (one chunk, 28 x 1,810 = 50,680 rows) per call, 7 calls at
768x1344x124. Each layer has four 2048x2048 projections (q, k, v, out) and a SwiGLU MLP (2048->8192 twice, 8192->2048).
This times each product alone on random operands (CUDA events, median of 10 after warm-up): bf16 ``torch.mm``, FP8
E4M3 ``torch._scaled_mm`` with per-row / per-column scales, INT8 ``torch._int_mm`` (int32 output, the rescale not
counted), and sums them to the decode's GEMM time: a lower bound for that format's decode, before attention,
norms, activation quantization and the rescale.

    PYTHONPATH=.:benchmarks python docs/experiments/vae_gemm_rates_probe.py OUT.json
"""

import json
import sys

import torch

from _common import cuda_median_ms


ROWS = 28 * 1810
CALLS, LAYERS = 7, 36
REPS = 10
SHAPES = {"qkvo_2048x2048": (2048, 2048, 4), "mlp_in_2048x8192": (2048, 8192, 2), "mlp_out_8192x2048": (8192, 2048, 1)}


def main(out):
    torch.manual_seed(0)
    dev = "cuda"
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": ROWS, "shapes": {}}
    totals = {"bf16": 0.0, "fp8": 0.0, "int8": 0.0}
    for name, (k, n, count) in SHAPES.items():
        a = torch.randn(ROWS, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
        a8, w8 = a.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
        sa = torch.ones(ROWS, 1, device=dev)
        sw = torch.ones(1, n, device=dev)
        ai, wi = a.clamp(-127, 127).to(torch.int8), (w * 100).clamp(-127, 127).to(torch.int8)
        times = {
            "bf16": cuda_median_ms(lambda: torch.mm(a, w.t()), reps=REPS),
            "fp8": cuda_median_ms(lambda: torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16), reps=REPS),
            "int8": cuda_median_ms(lambda: torch._int_mm(ai, wi.t()), reps=REPS),
        }
        flop = 2 * ROWS * k * n
        result["shapes"][name] = {
            "k": k, "n": n, "per_layer": count,
            **{f"{fmt}_ms": round(ms, 4) for fmt, ms in times.items()},
            **{f"{fmt}_tflops": round(flop / ms / 1e9, 1) for fmt, ms in times.items()},
        }  # fmt: skip
        for fmt, ms in times.items():
            totals[fmt] += ms * count * LAYERS * CALLS
    result["decode_gemm_s"] = {fmt: round(ms / 1000, 3) for fmt, ms in totals.items()}
    print(json.dumps(result, indent=1))
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
