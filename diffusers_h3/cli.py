"""`diffusers-h3` command line: `generate` an MP4 with audio, `describe` the environment and a pipeline's paths.

Every user mistake ends in one line, `diffusers-h3: error: <what> — <fix>`, and exit code 2 (`--debug` shows the
traceback instead). Whatever can be checked without the weights (sizes, frames, prompt, files, flag combinations) is
checked before any model loads. torch and diffusers are imported inside the commands, so parsing `--help` and
`--version` imports neither.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, List, NamedTuple, Optional

from ._checkpoint_files import (
    gguf_problem,
    looks_like_local_path,
    safetensors_metadata,
    safetensors_problem,
    torch_checkpoint_problem,
    turbo_sla_message,
    turbo_sla_reason,
)
from ._version import __version__
from ._video_encoding import (
    CRF_RANGE,
    DEFAULT_CRF,
    DEFAULT_PIX_FMT,
    DEFAULT_PRESET,
    PIXEL_FORMATS,
    X264_PRESETS,
    encoding_option_problem,
)


PROG = "diffusers-h3"
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16"}
REFERENCE_KINDS = ("image", "video", "audio")
REFERENCE_EXTENSIONS = {
    "png": "image", "jpg": "image", "jpeg": "image", "webp": "image", "mp4": "video", "mov": "video", "mkv": "video",
    "webm": "video", "wav": "audio", "mp3": "audio", "flac": "audio", "m4a": "audio",
}  # fmt: skip
# The names of `diffusers_h3.hooks.cache.CACHE_METHODS`, spelled out so that `--help` imports no diffusers (tested).
CACHE_METHOD_CHOICES = ("first-block", "mag", "taylorseer", "taylorseer-lite")
# The tiny demo checkpoint's default canvas (its `DEMO_PIPELINE_CONFIG`), spelled out for `--help` (tested).
DEMO_CANVAS = (64, 96)
# --steps: the model is distilled for 50 steps; 1000 (20x that, 999 forwards) already takes hours on a real request, so
# a larger count is a typo rather than a setting.
MAX_STEPS = 1000
STEPS_BOUNDS = f"from 2 to {MAX_STEPS} (20x the default 50: more is hours per clip for no gain)"
_PYTHON_TO_FLAGS = (
    ("`height` and `width`", "--height and --width"),
    ("height=", "--height "),
    (", width=", " --width "),
    ("`strict_duration=True`", "--strict-duration"),
    ("`num_frames`=", "--frames "),
    ("`num_frames`", "--frames"),
    ("`references`", "--reference"),
    ("`prompt`", "--prompt"),
    ("`crf`", "--crf"),
    ("`preset`", "--preset"),
    ("`pix_fmt`", "--pix-fmt"),
)


class UsageError(Exception):
    """A user mistake, printed as one line `diffusers-h3: error: <what> — <fix>` (exit code 2)."""

    def __init__(self, what: str, fix: str):
        super().__init__(f"{what.rstrip('.')} — {fix.rstrip('.')}")


# Options whose value may start with "-" and is not one number (argparse would take "-1,-1" for an option).
_DASH_VALUE_OPTIONS = ("--memory",)


class _Parser(argparse.ArgumentParser):
    """argparse's usage errors as one line too (argparse already exits with 2)."""

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        for i in range(len(args) - 2, -1, -1):  # `--memory -1,-1` is read as `--memory=-1,-1`: its own check answers
            if args[i] in _DASH_VALUE_OPTIONS and re.match(r"-[\d.]", args[i + 1]):
                args[i : i + 2] = [f"{args[i]}={args[i + 1]}"]
        return super().parse_known_args(args, namespace)

    def error(self, message):
        self.exit(2, f"{PROG}: error: {message} — see `{self.prog} --help`\n")


def _as_flags(message: str) -> str:
    """A library error message in the CLI's words (its flags instead of Python argument names)."""
    for python, flag in _PYTHON_TO_FLAGS:
        message = message.replace(python, flag)
    return message.strip().splitlines()[0] if message.strip() else message


# ---------------------------------------------------------------------------------------------------------------------
# Checks that need no weights (run before any model loads)
# ---------------------------------------------------------------------------------------------------------------------
def _local_path(value: str, flag: str) -> Optional[Path]:
    """`value` as an existing local path, or `None` when it is a hub repo id; a path that does not exist is an error
    here, so that a mistyped path never reaches the network."""
    path = Path(value).expanduser()
    if path.exists():
        return path
    if looks_like_local_path(value):
        raise UsageError(
            f"{flag} {value}: no such file or folder ({path.absolute()} does not exist)",
            "check the path, or pass a hub repo id such as 'namespace/name'",
        )
    return None


def check_hub_reachable(repo_id: str, flag: str, file: Optional[str] = None) -> None:
    """Before a hub repo id is downloaded: with `HF_HUB_OFFLINE` set, `file` must be in the local cache (no request is
    made); otherwise the hub's host name must resolve, or the network is named as the cause (not the repo id)."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants, try_to_load_from_cache

    if constants.HF_HUB_OFFLINE:
        if file is not None and not isinstance(try_to_load_from_cache(repo_id, file), str):
            raise UsageError(f"{flag} {repo_id}: HF_HUB_OFFLINE is set and the repo is not in the Hugging Face cache "
                             f"({constants.HF_HUB_CACHE})", "download it once with network access, or pass a local "
                             "folder")  # fmt: skip
        return
    host = urlparse(constants.ENDPOINT).hostname
    try:
        socket.getaddrinfo(host, 443)
    except OSError as error:
        raise UsageError(f"{flag} {repo_id}: cannot reach the Hugging Face Hub: the network cannot resolve {host} "
                         f"({error.strerror or error})", "check the network, or set HF_HUB_OFFLINE=1 to use the local "
                         "cache, or pass a local folder") from None  # fmt: skip


def _check_model_folder(path: Path, flag: str = "--model") -> None:
    """The folder's JSON files parse and its safetensors files are complete (a corrupt file is named, with why)."""
    if not path.is_dir():
        raise UsageError(f"{flag} {path}: is a file, not a checkpoint folder", "pass the folder that holds model_index.json")
    for file in sorted([*path.glob("*.json"), *path.glob("*/*.json")]):
        try:
            json.loads(file.read_text())
        except (UnicodeDecodeError, ValueError) as error:
            raise UsageError(f"{file}: not valid JSON ({error})", "restore the file from the original checkpoint")
    for file in sorted([*path.glob("*.safetensors"), *path.glob("*/*.safetensors")]):
        problem = safetensors_problem(file)
        if problem:
            raise UsageError(f"{file}: {problem}", "download or copy the file again")


def _check_image(path_text: str, flag: str):
    """An existing, readable image file, opened (RGB)."""
    from PIL import Image, UnidentifiedImageError

    path = _check_file(path_text, flag)
    try:
        with Image.open(path) as image:
            image.load()
            return image.convert("RGB")
    except Image.DecompressionBombError as error:
        raise UsageError(f"{flag} {path_text}: refused as a possible decompression bomb ({error})",
                         "pass a smaller image (the reference short edge is 2048 px)") from None  # fmt: skip
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise UsageError(f"{flag} {path_text}: not a readable image ({error})", "pass a PNG, JPEG or WebP file")


def _check_file(path_text: str, flag: str) -> Path:
    """`path_text` as an existing file (a folder or a missing path is named as such)."""
    path = Path(path_text).expanduser()
    if path.is_dir():
        raise UsageError(f"{flag} {path_text}: is a folder, not a file", "pass the file in it")
    if not path.is_file():
        raise UsageError(f"{flag} {path_text}: no such file ({path.absolute()} does not exist)", "check the path")
    return path


def _split_reference(value: str):
    """`image:PATH`, `video:PATH` or `audio:PATH`; the kind may be omitted for common file extensions."""
    kind, sep, path = value.partition(":")
    if sep and kind in REFERENCE_KINDS:
        return kind, path
    kind = REFERENCE_EXTENSIONS.get(value.rsplit(".", 1)[-1].lower())
    if kind is None:
        raise UsageError(
            f"--reference {value}: unknown reference kind",
            "write it as image:PATH, video:PATH or audio:PATH",
        )
    return kind, value


def _load_reference(value: str):
    """A `MiniMaxH3{Image,Video,Audio}Reference` decoded from `value`; a missing or unreadable file is named."""
    kind, path_text = _split_reference(value)
    if kind == "image":
        from diffusers_h3 import MiniMaxH3ImageReference

        return MiniMaxH3ImageReference(image=_check_image(path_text, "--reference"))
    path = _check_file(path_text, "--reference")
    import av

    try:
        with av.open(str(path)) as container:
            streams = container.streams.video if kind == "video" else container.streams.audio
            if not streams:
                raise UsageError(f"--reference {value}: the file has no {kind} stream", f"pass a {kind} file")
    except av.error.FFmpegError as error:
        raise UsageError(f"--reference {value}: not a readable {kind} file ({error})", f"pass a {kind} file")
    from diffusers_h3 import MiniMaxH3AudioReference, MiniMaxH3VideoReference

    reference_cls = MiniMaxH3VideoReference if kind == "video" else MiniMaxH3AudioReference
    try:
        return reference_cls.from_file(str(path))
    except (ValueError, OSError, RuntimeError) as error:
        raise UsageError(f"--reference {value}: cannot decode the {kind} ({_as_flags(str(error))})", f"pass a {kind} file")


def _check_out(value: str) -> None:
    path = Path(value).expanduser()
    if path.suffix.lower() != ".mp4":
        raise UsageError(f"--out {value}: the clip is written as MP4", f"end the name with .mp4, e.g. {path.with_suffix('.mp4')}")
    if path.is_dir():
        raise UsageError(f"--out {value}: is a folder", f"name a file in it, e.g. {path / 'clip.mp4'}")
    parent = path.absolute().parent
    if not parent.is_dir():
        raise UsageError(f"--out {value}: the folder {parent} does not exist", "create it first or pick another --out")
    try:  # the clip is written next to the target and renamed onto it (export_to_video): probe that folder
        tempfile.NamedTemporaryFile(dir=parent, prefix=f".{path.name}.", suffix=".probe").close()
    except OSError as error:
        raise UsageError(f"--out {value}: cannot write in {parent} ({error.strerror or error})",
                         "pick a folder you can write to") from None  # fmt: skip


def _check_encoding_options(args) -> None:
    """`--crf`, `--preset`, `--pix-fmt`: values libx264 takes (the export refuses others only after generating).
    Unset ones are the speed preset's choice, which is one libx264 takes."""
    problem = encoding_option_problem(DEFAULT_CRF if args.crf is None else args.crf,
                                      DEFAULT_PRESET if args.preset is None else args.preset,
                                      DEFAULT_PIX_FMT if args.pix_fmt is None else args.pix_fmt)  # fmt: skip
    if problem:
        what, _, fix = problem.partition(" — ")
        raise UsageError(_as_flags(what), fix)


