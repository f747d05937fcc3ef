"""The whole MiniMax-H3 request on one GPU at the released sizes: text encoding, every forward, video and audio decode,
MP4 mux, and peak memory, for the speed presets (docs/speed.md).

    python benchmarks/request.py --out benchmarks/results/request_h200.json --forwards 3
    python benchmarks/request.py --tiny --cases t2va_fast --out /tmp/request_tiny.json   # CPU smoke test
    python benchmarks/request.py --export streamed --cases t2va_fastest --out /tmp/request_streamed.json

``--export streamed`` writes the MP4 as the CLI does (``output_type="latent"`` + ``pipe.decode_to_video``: each decoded
video chunk encoded while the next decodes) and records ``mux_after_last_chunk_ms``; the default ``one-shot`` decodes
the whole clip (``output_type="np"``) and then runs ``export_to_video``.

Random weights at the released sizes, no downloads: the Qwen3-VL-32B text encoder built from its public config
(its decoder layers after the one H3 reads are never run by the pipeline's early exit and are not built: same compute,
less memory), the full 50-block DiT, both VAEs at diffusers' default (released) configs, bf16 as the pipeline loads
them (fp32 modules kept fp32). Every component is built directly on the GPU. 768x1344, 124 frames, t2va with a
512-token prompt; fl2va with two 768x1344 keyframes.

Cases, in this order (the presets quantize in place, so the bf16 ones come first):

* ``t2va_native``           the pipeline as loaded (diffusers' default attention processor and backend), 50 sigma
                            points (49 forwards);
* ``t2va_exact``            ``pipe.enable_speed_preset("exact")``;
* ``t2va_fast``             ``pipe.enable_speed_preset("fast")``;
* ``t2va_fast_flashinfer``  (only when asked for in ``--cases``; needs flashinfer-python on Hopper)
                            ``SpeedPresetConfig("fast", flashinfer=True)``: FA3's FP8 attention;
* ``t2va_fastest``          ``pipe.enable_speed_preset("fastest")``;
* ``fl2va_light4_fastest``  fl2va with the LightX2V Turbo 4-step 768p schedule (5 sigma points, shift 6 / 3) on the
                            fastest preset; no LoRA weights (a fused LoRA costs nothing at run time).
* ``t2va_{fast,fastest}_{first_block_cache,taylorseer,taylorseer_lite}``  (only when asked for; one step cache per
                            process) the cache profiles: ``hooks.cache.cache_config(method)`` on the transformer, then
                            the preset, the t2va 50-point request; the JSON records the steps the cache skipped.

Each case runs one untimed warm-up request of two forwards (compilation, autotuning, cuDNN plans; decoding too in the
first case; two because step 0 and the later steps pack different timestep counts) and one timed request. With
``--forwards K`` a case of more than K forwards times only the first K (the rest of the loop is interrupted, decode
and mux still run) and the whole-request ``ms`` is extrapolated with the median forward: the JSON says so per case
(``forwards_timed``, ``extrapolated``). Stage times are CUDA-synchronized wall times; the partial JSON is written
after every case. ``device_peak_gib`` is the card's count over each case (warm-up and timed request: NVML sampled,
the CUDA context and workspaces included; never reported below the allocator's reserved peak), next to the
allocator's ``peak_gib`` / ``peak_reserved_gib``; each case starts with the allocator's cache emptied, so a case's
peaks are not the blocks an earlier case left cached.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import os
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from _common import DeviceMemorySampler, device_peak_fields, result_header, write_json


HEIGHT, WIDTH, NUM_FRAMES = 768, 1344, 124
PROMPT_TOKENS = 512  # the byte-level tokenizer makes one token per byte
CASES = ("t2va_native", "t2va_exact", "t2va_fast", "t2va_fast_flashinfer", "t2va_fastest", "fl2va_light4_fastest",
         "t2va_fast_first_block_cache", "t2va_fastest_first_block_cache", "t2va_fast_taylorseer",
         "t2va_fastest_taylorseer", "t2va_fast_taylorseer_lite", "t2va_fastest_taylorseer_lite")  # fmt: skip
# case -> (task, speed preset or None, sigma points, flow_shift, audio_flow_shift)
CASE_SETUP = {
    "t2va_native": ("t2va", None, 50, None, None),
    "t2va_exact": ("t2va", "exact", 50, None, None),
    "t2va_fast": ("t2va", "fast", 50, None, None),
    "t2va_fast_flashinfer": ("t2va", "fast", 50, None, None),
    "t2va_fastest": ("t2va", "fastest", 50, None, None),
    "fl2va_light4_fastest": ("fl2va", "fastest", 5, 6.0, 3.0),  # lightx2v-fl2v-turbo-4step-768p
    # The cache profiles (docs/speed.md): a step cache on a fast preset, the t2va 50-step request.
    "t2va_fast_first_block_cache": ("t2va", "fast", 50, None, None),
    "t2va_fastest_first_block_cache": ("t2va", "fastest", 50, None, None),
    "t2va_fast_taylorseer": ("t2va", "fast", 50, None, None),
    "t2va_fastest_taylorseer": ("t2va", "fastest", 50, None, None),
    "t2va_fast_taylorseer_lite": ("t2va", "fast", 50, None, None),
    "t2va_fastest_taylorseer_lite": ("t2va", "fastest", 50, None, None),
}

# The step cache per case (`diffusers_h3.hooks.cache` method), enabled before the preset compiles the blocks. One run
# takes one cache setting: a run mixing them is refused (run each cache profile as its own --cases).
CASE_CACHE = {
    "t2va_fast_first_block_cache": "first-block",
    "t2va_fastest_first_block_cache": "first-block",
    "t2va_fast_taylorseer": "taylorseer",
    "t2va_fastest_taylorseer": "taylorseer",
    "t2va_fast_taylorseer_lite": "taylorseer-lite",
    "t2va_fastest_taylorseer_lite": "taylorseer-lite",
}
# t2va_fast_flashinfer needs flashinfer-python; the cache profiles run one per process (CASE_CACHE)
DEFAULT_CASES = tuple(c for c in CASES if c != "t2va_fast_flashinfer" and c not in CASE_CACHE)

# The preset's flashinfer argument per case (None: automatic).
CASE_FLASHINFER = {"t2va_fast_flashinfer": True}

# Qwen3-VL-32B (public config.json of Qwen/Qwen3-VL-32B-Instruct).
QWEN3_VL_32B_TEXT = {
    "vocab_size": 151936,
    "hidden_size": 5120,
    "intermediate_size": 25600,
    "num_hidden_layers": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [24, 20, 20],
                     "mrope_interleaved": True},
}  # fmt: skip
QWEN3_VL_32B_VISION = {
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "in_channels": 3,
    "hidden_act": "gelu_pytorch_tanh",
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 5120,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [8, 16, 24],
}
# Qwen3-VL's image processor (preprocessor_config.json).
QWEN3_VL_IMAGE_PROCESSOR = {
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}  # fmt: skip
TEXT_ENCODER_LAYER = 50  # hidden_states[50]: decoder layers 0..49 run


@contextlib.contextmanager
def default_dtype_and_device(dtype, device):
    """Build modules directly in ``dtype`` on ``device`` (no fp32 CPU copy of 100+ GB of random weights)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def keep_fp32_modules(model):
    """Cast the modules named by ``_keep_in_fp32_modules`` back to fp32, as ``from_pretrained(dtype=bf16)`` does."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    with torch.no_grad():  # by parameter name, as diffusers does (entries like `scale1` name parameters, not modules)
        for name, param in model.named_parameters():
            if keep & set(name.split(".")):
                param.data = param.data.float()
    return model.eval().requires_grad_(False)


# torch.nn.init's random fills; the deterministic ones (zeros_, ones_, constant_, eye_, dirac_) are left alone.
RANDOM_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
                         "xavier_uniform_", "xavier_normal_")  # fmt: skip
REPLAY_MIN_NUMEL = 1 << 16  # smaller tensors stay on the CPU (a device round trip costs more than it saves)


def _replayed_on(device, init, min_numel):
    """``init`` that fills a large plain CPU tensor by running on a same-shape, same-dtype tensor on ``device`` (same
    function, same arguments, so the same distribution) and copying the result back."""
    signature = inspect.signature(init)
    first = next(iter(signature.parameters))

    @functools.wraps(init)
    def wrapper(tensor, *args, **kwargs):
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.device.type != "cpu" \
                or tensor.numel() < min_numel:  # fmt: skip
            return init(tensor, *args, **kwargs)
        bound = signature.bind(tensor, *args, **kwargs)
        bound.arguments.pop("generator", None)  # a CPU generator cannot fill a tensor on another device
        replay = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
        bound.arguments[first] = replay
        init(*bound.args, **bound.kwargs)
        with torch.no_grad():
            tensor.copy_(replay)
        return tensor

    return wrapper


@contextlib.contextmanager
def random_init_on(device, min_numel=REPLAY_MIN_NUMEL):
    """Run the random weight inits of modules built on the CPU on ``device``'s RNG and copy the values back.

    PyTorch's CPU RNG fills a tensor on one thread, so building a released-size model on the CPU spends most of its
    time in ``reset_parameters`` / ``_init_weights``; a GPU fills the same tensor in milliseconds. While active,
    ``torch.nn.init``'s random fills (``RANDOM_INIT_FUNCTIONS``, where ``nn.Linear`` / ``nn.Embedding`` / convolutions
    look them up) and the same entries of transformers' ``initialization.TORCH_INIT_FUNCTIONS`` (what its ``init.*``
    wrappers call) run each CPU tensor of at least ``min_numel`` elements on a same-shape, same-dtype tensor on
    ``device`` (same function and arguments, a ``generator=`` dropped) and ``copy_`` the result into it. Everything is
    restored on exit, also on an exception. Meant for a CUDA ``device``; any device works (on the CPU it is only a
    detour)."""
    device = torch.device(device)
    # Imported before torch.nn.init is patched: transformers copies torch.nn.init's functions into its table on import.
    try:
        from transformers import initialization as hf_init
    except ImportError:  # no transformers, or one without its init table: torch.nn.init alone
        hf_init = None
    patched = [(torch.nn.init, name, getattr(torch.nn.init, name), setattr) for name in RANDOM_INIT_FUNCTIONS]
    table = getattr(hf_init, "TORCH_INIT_FUNCTIONS", None)
    if isinstance(table, dict):
        patched += [(table, name, table[name], dict.__setitem__) for name in RANDOM_INIT_FUNCTIONS if name in table]
    done = []
    try:
        for owner, name, original, put in patched:
            put(owner, name, _replayed_on(device, original, min_numel))
            done.append((owner, name, original, put))
        yield
    finally:
        for owner, name, original, put in reversed(done):
            put(owner, name, original)


def build_pipeline(device, tiny: bool, component_hook=None, text_encoder_layers=None, build_on_cpu=(), without=()):
    """The pipeline with random weights: tiny components, or the released sizes built directly on ``device``.

    ``component_hook(name, module) -> module``, if given, is applied to each model right after it is built, in the
    order text_encoder, transformer, vae, audio_vae, before the next one is built (e.g. quantize in place and move
    to the CPU, so that no two 16-bit components sit on the device together). ``text_encoder_layers``: decoder layers
    of the text encoder (default ``TEXT_ENCODER_LAYER + 1``, the fewest the early exit needs; 64 is the released
    model). ``build_on_cpu``: components built on the CPU instead (released sizes); the hook then puts them on the
    device (e.g. ``quantize(module, config, device=device)``: never the whole 16-bit model there). With a CUDA
    ``device`` they are built under ``random_init_on(device)``: PyTorch's CPU RNG is single-threaded and would spend
    many minutes on the ~60 G random elements, so each large random init is drawn on the GPU and copied into the CPU
    weight (same init function and arguments). ``without``: components left out (``"text_encoder"``: with its
    tokenizer and processor, a pipeline that generates from prompt embeddings; ``"transformer"``: one that only
    encodes prompts), for cards that cannot hold the text encoder and the DiT together."""
    from diffusers import (
        AutoencoderKLMiniMaxH3,
        AutoencoderKLMiniMaxH3Audio,
        MiniMaxH3Scheduler,
        MiniMaxH3Transformer3DModel,
    )
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    from diffusers_h3 import MiniMaxH3Pipeline
    from diffusers_h3.testing import tiny as tiny_parts

    hook = component_hook or (lambda name, module: module)
    layers = TEXT_ENCODER_LAYER + 1 if text_encoder_layers is None else int(text_encoder_layers)
    if tiny:
        components = tiny_parts.tiny_components(seed=0, text_encoder_layers=layers, with_transformer_ref=False)
        components.pop("transformer_ref")
        for name in ("text_encoder", "transformer", "vae", "audio_vae"):
            components[name] = None if name in without else hook(name, components[name].to(device))
        if "text_encoder" in without:
            components["tokenizer"] = components["processor"] = None
        return MiniMaxH3Pipeline(**components, text_encoder_layer=TEXT_ENCODER_LAYER, **tiny_parts.TINY_DURATION_LIMITS)

    tokenizer = tiny_parts.tiny_tokenizer()  # byte-level: no download; token ids stay far below the real vocab
    ids = {token: 257 + i for i, token in enumerate(tiny_parts.VISION_TOKENS)}
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(**QWEN3_VL_IMAGE_PROCESSOR), tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(**QWEN3_VL_IMAGE_PROCESSOR),
    )  # fmt: skip
    # The early exit never runs decoder layers 50..63 (nor the LM head's output): by default build 51 so the
    # pipeline's layer check passes, skipping 13 layers (~12 GiB in bf16) of weights that would only sit there.
    text_config = {**QWEN3_VL_32B_TEXT, "num_hidden_layers": layers}
    config = Qwen3VLConfig(
        text_config=text_config, vision_config=QWEN3_VL_32B_VISION, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip
    # Some parameters are created in fp32 whatever the default dtype: cast whole modules to bf16 first, then restore
    # `_keep_in_fp32_modules`, which is what `from_pretrained(dtype=torch.bfloat16)` ends up with. Each component is
    # built in its own context so that the hook runs with the default dtype and device restored.
    def where(name):
        return torch.device("cpu") if name in build_on_cpu else device

    @contextlib.contextmanager
    def built_in(name):  # bf16 on its device; on the CPU with the random inits drawn on the GPU (random_init_on)
        on_gpu_rng = name in build_on_cpu and torch.device(device).type == "cuda"
        with default_dtype_and_device(torch.bfloat16, where(name)):
            with random_init_on(device) if on_gpu_rng else contextlib.nullcontext():
                yield

    text_encoder = transformer = None
    if "text_encoder" not in without:
        with built_in("text_encoder"):
            text_encoder = Qwen3VLForConditionalGeneration(config).to(torch.bfloat16).eval().requires_grad_(False)
        text_encoder = hook("text_encoder", text_encoder)
    else:
        tokenizer = processor = None
    if "transformer" not in without:
        with built_in("transformer"):
            transformer = keep_fp32_modules(MiniMaxH3Transformer3DModel().to(torch.bfloat16))
        transformer = hook("transformer", transformer)
    with built_in("vae"):
        vae = keep_fp32_modules(AutoencoderKLMiniMaxH3().to(torch.bfloat16))
    vae = hook("vae", vae)
    with torch.device(device):  # fp32 as a whole (_keep_in_fp32_modules covers the model)
        audio_vae = AutoencoderKLMiniMaxH3Audio(latents_mean=[0.0] * 32, latents_std=[1.0] * 32)
    audio_vae = hook("audio_vae", audio_vae.eval().requires_grad_(False))
    return MiniMaxH3Pipeline(
        text_encoder=text_encoder, tokenizer=tokenizer, processor=processor, vae=vae, audio_vae=audio_vae,
        scheduler=MiniMaxH3Scheduler(shift=12.0), audio_scheduler=MiniMaxH3Scheduler(shift=3.0),
        transformer=transformer, text_encoder_layer=TEXT_ENCODER_LAYER,
    )  # fmt: skip


# --dit-format quantized: the components the fast presets quantize, built on the CPU and brought to the device in the
# presets' formats one layer at a time (no 16-bit copy of either on the card: what fits one 80 GB GPU).
QUANTIZED_BUILD_ON_CPU = ("text_encoder", "transformer")


def preset_dit_config(device):
    """The DiT format of the ``fast`` / ``fastest`` presets on ``device`` (FP8 with FP8 tensor cores, else W8A16)."""
    from diffusers_h3.pipelines.speed_presets import gemm_format
    from diffusers_h3.quantizers import FP8Config, W8A16Config

    return FP8Config() if gemm_format(device) == "fp8" else W8A16Config()


def preset_quantizing_hook(device, tiny):
    """``build_pipeline``'s component hook for ``--dit-format quantized``: the text encoder to the presets' text-encoder
    format (W8A16) and the DiT to :func:`preset_dit_config`, each quantized onto ``device`` from its CPU build
    (``quantize(module, config, device=...)``, what ``from_pretrained(..., quantization_config=...)`` does). The
    presets then find both "already quantized: kept", so the request runs the weights they would have made."""
    from diffusers_h3.pipelines.speed_presets import TEXT_ENCODER_FORMAT
    from diffusers_h3.quantizers import get_format, quantize

    target = None if tiny else device  # tiny components are built on the device already

    def hook(name, module):
        if name == "text_encoder":
            quantize(module, get_format(TEXT_ENCODER_FORMAT).config_cls(), device=target)
        elif name == "transformer":
            quantize(module, preset_dit_config(device), device=target)
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
        return module

    return hook


def peak_over_stages(peaks):
    """``(allocated, reserved)`` GiB: the largest of ``StageTimer.peaks`` (``(None, None)`` when empty, off CUDA).
    Each mark resets the allocator's peak, so the allocator itself knows only the interval since the last mark."""
    if not peaks:
        return None, None
    return max(v[0] for v in peaks.values()), max(v[1] for v in peaks.values())


