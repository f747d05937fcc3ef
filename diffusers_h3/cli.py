"""`diffusers-h3` command line: `generate` an MP4 with audio, `describe` the environment and a pipeline's paths."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import List, Optional

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16"}


def _parse_reference(value: str):
    """`image:path`, `video:path` or `audio:path` (the kind may be omitted for common file extensions)."""
    from diffusers_h3 import MiniMaxH3AudioReference, MiniMaxH3ImageReference, MiniMaxH3VideoReference

    kinds = {"image": MiniMaxH3ImageReference, "video": MiniMaxH3VideoReference, "audio": MiniMaxH3AudioReference}
    kind, sep, path = value.partition(":")
    if not sep or kind not in kinds:
        path = value
        extension = value.rsplit(".", 1)[-1].lower()
        kind = {"png": "image", "jpg": "image", "jpeg": "image", "webp": "image", "mp4": "video", "mov": "video",
                "mkv": "video", "webm": "video", "wav": "audio", "mp3": "audio", "flac": "audio", "m4a": "audio"}.get(extension)  # fmt: skip
        if kind is None:
            raise SystemExit(f"--reference {value!r}: write it as image:PATH, video:PATH or audio:PATH")
    return kinds[kind].from_file(path)


def _load_pipeline(args):
    import torch

    from diffusers_h3 import MiniMaxH3Pipeline
    from diffusers_h3.testing.tiny import demo_checkpoint_dir

    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    reference, image, last_image = (getattr(args, k, None) for k in ("reference", "image", "last_image"))
    task = "ref2va" if reference else ("fl2va" if (image or last_image) else "t2va")
    if args.model is None:
        print("No --model given: using the embedded tiny demo checkpoint (random weights: the output is noise).", file=sys.stderr)
        model = demo_checkpoint_dir()
        if task == "ref2va":
            raise SystemExit("The tiny demo checkpoint holds only the t2va/fl2va partition; pass --model for --reference.")
    else:
        model = args.model
    kwargs = {"torch_dtype": dtype} if dtype is not None else {}
    pipe = MiniMaxH3Pipeline.from_pretrained(model, task=task, **kwargs)
    if args.cpu_offload:
        pipe.enable_model_cpu_offload(device=args.device)
    else:
        pipe.to(args.device)
    return pipe


def cmd_generate(args) -> int:
    import torch
    from PIL import Image

    from diffusers_h3 import export_to_video

    pipe = _load_pipeline(args)
    call = dict(
        prompt=args.prompt,
        num_frames=args.frames,
        num_inference_steps=args.steps,
        generator=torch.Generator(device="cpu").manual_seed(args.seed),
        output_type="np",
    )
    if args.model is None and args.height is None:
        args.height, args.width = 64, 96  # the tiny demo runs on a small canvas
    if args.height is not None or args.width is not None:
        call.update(height=args.height, width=args.width)
    if args.image:
        call["image"] = Image.open(args.image).convert("RGB")
    if args.last_image:
        call["last_image"] = Image.open(args.last_image).convert("RGB")
    if args.reference:
        call["references"] = [_parse_reference(value) for value in args.reference]
    start = time.perf_counter()
    output = pipe(**call)
    seconds = time.perf_counter() - start
    path = export_to_video(output.frames[0], args.out, fps=24, audio=output.audio[0], sampling_rate=output.sampling_rate)
    frames = output.frames.shape[1]
    print(f"wrote {path}: {frames} frames at 24 fps + stereo audio at {output.sampling_rate} Hz ({seconds:.1f} s)")
    return 0


def cmd_describe(args) -> int:
    from diffusers_h3 import describe, format_report

    pipe = None
    if args.model is not None or args.demo:
        pipe = _load_pipeline(args)
    report = describe(pipe)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diffusers-h3", description="MiniMax-H3 video + audio with Hugging Face Diffusers")
    sub = parser.add_subparsers(dest="command", required=True)

    def add_model_options(p):
        p.add_argument("--model", default=None, help="local folder or hub repo id (default: embedded tiny demo checkpoint)")
        p.add_argument("--device", default="cuda" if _cuda() else "cpu")
        p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="weights dtype (default: as saved)")
        p.add_argument("--cpu-offload", action="store_true", help="enable_model_cpu_offload (big models on one GPU)")

    gen = sub.add_parser("generate", help="generate a clip and write it as MP4 with stereo audio")
    add_model_options(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--out", default="clip.mp4")
    gen.add_argument("--image", help="first keyframe (fl2va)")
    gen.add_argument("--last-image", help="last keyframe (fl2va)")
    gen.add_argument("--reference", action="append", help="ref2va reference: image:PATH | video:PATH | audio:PATH (repeat)")
    gen.add_argument("--height", type=int, default=None)
    gen.add_argument("--width", type=int, default=None)
    gen.add_argument("--frames", type=int, default=124, help="frames at 24 fps (17n+5, 5-15 s)")
    gen.add_argument("--steps", type=int, default=None, help="sigma grid points (default 50, or a LoRA preset)")
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(func=cmd_generate)

    des = sub.add_parser("describe", help="print versions, devices and which attention/quantization paths run")
    add_model_options(des)
    des.add_argument("--demo", action="store_true", help="describe the tiny demo pipeline")
    des.add_argument("--json", action="store_true")
    des.set_defaults(func=cmd_describe)
    return parser


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover
        return False


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