def _check_flag_combinations(args) -> None:
    if (args.height is None) != (args.width is None):
        given, missing = ("--height", "--width") if args.width is None else ("--width", "--height")
        raise UsageError(f"--height and --width have to be passed together, got {given} without {missing}",
                         f"add {missing} or drop {given}")  # fmt: skip
    if args.dense_first_steps is not None and args.vsa is None:
        raise UsageError("--dense-first-steps only applies to video sparse attention", "add --vsa SPARSITY or drop it")
    if args.lora_scale is not None and args.lora is None:
        raise UsageError("--lora-scale without --lora", "add --lora FILE or drop --lora-scale")
    if args.lora_allow_unmatched and args.lora is None:
        raise UsageError("--lora-allow-unmatched without --lora", "add --lora FILE or drop --lora-allow-unmatched")
    if args.allow_step_recipe_stacking and args.lora is None:
        raise UsageError("--allow-step-recipe-stacking without --lora",
                         "add --lora FILE or drop --allow-step-recipe-stacking")  # fmt: skip
    if args.cache_threshold is not None and args.cache is None:
        raise UsageError("--cache-threshold without --cache", "add --cache first-block or --cache mag")
    speed = getattr(args, "speed", None)
    if speed is not None and (args.vsa is not None or args.attention_precision is not None or args.v100):
        raise UsageError(f"--speed {speed} sets the attention itself and cannot be combined with "
                         "--vsa/--attention-precision/--v100", "drop --speed or those flags")  # fmt: skip
    if speed == "exact" and args.quantize is not None:
        raise UsageError(f"--speed exact runs bf16 weights and cannot be combined with --quantize {args.quantize}",
                         "drop --quantize, or use --speed fast")  # fmt: skip
    flashinfer = getattr(args, "flashinfer", None)
    if flashinfer is not None and speed not in ("exact", "fast"):
        raise UsageError(f"--flashinfer {flashinfer} chooses the attention of --speed exact or --speed fast",
                         "add --speed exact / fast or drop --flashinfer")  # fmt: skip
    if flashinfer == "on" and args.device is not None and not args.device.startswith("cuda"):
        raise UsageError(f"--flashinfer on runs FlashInfer's CUDA kernels, not on --device {args.device}",
                         "run on a CUDA GPU (SM80+) or use --flashinfer off")  # fmt: skip
    if args.v100 and (args.vsa is not None or args.attention_precision is not None):
        raise UsageError(
            "--v100 installs the FA-V100 attention and cannot be combined with --vsa/--attention-precision",
            "drop one of them",
        )
    if args.reference_short_edge is not None and not args.reference:
        raise UsageError("--reference-short-edge without --reference", "add --reference or drop it")
    if args.gpus < 1:
        raise UsageError(f"--gpus {args.gpus}: needs at least one process", "pass --gpus 1 or more")
    _check_placement(args)


def _check_flashinfer(args) -> None:
    """`--flashinfer on`: the kernels build, and FA3's FP8 kernel runs on this GPU."""
    if getattr(args, "flashinfer", None) != "on":
        return
    from diffusers_h3.kernels.attention.flashinfer_dense import check_flashinfer_kernels, resolve_backend

    try:
        check_flashinfer_kernels()
    except (ImportError, RuntimeError) as error:
        raise UsageError(f"--flashinfer on: {error}", "or use --flashinfer auto / off") from None
    if args.speed == "fast":
        import torch

        if torch.cuda.is_available():
            try:
                resolve_backend("fa3", torch.cuda.get_device_capability(args.device or "cuda"))
            except ValueError as error:
                raise UsageError(f"--speed fast --flashinfer on runs FA3's FP8 kernel: {error}",
                                 "use --flashinfer off (INT8 attention)") from None  # fmt: skip


def _check_device(args) -> None:
    """`--device` names a torch device that this host has (a CPU-only host has no `cuda`)."""
    if args.device is None:
        return
    import torch

    try:
        device = torch.device(args.device)
    except (RuntimeError, ValueError) as error:
        raise UsageError(f"--device {args.device}: not a torch device ({str(error).strip().splitlines()[0]})",
                         "pass cpu, cuda or cuda:N") from None  # fmt: skip
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build of torch" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise UsageError(f"--device {args.device}: this host has no usable CUDA GPU ({build})",
                             "pass --device cpu, or run on a GPU host") from None  # fmt: skip
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {args.device}: only {torch.cuda.device_count()} CUDA device(s) visible",
                             f"pass cuda:0 to cuda:{torch.cuda.device_count() - 1}")  # fmt: skip
    elif device.type != "cpu":
        is_available = getattr(getattr(torch, device.type, None), "is_available", None)
        if is_available is not None and not is_available():
            raise UsageError(f"--device {args.device}: no {device.type} device on this host", "pass --device cpu")


def _check_placement(args) -> None:
    """`--low-memory` against the other placement and speed flags (generate and describe)."""
    if getattr(args, "text_encoder_offload", False) and getattr(args, "gpus", 1) <= 1 \
            and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        raise UsageError("--text-encoder-offload places rank 0's text encoder under context parallelism, but this "
                         "is one process", "add --gpus N, or use --low-memory on one GPU")  # fmt: skip
    if getattr(args, "request_sized_cap", None) is not None and getattr(args, "memory", None) is None:
        flag = "--request-sized-cap" if args.request_sized_cap else "--no-request-sized-cap"
        raise UsageError(f"{flag} chooses how a memory recipe caps the allocator for each request, but no recipe is "
                         "placed", "add --memory auto (or --memory GPU,HOST)")  # fmt: skip
    if not args.low_memory:
        return
    if args.cpu_offload:
        raise UsageError("--low-memory and --cpu-offload are two placements", "pass one of them")
    if getattr(args, "gpus", 1) > 1:
        raise UsageError(f"--low-memory places the model on one GPU, but --gpus {args.gpus} asks for several",
                         "drop --low-memory, or run with --gpus 1")  # fmt: skip
    for flag in ("speed", "compile"):
        if getattr(args, flag, None):
            raise UsageError(f"--low-memory with --{flag}: torch.compile over offloaded blocks is not supported here",
                             f"drop --{flag}, or load the model resident (an 80 GB GPU with --quantize fp8)")  # fmt: skip


def _check_choices(args) -> None:
    """Options whose valid values live in the library (imported here, after parsing, not for `--help`)."""
    if getattr(args, "quantize", None) or getattr(args, "quantize_text_encoder", None):
        from diffusers_h3.quantizers.registry import format_names

        for flag, value in (("--quantize", args.quantize), ("--quantize-text-encoder", args.quantize_text_encoder)):
            if value is not None and value not in format_names():
                raise UsageError(f"{flag} {value}: unknown quantization format", f"choose one of {', '.join(format_names())}")
    if getattr(args, "cache", None):
        from diffusers_h3.hooks.cache import cache_config

        try:
            args.cache_config = cache_config(args.cache, num_inference_steps=args.steps, threshold=args.cache_threshold)
        except ValueError as error:
            message = str(error).replace("MagCache needs num_inference_steps", "--cache mag needs --steps")
            what, _, fix = message.partition(": ")
            raise UsageError(what if what.startswith("--cache") else f"--cache {args.cache}: {what}", fix or "see --help")


def _check_model_option(args) -> None:
    """`--model` as a checked local folder (`args.model_path`) or a hub repo id; `--transformer-file` as a file."""
    args.model_path = None
    if args.model is not None:
        args.model_path = _local_path(args.model, "--model")
        if args.model_path is not None:
            _check_model_folder(args.model_path)
    if getattr(args, "transformer_file", None) is not None:
        _check_transformer_file(args)


def _check_transformer_file(args) -> None:
    """`--transformer-file`: an existing .safetensors / .gguf file whose header reads (standard library only)."""
    path = _check_file(args.transformer_file, "--transformer-file")
    flag = f"--transformer-file {args.transformer_file}"
    suffix = path.suffix.lower()
    if suffix not in (".safetensors", ".gguf"):
        raise UsageError(f"{flag}: a {suffix or 'suffix-less'} file is not a single-file DiT format this reads",
                         "pass a .safetensors (bf16 or fp8-scaled) or .gguf file")  # fmt: skip
    problem = safetensors_problem(path) if suffix == ".safetensors" else gguf_problem(path)
    if problem:
        raise UsageError(f"{flag}: {problem}", "download the file again")


def _transformer_file_config(args, task: str):
    """The config the `--transformer-file` DiT is checked and built with: `--model`'s partition, or the demo's."""
    from diffusers_h3.tasks import partition_for_task

    partition = partition_for_task(task)
    if args.model is None:
        from diffusers_h3.testing.tiny import TINY_TRANSFORMER_CONFIG

        return dict(TINY_TRANSFORMER_CONFIG)
    if args.model_path is not None:
        return args.model_path / partition
    from diffusers import MiniMaxH3Transformer3DModel

    return dict(MiniMaxH3Transformer3DModel.load_config(args.model, subfolder=partition))


def _check_transformer_file_contents(args, task: str) -> None:
    """Every key, shape and tensor type of `--transformer-file` against `--model`'s DiT config, from the header (no
    weights read): one line naming what does not fit."""
    if getattr(args, "transformer_file", None) is None:
        return
    from diffusers_h3.loaders.single_file import TransformerFileError, inspect_transformer_file

    try:
        plan = inspect_transformer_file(args.transformer_file, _transformer_file_config(args, task))
    except TransformerFileError as error:
        what, _, fix = str(error).partition(" — ")
        raise UsageError(f"--transformer-file {what}", fix or "pass a MiniMax-H3 DiT file") from None
    quantize = getattr(args, "quantize", None)
    if quantize and plan.layout.format != "dense":
        raise UsageError(f"--transformer-file {args.transformer_file} is already quantized ({plan.layout.format}); "
                         f"--quantize {quantize} would quantize it twice", "drop --quantize")  # fmt: skip


class CheckedRequest(NamedTuple):
    """The `H3Request` the CLI checked and the `RequestConfig` it was checked against."""

    request: Any
    config: Any


def _check_request(args, task: str, conditioning) -> CheckedRequest:
    """The pipeline's own request checks (sizes, aspect, frames, conditioning): the `H3Request` the pipeline would
    build, on the checkpoint's configs read from its folder (no weights)."""
    from diffusers_h3.pipelines.request import H3Request, RequestConfig
    from diffusers_h3.tasks import partition_for_task

    partition = partition_for_task(task)
    folder = args.model_path
    if folder is not None and not (folder / partition).is_dir() and (folder / "vae").is_dir():
        raise UsageError(
            f"--model {args.model}: has no {partition}/ folder, which {task} runs on",
            "pass a checkpoint that holds it" + (" or drop --reference" if task == "ref2va" else ""),
        )
    if folder is None:  # the tiny demo checkpoint
        from diffusers_h3.testing import tiny

        config = RequestConfig.from_configs(tiny.TINY_VAE_CONFIG, {partition: tiny.TINY_TRANSFORMER_CONFIG},
                                            tiny.demo_pipeline_config())  # fmt: skip
    else:
        config = RequestConfig.from_folder(folder, partitions=(partition,))
    try:
        strict = getattr(args, "strict_duration", False) or None  # None: the checkpoint config's setting
        request = H3Request.build(config, prompt=args.prompt, height=args.height, width=args.width,
                                  num_frames=args.frames, task=task, strict_duration=strict, **conditioning)  # fmt: skip
    except ValueError as error:
        raise UsageError(_as_flags(str(error)), "see the limits in `diffusers-h3 generate --help`") from error
    return CheckedRequest(request, config)


