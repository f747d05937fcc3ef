"""Whole t2va and fl2va requests on one GPU with a FastH3-shaped stack: random weights at the released sizes in the
stack's layout, its 4-forward preset (the trained rungs 999/749/500/250, shifts 12 / 3, VSA 0.9 on 64-token tiles
with the trained gates), its light VAE and its NVFP4 text encoder (docs/checkpoints.md, "FastH3 stacks").

    python benchmarks/fasth3.py --out benchmarks/results/fasth3_h200.json          # the two *_fastest cases
    python benchmarks/fasth3.py --out benchmarks/results/fasth3_h100.json          # the same on one 80 GB H100
    python benchmarks/fasth3.py --dit-format bf16 --cases t2va_fasth3,fl2va_fasth3,t2va_fasth3_fastest,\
        fl2va_fasth3_fastest --out ...                                               # bf16 cases (an H200 holds them)
    python benchmarks/fasth3.py --tiny --out /tmp/fasth3_tiny.json                   # CPU smoke test

The stack (``benchmarks/request.py``'s builder with a hook per component). By default (``--dit-format quantized``)
the text encoder, the DiT and the video VAE are built on the CPU and reach the device already quantized, one layer
at a time (``quantize(module, config, device=...)``, what ``from_pretrained(..., quantization_config=...)`` does
for a stack on disk): the 16-bit DiT never sits on the device whole, which is what fits one 80 GB card. Their random
weights are drawn on the GPU (``request.random_init_on``): PyTorch's CPU RNG fills on one thread, too slow for the
~60 G elements, so each large ``torch.nn.init`` / transformers init runs on a same-shape GPU tensor, copied back.

* text encoder: Qwen3-VL-32B config, decoder layers 0-50, block linears quantized to weight-only NVFP4 (the vision
  tower and the LM head kept 16-bit, as the stack's NVFP4 encoder does);
* DiT: ``MiniMaxH3Transformer3DModel()`` plus one random ``to_gate_compress`` (7168 x 5376) per block; quantized to
  the ``fastest`` preset's GEMM format (FP8 where FP8 tensor cores exist, gates included), which the preset then
  keeps; with ``--dit-format bf16`` built in bf16 on the device (the ``_fastest`` cases then quantize it in place);
  the FastH3 preset applied with ``enable_fasth3_preset`` (schedule + VSA with the gates);
* video VAE: the released VAE's decoder depth-cut to 8 evenly spaced blocks through the exported-decoder loader
  (``load_nvfp4_decoder`` on a ``decoder.pt``-format dict of its own weights): weight-only NVFP4 decoder linears.

Memory: ``peak_gib`` / ``peak_reserved_gib`` are PyTorch's allocator peaks of the timed request; ``device_peak_gib``
is the card's count (``DeviceMemorySampler``: NVML, the CUDA context and workspaces included) over the case (warm-up
and timed request), and ``build_device_peak_gib`` over building the stack; ``within_card_bound`` compares the case's
with ``--card-bound-gib`` (75 by default: what must hold on an 80 GB card). The allocator runs as the memory recipes
run it: expandable segments, capped (``--gpu-cap-gib``, default the bound less 1 GiB for the CUDA context and
workspaces) from before the build, since the caching allocator would otherwise keep freed blocks up to the whole card.

Cases (in this order; the ``_fastest`` ones quantize a bf16 DiT in place, so the bf16 ones come first):

* ``t2va_fasth3`` / ``fl2va_fasth3`` (``--dit-format bf16`` only): the preset as trained: bf16 weights, VSA 0.9 with
  bf16 attention, regional compile, diffusers' tiled decode of the light decoder;
* ``t2va_fasth3_fastest`` / ``fl2va_fasth3_fastest``: ``enable_speed_preset("fastest")`` (FP8 GEMMs, the gates
  included; batched-tile compiled decode), which keeps the stack's VSA 0.9, with INT8 Q/K.

Each case: one untimed warm-up request (2 forwards, decode the first time after a change) and one timed request with
all 4 forwards (``benchmarks/request.py``'s protocol and stage timer). The JSON is written after every case.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
import traceback

import request as request_suite
import torch

from _common import DeviceMemorySampler, device_peak_fields, result_header, write_json


CASES = ("t2va_fasth3", "fl2va_fasth3", "t2va_fasth3_fastest", "fl2va_fasth3_fastest")
DEFAULT_CASES = ("t2va_fasth3_fastest", "fl2va_fasth3_fastest")
PRESET = "fasth3-4step-preview-vsa"
STUDENT_LAYERS = 8  # the light VAE's exported NVFP4 decoder ("fast-8L")
OUTSIDE_ALLOCATOR_GIB = 1.0  # the CUDA context, cuBLAS workspaces and kernels: 0.6-0.75 GiB measured (docs/memory.md)


def case_setup(case):
    """``request.py``'s case record: (task, speed preset, sigma points, flow_shift, audio_flow_shift). The sigma
    points are the preset's trained count, so the calls run its rungs (the shifts are left to the preset)."""
    task = case.split("_", 1)[0]
    return task, "fastest" if case.endswith("_fastest") else None, 5, None, None


