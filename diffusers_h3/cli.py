"""`diffusers-h3` command line: `generate` an MP4 with audio, `describe` the environment and a pipeline's paths."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import List, Optional

from .quantizers.registry import format_names, get_format

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16"}


def _quant_config(method: str):
    """The default config of the quantization format registered under the CLI name ``method``."""
    return get_format(method).config_cls()


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
    from diffusers_h3.tasks import partition_for_task, select_task
    from diffusers_h3.testing.tiny import DEMO_PARTITIONS, demo_checkpoint_dir

    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    reference, image, last_image = (getattr(args, k, None) for k in ("reference", "image", "last_image"))
    task = select_task(image=image, last_image=last_image, references=reference)
    if args.model is None:
        print("No --model given: using the embedded tiny demo checkpoint (random weights: the output is noise).", file=sys.stderr)
        model = demo_checkpoint_dir()
        if partition_for_task(task) not in DEMO_PARTITIONS:
            raise SystemExit(
                f"The tiny demo checkpoint holds only the {'/'.join(DEMO_PARTITIONS)} partition, not the one {task} "
                "runs on; pass --model."
            )
    else:
        model = args.model
    kwargs = {"torch_dtype": dtype} if dtype is not None else {}
    quant_mapping = {}
    if getattr(args, "quantize", None):
        quant_mapping[partition_for_task(task)] = _quant_config(args.quantize)
    if getattr(args, "quantize_text_encoder", None):
        quant_mapping["text_encoder"] = _quant_config(args.quantize_text_encoder)
    if quant_mapping:  # quantized while loading: the bf16 weights never sit on the GPU whole
        from diffusers.quantizers import PipelineQuantizationConfig

        kwargs["quantization_config"] = PipelineQuantizationConfig(quant_mapping=quant_mapping)
    pipe = MiniMaxH3Pipeline.from_pretrained(model, task=task, **kwargs)
    if args.cpu_offload:
        pipe.enable_model_cpu_offload(device=args.device)
    else:
        pipe.to(args.device)
    return pipe


def _apply_fast_paths(pipe, args) -> None:
    """LoRA, V100 mode, attention (VSA / FP8) and regional torch.compile, in the order they must be applied."""
    if args.lora:
        report = pipe.load_lora_weights(args.lora, adapter_name="cli")
        pipe.set_adapters(["cli"], [args.lora_scale])
        print(f"LoRA {args.lora}: {report}", file=sys.stderr)
    if args.v100:
        pipe.enable_v100_mode()
    if args.vsa is not None or args.attention_precision is not None:
        if args.v100:
            raise SystemExit("--v100 installs the FA-V100 attention; it cannot be combined with --vsa/--attention-precision")
        if args.vsa is not None:
            pipe.enable_vsa(sparsity=args.vsa, precision=args.attention_precision or "bf16",
                            dense_first_steps=args.dense_first_steps)
        elif args.attention_precision != "bf16":  # dense attention in FP8 / INT8 / FP4 (bf16 is the default path)
            from diffusers_h3.attention_processors import enable_low_precision_attention

            enable_low_precision_attention(pipe, precision=args.attention_precision)
    if args.compile:
        for _, model in pipe._partitions():
            model.compile_repeated_blocks(fullgraph=False)


def _print_paths(pipe) -> None:
    """One line per distinct attention / quantized-linear path the transformer ran (honest about what ran)."""
    from diffusers_h3 import describe

    for name, info in describe(pipe).get("components", {}).items():
        for kind in ("attention", "quantized_layers"):
            for path, count in info.get(kind, {}).items():
                print(f"  {name} {kind.replace('_', ' ')} x{count}: {path}")


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _generate_rank(args) -> None:
    """One rank of `generate --gpus N` (started by `parallel._launch.launch`, process group already up)."""
    import torch
    import torch.distributed as dist

    if args.device.startswith("cuda"):
        args.device = f"cuda:{dist.get_rank() % torch.cuda.device_count()}"
    args.gpus = 1  # this process is one of the ranks
    cmd_generate(args)


def cmd_generate(args) -> int:
    import os

    import torch
    from PIL import Image

    from diffusers_h3 import export_to_video

    if args.gpus > 1:
        from diffusers_h3.parallel._launch import launch

        backend = "cpu:gloo,cuda:nccl" if args.device.startswith("cuda") else "cpu:gloo"
        if args.device.startswith("cuda") and torch.cuda.device_count() < args.gpus:
            raise SystemExit(f"--gpus {args.gpus}: only {torch.cuda.device_count()} CUDA device(s) visible.")
        # Rank 0 encodes the prompt while the others wait in a broadcast: collectives may wait long.
        launch(_generate_rank, args.gpus, args=(args,), backend=backend, timeout_s=7 * 24 * 3600,
               collective_timeout_s=3600, num_threads=None)  # fmt: skip
        return 0
    if _world_size() == 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1:  # started by torchrun / accelerate launch
        from accelerate import PartialState

        PartialState()
        if args.device.startswith("cuda"):
            args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    pipe = _load_pipeline(args)
    _apply_fast_paths(pipe, args)
    world_size = _world_size()
    if world_size > 1:
        from diffusers_h3.parallel import enable_context_parallel

        enable_context_parallel(pipe, ulysses_degree=world_size)
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
    from diffusers_h3.parallel.ranks import is_main_rank

    if not is_main_rank():  # every rank holds the same output; rank 0 writes it
        return 0
    path = export_to_video(output.frames[0], args.out, fps=24, audio=output.audio[0], sampling_rate=output.sampling_rate)
    frames = output.frames.shape[1]
    print(f"wrote {path}: {frames} frames at 24 fps + stereo audio at {output.sampling_rate} Hz ({seconds:.1f} s)")
    print("paths:")
    _print_paths(pipe)
    return 0


def cmd_describe(args) -> int:
    from diffusers_h3 import describe
    from diffusers_h3._report import format_report

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
    gen.add_argument("--gpus", type=int, default=1,
                     help="context-parallel ranks (Ulysses): starts one process per GPU (on CPU: gloo processes)")
    fast = gen.add_argument_group("fast paths (each prints the path it runs at the end)")
    fast.add_argument("--vsa", type=_sparsity, default=None, metavar="SPARSITY",
                      help="video sparse attention with this sparsity in [0, 1) (0.8: FastH3's setting)")
    fast.add_argument("--attention-precision", choices=("bf16", "fp8", "int8", "fp4"), default=None,
                      help="VSA precision; without --vsa: dense attention in this precision (MiniMaxH3LowPrecisionAttnProcessor; fp8: Ada/Hopper+, int8: Ampere+)")
    fast.add_argument("--dense-first-steps", type=int, default=0, help="with --vsa: dense attention for these steps")
    quant_methods = format_names()  # every registered quantization format
    fast.add_argument("--quantize", choices=quant_methods, default=None, help="quantize the DiT while loading")
    fast.add_argument("--quantize-text-encoder", choices=quant_methods, default=None,
                      help="quantize the Qwen3-VL text encoder while loading")
    fast.add_argument("--lora", default=None, help="LoRA file or repo (LightX2V Turbo files also set their schedule)")
    fast.add_argument("--lora-scale", type=float, default=1.0)
    fast.add_argument("--v100", action="store_true", help="enable_v100_mode: fp16-safe run with FA-V100 attention")
    fast.add_argument("--compile", action="store_true",
                      help="regional torch.compile of the transformer blocks (first call compiles)")
    gen.set_defaults(func=cmd_generate)

    des = sub.add_parser("describe", help="print versions, devices and which attention/quantization paths run")
    add_model_options(des)
    des.add_argument("--demo", action="store_true", help="describe the tiny demo pipeline")
    des.add_argument("--json", action="store_true")
    des.set_defaults(func=cmd_describe)
    return parser


def _sparsity(value: str) -> float:
    sparsity = float(value)
    if not 0.0 <= sparsity < 1.0:
        raise argparse.ArgumentTypeError(f"sparsity must be in [0, 1), got {value}")
    return sparsity


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
