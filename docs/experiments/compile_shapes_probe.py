"""Probe: does the regional-compiled fastest forward slow down once the blocks recompile for a second timestep count?

The pipeline's step 0 packs one distinct timestep (video and audio start at the same sigma), later steps two; the
blocks meet a second shape at step 1 and torch.compile's automatic dynamic shapes recompile them with a symbolic
dimension. This times the full-width forward (FP8 GEMMs + VSA 0.8 INT8, regional compile) with 2 timesteps on the
static graph, then with 1 timestep (recompile), then with 2 again (now the dynamic graph), and profiles each kernel
family. Run from the repository root:  PYTHONPATH=.:benchmarks python docs/experiments/compile_shapes_probe.py OUT.json
"""

import json
import sys
import time

import torch
from end_to_end import build_inputs, build_model

from diffusers_h3 import use_packed_layout
from diffusers_h3.attention_processors import enable_vsa
from diffusers_h3.quantizers import FP8Config, quantize

from _common import profile_forward


def main(out_path, dynamic):
    device = torch.device("cuda")
    model = build_model(device, 50)
    kwargs, layout = build_inputs(device, 50)
    quantize(model, FP8Config())
    enable_vsa(model, sparsity=0.8, precision="int8")
    model.compile_repeated_blocks(fullgraph=False, dynamic=dynamic)
    one = dict(kwargs, timestep=kwargs["timestep"][:1], timestep_indices=torch.zeros_like(kwargs["timestep_indices"]))

    def forward(inputs):
        with torch.inference_mode(), use_packed_layout(layout):
            return model(**inputs)[0]

    def timed(inputs, reps=3):
        times = []
        for _ in range(reps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            forward(inputs)
            torch.cuda.synchronize()
            times.append(round((time.perf_counter() - start) * 1e3, 1))
        return times

    results = {"dynamic": dynamic}
    for label, inputs in (
        ("two_timesteps_first_graph", kwargs),
        ("one_timestep_after_recompile", one),
        ("two_timesteps_again", kwargs),
    ):
        torch.cuda.synchronize()
        start = time.perf_counter()
        forward(inputs)
        torch.cuda.synchronize()
        first = round(time.perf_counter() - start, 1)
        results[label] = {
            "first_call_s": first,
            "ms": timed(inputs),
            "profile": profile_forward(lambda: forward(inputs), device, top=8),
        }
        print(label, results[label]["first_call_s"], results[label]["ms"], flush=True)
        json.dump(results, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1], None if len(sys.argv) < 3 else {"true": True, "false": False}[sys.argv[2]])
