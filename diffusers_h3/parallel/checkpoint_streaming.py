"""Stream a model's weights from its own safetensors checkpoint, group by group, reading ahead while it computes.

diffusers' group offload keeps every weight in host memory (or, with ``offload_to_disk_path``, first writes each group
to new files), so a 17 GiB NVFP4 DiT needs 17 GiB of RAM or a second copy on disk. When the model's state-dict keys,
shapes and dtypes are exactly those of the checkpoint files it was loaded from (a pre-quantized checkpoint in the
format it runs in), :func:`stream_from_checkpoint` reads each group's bytes straight from those files onto the
execution device when the group runs and drops them when it returns. Host memory keeps only the small resident
tensors and a ring of pinned staging buffers; the disk keeps one copy.

How a read works: a reader thread ``pread``\\s each group's byte ranges into a small ring of pinned host buffers and
copies each piece to the device on its own CUDA stream (on the CPU it reads straight into the destination), while the
compute stream runs the previous groups. File pages are dropped from the page cache after each read
(``posix_fadvise(DONTNEED)``, optional): they never enter the process's RSS (``pread`` copies into our buffers, no
mapping) and, on a PC whose RAM cannot hold the model, they would only evict other pages. Which group runs next is
learned from the previous calls (the successor of each group the last time it ran; definition order before any
call), so early exits, once-per-request modules and the loop over sampling steps are all predicted after one pass; a
group that was not predicted is read when it is asked for (counted as a miss in the record).

Groups: each submodule whose class is in the model's ``_no_split_modules`` (a DiT block, a decoder layer) is one
group; every other module holding tensors is a group of its own tensors. Groups smaller than
``resident_below_bytes`` stay on the device. With ``hold=True`` (a VAE, whose decoder runs once per tile) each child
of the model (its encoder, its decoder) is one group, which stays on the device after it runs until
:func:`release_streamed_weights`; a group is loaded before any hook of its modules runs (weight norm's included).

Anything that does not match raises before any weight is released (nothing falls back). Hooks go through diffusers'
:class:`~diffusers.hooks.HookRegistry`, like its group offload.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import torch

from .._checkpoint_files import read_safetensors_header
from .._hooks import (
    H3_CHECKPOINT_STREAM_HOOK,
    H3_CHECKPOINT_STREAM_MODEL_HOOK,
    H3Hook,
    get_h3_hook,
    h3_record,
    register_h3_hook,
)
from .._utils import SAFETENSORS_DTYPES, move_non_persistent_buffers, with_device_index
from ..quantizers import QuantizedTensor
from ..quantizers.tensors import STORAGE_ATTRS


STREAM_HOOK_NAME = H3_CHECKPOINT_STREAM_HOOK
# Groups whose streamed tensors are smaller than this stay on the execution device: norms and biases would cost a
# read each per forward for a few KiB.
RESIDENT_BELOW_BYTES = 1 << 20
_CASTABLE = (torch.bfloat16, torch.float16, torch.float32)
_ALIGN = 256  # byte alignment of each range in a group's device buffer
_MAX_READ = 1 << 30  # bytes per pread call (Linux returns at most ~2 GiB per call)
# PEFT adapters added to a streamed model are not in its checkpoint: they stay on the device.
_ADAPTER_MARKERS = ("lora_", "dora_", "lokr_", "loha_")


class CheckpointMismatchError(ValueError):
    """The model's tensors are not the ones stored in the checkpoint files (names, shapes or dtypes differ)."""


