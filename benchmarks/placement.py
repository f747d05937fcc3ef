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
import contextlib
import gc
import json
import os
import resource
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
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
    num_frames,
    peak_over_stages,
    request_kwargs,
    rounded_stage_peaks,
    stop_after,
)

from _common import DeviceMemorySampler, device_peak_fields, result_header, write_json


CASES = ("resident_80gb", "offload_48gb", "offload_40gb", "offload_24gb", "low_ram_16gb", "low_ram_24gb",
         "pc_12gb_32gib", "pc_8gb_16gib", "pc_12gb_ref2va")
# case -> (recipe, cap in GiB on a CUDA device)
CASE_SETUP = {
    "resident_80gb": ("resident", 78.5),
    "offload_48gb": ("offload", 47.0),
    "offload_40gb": ("offload", 39.0),
    "offload_24gb": ("offload", 22.5),
    "low_ram_16gb": ("low_ram", 15.5),
    "low_ram_24gb": ("low_ram", 22.5),
    "pc_12gb_32gib": ("low_ram", 10.3),
    "pc_8gb_16gib": ("low_ram", 6.4),
    "pc_12gb_ref2va": ("low_ram", 10.3),  # one Ref2VA request (3 image + 1 video references) under the 12 GB recipe
}
# The PC cases' caps bound the allocator so that the whole process stays within what the card gives a program
# (8 GB: 7.3 GiB, 12 GB: 11.2 GiB, as the card counts it): the CUDA context, cuBLAS workspaces and lazily loaded kernels
# held 0.6-0.75 GiB outside the allocator during the fl2va forwards, so the caps leave 0.9 GiB below those bounds.
CARD_BOUND_GIB = {"pc_12gb_32gib": 11.2, "pc_8gb_16gib": 7.3, "pc_12gb_ref2va": 11.2}
REF2VA_CASE = "pc_12gb_ref2va"
REF2VA_IMAGES, REF2VA_VIDEO_FRAMES = 3, 48
# The low_ram cases' streaming and activation settings (``recipe_settings``; the recipe table carries them) and the
# host budget each is for (a cgroup ``memory.max`` where the machine lets us make one; the record says).
CASE_SETTINGS = {
    "low_ram_16gb": {"read_ahead": 2},
    "low_ram_24gb": {"read_ahead": 2},
    "pc_12gb_32gib": {"read_ahead": 2, "ffn_chunk_rows": 16384, "attention_head_groups": 8},
    "pc_8gb_16gib": {"read_ahead": 1, "ffn_chunk_rows": 8192, "attention_head_groups": 8},
    "pc_12gb_ref2va": {"read_ahead": 2, "ffn_chunk_rows": 16384, "attention_head_groups": 8},
}
CASE_HOST_BUDGET_GIB = {"low_ram_16gb": 20.0, "low_ram_24gb": 32.0, "pc_12gb_32gib": 20.0, "pc_8gb_16gib": 12.0,
                        "pc_12gb_ref2va": 20.0}
# fl2va with the LightX2V 4-step schedule and a LoRA of that adapter's layout (random, rank below) loaded unfused:
# the request the PC recipes are practical with (docs/memory.md).
LIGHT4_CASE = "fl2va_light4_fastest"
LIGHT4_LORA_RANK = 64
SUBPROCESS_RECIPES = ("low_ram",)  # loaded from a checkpoint on disk, one fresh process per case
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
    "low_ram": 'load_for_memory_budget(checkpoint, task="t2va", recipe="low_ram", offload_folder=folder)  # NVFP4 DiT '
               'in host memory, block offload; W8A16 text encoder streamed from disk, loaded first',
}  # fmt: skip
REQUEST_CASE = "t2va_native"  # request.py's t2va request: 50 sigma points, 512-token prompt
SIGMA_POINTS = 50
HOST_MARGIN_GIB = 6.0
GiB = 2**30
_SAMPLER = None  # the child's DeviceMemorySampler (CUDA), sampled again at every stage boundary
_PROMPT_EMBEDS = []  # the t2va request's prompt embeddings, reused by the shape sweep


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
    window = _SAMPLER.window("t2va_request") if _SAMPLER is not None else contextlib.nullcontext()
    with window, StageTimer(pipe, device, sampler=_SAMPLER) as timer:
        start = time.perf_counter()
        try:
            one_request(pipe, tiny)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as error:
            timer.mark("at_failure")  # what ran since the last stage boundary (the DiT forward, typically)
            error.stage_peaks = dict(timer.peaks)  # read by the case's failure record
            raise
        ms = (time.perf_counter() - start) * 1000
        timer.mark("other")  # the tail after the last stage (numpy conversion)
    _PROMPT_EMBEDS[:] = [timer.prompt_embeds, timer.text_token_tags]
    # the timer resets the allocator's peak at every stage: the request's peak is the largest stage peak
    peak_allocated, peak_reserved = peak_over_stages(timer.peaks)
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
            peak_allocated_gib=round(peak_allocated, 2),
            peak_reserved_gib=round(peak_reserved, 2),
            stage_peak_gib=rounded_stage_peaks(timer.peaks),
            non_torch_gib=_gib(non_torch),
            resident_by_component_gib=resident_by_component,
            resident_by_component_after_gib=device_bytes_by_component(pipe, device),
        )
        if _SAMPLER is not None:
            record.update(device_peak_fields(_SAMPLER.windows["t2va_request"], record["peak_reserved_gib"],
                                             _SAMPLER.source))  # fmt: skip
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
# The low_ram recipe: a checkpoint on disk, loaded in a fresh process per case

HOST_BUDGET_GIB = 32.0
PCIE4_X16_GB_S = 25.0  # effective host-to-device rate of PCIe 4.0 x16 (an RTX 4090's link), for the computed cost
CHUNK_BYTES = 2 * GiB  # the writer materializes at most about this much of a model at a time


def _chunks(module, prefix="", limit=CHUNK_BYTES):
    """``(prefix, module, own_only)`` pieces of ``module`` of at most ``limit`` bytes each (a module larger than
    that is split into its children, its own direct parameters forming one more piece)."""
    size = module_bytes(module)
    children = list(module.named_children())
    if size <= limit or not children:
        yield prefix, module, False
        return
    if any(True for _ in module.parameters(recurse=False)):
        yield prefix, module, True
    for name, child in children:
        yield from _chunks(child, f"{prefix}{name}.", limit)


