# Copyright 2026 The diffusers-h3 authors. Licensed under the Apache License, Version 2.0.
"""Speed presets: one call that turns on a consistent set of fast paths on the transformer partition(s).

* ``"exact"``: no approximation. bf16 weights, dense bf16 attention through the fastest exact kernel available: on
  Hopper FlashInfer's FlashAttention-3 kernel when flashinfer-python is installed (faster than cuDNN at H3's shape,
  docs/speed.md), else the fastest one diffusers' dispatcher offers (cuDNN on CUDA SM80+, PyTorch SDPA otherwise);
  regional ``torch.compile`` on CUDA with inductor's ``emulate_precision_casts`` (fused kernels round to bf16 where
  eager does).
* ``"fast"``: FP8 GEMMs (``FP8Config``) where FP8 tensor cores exist, else weight-only INT8 (``W8A16Config``), and
  dense 8-bit attention with INT8 Q/K (``LowPrecisionAttentionConfig(precision="int8")``: the same speed as our FP8
  Q/K on Hopper with less Q/K rounding error, docs/attention.md), no sparsity; regional compile on CUDA (with
  ``emulate_precision_casts``, as every preset). With ``flashinfer=True``
  (Hopper) FlashInfer's FA3 FP8 kernel instead: faster, with coarser rounding (E4M3 Q/K/V and P; docs/speed.md).
* ``"fastest"``: ``"fast"`` + video sparse attention at sparsity 0.8 with INT8 Q/K (``enable_vsa``; on a FastH3 stack
  the sparsity it was trained for, e.g. 0.9); regional compile on CUDA.

Each preset also picks the video decode (``plan_vae_decode``): ``"exact"`` diffusers' own tile-by-tile decode (the bitwise
reference), ``"fast"`` the tiles decoded in batches with the decoder under ``torch.compile`` on CUDA
(``enable_fast_vae_decode``), ``"fastest"`` the same with FP8 decoder linears where FP8 tensor cores exist (SM89+;
elsewhere without, said in the record). And the MP4 export settings (``EXPORT_SETTINGS``: the measured defaults of
benchmarks/results/export_cpu.json for all three) that ``MiniMaxH3Pipeline.decode_to_video`` and the CLI write with.

Each call logs what it turned on and records it on the pipeline (``diffusers_h3.describe(pipe)["speed_preset"]``).
Weight quantization is applied in place once: switching between ``"fast"`` and ``"fastest"`` keeps the quantized
weights, and a preset that needs other weights than the ones loaded (``"exact"`` after ``"fast"``, FP8 over W8A16)
raises instead of quantizing twice. ``enable_speed_preset_on_transformer`` applies the transformer part of a preset to
one model without a pipeline (benchmarks/forward.py). docs/speed.md has the exactness and determinism of each preset.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from diffusers.utils import logging

from .._hooks import moves_weights, partitions_of
from .._utils import config_from_call, cuda_capability, has_fp8_tensor_cores
from .._video_encoding import DEFAULT_CRF, DEFAULT_PIX_FMT, DEFAULT_PRESET
from ..attention_processors import (
    FlashInferAttentionConfig,
    LowPrecisionAttentionConfig,
    VSAConfig,
    disable_low_precision_attention,
    enable_flashinfer_attention,
    enable_low_precision_attention,
    enable_vsa,
    flashinfer_attention_state,
)
from ..hooks.fast_vae_decode import (
    FP8_LINEARS_NOTE,
    FastVAEDecodeConfig,
    decoder_is_fp8,
    disable_fast_vae_decode,
    enable_fast_vae_decode,
)
from ..kernels.attention.flashinfer_dense import (
    check_flashinfer_kernels,
    flashinfer_kernel_source,
    import_flashinfer,
    resolve_backend,
)
from ..loaders.single_file import transformer_file_record
from ..quantizers import FP8Config, W8A16Config, get_format, quantize, quantized_weight
from .fasth3 import fasth3_record


logger = logging.get_logger(__name__)

SPEED_PRESETS = ("exact", "fast", "fastest")
# The weight format "fast" / "fastest" give the text encoder (weight-only INT8: half the memory, any GPU).
TEXT_ENCODER_FORMAT = "w8a16"
# Sparsity of the "fastest" preset (the operating point of docs/attention.md and benchmarks/results).
FASTEST_SPARSITY = 0.8
# INT8 Q/K: same kernels and speed as FP8 Q/K on Ampere/Hopper, less Q/K rounding error (docs/attention.md).
ATTENTION_PRECISION = "int8"

# The precision of the FlashInfer kernel each preset can run (docs/speed.md).
FLASHINFER_PRECISION = {"exact": "bf16", "fast": "fp8"}

# Whether two identical requests give bitwise identical outputs on one GPU, and why (docs/speed.md).
DETERMINISM = {
    "exact": "bitwise reproducible on one GPU: cuDNN/SDPA and FlashInfer's single-prefill forward attention and "
             "cuBLAS GEMMs use no atomics for fixed shapes; inductor's generated kernels are fixed per shape",
    "fast": "bitwise reproducible on one GPU: the INT8 attention kernels and the FP8 GEMM path (Triton activation "
            "quantization + torch._scaled_mm) use no atomics or split reductions across launches",
    "fast+flashinfer": "expected bitwise reproducible on one GPU: FlashInfer's FA3 FP8 single-prefill has no split-KV "
                       "reduction, the operand quantization and the FP8 GEMM path use no atomics; not yet checked on "
                       "hardware (tests/gpu/test_flashinfer_gpu.py)",
    "fastest": "bitwise reproducible on one GPU: VSA's pooling, top-k selection and block-sparse kernels use no "
               "atomics; ties in top-k resolve the same way on every run",
}  # fmt: skip


# The MP4 export each preset writes with (`MiniMaxH3Pipeline.decode_to_video`, `diffusers-h3 generate`): all three
# take the measured defaults of benchmarks/results/export_cpu.json (docs/pipeline.md, "MP4 export"). No preset has a
# reason to differ: the encoder runs on the CPU while the GPU decodes and the streamed export hides it behind the
# decode whatever the preset, and neither a slower x264 preset nor a lower crf bought visible quality there.
EXPORT_SOURCE = "measured defaults: benchmarks/results/export_cpu.json (docs/pipeline.md, MP4 export)"
EXPORT_SETTINGS: Dict[str, Dict[str, Any]] = {
    preset: {"crf": DEFAULT_CRF, "preset": DEFAULT_PRESET, "pix_fmt": DEFAULT_PIX_FMT} for preset in SPEED_PRESETS
}


# Inductor keeps fused intermediates in fp32 unless asked to round them where eager rounds. Every preset asks: the
# compiled blocks keep eager's bf16 numerics (bitwise on the CPU: tests/pipelines/test_speed_presets.py), at no cost in
# time, and without it the 8-bit presets' distance to native grows by half (docs/speed.md, "Measured").
EMULATE_EAGER_ROUNDING = {"emulate_precision_casts": True}
COMPILE_OPTIONS: Dict[str, Dict[str, Any]] = {preset: dict(EMULATE_EAGER_ROUNDING) for preset in SPEED_PRESETS}


def compile_blocks(
    model: torch.nn.Module, preset: str, fullgraph: bool = False, dynamic: Optional[bool] = None
) -> str:
    """Regional ``torch.compile`` of ``model``'s repeated blocks with ``preset``'s inductor options; returns the line
    ``describe`` shows.

    The kernels are custom ops (``diffusers_h3::*``) and the VSA route is prepared outside the blocks, so the presets'
    blocks trace without a graph break (tests/pipelines/test_compile_fullgraph.py); ``fullgraph=True`` makes any
    break an error instead of a split graph. ``dynamic``: torch.compile's; the presets keep its default (``None``: the
    second packed length met recompiles once with symbolic sizes, later lengths reuse that graph), which ran the
    fl2va forward after a t2va one as fast as static graphs (docs/speed.md, "Compilation")."""
    options = COMPILE_OPTIONS[check_speed_preset(preset)]
    kwargs: Dict[str, Any] = {"fullgraph": fullgraph}
    if dynamic is not None:
        kwargs["dynamic"] = dynamic
    if options:
        kwargs["options"] = dict(options)
    model.compile_repeated_blocks(**kwargs)
    extra = "".join(f", {key}={value}" for key, value in options.items())
    extra += "" if dynamic is None else f", dynamic={dynamic}"
    return f"regional torch.compile (compile_repeated_blocks, fullgraph={fullgraph}{extra})"


def check_speed_preset(preset: Any) -> str:
    """``preset`` if it names a speed preset; one clear error otherwise."""
    if preset not in SPEED_PRESETS:
        raise ValueError(f"unknown speed preset {preset!r}: choose one of {', '.join(repr(p) for p in SPEED_PRESETS)}")
    return preset


@dataclass(frozen=True)
class SpeedPresetConfig:
    r"""
    A speed preset and its options, for :func:`enable_speed_preset` (a preset name alone is
    ``SpeedPresetConfig(name)``).

    Args:
        preset (`str`): ``"exact"``, ``"fast"`` or ``"fastest"`` (see the module docstring and docs/speed.md).
        compile (`bool`, defaults to `True`): regional ``torch.compile`` of the transformer blocks on CUDA (diffusers'
            ``compile_repeated_blocks``; the first call compiles). Ignored with a log line on CPU.
        flashinfer (`bool`, *optional*): FlashInfer's FlashAttention-3 kernels for the dense attention. ``"exact"``:
            `None` (default) uses FA3 bf16 on Hopper when flashinfer-python is installed (it builds its kernels on
            first use), `False` diffusers' backend (cuDNN). ``"fast"``: `True` runs FA3's FP8 kernel (Hopper) instead
            of the INT8 attention (faster, less exact); `None` / `False` keep INT8. `True` requires it (an error if it
            cannot run). ``"fastest"`` refuses `True`.
        fullgraph (`bool`, defaults to `False`): compile each block as one graph (``compile_repeated_blocks(
            fullgraph=True)``): an error on any graph break instead of a split graph. The presets' blocks have none
            (every kernel is a custom op), so this only changes what happens if one appears.
        quantize_text_encoder (`bool`, *optional*): ``"fast"`` / ``"fastest"`` quantize a bf16 text encoder that
            sits on its device to weight-only INT8 (``W8A16Config``) by default (`None`): half its memory (the 32B
            Qwen3-VL's 50 layers from ~50 to ~25 GiB), which is what lets the preset's whole request stay under 75 GiB
            on one GPU; the prompt embeddings move by the error docs/speed.md states. `False` keeps it as loaded;
            `True` requires it (an error for an offloaded text encoder, or with ``"exact"``, which never changes it).
            A text encoder loaded quantized is kept. A pipeline's option: a transformer alone has no text encoder.
    """

    preset: str
    compile: bool = True
    flashinfer: Optional[bool] = None
    fullgraph: bool = False
    quantize_text_encoder: Optional[bool] = None

    def __post_init__(self):
        check_speed_preset(self.preset)


def speed_preset_config(config: Union[str, SpeedPresetConfig, None], legacy_args, legacy, call: str) -> SpeedPresetConfig:
    """The :class:`SpeedPresetConfig` of an ``enable_speed_preset*`` call: ``config`` (a preset name is
    ``SpeedPresetConfig(name)``), with the options it took as separate arguments before (deprecated) applied."""
    if isinstance(config, str):
        config = SpeedPresetConfig(config)
    if config is None and "preset" not in legacy:
        raise TypeError(f"{call}() needs a preset: pass one of {', '.join(repr(p) for p in SPEED_PRESETS)} or a "
                        "SpeedPresetConfig")  # fmt: skip
    return config_from_call(SpeedPresetConfig, config, legacy, call=call, legacy_args=legacy_args,
                            legacy_positional=("compile", "flashinfer", "fullgraph", "quantize_text_encoder"))


def gemm_format(device: torch.device) -> str:
    """The weight format the ``"fast"`` presets quantize the DiT to on ``device``: ``"fp8"`` (FP8 tensor cores,
    SM89+) or ``"w8a16"`` (everywhere else: weight-only INT8 with 16-bit GEMMs)."""
    device = torch.device(device)
    return "fp8" if device.type == "cuda" and has_fp8_tensor_cores(device) else "w8a16"


# The dtypes the fused attention kernels (cuDNN, FlashInfer) run; a float32 model keeps SDPA's own choice.
HALF_DTYPES = (torch.bfloat16, torch.float16)


def exact_attention_backend(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> Optional[str]:
    """diffusers' attention backend for exact dense attention of a ``dtype`` model on ``device``: cuDNN's fused
    attention on CUDA SM80+ for bf16 / fp16 (the fastest exact kernel diffusers dispatches to on Hopper; it has no
    float32 kernel), ``None`` (keep the active backend) elsewhere."""
    device = torch.device(device)
    cap = cuda_capability(device) if device.type == "cuda" else None
    if dtype in HALF_DTYPES and cap is not None and tuple(cap) >= (8, 0) and torch.backends.cudnn.is_available():
        return "_native_cudnn"
    return None


def attention_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype ``model``'s attention runs in: its transformer blocks' (diffusers keeps a few other modules in
    float32 whatever the model's dtype)."""
    blocks = getattr(model, "transformer_blocks", None)
    source = blocks if blocks is not None and len(blocks) else model
    return next((p.dtype for p in source.parameters() if p.is_floating_point()), torch.float32)


def set_attention_backend_on_model(model: torch.nn.Module, backend: str) -> None:
    """``model.set_attention_backend(backend)`` for ``model``'s processors only.

    diffusers' ``ModelMixin.set_attention_backend`` also makes ``backend`` the process-wide active backend, which every
    other model whose processors have no backend of their own then runs on (an fp32 VAE on cuDNN finds no kernel):
    the previous active backend is restored.
    """
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    previous = _AttentionBackendRegistry.get_active_backend()[0]
    try:
        model.set_attention_backend(backend)
    finally:
        _AttentionBackendRegistry.set_active_backend(previous)


def plan_flashinfer(
    flashinfer: Optional[bool], device: torch.device, preset: str, dtype: torch.dtype = torch.bfloat16
) -> str:
    """Whether ``preset`` runs a FlashInfer kernel on ``device``: ``"on"``, ``"off"``, ``"available"`` (``"fast"``:
    it could, when asked), or why the automatic choice could not take it (``"not installed"``, ``"no compiler"``);
    checked before anything changes.

    ``"exact"``: ``flashinfer=None`` (the default) takes FA3 bf16 on a Hopper GPU (SM90, where it is faster than cuDNN
    at no cost in exactness, docs/speed.md) when flashinfer-python is importable. ``"fast"``: FA3's FP8 kernel only when
    asked (``flashinfer=True``, Hopper): it is faster than the INT8 attention but less exact (docs/speed.md), so automatic
    keeps INT8. ``True``: required (one clear error when the package, the GPU or a float32 model cannot run it).
    ``False``: never. ``dtype``: the transformer's attention dtype (FlashInfer has no float32 kernel).
    ``"fastest"`` runs video sparse attention, which no FlashInfer kernel runs, and refuses ``flashinfer=True``."""
    if flashinfer is not None and not isinstance(flashinfer, bool):
        raise TypeError(f"flashinfer must be None (automatic), True or False, got {flashinfer!r}")
    if preset not in FLASHINFER_PRECISION:
        if flashinfer:
            raise ValueError(
                f"flashinfer=True: no FlashInfer kernel runs the {preset!r} preset's video sparse attention (partial "
                "tiles, more than 64 selected key tiles): drop flashinfer=True, or use preset='fast' (FA3 FP8) or "
                "'exact' (FA3 bf16)"
            )
        return "off"
    if flashinfer is False:
        return "off"
    if dtype not in HALF_DTYPES:
        if flashinfer:
            raise ValueError(
                f"flashinfer=True: FlashInfer's attention kernels run bf16 / fp16 models, this transformer is {dtype}: "
                "load it with torch_dtype=torch.bfloat16, or drop flashinfer=True"
            )
        return "off"
    device = torch.device(device)
    capability = cuda_capability(device)
    if flashinfer is None:
        if capability is None or capability[0] != 9:
            return "off"
        try:
            import_flashinfer()
        except ImportError:
            return "not installed"
        if flashinfer_kernel_source() is None:
            return "no compiler"
        return "on" if preset == "exact" else "available"
    check_flashinfer_kernels()  # flashinfer=True: one clear error when it is missing, cannot build or the GPU cannot run it
    resolve_backend("auto" if FLASHINFER_PRECISION[preset] == "bf16" else "fa3", capability)  # FP8 is FA3's
    return "on"


@dataclass(frozen=True)
class VAEDecodePlan:
    """The video decode a preset runs: diffusers' own (``batched=False``) or ``enable_fast_vae_decode``'s, and the
    lines ``describe`` shows."""

    batched: bool
    compile: bool
    fp8_linears: bool
    decode: str
    decode_compile: str


def plan_vae_decode(preset: str, device: torch.device, compile: bool, decoder_fp8: bool = False) -> VAEDecodePlan:
    """The video decode of ``preset`` for a VAE on ``device`` (``decoder_fp8``: its decoder linears are FP8 already);
    raises before anything changes when it cannot be run.

    ``"exact"``: diffusers' tile-by-tile decode, eager (the bitwise reference). ``"fast"``: the tiles decoded in
    batches, the decoder under ``torch.compile`` on CUDA. ``"fastest"``: the same with FP8 decoder linears where FP8
    tensor cores exist (SM89+; approximate, the measured error is in docs/speed.md), without them elsewhere.
    """
    check_speed_preset(preset)
    device = torch.device(device)
    if preset == "exact":
        if decoder_fp8:
            raise ValueError(
                "speed preset 'exact' runs diffusers' own video decode, but the VAE decoder's linears are already FP8 "
                "(an earlier 'fastest' preset), which cannot be undone: reload the VAE or the pipeline and apply "
                "'exact' first"
            )
        return VAEDecodePlan(False, False, False, "diffusers' tiled decode",
                             "off: 'exact' runs diffusers' eager decode (the bitwise reference)")  # fmt: skip
    compiled = bool(compile) and device.type == "cuda"
    if compiled:
        compile_line = "torch.compile of the VAE decoder (one graph per tile-batch shape, built on the first decode)"
    elif compile:
        compile_line = f"off: the VAE decoder is compiled on CUDA only (device {device})"
    else:
        compile_line = "off (compile=False)"
    if decoder_fp8:
        fp8, fp8_line = True, f"{FP8_LINEARS_NOTE} [already quantized: kept; reload the VAE for bf16 linears]"
    elif preset == "fastest" and device.type == "cuda" and has_fp8_tensor_cores(device):
        fp8, fp8_line = True, FP8_LINEARS_NOTE
    elif preset == "fastest":
        fp8, fp8_line = False, f"decoder linears not quantized: no FP8 tensor cores on {device} (SM89+ needed)"
    else:
        fp8, fp8_line = False, ""
    decode = "batched tiles" + (" + torch.compile" if compiled else "") + (f" + {fp8_line}" if fp8 else "")
    decode += " (enable_fast_vae_decode)" + ("" if fp8 or not fp8_line else f"; {fp8_line}")
    return VAEDecodePlan(True, compiled, fp8, decode, compile_line)


@dataclass
class SpeedPresetRecord:
    """What ``enable_speed_preset`` turned on, per partition, for ``describe``."""

    preset: str
    weights: Dict[str, str] = field(default_factory=dict)
    attention: Dict[str, str] = field(default_factory=dict)
    compile: Dict[str, str] = field(default_factory=dict)
    decode: str = ""
    decode_compile: str = ""
    export: Dict[str, Any] = field(default_factory=dict)
    determinism: str = ""

    def describe(self) -> Dict[str, Any]:
        return {
            "preset": self.preset,
            "weights": dict(self.weights),
            "attention": dict(self.attention),
            "compile": dict(self.compile),
            "decode": self.decode,
            "decode_compile": self.decode_compile,
            "export": dict(self.export),
            "determinism": self.determinism,
        }


def _quantized_method(model: torch.nn.Module) -> Optional[str]:
    methods = {str(quantized_weight(m).quant_method) for m in model.modules() if quantized_weight(m) is not None}
    return ", ".join(sorted(methods)) if methods else None


def _has_lora(model: torch.nn.Module) -> bool:
    return bool(getattr(model, "peft_config", None)) or any("lora_A" in name for name, _ in model.named_modules())


def _is_compiled(model: torch.nn.Module) -> bool:
    repeated = set(getattr(model, "_repeated_blocks", ()) or ())
    return any(
        getattr(module, "_compiled_call_impl", None) is not None
        for module in model.modules()
        if type(module).__name__ in repeated
    )


def _determinism(preset: str, flashinfer_plans) -> str:
    """The determinism line of ``preset`` as planned (the FA3 FP8 ``"fast"`` variant has its own)."""
    return DETERMINISM["fast+flashinfer" if preset == "fast" and "on" in flashinfer_plans else preset]


def _plan_weights(name: str, model: torch.nn.Module, preset: str, device: torch.device) -> Tuple[Optional[Any], str]:
    """``(config to quantize with or None, what the weights will be)``; raises when the loaded weights cannot become
    what ``preset`` needs without quantizing twice."""
    from_file = transformer_file_record(model)
    if from_file is not None and from_file.quantized:  # a GGUF / fp8-scaled file: its weights are all there is
        kept = f"{from_file.summary()} [the file's weights: kept]"
        return None, kept + (" (exact attention on the file's quantized weights)" if preset == "exact" else "")
    loaded = _quantized_method(model)
    if preset == "exact":
        if loaded is not None:
            raise ValueError(
                f"speed preset 'exact' runs bf16 weights, but {name} is already quantized ({loaded}): quantized "
                "weights cannot be restored exactly; reload the pipeline without quantization and apply 'exact' first"
            )
        dtype = str(next(model.transformer_blocks.parameters()).dtype).replace("torch.", "")
        return None, f"{dtype} (not quantized)"
    wanted = gemm_format(device)
    config = FP8Config() if wanted == "fp8" else W8A16Config()
    why = (
        "FP8 tensor cores" if wanted == "fp8" else f"no FP8 tensor cores on {device} (SM89+ needed for FP8 GEMMs)"
    )
    label = ("FP8 E4M3 weights + per-token FP8 activations (FP8Config)" if wanted == "fp8" else
             "weight-only INT8 with 16-bit GEMMs (W8A16Config)") + f": {why}"  # fmt: skip
    if loaded is not None:
        if loaded != str(config.quant_method):
            raise ValueError(
                f"speed preset {preset!r} quantizes {name} with {type(config).__name__} on {device}, but it is "
                f"already quantized ({loaded}); reload it in bf16 (or with {type(config).__name__}) before applying the preset"
            )
        return None, label + " [already quantized: kept]"
    if _has_lora(model):
        raise ValueError(
            f"speed preset {preset!r} quantizes {name} in place, but it has LoRA adapters loaded: apply the preset "
            "before load_lora_weights (LoRA loads onto quantized layers)"
        )
    return config, label


def _plan_text_encoder(
    text_encoder: Optional[torch.nn.Module], preset: str, quantize_text_encoder: Optional[bool]
) -> Tuple[Optional[Any], Optional[str]]:
    """``(config to quantize the text encoder with or None, what its weights will be)``; ``(None, None)`` without a
    text encoder. ``"fast"`` / ``"fastest"`` quantize a resident bf16 text encoder to weight-only INT8 (W8A16) unless
    ``quantize_text_encoder=False``: half its memory, so that the preset's whole request fits an 80 GB GPU
    (docs/speed.md, "Memory"); ``"exact"`` never touches it. Raises before anything changes when asked for what
    cannot be done."""
    if quantize_text_encoder is not None and not isinstance(quantize_text_encoder, bool):
        raise TypeError(f"quantize_text_encoder must be None (automatic), True or False, got {quantize_text_encoder!r}")
    if preset == "exact" and quantize_text_encoder:
        raise ValueError("quantize_text_encoder=True: the 'exact' preset runs the text encoder as loaded; drop the "
                         "argument, or use preset='fast' / 'fastest' (they quantize it to W8A16)")  # fmt: skip
    if text_encoder is None:
        if quantize_text_encoder:
            raise ValueError("quantize_text_encoder=True: the pipeline has no text encoder (loaded with "
                             "text_encoder=None); drop the argument")  # fmt: skip
        return None, None
    loaded = _quantized_method(text_encoder)
    if loaded is not None:
        kept = "" if preset != "exact" else " (quantized before the preset: not exact)"
        return None, f"{loaded} [already quantized: kept]{kept}"
    dtype = str(next(text_encoder.parameters()).dtype).replace("torch.", "")
    if preset == "exact":
        return None, f"{dtype} (not quantized)"
    if quantize_text_encoder is False:
        return None, f"{dtype} (not quantized: quantize_text_encoder=False)"
    if hasattr(text_encoder, "_hf_hook") or moves_weights(text_encoder):
        if quantize_text_encoder:
            raise ValueError(
                "quantize_text_encoder=True: the text encoder is offloaded (its weights move between devices), so it "
                "cannot be quantized in place; load it quantized instead (W8A16Config as quantization_config, or a "
                "memory recipe: docs/memory.md)"
            )
        return None, f"{dtype}, offloaded (not quantized: an offloaded text encoder is not quantized in place)"
    if _has_lora(text_encoder):
        raise ValueError(
            f"speed preset {preset!r} quantizes the text encoder in place, but it has LoRA adapters loaded: apply the "
            "preset before loading them, or pass quantize_text_encoder=False"
        )
    config = get_format(TEXT_ENCODER_FORMAT).config_cls()
    return config, f"weight-only INT8 with 16-bit GEMMs ({type(config).__name__}): half the bf16 memory"


@dataclass(frozen=True)
class _TransformerPlan:
    """What a preset will do to one transformer, checked before anything changes: its device, the quantization
    config (``None``: keep its weights), what its weights will be, and the FlashInfer plan (``plan_flashinfer``)."""

    device: torch.device
    quantization: Optional[Any]
    weights: str
    flashinfer: str


def _apply_to_transformer(
    record: SpeedPresetRecord,
    name: str,
    model: torch.nn.Module,
    plan: _TransformerPlan,
    config: SpeedPresetConfig,
    sparsity: float = FASTEST_SPARSITY,
) -> None:
    """Turn ``config``'s weights, attention and compile on for one transformer (as ``plan`` says) and record it
    under ``name``."""
    device, weights, flashinfer, preset = plan.device, plan.weights, plan.flashinfer, config.preset
    if plan.quantization is not None:
        quantize(model, plan.quantization)
    record.weights[name] = weights

    if preset == "exact":
        disable_low_precision_attention(model)  # diffusers' default processor on every block
        dtype = attention_dtype(model)
        dense = f"dense {str(dtype).replace('torch.', '')}"
        backend = exact_attention_backend(device, dtype)
        if backend is not None:  # the token refiner keeps diffusers' processor, on this backend
            set_attention_backend_on_model(model, backend)
            record.attention[name] = f"{dense}, diffusers backend {backend!r}"
        else:
            record.attention[name] = f"{dense}, diffusers' active backend (SDPA)"
        if flashinfer == "on":
            resolved = flashinfer_attention_state(enable_flashinfer_attention(model, FlashInferAttentionConfig()))
            resolved = resolved["backend"]
            record.attention[name] = f"{dense}, FlashInfer {resolved.upper()} (single_prefill) in the blocks"
        elif flashinfer == "not installed":
            record.attention[name] += " (flashinfer-python not installed: with it, FlashInfer's faster FA3 kernel)"
        elif flashinfer == "no compiler":
            record.attention[name] += (" (flashinfer-python is installed but cannot build its kernels: no nvcc found; "
                                       "set CUDA_HOME or install flashinfer-jit-cache for its faster FA3 kernel)")
    elif preset == "fast" and flashinfer == "on":
        enable_flashinfer_attention(model, FlashInferAttentionConfig(backend="fa3", precision="fp8"))
        record.attention[name] = ("dense FP8, FlashInfer FA3 FP8 (single_prefill) in the blocks: E4M3 Q/K/V with one "
                                  "scale per head, K mean-centred, FP8 P·V")  # fmt: skip
    elif preset == "fast":
        enable_low_precision_attention(model, LowPrecisionAttentionConfig(precision=ATTENTION_PRECISION))
        record.attention[name] = f"dense {ATTENTION_PRECISION.upper()} Q/K + bf16 P·V (enable_low_precision_attention)"
        if flashinfer == "available":
            record.attention[name] += (" (flashinfer=True: FlashInfer's FA3 FP8 kernel, faster on this GPU, less "
                                       "exact: E4M3 Q/K/V and P; docs/speed.md)")
    else:
        enable_vsa(model, VSAConfig(sparsity=sparsity, precision=ATTENTION_PRECISION))
        record.attention[name] = (
            f"VSA sparsity={sparsity} with {ATTENTION_PRECISION.upper()} Q/K + bf16 P·V (enable_vsa)"
            + ("" if sparsity == FASTEST_SPARSITY else ": the FastH3 stack's trained sparsity")
        )

    # Blocks compiled before (an earlier preset) keep their torch.compile wrappers: Dynamo's guards on the swapped
    # processors / linears make the next call re-trace them (up to torch._dynamo.config.recompile_limit re-traces;
    # torch._dynamo.reset() before the switch starts from an empty cache).
    if _is_compiled(model):
        record.compile[name] = "regional torch.compile (blocks already compiled: kept)"
    elif config.compile and device.type == "cuda":
        record.compile[name] = compile_blocks(model, preset, fullgraph=config.fullgraph)
    elif config.compile:
        record.compile[name] = f"off: regional torch.compile is applied on CUDA only (device {device})"
    else:
        record.compile[name] = "off (compile=False)"
    logger.info(
        f"speed preset {preset!r} on {name}: weights {record.weights[name]}; attention {record.attention[name]}; "
        f"compile {record.compile[name]}"
    )


# A pipeline is no module and has no hook registry: the preset's pipeline-wide record (every partition, the decode)
# is kept on the pipeline object under this attribute; the parts it enables hold their own records in their hooks.
_RECORD_ATTRIBUTE = "_h3_speed_preset"


def enable_speed_preset(pipe, config: Union[str, SpeedPresetConfig, None] = None, *args, **legacy):
    r"""
    Turn on the fast paths of a speed preset on every loaded transformer partition of a `MiniMaxH3Pipeline`.

    Args:
        pipe (`MiniMaxH3Pipeline`): the pipeline (its components already on their devices: FP8 or W8A16 and the
            attention kernels are chosen for the transformer's device).
        config (`SpeedPresetConfig` or `str`): the preset and its options; a preset name (``"exact"``, ``"fast"`` or
            ``"fastest"``) is ``SpeedPresetConfig(name)``. ``compile=`` / ``flashinfer=`` / ``fullgraph=`` /
            ``quantize_text_encoder=`` as separate arguments still work for one release, with a ``FutureWarning``.

    Returns the pipeline. What was turned on is the :class:`SpeedPresetRecord` read with
    :func:`speed_preset_record` (``diffusers_h3.describe(pipe)`` reports it as ``speed_preset``).
    """
    config = speed_preset_config(config, args, legacy, "enable_speed_preset")
    preset = config.preset
    if isinstance(pipe, torch.nn.Module) or not callable(getattr(pipe, "_device_of", None)):
        raise TypeError(f"enable_speed_preset expects a MiniMaxH3Pipeline, got {type(pipe).__name__}")
    models = partitions_of(pipe)
    if not models:
        raise ValueError("enable_speed_preset: the pipeline holds no transformer partition to speed up")
    # Check every partition and the VAE before changing any (one clear error, nothing half-applied).
    plans = {}
    for name, model in models:
        device = pipe._device_of(model)
        plans[name] = _TransformerPlan(device, *_plan_weights(name, model, preset, device),
                                       plan_flashinfer(config.flashinfer, device, preset, attention_dtype(model)))
    text_encoder = getattr(pipe, "text_encoder", None)
    text_encoder_config, text_encoder_weights = _plan_text_encoder(text_encoder, preset, config.quantize_text_encoder)
    vae = getattr(pipe, "vae", None)
    vae_plan = (None if vae is None
                else plan_vae_decode(preset, pipe._device_of(vae), config.compile, decoder_is_fp8(vae)))  # fmt: skip

    # A FastH3 stack (pipelines/fasth3.py) runs "fastest" at the sparsity it was trained for; dense attention (the other
    # presets) leaves its trained gates unused, which is said.
    stack = fasth3_record(pipe)
    stack_sparsity = FASTEST_SPARSITY if stack is None or stack.preset.vsa_sparsity is None else stack.preset.vsa_sparsity
    if stack is not None and stack.preset.vsa_sparsity is not None and preset != "fastest":
        logger.warning(f"speed preset {preset!r} runs dense attention, which does not use the FastH3 stack's trained "
                       f"VSA gates ({stack.preset.name} was distilled with VSA {stack.preset.vsa_sparsity:g}): use "
                       "'fastest' (VSA at the stack's sparsity)")  # fmt: skip
    record = SpeedPresetRecord(preset=preset, determinism=_determinism(preset, [p.flashinfer for p in plans.values()]),
                               export={**EXPORT_SETTINGS[preset], "source": EXPORT_SOURCE})  # fmt: skip
    for name, model in models:
        _apply_to_transformer(record, name, model, plans[name], config,
                              sparsity=stack_sparsity if name == "transformer" else FASTEST_SPARSITY)  # fmt: skip
    if text_encoder_config is not None:
        quantize(text_encoder, text_encoder_config)
    if text_encoder_weights is not None:
        record.weights["text_encoder"] = text_encoder_weights
        logger.info(f"speed preset {preset!r} on text_encoder: weights {text_encoder_weights}")
    # The batched-tile decode reorders the decoder's GEMMs (bf16 rounding may differ from diffusers' tile loop), so
    # the exact preset keeps diffusers' decode.
    if vae_plan is None:
        record.decode, record.decode_compile = "no video VAE", "off (no video VAE)"
    else:
        if vae_plan.batched:
            enable_fast_vae_decode(vae, FastVAEDecodeConfig(batch_tiles=True, compile=vae_plan.compile,
                                                            fp8_linears=vae_plan.fp8_linears))  # fmt: skip
        else:
            disable_fast_vae_decode(vae)
        record.decode, record.decode_compile = vae_plan.decode, vae_plan.decode_compile
    logger.info(f"speed preset {preset!r}: video decode {record.decode}; decoder compile {record.decode_compile}; "
                f"export {record.export}")  # fmt: skip
    setattr(pipe, _RECORD_ATTRIBUTE, record)
    return pipe


def enable_speed_preset_on_transformer(
    transformer: torch.nn.Module, config: Union[str, SpeedPresetConfig], name: str = "transformer"
) -> SpeedPresetRecord:
    r"""
    Turn on a speed preset's transformer part (weights, attention, regional compile) on one
    `MiniMaxH3Transformer3DModel`, without a pipeline: what :func:`enable_speed_preset` does per partition, with the
    same checks (one clear error before anything changes). The video decode is not touched.

    Args:
        transformer (`MiniMaxH3Transformer3DModel`): the model, on the device it will run on.
        config (`SpeedPresetConfig` or `str`): the preset and its options, as for :func:`enable_speed_preset`
            (``quantize_text_encoder`` is refused: there is no text encoder).
        name (`str`, defaults to ``"transformer"``): the key of the record's per-partition entries.

    Returns a :class:`SpeedPresetRecord` (``decode`` says that no VAE was involved). Unlike :func:`enable_speed_preset`,
    not the target: a model keeps state only in registry hooks, and this record has no hook of its own to live in.
    """
    config = SpeedPresetConfig(config) if isinstance(config, str) else config
    if not isinstance(config, SpeedPresetConfig):
        raise TypeError(f"enable_speed_preset_on_transformer takes a SpeedPresetConfig or a preset name, got "
                        f"{type(config).__name__}")  # fmt: skip
    if config.quantize_text_encoder is not None:
        raise ValueError("quantize_text_encoder: enable_speed_preset_on_transformer has no text encoder to quantize; "
                         "leave it None (or use enable_speed_preset on a pipeline)")  # fmt: skip
    preset = config.preset
    weight = next(transformer.parameters(), None)
    if weight is None:
        weight = next(transformer.buffers(), None)
    device = weight.device if weight is not None else torch.device("cpu")
    plan = _TransformerPlan(device, *_plan_weights(name, transformer, preset, device),
                            plan_flashinfer(config.flashinfer, device, preset, attention_dtype(transformer)))
    record = SpeedPresetRecord(preset=preset, determinism=_determinism(preset, [plan.flashinfer]),
                               decode="not applied (transformer only)")
    _apply_to_transformer(record, name, transformer, plan, config)
    return record


def speed_preset_report(pipe) -> Optional[Dict[str, Any]]:
    """The recorded speed preset of ``pipe`` (``None`` when none was applied)."""
    record = speed_preset_record(pipe)
    return record.describe() if record is not None else None


def speed_preset_record(pipe) -> Optional[SpeedPresetRecord]:
    """The :class:`SpeedPresetRecord` of the last :func:`enable_speed_preset` on ``pipe``, or ``None``."""
    return getattr(pipe, _RECORD_ATTRIBUTE, None)


__all__: List[str] = [
    "SPEED_PRESETS",
    "SpeedPresetConfig",
    "SpeedPresetRecord",
    "VAEDecodePlan",
    "check_speed_preset",
    "enable_speed_preset",
    "enable_speed_preset_on_transformer",
    "exact_attention_backend",
    "gemm_format",
    "plan_flashinfer",
    "plan_vae_decode",
    "speed_preset_record",
    "speed_preset_report",
]