@dataclass(frozen=True)
class StreamingConfig:
    """How :func:`stream_from_checkpoint` reads a model's weights.

    Args:
        read_ahead: groups read (and copied to the device) ahead of the one running; each holds its weights on the
            device until it has run, so the device holds up to ``read_ahead + 1`` groups.
        pinned_slots / slot_mib: the ring of pinned host buffers each read passes through on its way to a CUDA device
            (host memory: ``pinned_slots * slot_mib`` MiB).
        drop_page_cache: drop the file pages after each read (``posix_fadvise(DONTNEED)``), so that streaming a model
            larger than the RAM does not evict the rest of the system's cache; off to let a machine with RAM to spare
            serve repeated reads from its page cache.
        resident_below_bytes: groups smaller than this stay on the device (default :data:`RESIDENT_BELOW_BYTES`).
        hold: keep each group on the device after it runs, until :func:`release_streamed_weights` (a VAE, whose
            modules run once per tile).
    """

    read_ahead: int = 2
    pinned_slots: int = 2
    slot_mib: int = 64
    drop_page_cache: bool = True
    resident_below_bytes: Optional[int] = None
    hold: bool = False

    def __post_init__(self):
        for name in ("read_ahead", "pinned_slots", "slot_mib", "resident_below_bytes"):
            value = getattr(self, name)
            if name == "resident_below_bytes" and value is None:
                continue
            minimum = 0 if name in ("read_ahead", "resident_below_bytes") else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"StreamingConfig.{name}={value!r}: give an integer >= {minimum}")


@dataclass
class StreamStats:
    """What streaming did since it was enabled (``describe(pipe)`` and the benchmarks read it)."""

    group_loads: int = 0  # groups placed on the device for a forward
    bytes_read: int = 0  # bytes read from the checkpoint files
    prefetch_hits: int = 0  # loads whose read had been started ahead of time
    misses: int = 0  # loads read only when asked for (not predicted)
    dropped_prefetches: int = 0  # reads started ahead for a group that did not run next
    wait_s: float = 0.0  # time the forward waited for reads

    def as_dict(self) -> Dict[str, float]:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in self.__dict__.items()}


@dataclass
class StreamRecord:
    """A streamed model: where its weights come from and how they are read (the top module's hook holds it)."""

    folder: str
    device: str
    config: StreamingConfig
    groups: int
    streamed_bytes_per_forward: int
    resident_bytes: int
    largest_group_bytes: int
    stats: StreamStats = field(default_factory=StreamStats)

    def describe(self) -> str:
        return (f"streamed from its checkpoint files ({self.folder}; {self.groups} groups, "
                f"{self.streamed_bytes_per_forward / 2**30:.2f} GiB per forward, read ahead "
                f"{self.config.read_ahead}{', held until released' if self.config.hold else ''})")  # fmt: skip


@dataclass(frozen=True)
class _Stored:
    file: str
    dtype: str
    shape: Tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def _checkpoint_files(folder: Path) -> List[Path]:
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        shards = sorted(set(json.loads(indexes[0].read_text())["weight_map"].values()))
        return [folder / shard for shard in shards]
    return sorted(folder.glob("*.safetensors"))


def _stored_tensors(folder: Path) -> Dict[str, _Stored]:
    """Each tensor of a safetensors checkpoint folder (the shards its index names, else every file): its file,
    dtype name, shape and byte range, read from the headers."""
    stored: Dict[str, _Stored] = {}
    for file in _checkpoint_files(folder):
        data_start, header = read_safetensors_header(file)
        for key, entry in header.items():
            begin, end = entry["data_offsets"]
            stored[key] = _Stored(str(file), entry["dtype"], tuple(entry["shape"]), data_start + begin, end - begin)
    return stored


@dataclass
class _Entry:
    module: torch.nn.Module
    name: str
    is_param: bool
    dtype: torch.dtype  # in the model
    stored: _Stored
    offset: int = 0  # in the group's device buffer


@dataclass
class _Group:
    index: int
    name: str
    module: torch.nn.Module
    entries: List[_Entry]
    ranges: List[Tuple[str, int, int, List[_Entry]]] = field(default_factory=list)  # contiguous file ranges
    nbytes: int = 0  # size of the group's device buffer