def _check_gpus(args, task: str) -> None:
    """`--gpus N`: Ulysses splits the DiT's attention heads over the ranks, so N must divide the head count (the
    checkpoint's config; a hub repo's is read when it loads: the released model's 56 here), and each rank needs a GPU
    (on the CPU: a core). Under torchrun / accelerate launch (`WORLD_SIZE` ranks, `--gpus 1`) the heads are checked
    against the world size."""
    launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
    ranks, flag = (args.gpus, f"--gpus {args.gpus}") if args.gpus > 1 else (launched, f"WORLD_SIZE={launched}")
    if ranks <= 1:
        return
    from diffusers_h3.attention_processors._ulysses import usable_ulysses_degrees
    from diffusers_h3.tasks import partition_for_task

    if args.model is None:
        from diffusers_h3.testing.tiny import TINY_TRANSFORMER_CONFIG

        config = TINY_TRANSFORMER_CONFIG
    else:
        file = args.model_path / partition_for_task(task) / "config.json" if args.model_path is not None else None
        config = json.loads(file.read_text()) if file is not None and file.is_file() else {}
    heads = int(config.get("num_attention_heads", 56))  # MiniMaxH3Transformer3DModel's default, the released model's
    if heads % ranks:
        usable = " / ".join(str(n) for n in usable_ulysses_degrees(heads)) or "1"
        raise UsageError(f"{flag}: context parallelism splits the DiT's {heads} attention heads over the ranks, and "
                         f"{heads} does not divide by {ranks}",
                         f"pass --gpus {usable}" if args.gpus > 1 else f"launch {usable} ranks")  # fmt: skip
    if args.gpus <= 1:  # torchrun placed the ranks itself
        return
    import torch

    if _device(args).startswith("cuda"):
        visible = torch.cuda.device_count()
        if args.gpus > visible:
            raise UsageError(f"--gpus {args.gpus}: only {visible} CUDA device(s) visible",
                             "lower --gpus or make more GPUs visible")  # fmt: skip
    elif args.gpus > (os.cpu_count() or 1):
        raise UsageError(f"--gpus {args.gpus} on --device {args.device} starts {args.gpus} processes, but this host "
                         f"has {os.cpu_count() or 1} CPU cores", f"pass --gpus {os.cpu_count() or 1} or fewer")  # fmt: skip


def _check_prompt_length(args, config) -> None:
    """The prompt fits what the checkpoint encodes: `config.max_prompt_tokens` (the pipeline's `max_prompt_tokens`,
    lowered to the text encoder's `max_position_embeddings`), counted as the pipeline presents it (no chat template).
    The tokenizer is byte-level, so a prompt of at most that many UTF-8 bytes fits without tokenizing."""
    if args.model is not None and args.model_path is None:  # a hub repo: its configs are not here before loading
        return
    limit = config.max_prompt_tokens
    if len(args.prompt.encode("utf-8")) <= limit:
        return
    if args.model_path is None:
        from diffusers_h3.testing.tiny import tiny_tokenizer

        tokenizer = tiny_tokenizer()
    elif (args.model_path / "tokenizer").is_dir():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model_path / "tokenizer")
    else:
        return
    from diffusers_h3.pipelines.request import count_tokens

    num_tokens = count_tokens(tokenizer, args.prompt)
    if num_tokens > limit:
        raise UsageError(f"--prompt is {num_tokens} tokens, more than this checkpoint encodes ({limit} tokens: the "
                         "pipeline's max_prompt_tokens or the text encoder's max_position_embeddings)",
                         f"shorten the prompt to at most {limit} tokens")  # fmt: skip


def _check_memory_option(args) -> None:
    """`--memory auto|<GPU GiB>,<host GiB>` read into `args.memory_budget` (`(None, None)`: read the machine), and
    the flags it cannot be combined with (no torch needed)."""
    if getattr(args, "memory", None) is None:
        return
    others = [f for f, on in (("--low-memory", args.low_memory), ("--cpu-offload", args.cpu_offload),
                              ("--quantize", args.quantize), ("--quantize-text-encoder", args.quantize_text_encoder),
                              ("--gpus", args.gpus > 1)) if on]  # fmt: skip
    if others:
        raise UsageError(f"--memory picks the placement and weight formats itself, but {others[0]} asks for its own",
                         f"drop {others[0]} or --memory")  # fmt: skip
    text = args.memory.strip().lower()
    if text == "auto":
        args.memory_budget = (None, None)
        return
    parts = text.split(",")
    try:
        gpu, host = (float(p) for p in parts) if len(parts) == 2 else (math.nan, math.nan)
    except ValueError:
        gpu = host = math.nan
    if not (gpu > 0 and host > 0 and math.isfinite(gpu) and math.isfinite(host)):
        raise UsageError(f"--memory {args.memory}: not 'auto' nor '<GPU GiB>,<host GiB>' with two positive numbers",
                         "pass e.g. --memory auto or --memory 16,32")  # fmt: skip
    args.memory_budget = (gpu, host)


def _check_memory_device(args) -> None:
    """`--memory` places the model on a CUDA GPU: without one it is refused rather than run on the CPU."""
    if getattr(args, "memory", None) is None:
        return
    import torch

    if not torch.cuda.is_available():
        build = "a CPU-only build of torch" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise UsageError(f"--memory {args.memory}: the memory recipes place the model on a CUDA GPU, and this host "
                         f"has none ({build})", "drop --memory to run on the CPU (slowly), or run on a GPU host")  # fmt: skip
    if not _device(args).startswith("cuda"):
        raise UsageError(f"--memory places the model on a CUDA GPU, but --device {args.device} asks for another "
                         "device", "drop --device or --memory")  # fmt: skip


def _lora_rank(args) -> int:
    """The rank of `--lora` (the largest of its down / A matrices) read from a local safetensors file's header; the
    measured Light4 LoRA's 64 for a file not on this disk; 0 without `--lora`."""
    if args.lora is None:
        return 0
    path = _local_path(args.lora, "--lora")
    if path is None or not path.is_file() or path.suffix.lower() != ".safetensors":
        return 64
    from safetensors import safe_open

    ranks = [0]
    with safe_open(str(path), framework="pt") as handle:
        for key in handle.keys():
            if "lora_a" in key.lower() or "lora_down" in key.lower():
                ranks.append(min(handle.get_slice(key).get_shape()))
    return max(ranks)


def _check_memory(args, checked: CheckedRequest) -> None:
    """`--memory`: the recipe that fits this request's shape, chosen (and printed on one line) before anything
    loads; when none fits, one line naming the longest clip at this canvas and the largest canvas at this length
    that fit."""
    if getattr(args, "memory", None) is None:
        return
    from diffusers_h3.parallel.memory_recipes import MemoryBudgetError, select_recipe
    from diffusers_h3.pipelines.request import memory_shape

    args.request_shape = memory_shape(checked.request, _lora_rank(args), checked.config.max_prompt_tokens)
    try:
        args.memory_recipe = select_recipe(*args.memory_budget, device=_device(args), shape=args.request_shape)
    except MemoryBudgetError as error:
        raise UsageError(_as_flags(error.what), error.fix or "see docs/memory.md") from None
    print(args.memory_recipe.line(), file=sys.stderr)


def _check_prompt_text(prompt: str) -> None:
    if not prompt.strip():
        raise UsageError("--prompt is empty", "describe the clip, e.g. --prompt 'a cat playing the piano'")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as error:  # bytes that were not UTF-8 reach Python as lone surrogates (PEP 383)
        raw = prompt[error.start].encode("utf-8", "surrogateescape")
        raise UsageError(f"--prompt is not valid UTF-8 text (byte 0x{raw.hex()} at character {error.start})",
                         "pass the prompt as UTF-8 (check the terminal's or the script's encoding)") from None  # fmt: skip


def _check_lora_file(args) -> None:
    lora_path = _local_path(args.lora, "--lora")
    if lora_path is None or not lora_path.is_file():
        return
    if lora_path.suffix.lower() in (".bin", ".pt", ".pth"):
        problem = torch_checkpoint_problem(lora_path)
        if problem:
            raise UsageError(f"--lora {args.lora}: {problem}", "pass a LoRA .safetensors file or a torch.save checkpoint")
    else:
        problem = safetensors_problem(lora_path)
        if problem:
            raise UsageError(f"--lora {args.lora}: {problem}", "pass a LoRA .safetensors file")
        reason = turbo_sla_reason(lora_path.name, safetensors_metadata(lora_path))
        if reason is not None:  # before anything loads
            message, _, fix = turbo_sla_message(lora_path.name, reason).rpartition("; ")
            raise UsageError(f"--lora {args.lora}: {message}", fix.rstrip("."))


def check_arguments(args) -> None:
    """The checks that read only the arguments and the file system, with the standard library: the console entry
    point runs them before importing the package (torch, diffusers), so these mistakes answer at once."""
    if args.command in FIDELITY_COMMANDS:
        _check_fidelity_arguments(args)
        return
    if args.command == "plan":
        _check_plan_arguments(args)
        return
    if args.command == "train-lora":
        _check_train_lora_arguments(args)
        return
    if args.command == "describe":
        if args.demo and args.model is not None:
            raise UsageError("--demo and --model name two pipelines", "pass one of them")
        _check_placement(args)
        _check_model_option(args)
        return
    _check_prompt_text(args.prompt)
    _check_flag_combinations(args)
    _check_memory_option(args)
    _check_out(args.out)
    _check_encoding_options(args)
    if args.lora is not None:
        _check_lora_file(args)
    _check_model_option(args)
    for flag, value in (("--image", args.image), ("--last-image", args.last_image)):
        if value:
            _check_file(value, flag)
    for value in args.reference or ():
        _check_file(_split_reference(value)[1], "--reference")


def check_generate(args):
    """Every check of `generate` that needs no weights; returns the decoded conditioning inputs."""
    check_arguments(args)
    _check_flashinfer(args)
    _check_device(args)
    _check_memory_device(args)
    for flag, value in (("--model", args.model), ("--lora", args.lora)):
        if value is not None and _local_path(value, flag) is None:
            check_hub_reachable(value, flag, file="model_index.json" if flag == "--model" else None)
    conditioning = {
        "image": _check_image(args.image, "--image") if args.image else None,
        "last_image": _check_image(args.last_image, "--last-image") if args.last_image else None,
        "references": [_load_reference(value) for value in args.reference] if args.reference else None,
    }
    from diffusers_h3.tasks import partition_for_task, select_task
    from diffusers_h3.testing.tiny import DEMO_PARTITIONS

    try:
        task = select_task(**conditioning)
    except ValueError:
        raise UsageError(
            "--reference (ref2va) cannot be combined with --image/--last-image (fl2va)",
            "pass the inputs of one task",
        ) from None
    if args.model is None and partition_for_task(task) not in DEMO_PARTITIONS:
        raise UsageError(
            f"the tiny demo checkpoint holds only the {'/'.join(DEMO_PARTITIONS)} partition, not the one {task} runs on",
            "pass --model",
        )
    _check_choices(args)
    _check_transformer_file_contents(args, task)
    request = _check_request(args, task, conditioning)
    _check_prompt_length(args, request.config)
    _check_gpus(args, task)
    args.task = task
    args.checked_request = request
    _check_memory(args, request)
    return conditioning


