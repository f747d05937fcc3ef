"""Stream a model's weights from its own safetensors checkpoint, leaf by leaf, instead of holding them in memory.

diffusers' group offload with ``offload_to_disk_path`` first writes every group to new files, so a checkpoint that
already sits on local disk in its final format (a pre-quantized text encoder) would be stored twice. When the model's
state-dict keys, shapes and dtypes are exactly those of its checkpoint files, :func:`stream_from_checkpoint` reads
each module's tensors straight from those files to the execution device when the module runs, and drops them when
it returns: host memory keeps only the small always-resident tensors and the mapping of the tensor in flight, the
disk keeps one copy. Anything that does not match raises before any weight is released (nothing falls back).

Hooks go through diffusers' :class:`~diffusers.hooks.HookRegistry`, like its group offload.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import torch
from diffusers.hooks import HookRegistry, ModelHook

from .._hooks import H3_CHECKPOINT_STREAM_HOOK, get_h3_hook, register_h3_hook
from .._utils import SAFETENSORS_DTYPES


STREAM_HOOK_NAME = H3_CHECKPOINT_STREAM_HOOK
# Modules whose streamed tensors are smaller than this stay on the execution device: norms and biases would cost a
# file open each per forward for a few KiB.
RESIDENT_BELOW_BYTES = 1 << 20
_CASTABLE = (torch.bfloat16, torch.float16, torch.float32)


class CheckpointMismatchError(ValueError):
    """The model's tensors are not the ones stored in the checkpoint files (names, shapes or dtypes differ)."""