def _layout(group: _Group) -> None:
    """Give each tensor an aligned place in the group's buffer (kernels may take another path, with other rounding,
    for a misaligned pointer) and merge the tensors that lie back to back in a file into one read."""
    entries = sorted(group.entries, key=lambda e: (e.stored.file, e.stored.start))
    offset = 0
    ranges: List[List] = []
    for entry in entries:
        entry.offset = offset
        offset = -(-(offset + entry.stored.nbytes) // _ALIGN) * _ALIGN
        s = entry.stored
        last = ranges[-1] if ranges else None
        if last is not None and last[0] == s.file and last[1] + last[2] == s.start:
            last[2] += s.nbytes
            last[3].append(entry)
        else:
            ranges.append([s.file, s.start, s.nbytes, [entry]])
    group.ranges = [tuple(r) for r in ranges]
    group.nbytes = offset


def _aligned_host_buffer(nbytes: int) -> torch.Tensor:
    """A host buffer whose start is aligned like a device allocation (the CPU allocator aligns to 64 bytes only)."""
    storage = torch.empty(nbytes + _ALIGN, dtype=torch.uint8)
    shift = -storage.data_ptr() % _ALIGN
    return storage[shift : shift + nbytes]


def _pread_into(fd: int, target: memoryview, offset: int) -> None:
    done = 0
    while done < len(target):
        count = os.preadv(fd, [target[done : done + _MAX_READ]], offset + done)
        if count <= 0:
            raise OSError(f"unexpected end of a checkpoint file at byte {offset + done}")
        done += count


class _Loaded:
    """A group's bytes on the device: one buffer, and the event its copies end with (CUDA)."""

    def __init__(self, buffer: torch.Tensor, event=None):
        self.buffer = buffer
        self.event = event


class _Streamer:
    """Reads one model's groups (a single reader thread, so reads stay sequential on the disk)."""

    def __init__(self, groups: List[_Group], device: torch.device, config: StreamingConfig, record: StreamRecord):
        self.groups = groups
        self.device = with_device_index(device)  # compared with tensors' devices, which carry the index
        self.config = config
        self.record = record
        self.successor = {g.index: groups[(i + 1) % len(groups)].index for i, g in enumerate(groups)}
        self.pending: Dict[int, Future] = {}
        self.held: Dict[int, _Loaded] = {}
        self.running: Dict[int, _Loaded] = {}
        # tensors that are not in the checkpoint (PEFT adapters added after streaming began), on the device while
        # their group is placed: group index -> [(module, name, is_param, the tensor to restore on release)]
        self.followers: Dict[int, List[Tuple[torch.nn.Module, str, bool, torch.Tensor]]] = {}
        self.last: Optional[int] = None
        self.previous: Optional[int] = None  # the group that ran before `last`
        self.successor_after: Dict[Tuple[Optional[int], int], int] = {}  # (previous, last) -> the group that followed
        self.files: Dict[str, int] = {}
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffusers_h3_stream")
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device)
            slot_bytes = config.slot_mib << 20
            self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=True)
                          for _ in range(config.pinned_slots)]  # fmt: skip
            self.slot_events: List[Optional[torch.cuda.Event]] = [None] * config.pinned_slots
            self.next_slot = 0
        weakref.finalize(self, _close_all, self.files, self.executor)

    # -- reading (reader thread) -----------------------------------------------------------------------------------

    def _fd(self, file: str) -> int:
        if file not in self.files:
            self.files[file] = os.open(file, os.O_RDONLY)
        return self.files[file]

    def _read(self, group: _Group) -> _Loaded:
        if self.cuda:
            with torch.cuda.device(self.device), torch.cuda.stream(self.copy_stream):
                return self._read_cuda(group)
        buffer = _aligned_host_buffer(group.nbytes)
        view = memoryview(buffer.numpy())
        for file, start, nbytes, entries in group.ranges:
            fd = self._fd(file)
            for entry in entries:  # straight into each tensor's place
                _pread_into(fd, view[entry.offset : entry.offset + entry.stored.nbytes], entry.stored.start)
            self._drop_cache(fd, start, nbytes)
        self.record.stats.bytes_read += sum(r[2] for r in group.ranges)
        return _Loaded(buffer)

    def _read_cuda(self, group: _Group) -> _Loaded:
        buffer = torch.empty(group.nbytes, dtype=torch.uint8, device=self.device)
        slot_bytes = self.slots[0].numel()
        for file, start, nbytes, entries in group.ranges:
            fd = self._fd(file)
            done = 0
            while done < nbytes:  # the range in slot-sized pieces, each copied to the parts of the tensors it holds
                count = min(slot_bytes, nbytes - done)
                index = self.next_slot
                self.next_slot = (index + 1) % len(self.slots)
                if self.slot_events[index] is not None:
                    self.slot_events[index].synchronize()  # its previous piece has reached the device
                slot = self.slots[index]
                _pread_into(fd, memoryview(slot.numpy())[:count], start + done)
                piece_start, piece_end = start + done, start + done + count
                for entry in entries:
                    lo = max(piece_start, entry.stored.start)
                    hi = min(piece_end, entry.stored.start + entry.stored.nbytes)
                    if lo < hi:
                        target = entry.offset + (lo - entry.stored.start)
                        buffer[target : target + hi - lo].copy_(slot[lo - piece_start : hi - piece_start],
                                                                non_blocking=True)  # fmt: skip
                event = torch.cuda.Event()
                event.record(self.copy_stream)
                self.slot_events[index] = event
                done += count
            self._drop_cache(fd, start, nbytes)
        done_event = torch.cuda.Event()
        done_event.record(self.copy_stream)
        self.record.stats.bytes_read += sum(r[2] for r in group.ranges)
        return _Loaded(buffer, done_event)

    def _drop_cache(self, fd: int, start: int, nbytes: int) -> None:
        if self.config.drop_page_cache and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, start, nbytes, os.POSIX_FADV_DONTNEED)

    # -- placing (compute thread) ----------------------------------------------------------------------------------

    def _window(self, index: int) -> List[int]:
        window, previous, current = [], self.previous, index
        for _ in range(self.config.read_ahead):
            # The group that followed this pair last time (a training step runs the blocks forward, then backward
            # in reverse for the recomputed forward: the pair tells the two directions apart), else the one that
            # followed this group.
            previous, current = current, self.successor_after.get((previous, current), self.successor[current])
            if current == index or current in window:
                break
            window.append(current)
        return window

    def load(self, group: _Group) -> None:
        stats = self.record.stats
        if group.index in self.held:
            loaded = None
        else:
            future = self.pending.pop(group.index, None)
            if future is None:
                stats.misses += 1
                self._drop_stale(keep=())
                future = self.executor.submit(self._read, group)
            else:
                stats.prefetch_hits += 1
            started = time.perf_counter()
            loaded = future.result()
            stats.wait_s += time.perf_counter() - started
        if self.last is not None and self.last != group.index:
            self.successor[self.last] = group.index
            self.successor_after[(self.previous, self.last)] = group.index
            self.previous = self.last
        self.last = group.index
        window = self._window(group.index)
        self._drop_stale(keep=window)
        for index in window:
            if index not in self.pending and index not in self.held and index not in self.running:
                self.pending[index] = self.executor.submit(self._read, self.groups[index])
        if loaded is not None:
            self._place(group, loaded)
            stats.group_loads += 1
            if self.config.hold:
                self.held[group.index] = loaded
            else:
                self.running[group.index] = loaded

    def _drop_stale(self, keep) -> None:
        for index in [i for i in self.pending if i not in keep]:
            future = self.pending.pop(index)
            if not future.cancel():
                self.record.stats.dropped_prefetches += 1  # its buffer is freed once the read finishes

    def _place(self, group: _Group, loaded: _Loaded) -> None:
        buffer = loaded.buffer
        if self.cuda:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(loaded.event)
            buffer.record_stream(stream)  # the allocator reuses it only after the compute stream is done with it
        for entry in group.entries:
            raw = buffer[entry.offset : entry.offset + entry.stored.nbytes]
            value = raw.view(SAFETENSORS_DTYPES[entry.stored.dtype]).view(entry.stored.shape)
            if value.dtype != entry.dtype:
                value = value.to(entry.dtype)
            _set_tensor(entry.module, entry.name, value, entry.is_param)
        # Tensors added after streaming began (PEFT adapters) are not in the checkpoint: they follow to the device.
        # Without autograd (inference) they come back to where they were when the group is released, so a LoRA
        # costs the device one block's factors at a time, not the whole adapter; a training step keeps them there
        # (autograd holds the device tensors until the backward pass).
        follow = not torch.is_grad_enabled()
        followers = self.followers.setdefault(group.index, [])
        for tensor_owner in group.module.modules():
            for table in (tensor_owner._parameters, tensor_owner._buffers):
                for name, tensor in table.items():
                    if tensor is None or not tensor.numel() or isinstance(tensor, QuantizedTensor):
                        continue  # a quantized weight's packed tensors are entries of its group, placed above
                    if tensor.device != self.device:
                        is_param = table is tensor_owner._parameters
                        # a Parameter keeps its object and gets the device data: remember the host data, not the
                        # object (which would hold the device data by the time it is restored)
                        host = tensor.data if is_param else tensor
                        _set_tensor(tensor_owner, name, tensor.to(self.device), is_param)
                        if follow:
                            followers.append((tensor_owner, name, is_param, host))

    def release(self, group: _Group, force: bool = False) -> None:
        if self.config.hold and not force:
            return
        self.running.pop(group.index, None)
        self.held.pop(group.index, None)
        # Under autograd (training) a forward outside gradient checkpointing saved these very tensors for its
        # backward: the parameters get new (empty) objects instead of having their data swapped out, so the saved
        # ones keep their values until the backward has run.
        keep_saved = torch.is_grad_enabled()
        for entry in group.entries:
            _set_tensor(entry.module, entry.name, torch.empty(0, dtype=entry.dtype), entry.is_param, new_param=keep_saved)
        for owner, name, is_param, tensor in self.followers.pop(group.index, ()):
            _set_tensor(owner, name, tensor, is_param)

    def wait_for_reads(self) -> None:
        """Return once every read submitted so far has ended, those dropped while running included (the single
        reader runs them in order, so a no-op submitted now ends after all of them)."""
        self.executor.submit(int).result()

    def release_all(self) -> None:
        self._drop_stale(keep=())
        self.wait_for_reads()  # nothing reads the files or fills a buffer after this returns
        for index in list(self.held) + list(self.running):
            self.release(self.groups[index], force=True)