def rounded_stage_peaks(peaks):
    """``StageTimer.peaks`` for the JSON: stage -> ``[allocated, reserved]`` GiB."""
    return {k: [round(v[0], 2), round(v[1], 2)] for k, v in peaks.items()}


class StageTimer:
    """CUDA-synchronized wall times of the pipeline's stages, by wrapping its stage methods and hooking the DiT, and
    the peak GPU memory (allocated and reserved) of each stage: the allocator's peak is read and reset at every stage
    boundary, the time between stages counted as ``other``. Keeps the last prompt embeddings (``prompt_embeds``)."""

    def __init__(self, pipe, device, sampler=None):
        self.pipe, self.device = pipe, device
        self.sampler = sampler  # a DeviceMemorySampler: one more sample at every stage boundary
        self.stages, self.forwards = {}, []
        self.peaks: dict = {}  # stage -> [peak allocated GiB, peak reserved GiB]
        self.prompt_embeds = None
        self.text_token_tags = None
        self._start = None
        self._handles = []

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def mark(self, stage):
        """Attribute the allocator's peak since the last mark to ``stage`` and start a new interval."""
        if self.device.type != "cuda":
            return
        if self.sampler is not None:
            self.sampler.sample()
        allocated = torch.cuda.max_memory_allocated(self.device) / 2**30
        reserved = torch.cuda.max_memory_reserved(self.device) / 2**30
        old = self.peaks.get(stage, [0.0, 0.0])
        self.peaks[stage] = [max(old[0], allocated), max(old[1], reserved)]
        torch.cuda.reset_peak_memory_stats(self.device)

    def _wrap(self, attr, stage):
        original = getattr(self.pipe, attr)

        def timed(*args, **kwargs):
            self._sync()
            self.mark("other")
            start = time.perf_counter()
            try:
                out = original(*args, **kwargs)
                self._sync()
            finally:  # a stage that fails (out of memory) still owns its peak
                self.mark(stage)
            self.stages[stage] = self.stages.get(stage, 0.0) + (time.perf_counter() - start) * 1000
            if stage == "text_encode":
                self.prompt_embeds = out[0].detach().float().cpu()
                self.text_token_tags = out[1] if isinstance(out, tuple) and len(out) > 1 else None
            return out

        setattr(self.pipe, attr, timed)

    def __enter__(self):
        self._wrap("encode_prompt", "text_encode")
        self._wrap("_encode_visual_condition", "condition_encode")
        self._wrap("_decode_video", "video_decode")
        self._wrap("_decode_audio", "audio_decode")

        def before(module, args, kwargs):
            self._sync()
            self.mark("other")
            self._start = time.perf_counter()

        def after(module, args, kwargs, output):
            self._sync()
            self.mark("forwards")
            self.forwards.append((time.perf_counter() - self._start) * 1000)

        transformer = self.pipe.transformer if self.pipe.transformer is not None else self.pipe.transformer_ref
        self._handles = [
            transformer.register_forward_pre_hook(before, with_kwargs=True),
            transformer.register_forward_hook(after, with_kwargs=True),
        ]
        return self

    def __exit__(self, *exc):
        for attr in ("encode_prompt", "_encode_visual_condition", "_decode_video", "_decode_audio"):
            self.pipe.__dict__.pop(attr, None)
        for handle in self._handles:
            handle.remove()


