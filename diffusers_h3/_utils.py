"""Small shared helpers: one-time warnings and hardware queries used by processors, quantizers and kernels."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging as std_logging
import re
import warnings
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from diffusers.utils import logging


logger = logging.get_logger(__name__)

# safetensors' names of the storage dtypes (a lazily read checkpoint tensor reports its dtype by name)
SAFETENSORS_DTYPES = {"I8": torch.int8, "U8": torch.uint8, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
                      "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32,
                      "I64": torch.int64, "BOOL": torch.bool}  # fmt: skip


def attach_to_diffusers_logging() -> None:
    """Hang the package logger under diffusers' library root logger.

    Our loggers (`diffusers.utils.logging.get_logger(__name__)`) are named `diffusers_h3.*`, outside the `diffusers`
    hierarchy; as children of its root they follow `diffusers.utils.logging.set_verbosity_*` and use its handler,
    as diffusers' own modules do, while `logging.getLogger("diffusers_h3")` still addresses them alone.
    """
    std_logging.getLogger(__name__.partition(".")[0]).parent = logging.get_logger()


def move_non_persistent_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Move ``model``'s non-persistent buffers (rotary tables: built at init, never stored in a checkpoint) to
    ``device``, for loaders that place the stored tensors themselves."""
    for module in model.modules():
        for name in module._non_persistent_buffers_set:
            buffer = module._buffers.get(name)
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)


def config_from_call(
    config_cls: type,
    config: Any,
    legacy: Dict[str, Any],
    *,
    call: str,
    legacy_positional: Sequence[str] = (),
    legacy_args: Sequence[Any] = (),
    config_name: Optional[str] = None,
) -> Any:
    """The config object an ``enable_*`` hook runs with: ``config`` (``config_cls()`` for ``None``).

    The hooks took loose arguments before they took one config object; for one release those still work: keyword
    arguments ``legacy`` (fields of ``config_cls``) and positional values (a value other than a config in the config's
    place, then ``legacy_args``; their fields are named by ``legacy_positional``, in order) replace fields of
    ``config``, with one ``FutureWarning`` that names the new call. diffusers' ``deprecate`` is not used: it checks
    the removal version against diffusers' own version, not this package's. ``config_name``: the config class the
    messages name (default: ``config_cls``'s name)."""
    name_of_config = config_name or config_cls.__name__
    options = dict(legacy)
    positional = list(legacy_args)
    if config is not None and not isinstance(config, config_cls):
        positional.insert(0, config)
        config = None
    if len(positional) > len(legacy_positional):
        raise TypeError(f"{call}() takes the target and one {name_of_config}, got {len(positional)} other "
                        f"positional argument(s): pass {call}(target, {name_of_config}(...))")  # fmt: skip
    for name, value in zip(legacy_positional, positional):
        if name in options:
            raise TypeError(f"{call}() got {name!r} twice (by position and by keyword)")
        options[name] = value
    if not options:
        return config if config is not None else config_cls()
    fields = {field.name for field in dataclasses.fields(config_cls)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise TypeError(f"{call}() got unexpected argument(s) {unknown}; {name_of_config} fields are "
                        f"{sorted(fields)}")  # fmt: skip
    arguments = ", ".join(f"{name}={value!r}" for name, value in options.items())
    warnings.warn(f"{call}() with {', '.join(options)} as separate arguments is deprecated and goes in the next "
                  f"release: call {call}(target, {name_of_config}({arguments}))", FutureWarning, stacklevel=3)
    return dataclasses.replace(config, **options) if config is not None else config_cls(**options)


_WARNED: set = set()


# Under torch.compile, code that calls these two is traced: they run once at trace time and their result is a
# constant of the graph (a device's capability does not change; a warning is a side effect with no result), so the
# processors' and quantized layers' per-device decisions do not break the graph.
@torch.compiler.assume_constant_result
def warn_once(key: str, message: str) -> None:
    """Warn once per process for ``key`` (fallbacks must be visible, but not on every layer and step)."""
    if key in _WARNED:
        return
    _WARNED.add(key)
    logger.warning(message)


@torch.compiler.assume_constant_result
def cuda_capability(device: Optional[torch.device] = None) -> Optional[Tuple[int, int]]:
    """Compute capability of a CUDA device, or ``None`` for CPU / no CUDA."""
    if device is not None and torch.device(device).type != "cuda":
        return None
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=None)
def with_device_index(device) -> torch.device:
    """``device`` with its index: ``"cuda"`` means the current CUDA device (tensors on it report ``cuda:N``)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def is_package_available(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def has_fp8_tensor_cores(device: Optional[torch.device] = None) -> bool:
    cap = cuda_capability(device)
    return cap is not None and cap >= (8, 9)


def has_fp4_tensor_cores(device: Optional[torch.device] = None) -> bool:
    """FP4 MMA exists only on SM100/103/110/120/121 (datacenter and consumer Blackwell)."""
    cap = cuda_capability(device)
    return cap is not None and cap[0] in (10, 11, 12)


def gpu_model_name(device_name: Optional[str]) -> Optional[str]:
    """The GPU model in a CUDA device name (``NVIDIA H100 80GB HBM3`` -> ``H100``, ``NVIDIA L40S`` -> ``L40S``); None
    when the name has none (``NVIDIA GeForce RTX 4090``)."""
    match = re.search(r"\b([A-Z]\d{2,4}[A-Z]?)\b", device_name or "")
    return match.group(1) if match else None
