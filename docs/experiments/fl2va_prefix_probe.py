"""Probe: what would it take for the fl2va forward to reach t2va's speed? Sparser video selection, sparse keyframes.

The fl2va forward (42,284 rows) is slower than t2va's (38,222 rows) because its 79 non-video ("prefix") tiles are
dense both ways under the FastH3 rule that the VSA processor follows: the prompt with 2,016 vision tokens, the two
1,008-row keyframes and the audio. This times the full-width `fastest` forward (FP8 GEMMs, VSA INT8, regional compile)
on the fl2va inputs under four tile rules, none of which the product runs:

* ``dense_prefix``        the product's rule (sparsity 0.8);
* ``dense_prefix_sp0.9``  FastVideo's 4-step recipe sparsity (0.9);
* ``sparse_keyframes``    the keyframe segments cut into 4x4x4 cubes and selected like target-video tiles (0.8);
* ``sparse_keyframes_sp0.9`` both.

Each row records the median forward, the attended tile pairs per head, and the output's rel-L2 against the product
rule's output (random weights: a measure of how far the rule moves the output, not of video quality). Run from the
repository root:  PYTHONPATH=.:benchmarks python docs/experiments/fl2va_prefix_probe.py OUT.json [--tiny] [COMMIT]
"""

import dataclasses
import json
import sys
import time

import torch

from diffusers_h3 import use_packed_layout
from diffusers_h3.attention_processors import enable_vsa, tiling
from diffusers_h3.kernels.attention.vsa_select import topk_for_sparsity


# The product's rule first (the reference), then the one expected to gain most.
RULES = {"dense_prefix": (0.8, False), "sparse_keyframes_sp0.9": (0.9, True), "sparse_keyframes": (0.8, True),
         "dense_prefix_sp0.9": (0.9, False)}  # fmt: skip
PRODUCT_PLAN = tiling.build_tile_plan


def plan_with_sparse_keyframes(layout, tile=(4, 4, 4), device=None):
    """The product's plan of a layout whose keyframe segments are tiled and selected as target video."""
    segments = tuple(dataclasses.replace(s, role="target") if s.kind == "video" else s for s in layout.segments)
    return PRODUCT_PLAN(dataclasses.replace(layout, segments=segments), tile, device=device)


def tile_pairs(plan, sparsity):
    """Attended (query tile, key tile) pairs per head: prefix query tiles see every tile, video query tiles every
    prefix tile plus the top-k video tiles."""
    topk = topk_for_sparsity(sparsity, plan.num_video_tiles)
    return plan.num_prefix_tiles * plan.num_tiles + plan.num_video_tiles * (plan.num_prefix_tiles + topk)


def main(out_path, tiny, commit):
    if tiny:
        sys.argv = sys.argv[:1]
        from forward import build_fl2va_inputs, build_tiny

        device = torch.device("cpu")
        model, _, _, _ = build_tiny(device, None, task="fl2va")
        kwargs, layout, _ = build_fl2va_inputs(device, None, True)
    else:
        from end_to_end import build_inputs, build_model

        from diffusers_h3.pipelines.speed_presets import enable_speed_preset_on_transformer

        device = torch.device("cuda")
        model = build_model(device, 50)
        kwargs, layout = build_inputs(device, 50, task="fl2va")
        enable_speed_preset_on_transformer(model, "fastest")  # compiles on CUDA

    def forward():
        with torch.inference_mode(), use_packed_layout(layout):
            return model(**kwargs)[0].float()

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize()

    results, reference = {}, None
    for name, (sparsity, sparse_keyframes) in RULES.items():
        tiling.build_tile_plan = plan_with_sparse_keyframes if sparse_keyframes else PRODUCT_PLAN
        enable_vsa(model, sparsity=sparsity, precision="int8")  # fresh processors: an empty plan cache
        if not tiny:
            torch._dynamo.reset()  # the compiled blocks trace again with these processors
        plan = tiling.build_tile_plan(layout, (4, 4, 4))
        out = None
        for _ in range(2):  # the first call compiles again (new processors)
            out = forward()
        times = []
        for _ in range(1 if tiny else 2):
            synchronize()
            start = time.perf_counter()
            out = forward()
            synchronize()
            times.append((time.perf_counter() - start) * 1000)
        if reference is None:
            reference = out
        results[name] = {
            "sparsity": sparsity,
            "keyframes": "sparse (selected like target video)" if sparse_keyframes else "dense prefix",
            "plan": plan.describe(),
            "tile_pairs_per_head": tile_pairs(plan, sparsity),
            "forward_ms": round(sorted(times)[len(times) // 2], 1),
            "times_ms": [round(t, 1) for t in times],
            "rel_l2_vs_dense_prefix": round(float((out - reference).norm() / reference.norm()), 4),
        }
        print(name, results[name], flush=True)
        write(out_path, device, layout, tiny, commit, results)  # after every rule: a run cut short keeps what it measured
    tiling.build_tile_plan = PRODUCT_PLAN


def write(out_path, device, layout, tiny, commit, results):
    record = {
        "probe": "docs/experiments/fl2va_prefix_probe.py",
        "commit": commit,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "shape": {"rows": int(layout.seq_len), "layout": str(layout)[:400], "tiny": tiny},
        "model": "fastest preset (FP8 GEMMs, regional compile); VSA INT8 Q/K under each tile rule; random weights",
        "rules": results,
    }
    with open(out_path, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    extra = sys.argv[2:]
    main(sys.argv[1], "--tiny" in extra, next((a for a in extra if a != "--tiny"), None))