def request_kwargs(case, tiny):
    """The pipeline arguments of ``case``'s request."""
    from PIL import Image

    task, _, sigma_points, flow_shift, audio_flow_shift = CASE_SETUP[case]
    height, width = (64, 96) if tiny else (HEIGHT, WIDTH)
    rng = np.random.default_rng(0)
    prompt = ("A street drummer plays under neon lights, the crowd claps along. " * 16)[:PROMPT_TOKENS]
    kwargs = {"prompt": prompt, "height": height, "width": width, "num_frames": num_frames(tiny),
              "num_inference_steps": sigma_points, "flow_shift": flow_shift, "audio_flow_shift": audio_flow_shift,
              "output_type": "np"}  # fmt: skip
    if task == "fl2va":
        kwargs["image"] = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        kwargs["last_image"] = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    return kwargs


def num_frames(tiny: bool) -> int:
    """Frames of a request: the released 124 (5.2 s), or the tiny pipeline's shortest clip for the CPU smoke runs."""
    if tiny:
        from diffusers_h3.testing.tiny import TINY_NUM_FRAMES

        return TINY_NUM_FRAMES
    return NUM_FRAMES


def stop_after(forwards):
    """A step callback that interrupts the denoising loop after ``forwards`` forwards (decoding still runs)."""

    def callback(pipeline, step, timestep, tensors):
        if step + 1 >= forwards:
            pipeline._interrupt = True  # the loop skips the remaining forwards
        return {}

    return callback


