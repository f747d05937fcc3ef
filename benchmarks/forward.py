"""The full MiniMax-H3 DiT forward at 768x1344x124 on one GPU for the speed presets, with a kernel-time breakdown.

    PYTHONPATH=. python benchmarks/forward.py --out benchmarks/results/forward_h200.json --profile fastest
    python benchmarks/forward.py --tiny --out /tmp/forward_tiny.json     # CPU smoke test (tests/test_benchmark_forward.py)

The model and inputs are benchmarks/end_to_end.py's (imported, not copied): a full-width 50-block H3 DiT with random
bf16 weights (fp32 modules kept fp32) and the real packed t2va layout (512 text + 414 audio + 37x24x42 video = 38,222
rows) published as a PackedLayout. Cases, in this order (``fast`` / ``fastest`` quantize the weights in place):

* ``native``   diffusers' ``MiniMaxH3AttnProcessor`` with the ``_native_cudnn`` backend, eager: the baseline, and its
               output is the reference of ``rel_l2``;
* ``exact``    ``enable_speed_preset_on_transformer`` with ``SpeedPresetConfig("exact", flashinfer=False)``: bf16, cuDNN,
               regional compile (the preset without flashinfer-python);
* ``exact_flashinfer``  (only when asked for in ``--cases``; needs flashinfer-python) the preset with
               ``flashinfer=True``: FlashInfer's dense kernel (FA3 on Hopper) in place of cuDNN (the preset's
               default on Hopper when flashinfer-python is installed);
* ``fast``     the ``"fast"`` preset: FP8 GEMMs, dense INT8 Q/K attention, regional compile;
* ``fast_flashinfer_fp8``  (only when asked for; needs flashinfer-python on Hopper) the ``"fast"`` preset with
               ``flashinfer=True``: FA3's FP8 attention kernel (E4M3 Q/K/V, one scale per head, K mean-centred; FP8
               P.V) in place of the INT8 attention;
* ``fastest``  the ``"fastest"`` preset: ``fast`` + VSA at sparsity 0.8, regional compile.

The presets are applied to the transformer alone (``diffusers_h3.pipelines.speed_presets``'s per-transformer part of
``enable_speed_preset``). Compilation across presets: ``exact`` compiles the blocks (``compile_repeated_blocks``); the
later presets find them compiled and keep the compiled wrappers ("blocks already compiled: kept"). Dynamo's guards
would re-trace the blocks for the swapped processors and quantized linears on their own, but every preset case here
starts with ``torch._dynamo.reset()``: the cache is empty, nothing stale can run and no re-trace is lost to
``recompile_limit``, so the first call traces (and inductor compiles) the blocks with that preset's processors and
quantized weights. Per case ``dynamo`` records the graphs traced and graph breaks during the warm-up with
their reasons (``graph_break_reasons``; the kernels are ``torch.library`` custom ops, so the presets' blocks should
trace as one graph each: 0 breaks), and whether anything was (re)compiled during the timed forwards (it should not).
``--fullgraph`` compiles the blocks with ``compile_repeated_blocks(fullgraph=True)`` (a graph break fails the case).

Per case: ``--warmup`` (2) untimed forwards (the first one compiles / autotunes: ``first_call_s``), then ``--reps``
CUDA-event timed forwards. ``ms`` = their median; ``ratio`` = native ms / ms; ``rel_l2`` = ||out - native|| / ||native||
on the video output (``rel_l2_audio`` on the audio output; random weights: numerical distance, not quality);
``peak_gib`` = peak allocated GPU memory during the timed forwards (weights included), ``resident_gib`` = allocated
before them; ``preset`` = the preset record's ``describe()``; ``paths`` = ``diffusers_h3.describe(model)``'s attention
and quantized-layer paths. The partial JSON is written after every case.

``--profile CASES`` (``--profile`` alone: ``fastest``) runs ``torch.profiler`` over one more forward of those cases and
records the CUDA kernel time by category (``kernel_category``: gemm, attention, inductor_fused, quantization, other;
ms, % and kernel launches each) and the top-15 kernels; ``kernel_ms`` / ``ms`` is how busy the GPU is in a forward.
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from _common import profile_forward, rel_l2, result_header, synchronize, write_json


CASES = ("native", "exact", "exact_flashinfer", "fast", "fast_flashinfer_fp8", "fastest")
DEFAULT_CASES = ("native", "exact", "fast", "fastest")  # the *_flashinfer* cases need flashinfer-python
PRESET_OF = {"native": None, "exact": "exact", "exact_flashinfer": "exact", "fast": "fast",
             "fast_flashinfer_fp8": "fast", "fastest": "fastest"}  # fmt: skip
TINY_SHAPE = {"height": 64, "width": 96}  # frames: the tiny pipeline's shortest clip (TINY_NUM_FRAMES)

# ---------------------------------------------------------------------------------------------------------------------
# Model, inputs, measurement


def build(device: torch.device, layers: Optional[int], tiny: bool, build_dtype: torch.dtype = torch.float32):
    """``(model, forward kwargs, PackedLayout, shape)``: end_to_end.py's full-width DiT (``layers`` blocks, default 50)
    and t2va inputs, or with ``tiny`` the tiny pipeline's transformer (its 2 blocks unless ``layers``) and the kwargs /
    layout of its first forward in a 64x96x22 t2va call."""
    if not tiny:
        layers = layers or 50
        from end_to_end import HEIGHT, NUM_FRAMES, TEXT_ROWS, WIDTH, build_inputs, build_model

        model = build_model(device, layers, build_dtype)
        kwargs, layout = build_inputs(device, layers)
        shape = {"layers": layers, "rows": int(layout.seq_len), "text": TEXT_ROWS, "frames": NUM_FRAMES,
                 "height": HEIGHT, "width": WIDTH, "heads": 56, "head_dim": 128, "tiny": False}  # fmt: skip
        return model, kwargs, layout, shape
    return build_tiny(device, layers)


def build_fl2va_inputs(device: torch.device, layers: Optional[int], tiny: bool):
    """``(forward kwargs, PackedLayout, rows)`` of the fl2va forward: end_to_end.py's 768x1344x124 fl2va inputs
    (42,284 rows), or with ``tiny`` the tiny pipeline's first forward of a 64x96x22 fl2va call."""
    if not tiny:
        from end_to_end import build_inputs

        kwargs, layout = build_inputs(device, layers or 50, task="fl2va")
        return kwargs, layout, int(layout.seq_len)
    _, kwargs, layout, shape = build_tiny(device, layers, task="fl2va")
    return kwargs, layout, shape["rows"]


