"""The single-GPU placement recipes of ``diffusers_h3/parallel/placement.py`` at the released sizes: peak GPU memory and
the stage times of one 768x1344, 124-frame t2va request (text encode, one DiT forward, video and audio decode) under
the memory cap of the GPU class each recipe is for.

    python benchmarks/placement.py --out benchmarks/results/placement_h200.json
    python benchmarks/placement.py --cases offload_48gb,offload_40gb --merge --out benchmarks/results/placement_h200.json
    python benchmarks/placement.py --tiny --cases offload_48gb --out /tmp/placement_tiny.json   # CPU smoke test

Cases, in this order (one pipeline per recipe; the offload cases share theirs, only the cap differs):

* ``resident_80gb``  ``single_gpu_resident_kwargs()``: FP8 DiT (``FP8Config``) + W8A16 text encoder
                     (``W8A16Config``), everything resident on the GPU; cap 78.5 GiB.
* ``offload_48gb``   ``enable_low_memory_offload(pipe, "cuda", low_cpu_mem_usage=True)`` on a pipeline on the CPU:
                     group offload (DiT by blocks with CUDA-stream prefetch, text encoder by leaves), model offload for
                     the VAEs; cap 47.0 GiB.
* ``offload_40gb``   the same pipeline and recipe; cap 39.0 GiB.
* ``offload_24gb``   the same pipeline and recipe; cap 22.5 GiB (24 GB cards).

Caps: what a card of the class gives PyTorch (A100 / H100 80 GB: ~79.1 GiB; RTX A6000 / 6000 Ada: ~47.5 GiB; A100
40 GB: ~39.6 GiB) less ~0.6 GiB for the CUDA context and library handles, which on the H200 lie outside the cap (the
JSON records them as ``non_torch_gib``). L40S / A40 (~44.5 GiB) fall between the two offload caps. ``--caps`` overrides.
The cap is ``torch.cuda.set_per_process_memory_fraction(cap / total)``, which bounds the caching allocator's reserved
memory; it is set after building, before the case's warm-up, and applies to the requests only.

Weights: random, no downloads. Each model is built directly on the GPU in bf16 (``request.build_pipeline``: the
Qwen3-VL-32B text encoder from its public config, here with all 64 decoder layers as ``from_pretrained`` loads them
although the early exit runs 50; the 50-block DiT; both VAEs) and quantized in place right after it is built with the
configs the recipe passes to ``from_pretrained`` (``quantize(module, config)``), one model at a time, so that no two
bf16 models are ever on the GPU together. The offload cases quantize the DiT and the text encoder with W8A16, not
bf16: bf16 DiT (61.7 GiB) + bf16 text encoder (62 GiB) + VAEs (5.8 GiB) would fill this host's 128 GiB of RAM, and
with pinned copies exceed it. ``enable_low_memory_offload`` is the same for any weights. Those models move to the CPU
after quantization (host memory is checked before each move), then the recipe is applied; ``low_cpu_mem_usage=True``
pins each group on the fly at every transfer instead of keeping pinned copies of all the weights (diffusers' pinned
copies are made for all groups before the originals are released, and pinned sizes round up to powers of two: ~2.5x
the W8A16 DiT while the recipe is applied, about 118 GiB of host memory in all here, estimated).

Protocol per case: cap, one untimed warm-up request (one forward, decode on), then one timed request: the t2va case of
``benchmarks/request.py`` (50 sigma points) interrupted after its first forward by ``stop_after(1)`` (so the forward is
the first step of a real schedule), ``output_type="np"`` (video and audio decode run; no MP4 mux). Stage times are
CUDA-synchronized wall times (``request.StageTimer``; ``forwards`` includes the offload transfers the forward waits
for). The partial JSON is written after every case.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import time
import traceback
from pathlib import Path

import torch
from request import (
    HEIGHT,
    NUM_FRAMES,
    PROMPT_TOKENS,
    QWEN3_VL_32B_TEXT,
    TEXT_ENCODER_LAYER,
    WIDTH,
    StageTimer,
    build_pipeline,
    request_kwargs,
    stop_after,
)

from _common import result_header, write_json


CASES = ("resident_80gb", "offload_48gb", "offload_40gb", "offload_24gb")
# case -> (recipe, cap in GiB on a CUDA device)
CASE_SETUP = {
    "resident_80gb": ("resident", 78.5),
    "offload_48gb": ("offload", 47.0),
    "offload_40gb": ("offload", 39.0),
    "offload_24gb": ("offload", 22.5),
}
CAP_BASIS = (
    "usable memory of the class's card as PyTorch sees it (A100/H100 80 GB ~79.1 GiB, RTX A6000/6000 Ada ~47.5 GiB, "
    "A100 40 GB ~39.6 GiB) less ~0.6 GiB of CUDA context and library handles, which on the H200 lie outside the cap "
    "(non_torch_gib); L40S/A40 (~44.5 GiB) fall between the two offload caps; 24 GB cards (RTX 3090/4090, A10, L4: ~23.5 GiB) "
    "less the context and ~0.4 GiB of margin"
)
RECIPE_LINES = {
    "resident": 'MiniMaxH3Pipeline.from_pretrained(repo, task="t2va", dtype=torch.bfloat16, '
                '**single_gpu_resident_kwargs()); drop_unused_text_encoder_layers(pipe); pipe.to("cuda")',
    "offload": 'drop_unused_text_encoder_layers(pipe); enable_low_memory_offload(pipe, "cuda", low_cpu_mem_usage=True)'
               '  # pipe on the CPU',
}  # fmt: skip
REQUEST_CASE = "t2va_native"  # request.py's t2va request: 50 sigma points, 512-token prompt
SIGMA_POINTS = 50
HOST_MARGIN_GIB = 6.0
GiB = 2**30


# ---------------------------------------------------------------------------------------------------------------------
# Memory helpers


def _gib(nbytes):
    return round(nbytes / GiB, 2)


def module_bytes(module, device_type=None):
    """Bytes of ``module``'s parameters and buffers (only those on a ``device_type`` device, when given)."""
    tensors = (*module.parameters(), *module.buffers())  # both iterators yield each shared tensor once
    return sum(t.numel() * t.element_size() for t in tensors if device_type is None or t.device.type == device_type)