def warm_up(pipe, case, tiny, decode):
    """One untimed request with two forwards: compilation, Triton autotuning, cuDNN / cuBLAS plans; ``decode`` also
    warms the VAE decoders (they do not change between cases). Two, because the first step has fewer distinct
    timesteps in the packed sequence (video and audio start at the same sigma) than the later ones, so the compiled
    blocks meet a second set of shapes at step 1."""
    kwargs = {**request_kwargs(case, tiny), "output_type": "np" if decode else "latent"}
    forwards = min(2, CASE_SETUP[case][2] - 1)
    pipe(**kwargs, generator=torch.Generator().manual_seed(0), callback_on_step_end=stop_after(forwards))


def request(pipe, case, device, out_dir, forwards_limit, tiny, export="one-shot", reference_embeds=None, sampler=None):
    """One request of ``case``; returns its record (ms, stages, forwards, peak). ``export="streamed"`` writes the MP4
    with ``pipe.decode_to_video`` (each decoded chunk encoded while the next decodes, as the CLI does): the video
    decode and the mux are then one stage, ``video_decode+mux``, and ``mux_after_last_chunk_ms`` is the time from the
    last chunk handed to the writer to the finished file. ``peak_gib`` / ``peak_reserved_gib``: the request's GPU peaks
    (weights included), ``stage_peak_gib``: ``[allocated, reserved]`` per stage; ``prompt_embeds_rel_l2``: the prompt
    embeddings against ``reference_embeds`` (the first case's, bf16 text encoder); ``sampler``: a
    ``DeviceMemorySampler`` sampled again at every stage boundary."""
    from diffusers_h3 import export_to_video
    from diffusers_h3.pipelines import export as export_module

    task, _, sigma_points, _, _ = CASE_SETUP[case]
    kwargs = request_kwargs(case, tiny)
    streamed = export == "streamed"
    if streamed:
        kwargs["output_type"] = "latent"
    total_forwards = sigma_points - 1
    timed_forwards = total_forwards if forwards_limit is None else min(forwards_limit, total_forwards)

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    resident = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None
    chunk_ready = []
    write_frames = export_module.VideoWriter.write_frames

    def timed_write_frames(writer, frames):
        chunk_ready.append(time.perf_counter())
        return write_frames(writer, frames)

    export_module.VideoWriter.write_frames = timed_write_frames
    try:
        with StageTimer(pipe, device, sampler=sampler) as timer:
            start = time.perf_counter()
            out = pipe(**kwargs, generator=torch.Generator().manual_seed(0),
                       callback_on_step_end=stop_after(timed_forwards))  # fmt: skip
            mux_start = time.perf_counter()
            path = str(Path(out_dir) / f"{case}.mp4")
            if streamed:
                pipe.decode_to_video(out.frames, out.audio, path)
            else:
                export_to_video(out.frames[0], path, audio=out.audio[0], sampling_rate=out.sampling_rate)
            end = time.perf_counter()
            timer.mark("video_decode+mux" if streamed else "mux")
    finally:
        export_module.VideoWriter.write_frames = write_frames
    if streamed:  # decode_to_video decodes the audio first (timed by its own stage), then the video into the writer
        timer.stages["video_decode+mux"] = (end - mux_start) * 1000 - timer.stages.get("audio_decode", 0.0)
    else:
        timer.stages["mux"] = (end - mux_start) * 1000
    assert len(timer.forwards) == timed_forwards, (len(timer.forwards), timed_forwards)
    forward_ms = statistics.median(timer.forwards)
    measured_ms = (end - start) * 1000
    missing = total_forwards - timed_forwards
    stages = {"text_encode": timer.stages.get("text_encode", 0.0)}
    if task == "fl2va":
        stages["condition_encode"] = timer.stages.get("condition_encode", 0.0)
    stages["forwards"] = sum(timer.forwards) + missing * forward_ms
    stages.update({k: timer.stages[k] for k in (("audio_decode", "video_decode+mux") if streamed else
                                                ("video_decode", "audio_decode", "mux"))})  # fmt: skip
    stages["other"] = measured_ms + missing * forward_ms - sum(stages.values())  # packing, scheduler steps, ...
    embeds_rel = None
    if reference_embeds is not None and timer.prompt_embeds is not None:
        embeds_rel = float((timer.prompt_embeds - reference_embeds).norm() / reference_embeds.norm())
    peak_allocated, peak_reserved = peak_over_stages(timer.peaks)
    return {
        "ms": round(measured_ms + missing * forward_ms, 1),
        "stages": {k: round(v, 1) for k, v in stages.items()},
        "forward_ms": [round(t, 1) for t in timer.forwards],
        "forward_median_ms": round(forward_ms, 1),
        "forwards": total_forwards,
        "forwards_timed": timed_forwards,
        "extrapolated": missing > 0,
        "sigma_points": sigma_points,
        "resident_gib": round(resident, 2) if resident is not None else None,
        "peak_gib": round(peak_allocated, 2) if peak_allocated is not None else None,
        "peak_reserved_gib": round(peak_reserved, 2) if peak_reserved is not None else None,
        "stage_peak_gib": rounded_stage_peaks(timer.peaks),
        "prompt_embeds_rel_l2": embeds_rel,
        "prompt_embeds": timer.prompt_embeds,  # popped by main: the reference of the next cases
        "export": export,
        "video_chunks_written": len(chunk_ready),
        "mux_after_last_chunk_ms": round((end - chunk_ready[-1]) * 1000, 1) if chunk_ready else None,
    }


