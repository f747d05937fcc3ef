"""``diffusers_h3.describe(pipe)``: which path every attention processor and quantized layer runs.

Processors and quantized weights of this package implement ``describe_path() -> str`` (one line: kernel or fallback,
and why; "not run on hardware" where that applies). Anything else is reported by class name. What an ``enable_*``
attached to a model is read from the records its hooks hold in the model's diffusers ``HookRegistry``
(``diffusers_h3._hooks``), never re-derived: the report says what was set up and, where the hook records it, what ran.
"""

from __future__ import annotations

import collections
import importlib.metadata
import platform
from typing import Any, Dict, List

import torch

from ._hooks import (
    H3_CALL_PLAN_HOOK,
    H3_CONTEXT_PARALLEL_HOOK,
    H3_HOOK_NAMES,
    H3_TENSOR_PARALLEL_HOOK,
    H3_V100_MODE_HOOK,
    get_h3_hook,
    h3_record,
)
from .hooks.cache import describe_cache
from .hooks.fast_vae_decode import describe_vae_decode
from .loaders.single_file import describe_transformer_file
from .quantizers import describe_layer


def _path_of(obj: Any) -> str:
    describe_path = getattr(obj, "describe_path", None)
    if callable(describe_path):
        return describe_path()
    name = f"{type(obj).__module__}.{type(obj).__qualname__}"
    if hasattr(obj, "_attention_backend"):
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry

        backend = obj._attention_backend or _AttentionBackendRegistry.get_active_backend()[0]
        backend = getattr(backend, "value", backend)
        return f"{name} (dense, diffusers dispatch_attention_fn backend={backend})"
    return name


def _summarize_model(model: torch.nn.Module) -> Dict[str, Any]:
    attention = collections.Counter()
    linears = collections.Counter()
    for name, module in model.named_modules():
        if ".base_layer" in name:
            continue  # a LoRA-wrapped layer is reported once, by its wrapper
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(module, "set_processor"):
            attention[_path_of(processor)] += 1
        elif describe_layer(module) is not None:  # an nn.Linear (or a PEFT layer over one) with a quantized weight
            linears[describe_layer(module)] += 1
    info: Dict[str, Any] = {"class": type(model).__name__}
    try:
        param = next(model.parameters())
        info["device"], info["dtype"] = str(param.device), str(param.dtype).replace("torch.", "")
    except StopIteration:
        pass
    quant = getattr(model, "hf_quantizer", None)
    if quant is not None:
        info["quantization"] = type(quant.quantization_config).__name__
    for label, name in (("tensor parallel", H3_TENSOR_PARALLEL_HOOK), ("context parallel", H3_CONTEXT_PARALLEL_HOOK)):
        record = h3_record(model, name)
        if record is not None:
            info[label] = record.as_dict()
    v100 = h3_record(model, H3_V100_MODE_HOOK)
    if v100 is not None:
        info["v100 mode"] = v100.describe_path()
    if attention:
        info["attention"] = dict(attention)
    forwards = h3_record(model, H3_CALL_PLAN_HOOK)
    if forwards is not None and forwards.last is not None:  # the plan of the last call: layout, routes, kernels
        info["last_forward"] = forwards.last.describe()
    if linears:
        info["quantized_layers"] = dict(linears)
    cache = describe_cache(model)
    if cache is not None:
        info["cache"] = cache
    checkpoint_file = describe_transformer_file(model)
    if checkpoint_file is not None:
        info["checkpoint_file"] = checkpoint_file
    if hasattr(model, "tokens_chunk_size") and hasattr(model, "_stitch_tiles"):  # the MiniMax-H3 video VAE
        info["decode"] = describe_vae_decode(model)
    hooks = registered_hooks(model)
    if hooks:
        info["hooks"] = hooks
    return info


def registered_hooks(model: torch.nn.Module) -> Dict[str, int]:
    """``{hook name: number of modules holding it}`` for diffusers_h3's hooks in ``model``'s registries."""
    counts: Dict[str, int] = {}
    for module in model.modules():
        for name in H3_HOOK_NAMES:
            if get_h3_hook(module, name) is not None:
                counts[name] = counts.get(name, 0) + 1
    return counts


# Optional packages that change which paths can run: FlashInfer (the exact preset's FA3 attention on Hopper, NVFP4 W4A4
# on Blackwell), PEFT (LoRA), PyAV (MP4 export).
OPTIONAL_PACKAGES = ("flashinfer-python", "peft", "accelerate", "av")


def _installed_version(distribution: str):
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> Dict[str, Any]:
    import diffusers
    import transformers

    from ._version import __version__

    env = {
        "diffusers_h3": __version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "optional_packages": {name: _installed_version(name) for name in OPTIONAL_PACKAGES},  # None: not installed
        "cuda_devices": [],
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cap = torch.cuda.get_device_capability(i)
            env["cuda_devices"].append(f"cuda:{i} {torch.cuda.get_device_name(i)} (sm_{cap[0]}{cap[1]})")
    return env


def describe(pipe_or_model: Any = None) -> Dict[str, Any]:
    """Versions, devices and, for a pipeline or model, the attention/quantization path each part runs."""
    report: Dict[str, Any] = {"environment": environment()}
    if pipe_or_model is None:
        return report
    if isinstance(pipe_or_model, torch.nn.Module):
        report["model"] = _summarize_model(pipe_or_model)
        return report
    components: Dict[str, Any] = {}
    for name, component in getattr(pipe_or_model, "components", {}).items():
        if isinstance(component, torch.nn.Module):
            components[name] = _summarize_model(component)
        elif component is not None:
            components[name] = {"class": type(component).__name__}
    report["components"] = components
    # Pipeline-wide records (a pipeline is no module and has no hook registry): kept on the pipeline object.
    from .parallel.placement import placement_of
    from .pipelines.fasth3 import fasth3_report
    from .pipelines.speed_presets import speed_preset_report

    speed_preset = speed_preset_report(pipe_or_model)  # recorded by enable_speed_preset
    if speed_preset is not None:
        report["speed_preset"] = speed_preset
    fasth3 = fasth3_report(pipe_or_model)  # a FastH3 stack's preset, gates, payload, light VAE
    if fasth3 is not None:
        report["fasth3"] = fasth3
    placement = placement_of(pipe_or_model)  # recorded by the placement recipes
    if placement:
        report["placement"] = placement
    extra = getattr(pipe_or_model, "describe_paths", None)
    if callable(extra):
        report["pipeline"] = extra()
    return report


def format_report(report: Dict[str, Any], indent: int = 0) -> str:
    lines: List[str] = []
    pad = "  " * indent
    for key, value in report.items():
        if isinstance(value, dict):
            lines.append(f"{pad}{key}:")
            lines.append(format_report(value, indent + 1))
        elif isinstance(value, list):
            lines.append(f"{pad}{key}:" + ("" if value else " none"))
            lines.extend(f"{pad}  - {v}" for v in value)
        else:
            lines.append(f"{pad}{key}: {value}")
    return "\n".join(line for line in lines if line)