def _close_all(files: Dict[str, int], executor: ThreadPoolExecutor) -> None:
    executor.shutdown(wait=True, cancel_futures=True)
    for fd in files.values():
        try:
            os.close(fd)
        except OSError:
            pass


class _StreamGroupHook(H3Hook):
    """Places a group's tensors on the device before its forward and releases them after it."""

    def __init__(self, streamer: _Streamer, group: _Group):
        super().__init__()
        self.streamer = streamer
        self.group = group

    def pre_forward(self, module, *args, **kwargs):
        self.streamer.load(self.group)
        return args, kwargs

    def post_forward(self, module, output):
        self.streamer.release(self.group)
        return output


class _StreamModelHook(H3Hook):
    """Holds a streamed model's :class:`StreamRecord` and its reader on the model's top module."""

    def __init__(self, record: StreamRecord, streamer: _Streamer):
        super().__init__(record)
        self.streamer = streamer


def _packed_weight(module: torch.nn.Module, name: str) -> Optional[QuantizedTensor]:
    """The quantized weight whose packed tensor ``name`` (``weight``, ``weight_scale``...) is, or ``None``."""
    weight = module._parameters.get("weight") if name in STORAGE_ATTRS else None
    return weight if isinstance(weight, QuantizedTensor) else None


def _get_tensor(module: torch.nn.Module, name: str) -> torch.Tensor:
    packed = _packed_weight(module, name)
    return packed.storage()[name] if packed is not None else getattr(module, name)