def card_sampler(device):
    """The card's count of this process's memory (NVML, sampled: ``device_peak_gib`` per case), started; ``None`` off
    CUDA. Made before the process touches CUDA, so that its baseline is the idle card."""
    return DeviceMemorySampler(device.index or 0).start() if device.type == "cuda" else None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/request_h200.json")
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES),
                        help=f"comma list of cases to run (default: {','.join(DEFAULT_CASES)})")
    parser.add_argument("--skip", default="", help="comma list of cases to skip")
    parser.add_argument("--forwards", type=int, default=None, metavar="K",
                        help="time at most K forwards per request and extrapolate the rest (default: all)")
    parser.add_argument("--no-compile", action="store_true", help="presets without regional torch.compile")
    parser.add_argument("--no-warmup", action="store_true", help="skip the warm-up request (smoke tests only)")
    parser.add_argument("--tiny", action="store_true", help="tiny random components (CPU smoke test)")
    parser.add_argument("--device", default=None, help="default: cuda (cpu with --tiny when no GPU)")
    parser.add_argument("--commit", default=None, help="commit measured (the device copy has no .git)")
    parser.add_argument("--gpu-cap-gib", type=float, default=None, metavar="G",
                        help="hold the caching allocator to G GiB (apply_gpu_cap) for the fast / fastest cases, from "
                             "their preset on (the bf16 cases need more)")
    parser.add_argument("--dit-format", choices=("bf16", "quantized"), default="bf16",
                        help="bf16 (default): every component built in bf16 on the device, the presets quantize in "
                             "place (an H200 holds it); quantized: the text encoder and the DiT reach the device "
                             "already in the fast presets' formats, layer by layer from a CPU build (one 80 GB GPU; "
                             "only the fast / fastest cases)")  # fmt: skip
    parser.add_argument("--export", choices=("one-shot", "streamed"), default="one-shot",
                        help="one-shot: output_type='np' then export_to_video; streamed: output_type='latent' then "
                             "pipe.decode_to_video, the MP4 written while the video decodes (what the CLI runs)")  # fmt: skip
    args = parser.parse_args(argv)

    wanted = [c for c in args.cases.split(",") if c]
    skip = {c for c in args.skip.split(",") if c}
    unknown = sorted((set(wanted) | skip) - set(CASES))
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}: choose from {', '.join(CASES)}")
    if args.forwards is not None and args.forwards < 1:
        raise SystemExit(f"--forwards {args.forwards}: must be at least 1")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() or not args.tiny else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks/request.py needs a CUDA GPU (or --tiny for the CPU smoke test)")
    run = [c for c in CASES if c in wanted and c not in skip]
    bf16_cases = [c for c in run if CASE_SETUP[c][1] not in ("fast", "fastest")]
    if args.dit_format == "quantized" and bf16_cases:
        raise SystemExit(f"--dit-format quantized builds the fast presets' weights; {', '.join(bf16_cases)} run(s) "
                         "the bf16 model: run them with --dit-format bf16 (a card that holds it)")  # fmt: skip
    caches = {CASE_CACHE.get(c) for c in run}
    if len(caches) > 1:
        raise SystemExit(f"cases with different step caches in one run ({sorted(map(str, caches))}): run each cache "
                         "profile as its own --cases")  # fmt: skip

    sampler = card_sampler(device)  # before this process touches CUDA

    import diffusers_h3

    started = time.perf_counter()
    with sampler.window("build") if sampler is not None else contextlib.nullcontext():
        if args.dit_format == "quantized":
            pipe = build_pipeline(device, args.tiny, component_hook=preset_quantizing_hook(device, args.tiny),
                                  build_on_cpu=() if args.tiny else QUANTIZED_BUILD_ON_CPU)  # fmt: skip
        else:
            pipe = build_pipeline(device, args.tiny)
    # the card's count while building (the quantized build's claim: no 16-bit DiT or text encoder on the card whole)
    args.build_device_peak_gib = round(sampler.windows["build"] / 2**30, 2) if sampler is not None else None
    pipe.set_progress_bar_config(disable=True)
    cache = next(iter(caches), None)
    if cache is not None:  # before any preset: the preset compiles the blocks with the cache hooks in place
        from diffusers_h3.hooks.cache import cache_config

        pipe.transformer.enable_cache(cache_config(cache))
    build_s = time.perf_counter() - started
    print(f"built the pipeline in {build_s:.1f} s", flush=True)

    results, notes, applied, decoders_warm = {}, {}, None, False
    reference_embeds = {}  # task -> prompt embeddings of its first case (bf16 text encoder before any preset)
    out_dir = tempfile.mkdtemp(prefix="h3_request_")
    for case in run:
        preset, flashinfer = CASE_SETUP[case][1], CASE_FLASHINFER.get(case)
        capped = args.gpu_cap_gib is not None and preset in ("fast", "fastest") and device.type == "cuda"
        try:
            if preset is not None and (preset, flashinfer) != applied:
                torch._dynamo.reset()  # compile the new preset's blocks from scratch (no stale guards or cache limit)
                config = diffusers_h3.SpeedPresetConfig(preset, compile=not args.no_compile, flashinfer=flashinfer)
                diffusers_h3.enable_speed_preset(pipe, config)
                applied = (preset, flashinfer)
                decoders_warm = False  # the preset chose a decode path, and the reset dropped any compiled decoder
                if capped:
                    from diffusers_h3.parallel.memory_recipes import apply_gpu_cap

                    torch.cuda.empty_cache()  # the bf16 weights the preset quantized away
                    apply_gpu_cap(args.gpu_cap_gib, device)
            if device.type == "cuda":  # each case's peaks are its own, not the previous case's cached blocks
                torch.cuda.empty_cache()
            case_start = time.perf_counter()
            window = sampler.window(case) if sampler is not None else contextlib.nullcontext()
            with window:
                if not args.no_warmup:
                    warm_up(pipe, case, args.tiny, decode=not decoders_warm)
                    decoders_warm = True
                warmup_s = time.perf_counter() - case_start
                task = CASE_SETUP[case][0]
                record = request(pipe, case, device, out_dir, forwards_limit=args.forwards, tiny=args.tiny,
                                 export=args.export, reference_embeds=reference_embeds.get(task),
                                 sampler=sampler)  # fmt: skip
            if sampler is not None:  # the card's count over the case (warm-up and timed request)
                record.update(device_peak_fields(sampler.windows[case], record.get("peak_reserved_gib"),
                                                 sampler.source))  # fmt: skip
            embeds = record.pop("prompt_embeds", None)
            if task not in reference_embeds and embeds is not None and preset in (None, "exact"):
                reference_embeds[task] = embeds
        except Exception as error:  # noqa: BLE001 - one failing case must not lose the others
            results[case] = {"ms": None, "stages": None, "peak_gib": None}
            notes[case] = f"failed: {type(error).__name__}: {str(error)[:400]}"
            print(f"{case:22s} {notes[case]}", flush=True)
            traceback.print_exc()
        else:
            record["preset"] = preset
            record["gpu_cap_gib"] = args.gpu_cap_gib if capped else None
            record["warmup_s"] = round(warmup_s, 1)
            record["speed_preset"] = diffusers_h3.describe(pipe).get("speed_preset")
            if cache is not None:  # the config and the steps the cache skipped in the timed request
                from diffusers_h3.hooks.cache import describe_cache

                record["cache"] = describe_cache(pipe.transformer)
            results[case] = record
            stages = " ".join(f"{k} {v / 1000:.2f}" for k, v in record["stages"].items())
            print(f"{case:22s} {record['ms'] / 1000:7.2f} s ({stages}) peak {record['peak_gib']} GiB "
                  f"[{record['forwards_timed']}/{record['forwards']} forwards timed]", flush=True)  # fmt: skip
        write_report(args, results, notes, build_s, device)  # after every case: a time limit loses nothing done
    write_report(args, results, notes, build_s, device)
    if sampler is not None:
        sampler.stop()