# ---------------------------------------------------------------------------------------------------------------------
# Loading and running
# ---------------------------------------------------------------------------------------------------------------------
def _quant_config(method: str):
    """The default config of the quantization format registered under the CLI name ``method``."""
    from diffusers_h3.quantizers.registry import get_format

    return get_format(method).config_cls()


def _device(args) -> str:
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args.device


def _load_pipeline(args):
    import torch

    from diffusers_h3 import MiniMaxH3Pipeline
    from diffusers_h3.tasks import partition_for_task
    from diffusers_h3.testing.tiny import demo_checkpoint_dir

    task = getattr(args, "task", None) or "t2va"
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    if args.model is None:
        print("No --model given: using the embedded tiny demo checkpoint (random weights: the output is noise).", file=sys.stderr)
        model = demo_checkpoint_dir()
    else:
        model = args.model
    if getattr(args, "memory_recipe", None) is not None:  # --memory: the recipe loads and places everything
        from diffusers_h3.parallel.memory_recipes import MemoryBudgetError
        from diffusers_h3.pipelines.recipe_loading import load_for_memory_budget

        try:  # the checkpoint's formats are checked against the recipe's before any weight is read
            return load_for_memory_budget(model, task, *args.memory_budget, device=_device(args),
                                          recipe=args.memory_recipe,
                                          request_sized_cap=getattr(args, "request_sized_cap", None),
                                          transformer_file=getattr(args, "transformer_file", None))  # fmt: skip
        except MemoryBudgetError as error:
            raise UsageError(f"--memory {args.memory}: {_as_flags(error.what)}", error.fix or "see docs/memory.md") from None
    kwargs = {"dtype": dtype} if dtype is not None else {}
    left_out = tuple(getattr(args, "without", ()))  # components not loaded (fidelity --text-encoder-first)
    kwargs.update(dict.fromkeys(left_out))
    quant_mapping = {}
    if getattr(args, "transformer_file", None) is not None:  # the DiT from one file, quantized (or not) by the file
        kwargs[partition_for_task(task)] = _load_transformer_file(args, task, dtype)
    elif getattr(args, "quantize", None):
        quant_mapping[partition_for_task(task)] = _quant_config(args.quantize)
    elif getattr(args, "speed", None) in ("fast", "fastest"):
        # The preset's weight format, quantized while loading (the preset then keeps it instead of quantizing again).
        from diffusers_h3.pipelines.speed_presets import gemm_format

        quant_mapping[partition_for_task(task)] = _quant_config(gemm_format(_device(args)))
    if getattr(args, "quantize_text_encoder", None):
        quant_mapping["text_encoder"] = _quant_config(args.quantize_text_encoder)
    elif getattr(args, "speed", None) in ("fast", "fastest"):
        # The preset's text-encoder format, quantized while loading: the bf16 text encoder never sits on the GPU.
        from diffusers_h3.pipelines.speed_presets import TEXT_ENCODER_FORMAT

        quant_mapping["text_encoder"] = _quant_config(TEXT_ENCODER_FORMAT)
    quant_mapping = {name: config for name, config in quant_mapping.items() if name not in left_out}
    if quant_mapping:  # quantized while loading: the bf16 weights never sit on the GPU whole
        from diffusers.quantizers import PipelineQuantizationConfig

        kwargs["quantization_config"] = PipelineQuantizationConfig(quant_mapping=quant_mapping)
    try:
        pipe = MiniMaxH3Pipeline.from_pretrained(model, task=task, **kwargs)
    except (OSError, ValueError) as error:  # corrupt or missing files the checks could not see (e.g. on the hub)
        raise UsageError(f"--model {args.model or model}: cannot load ({_as_flags(str(error))})",
                         "check the checkpoint's files, or run with --debug for the traceback") from error  # fmt: skip
    from diffusers_h3.parallel.placement import (
        drop_unused_text_encoder_layers,
        enable_low_memory_offload,
        place_for_context_parallel,
    )

    # Generation never runs the text encoder's later layers: dropping them keeps the output, saves memory everywhere.
    if getattr(pipe, "text_encoder", None) is not None:
        trimmed = drop_unused_text_encoder_layers(pipe)
        if trimmed["removed_layers"]:
            print(f"text encoder: {trimmed['removed_layers']} never-run decoder layers dropped "
                  f"({trimmed['freed_gib']} GiB)", file=sys.stderr)  # fmt: skip
    if args.cpu_offload:
        pipe.enable_model_cpu_offload(device=_device(args))
    elif getattr(args, "low_memory", False):
        placements = enable_low_memory_offload(pipe, _device(args), low_cpu_mem_usage=True)
        print(f"low-memory placement: {placements}", file=sys.stderr)
    elif _world_size() > 1:  # context parallel: only rank 0 needs the text encoder
        text_encoder = "offload" if getattr(args, "text_encoder_offload", False) else "resident"
        place_for_context_parallel(pipe, _device(args), text_encoder=text_encoder)
    else:
        pipe.to(_device(args))
    return pipe


def _load_transformer_file(args, task: str, dtype):
    """The `--transformer-file` DiT (checked by `_check_transformer_file_contents` before anything loads); `--quantize`
    quantizes a dense file after loading, `--speed fast` / `fastest` then quantize it in place (a GGUF or fp8-scaled
    file keeps its own weights)."""
    from diffusers_h3.loaders.single_file import load_transformer_file, transformer_file_record

    quantization = _quant_config(args.quantize) if getattr(args, "quantize", None) else None
    model = load_transformer_file(args.transformer_file, _transformer_file_config(args, task), dtype=dtype,
                                  quantization_config=quantization)  # fmt: skip
    print(f"transformer: {transformer_file_record(model).summary()}", file=sys.stderr)
    return model


def _load_lora(pipe, args) -> None:
    try:
        report = pipe.load_lora_weights(args.lora, adapter_name="cli", allow_unmatched_keys=args.lora_allow_unmatched,
                                        allow_step_recipe_stacking=args.allow_step_recipe_stacking)  # fmt: skip
    except ValueError as error:
        message = str(error)
        what, marker, rest = message.partition(" Pass `allow_unmatched_keys=True` to load")
        if marker:
            raise UsageError(f"--lora {args.lora}: {what}", f"add --lora-allow-unmatched to load{rest}") from error
        what, marker, _ = message.partition(" Unload the first")
        if marker:
            raise UsageError(f"--lora {args.lora}: {what}",
                             "drop --lora, or add --allow-step-recipe-stacking to load both") from error  # fmt: skip
        raise UsageError(f"--lora {args.lora}: {_as_flags(message)}", "pass a MiniMax-H3 LoRA") from error
    pipe.set_adapters(["cli"], [1.0 if args.lora_scale is None else args.lora_scale])
    print(f"LoRA {args.lora}: {report}", file=sys.stderr)


def _apply_fast_paths(pipe, args) -> None:
    """LoRA, V100 mode, attention (VSA / FP8), step cache and regional torch.compile, in the order they must be
    applied."""
    if args.lora:
        _load_lora(pipe, args)
    if args.v100:
        pipe.enable_v100_mode()
    if args.vsa is not None or args.attention_precision is not None:
        if args.vsa is not None:
            pipe.enable_vsa(sparsity=args.vsa, precision=args.attention_precision or "bf16",
                            dense_first_steps=args.dense_first_steps or 0)  # fmt: skip
        elif args.attention_precision != "bf16":  # dense attention in FP8 / INT8 / FP4 (bf16 is the default path)
            from diffusers_h3.attention_processors import LowPrecisionAttentionConfig, enable_low_precision_attention

            enable_low_precision_attention(pipe, LowPrecisionAttentionConfig(precision=args.attention_precision))
    if args.cache:
        for _, model in pipe._partitions():
            model.enable_cache(args.cache_config)
    if getattr(args, "speed", None):  # after the cache hooks: the preset compiles the blocks last
        flashinfer = {"on": True, "off": False}.get(getattr(args, "flashinfer", None))  # None: automatic
        from diffusers_h3.pipelines.speed_presets import SpeedPresetConfig, speed_preset_record

        config = SpeedPresetConfig(args.speed, compile=True, flashinfer=flashinfer)
        record = speed_preset_record(pipe.enable_speed_preset(config))
        print(f"speed preset {args.speed}: {record.describe()}", file=sys.stderr)
    elif args.compile:
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
    conditioning = check_generate(args)  # before torch, the model or any output file
    if args.dry_run:
        from diffusers_h3.parallel.memory_model import packed_rows
        from diffusers_h3.pipelines.request import memory_shape

        checked = args.checked_request
        shape = getattr(args, "request_shape", None) or memory_shape(checked.request, _lora_rank(args),
                                                                    checked.config.max_prompt_tokens)  # fmt: skip
        print(f"dry run: {shape.label()}, {packed_rows(shape)['total']:,} packed rows: every check passed; nothing "
              "loaded (diffusers-h3 plan predicts its memory and time on any machine)")  # fmt: skip
        return 0

    import torch

    _device(args)
    if args.gpus > 1:
        from diffusers_h3.parallel._launch import launch

        backend = "cpu:gloo,cuda:nccl" if args.device.startswith("cuda") else "cpu:gloo"  # --gpus: `_check_gpus`
        if args.model is None:  # build the demo checkpoint once here, not concurrently in every rank
            from diffusers_h3.testing.tiny import demo_checkpoint_dir

            demo_checkpoint_dir()
        # Each rank checks the request again; the checked one holds configs that cannot be pickled to a new process.
        rank_args = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "checked_request"})
        # Rank 0 encodes the prompt while the others wait in a broadcast: collectives may wait long.
        launch(_generate_rank, args.gpus, args=(rank_args,), backend=backend, timeout_s=7 * 24 * 3600,
               collective_timeout_s=3600, num_threads=None)  # fmt: skip
        return 0
    if _world_size() == 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1:  # started by torchrun / accelerate launch
        from accelerate import PartialState

        PartialState()
        if args.device.startswith("cuda"):
            args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    pipe = _load_pipeline(args)
    if args.reference_short_edge is not None:
        pipe.register_to_config(reference_image_short_edge=args.reference_short_edge)
    _apply_fast_paths(pipe, args)
    world_size = _world_size()
    if world_size > 1:
        from diffusers import ContextParallelConfig

        from diffusers_h3.parallel import enable_context_parallel

        enable_context_parallel(pipe, ContextParallelConfig(ulysses_degree=world_size))
    call = dict(
        prompt=args.prompt,
        num_frames=args.frames,
        strict_duration=args.strict_duration or None,
        num_inference_steps=args.steps,
        generator=torch.Generator(device="cpu").manual_seed(args.seed),
        output_type="latent",  # decoded by decode_to_video, which encodes each video chunk while the next decodes
        height=args.height,
        width=args.width,
        **{name: value for name, value in conditioning.items() if value is not None},
    )
    start = time.perf_counter()
    try:
        output = pipe(**call)
    except ValueError as error:  # the pipeline's input checks that need the loaded model
        raise UsageError(_as_flags(str(error)), "see `diffusers-h3 generate --help`") from error
    try:  # every rank takes part (the context-parallel decode); rank 0 writes
        path = pipe.decode_to_video(output.frames, output.audio, args.out, crf=args.crf, preset=args.preset,
                                    pix_fmt=args.pix_fmt)  # fmt: skip
    except OSError as error:  # a full disk: the target is left as it was, the error names it
        raise UsageError(f"--out {args.out}: {error}", "free some space or pick another --out") from error
    except ValueError as error:  # NaN/inf latents or audio: refused before anything is written
        raise UsageError(str(error), "check --lora / --lora-scale and --dtype (bf16 or fp32), or rerun with --debug "
                         "for the traceback") from error  # fmt: skip
    seconds = time.perf_counter() - start
    if path is None:  # a context-parallel rank other than 0
        return 0
    export = pipe._h3_last_export
    print(f"wrote {path}: {export['num_frames']} frames at 24 fps ({export['num_frames'] / 24:.2f} s of video) + stereo "
          f"audio at {output.sampling_rate} Hz, generated and written in {seconds:.1f} s; video {export['decode']}; "
          f"crf {export['crf']}, preset {export['preset']}, "
          f"{export['pix_fmt']}")  # fmt: skip
    print("paths:")
    _print_paths(pipe)
    return 0


