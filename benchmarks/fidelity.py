"""What each fast path costs in the clip, on random weights at the released sizes: `diffusers_h3.fidelity` run over
t2va with two prompts, every case against the `exact` preset (docs/fidelity.md).

    python benchmarks/fidelity.py --out benchmarks/results/fidelity_h200.json --page benchmarks/results/fidelity_h200
    python benchmarks/fidelity.py --tiny --out benchmarks/results/fidelity_cpu.json --no-page   # tiny, on the CPU
    python benchmarks/fidelity.py --text-encoder-first --out benchmarks/results/fidelity_h100.json \
        --page benchmarks/results/fidelity_h100   # an 80 GB card: the text encoder and the DiT never resident together

Random weights make noise, not pictures: the numbers are the numerical distance of each path from the exact one
through the whole request (text encoder, every forward, both decoders, the MP4), not a measure of quality. Users
measure quality with `diffusers-h3 fidelity --model <their weights>`.

Each case gets the same pipeline, rebuilt from the same seed (`benchmarks/request.py`'s `build_pipeline`: Qwen3-VL-32B
text encoder up to the layer H3 reads, the full 50-block DiT, both VAEs, bf16 as loaded), and `apply_case` quantizes
it in place to the case's formats. To fit a few minutes of one H200 the clip is short: 768x1344 (the released canvas,
so VSA's tile selection sees its real grid), 22 frames (one VAE chunk; the released pipeline's 5 s minimum is
lowered for this run), 8 sigma points (7 forwards), and the presets run without torch.compile (eager kernels: the
same operations, so the same distance up to compiler rounding, without minutes of compilation). All of this is
recorded in the JSON under ``choices``. Speeds of such short eager requests are not the presets' speed (that is
`request_h200.json`).

The page (``--page``: ``index.html`` + ``images/``) and the JSON (the fidelity report under ``report``) are written;
the MP4 clips stay in ``--work`` (default: a temporary folder).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from request import build_pipeline

from _common import result_header, write_json


CASES = ("fast", "fastest", "low_ram", "fp8_decode", "first_block_cache")
PROMPTS = (
    "A street drummer plays under neon lights at night, the crowd claps along, rain on the pavement.",
    "An old fisherman mends a net on a wooden pier at dawn, gulls call and waves lap against the posts.",
)
FULL = {"height": 768, "width": 1344, "num_frames": 22, "steps": 8, "min_duration_s": 0.5}
TINY = {"height": 64, "width": 96, "num_frames": 22, "steps": 3, "min_duration_s": 0.5}
WEIGHT_SEED = 0
NOTE = ("Random weights at the released sizes: these are numerical distances of each path from the exact preset "
        "through the whole request, not a measure of picture or sound quality.")  # fmt: skip
TINY_NOTE = ("The tiny random pipeline: numerical distances of each path from the exact preset on tiny components, "
             "not a measure of quality.")  # fmt: skip


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/fidelity_h200.json")
    parser.add_argument("--page", default="benchmarks/results/fidelity_h200",
                        help="folder for index.html and images/ (copied from the run's folder)")
    parser.add_argument("--no-page", action="store_true", help="write the JSON only (the page stays in --work)")
    parser.add_argument("--work", default=None, help="the run's folder (clips; resumable); default: a temporary one")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma list (default: {','.join(CASES)})")
    parser.add_argument("--seeds", default="0", help="comma list of seeds (default: 0)")
    parser.add_argument("--tiny", action="store_true", help="tiny random components (CPU)")
    parser.add_argument("--device", default=None, help="default: cuda (cpu with --tiny when no GPU)")
    parser.add_argument("--thumbnail-width", type=int, default=96,
                        help="frame width in the strips (default: 96, keeps the committed page small)")
    parser.add_argument("--commit", default=None, help="commit measured (the device copy has no .git)")
    parser.add_argument("--steps", type=int, default=None, metavar="N",
                        help="sigma points (default: 8, tiny 3); 50 is the released request's, where the step caches "
                             "skip what they skip in a real request")
    parser.add_argument("--prompt-count", type=int, default=len(PROMPTS), metavar="K",
                        help=f"the first K of the {len(PROMPTS)} prompts (default: all)")
    parser.add_argument("--text-encoder-first", action="store_true",
                        help="encode each case's prompts with a pipeline built without the DiT, free it, then build "
                             "the rest without the text encoder: the bf16 `exact` reference on an 80 GB card")
    args = parser.parse_args(argv)

    from diffusers_h3.fidelity import FIDELITY_CASES, FidelitySettings, run_fidelity

    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in FIDELITY_CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}: choose from {', '.join(FIDELITY_CASES)}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() or not args.tiny else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks/fidelity.py needs a CUDA GPU (or --tiny for the CPU run)")
    shape = dict(TINY if args.tiny else FULL)
    if args.steps is not None:
        shape["steps"] = args.steps
    if not 1 <= args.prompt_count <= len(PROMPTS):
        raise SystemExit(f"--prompt-count {args.prompt_count}: choose 1 to {len(PROMPTS)}")
    header = result_header("fidelity", commit=args.commit)

    def load(case, without=("text_encoder",) if args.text_encoder_first else ()):
        torch.manual_seed(WEIGHT_SEED)  # the same random weights for every case
        pipe = build_pipeline(device, args.tiny, without=without)
        pipe.register_to_config(min_duration_s=shape["min_duration_s"])
        return pipe

    def load_text_encoder(case):
        return load(case, without=("transformer",))

    settings = FidelitySettings(prompts=list(PROMPTS[:args.prompt_count]),
                                seeds=[int(s) for s in args.seeds.split(",") if s], cases=cases, against="exact",
                                height=shape["height"], width=shape["width"],
                                num_frames=shape["num_frames"], steps=shape["steps"], compile=False,
                                model="random weights (tiny components)" if args.tiny else
                                "random weights at the released sizes")  # fmt: skip
    choices = {
        "task": "t2va",
        **shape,
        "compile": False,
        "weights": f"random, seed {WEIGHT_SEED}, rebuilt for every case ({'tiny components' if args.tiny else 'benchmarks/request.py build_pipeline: Qwen3-VL-32B text encoder (layers 0-50), 50-block DiT, released VAEs, bf16'})",
        "text_encoder_first": (
            "each case's prompts encoded by a pipeline built without the DiT, then the DiT and VAEs built (from the "
            "same seed) without the text encoder: what fits the bf16 reference on an 80 GB card; the weights differ "
            "from a run without this option, so compare only within a run") if args.text_encoder_first else False,
        "prompts": args.prompt_count,
        "why": ("the tiny pipeline's shortest clip, a CPU smoke run of the whole comparison" if args.tiny else
                f"a short clip ({'few steps' if shape['steps'] < 50 else 'the released 50 steps'}) so that the cases "
                "fit a few minutes of one GPU; the released canvas so VSA's tile selection sees its real grid; eager "
                "presets (no compile) to skip minutes of compilation"),
        "speed_note": ("seconds on a CPU shared with other work: not a speed measurement" if args.tiny else
                       "seconds are one short eager request per clip, not the presets' speed (request_h200.json)"),
    }  # fmt: skip
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="h3_fidelity_"))
    start = time.perf_counter()
    report = run_fidelity(load, settings, work, progress=sys.stderr.isatty(), note=TINY_NOTE if args.tiny else NOTE,
                          thumbnail_width=args.thumbnail_width, extra={"choices": choices},
                          load_text_encoder=load_text_encoder if args.text_encoder_first else None)  # fmt: skip
    page = None if args.no_page else Path(args.page)
    if page is not None:
        if page.exists():
            shutil.rmtree(page)
        page.mkdir(parents=True)
        shutil.copy2(work / "index.html", page / "index.html")
        if (work / "images").is_dir():
            shutil.copytree(work / "images", page / "images")
    data = {**header, "choices": choices, "page": f"{page.name}/index.html (beside this file)" if page else None,
            "wall_s": round(time.perf_counter() - start, 1),
            "report": report}  # fmt: skip
    write_json(args.out, data)
    for name, case in report["cases"].items():
        summary = case.get("summary") or {}
        print(f"{name:18s} {case['status']:9s} ssim_yuv420 {summary.get('ssim_yuv420')} psnr_yuv420 "
              f"{summary.get('psnr_yuv420')} audio_cosine {summary.get('audio_cosine')} "
              f"{case['error'] or ''}", flush=True)  # fmt: skip
    print(f"wrote {args.out} and {page or work}/index.html in {data['wall_s']} s")


if __name__ == "__main__":
    main()