@torch.no_grad()
def _randomize(module, own_only):
    """Random weights where ``to_empty`` left garbage: norms 1, biases 0, other matrices N(0, 0.02); quantized
    layers quantize a random bf16 weight (one layer at a time, on the device)."""
    from diffusers_h3.quantizers import is_quantized_linear

    modules = [module] if own_only else list(module.modules())
    for sub in modules:
        if is_quantized_linear(sub):
            dense = torch.randn(sub.out_features, sub.in_features, device=sub.weight.device,
                                dtype=torch.bfloat16) * 0.02  # fmt: skip
            sub.weight.copy_(dense)  # quantizes
            if sub.bias is not None:
                sub.bias.zero_()
            continue
        for name, param in sub.named_parameters(recurse=False):
            if not param.is_floating_point():
                continue
            if param.ndim == 1:
                param.fill_(0.0 if "bias" in name else 1.0)
            else:
                param.normal_(0.0, 0.02)


def swap_to_quantized_on_meta(model, config, keep_in_fp32=()):
    """Empty (meta) quantized weights on the Linears ``config`` selects, as a pre-quantized load leaves them."""
    from diffusers_h3.quantizers import install_quantized_weight, linears_to_quantize
    from diffusers_h3.quantizers.registry import weight_class_for

    cls = weight_class_for(config)
    for name in linears_to_quantize(model, config, keep_in_fp32):
        linear = model.get_submodule(name)
        options = cls.full_options(config.layer_kwargs())
        empty = {name: torch.empty(shape, dtype=dtype, device="meta")
                 for name, (shape, dtype) in cls.storage_spec(linear.out_features, linear.in_features, options).items()}
        install_quantized_weight(linear, cls.from_storage(empty, linear.out_features, linear.in_features,
                                                          torch.bfloat16, **options))  # fmt: skip
        if linear.bias is not None:
            linear.bias = torch.nn.Parameter(linear.bias.to(torch.bfloat16), requires_grad=False)
    return model


def _move_storage(piece, own_only, device):
    from diffusers_h3.quantizers import QuantizedTensor

    """Uninitialized storage on ``device`` for every parameter and buffer of ``piece`` (of the piece alone when
    ``own_only``), set directly: ``to_empty`` would allocate and copy."""
    for sub in [piece] if own_only else piece.modules():
        for table in (sub._parameters, sub._buffers):
            for name, tensor in table.items():
                if tensor is None:
                    continue
                if isinstance(tensor, QuantizedTensor):
                    empty = tensor._map(lambda t: torch.empty_like(t, device=device), share_merge=False)
                else:
                    empty = torch.empty_like(tensor, device=device)
                table[name] = torch.nn.Parameter(empty, requires_grad=False) if table is sub._parameters else empty


def write_model_streamed(model, config, folder, device, index_name, shard_stem, keep_in_fp32=(), limit=CHUNK_BYTES):
    """Write ``model`` (built on the meta device) as a pre-quantized checkpoint, one piece at a time: each piece is
    materialized on ``device`` with random weights, its selected Linear layers quantized with ``config``, copied to
    the CPU, written to its own safetensors shard and dropped. Never more than one piece exists in memory. Returns
    the bytes written."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if config is not None:
        swap_to_quantized_on_meta(model, config, keep_in_fp32)
    pieces = list(_chunks(model, limit=limit))
    weight_map, total = {}, 0
    for i, (prefix, piece, own_only) in enumerate(pieces):
        tensors = dict(piece.named_parameters(recurse=not own_only)) | dict(piece.named_buffers(recurse=not own_only))
        if not tensors:
            continue
        _move_storage(piece, own_only, device)
        _randomize(piece, own_only)
        persistent = piece.state_dict(keep_vars=True) if not own_only else dict(piece.named_parameters(recurse=False))
        state = {f"{prefix}{n}": t.detach().to("cpu").contiguous() for n, t in persistent.items()}
        shard = f"{shard_stem}-{i + 1:05d}-of-{len(pieces):05d}.safetensors"
        save_file(state, str(folder / shard), metadata={"format": "pt"})
        for key, tensor in state.items():
            weight_map[key] = shard
            total += tensor.numel() * tensor.element_size()
        del state, persistent
        _move_storage(piece, own_only, torch.device("meta"))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    (folder / index_name).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=1))  # fmt: skip
    return total


def write_low_ram_checkpoint(folder, device, tiny):
    """The checkpoint the low_ram recipe loads, written like a user's converted one (random weights, released sizes
    unless ``tiny``): the DiT pre-quantized to NVFP4 and the text encoder pre-quantized to W8A16 with only the decoder
    layers the early exit runs (51 of 64), both written piece by piece; the VAEs, tokenizer, processor and schedulers
    by ``save_pretrained``. Returns what was written."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Transformer3DModel
    from request import keep_fp32_modules

    from diffusers_h3 import MiniMaxH3Pipeline
    from diffusers_h3.quantizers import NVFP4Config, W8A16Config
    from diffusers_h3.testing import tiny as tiny_parts

    folder = Path(folder)
    started = time.perf_counter()
    parts = tiny_parts.tiny_components(seed=0, text_encoder_layers=TEXT_ENCODER_LAYER + 1, with_transformer_ref=False)
    parts.pop("transformer_ref")
    # model_index.json and the small components (byte-level tokenizer: no download); the models are replaced below
    limits = tiny_parts.TINY_DURATION_LIMITS if tiny else {}  # the tiny smoke run generates the short tiny clip
    MiniMaxH3Pipeline(**parts, text_encoder_layer=TEXT_ENCODER_LAYER, **limits).save_pretrained(folder)
    dit_config, te_config = NVFP4Config(), W8A16Config()
    if tiny:
        dit_model_config = dict(parts["transformer"].config)
        te_model_config = parts["text_encoder"].config
    else:
        dit_model_config = {}  # the class defaults are the released sizes
        te_model_config = _released_text_encoder_config()
    sizes = {}
    limit = 2**16 if tiny else CHUNK_BYTES  # tiny: many small pieces, so the smoke test splits the models too
    # the DiT
    shutil.rmtree(folder / "transformer", ignore_errors=True)
    with torch.device("meta"):
        dit = MiniMaxH3Transformer3DModel(**{k: v for k, v in dit_model_config.items() if not k.startswith("_")})
    keep_fp32_modules(dit.to(torch.bfloat16))
    dit.register_to_config(quantization_config=dit_config)
    sizes["transformer"] = write_model_streamed(dit, dit_config, folder / "transformer", device,
                                                "diffusion_pytorch_model.safetensors.index.json",
                                                "diffusion_pytorch_model", dit._keep_in_fp32_modules, limit)  # fmt: skip
    dit.save_config(folder / "transformer")
    del dit
    # the text encoder, without the never-run decoder layers
    from transformers import Qwen3VLForConditionalGeneration

    shutil.rmtree(folder / "text_encoder", ignore_errors=True)
    te_model_config.text_config.num_hidden_layers = TEXT_ENCODER_LAYER + 1
    if isinstance(getattr(te_model_config.text_config, "layer_types", None), list):
        te_model_config.text_config.layer_types = te_model_config.text_config.layer_types[: TEXT_ENCODER_LAYER + 1]
    with torch.device("meta"):
        te = Qwen3VLForConditionalGeneration(te_model_config).to(torch.bfloat16)
    sizes["text_encoder"] = write_model_streamed(te, te_config, folder / "text_encoder", device,
                                                 "model.safetensors.index.json", "model", (), limit)  # fmt: skip
    te_model_config.quantization_config = te_config
    te_model_config.save_pretrained(folder / "text_encoder")
    del te
    # the VAEs: built whole (a few GiB) and saved
    for name in ("vae", "audio_vae"):
        shutil.rmtree(folder / name, ignore_errors=True)
        if tiny:
            module = parts[name]
        elif name == "vae":
            with torch.device(device):
                module = keep_fp32_modules(AutoencoderKLMiniMaxH3().to(torch.bfloat16))
        else:
            with torch.device(device):
                module = AutoencoderKLMiniMaxH3Audio(latents_mean=[0.0] * 32, latents_std=[1.0] * 32)
        module.save_pretrained(folder / name)
        sizes[name] = module_bytes(module)
        del module
        clean_device(device)
    return {"written_gib": {k: _gib(v) for k, v in sizes.items()}, "write_s": round(time.perf_counter() - started, 1),
            "formats": {"transformer": "NVFP4 (pre-quantized, weight-only 4-bit)", "text_encoder":
                        f"W8A16 (pre-quantized), {TEXT_ENCODER_LAYER + 1} decoder layers (64 released: the never-run "
                        "ones are not written)", "vae": "bf16 (fp32 modules kept)", "audio_vae": "fp32"}}  # fmt: skip