def cmd_describe(args) -> int:
    check_arguments(args)
    if args.model is not None and args.model_path is None:
        check_hub_reachable(args.model, "--model", file="model_index.json")
    _check_device(args)
    if getattr(args, "transformer_file", None) is not None:
        if args.model is None and not args.demo:
            raise UsageError("--transformer-file replaces the DiT of a pipeline", "add --model (or --demo)")
        _check_transformer_file_contents(args, "t2va")
    from diffusers_h3 import describe
    from diffusers_h3._report import format_report

    pipe = None
    if args.model is not None or args.demo:
        pipe = _load_pipeline(args)
    report = describe(pipe)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# The parser
# ---------------------------------------------------------------------------------------------------------------------
def _ranged(kind, minimum=None, below=None, what="value", bounds=None):
    """An argparse type: `kind(value)` within [minimum, below) (`bounds`: how the message says the range); a float
    must be finite (NaN passes every comparison, inf every lower bound)."""

    def parse(value: str):
        try:
            number = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
        if kind is float and not math.isfinite(number):
            raise argparse.ArgumentTypeError(f"{what} must be a finite number, got {value!r}")
        if (minimum is not None and number < minimum) or (below is not None and number >= below):
            raise argparse.ArgumentTypeError(
                f"{what} must be {bounds or (f'at least {minimum}' if below is None else f'in [{minimum}, {below})')}, "
                f"got {value}"
            )
        return number

    parse.kind = kind  # what the option parses (the bad-input tests find the float options by it)
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="MiniMax-H3 video + stereo audio with Hugging Face Diffusers")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,describe,compare,fidelity}")

    def add_common_options(p, model_help):
        p.add_argument("--model", default=None, help=model_help)
        p.add_argument("--device", default=None, help="device to run on (default: cuda when available, else cpu)")
        p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="weights dtype (default: as saved)")
        p.add_argument("--transformer-file", default=None, metavar="PATH",
                       help="the DiT from one file: .safetensors (bf16, or ComfyUI fp8-scaled) or .gguf (Q8_0, Q6_K, "
                            "Q5_K, Q4_K ...), ComfyUI or diffusers names; the rest of the pipeline from --model "
                            "(docs/checkpoints.md)")  # fmt: skip
        p.add_argument("--cpu-offload", action="store_true", help="enable_model_cpu_offload (big models on one GPU)")
        p.add_argument("--low-memory", action="store_true",
                       help="one 24-48 GB GPU: enable_low_memory_offload (block-level group offload with CUDA "
                            "streams for the DiT, leaf-level for the text encoder, model offload for the VAEs; "
                            "docs/multi_gpu.md)")  # fmt: skip
        p.add_argument("--debug", action="store_true", help="show the full traceback of an error instead of one line")

    gen = sub.add_parser("generate", help="generate a clip and write it as MP4 with stereo audio")
    add_common_options(gen, "local checkpoint folder or hub repo id (default: the embedded tiny demo checkpoint, "
                            "random weights, t2va/fl2va only)")  # fmt: skip
    gen.add_argument("--prompt", required=True, help="what the clip shows and sounds like (one non-empty string)")
    gen.add_argument("--out", default="clip.mp4",
                     help="output file, .mp4 in an existing folder (default: %(default)s)")  # fmt: skip
    gen.add_argument("--image", help="first keyframe image (fl2va)")
    gen.add_argument("--last-image", help="last keyframe image (fl2va)")
    gen.add_argument("--reference", action="append",
                     help="ref2va reference: image:PATH | video:PATH | audio:PATH (repeat; at most 9 images, 3 videos, "
                          "3 audios, 12 in all, not audio only). Image references are encoded at the checkpoint's "
                          "reference short edge (2048 px for the released model, slow with tiny test checkpoints: "
                          "see --reference-short-edge)")  # fmt: skip
    gen.add_argument("--reference-short-edge", type=_ranged(int, 1, what="--reference-short-edge"), default=None,
                     metavar="PIXELS", help="encode image references at this short edge instead of the checkpoint's "
                                            "(2048 for the released model, which it was trained at; lower is faster "
                                            "but departs from the reference pipeline)")  # fmt: skip
    gen.add_argument("--height", type=int, default=None,
                     help="canvas height in pixels, with --width: multiples of 32 (the VAE's 16x times the DiT's "
                          "patch 2), aspect ratio (width:height) 1:4 to 4:1 (default: height 768, width 1344 for "
                          "t2va/ref2va, the first keyframe's aspect at a 768 short edge for fl2va, height %d, width %d "
                          "on the tiny demo)" % DEMO_CANVAS)  # fmt: skip
    gen.add_argument("--width", type=int, default=None, help="canvas width in pixels (see --height)")
    gen.add_argument("--frames", "--num-frames", dest="frames", type=_ranged(int, 1, what="--frames"), default=124,
                     help="frames at 24 fps, rounded up to 17n+5 (whole VAE chunks: at least 22 frames); the "
                          "released model is trained for 5-15 s (124-345 frames after rounding): outside that range "
                          "the clip is generated after a warning (default: %(default)s = 5.2 s)")  # fmt: skip
    gen.add_argument("--dry-run", action="store_true",
                     help="run every check of the request (and, with --memory, choose the recipe) and stop before "
                          "loading anything")  # fmt: skip
    gen.add_argument("--strict-duration", action="store_true",
                     help="refuse --frames outside the checkpoint's recommended durations instead of warning")
    gen.add_argument("--steps", type=_ranged(int, 2, MAX_STEPS + 1, what="--steps", bounds=STEPS_BOUNDS), default=None,
                     help=f"sigma grid points including the final 0 (STEPS-1 transformer forwards), {STEPS_BOUNDS} "
                          "(default: 50, or the schedule of a step-distillation LoRA)")  # fmt: skip
    gen.add_argument("--seed", type=_ranged(int, 0, 2**64, what="--seed", bounds="from 0 to 2**64-1"), default=0,
                     help="seed of the one CPU generator, 0 to 2**64-1 (default: %(default)s)")
    gen.add_argument("--gpus", type=int, default=1,
                     help="context-parallel ranks (Ulysses): starts one process per GPU (on CPU: gloo processes, at "
                          "most one per core); must divide the DiT's attention heads (56 for the released model: 2, "
                          "4, 7, 8, 14, 28, 56) (default: %(default)s)")  # fmt: skip
    gen.add_argument("--memory", default=None, metavar="auto|GPU,HOST",
                     help="fit a memory budget on a CUDA GPU: 'auto' reads the visible GPU's free memory (less 0.5 "
                          "GiB) and the host's available memory (at most all but 4 GiB), '16,32' gives 16 GiB of GPU "
                          "and 32 GiB of host memory as they are; picks the fastest measured recipe that fits and "
                          "says why in one line (docs/memory.md)")
    gen.add_argument("--request-sized-cap", action=argparse.BooleanOptionalAction, default=None,
                     help="with --memory: hold the GPU allocator to this request's predicted allocations plus "
                          "headroom instead of the recipe's whole cap, so a small clip leaves the rest of the card "
                          "free (default: as the recipe entry was measured; the 12 GB entry was; docs/memory.md)")  # fmt: skip
    gen.add_argument("--text-encoder-offload", action="store_true",
                     help="with --gpus N: rank 0 streams the text encoder layer by layer (group offload) instead of "
                          "holding it whole next to its DiT replica; the other ranks never hold it on a GPU")  # fmt: skip
    encoding = gen.add_argument_group(
        "MP4 export (libx264; written while the video decodes; unset options take the --speed preset's choice, "
        "else the defaults measured in docs/pipeline.md)")  # fmt: skip
    encoding.add_argument("--crf", type=int, default=None,
                          help=f"constant rate factor, {CRF_RANGE[0]} (lossless) to {CRF_RANGE[1]}; lower is better "
                               f"quality and larger files (default: {DEFAULT_CRF})")  # fmt: skip
    encoding.add_argument("--preset", choices=X264_PRESETS, default=None,
                          help="x264 speed preset; slower presets make smaller files at the same --crf "
                               f"(default: {DEFAULT_PRESET})")  # fmt: skip
    encoding.add_argument("--pix-fmt", choices=PIXEL_FORMATS, default=None,
                          help="pixel format: yuv420p plays everywhere, yuv444p keeps full colour resolution but "
                               f"some players refuse it (default: {DEFAULT_PIX_FMT})")  # fmt: skip
    fast = gen.add_argument_group("fast paths (each prints the path it runs at the end)")
    fast.add_argument("--vsa", type=_ranged(float, 0.0, 1.0, what="sparsity"), default=None, metavar="SPARSITY",
                      help="video sparse attention with this sparsity in [0, 1) (0.8: FastH3's setting)")
    fast.add_argument("--attention-precision", choices=("bf16", "fp8", "int8", "fp4"), default=None,
                      help="VSA precision; without --vsa: dense attention in this precision (MiniMaxH3LowPrecisionAttnProcessor; fp8: Ada/Hopper+, int8: Ampere+)")
    fast.add_argument("--dense-first-steps", type=_ranged(int, 0, what="--dense-first-steps"), default=None,
                      metavar="STEPS", help="with --vsa: dense attention for the first STEPS steps (default: 0)")
    fast.add_argument("--quantize", default=None, metavar="FORMAT",
                      help="quantize the DiT while loading, in a registered format (built in: fp8, w8a16, nvfp4)")
    fast.add_argument("--quantize-text-encoder", default=None, metavar="FORMAT",
                      help="quantize the Qwen3-VL text encoder while loading (formats as --quantize)")
    fast.add_argument("--lora", default=None, help="LoRA file or repo (LightX2V Turbo and PDD Acc-LoRA files also set their schedule)")
    fast.add_argument("--lora-scale", type=_ranged(float, what="--lora-scale"), default=None, help="with --lora: adapter weight (default: 1.0)")
    fast.add_argument("--lora-allow-unmatched", action="store_true",
                      help="with --lora: load the matching modules and skip LoRA keys that match none")
    fast.add_argument("--allow-step-recipe-stacking", action="store_true",
                      help="with --lora: load a step-reduction LoRA (LightX2V Turbo, PDD) on a model that already has "
                           "a step recipe (a FastH3 stack); refused by default")  # fmt: skip
    fast.add_argument("--cache", choices=CACHE_METHOD_CHOICES, default=None,
                      help="diffusers' step cache on the DiT: first-block (FirstBlockCache), mag (MagCache; needs "
                           "--steps, calibrates on its first run), taylorseer (TaylorSeer on every block's attention) or "
                           "taylorseer-lite (TaylorSeer on the two outputs: little memory)")  # fmt: skip
    fast.add_argument("--cache-threshold", type=_ranged(float, 0.0, what="--cache-threshold"), default=None,
                      help="with --cache first-block/mag: the skip threshold (default: diffusers' 0.05 / 0.06)")
    fast.add_argument("--v100", action="store_true", help="enable_v100_mode: fp16-safe run with FA-V100 attention")
    fast.add_argument("--speed", choices=("exact", "fast", "fastest"), default=None,
                      help="speed preset (docs/speed.md): exact = bf16, fastest exact attention, regional compile; "
                           "fast = FP8 GEMMs + INT8 dense attention, text encoder W8A16 (loaded quantized); "
                           "fastest = fast + VSA 0.8")
    fast.add_argument("--flashinfer", choices=("auto", "on", "off"), default=None,
                      help="with --speed exact: FlashInfer's FA3 attention (auto, the default: when flashinfer-python "
                           "is installed and the GPU is Hopper; on: required; off: cuDNN); with --speed fast: on runs "
                           "FA3's FP8 attention (Hopper; faster, less exact than the default INT8)")  # fmt: skip
    fast.add_argument("--compile", action="store_true",
                      help="regional torch.compile of the transformer blocks (first call compiles)")
    gen.set_defaults(func=cmd_generate)

    des = sub.add_parser("describe", help="print versions, devices and which attention/quantization paths run")
    add_common_options(des, "local checkpoint folder or hub repo id to load and describe (omitted, with no --demo: "
                            "nothing is loaded, only the environment is described)")  # fmt: skip
    des.add_argument("--demo", action="store_true", help="load and describe the embedded tiny demo pipeline")
    des.add_argument("--json", action="store_true", help="print the report as JSON")
    des.set_defaults(func=cmd_describe)
    _add_plan_command(sub)
    _add_fidelity_commands(sub)
    _add_train_lora_command(sub)
    return parser