def _set_tensor(module: torch.nn.Module, name: str, value: torch.Tensor, is_param: bool, new_param: bool = False) -> None:
    packed = _packed_weight(module, name)
    if packed is not None:  # one packed tensor of a quantized weight (the checkpoint stores them one by one)
        packed.data = packed._with({STORAGE_ATTRS[name]: value})
    elif is_param and new_param:
        old = module._parameters[name]
        module._parameters[name] = torch.nn.Parameter(value, requires_grad=old.requires_grad)
    elif is_param:
        module._parameters[name].data = value  # keep the Parameter object: optimizers, PEFT and ties hold it
    else:
        module._buffers[name] = value


def _release_host_memory() -> None:
    gc.collect()
    try:  # glibc keeps freed small blocks in its arenas; hand them back so RSS shows the release
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _checkpoint_key(key: str, stored: Dict[str, _Stored]) -> Optional[str]:
    if key in stored:
        return key
    unwrapped = key.replace(".base_layer.", ".")  # a PEFT-wrapped layer stores its base weights under the plain name
    return unwrapped if unwrapped in stored else None


def _called_children(module: torch.nn.Module, prefix: str = "") -> List[str]:
    """Paths of ``module``'s children that are called, looking through containers that never are (a ModuleList of
    blocks, whose owner iterates it)."""
    paths = []
    for name, child in module.named_children():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            paths += _called_children(child, f"{prefix}{name}.")
        else:
            paths.append(f"{prefix}{name}")
    return paths


