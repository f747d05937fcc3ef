"""`ulysses_attention` on 2 and 4 gloo ranks (forked from a server that imported the package) against a one-process computation."""

import pytest
import torch
import torch.nn.functional as F

from diffusers_h3.parallel._launch import RankFailedError

from ._ranks import launch


HEADS, HEAD_DIM, BATCH = 4, 8, 2
# (sequence length, seed) per case; lengths that do not divide by the world size give uneven shards.
CASES = {2: [(8, 0), (7, 1), (13, 2)], 4: [(16, 3), (11, 4), (6, 5)]}


def _gated_core(query, key, value, extras):
    """SDPA whose output depends on per-row-per-head extras of two dtypes, so a misrouted row or head shows."""
    out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))
    out = out.transpose(1, 2)
    if extras is not None:
        out = out * torch.sigmoid(extras["gate"]) + extras["bias"].to(out.dtype).sum(-1, keepdim=True)
    return out


def _case_inputs(seq_len, seed, with_extras=True):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(BATCH, seq_len, HEADS, HEAD_DIM, generator=gen) for _ in range(3))
    extras = None
    if with_extras:
        extras = {
            "gate": torch.randn(BATCH, seq_len, HEADS, 1, generator=gen),
            "bias": torch.randn(BATCH, seq_len, HEADS, 3, generator=gen, dtype=torch.float64),
        }
    return q, k, v, extras


def _ulysses_parallel_config(world_size):
    from diffusers import ContextParallelConfig, ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    config = ParallelConfig(context_parallel_config=ContextParallelConfig(ulysses_degree=world_size))
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("ring", "ulysses"))
    config.setup(torch.distributed.get_rank(), world_size, torch.device("cpu"), mesh=mesh)
    return config


def _rank_ulysses(world_size):
    import torch.distributed as dist

    from diffusers_h3.attention_processors._ulysses import ulysses_attention

    rank = dist.get_rank()
    config = _ulysses_parallel_config(world_size)
    results = {}
    for seq_len, seed in CASES[world_size]:
        for with_extras in (True, False):
            q, k, v, extras = _case_inputs(seq_len, seed, with_extras)
            shard = lambda t: t.tensor_split(world_size, dim=1)[rank]  # noqa: E731  (as diffusers' ulysses_anything)
            local_extras = None if extras is None else {name: shard(t) for name, t in extras.items()}
            out = torch.full((1,), float("nan"))
            out = ulysses_attention(_gated_core, shard(q), shard(k), shard(v), config, extras=local_extras)
            results[(seq_len, seed, with_extras)] = out
    # Three heads cannot be split over the group: every rank raises before any collective.
    q = torch.randn(1, 4, 3, HEAD_DIM)
    try:
        ulysses_attention(_gated_core, q, q, q, config)
        results["bad_heads"] = None
    except ValueError as error:
        results["bad_heads"] = str(error)
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_ulysses_matches_one_process(world_size):
    rank_results = launch(_rank_ulysses, world_size, args=(world_size,), timeout_s=240)
    for seq_len, seed in CASES[world_size]:
        for with_extras in (True, False):
            q, k, v, extras = _case_inputs(seq_len, seed, with_extras)
            expected = _gated_core(q, k, v, extras)
            shards = [rank_results[r][(seq_len, seed, with_extras)] for r in range(world_size)]
            assert [s.shape[1] for s in shards] == [t.shape[1] for t in expected.tensor_split(world_size, dim=1)]
            got = torch.cat(shards, dim=1)
            assert got.shape == expected.shape
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    for r in range(world_size):
        message = rank_results[r]["bad_heads"]
        assert message is not None and "head count (3)" in message and "ulysses_degree" in message


def _rank_fails(failing_rank):
    import torch.distributed as dist

    if dist.get_rank() == failing_rank:
        raise RuntimeError("boom from the failing rank")
    dist.barrier()  # the other ranks wait for a partner that never comes
    return "unreachable"


def test_failing_rank_ends_the_job_with_its_error():
    with pytest.raises(RankFailedError, match="(?s)rank 1 failed.*boom from the failing rank"):
        launch(_rank_fails, 2, args=(1,), timeout_s=120, collective_timeout_s=60)