# ---------------------------------------------------------------------------------------------------------------------
# plan: which recipe a request runs as on a machine, its predicted peaks and times (docs/memory.md)
# ---------------------------------------------------------------------------------------------------------------------
PLAN_TASKS = ("t2va", "fl2va", "ref2va")


def _add_plan_command(sub) -> None:
    plan = sub.add_parser("plan", help="the memory recipe a request runs as on this machine or a named one, with its "
                                       "predicted device and host peaks and times; loads nothing")  # fmt: skip
    plan.add_argument("--task", choices=PLAN_TASKS, default="t2va", help="the request's task (default: t2va)")
    plan.add_argument("--height", type=_ranged(int, 32, what="--height"), default=768,
                      help="canvas height in pixels, a multiple of 32 (default: %(default)s)")
    plan.add_argument("--width", type=_ranged(int, 32, what="--width"), default=1344,
                      help="canvas width in pixels, a multiple of 32 (default: %(default)s)")
    plan.add_argument("--frames", "--num-frames", dest="frames", type=_ranged(int, 1, what="--frames"), default=124,
                      help="frames at 24 fps, rounded up to 17n+5 as `generate` does (default: %(default)s)")
    plan.add_argument("--prompt-tokens", type=_ranged(int, 1, what="--prompt-tokens"), default=512,
                      help="text rows: the prompt's tokens, plus the vision tokens of keyframes and references "
                           "(default: %(default)s)")  # fmt: skip
    plan.add_argument("--keyframes", type=int, choices=(1, 2), default=None, help="fl2va: keyframes (default: 1)")
    plan.add_argument("--reference-images", type=_ranged(int, 0, 10, what="--reference-images"), default=0,
                      help="ref2va: image references (each encoded at a 2048-pixel short edge)")
    plan.add_argument("--reference-videos", type=_ranged(int, 0, 4, what="--reference-videos"), default=0,
                      help="ref2va: video references (counted as long as the clip, with a soundtrack)")
    plan.add_argument("--lora-rank", type=_ranged(int, 0, what="--lora-rank"), default=0,
                      help="rank of the LoRA loaded (0: none; the LightX2V 4-step LoRA's is 64)")
    plan.add_argument("--gpu", default=None, metavar="GB|NAME",
                      help="plan for a card of this many GB (e.g. 8) or named as the consumer-GPU model lists it "
                           "(e.g. 'RTX 4070'); default: this machine's visible GPU")  # fmt: skip
    plan.add_argument("--ram", type=_ranged(float, 0.0, what="--ram"), default=None, metavar="GIB",
                      help="the machine's host memory in GiB (the recipe may use all but 4 GiB); default: this "
                           "machine's available memory")  # fmt: skip
    plan.add_argument("--debug", action="store_true", help="show the full traceback of an error instead of one line")
    plan.set_defaults(func=cmd_plan)


def _check_plan_arguments(args) -> None:
    if args.height % 32 or args.width % 32:
        raise UsageError(f"--height {args.height} --width {args.width}: not multiples of 32",
                         f"pass e.g. --height {round(args.height / 32) * 32 or 32} --width "
                         f"{round(args.width / 32) * 32 or 32}")  # fmt: skip
    refs = args.reference_images + args.reference_videos
    if args.task == "ref2va" and not refs:
        raise UsageError("--task ref2va needs at least one reference", "add --reference-images N or "
                         "--reference-videos N")  # fmt: skip
    if args.task != "ref2va" and refs:
        raise UsageError(f"--task {args.task} takes no references", "pass --task ref2va")
    if args.keyframes is not None and args.task != "fl2va":
        raise UsageError(f"--keyframes with --task {args.task}", "keyframes belong to --task fl2va")
    if args.ram is not None and args.ram <= 4.0:
        raise UsageError(f"--ram {args.ram:g}: the recipes leave 4 GiB of host memory to the system",
                         "give the machine's memory in GiB, e.g. --ram 16")  # fmt: skip


def cmd_plan(args) -> int:
    check_arguments(args)
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import align_num_frames

    from diffusers_h3.parallel.memory_model import RequestShape
    from diffusers_h3.parallel.memory_recipes import HOST_HEADROOM_GIB, MemoryBudgetError, plan_request

    shape = RequestShape(task=args.task, height=args.height, width=args.width,
                         num_frames=max(22, align_num_frames(args.frames, 17, 5)), prompt_tokens=args.prompt_tokens,
                         reference_images=args.reference_images, reference_videos=args.reference_videos,
                         lora_rank=args.lora_rank, keyframes=args.keyframes)  # fmt: skip
    host = None if args.ram is None else args.ram - HOST_HEADROOM_GIB
    try:
        if args.gpu is None:
            import torch

            if not torch.cuda.is_available():
                raise UsageError("plan reads this machine's GPU, and none is visible",
                                 "name a card: --gpu 8 (its memory in GB) or --gpu 'RTX 4070'")  # fmt: skip
        plan = plan_request(shape, host_gib=host, gpu=args.gpu)
    except MemoryBudgetError as error:
        print(_as_flags(error.what) + (f" — {error.fix}" if error.fix else ""))
        return 1
    for line in plan.lines():
        print(line)
    if not 124 <= shape.num_frames <= 345:
        print(f"note: {shape.num_frames} frames ({shape.num_frames / 24:.1f} s) is outside the 5-15 s the released "
              "model was trained for: generate warns, --strict-duration refuses")  # fmt: skip
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# train-lora: a LoRA on the DiT from a folder of clips (docs/training.md)
# ---------------------------------------------------------------------------------------------------------------------
def _add_train_lora_command(sub) -> None:
    tr = sub.add_parser("train-lora", help="train a LoRA on the DiT from a folder of clips or images with captions "
                                           "(docs/training.md)")  # fmt: skip
    tr.add_argument("--model", default=None, help="checkpoint folder or hub repo id (default: the embedded tiny demo "
                                                  "checkpoint, random weights)")  # fmt: skip
    tr.add_argument("--data", required=True, metavar="DIR",
                    help="folder with metadata.jsonl ({\"file_name\": ..., \"text\": ...} per line) and the clips "
                         "(video with an audio track) or images it lists")  # fmt: skip
    tr.add_argument("--output", required=True, metavar="DIR", help="checkpoints, validation clips, logs and the LoRA")
    tr.add_argument("--cache-dir", default=None, metavar="DIR", help="pass 1's latent cache (default: OUTPUT/cache)")
    tr.add_argument("--task", choices=("t2va", "fl2va"), default="t2va",
                    help="t2va, or fl2va (each clip's first and last frames become its keyframes)")
    tr.add_argument("--height", type=_ranged(int, 32, what="--height"), default=480, help="canvas height (default: %(default)s)")
    tr.add_argument("--width", type=_ranged(int, 32, what="--width"), default=832, help="canvas width (default: %(default)s)")
    tr.add_argument("--frames", type=_ranged(int, 5, what="--frames"), default=124,
                    help="frames per clip at 24 fps, 17n+5 (default: %(default)s)")
    tr.add_argument("--rank", type=_ranged(int, 1, what="--rank"), default=32, help="LoRA rank (default: %(default)s)")
    tr.add_argument("--alpha", type=_ranged(float, 0.0, what="--alpha"), default=None, help="LoRA alpha (default: the rank)")
    tr.add_argument("--target-modules", default=None, metavar="REGEX",
                    help="PEFT target_modules regex (default: attention and feed-forward of the main blocks)")
    tr.add_argument("--lora-dtype", choices=("float32", "bfloat16"), default="float32", help="LoRA factors' dtype")
    tr.add_argument("--learning-rate", type=_ranged(float, 0.0, what="--learning-rate"), default=1e-4,
                    help="AdamW learning rate (default: %(default)s)")
    tr.add_argument("--steps", type=_ranged(int, 1, what="--steps"), default=1000, help="optimizer steps (default: %(default)s)")
    tr.add_argument("--gradient-accumulation", type=_ranged(int, 1, what="--gradient-accumulation"), default=1,
                    help="clips per optimizer step (one clip per forward; default: %(default)s)")
    tr.add_argument("--mixed-precision", choices=("no", "bf16", "fp16"), default="no", help="Accelerate's autocast")
    tr.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16", help="base weights' dtype")
    tr.add_argument("--quantize", default=None, metavar="FORMAT", help="quantize the DiT while loading: w8a16, nvfp4, fp8")
    tr.add_argument("--quantize-text-encoder", default=None, metavar="FORMAT",
                    help="quantize the text encoder while loading for pass 1: w8a16, nvfp4, fp8")
    tr.add_argument("--transformer-file", default=None, metavar="PATH", help="the DiT from one .safetensors or .gguf file")
    tr.add_argument("--stream-base", action="store_true",
                    help="read the frozen base block by block from its checkpoint files (small GPUs; a checkpoint "
                         "saved in the format it runs in)")  # fmt: skip
    tr.add_argument("--no-gradient-checkpointing", action="store_true", help="keep every block's activations")
    tr.add_argument("--optimizer", choices=("adamw", "adamw8bit"), default="adamw",
                    help="adamw8bit needs bitsandbytes (default: %(default)s)")
    tr.add_argument("--checkpointing-steps", type=_ranged(int, 0, what="--checkpointing-steps"), default=250,
                    help="save_state every N steps, written atomically (0: only at the end; default: %(default)s)")
    tr.add_argument("--checkpoints-total-limit", type=_ranged(int, 1, what="--checkpoints-total-limit"), default=None,
                    help="keep the newest N checkpoints (default: all)")
    tr.add_argument("--resume", default=None, metavar="latest|DIR", help="resume from a checkpoint folder or the latest")
    tr.add_argument("--validation-prompt", action="append", default=[], help="prompt of a validation clip (repeat)")
    tr.add_argument("--validation-steps", type=_ranged(int, 0, what="--validation-steps"), default=0,
                    help="write the validation clips every N steps (default: off)")
    tr.add_argument("--validation-inference-steps", type=_ranged(int, 2, what="--validation-inference-steps"), default=50,
                    help="sigma grid points of a validation clip (default: %(default)s)")
    tr.add_argument("--guidance-scale", type=_ranged(float, 0.0, what="--guidance-scale"), default=None,
                    help="guidance-distillation target uncond + s * (v - uncond) (3-4 in the community's recipes)")
    tr.add_argument("--training-adapter", default=None, metavar="PATH",
                    help="a LoRA active (frozen) during training only, e.g. a de-distillation adapter")
    tr.add_argument("--flow-shift", type=_ranged(float, 0.0, what="--flow-shift"), default=None,
                    help="video sigma shift (default: the checkpoint's, 12)")
    tr.add_argument("--audio-flow-shift", type=_ranged(float, 0.0, what="--audio-flow-shift"), default=None,
                    help="audio sigma shift (default: the checkpoint's, 3)")
    tr.add_argument("--audio-loss-weight", type=_ranged(float, 0.0, what="--audio-loss-weight"), default=1.0,
                    help="weight of the audio rows' error next to the video rows' (default: %(default)s)")
    tr.add_argument("--seed", type=_ranged(int, 0, what="--seed"), default=0,
                    help="seed of the sample order and each step's noise (default: %(default)s)")
    tr.add_argument("--lora-name", default="lora", help="name of the adapter in the written files")
    tr.add_argument("--device", default=None, help="device of pass 1 (default: Accelerate's)")
    tr.add_argument("--report-to", default=None, help="Accelerate tracker: tensorboard, wandb, ...")
    tr.add_argument("--debug", action="store_true", help="show the full traceback of an error instead of one line")
    tr.set_defaults(func=cmd_train_lora)