def write_report(args, results, notes, build_s, device):
    base = results.get("t2va_native", {}).get("ms")
    for name, case in results.items():
        if name.startswith("t2va") and case.get("ms"):
            case["baseline"] = "t2va_native"
            case["ratio"] = round(base / case["ms"], 3) if base else None
        case.setdefault("rel_l2", None)  # random weights: numerical distance is measured by the forward suite
    report = {
        **result_header("request", args.commit, device="cpu (tiny smoke test)" if args.tiny else None),
        "shape": {"height": 64 if args.tiny else HEIGHT, "width": 96 if args.tiny else WIDTH, "frames": num_frames(args.tiny),
                  "prompt_tokens": PROMPT_TOKENS, "tiny": args.tiny,
                  "text_encoder": "Qwen3-VL-32B config, decoder layers 0-50 built, 0-49 run (early exit at "
                                  "hidden_states[50]), vision tower built" if not args.tiny else "tiny",
                  "transformer": "MiniMaxH3Transformer3DModel() defaults: 50 blocks, hidden 5376, 56x128 heads",
                  "vae": "AutoencoderKLMiniMaxH3() / AutoencoderKLMiniMaxH3Audio() defaults (released sizes), tiled",
                  "dit_format": args.dit_format,
                  "quantized_build": None if args.dit_format == "bf16" else
                  "text encoder and DiT built on the CPU and quantized onto the device layer by layer in the fast "
                  "presets' formats (the presets keep them)"},
        "protocol": ("random weights built on the device" if args.dit_format == "bf16" else
                     "random weights, the text encoder and DiT built on the CPU and quantized onto the device") +
                    "; per case 1 warm-up request (2 forwards) + 1 timed request "
                    "(CUDA-synchronized wall times per stage); with --forwards K only K forwards run and 'ms' and "
                    "stages.forwards add the missing ones at the median forward ('extrapolated': true)",
        "build_s": round(build_s, 1),
        "build_device_peak_gib": getattr(args, "build_device_peak_gib", None),
        "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or "default",  # expandable_segments changes reserved
        "cases": results,
        "notes": notes,
    }  # fmt: skip
    write_json(args.out, report)


if __name__ == "__main__":
    main()