def _plan(model: torch.nn.Module, stored: Dict[str, _Stored], folder, hold: bool) -> Tuple[List[_Group], List[_Entry]]:
    """The groups to stream and the entries kept on the device; raises before anything changes on a mismatch."""
    split_classes = set(getattr(model, "_no_split_modules", None) or ())
    owners: Dict[str, str] = {}  # module path -> the group it belongs to
    if hold:  # held groups load once per stage: one per child (an encoder, a decoder), whatever calls inside it
        for path in _called_children(model):
            owners[path] = path
    for path, module in model.named_modules():
        if not hold and path and type(module).__name__ in split_classes and not any(
            path.startswith(o + ".") for o in owners
        ):
            owners[path] = path
    groups: Dict[str, _Group] = {}
    adapters: List[_Entry] = []
    for path, module in model.named_modules():
        owner = next((o for o in owners if path == o or path.startswith(o + ".")), path)
        own = [(n, t, True) for n, t in module._parameters.items() if t is not None and not isinstance(t, QuantizedTensor)]
        own += [(n, t, True) for q in module._parameters.values() if isinstance(q, QuantizedTensor)
                for n, t in q.storage().items()]  # fmt: skip
        persistent = [(n, t, False) for n, t in module._buffers.items()
                      if t is not None and n not in module._non_persistent_buffers_set]  # fmt: skip
        for name, tensor, is_param in own + persistent:
            key = f"{path}.{name}" if path else name
            checkpoint_key = _checkpoint_key(key, stored)
            if checkpoint_key is None and any(marker in key for marker in _ADAPTER_MARKERS):
                adapters.append(_Entry(module, name, is_param, tensor.dtype, _Stored("", "", (), 0, 0)))
                continue
            if checkpoint_key is None:
                raise CheckpointMismatchError(f"{key} is not in the checkpoint files of {folder}: stream only a model "
                                              "loaded from these files in the format they store")  # fmt: skip
            s = stored[checkpoint_key]
            stored_as = SAFETENSORS_DTYPES.get(s.dtype)
            # floating-point tensors stored in another precision are cast as they arrive, as from_pretrained casts
            castable = stored_as in _CASTABLE and tensor.dtype in _CASTABLE
            if s.shape != tuple(tensor.shape) or not (stored_as == tensor.dtype or castable):
                raise CheckpointMismatchError(
                    f"{key} is {tensor.dtype} {tuple(tensor.shape)} in the model but {s.dtype} {s.shape} "
                    f"in {s.file}: stream only a model loaded from these files in the format they store"
                )
            group = groups.setdefault(owner, _Group(len(groups), owner, model.get_submodule(owner), []))
            group.entries.append(_Entry(module, name, is_param, tensor.dtype, s))
    return list(groups.values()), adapters