def _check_train_lora_arguments(args) -> None:
    data = Path(args.data)
    if not (data / "metadata.jsonl").is_file():
        raise UsageError(f"--data {args.data}: no metadata.jsonl in that folder",
                         'write one line per clip or image: {"file_name": "clip.mp4", "text": "its caption"}')  # fmt: skip
    if (args.frames - 5) % 17:
        raise UsageError(f"--frames {args.frames} is not 17n+5", "use e.g. 22, 124 (5.2 s) or 345 (14.4 s)")
    if args.height % 32 or args.width % 32:
        raise UsageError(f"--height {args.height} --width {args.width}: not multiples of 32", "e.g. 480 x 832")
    if args.resume not in (None, "latest") and not Path(args.resume).is_dir():
        raise UsageError(f"--resume {args.resume}: no such checkpoint folder", "pass a checkpoint-N folder or 'latest'")
    if args.training_adapter is not None:
        _check_file(args.training_adapter, "--training-adapter")
    if args.validation_steps and not args.validation_prompt:
        raise UsageError("--validation-steps without --validation-prompt", "add --validation-prompt TEXT (repeat)")
    _check_model_option(args)


def cmd_train_lora(args) -> int:
    from diffusers_h3.training import CacheError, DataFolderError, TrainingConfigError, TrainLoraConfig, train_lora
    from diffusers_h3.training.trainer import DEFAULT_TARGET_MODULES

    if args.model is None:
        from diffusers_h3.testing.tiny import demo_checkpoint_dir

        print("No --model given: training on the embedded tiny demo checkpoint (random weights).", file=sys.stderr)
        args.model = str(demo_checkpoint_dir())
    config = TrainLoraConfig(
        model=args.model, data_dir=args.data, output_dir=args.output, cache_dir=args.cache_dir, task=args.task,
        height=args.height, width=args.width, num_frames=args.frames, rank=args.rank, alpha=args.alpha,
        target_modules=args.target_modules or DEFAULT_TARGET_MODULES, lora_dtype=args.lora_dtype,
        learning_rate=args.learning_rate, max_train_steps=args.steps,
        gradient_accumulation_steps=args.gradient_accumulation, mixed_precision=args.mixed_precision,
        dtype=args.dtype, quantize=args.quantize, quantize_text_encoder=args.quantize_text_encoder,
        transformer_file=args.transformer_file,
        stream_base=args.stream_base, gradient_checkpointing=not args.no_gradient_checkpointing,
        optimizer=args.optimizer, checkpointing_steps=args.checkpointing_steps,
        checkpoints_total_limit=args.checkpoints_total_limit, resume_from_checkpoint=args.resume,
        validation_prompts=tuple(args.validation_prompt), validation_steps=args.validation_steps,
        validation_num_inference_steps=args.validation_inference_steps, guidance_scale=args.guidance_scale,
        training_adapter=args.training_adapter, flow_shift=args.flow_shift, audio_flow_shift=args.audio_flow_shift,
        audio_loss_weight=args.audio_loss_weight, seed=args.seed, lora_name=args.lora_name, device=args.device,
        report_to=args.report_to,
    )  # fmt: skip
    try:
        result = train_lora(config)
    except (DataFolderError, TrainingConfigError, CacheError) as error:
        if args.debug:
            raise
        what, _, fix = str(error).partition(" — ")
        raise UsageError(what, fix or "see docs/training.md") from None
    print(f"trained {result.global_step} steps; LoRA: {result.files['diffusers']} (diffusers / PEFT), "
          f"{result.files['comfyui']} (ComfyUI)")  # fmt: skip
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# compare / fidelity: what a fast path costs in the clip (docs/fidelity.md)
# ---------------------------------------------------------------------------------------------------------------------
FIDELITY_COMMANDS = ("compare", "fidelity")
# The names of `diffusers_h3.fidelity.FIDELITY_CASES`, spelled out so that `--help` imports no torch (tested).
FIDELITY_CASE_CHOICES = ("native", "exact", "fast", "fastest", "low_ram", "fp8_decode", "first_block_cache",
                         "fast_first_block_cache", "fast_taylorseer", "fast_taylorseer_lite",
                         "fastest_first_block_cache", "fastest_taylorseer", "fastest_taylorseer_lite")  # fmt: skip
DEFAULT_FIDELITY_CASES = "fast,fastest"
# Exit status of a comparison or fidelity run with a gate below its threshold or a case that failed to run.
GATE_FAILED = 1
# `diffusers_h3.fidelity.run`'s default audio gates, spelled out so that `--help` imports no torch (tested).
DEFAULT_MIN_AUDIO_SI_SDR = 20.0
DEFAULT_MIN_AUDIO_CORRELATION = 0.995


def _seed_list(value: str):
    """`--seeds 0,1`: comma-separated seeds, each 0 to 2**64-1."""
    parse = _ranged(int, 0, 2**64, what="--seeds entry", bounds="from 0 to 2**64-1")
    seeds = [parse(part.strip()) for part in value.split(",") if part.strip()]
    if not seeds:
        raise argparse.ArgumentTypeError(f"--seeds needs at least one seed, got {value!r}")
    return list(dict.fromkeys(seeds))


def _case_list(value: str):
    cases = [part.strip() for part in value.split(",") if part.strip()]
    unknown = [case for case in cases if case not in FIDELITY_CASE_CHOICES]
    if unknown or not cases:
        raise argparse.ArgumentTypeError(f"unknown case(s) {', '.join(unknown) or repr(value)}: choose from "
                                         f"{', '.join(FIDELITY_CASE_CHOICES)}")  # fmt: skip
    return list(dict.fromkeys(cases))


def _ratio_range(value: str):
    parse = _ranged(float, 0.0, what="--rms-ratio-range bound")
    low, sep, high = value.partition(",")
    if not sep:
        raise argparse.ArgumentTypeError(f"--rms-ratio-range takes LOW,HIGH (e.g. 0.8,1.25), got {value!r}")
    bounds = parse(low.strip()), parse(high.strip())
    if bounds[0] > bounds[1]:
        raise argparse.ArgumentTypeError(f"--rms-ratio-range: LOW {bounds[0]} is above HIGH {bounds[1]}")
    return bounds


def _or_off(parse):
    """A gate threshold, or `off` for none (to turn a default gate off)."""

    def parse_or_off(value: str):
        return None if value.strip().lower() == "off" else parse(value)

    return parse_or_off


def _add_gate_options(p) -> None:
    gates = p.add_argument_group("gates (exit status 1 when a case falls outside; docs/fidelity.md)")
    gates.add_argument("--min-ssim", type=_ranged(float, -1.0, 1.0000001, what="--min-ssim", bounds="in [-1, 1]"),
                       default=None, help="lowest mean SSIM (YUV 4:2:0) a clip may have")  # fmt: skip
    gates.add_argument("--min-psnr", type=_ranged(float, 0.0, what="--min-psnr"), default=None, metavar="DB",
                       help="lowest mean PSNR (YUV 4:2:0, dB) a clip may have")  # fmt: skip
    gates.add_argument("--min-audio-cosine", type=_ranged(float, -1.0, 1.0000001, what="--min-audio-cosine",
                                                          bounds="in [-1, 1]"),
                       default=None, help="lowest log-mel spectral cosine of the audio a clip may have")  # fmt: skip
    gates.add_argument("--max-lpips", type=_ranged(float, 0.0, what="--max-lpips"), default=None,
                       help="highest mean LPIPS a clip may have (needs the lpips package and its AlexNet weights "
                            "locally; not computed is a failure)")  # fmt: skip
    gates.add_argument("--rms-ratio-range", type=_ratio_range, default=None, metavar="LOW,HIGH",
                       help="the RMS ratio of the audio (case / reference) must lie in [LOW, HIGH]")
    gates.add_argument("--min-audio-si-sdr", type=_or_off(_ranged(float, -1e9, what="--min-audio-si-sdr")),
                       default=DEFAULT_MIN_AUDIO_SI_SDR, metavar="DB|off",
                       help="lowest SI-SDR (dB) of a clip's audio channels (default: %(default)s; off: no gate)")
    gates.add_argument("--min-audio-correlation", type=_or_off(_ranged(float, -1.0, 1.0000001,
                                                                       what="--min-audio-correlation",
                                                                       bounds="in [-1, 1]")),
                       default=DEFAULT_MIN_AUDIO_CORRELATION, metavar="X|off",
                       help="lowest waveform correlation of a clip's audio channels (default: %(default)s; off: no "
                            "gate)")  # fmt: skip


def _gates(args):
    from diffusers_h3.fidelity import Gates

    return Gates(min_ssim=args.min_ssim, min_psnr=args.min_psnr, min_audio_cosine=args.min_audio_cosine,
                 max_lpips=args.max_lpips, rms_ratio_range=args.rms_ratio_range,
                 min_audio_si_sdr=args.min_audio_si_sdr, min_audio_correlation=args.min_audio_correlation)  # fmt: skip