def _released_text_encoder_config():
    from request import QWEN3_VL_32B_VISION
    from transformers import Qwen3VLConfig

    from diffusers_h3.testing import tiny as tiny_parts

    ids = {token: 257 + i for i, token in enumerate(tiny_parts.VISION_TOKENS)}
    return Qwen3VLConfig(
        text_config=dict(QWEN3_VL_32B_TEXT), vision_config=QWEN3_VL_32B_VISION, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip


def reset_vm_hwm():
    """Start a new host peak (``VmHWM``) from the current RSS (Linux: ``/proc/self/clear_refs``); False where refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def parse_shapes(text):
    """``"480x832x124,768x1344x259"`` -> ``[(480, 832, 124), (768, 1344, 259)]`` (height x width x frames)."""
    shapes = []
    for item in (t for t in text.split(",") if t):
        parts = item.lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise SystemExit(f"--shapes: {item!r} is not HEIGHTxWIDTHxFRAMES (e.g. 480x832x124)")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


def shape_record(kwargs, recipe_settings, lora_rank, prompt_tokens, references=(0, 0)):
    """The request's shape fields of a memory-model record (``benchmarks/memory_model.py`` reads them): frames as
    the pipeline aligns them (17n+5), ``prompt_tokens`` the text rows packed (a keyframe's vision tokens included)."""
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import align_num_frames

    task = "fl2va" if "image" in kwargs else ("ref2va" if "references" in kwargs else "t2va")
    keyframes = (2 if kwargs.get("last_image") is not None else 1) if task == "fl2va" else 0
    return {"task": task, "height": kwargs["height"], "width": kwargs["width"],
            "num_frames": align_num_frames(kwargs["num_frames"], 17, 5), "prompt_tokens": int(prompt_tokens),
            "reference_images": references[0], "reference_videos": references[1], "keyframes": keyframes,
            "lora_rank": lora_rank, "recipe": "low_ram", "settings": dict(recipe_settings)}  # fmt: skip


def text_rows(timer, default=PROMPT_TOKENS):
    """The text rows a request packed: its text token tags' length (the prompt's tokens and any vision tokens)."""
    tags = getattr(timer, "text_token_tags", None)
    return int(tags.numel()) if tags is not None else default


def one_forward_request(pipe, device, kwargs, record, name, sampler):
    """Run ``pipe(**kwargs)`` for one forward and both decodes, and fill ``record`` with whether it fitted (an
    out-of-memory error is recorded, not raised), its times, the text rows it packed, and its peaks: the
    allocator's, and the card's in the sampler window ``name``."""
    window = sampler.window(name) if sampler is not None else contextlib.nullcontext()
    start = time.perf_counter()
    with window, StageTimer(pipe, device, sampler=sampler) as timer:
        try:
            out = pipe(**kwargs, generator=torch.Generator().manual_seed(0), callback_on_step_end=stop_after(1))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            record["fits"] = out.frames is not None and out.audio is not None
        except torch.OutOfMemoryError as error:
            timer.mark("at_failure")
            record.update(fits=False, error=f"OutOfMemoryError: {str(error).splitlines()[0][:300]}")
    record.update(ms=round((time.perf_counter() - start) * 1000, 1),
                  stages={k: round(v, 1) for k, v in timer.stages.items()},
                  forward_ms=[round(t, 1) for t in timer.forwards],
                  prompt_tokens=text_rows(timer, record["prompt_tokens"]))  # fmt: skip
    if device.type == "cuda":
        peak_allocated, peak_reserved = peak_over_stages(timer.peaks)
        record.update(peak_allocated_gib=round(peak_allocated, 2), peak_reserved_gib=round(peak_reserved, 2),
                      stage_peak_gib=rounded_stage_peaks(timer.peaks))  # fmt: skip
        if sampler is not None:
            record.update(device_peak_fields(sampler.windows[name], record["peak_reserved_gib"], sampler.source))
    return record


def timed_shape_request(pipe, device, shape, prompt_embeds, settings, sampler):
    """One t2va request at ``shape`` (one forward, both decodes) with the prompt embedded once before (the text
    encoder's stage peaks at a fixed 512 tokens, below the forward's): its peaks as the card counts them, the
    allocator's, and the host's since the request began. An out-of-memory error is recorded, not raised."""
    height, width, frames = shape
    kwargs = {"prompt_embeds": prompt_embeds[0], "text_token_tags": prompt_embeds[1], "height": height,
              "width": width, "num_frames": frames, "num_inference_steps": SIGMA_POINTS, "output_type": "np"}
    record = shape_record(kwargs, settings, lora_rank=0, prompt_tokens=int(prompt_embeds[1].numel()))
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    record["host_peak_reset"] = reset_vm_hwm()
    one_forward_request(pipe, device, kwargs, record, f"{height}x{width}x{frames}", sampler)
    record["host_peak_rss_gib"] = _gib(vm_hwm_bytes())
    del kwargs
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return record


def ref2va_request(pipe, device, settings, sampler):
    """One Ref2VA request at the released canvas and 124 frames with three image references and one video reference
    (random pixels, no soundtrack): one forward, both decodes; its peaks, or the out-of-memory error it met."""
    from diffusers.modular_pipelines.minimax_h3.references import MiniMaxH3ImageReference, MiniMaxH3VideoReference
    from PIL import Image

    tiny = device.type != "cuda"
    height, width, frames = (64, 96, num_frames(True)) if tiny else (HEIGHT, WIDTH, NUM_FRAMES)
    side = 64 if tiny else 1024
    rng = np.random.default_rng(0)
    references = [MiniMaxH3ImageReference(image=Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)))
                  for _ in range(REF2VA_IMAGES)]  # fmt: skip
    references.append(MiniMaxH3VideoReference(frames=rng.integers(0, 256, (REF2VA_VIDEO_FRAMES, height, width, 3),
                                                                  dtype=np.uint8), fps=24.0))  # fmt: skip
    kwargs = {"prompt": ("A street drummer plays under neon lights. " * 16)[:PROMPT_TOKENS], "references": references,
              "height": height, "width": width, "num_frames": frames, "num_inference_steps": SIGMA_POINTS,
              "output_type": "np"}  # fmt: skip
    record = shape_record(kwargs, settings, lora_rank=0, prompt_tokens=PROMPT_TOKENS, references=(REF2VA_IMAGES, 1))
    return one_forward_request(pipe, device, kwargs, record, "ref2va", sampler)