BUILT_ON_CPU = ("text_encoder", "transformer", "vae")  # --dit-format quantized


def stack_hook(device, tiny, dit_format="quantized"):
    """The component hook that gives ``request.build_pipeline``'s random components the FastH3 stack's layout; with
    ``dit_format="quantized"`` it also brings the components built on the CPU to ``device``, quantized layer by layer
    (the DiT's gates included)."""
    from diffusers_h3.loaders.fasth3_vae import load_nvfp4_decoder
    from diffusers_h3.quantizers import NVFP4Config, quantize
    from diffusers_h3.quantizers.config import DEFAULT_MODULES_TO_NOT_CONVERT
    from diffusers_h3.testing.fasth3 import add_random_gates, nvfp4_decoder_export

    moving = dit_format == "quantized" and not tiny
    target = device if moving else None

    def hook(name, module):
        if name == "text_encoder":
            config = NVFP4Config(modules_to_not_convert=[*DEFAULT_MODULES_TO_NOT_CONVERT, "visual"])
            quantize(module, config, device=target)
        elif name == "transformer":
            # the gates' nn.Linear init is on the module's device: on the GPU's RNG when that is the CPU
            on_gpu_rng = moving and device.type == "cuda"
            with request_suite.random_init_on(device) if on_gpu_rng else contextlib.nullcontext():
                add_random_gates(module)
            if dit_format == "quantized":
                quantize(module, request_suite.preset_dit_config(device), device=target)
        elif name == "vae":
            layers = min(STUDENT_LAYERS, len(module.decoder.transformer_blocks))
            load_nvfp4_decoder(module, nvfp4_decoder_export(module, layers), source="decoder.pt layout (random)")
            module = module.to(device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return module

    return hook


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON to write (e.g. benchmarks/results/fasth3_h100.json)")
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES),
                        help=f"comma list from {', '.join(CASES)} (default: {','.join(DEFAULT_CASES)})")
    parser.add_argument("--no-compile", action="store_true", help="no regional torch.compile")
    parser.add_argument("--no-warmup", action="store_true", help="skip the warm-up request (smoke tests only)")
    parser.add_argument("--tiny", action="store_true", help="tiny random components (CPU smoke test)")
    parser.add_argument("--device", default=None, help="default: cuda (cpu with --tiny when no GPU)")
    parser.add_argument("--commit", default=None, help="commit measured (the device copy has no .git)")
    parser.add_argument("--export", choices=("one-shot", "streamed"), default="streamed",
                        help="streamed (default, what the CLI runs): the MP4 written while the video decodes")
    parser.add_argument("--dit-format", choices=("quantized", "bf16"), default="quantized",
                        help="quantized (default): the components reach the device quantized layer by layer, the "
                             "DiT in the fastest preset's format (fits one 80 GB card); bf16: the DiT built in bf16 on "
                             "the device (needed by the bf16 cases)")  # fmt: skip
    parser.add_argument("--gpu-cap-gib", type=float, default=None,
                        help="hold the caching allocator to this many GiB, with expandable segments, from before the "
                             "build (default: the card bound less 1 GiB for what lies outside the allocator, so that "
                             "the card's count stays within the bound; 0: no cap)")
    parser.add_argument("--card-bound-gib", type=float, default=75.0,
                        help="device peak each case must stay within (default: %(default)s, an 80 GB card)")
    args = parser.parse_args(argv)

    wanted = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(wanted) - set(CASES))
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}: choose from {', '.join(CASES)}")
    bf16_cases = [c for c in wanted if not c.endswith("_fastest")]
    if bf16_cases and args.dit_format != "bf16":
        raise SystemExit(f"{', '.join(bf16_cases)} run the bf16 DiT: pass --dit-format bf16 (a card that holds it)")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() or not args.tiny else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks/fasth3.py needs a CUDA GPU (or --tiny for the CPU smoke test)")
    # Made before this process touches CUDA: NVML's count of the whole card for this process.
    sampler = DeviceMemorySampler(device.index or 0).start() if device.type == "cuda" else None
    if args.gpu_cap_gib is None:
        args.gpu_cap_gib = args.card_bound_gib - OUTSIDE_ALLOCATOR_GIB
    args.allocator = None
    if device.type == "cuda" and args.gpu_cap_gib > 0:
        # as the memory recipes run: the caching allocator would otherwise keep freed blocks up to the whole card
        from diffusers_h3.parallel.memory_recipes import hold_allocator

        args.allocator = hold_allocator(args.gpu_cap_gib, device)
    run = [c for c in CASES if c in wanted]
    for case in run:
        request_suite.CASE_SETUP[case] = case_setup(case)

    import diffusers_h3
    from diffusers_h3.attention_processors import vsa_state
    from diffusers_h3.loaders.fasth3 import get_fasth3_preset
    from diffusers_h3.pipelines.speed_presets import compile_blocks

    preset = get_fasth3_preset(PRESET)
    started = time.perf_counter()
    build_window = sampler.window("build") if sampler is not None else contextlib.nullcontext()
    with build_window:
        on_cpu = BUILT_ON_CPU if args.dit_format == "quantized" else ()
        pipe = request_suite.build_pipeline(device, args.tiny, build_on_cpu=on_cpu,
                                            component_hook=stack_hook(device, args.tiny, args.dit_format))  # fmt: skip
        pipe.set_progress_bar_config(disable=True)
        diffusers_h3.enable_fasth3_preset(pipe, preset)
    build_s = time.perf_counter() - started
    build_peak = None
    if sampler is not None:
        build_peak = device_peak_fields(sampler.windows["build"], None, sampler.source)
    print(f"built the FastH3-shaped stack in {build_s:.1f} s" + (f", device peak {build_peak['device_peak_gib']} GiB"
          if build_peak else ""), flush=True)  # fmt: skip

    results, notes, applied, decoders_warm = {}, {}, None, False
    out_dir = tempfile.mkdtemp(prefix="h3_fasth3_")
    for case in run:
        speed = case_setup(case)[1]
        try:
            if (speed or "fasth3") != applied:
                torch._dynamo.reset()
                if speed is not None:
                    # on a FastH3 stack "fastest" keeps the stack's VSA 0.9 (INT8 Q/K)
                    config = diffusers_h3.SpeedPresetConfig(speed, compile=not args.no_compile)
                    diffusers_h3.enable_speed_preset(pipe, config)
                elif not args.no_compile and device.type == "cuda":
                    compile_blocks(pipe.transformer, "fastest")
                applied, decoders_warm = speed or "fasth3", False
            case_start = time.perf_counter()
            window = sampler.window(case) if sampler is not None else contextlib.nullcontext()
            with window:
                if not args.no_warmup:
                    request_suite.warm_up(pipe, case, args.tiny, decode=not decoders_warm)
                    decoders_warm = True
                warmup_s = time.perf_counter() - case_start
                record = request_suite.request(pipe, case, device, out_dir, forwards_limit=None, tiny=args.tiny,
                                               export=args.export, sampler=sampler)  # fmt: skip
            record.pop("prompt_embeds", None)
            if sampler is not None:
                record.update(device_peak_fields(sampler.windows[case], record["peak_reserved_gib"], sampler.source))
                record["within_card_bound"] = record["device_peak_gib"] <= args.card_bound_gib
        except Exception as error:  # noqa: BLE001 - one failing case must not lose the others
            results[case] = {"ms": None, "stages": None, "peak_gib": None}
            notes[case] = f"failed: {type(error).__name__}: {str(error)[:400]}"
            print(f"{case:22s} {notes[case]}", flush=True)
            traceback.print_exc()
        else:
            report = diffusers_h3.describe(pipe)
            record.update({
                "warmup_s": round(warmup_s, 1),
                "sigmas": [round(float(s), 6) for s in pipe.scheduler.sigmas],
                "audio_sigmas": [round(float(s), 6) for s in pipe.audio_scheduler.sigmas],
                "vsa": {k: v for k, v in (vsa_state(pipe.transformer) or {}).items() if k != "path"},
                "fasth3": report.get("fasth3"),
                "speed_preset": report.get("speed_preset"),
                "rel_l2": None,  # random weights: the distance to the trained output is not measured here
            })  # fmt: skip
            results[case] = record
            stages = " ".join(f"{k} {v / 1000:.2f}" for k, v in record["stages"].items())
            device_peak = f", device {record['device_peak_gib']} GiB" if "device_peak_gib" in record else ""
            print(f"{case:22s} {record['ms'] / 1000:7.2f} s ({stages}) peak {record['peak_gib']} GiB{device_peak}",
                  flush=True)  # fmt: skip
        write_report(args, results, notes, build_s, preset, build_peak)
    if sampler is not None:
        sampler.stop()