def host_available_bytes():
    """``MemAvailable`` of /proc/meminfo (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_host_room(nbytes, what):
    """Refuse (MemoryError, recorded as the case's failure) rather than let the kernel kill the whole run."""
    available = host_available_bytes()
    if available is not None and available - nbytes < HOST_MARGIN_GIB * GiB:
        raise MemoryError(f"moving {what} ({nbytes / GiB:.1f} GiB) to the CPU would leave less than "
                          f"{HOST_MARGIN_GIB} GiB of host memory ({available / GiB:.1f} GiB available)")  # fmt: skip


def host_memory():
    """Resident set size now and its high-water mark over the process (pinned host memory included)."""
    current = None
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                current = int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    out = {"host_rss_gib": _gib(current) if current is not None else None, "host_peak_rss_gib": _gib(peak)}
    if torch.cuda.is_available():
        stats = torch.cuda.host_memory_stats()
        out["pinned_host_gib"] = {
            k: _gib(v) for k, v in stats.items() if "bytes" in k and k.endswith((".current", ".peak"))
        }
    return out


def host_status():
    available = host_available_bytes()
    return f", host MemAvailable {available / GiB:.1f} GiB" if available is not None else ""


def clean_device(device, fraction=None):
    """Free what the previous step left (cycles through offload hooks, cached blocks, pinned staging buffers); then
    set the allocator cap (a fraction of the device; 1.0 lifts it)."""
    gc.collect()
    if device.type != "cuda":
        return
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    if hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()
    if fraction is not None:
        torch.cuda.set_per_process_memory_fraction(fraction, device)
    torch.cuda.reset_peak_memory_stats(device)


# ---------------------------------------------------------------------------------------------------------------------
# The recipes


def describe_weights(pipe, configs, tiny, layers):
    """What each model is, and its weight bytes (quantized storage included)."""
    from diffusers_h3.quantizers import quantization_summary

    fp8_note = " (CPU: fp32 emulation of the W8A8 numerics)" if tiny else ""
    te = "tiny Qwen3-VL" if tiny else f"Qwen3-VL-32B config, {layers} decoder layers + vision tower"
    what = {
        "text_encoder": te,
        "transformer": "tiny MiniMax-H3 DiT"
        if tiny
        else f"MiniMax-H3 DiT, {len(pipe.transformer.transformer_blocks)} blocks",
        "vae": "video VAE, bf16 (fp32 modules kept)",
        "audio_vae": "audio VAE, fp32",
    }
    weights, sizes = {}, {}
    for name, text in what.items():
        module = getattr(pipe, name)
        config = configs.get(name)
        if config is None:
            weights[name] = text if name in ("vae", "audio_vae") else f"{text}, bf16 (fp32 modules kept)"
        else:
            summary = quantization_summary(module)
            kind = type(config).__name__
            weights[name] = (f"{text}, {kind} ({summary['quantized_layers']} Linear layers; the rest 16/32-bit)"
                             + (fp8_note if kind == "FP8Config" else ""))  # fmt: skip
        sizes[name] = round(module_bytes(module) / GiB, 4)
    return weights, sizes


def build_recipe(recipe, device, tiny, layers):
    """The pipeline for ``recipe``: ``(pipe, placements, weights, weights_gib)``."""
    from diffusers_h3.parallel.placement import (
        drop_unused_text_encoder_layers,
        enable_low_memory_offload,
        single_gpu_resident_kwargs,
    )
    from diffusers_h3.quantizers import W8A16Config, quantize

    if recipe == "resident":
        # the configs the recipe hands to from_pretrained, applied in place to the random weights
        mapping = single_gpu_resident_kwargs()["quantization_config"].quant_mapping
        configs = {name: mapping[name] for name in ("transformer", "text_encoder")}
    else:
        configs = {"transformer": W8A16Config(), "text_encoder": W8A16Config()}

    started = time.perf_counter()

    def hook(name, module):
        config = configs.get(name)
        if config is not None:
            quantize(module, config)
        if recipe == "offload":  # the recipe starts from a pipeline on the CPU
            check_host_room(module_bytes(module) if device.type == "cuda" else 0, name)
            module = module.to("cpu")
        clean_device(device)  # the freed bf16 weights go back to the device before the next model is built
        print(f"  {name}: {module_bytes(module) / GiB:.2f} GiB{f' ({type(config).__name__})' if config else ''}, "
              f"{time.perf_counter() - started:.1f} s{host_status()}", flush=True)  # fmt: skip
        return module

    pipe = build_pipeline(device, tiny, component_hook=hook, text_encoder_layers=layers)
    pipe.set_progress_bar_config(disable=True)
    trimmed = drop_unused_text_encoder_layers(pipe)  # part of both recipes: the never-run layers cost memory only
    clean_device(device)
    print(f"  dropped never-run text encoder layers: {trimmed}", flush=True)
    if recipe == "offload":
        placements = enable_low_memory_offload(pipe, device, low_cpu_mem_usage=True)
    else:
        placements = f"all on {device.type}"
    weights, sizes = describe_weights(pipe, configs, tiny, layers)
    weights["text_encoder_layers"] = trimmed
    return pipe, placements, weights, sizes


# ---------------------------------------------------------------------------------------------------------------------
# One request


def one_request(pipe, tiny):
    kwargs = request_kwargs(REQUEST_CASE, tiny)
    assert kwargs["num_inference_steps"] == SIGMA_POINTS and kwargs["output_type"] == "np"
    out = pipe(**kwargs, generator=torch.Generator().manual_seed(0), callback_on_step_end=stop_after(1))
    assert out.frames is not None and out.audio is not None


def device_bytes_by_component(pipe, device):
    """GiB of each component's parameters and buffers that sit on ``device`` now (what stays resident)."""
    return {name: _gib(module_bytes(component, device.type)) for name, component in pipe.components.items()
            if isinstance(component, torch.nn.Module)}  # fmt: skip


def timed_request(pipe, device, tiny):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        resident = torch.cuda.memory_allocated(device)
        resident_by_component = device_bytes_by_component(pipe, device)
        free, total = torch.cuda.mem_get_info(device)
        non_torch = (total - free) - torch.cuda.memory_reserved(device)
    with StageTimer(pipe, device) as timer:
        start = time.perf_counter()
        one_request(pipe, tiny)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ms = (time.perf_counter() - start) * 1000
    if len(timer.forwards) != 1:
        raise RuntimeError(f"expected exactly one DiT forward, ran {len(timer.forwards)}")
    stages = {"text_encode": timer.stages.get("text_encode", 0.0), "forwards": sum(timer.forwards)}
    stages.update({k: timer.stages.get(k, 0.0) for k in ("video_decode", "audio_decode")})
    stages["other"] = ms - sum(stages.values())  # packing, schedules, noise, numpy conversion
    record = {
        "ms": round(ms, 1),
        "stages": {k: round(v, 1) for k, v in stages.items()},
        "forward_ms": [round(t, 1) for t in timer.forwards],
        "forwards": 1,
        "sigma_points": SIGMA_POINTS,
        "resident_gib": None,
        "peak_allocated_gib": None,
        "peak_reserved_gib": None,
        "non_torch_gib": None,
    }
    if device.type == "cuda":
        record.update(
            resident_gib=_gib(resident),
            peak_allocated_gib=_gib(torch.cuda.max_memory_allocated(device)),
            peak_reserved_gib=_gib(torch.cuda.max_memory_reserved(device)),
            non_torch_gib=_gib(non_torch),
            resident_by_component_gib=resident_by_component,
            resident_by_component_after_gib=device_bytes_by_component(pipe, device),
        )
    record.update(host_memory())
    return record


def run_case(pipe, case, cap_gib, device, tiny, warmup):
    """Cap, warm-up, timed request: the case's record."""
    fraction = None
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        fraction = min(1.0, cap_gib * GiB / total)
    clean_device(device, fraction)
    if device.type == "cuda":
        reserved = torch.cuda.memory_reserved(device)
        if reserved > cap_gib * GiB:
            raise MemoryError(f"{reserved / GiB:.1f} GiB already reserved before the request exceeds the "
                              f"{cap_gib} GiB cap")  # fmt: skip
    start = time.perf_counter()
    if warmup:
        one_request(pipe, tiny)
    warmup_s = time.perf_counter() - start
    record = timed_request(pipe, device, tiny)
    record["warmup_s"] = round(warmup_s, 1)
    record["cap_fraction"] = round(fraction, 4) if fraction is not None else None
    return record


# ---------------------------------------------------------------------------------------------------------------------
# Main


def parse_caps(text):
    caps = {}
    for item in (x for x in text.split(",") if x):
        name, _, value = item.partition("=")
        if name not in CASE_SETUP:
            raise SystemExit(f"--caps: unknown case {name!r}: choose from {', '.join(CASES)}")
        try:
            caps[name] = float(value)
        except ValueError:
            raise SystemExit(f"--caps: {item!r} is not CASE=GiB") from None
        if caps[name] <= 0:
            raise SystemExit(f"--caps: {item!r}: the cap must be positive")
    return caps


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/placement_h200.json")
    parser.add_argument("--cases", default=",".join(CASES), help="comma list of cases to run (default: all)")
    parser.add_argument("--caps", default="", help="override caps in GiB, e.g. offload_48gb=44.5")
    parser.add_argument("--text-encoder-layers", type=int, default=QWEN3_VL_32B_TEXT["num_hidden_layers"],
                        help="decoder layers built (default 64, the released model; 51 is the fewest the early exit "
                             "needs)")  # fmt: skip
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the other cases already in --out (a run split over several commands)",
    )
    parser.add_argument("--no-warmup", action="store_true", help="skip the warm-up request (smoke tests only)")
    parser.add_argument("--tiny", action="store_true", help="tiny random components (CPU smoke test; no caps)")
    parser.add_argument("--commit", default=None, help="commit measured (the device copy has no .git)")
    args = parser.parse_args()

    wanted = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(wanted) - set(CASES))
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}: choose from {', '.join(CASES)}")
    if not wanted:
        raise SystemExit("--cases is empty")
    caps = {case: cap for case, (_, cap) in CASE_SETUP.items()}
    caps.update(parse_caps(args.caps))
    if args.text_encoder_layers <= TEXT_ENCODER_LAYER:
        raise SystemExit(f"--text-encoder-layers must exceed {TEXT_ENCODER_LAYER} (the pipeline reads "
                         f"hidden_states[{TEXT_ENCODER_LAYER}])")  # fmt: skip
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if not args.tiny and device.type != "cuda":
        raise SystemExit("benchmarks/placement.py needs a CUDA GPU (or --tiny for the CPU smoke run)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks/placement.py needs a CUDA GPU (or --tiny for the CPU smoke test)")
    layers = TEXT_ENCODER_LAYER + 1 if args.tiny else args.text_encoder_layers
    run = [c for c in CASES if c in wanted]
    recipes = list(dict.fromkeys(CASE_SETUP[c][0] for c in run))

    previous = {}
    if args.merge and Path(args.out).exists():
        previous = json.loads(Path(args.out).read_text())
        if previous.get("suite") != "placement" or previous.get("shape", {}).get("tiny") != args.tiny:
            raise SystemExit(f"--merge: {args.out} is not a placement result of the same kind (tiny={args.tiny})")

    results, notes = {}, {}
    header = result_header("placement", args.commit, device="cpu (tiny smoke test)" if args.tiny else None)
    for recipe in recipes:
        cases = [c for c in run if CASE_SETUP[c][0] == recipe]
        pipe = None
        try:
            started = time.perf_counter()
            pipe, placements, weights, sizes = build_recipe(recipe, device, args.tiny, layers)
            clean_device(device)
            build_s = time.perf_counter() - started
            print(f"{recipe}: built in {build_s:.1f} s, weights {sizes} GiB, {placements}", flush=True)
        except Exception as error:  # noqa: BLE001 - a recipe that cannot be built must not lose the others
            for case in cases:
                results[case] = failed_record(recipe, caps[case], device)
                notes[case] = f"build failed: {type(error).__name__}: {str(error)[:400]}"
            print(f"{recipe}: build failed: {error}", flush=True)
            traceback.print_exc()
            pipe = None
            clean_device(device, 1.0)
            write_report(args, header, previous, results, notes, layers, device)
            continue
        for case in cases:
            cap_gib = caps[case] if device.type == "cuda" else None
            try:
                record = run_case(pipe, case, caps[case], device, args.tiny, warmup=not args.no_warmup)
            except Exception as error:  # noqa: BLE001 - one failing case must not lose the others
                results[case] = failed_record(recipe, caps[case], device)
                if device.type == "cuda":  # how far it got (an allocation refused by the cap, typically)
                    results[case]["peak_allocated_before_failure_gib"] = _gib(torch.cuda.max_memory_allocated(device))
                    results[case]["peak_reserved_before_failure_gib"] = _gib(torch.cuda.max_memory_reserved(device))
                notes[case] = f"failed: {type(error).__name__}: {str(error)[:400]}"
                print(f"{case:14s} {notes[case]}", flush=True)
                traceback.print_exc()
            else:
                results[case] = {
                    "recipe": RECIPE_LINES[recipe],
                    "cap_gib": cap_gib,
                    "cap_scope": "the warm-up and the timed request; building the random weights ran uncapped"
                    if cap_gib is not None
                    else "no cap on the CPU",
                    "placements": placements,
                    "weights": weights,
                    "weights_gib": sizes,
                    "build_s": round(build_s, 1),
                    **record,
                    "commit": header["commit"],
                    "date": header["date"],
                }
                stages = " ".join(f"{k} {v / 1000:.2f}" for k, v in record["stages"].items())
                print(f"{case:14s} {record['ms'] / 1000:7.2f} s ({stages}) peak allocated "
                      f"{record['peak_allocated_gib']} / reserved {record['peak_reserved_gib']} GiB, cap {cap_gib} "
                      f"GiB, host RSS {record['host_rss_gib']} GiB", flush=True)  # fmt: skip
            write_report(args, header, previous, results, notes, layers, device)  # after every case
        pipe = None  # the GPU is clean before the next recipe is built
        clean_device(device, 1.0)
        if device.type == "cuda":
            print(f"after {recipe}: {torch.cuda.memory_allocated(device) / GiB:.2f} GiB still allocated", flush=True)
    write_report(args, header, previous, results, notes, layers, device)


