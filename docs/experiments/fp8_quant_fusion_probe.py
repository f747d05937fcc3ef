"""Probe: does regional compile fuse FP8 per-token activation quantization into the preceding norm / modulation /
SwiGLU kernels better than our separate Triton quantization kernel?

Times the full-width fastest forward (FP8 GEMMs + VSA 0.8 INT8 Q/K, regional compile) twice in one process:
``triton_quant`` (the shipped path: ``fp8_linear`` is opaque to torch.compile, quantization is our Triton kernel) and
``inductor_quant`` (the same math written in torch ops + ``torch._scaled_mm``, visible to inductor, which may fuse
the quantization with what precedes it). Run from the repository root:
    PYTHONPATH=.:benchmarks python docs/experiments/fp8_quant_fusion_probe.py OUT.json
"""

import json
import sys

import torch
from end_to_end import build_inputs, build_model

import diffusers_h3.quantizers.layers as layers
from diffusers_h3 import use_packed_layout
from diffusers_h3.attention_processors import enable_vsa
from diffusers_h3.kernels.gemm.fp8 import fp8_linear_scaled_mm
from diffusers_h3.quantizers import FP8Config, quantize

from _common import profile_forward


shipped_fp8_linear = layers.fp8_linear


def traceable_fp8_linear(x, wq, w_scale, bias=None, backend="auto", use_fast_accum=True):
    # The shipped path without its compile barrier, with the quantization in torch ops (the reference).
    return fp8_linear_scaled_mm(x, wq, w_scale, bias, use_fast_accum, quant_backend="torch")


def main(out_path):
    device = torch.device("cuda")
    model = build_model(device, 50)
    kwargs, layout = build_inputs(device, 50)
    quantize(model, FP8Config())
    enable_vsa(model, sparsity=0.8, precision="int8")

    def forward():
        with torch.inference_mode(), use_packed_layout(layout):
            return model(**kwargs)[0]

    results, outputs = {}, {}
    for label, linear in (("triton_quant", shipped_fp8_linear), ("inductor_quant", traceable_fp8_linear)):
        torch._dynamo.reset()
        layers.fp8_linear = linear
        model.compile_repeated_blocks(fullgraph=False)
        forward(), forward()
        times = []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            outputs[label] = forward().float()
            end.record()
            torch.cuda.synchronize()
            times.append(round(start.elapsed_time(end), 1))
        results[label] = {"ms": times, "profile": profile_forward(forward, device, top=10)}
        if label != "triton_quant":
            ref = outputs["triton_quant"]
            results[label]["rel_l2_vs_triton_quant"] = ((outputs[label] - ref).norm() / ref.norm()).item()
        print(label, times, flush=True)
        json.dump(results, open(out_path, "w"), indent=1)
    layers.fp8_linear = shipped_fp8_linear


if __name__ == "__main__":
    main(sys.argv[1])