def write_report(args, results, notes, build_s, preset, build_peak=None):
    report = {
        **result_header("fasth3", args.commit, device="cpu (tiny smoke test)" if args.tiny else None),
        "dit_format": args.dit_format,
        "card_bound_gib": args.card_bound_gib,
        "allocator": getattr(args, "allocator", None),
        "build_device_peak_gib": build_peak["device_peak_gib"] if build_peak else None,
        "shape": {"height": 64 if args.tiny else request_suite.HEIGHT, "width": 96 if args.tiny else request_suite.WIDTH,
                  "frames": request_suite.num_frames(args.tiny), "prompt_tokens": request_suite.PROMPT_TOKENS,
                  "tiny": args.tiny,
                  "stack": "FastH3-shaped, random weights: NVFP4 weight-only text encoder (Qwen3-VL-32B config, layers "
                           f"0-50), {'quantized-on-the-way' if args.dit_format == 'quantized' else 'bf16'} DiT with 50 "
                           "to_gate_compress gates, released VAE depth-cut to an 8-block NVFP4 weight-only decoder "
                           "(load_nvfp4_decoder)" if not args.tiny else "tiny",
                  "preset": preset.describe()},
        "protocol": "random weights built on the device; per case 1 warm-up request (2 forwards) + 1 timed request "
                    "with every forward (CUDA-synchronized wall times per stage, benchmarks/request.py's timer)",
        "build_s": round(build_s, 1),
        "cases": results,
        "notes": notes,
    }  # fmt: skip
    write_json(args.out, report)


if __name__ == "__main__":
    main()
