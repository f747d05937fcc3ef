"""Ulysses (all-to-all) context parallelism for attention cores that diffusers' dispatcher does not know.

Diffusers' context-parallel hooks shard the packed sequence across the ranks of the Ulysses group before the first
block. A plugin attention core (VSA, the low-precision dense kernels, FA-V100) needs the *whole* sequence — VSA's tile
plan is built from the global `PackedLayout` — so this module swaps the sharded axis: every rank sends each head group
to the rank that owns it, runs the core over the full sequence with `heads / degree` heads, and sends the result back.
Per-row-per-head side inputs (VSA's trained gate values) travel with Q/K/V through the same exchange.

The sequence shards may be uneven (diffusers' `ulysses_anything` mode uses `tensor_split`); the exchange uses
`all_to_all_single` with per-rank split sizes, which both NCCL and gloo support, so no padding is needed.
"""

from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist


UlyssesCore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Optional[Dict[str, torch.Tensor]]], torch.Tensor]


def usable_ulysses_degrees(num_heads: int) -> List[int]:
    """Ulysses degrees (> 1) that split `num_heads` evenly."""
    return [degree for degree in range(2, num_heads + 1) if num_heads % degree == 0]


def check_ulysses_heads(num_heads: int, degree: int) -> None:
    if degree > 1 and num_heads % degree != 0:
        raise ValueError(
            f"Ulysses context parallelism needs the head count ({num_heads}) to divide by ulysses_degree={degree}; "
            f"usable degrees for {num_heads} heads: {usable_ulysses_degrees(num_heads)}."
        )


def _ulysses_group(parallel_config):
    cp_config = getattr(parallel_config, "context_parallel_config", parallel_config)
    if cp_config is None or getattr(cp_config, "_ulysses_mesh", None) is None:
        raise ValueError(
            "ulysses_attention needs a parallel config set up by `enable_parallelism` (its `_ulysses_mesh` is missing)."
        )
    if cp_config.ring_degree > 1:
        raise NotImplementedError(
            f"ring_degree={cp_config.ring_degree}: plugin attention cores return no log-sum-exp, so they run with "
            "Ulysses only; use ring_degree=1."
        )
    return cp_config._ulysses_mesh.get_group()


def _size_exchange_device(group, like: torch.Tensor) -> torch.device:
    # A mixed "cpu:gloo,cuda:nccl" group exchanges the small size tensor on the CPU (no device sync for it).
    backend = str(dist.get_backend(group))
    return torch.device("cpu") if like.device.type == "cpu" or "cpu" in backend else like.device


def _all_gather_sizes(size: int, group, like: torch.Tensor) -> List[int]:
    # Never cached: a cache hit on one rank and a miss on another would desynchronize the collectives.
    world_size = dist.get_world_size(group)
    device = _size_exchange_device(group, like)
    gathered = [torch.empty(1, dtype=torch.int64, device=device) for _ in range(world_size)]
    dist.all_gather(gathered, torch.tensor([size], dtype=torch.int64, device=device), group=group)
    return [int(x.item()) for x in gathered]


def _all_to_all(output: torch.Tensor, tensor: torch.Tensor, output_sizes, input_sizes, group) -> torch.Tensor:
    if torch.is_grad_enabled() and tensor.requires_grad:
        # The autograd-aware collective sends the gradients back along the reverse exchange.
        from torch.distributed.nn.functional import all_to_all_single

        return all_to_all_single(output, tensor, output_sizes, input_sizes, group=group)
    dist.all_to_all_single(output, tensor, output_sizes, input_sizes, group=group)
    return output


def _sequence_to_heads(x: torch.Tensor, sizes: List[int], rank: int, group) -> torch.Tensor:
    """`(B, S_local, H, X)` sequence shard -> `(B, S_total, H / W, X)`: all rows, this rank's head group."""
    batch, seq_local, heads, *rest = x.shape
    world_size = len(sizes)
    heads_local = heads // world_size
    # Row blocks of dim 0 go to the ranks in order: block j holds head group j of this rank's rows.
    send = x.reshape(batch, seq_local, world_size, heads_local, *rest).movedim(2, 0).movedim(1, 2)
    send = send.reshape(world_size * seq_local, batch, heads_local, *rest).contiguous()
    recv = send.new_empty((sum(sizes), batch, heads_local, *rest))
    recv = _all_to_all(recv, send, sizes, [seq_local] * world_size, group)
    return recv.movedim(0, 1)