def ref2va_checkpoint(checkpoint, work):
    """The low_ram checkpoint seen with a Ref2VA partition: links to its folders, ``transformer_ref`` to the same DiT
    files (random weights: the memory a request needs does not depend on their values)."""
    folder = Path(work) / "checkpoint_ref2va"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for item in Path(checkpoint).iterdir():
        if item.name != "model_index.json":
            (folder / item.name).symlink_to(item.resolve())
    (folder / "transformer_ref").symlink_to((Path(checkpoint) / "transformer").resolve())
    index = json.loads((Path(checkpoint) / "model_index.json").read_text())
    index["transformer_ref"] = index["transformer"]
    (folder / "model_index.json").write_text(json.dumps(index, indent=1))
    return folder


def vm_hwm_bytes():
    """This process's peak resident set size (``VmHWM``), pinned and file-backed pages included."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def where_components_live(pipe):
    """Each component's weight bytes by where they rest between uses and how they reach the GPU."""
    from diffusers_h3.parallel.placement import placement_of

    placement = placement_of(pipe)
    out = {}
    for name, component in pipe.components.items():
        if not isinstance(component, torch.nn.Module):
            continue
        out[name] = {"placement": placement.get(name, "?"), "weights_gib": _gib(module_bytes(component))}
    return out


def pcie_traffic(pipe):
    """Bytes each request moves from the host to the GPU (computed from the weights, not measured): the whole DiT
    every forward (block offload), the text encoder once per request (from disk), each VAE once per request (model
    offload), and their cost at PCIe 4.0 x16."""
    from diffusers_h3.parallel.checkpoint_streaming import streamed_bytes

    dit = module_bytes(pipe.transformer)
    # a text encoder streamed from its checkpoint files holds only its small resident tensors between forwards
    te_bytes = module_bytes(pipe.text_encoder) + streamed_bytes(pipe.text_encoder)
    per_request = {"text_encoder": te_bytes,
                   "vae": module_bytes(pipe.vae), "audio_vae": module_bytes(pipe.audio_vae)}  # fmt: skip
    forwards = SIGMA_POINTS - 1
    total = dit * forwards + sum(per_request.values())
    rate = PCIE4_X16_GB_S * 1e9
    return {
        "label": f"computed from the weight bytes at {PCIE4_X16_GB_S:g} GB/s (PCIe 4.0 x16 effective), not measured",
        "per_forward_gib": _gib(dit),
        "per_forward_s_at_pcie4": round(dit / rate, 2),
        "per_request_once_gib": {k: _gib(v) for k, v in per_request.items()},
        "per_request_gib": _gib(total),
        "per_request_s_at_pcie4": round(total / rate, 1),
    }


def proc_io():
    """This process's ``/proc/self/io`` counters: ``read_bytes`` (what storage delivered: page-cache hits excluded)
    and ``rchar`` (every byte read through read/pread calls)."""
    try:
        return {k: int(v) for k, v in (line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())}
    except OSError:
        return {}


def io_since(before):
    after = proc_io()
    return {f"{k}_gib": _gib(after[k] - before[k]) for k in ("read_bytes", "rchar") if k in after and k in before}