def stream_from_checkpoint(
    model: torch.nn.Module,
    folder: Union[str, os.PathLike],
    device: Union[str, torch.device],
    config: Optional[StreamingConfig] = None,
    *,
    resident_below_bytes: Optional[int] = None,
) -> Dict[str, int]:
    """Make ``model`` read its weights from the safetensors files in ``folder`` (the checkpoint it was loaded from,
    in the format it runs in) group by group on ``device``, reading ahead while it computes, and release its
    in-memory copies.

    Raises :class:`CheckpointMismatchError` before changing anything when a tensor of the model is stored under
    another name or shape, or in another dtype that is not a floating-point cast of the model's (e.g. a checkpoint
    quantized while loading, whose files hold other tensors). Floating-point tensors stored in another precision are
    cast to the model's dtype as they arrive, as ``from_pretrained(dtype=...)`` cast them. PEFT adapters (not in the
    checkpoint) stay on the device. Returns the bytes streamed per full forward and the bytes kept on ``device``.
    """
    config = config or StreamingConfig()
    if resident_below_bytes is None:
        resident_below_bytes = config.resident_below_bytes
    if resident_below_bytes is None:
        resident_below_bytes = RESIDENT_BELOW_BYTES
    device = torch.device(device)
    if get_h3_hook(model, H3_CHECKPOINT_STREAM_MODEL_HOOK) is not None:
        raise ValueError("this model already streams from its checkpoint files")
    stored = _stored_tensors(Path(folder))
    if not stored:
        raise CheckpointMismatchError(f"{folder} holds no safetensors files to stream the weights from")
    planned, adapters = _plan(model, stored, folder, config.hold)

    streamed_groups, resident = [], []
    for group in planned:
        size = sum(e.stored.nbytes for e in group.entries)
        (streamed_groups if size >= resident_below_bytes else resident).append(group)
    for index, group in enumerate(streamed_groups):
        group.index = index
        _layout(group)
    kept = 0
    for entry in [e for g in resident for e in g.entries] + adapters:
        tensor = _get_tensor(entry.module, entry.name)
        # a copy even on the same device: a loaded tensor may be a view of the file's mapping, which must go
        _set_tensor(entry.module, entry.name, tensor.to(device, copy=True), entry.is_param)
        kept += tensor.numel() * tensor.element_size()
    streamed = sum(e.stored.nbytes for g in streamed_groups for e in g.entries)
    record = StreamRecord(os.fspath(folder), str(device), config, len(streamed_groups), streamed, kept,
                          max((g.nbytes for g in streamed_groups), default=0))  # fmt: skip
    if streamed_groups:
        streamer = _Streamer(streamed_groups, device, config, record)
        for group in streamed_groups:
            register_h3_hook(group.module, _StreamGroupHook(streamer, group), STREAM_HOOK_NAME, root=model)
            for entry in group.entries:
                _set_tensor(entry.module, entry.name, torch.empty(0, dtype=entry.dtype), entry.is_param)
    else:
        streamer = None
    move_non_persistent_buffers(model, device)  # not stored: they move to the device once
    # The record sits on the top module; the pipeline reads the execution device from it.
    register_h3_hook(model, _StreamModelHook(record, streamer), H3_CHECKPOINT_STREAM_MODEL_HOOK)
    _release_host_memory()
    return {"streamed_bytes_per_forward": streamed, "resident_bytes": kept}


def streaming_of(model: torch.nn.Module) -> Optional[StreamRecord]:
    """The :class:`StreamRecord` of a model streamed by :func:`stream_from_checkpoint`, else ``None``."""
    return h3_record(model, H3_CHECKPOINT_STREAM_MODEL_HOOK)


def release_streamed_weights(model: torch.nn.Module) -> None:
    """Release what a streamed ``model`` holds on its device (held groups, reads started ahead); no-op otherwise.

    Returns once no read of the model is in flight: reads started ahead are cancelled, or waited for if already
    running."""
    hook = get_h3_hook(model, H3_CHECKPOINT_STREAM_MODEL_HOOK)
    if hook is not None and hook.streamer is not None:
        hook.streamer.release_all()


def streamed_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s weights read from its checkpoint files per full forward (0 when nothing streams)."""
    record = streaming_of(model)
    return record.streamed_bytes_per_forward if record is not None else 0