def _add_fidelity_commands(sub) -> None:
    cmp = sub.add_parser("compare", help="distances between two clips: PSNR/SSIM per frame, LPIPS, audio cosine, "
                                        "SI-SDR and correlation")
    cmp.add_argument("reference", help="the reference clip (MP4)")
    cmp.add_argument("candidate", help="the clip to measure against it (same frame count and size)")
    cmp.add_argument("--json", action="store_true", help="print the full record (per-frame values) as JSON")
    cmp.add_argument("--debug", action="store_true", help="show the full traceback of an error instead of one line")
    _add_gate_options(cmp)
    cmp.set_defaults(func=cmd_compare)

    fid = sub.add_parser("fidelity", help="generate the same prompts and seeds with several cases and measure each "
                                          "against a reference case (JSON report + HTML page)")  # fmt: skip
    fid.add_argument("--model", default=None, help="local checkpoint folder or hub repo id (default: the embedded "
                                                   "tiny demo checkpoint, random weights)")  # fmt: skip
    fid.add_argument("--prompts", required=True, metavar="FILE",
                     help="UTF-8 text file, one prompt per line (blank lines and lines starting with # are skipped)")
    fid.add_argument("--seeds", type=_seed_list, default=[0], help="comma-separated seeds (default: 0)")
    fid.add_argument("--against", choices=FIDELITY_CASE_CHOICES, default="exact",
                     help="the reference case (default: %(default)s)")
    fid.add_argument("--cases", type=_case_list, default=_case_list(DEFAULT_FIDELITY_CASES),
                     help=f"comma-separated cases to measure, of {', '.join(FIDELITY_CASE_CHOICES)} "
                          f"(default: {DEFAULT_FIDELITY_CASES}; docs/fidelity.md says what each runs)")  # fmt: skip
    fid.add_argument("--out", default="fidelity", metavar="DIR",
                     help="output folder: clips, fidelity.json, index.html and images/; clips already there are "
                          "reused (default: %(default)s)")  # fmt: skip
    fid.add_argument("--height", type=int, default=None, help="canvas height (see `generate --help`)")
    fid.add_argument("--width", type=int, default=None, help="canvas width (see `generate --help`)")
    fid.add_argument("--frames", "--num-frames", dest="frames", type=int, default=124,
                     help="frames at 24 fps, as `generate` takes them (default: %(default)s)")
    fid.add_argument("--steps", type=_ranged(int, 2, MAX_STEPS + 1, what="--steps", bounds=STEPS_BOUNDS),
                     default=None, help="sigma grid points, as `generate` takes them (default: 50)")  # fmt: skip
    fid.add_argument("--device", default=None, help="device to run on (default: cuda when available, else cpu)")
    fid.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="weights dtype (default: as saved)")
    fid.add_argument("--cpu-offload", action="store_true", help="enable_model_cpu_offload (big models on one GPU)")
    fid.add_argument("--text-encoder-first", action="store_true",
                     help="for each case, load the text encoder alone, encode the prompts, free it, then load the DiT "
                          "and VAEs without it: the same clips, and the bf16 `exact` reference fits an 80 GB card")  # fmt: skip
    fid.add_argument("--crf", type=_ranged(int, CRF_RANGE[0], CRF_RANGE[1] + 1, what="--crf",
                                           bounds=f"from {CRF_RANGE[0]} to {CRF_RANGE[1]}"), default=0,
                     help="libx264's constant rate factor of the clips (default: 0, lossless: the distances are the "
                          "paths', not the encoder's)")  # fmt: skip
    fid.add_argument("--no-compile", action="store_true",
                     help="the presets without regional torch.compile (starts sooner; eager kernels' numbers)")
    fid.add_argument("--thumbnail-width", type=_ranged(int, 16, 4097, what="--thumbnail-width"), default=160,
                     metavar="PIXELS", help="width of each frame in the page's frame strips (default: %(default)s)")
    fid.add_argument("--no-progress", action="store_true", help="no progress bars")
    fid.add_argument("--debug", action="store_true", help="show the full traceback of an error instead of one line")
    _add_gate_options(fid)
    fid.set_defaults(func=cmd_fidelity)


def _read_prompts(path_text: str) -> List[str]:
    path = _check_file(path_text, "--prompts")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise UsageError(f"--prompts {path_text}: not UTF-8 text ({error.reason} at byte {error.start})",
                         "save the file as UTF-8") from None  # fmt: skip
    prompts = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not prompts:
        raise UsageError(f"--prompts {path_text}: holds no prompt", "write one prompt per line")
    return prompts


def _check_fidelity_arguments(args) -> None:
    """`compare` and `fidelity`: the checks that read only the arguments and files (standard library)."""
    if args.command == "compare":
        for flag, value in (("reference", args.reference), ("candidate", args.candidate)):
            _check_file(value, flag)
        return
    args.prompt_list = _read_prompts(args.prompts)
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {args.out}: is a file", "name a folder (created if missing)")
    if not out.absolute().parent.is_dir():
        raise UsageError(f"--out {args.out}: the folder {out.absolute().parent} does not exist", "create it first")
    if (args.height is None) != (args.width is None):
        raise UsageError("--height and --width have to be passed together", "pass both or neither")
    _check_model_option(args)


def cmd_compare(args) -> int:
    check_arguments(args)
    from diffusers_h3.fidelity import compare_clips, evaluate_gates, format_comparison, json_ready, read_clip

    clips = []
    for flag, value in (("reference", args.reference), ("candidate", args.candidate)):
        try:
            clips.append(read_clip(value))
        except ValueError as error:
            raise UsageError(f"{flag} {value}: {str(error).rstrip('.')}", "pass an MP4 clip") from None
    try:
        record = compare_clips(*clips)
    except ValueError as error:  # "<what differs>; <the fix>"
        what, _, fix = str(error).partition("; ")
        raise UsageError(what, fix or "compare two clips of the same length and size") from None
    audio = record["audio"] or {}
    summary = {"ssim_yuv420": record["ssim_yuv420"]["mean"], "psnr_yuv420": record["psnr_yuv420"]["mean"],
               "lpips": record["lpips"]["value"], "audio_cosine": audio.get("spectral_cosine"),
               "rms_ratio": audio.get("rms_ratio"), "audio_si_sdr_db": audio.get("si_sdr_db"),
               "audio_correlation": audio.get("correlation"),
               "no_audio": record["audio"] is None and "audio_missing" not in record,
               "rms_ratio_range": [audio["rms_ratio"]] * 2 if "rms_ratio" in audio else None}  # fmt: skip
    gates = evaluate_gates(summary, _gates(args))
    record["gates"] = gates
    if args.json:
        print(json.dumps(json_ready(record), indent=2))
    else:
        print(format_comparison(record))
        for name, gate in gates.items():
            print(f"gate {name} {gate['threshold']}: {'pass' if gate['passed'] else 'FAIL'} "
                  f"({gate.get('reason') or gate['value']})")  # fmt: skip
    return 0 if all(gate["passed"] for gate in gates.values()) else GATE_FAILED


def _rounded(value, digits: int) -> str:
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value if value is not None else "n/a")


def cmd_fidelity(args) -> int:
    check_arguments(args)
    if args.model is not None and args.model_path is None:
        check_hub_reachable(args.model, "--model", file="model_index.json")
    _check_device(args)
    if args.model is None and args.height is None:
        args.height, args.width = DEMO_CANVAS
    for number, prompt in enumerate(args.prompt_list, start=1):  # the request checks of `generate`, per prompt
        request = argparse.Namespace(**{**vars(args), "prompt": prompt})
        try:
            _check_prompt_text(prompt)
            _check_prompt_length(request, _check_request(request, "t2va", {}).config)
        except UsageError as error:
            raise UsageError(f"--prompts {args.prompts} prompt {number}: {error}".split(" — ")[0],
                             str(error).partition(" — ")[2] or "fix the prompt") from None  # fmt: skip
    from diffusers_h3.fidelity import FidelityRunError, FidelitySettings, run_fidelity

    def load(case, without=("text_encoder", "tokenizer", "processor") if args.text_encoder_first else ()):
        case_args = argparse.Namespace(**{**vars(args), "speed": case.speed, "quantize": case.dit_format,
                                          "quantize_text_encoder": case.text_encoder_format, "memory_recipe": None,
                                          "task": "t2va", "without": without})  # fmt: skip
        return _load_pipeline(case_args)

    def load_text_encoder(case):
        return load(case, without=("transformer", "transformer_ref"))

    try:
        settings = FidelitySettings(prompts=args.prompt_list, seeds=args.seeds, cases=args.cases,
                                    against=args.against, height=args.height, width=args.width,
                                    num_frames=args.frames, steps=args.steps, compile=not args.no_compile,
                                    model=args.model or "tiny demo checkpoint", crf=args.crf)  # fmt: skip
        note = None
        if args.model is None:
            note = ("The tiny demo checkpoint has random weights: these are numerical distances between the paths, "
                    "not a measure of quality.")  # fmt: skip
        report = run_fidelity(load, settings, Path(args.out).expanduser(), gates=_gates(args),
                              progress=not args.no_progress, note=note, thumbnail_width=args.thumbnail_width,
                              extra={"device": _device(args), "dtype": args.dtype},
                              load_text_encoder=load_text_encoder if args.text_encoder_first else None)  # fmt: skip
    except FidelityRunError as error:
        raise UsageError(f"--out {args.out}: {error}" if "holds a fidelity run" in str(error) else str(error),
                         "see `diffusers-h3 fidelity --help`") from None  # fmt: skip
    out = Path(args.out)
    for name, case in report["cases"].items():
        summary = case.get("summary") or {}
        seconds = case["speed"].get("seconds")
        line = f"{name:18s} {case['status']:9s} {seconds if seconds is not None else 'n/a'} s/clip"
        if summary:
            line += "".join(f"  {label} {_rounded(summary[key], digits)}" for label, key, digits in (
                ("SSIM", "ssim_yuv420", 4), ("PSNR dB", "psnr_yuv420", 2), ("audio cosine", "audio_cosine", 4),
                ("SI-SDR dB", "audio_si_sdr_db", 2), ("corr", "audio_correlation", 4),
                ("RMS ratio", "rms_ratio", 3)))  # fmt: skip
        failed = [g for g, r in (case.get("gates") or {}).items() if not r["passed"]]
        if failed:
            line += f"  FAILED {', '.join(failed)}"
        if case.get("error"):
            line += f"  ({case['error']})"
        print(line)
    print(f"wrote {out / 'fidelity.json'} and {out / 'index.html'}: {'pass' if report['passed'] else 'FAIL'}")
    return 0 if report["passed"] else GATE_FAILED


def _exit_on_interrupt() -> None:
    """Ctrl-C: one line and exit code 130 (128 + SIGINT), the shell convention."""
    print(f"{PROG}: interrupted", file=sys.stderr)
    raise SystemExit(130) from None


def parse_arguments(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parse `argv` and run the checks that read only the arguments (`check_arguments`): a mistake exits with one line
    and code 2. The console entry point calls it before the package (and torch) is imported."""
    args = build_parser().parse_args(argv)
    try:
        check_arguments(args)
    except UsageError as error:
        if args.debug:
            raise
        print(f"{PROG}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        _exit_on_interrupt()
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UsageError as error:
        if args.debug:
            raise
        print(f"{PROG}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        if args.debug:
            raise
        _exit_on_interrupt()


if __name__ == "__main__":
    sys.exit(main())