def build_tiny(device: torch.device, layers: Optional[int], task: str = "t2va"):
    """The tiny pipeline's transformer and the kwargs / layout of its first forward in a 64x96x22 ``task`` call."""
    import numpy as np
    from PIL import Image

    from diffusers_h3.layout import current_packed_layout
    from diffusers_h3.testing.tiny import TINY_NUM_FRAMES, tiny_pipeline, tiny_transformer

    pipe = tiny_pipeline(seed=0, with_transformer_ref=False)
    if layers is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            pipe.transformer = tiny_transformer(num_layers=layers)
    pipe.set_progress_bar_config(disable=True)
    captured: Dict[str, Any] = {}

    def grab(module, args, kwargs):
        if not captured:  # the pipeline steps its latents in place after the call: keep copies
            captured["kwargs"] = {k: v.clone() if torch.is_tensor(v) else v for k, v in kwargs.items()}
            captured["layout"] = current_packed_layout()

    handle = pipe.transformer.register_forward_pre_hook(grab, with_kwargs=True)
    images = {}
    if task == "fl2va":
        rng = np.random.default_rng(0)
        size = (TINY_SHAPE["height"], TINY_SHAPE["width"], 3)
        images = {"image": Image.fromarray(rng.integers(0, 256, size, dtype=np.uint8)),
                  "last_image": Image.fromarray(rng.integers(0, 256, size, dtype=np.uint8))}  # fmt: skip
    try:
        pipe(prompt="a street drummer under neon lights", height=TINY_SHAPE["height"], width=TINY_SHAPE["width"],
             num_frames=TINY_NUM_FRAMES, num_inference_steps=2, output_type="latent",
             generator=torch.Generator().manual_seed(0), **images)  # fmt: skip
    finally:
        handle.remove()
    model = pipe.transformer.to(device).eval().requires_grad_(False)
    kwargs, layout = captured["kwargs"], captured["layout"]
    kwargs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in kwargs.items()}
    shape = {"layers": len(model.transformer_blocks), "rows": int(layout.seq_len), **TINY_SHAPE, "frames": TINY_NUM_FRAMES, "tiny": True}
    return model, kwargs, layout, shape


