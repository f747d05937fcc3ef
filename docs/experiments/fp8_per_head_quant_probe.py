"""Probe (GPU): what FA3 FP8's per-head operand quantization costs at the H3 shape, and where the time goes.

FlashInfer's FA3 FP8 kernel takes 49.0 ms at 38,222 rows x 56 heads x 128 on an H200; this package's FP8 path adds the
quantization of Q, V (per-head amax) and K (mean-centred, then per-head amax). Times (``cuda_median_ms``: CUDA events,
median of 20) the torch reference and the Triton path (``kernels/attention/fp8_per_head.py``) for each operand, and
the Triton path's parts: the channel max/min pass, torch's fp32 mean (K only) and the quantization pass.

    PYTHONPATH=.:benchmarks python docs/experiments/fp8_per_head_quant_probe.py OUT.json
"""

import json
import sys

import torch

from _common import cuda_median_ms


def timed(fn):
    return round(cuda_median_ms(fn, reps=20), 3)


def main(out):
    from diffusers_h3.kernels.attention import fp8_per_head as m

    torch.manual_seed(0)
    x = torch.randn(1, 38222, 56, 128, device="cuda", dtype=torch.bfloat16)
    hi, lo = m._channel_range(x)
    scale = torch.maximum(hi, lo.neg()).amax(-1) / 448
    result = {"shape": list(x.shape), "device": torch.cuda.get_device_name(), "ms": {
        "reference_q": timed(lambda: m.quantize_fp8_per_head_reference(x)),
        "reference_k_centred": timed(lambda: m.quantize_fp8_per_head_reference(x, center=True)),
        "triton_q": timed(lambda: m.quantize_fp8_per_head(x)),
        "triton_k_centred": timed(lambda: m.quantize_fp8_per_head(x, center=True)),
        "part_channel_range": timed(lambda: m._channel_range(x)),
        "part_fp32_mean": timed(lambda: x.mean(1, dtype=torch.float32)),
        "part_torch_amax_amin": timed(lambda: (x.amax(dim=1), x.amin(dim=1))),
        "part_quantize_pass": timed(lambda: m._quantize_per_head_kernel[(597, 56)](
            x, hi, scale, torch.empty(x.shape, device="cuda", dtype=torch.float8_e4m3fn), 38222, 56, *x.stride()[:3],
            *x.stride()[:3], D=128, BLOCK_N=64, CENTER=False, SOFT_ROUND=False)),
    }}  # fmt: skip
    result["ms"]["triton_qkv_total"] = round(2 * result["ms"]["triton_q"] + result["ms"]["triton_k_centred"], 3)
    print(json.dumps(result, indent=1))
    with open(out, "w") as handle:
        json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