def drop_page_cache(folder):
    """Drop the checkpoint's pages from the page cache, so that the case reads it from the disk as a cold PC would."""
    for file in Path(folder).rglob("*"):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def light4_lora(transformer, rank=LIGHT4_LORA_RANK, seed=0):
    """A random LoRA of rank ``rank`` on every Linear of the DiT's blocks (attention and feed-forward), in diffusers'
    ``transformer.<module>.lora_A/B.weight`` naming: the size of a turbo LoRA, to load unfused as a user would."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, module in transformer.transformer_blocks.named_modules():
        in_features, out_features = getattr(module, "in_features", None), getattr(module, "out_features", None)
        if in_features is None or not any(part in name for part in ("attn.", "ff.")):
            continue
        key = f"transformer.transformer_blocks.{name}"
        state[f"{key}.lora_A.weight"] = (torch.randn(rank, in_features, generator=gen) * 0.01).to(torch.bfloat16)
        state[f"{key}.lora_B.weight"] = (torch.randn(out_features, rank, generator=gen) * 0.01).to(torch.bfloat16)
    return state


def timed_light4_request(pipe, device, tiny):
    """The fl2va LightX2V 4-step request (5 sigma points: 4 forwards, shift 6 / 3), every stage timed."""
    kwargs = request_kwargs(LIGHT4_CASE, tiny)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    io_before = proc_io()
    with StageTimer(pipe, device, sampler=_SAMPLER) as timer:
        start = time.perf_counter()
        out = pipe(**kwargs, generator=torch.Generator().manual_seed(0))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ms = (time.perf_counter() - start) * 1000
        timer.mark("other")
    assert out.frames is not None and out.audio is not None
    stages = {"text_encode": timer.stages.get("text_encode", 0.0), "forwards": sum(timer.forwards)}
    stages.update({k: timer.stages.get(k, 0.0) for k in ("condition_encode", "video_decode", "audio_decode")})
    stages["other"] = ms - sum(stages.values())
    record = {"ms": round(ms, 1), "stages": {k: round(v, 1) for k, v in stages.items()},
              "forward_ms": [round(t, 1) for t in timer.forwards], "forwards": len(timer.forwards),
              "sigma_points": kwargs["num_inference_steps"], "disk": io_since(io_before),
              "text_rows": text_rows(timer)}  # fmt: skip
    if device.type == "cuda":
        peak_allocated, peak_reserved = peak_over_stages(timer.peaks)
        record.update(peak_allocated_gib=round(peak_allocated, 2), peak_reserved_gib=round(peak_reserved, 2),
                      stage_peak_gib=rounded_stage_peaks(timer.peaks))  # fmt: skip
    return record


def request_cap_fields(pipe, device) -> dict:
    """The request-sized cap the last call ran under (``--request-sized-cap``): the allocator's cap as set and the
    line ``describe`` shows; empty without it."""
    from diffusers_h3.parallel.placement import placement_of

    line = placement_of(pipe).get("request_cap")
    if line is None or device.type != "cuda":
        return {}
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    return {"request_cap_gib": round(fraction * torch.cuda.get_device_properties(device).total_memory / GiB, 2),
            "request_cap": line}


def child_main(args):
    """One low_ram case in this (fresh) process: cap, load from the checkpoint, warm-up, the timed t2va request
    (one forward), then the LoRA loaded and the fl2va Light4 request (all four forwards)."""
    import dataclasses

    from diffusers_h3 import disable_vsa
    from diffusers_h3.parallel.checkpoint_streaming import streaming_of
    from diffusers_h3.parallel.memory_recipes import resolve_recipe, set_allocator_cap, use_recipe_allocator_settings
    from diffusers_h3.parallel.placement import placement_of
    from diffusers_h3.pipelines.recipe_loading import load_for_memory_budget

    global _SAMPLER
    case = args.child
    io_start = proc_io()
    device = torch.device("cuda", 0) if not args.tiny else torch.device("cpu")
    # made before this process touches CUDA: its context is counted, the parent's is not
    sampler = DeviceMemorySampler(0).start() if device.type == "cuda" else None
    _SAMPLER = sampler
    cap_gib = CASE_SETUP[case][1] if device.type == "cuda" else None
    fraction = None
    allocator = None
    if device.type == "cuda":  # the recipe's allocator settings and cap hold from the load on
        allocator = use_recipe_allocator_settings()
        fraction = set_allocator_cap(cap_gib, device)
    recipe = dataclasses.replace(resolve_recipe("low_ram", None, None, device), case=case, cap_gib=cap_gib,
                                 settings=dict(CASE_SETTINGS.get(case, {})))  # fmt: skip
    started = time.perf_counter()
    task = "ref2va" if case == REF2VA_CASE else "t2va"
    pipe = load_for_memory_budget(args.checkpoint, task=task, recipe=recipe, device=device,
                                  offload_folder=args.offload_folder, cap_gpu=False,
                                  request_sized_cap=args.request_sized_cap)  # fmt: skip
    if task == "ref2va":
        record = {"recipe_name": "low_ram", "recipe": RECIPE_LINES["low_ram"], "cap_gib": cap_gib,
                  "settings": recipe.settings, "load_s": round(time.perf_counter() - started, 1),
                  "ref2va": ref2va_request(pipe, device, recipe.settings, sampler)}  # fmt: skip
        sampler.stop() if sampler is not None else None
        record["host_peak_rss_gib"] = _gib(vm_hwm_bytes())
        if sampler is not None:
            record.update(device_peak_fields(sampler.peak_bytes, record["ref2va"].get("peak_reserved_gib"),
                                             sampler.source), card_bound_gib=CARD_BOUND_GIB[case])  # fmt: skip
        Path(args.child_out).write_text(json.dumps(record, indent=1))
        return
    pipe.set_progress_bar_config(disable=True)
    load_s = time.perf_counter() - started
    load_peak = vm_hwm_bytes()
    load_reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None
    print(f"{case}: loaded in {load_s:.1f} s, host peak RSS so far {load_peak / GiB:.2f} GiB", flush=True)
    warm = time.perf_counter()
    if not args.no_warmup:
        one_request(pipe, args.tiny)
    warmup_s = time.perf_counter() - warm
    io_before = proc_io()
    record = timed_request(pipe, device, args.tiny)
    record["disk"] = io_since(io_before)
    if sampler is not None:  # started before the load: its peak so far is the load's and the t2va request's
        record.update({k.replace("device_peak", "device_peak_t2va"): v for k, v in device_peak_fields(
            sampler.peak_bytes, record["peak_reserved_gib"], sampler.source).items()})
    streams = {name: streaming_of(c).stats.as_dict() for name, c in pipe.components.items()
               if isinstance(c, torch.nn.Module) and streaming_of(c) is not None}  # fmt: skip
    record.update(
        recipe_name="low_ram", recipe=RECIPE_LINES["low_ram"], cap_gib=cap_gib, settings=recipe.settings,
        allocator=allocator, request_sized_cap=args.request_sized_cap,
        cap_fraction=round(fraction, 4) if fraction is not None else None,
        cap_scope="the whole process: load, warm-up and timed requests" if cap_gib else "no cap on the CPU",
        load_s=round(load_s, 1), warmup_s=round(warmup_s, 1),
        host_peak_rss_load_gib=_gib(load_peak), host_peak_rss_t2va_gib=_gib(vm_hwm_bytes()), host_includes_load=True,
        peak_reserved_load_gib=_gib(load_reserved) if load_reserved is not None else None,
        placements=placement_of(pipe), components=where_components_live(pipe),
        weights_gib={k: v["weights_gib"] for k, v in where_components_live(pipe).items() if k != "transformer_ref"},
        pcie=pcie_traffic(pipe), stream_stats_after_t2va=streams,
    )  # fmt: skip
    record["request_s_extrapolated"] = round(
        (record["ms"] - record["stages"]["forwards"] + (SIGMA_POINTS - 1) * record["stages"]["forwards"]) / 1000, 1)
    record["disk_per_t2va_request_gib_extrapolated"] = round(
        record["disk"].get("read_bytes_gib", 0.0) + (SIGMA_POINTS - 2) * record["pcie"]["per_forward_gib"], 2)
    # The memory model's requests: this t2va one (its host peak includes the load), then Light4's and the sweep's.
    shapes = record["shapes"] = [{
        **shape_record(request_kwargs(REQUEST_CASE, args.tiny), recipe.settings, lora_rank=0,
                       prompt_tokens=_PROMPT_EMBEDS[1].numel() if _PROMPT_EMBEDS[1] is not None else PROMPT_TOKENS),
        **{k: record.get(k) for k in ("device_peak_gib", "device_peak_source", "peak_reserved_gib",
                                      "peak_allocated_gib", "stage_peak_gib", "ms")},
        "host_peak_rss_gib": record["host_peak_rss_t2va_gib"], "fits": True, "forwards": 1,
        **request_cap_fields(pipe, device)}]  # fmt: skip
    host_peaks = [record["host_peak_rss_t2va_gib"]]
    Path(args.child_out).write_text(json.dumps(record, indent=1))  # the t2va request survives a kill during Light4
    if not args.no_light4:
        try:
            started = time.perf_counter()
            pipe.load_lora_weights(light4_lora(pipe.transformer), adapter_name="light4", distillation_preset=None)
            lora_s = time.perf_counter() - started
            if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0):
                pipe.enable_vsa(sparsity=0.8, precision="fp8")
                attention = "VSA 0.8, FP8 attention"
            else:
                attention = "dense (no VSA on this device)"
            window = sampler.window("fl2va_light4") if sampler is not None else contextlib.nullcontext()
            reset_vm_hwm()
            with window:
                light4 = timed_light4_request(pipe, device, args.tiny)
            light4["host_peak_rss_gib"] = _gib(vm_hwm_bytes())
            host_peaks.append(light4["host_peak_rss_gib"])
            if sampler is not None:
                light4.update(device_peak_fields(sampler.windows["fl2va_light4"], light4["peak_reserved_gib"],
                                                 sampler.source))  # fmt: skip
            light4["shape"] = shape_record(request_kwargs(LIGHT4_CASE, args.tiny), recipe.settings,
                                           lora_rank=LIGHT4_LORA_RANK, prompt_tokens=light4["text_rows"])  # fmt: skip
            shapes.append({**light4["shape"], **{k: light4.get(k) for k in (
                "device_peak_gib", "device_peak_source", "peak_reserved_gib", "peak_allocated_gib", "stage_peak_gib",
                "ms", "host_peak_rss_gib", "forwards")}, "fits": True, **request_cap_fields(pipe, device)})  # fmt: skip
            light4.update(lora=f"random rank-{LIGHT4_LORA_RANK} LoRA on every block Linear, unfused",
                          lora_load_s=round(lora_s, 1), attention=attention)  # fmt: skip
        except Exception as error:  # noqa: BLE001 - recorded: the t2va record stands on its own
            traceback.print_exc()
            light4 = {"failed": f"{type(error).__name__}: {str(error)[:400]}"}
        record["fl2va_light4"] = light4
    host_peaks.append(_gib(vm_hwm_bytes()))
    # the whole process's host peak: the largest of the high-water marks, each reset before a request
    record["host_peak_rss_gib"] = max(host_peaks)
    if args.shapes:
        if "light4" in getattr(pipe, "get_active_adapters", lambda: [])():
            pipe.unload_lora_weights()
        disable_vsa(pipe)  # the sweep's requests run as the t2va one did: dense attention, no LoRA
        embeds = (_PROMPT_EMBEDS[0].to(device, torch.bfloat16), _PROMPT_EMBEDS[1])
        for shape in parse_shapes(args.shapes):
            Path(args.child_out).write_text(json.dumps(record, indent=1))  # what is measured so far survives a kill
            print(f"{case}: shape {shape}", flush=True)
            shapes.append({**timed_shape_request(pipe, device, shape, embeds, recipe.settings, sampler),
                           **request_cap_fields(pipe, device)})  # fmt: skip
            print(f"{case}: {shapes[-1].get('device_peak_gib')} GiB device, fits {shapes[-1]['fits']}", flush=True)
    record["host_peak_rss_gib"] = max([record["host_peak_rss_gib"]] + [r["host_peak_rss_gib"] for r in shapes])
    if sampler is not None:
        sampler.stop()
        whole = device_peak_fields(sampler.peak_bytes, max(
            [record["peak_reserved_gib"] or 0] + [r.get("peak_reserved_gib") or 0 for r in record.get("shapes", [])]
            + [record.get("fl2va_light4", {}).get("peak_reserved_gib") or 0]), sampler.source)  # fmt: skip
        record.update(whole, device_samples=sampler.samples, device_sample_interval_s=sampler.interval_s,
                      card_bound_gib=CARD_BOUND_GIB.get(case))  # fmt: skip
    record["disk_whole_process"] = io_since(io_start)
    Path(args.child_out).write_text(json.dumps(record, indent=1))


def _cgroup_for_child(limit_gib):
    """A cgroup v2 with ``memory.max`` = ``limit_gib`` the child joins, when ``/sys/fs/cgroup`` lets us make one;
    ``(path or None, what happened)``."""
    root = Path("/sys/fs/cgroup")
    try:
        relative = Path("/proc/self/cgroup").read_text().strip().split("\n")[0].split("::", 1)[1].lstrip("/")
        parent = root / relative
        if "memory" not in (parent / "cgroup.controllers").read_text().split():
            return None, f"no memory controller in {parent}"
        group = parent / f"h3_placement_{os.getpid()}"
        group.mkdir(exist_ok=True)
        (group / "memory.max").write_text(str(int(limit_gib * GiB)))
        if (group / "memory.swap.max").exists():
            (group / "memory.swap.max").write_text("0")
        return group, f"cgroup v2 {group} with memory.max {limit_gib:g} GiB, swap 0"
    except (OSError, IndexError) as error:
        return None, f"could not make a cgroup ({type(error).__name__}: {error})"


def run_child(args, case, checkpoint, work):
    """Run ``case`` in a fresh process; its record with the child's peak RSS from ``wait4`` (ru_maxrss)."""
    offload_folder = work / f"offload_{case}"
    shutil.rmtree(offload_folder, ignore_errors=True)
    out = work / f"{case}.json"
    out.unlink(missing_ok=True)
    command = [sys.executable, __file__, "--child", case, "--checkpoint", str(checkpoint), "--offload-folder",
               str(offload_folder), "--child-out", str(out)] + (["--tiny"] if args.tiny else []) \
        + (["--no-warmup"] if args.no_warmup else []) + (["--no-light4"] if args.no_light4 else []) \
        + (["--shapes", args.shapes] if args.shapes else []) \
        + (["--request-sized-cap"] if args.request_sized_cap else [])  # fmt: skip
    drop_page_cache(checkpoint)  # every case reads the checkpoint cold, from the disk
    budget = CASE_HOST_BUDGET_GIB.get(case, HOST_BUDGET_GIB)
    group, cgroup_note = (None, "not tried (--no-cgroup)") if args.no_cgroup else _cgroup_for_child(budget)
    enforced = False
    if group is not None:
        def join():  # in the child, before it loads anything
            (group / "cgroup.procs").write_text(str(os.getpid()))
    else:
        join = None
    try:
        process = subprocess.Popen(command, preexec_fn=join)
    except (OSError, subprocess.SubprocessError) as error:  # joining the cgroup refused: run without the cap
        cgroup_note += f"; joining it failed ({error}): run without it"
        group = None
        process = subprocess.Popen(command)
    import threading

    deadline = threading.Timer(args.child_timeout, process.kill) if args.child_timeout else None
    if deadline is not None:
        deadline.start()
    _, status, usage = os.wait4(process.pid, 0)
    timed_out = deadline is not None and not deadline.is_alive() and deadline.finished.is_set()
    if deadline is not None:
        deadline.cancel()
    record = json.loads(out.read_text()) if out.exists() else None
    if record is not None and timed_out:
        record["partial"] = f"the process was stopped at --child-timeout {args.child_timeout} s: what it had written"
    cgroup = {"tried": not args.no_cgroup, "note": cgroup_note, "enforced": False}
    if group is not None:
        try:
            cgroup["memory_peak_gib"] = _gib(int((group / "memory.peak").read_text()))
        except (OSError, ValueError):
            pass
        try:
            events = dict(line.split() for line in (group / "memory.events").read_text().splitlines())
            cgroup["oom_kills"] = int(events.get("oom_kill", 0))
        except (OSError, ValueError):
            pass
        enforced = (group / "memory.max").read_text().strip() == str(int(budget * GiB))
        cgroup["enforced"] = enforced
        cgroup["limit_gib"] = budget
        try:
            group.rmdir()
        except OSError:
            pass
    shutil.rmtree(offload_folder, ignore_errors=True)
    exit_code = os.waitstatus_to_exitcode(status)
    if record is None:
        raise RuntimeError(f"the {case} process exited with {exit_code} without a record "
                           f"(peak RSS {usage.ru_maxrss / 2**20:.1f} GiB; {cgroup})")  # fmt: skip
    record["host_peak_rss_wait4_gib"] = _gib(usage.ru_maxrss * 1024)
    record["host_cgroup"] = cgroup
    return record