def dynamo_counts() -> Tuple[int, int]:
    """(graphs traced, graph breaks) so far in this process (torch._dynamo.utils.counters; reset() keeps them)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0)), int(sum(counters["graph_break"].values()))


def graph_break_reasons() -> Dict[str, int]:
    """Graph breaks so far in this process by reason (torch._dynamo.utils.counters["graph_break"])."""
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])


def new_graph_breaks(before: Dict[str, int], after: Dict[str, int], width: int = 300) -> Dict[str, int]:
    """The graph breaks counted between two :func:`graph_break_reasons` snapshots, by (shortened) reason."""
    new: Dict[str, int] = {}
    for reason, count in after.items():
        if count > before.get(reason, 0):
            key = " ".join(str(reason).split())[:width]
            new[key] = new.get(key, 0) + count - before.get(reason, 0)
    return new


def measure(run, device: torch.device, warmup: int, reps: int) -> Dict[str, Any]:
    """Warm-up calls (the first timed as ``first_call_s``), then ``reps`` timed calls; returns the record and the last
    output."""
    graphs0, breaks0 = dynamo_counts()
    reasons0 = graph_break_reasons()
    warmup_s = []
    out = None
    for _ in range(warmup):
        synchronize(device)
        start = time.perf_counter()
        out = run()
        synchronize(device)
        warmup_s.append(time.perf_counter() - start)
    graphs1, breaks1 = dynamo_counts()
    reasons1 = graph_break_reasons()
    del out
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    resident = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = run()
            b.record()
            torch.cuda.synchronize(device)
            times.append(a.elapsed_time(b))
        else:
            start = time.perf_counter()
            out = run()
            times.append((time.perf_counter() - start) * 1000)
    graphs2, _ = dynamo_counts()
    record = {
        "ms": round(statistics.median(times), 1 if device.type == "cuda" else 3),
        "times_ms": [round(t, 1 if device.type == "cuda" else 3) for t in times],
        "first_call_s": round(warmup_s[0], 2) if warmup_s else None,
        "warmup_s": [round(s, 2) for s in warmup_s],
        "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
        "resident_gib": round(resident, 2) if resident is not None else None,
        "dynamo": {
            "graphs_traced": graphs1 - graphs0,
            "graph_breaks": breaks1 - breaks0,
            "graph_break_reasons": new_graph_breaks(reasons0, reasons1),
            "recompiled_while_timed": graphs2 != graphs1,
        },  # fmt: skip
    }
    return record, out


def model_paths(model) -> Dict[str, Any]:
    import diffusers_h3

    info = diffusers_h3.describe(model).get("model", {})
    return {key: info[key] for key in ("attention", "quantized_layers") if key in info}


# ---------------------------------------------------------------------------------------------------------------------
# Cases


def set_up(
    case: str, model, device: torch.device, fullgraph: bool = False, static_shapes: bool = False
) -> Dict[str, Any]:
    """Turn ``case`` on; returns what it turned on (``fullgraph``: compile the blocks with fullgraph=True;
    ``static_shapes``: recompile them with ``dynamic=False``, a static graph per packed length)."""
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor

    from diffusers_h3.pipelines.speed_presets import (
        SpeedPresetConfig,
        attention_dtype,
        compile_blocks,
        enable_speed_preset_on_transformer,
        exact_attention_backend,
    )

    preset = PRESET_OF[case]
    if preset is None:
        model.set_attn_processor(MiniMaxH3AttnProcessor())
        backend = exact_attention_backend(device, attention_dtype(model))  # cuDNN for bf16 on SM80+; None: default
        if backend is not None:
            model.set_attention_backend(backend)
        return {"preset": None, "attention": f"diffusers MiniMaxH3AttnProcessor, backend {backend or 'default'}",
                "compile": "off (eager)"}  # fmt: skip
    # An empty Dynamo cache for every preset: the blocks compiled by an earlier preset keep their compiled wrappers,
    # which trace again on the next call with this preset's processors and quantized linears (see the docstring).
    torch._dynamo.reset()
    # On CPU (--tiny) the preset records regional compile as off (CUDA only) and quantizes to W8A16.
    # "exact" is measured with cuDNN (what it runs without flashinfer-python), "exact_flashinfer" with FlashInfer's FA3.
    # "fast_flashinfer_fp8" is the "fast" preset with flashinfer=True (FA3's FP8 attention in place of INT8).
    flashinfer = {"exact": False, "exact_flashinfer": True, "fast_flashinfer_fp8": True}.get(case)
    config = SpeedPresetConfig(preset, compile=True, flashinfer=flashinfer, fullgraph=fullgraph)
    record = enable_speed_preset_on_transformer(model, config)
    if static_shapes and device.type == "cuda":
        record.compile["transformer"] = compile_blocks(model, preset, fullgraph=fullgraph, dynamic=False)
    return record.describe()


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/forward_h200.json")
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES),
                        help=f"comma list, run in the order {', '.join(CASES)} (default: {', '.join(DEFAULT_CASES)})")
    parser.add_argument("--reps", type=int, default=3, help="timed forwards per case (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed forwards per case (the first compiles)")
    parser.add_argument(
        "--layers", type=int, default=None, help="transformer blocks (default: 50; with --tiny the tiny model's 2)"
    )
    parser.add_argument(
        "--profile",
        nargs="?",
        const="fastest",
        default="",
        metavar="CASES",
        help="comma list of cases to profile after their timing (--profile alone: fastest)",
    )
    parser.add_argument("--commit", default=None, help="commit measured (the device copy has no .git)")
    parser.add_argument("--build-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="dtype the random DiT is drawn in before its cast to bf16: float32 (default; the weights "
                             "of every committed result, 50 blocks need a 139 GB H200) or bfloat16 (other weights, half "
                             "the memory: 50 blocks fit an 80 GB H100; distances not comparable across the two)")
    parser.add_argument("--tiny", action="store_true", help="tiny model on the CPU, no compile (smoke test)")
    parser.add_argument("--fullgraph", action="store_true",
                        help="compile the presets' blocks with compile_repeated_blocks(fullgraph=True)")
    parser.add_argument("--tasks", default="t2va",
                        help="comma list of inputs each case runs, in this order, in the same process: t2va (38,222 "
                             "rows), fl2va (42,284 rows: two keyframes); the fl2va records are named CASE_fl2va")
    parser.add_argument("--static-shapes", action="store_true",
                        help="compile the presets' blocks with dynamic=False (a static graph per packed length) instead "
                             "of torch.compile's default the presets keep (an experiment: docs/speed.md, Compilation)")
    args = parser.parse_args(argv)
    tasks = [t for t in args.tasks.split(",") if t]
    if not tasks or set(tasks) - {"t2va", "fl2va"}:
        raise SystemExit(f"--tasks {args.tasks!r}: a comma list of t2va, fl2va")

    wanted = [c for c in args.cases.split(",") if c]
    profiled = [c for c in args.profile.split(",") if c]
    unknown = sorted(set(wanted + profiled) - set(CASES))
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}: choose from {', '.join(CASES)}")
    not_run = sorted(set(profiled) - set(wanted))
    if not_run:
        raise SystemExit(f"--profile {','.join(not_run)}: not in --cases ({','.join(wanted)})")
    if args.reps < 1 or args.warmup < 0 or (args.layers is not None and args.layers < 1):
        raise SystemExit("--reps and --layers must be at least 1, --warmup at least 0")
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("benchmarks/forward.py needs a CUDA GPU (or --tiny for the CPU smoke test)")
    device = torch.device("cpu" if args.tiny else "cuda")
    run_cases = [c for c in CASES if c in wanted]

    from diffusers_h3 import use_packed_layout

    started = time.perf_counter()
    torch.manual_seed(0)
    model, kwargs, layout, shape = build(device, args.layers, args.tiny, getattr(torch, args.build_dtype))
    shape["build_dtype"] = args.build_dtype
    inputs = {"t2va": (kwargs, layout)}
    if "fl2va" in tasks:
        fl2va_kwargs, fl2va_layout, fl2va_rows = build_fl2va_inputs(device, args.layers, args.tiny)
        inputs["fl2va"] = (fl2va_kwargs, fl2va_layout)
        shape["fl2va_rows"] = fl2va_rows
    build_s = time.perf_counter() - started
    print(
        f"built the model and inputs in {build_s:.1f} s ({shape['rows']} rows, {shape['layers']} blocks)", flush=True
    )

    def runner(task):
        task_kwargs, task_layout = inputs[task]

        def run():
            with torch.inference_mode(), use_packed_layout(task_layout):
                return model(**task_kwargs)

        return run

    results: Dict[str, Dict[str, Any]] = {}
    notes: Dict[str, str] = {}
    references: Dict[str, List[torch.Tensor]] = {}
    for case in run_cases:
        turned_on = None
        for task in tasks:  # the same compiled blocks meet each task's shapes in turn, as in one process's requests
            name = case if task == "t2va" else f"{case}_{task}"
            case_start = time.perf_counter()
            run = runner(task)
            try:
                if turned_on is None:
                    turned_on = set_up(case, model, device, args.fullgraph, args.static_shapes)
                record, out = measure(run, device, args.warmup, args.reps)
                video, audio = out[0], out[1]
                if case == "native":
                    references[task] = [video.float().clone(), audio.float().clone()]
                reference = references.get(task)
                record["rel_l2"] = rel_l2(video, reference[0]) if reference is not None else None
                record["rel_l2_audio"] = rel_l2(audio, reference[1]) if reference is not None else None
                del out, video, audio
                record["task"], record["rows"] = task, int(inputs[task][1].seq_len)
                record["preset"] = turned_on
                record["paths"] = model_paths(model)
                if case in profiled:
                    record["profile"] = profile_forward(run, device)
                    record["profile"]["kernel_ms_over_ms"] = round(record["profile"]["kernel_ms"] / record["ms"], 3)
            except Exception as error:  # noqa: BLE001 - one failing case must not lose the others
                record = {"ms": None, "rel_l2": None, "rel_l2_audio": None, "peak_gib": None}
                notes[name] = f"failed: {type(error).__name__}: {str(error)[:400]}"
                print(f"{name:8s} {notes[name]}", flush=True)
                traceback.print_exc()
            record["case_s"] = round(time.perf_counter() - case_start, 1)
            results[name] = record
            if record["ms"] is not None:
                print(f"{name:8s} {record['ms']:10.1f} ms  first call {record['first_call_s']} s  rel_l2 "
                      f"{record['rel_l2']}  peak {record['peak_gib']} GiB  dynamo {record['dynamo']}  "
                      f"[{time.perf_counter() - started:.0f} s total]", flush=True)  # fmt: skip
                if "profile" in record:
                    summary = {c: f"{v['ms']:.0f} ms {v['pct']}%" for c, v in record["profile"]["categories"].items()}
                    print(f"{name:8s} profile {summary}", flush=True)
            write_report(args, results, notes, shape, build_s)  # after every case: a time limit loses nothing done
    write_report(args, results, notes, shape, build_s)


def write_report(args, results, notes, shape, build_s) -> None:
    for name, case in results.items():
        baseline = "native" if case.get("task", "t2va") == "t2va" else f"native_{case['task']}"
        base = results.get(baseline, {}).get("ms")
        case["baseline"] = baseline
        case["ratio"] = round(base / case["ms"], 3) if base and case.get("ms") else None
    report = {
        **result_header("forward", args.commit, device="cpu (tiny smoke test)" if args.tiny else None),
        "shape": shape,
        "reference": "native (diffusers' processor, _native_cudnn backend, eager) output; random weights: numerical "
                     "distance, not quality",
        "protocol": f"in one process, in the order native, exact, fast, fastest (presets applied in place); per "
                    f"case torch._dynamo.reset() before a preset, {args.warmup} untimed forwards (the first compiles: "
                    f"first_call_s), then the median of {args.reps} timed forwards (CUDA events; perf_counter on a CPU)"
                    f"; blocks compiled with fullgraph={args.fullgraph}, "
                    f"dynamic={'False (--static-shapes)' if args.static_shapes else 'None (torch default, the presets)'}"
                    f"; inputs "
                    f"per case in the order {args.tasks} without a Dynamo reset between them",
        "build_s": round(build_s, 1),
        "cases": results,
        "notes": notes,
    }  # fmt: skip
    write_json(args.out, report)


if __name__ == "__main__":
    main()