def _heads_to_sequence(x: torch.Tensor, sizes: List[int], rank: int, group) -> torch.Tensor:
    """Inverse of :func:`_sequence_to_heads`: `(B, S_total, H / W, X)` -> `(B, S_local, H, X)`."""
    batch, _, heads_local, *rest = x.shape
    world_size = len(sizes)
    seq_local = sizes[rank]
    send = x.movedim(1, 0).contiguous()
    recv = send.new_empty((world_size * seq_local, batch, heads_local, *rest))
    recv = _all_to_all(recv, send, [seq_local] * world_size, sizes, group)
    recv = recv.reshape(world_size, seq_local, batch, heads_local, *rest).movedim(2, 0).movedim(1, 2)
    return recv.reshape(batch, seq_local, world_size * heads_local, *rest)


def ulysses_attention(
    core_fn: UlyssesCore,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    parallel_config,
    extras: Optional[Dict[str, torch.Tensor]] = None,
) -> torch.Tensor:
    """Run `core_fn` over the full sequence with this rank's head group and return this rank's sequence shard.

    Args:
        core_fn: `core_fn(query, key, value, extras)` on `(B, S_total, H / W, D)` tensors (extras likewise
            `(B, S_total, H / W, ...)`, or `None`), returning `(B, S_total, H / W, D_v)`.
        query, key, value: this rank's sequence shard, `(B, S_local, H, D)`. `S_local` may differ between ranks.
        parallel_config: diffusers' `ParallelConfig` (or its `ContextParallelConfig`) after `enable_parallelism`.
        extras: per-row-per-head tensors `(B, S_local, H, ...)` that the core needs next to Q/K/V.

    Returns:
        `(B, S_local, H, D_v)`, the attention output of this rank's rows for all heads.
    """
    group = _ulysses_group(parallel_config)
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return core_fn(query, key, value, extras)
    heads = query.shape[2]
    check_ulysses_heads(heads, world_size)
    seq_local = query.shape[1]
    for name, tensor in [("key", key), ("value", value), *(extras or {}).items()]:
        if tensor.shape[:3] != query.shape[:3]:
            raise ValueError(
                f"ulysses_attention: `{name}` has shape {list(tensor.shape)}, but every input must share the query's "
                f"(batch, rows, heads) = {list(query.shape[:3])}."
            )
    rank = dist.get_rank(group)
    sizes = _all_gather_sizes(seq_local, group, query)

    # Tensors of one dtype share one exchange: concatenated along a flattened trailing axis.
    named = {"query": query, "key": key, "value": value, **{f"extra:{k}": v for k, v in (extras or {}).items()}}
    by_dtype: Dict[torch.dtype, List[str]] = {}
    for name, tensor in named.items():
        by_dtype.setdefault(tensor.dtype, []).append(name)
    gathered: Dict[str, torch.Tensor] = {}
    for names in by_dtype.values():
        flat = [named[name].reshape(*named[name].shape[:3], -1) for name in names]
        widths = [t.shape[-1] for t in flat]
        full = _sequence_to_heads(torch.cat(flat, dim=-1), sizes, rank, group)
        for name, part in zip(names, full.split(widths, dim=-1)):
            gathered[name] = part.reshape(*part.shape[:3], *named[name].shape[3:])

    full_extras = None
    if extras is not None:
        full_extras = {k: gathered[f"extra:{k}"] for k in extras}
    out = core_fn(gathered["query"], gathered["key"], gathered["value"], full_extras)
    expected = (query.shape[0], sum(sizes), heads // world_size)
    if tuple(out.shape[:3]) != expected:
        raise ValueError(f"ulysses_attention: core_fn returned {list(out.shape)}, expected (B, S, H/W, D) = {expected}.")
    return _heads_to_sequence(out, sizes, rank, group)