def run_low_ram_cases(args, cases, header, previous, results, notes, layers, device):
    work = Path(args.work_dir)
    checkpoint = work / "checkpoint"
    written = None
    try:
        if not (checkpoint / "model_index.json").exists() or args.rewrite_checkpoint:
            shutil.rmtree(checkpoint, ignore_errors=True)
            command = [sys.executable, __file__, "--write-checkpoint", str(checkpoint)] + (
                ["--tiny"] if args.tiny else [])
            subprocess.run(command, check=True)  # its own process: this one stays without CUDA allocations
        written = json.loads((checkpoint / "written.json").read_text())
        print(f"checkpoint {checkpoint}: {written}", flush=True)
    except Exception as error:  # noqa: BLE001 - recorded as the cases' failure
        for case in cases:
            results[case] = failed_record("low_ram", CASE_SETUP[case][1], device)
            notes[case] = f"checkpoint writing failed: {type(error).__name__}: {str(error)[:400]}"
        write_report(args, header, previous, results, notes, layers, device)
        return
    for case in cases:
        try:
            source = ref2va_checkpoint(checkpoint, work) if case == REF2VA_CASE else checkpoint
            record = run_child(args, case, source, work)
        except Exception as error:  # noqa: BLE001 - one failing case must not lose the others
            results[case] = failed_record("low_ram", CASE_SETUP[case][1], device)
            notes[case] = f"failed: {type(error).__name__}: {str(error)[:400]}"
            print(f"{case:14s} {notes[case]}", flush=True)
        else:
            results[case] = {**record, "checkpoint": written, "commit": header["commit"], "date": header["date"]}
            if case == REF2VA_CASE:
                print(f"{case:14s} {record['ref2va']}, device peak {record.get('device_peak_gib')} GiB", flush=True)
                write_report(args, header, previous, results, notes, layers, device)
                continue
            print(f"{case:14s} load {record['load_s']} s, request {record['ms'] / 1000:.2f} s (1 forward; "
                  f"{record['request_s_extrapolated']} s with 49), peak reserved {record['peak_reserved_gib']} GiB, "
                  f"host peak RSS {record['host_peak_rss_gib']} GiB (wait4 {record['host_peak_rss_wait4_gib']}), "
                  f"cgroup {record['host_cgroup']}", flush=True)  # fmt: skip
        write_report(args, header, previous, results, notes, layers, device)
    if not args.keep_checkpoint:
        shutil.rmtree(checkpoint, ignore_errors=True)