def failed_record(recipe, cap_gib, device):
    return {"recipe": RECIPE_LINES[recipe], "cap_gib": cap_gib if device.type == "cuda" else None, "ms": None,
            "stages": None, "forward_ms": None, "peak_allocated_gib": None, "peak_reserved_gib": None}  # fmt: skip


def write_report(args, header, previous, results, notes, layers, device):
    cases = {**previous.get("cases", {}), **results}
    all_notes = {**{k: v for k, v in previous.get("notes", {}).items() if k not in results}, **notes}
    commands = previous.get("command", [])
    commands = ([commands] if isinstance(commands, str) else list(commands)) + [header["command"]]
    te_layers = "tiny" if args.tiny else (
        f"Qwen3-VL-32B config, {layers} decoder layers built (64 as released), layers 0-{TEXT_ENCODER_LAYER - 1} run "
        f"(early exit at hidden_states[{TEXT_ENCODER_LAYER}]), vision tower built")  # fmt: skip
    report = {
        **header,
        "command": commands if len(commands) > 1 else commands[0],
        "shape": {"height": 64 if args.tiny else HEIGHT, "width": 96 if args.tiny else WIDTH, "frames": NUM_FRAMES,
                  "prompt_tokens": PROMPT_TOKENS, "task": "t2va", "sigma_points": SIGMA_POINTS, "forwards": 1,
                  "output_type": "np", "tiny": args.tiny, "text_encoder": te_layers,
                  "transformer": "tiny" if args.tiny else "MiniMaxH3Transformer3DModel() defaults: 50 blocks, hidden "
                                                          "5376, 56x128 heads",
                  "vae": "tiny" if args.tiny else "AutoencoderKLMiniMaxH3() / AutoencoderKLMiniMaxH3Audio() defaults "
                                                  "(released sizes), tiled decode"},
        "protocol": "per case: cap (set_per_process_memory_fraction(cap / total), after building), 1 untimed warm-up "
                    "request, 1 timed request: request.py's t2va request (50 sigma points) interrupted after its "
                    "first forward (stop_after(1)), output_type='np' so the video and audio decode run (no MP4 mux); "
                    "CUDA-synchronized wall times per stage (forwards include the offload transfers they wait for); "
                    "peak allocated / reserved over the timed request",
        "weights_note": "random weights built on the device in bf16 and quantized in place with the configs the "
                        "recipe passes to from_pretrained (quantize(module, config)), one model at a time so that no "
                        "two bf16 models coexist. Offload cases: W8A16 DiT and text encoder (not bf16: bf16 DiT + "
                        "text encoder + VAEs ~130 GiB would not fit the 128 GiB host), moved to the CPU after "
                        "quantization, then enable_low_memory_offload(..., low_cpu_mem_usage=True): groups are "
                        "pinned on the fly per transfer instead of pinned copies of all weights (those are made for "
                        "every group before the originals are freed, sizes rounded up to powers of two: ~118 GiB of "
                        "host memory here, estimated)",
        "cap_note": "the cap bounds PyTorch's caching allocator (reserved memory) during the warm-up and the timed "
                    "request only, not the building of the random weights (bf16 on the GPU, then quantized). "
                    f"Caps: {CAP_BASIS}",
        "cases": cases,
        "notes": all_notes,
    }  # fmt: skip
    write_json(args.out, report)


if __name__ == "__main__":
    main()
