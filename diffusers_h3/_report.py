"""``diffusers_h3.describe(pipe)``: which path every attention processor and quantized layer runs.

Processors and quantized layers of this package implement ``describe_path() -> str`` (one line: kernel or fallback,
and why; "not run on hardware" where that applies). Anything else is reported by class name.
"""

from __future__ import annotations

import collections
import importlib.metadata
import platform
from typing import Any, Dict, List

import torch

from .hooks.cache import describe_cache
from .hooks.fast_vae_decode import describe_vae_decode


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
        elif hasattr(module, "describe_path"):
            linears[_path_of(module)] += 1
    info: Dict[str, Any] = {"class": type(model).__name__}
    try:
        param = next(model.parameters())
        info["device"], info["dtype"] = str(param.device), str(param.dtype).replace("torch.", "")
    except StopIteration:
        pass
    quant = getattr(model, "hf_quantizer", None)
    if quant is not None:
        info["quantization"] = type(quant.quantization_config).__name__
    from .parallel import context_parallel_state, tensor_parallel_state

    for label, state in (("tensor parallel", tensor_parallel_state), ("context parallel", context_parallel_state)):
        if state(model) is not None:
            info[label] = dict(state(model))
    if attention:
        info["attention"] = dict(attention)
    if linears:
        info["quantized_layers"] = dict(linears)
    cache = describe_cache(model)
    if cache is not None:
        info["cache"] = cache
    if hasattr(model, "tokens_chunk_size") and hasattr(model, "_stitch_tiles"):  # the MiniMax-H3 video VAE
        info["decode"] = describe_vae_decode(model)
    return info


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
    speed_preset = getattr(pipe_or_model, "_h3_speed_preset", None)  # recorded by enable_speed_preset
    if speed_preset is not None:
        report["speed_preset"] = speed_preset.describe()
    placement = getattr(pipe_or_model, "_diffusers_h3_placement", None)  # recorded by the placement recipes
    if placement:
        report["placement"] = dict(placement)
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
