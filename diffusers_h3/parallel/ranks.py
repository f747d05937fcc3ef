"""What a pipeline call does differently when its transformer runs under context parallelism.

Every rank runs the whole pipeline (as diffusers' context-parallel docs prescribe), but only the DiT forward is worth
sharing: the text encoder runs on rank 0 and its output is broadcast, every rank must start from the same noise
(checked), the video decode splits its tiles over the ranks, and only rank 0 writes files (the token refiner runs once
per request on every path: hooks/refine_once.py).
"""

import hashlib
from typing import Any, Callable, Optional, Tuple

import torch
import torch.distributed as dist

from .context_parallel import context_parallel_state


def context_parallel_group(transformer) -> Optional[Any]:
    """The process group `transformer`'s context parallelism spans, or `None` when it runs on one rank."""
    if context_parallel_state(transformer) is None or not dist.is_initialized():
        return None
    return transformer._parallel_config.context_parallel_config._flattened_mesh.get_group()


def is_main_rank() -> bool:
    """True on rank 0, and in a process without a process group (the one that writes files and prints)."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def check_same_generator(generator: Optional[torch.Generator], group) -> None:
    """Every rank must draw the same noise: same generator state on every rank, or one clear error on all of them."""
    if generator is None:
        digest = "none"
    else:
        digest = hashlib.sha256(generator.get_state().cpu().numpy().tobytes()).hexdigest()
    digests = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, digest, group=group)
    if "none" in digests:
        raise ValueError(
            "Context parallel generation needs `generator=torch.Generator().manual_seed(seed)` with the same seed on "
            "every rank (each rank draws the noise itself)."
        )
    if len(set(digests)) != 1:
        differing = [rank for rank, d in enumerate(digests) if d != digests[0]]
        raise ValueError(
            f"The generators differ across ranks (ranks {differing} differ from rank 0): seed them identically on "
            "every rank, e.g. torch.Generator().manual_seed(0)."
        )


def _broadcast_tensor(tensor: Optional[torch.Tensor], group, device: torch.device) -> torch.Tensor:
    meta = [None if tensor is None else (tuple(tensor.shape), tensor.dtype, str(tensor.device))]
    dist.broadcast_object_list(meta, group_src=0, group=group)
    shape, dtype, source_device = meta[0]
    # Gloo broadcasts CPU tensors; NCCL device tensors.
    on_device = device if dist.get_backend(group) != "gloo" else torch.device("cpu")
    buffer = tensor.to(on_device).contiguous() if tensor is not None else torch.empty(shape, dtype=dtype, device=on_device)
    dist.broadcast(buffer, group_src=0, group=group)
    # Rank 0's tensors keep their device type (e.g. CPU token tags); device tensors land on this rank's `device`.
    return buffer.to(device if torch.device(source_device).type == device.type else source_device)


def run_on_main_rank(fn: Callable[[], Tuple[torch.Tensor, ...]], group, device: torch.device):
    """`fn()` on rank 0 of `group`, its tensors broadcast to the other ranks (which never run `fn`).
    Without a group, `fn()`. An error on rank 0 is raised on every rank."""
    if group is None:
        return fn()
    outputs, error = None, None
    if dist.get_rank(group) == 0:
        try:
            outputs = fn()
        except Exception as exc:  # every rank must learn about it, or they would wait in the broadcast
            error = exc
    status = [None if error is None else f"{type(error).__name__}: {error}"]
    dist.broadcast_object_list(status, group_src=0, group=group)
    if error is not None:
        raise error
    if status[0] is not None:
        raise RuntimeError(f"rank 0 failed while encoding the prompt: {status[0]}")
    count = [len(outputs) if outputs is not None else None]
    dist.broadcast_object_list(count, group_src=0, group=group)
    return tuple(_broadcast_tensor(outputs[i] if outputs is not None else None, group, device) for i in range(count[0]))