def released_dit_bytes(config):
    """Bytes of the released-size DiT stored with ``config`` (computed on the meta device: nothing is allocated)."""
    from diffusers import MiniMaxH3Transformer3DModel
    from request import keep_fp32_modules

    with torch.device("meta"):
        dit = keep_fp32_modules(MiniMaxH3Transformer3DModel().to(torch.bfloat16))
    return module_bytes(swap_to_quantized_on_meta(dit, config, dit._keep_in_fp32_modules))


def estimate_low_ram(results):
    """The low_ram recipe's needs before it is measured (labelled an estimate), from the measured offload case with
    the smallest GPU need: GPU, its peak allocated memory (its W8A16 blocks are larger than NVFP4's); host, the NVFP4
    DiT (computed) and the VAEs resident plus that process's memory beyond its weights (the text encoder streams from
    disk); time, the offload case's."""
    from diffusers_h3.parallel.memory_recipes import derive_recipe_table
    from diffusers_h3.quantizers import NVFP4Config

    offload = next((e for e in derive_recipe_table(results)["recipes"] if e["recipe"] == "offload"), None)
    if offload is None:
        return None
    case = results["cases"][offload["case"]]
    weights = case["weights_gib"]
    overhead = case["host_peak_rss_gib"] - sum(weights.values())
    host = released_dit_bytes(NVFP4Config()) / GiB + weights["vae"] + weights["audio_vae"] + overhead
    return {"recipe": "low_ram", "gpu_gib": round(case["peak_allocated_gib"], 2), "host_gib": round(host, 2),
            "request_s": offload["request_s"], "case": offload["case"], "measured": False, "cap_gib": None,
            "basis": f"estimate from {offload['case']}: GPU its peak allocated memory, host the NVFP4 DiT (computed) "
                     "+ VAEs + its memory beyond the weights, time its request"}  # fmt: skip