def _stored_tensors(folder: Path) -> Dict[str, Tuple[str, str, Tuple[int, ...]]]:
    """Each tensor of a safetensors checkpoint folder (the shards its index names, else every file): its file, dtype
    name and shape, read from the headers."""
    from safetensors import safe_open

    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        shards = sorted(set(json.loads(indexes[0].read_text())["weight_map"].values()))
        files = [folder / shard for shard in shards]
    else:
        files = sorted(folder.glob("*.safetensors"))
    stored: Dict[str, Tuple[str, str, Tuple[int, ...]]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                piece = handle.get_slice(key)
                stored[key] = (str(file), piece.get_dtype(), tuple(piece.get_shape()))
    return stored


class _StreamFromCheckpointHook(ModelHook):
    """Loads a module's own tensors from the checkpoint before its forward and releases them after it."""

    def __init__(self, tensors: List[Tuple[str, str, str, bool, torch.dtype]], device: torch.device, nbytes: int):
        super().__init__()
        self.tensors = tensors  # (attribute name, checkpoint key, file, is a parameter, dtype in the model)
        self.device = device
        self.nbytes = nbytes  # read from disk each time the module runs
        self.by_file: Dict[str, List[Tuple[str, str, bool, torch.dtype]]] = defaultdict(list)
        for name, key, file, is_param, dtype in tensors:
            self.by_file[file].append((name, key, is_param, dtype))

    def pre_forward(self, module, *args, **kwargs):
        from safetensors import safe_open

        for file, entries in self.by_file.items():
            # one open per file and call: the mapping (and its pages in this process's RSS) ends with the block
            with safe_open(file, framework="pt", device=str(self.device)) as handle:
                for name, key, is_param, dtype in entries:
                    _set_tensor(module, name, handle.get_tensor(key).to(dtype), is_param)
        return args, kwargs

    def post_forward(self, module, output):
        for name, _, _, is_param, dtype in self.tensors:
            _set_tensor(module, name, torch.empty(0, dtype=dtype), is_param)
        return output


def _set_tensor(module: torch.nn.Module, name: str, value: torch.Tensor, is_param: bool) -> None:
    if is_param:
        module._parameters[name].data = value  # keep the Parameter object: optimizers, PEFT and ties hold it
    else:
        module._buffers[name] = value


def _release_host_memory() -> None:
    gc.collect()
    try:  # glibc keeps freed small blocks in its arenas; hand them back so RSS shows the release
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def stream_from_checkpoint(
    model: torch.nn.Module,
    folder: Union[str, os.PathLike],
    device: Union[str, torch.device],
    resident_below_bytes: Optional[int] = None,
) -> Dict[str, int]:
    """Make ``model`` read its weights from the safetensors files in ``folder`` (the checkpoint it was loaded from,
    in the format it runs in) module by module on ``device``, releasing its in-memory copies.

    Raises :class:`CheckpointMismatchError` before changing anything when a tensor of the model is stored under
    another name or shape, or in another dtype that is not a floating-point cast of the model's (e.g. a checkpoint
    quantized while loading, whose files hold other tensors). Floating-point tensors stored in another precision are
    cast as they arrive, as ``from_pretrained(dtype=...)`` cast them. Modules holding fewer than
    ``resident_below_bytes`` (default :data:`RESIDENT_BELOW_BYTES`) stay on ``device``. Returns the bytes streamed
    per full forward and the bytes kept on ``device``.
    """
    device = torch.device(device)
    if resident_below_bytes is None:
        resident_below_bytes = RESIDENT_BELOW_BYTES
    stored = _stored_tensors(Path(folder))
    if not stored:
        raise CheckpointMismatchError(f"{folder} holds no safetensors files to stream the weights from")

    plan: List[Tuple[torch.nn.Module, List[Tuple[str, str, str, bool, torch.dtype]], int]] = []
    resident: List[torch.nn.Module] = []
    for module_name, module in model.named_modules():
        own = [(n, t, True) for n, t in module._parameters.items() if t is not None]
        persistent = [(n, t, False) for n, t in module._buffers.items()
                      if t is not None and n not in module._non_persistent_buffers_set]  # fmt: skip
        entries, nbytes = [], 0
        for name, tensor, is_param in own + persistent:
            key = f"{module_name}.{name}" if module_name else name
            if key not in stored:
                raise CheckpointMismatchError(f"{key} is not in the checkpoint files of {folder}: stream only a model "
                                              "loaded from these files in the format they store")  # fmt: skip
            file, stored_dtype, stored_shape = stored[key]
            stored_as = SAFETENSORS_DTYPES.get(stored_dtype)
            # floating-point tensors stored in another precision are cast as they arrive, as from_pretrained casts
            castable = stored_as in _CASTABLE and tensor.dtype in _CASTABLE
            if stored_shape != tuple(tensor.shape) or not (stored_as == tensor.dtype or castable):
                raise CheckpointMismatchError(
                    f"{key} is {tensor.dtype} {tuple(tensor.shape)} in the model but {stored_dtype} {stored_shape} "
                    f"in {file}: stream only a model loaded from these files in the format they store"
                )
            entries.append((name, key, file, is_param, tensor.dtype))
            nbytes += tensor.numel() * tensor.element_size()
        if entries and nbytes >= resident_below_bytes:
            plan.append((module, entries, nbytes))
        elif entries:
            resident.append(module)

    streamed = kept = 0
    for module in resident:
        for name, tensor in list(module._parameters.items()) + list(module._buffers.items()):
            if tensor is not None:
                _set_tensor(module, name, tensor.to(device), name in module._parameters)
                kept += tensor.numel() * tensor.element_size()
    for module, entries, nbytes in plan:
        register_h3_hook(module, _StreamFromCheckpointHook(entries, device, nbytes), STREAM_HOOK_NAME, root=model)
        for name, _, _, is_param, _ in entries:
            _set_tensor(module, name, torch.empty(0, dtype=getattr(module, name).dtype), is_param)
        streamed += nbytes
    # Non-persistent buffers (rotary tables) are not stored: they move to the device once.
    for module in model.modules():
        for name in module._non_persistent_buffers_set:
            buffer = module._buffers.get(name)
            if buffer is not None:
                module._buffers[name] = buffer.to(device)
    # The pipeline sends the encoder's inputs to the execution device when a hook sits on the top module.
    HookRegistry.check_if_exists_or_initialize(model)
    _release_host_memory()
    return {"streamed_bytes_per_forward": streamed, "resident_bytes": kept}


def streamed_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s weights read from its checkpoint files per full forward (0 when nothing streams)."""
    total = 0
    for module in model.modules():
        hook = get_h3_hook(module, STREAM_HOOK_NAME)
        total += hook.nbytes if hook is not None else 0
    return total