def write_recipe_table(results_path, table_path, newer=()):
    """``diffusers_h3/parallel/memory_recipes.json`` from a placement result (estimates for unmeasured recipes) and the
    consumer-GPU model's predictions (``benchmarks/consumer_model.py``; run it first when the placement result
    changed). The cases of each result in ``newer`` replace those of the same name (each keeps its device)."""
    from diffusers_h3.parallel.memory_recipes import derive_recipe_table, merged_placement_results

    newer_results = [json.loads(Path(path).read_text()) for path in newer]
    results = merged_placement_results(json.loads(Path(results_path).read_text()), newer_results)
    results_path = " + ".join([str(results_path)] + [str(path) for path in newer])
    consumer = Path(__file__).resolve().parent / "results" / "consumer_model.json"  # predicted times per GPU
    predictions = json.loads(consumer.read_text()) if consumer.exists() else None
    table = derive_recipe_table(results, source=results_path, predictions=predictions)
    if not any(e["recipe"] == "low_ram" for e in table["recipes"]):
        estimate = estimate_low_ram(results)
        if estimate is not None:
            table["recipes"].append(estimate)
    Path(table_path).write_text(json.dumps(table, indent=1) + "\n")
    print(f"{table_path}: " + "; ".join(f"{e['recipe']} {e['gpu_gib']} GiB GPU / {e['host_gib']} GiB host "
                                          f"({'measured' if e['measured'] else 'estimate'})" for e in table["recipes"]))


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
    parser.add_argument("--work-dir", default="/tmp/h3_placement",
                        help="low_ram cases: where the checkpoint and the offload files are written (local disk)")
    parser.add_argument("--keep-checkpoint", action="store_true", help="low_ram cases: keep the written checkpoint")
    parser.add_argument("--rewrite-checkpoint", action="store_true", help="low_ram cases: write it even if present")
    parser.add_argument("--request-sized-cap", action="store_true",
                        help="low_ram cases: load with request_sized_cap=True (each call's allocator cap sized to its "
                             "predicted allocations; docs/memory.md)")  # fmt: skip
    parser.add_argument("--no-cgroup", action="store_true", help="low_ram cases: do not try a cgroup memory cap")
    parser.add_argument("--shapes", default="", metavar="HxWxF,...",
                        help="low_ram cases: after the two requests, one t2va request (one forward, both decodes) at "
                             "each of these shapes, for the memory model (benchmarks/memory_model.py)")  # fmt: skip
    parser.add_argument("--child-timeout", type=float, default=None, metavar="S",
                        help="low_ram cases: stop a case's process after S seconds and keep what it recorded")
    parser.add_argument("--no-light4", action="store_true",
                        help="low_ram cases: skip the fl2va Light4 request after the t2va one")  # fmt: skip
    parser.add_argument("--newer-results", action="append", default=[], metavar="PATH",
                        help="with --recipe-table: placement results whose cases replace those of --out")
    parser.add_argument("--recipe-table", default=None, metavar="PATH",
                        help="write the recipe table derived from --out (e.g. diffusers_h3/parallel/"
                             "memory_recipes.json) and exit")  # fmt: skip
    internal = parser.add_argument_group("internal (the processes the low_ram cases start)")
    internal.add_argument("--write-checkpoint", default=None, help=argparse.SUPPRESS)
    internal.add_argument("--child", default=None, help=argparse.SUPPRESS)
    internal.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)
    internal.add_argument("--offload-folder", default=None, help=argparse.SUPPRESS)
    internal.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.recipe_table:
        write_recipe_table(args.out, args.recipe_table, args.newer_results)
        return
    if args.write_checkpoint:
        device = torch.device("cuda", 0) if not args.tiny else torch.device("cpu")
        written = write_low_ram_checkpoint(args.write_checkpoint, device, args.tiny)
        (Path(args.write_checkpoint) / "written.json").write_text(json.dumps(written, indent=1))
        return
    if args.child:
        child_main(args)
        return

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
        if recipe in SUBPROCESS_RECIPES:
            run_low_ram_cases(args, cases, header, previous, results, notes, layers, device)
            continue
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
                    results[case].update(failure_peaks(error, device))
                notes[case] = f"failed: {type(error).__name__}: {str(error)[:400]}"
                print(f"{case:14s} {notes[case]}", flush=True)
                traceback.print_exc()
            else:
                results[case] = {
                    "recipe_name": recipe,
                    "host_includes_load": False,  # the weights were built on the GPU, not loaded
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


def failure_peaks(error, device):
    """How far a failed case got on the GPU: the largest stage peak of its timed request (``timed_request`` puts
    them on the error), else the allocator's peak since the last reset (the warm-up's)."""
    stage_peaks = getattr(error, "stage_peaks", None)
    if stage_peaks:
        allocated, reserved = peak_over_stages(stage_peaks)
        return {"peak_allocated_before_failure_gib": round(allocated, 2),
                "peak_reserved_before_failure_gib": round(reserved, 2), "stage_peak_gib": rounded_stage_peaks(stage_peaks)}
    return {"peak_allocated_before_failure_gib": _gib(torch.cuda.max_memory_allocated(device)),
            "peak_reserved_before_failure_gib": _gib(torch.cuda.max_memory_reserved(device))}  # fmt: skip


def failed_record(recipe, cap_gib, device):
    return {"recipe_name": recipe, "recipe": RECIPE_LINES[recipe], "cap_gib": cap_gib if device.type == "cuda" else None, "ms": None,
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
        "shape": {"height": 64 if args.tiny else HEIGHT, "width": 96 if args.tiny else WIDTH, "frames": num_frames(args.tiny),
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
                    "peak allocated / reserved over the timed request: the largest of its stages' peaks (stage_peak_gib)",
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
