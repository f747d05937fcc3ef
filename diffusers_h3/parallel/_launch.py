"""Start N ranks on this machine, each a fresh interpreter, and collect what each returns.

Used by the tests (gloo on CPU) and by the CLI (`--gpus N`, NCCL). Ranks are never forked from the caller: forking a
process after torch has started its thread pools can deadlock. They are spawned (the default), or forked from a
`forkserver` process that has only imported the `preload` modules and never ran a torch op; the tests use the latter
so that a launch does not import torch and diffusers again in every rank. A rank that raises ends the whole job with
its traceback, and the job has a wall-clock limit, so a rank stuck in a collective never hangs the caller.
"""

import datetime
import multiprocessing
import os
import pickle
import socket
import tempfile
import time
import traceback
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailedError(RuntimeError):
    """A rank raised; the message carries the failing rank and its traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_entry(
    rank: int,
    fn: Callable,
    args: Sequence[Any],
    world_size: int,
    port: int,
    backend: str,
    collective_timeout_s: float,
    result_dir: str,
    num_threads: Optional[int],
    environ: Optional[dict] = None,
) -> None:
    if environ is not None:  # a forked rank starts with the server's environment: take the caller's, as spawn does
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    if "nccl" in backend and torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=collective_timeout_s)
    )
    try:
        result = fn(*args)
        with open(os.path.join(result_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        # Timestamped, so that the launcher reports the first failure, not a partner's broken collective after it.
        # Written whole and then renamed: the launcher may read the folder while a partner is still writing.
        path = os.path.join(result_dir, f"rank{rank}.err")
        with open(path + ".partial", "w") as f:
            f.write(f"{time.time()!r}\n{traceback.format_exc()}")
        os.replace(path + ".partial", path)
        raise
    finally:
        if dist.is_initialized():  # `fn` may have ended the group itself
            dist.destroy_process_group()


def _first_failure(result_dir: str):
    failures = []
    for name in os.listdir(result_dir):
        if name.endswith(".err"):
            with open(os.path.join(result_dir, name)) as f:
                stamp, _, text = f.read().partition("\n")
            failures.append((float(stamp), int(name[len("rank") : -len(".err")]), text))
    if not failures:
        return None
    _, rank, text = min(failures)
    return rank, text


def launch(
    fn: Callable,
    world_size: int,
    args: Sequence[Any] = (),
    *,
    backend: str = "cpu:gloo",
    timeout_s: float = 300.0,
    collective_timeout_s: float = 120.0,
    num_threads: Optional[int] = 1,
    start_method: str = "spawn",
    preload: Sequence[str] = (),
) -> List[Any]:
    """Run `fn(*args)` in `world_size` fresh processes joined in one process group; return each rank's result.

    Args:
        fn: a module-level (picklable) function; it runs after `torch.distributed.init_process_group`, with `RANK`,
            `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT` set as torchrun sets them. Its return value
            must be picklable (move tensors to the CPU).
        world_size: number of ranks.
        backend: `"cpu:gloo"` (CPU), `"cpu:gloo,cuda:nccl"` (one GPU per rank; small size exchanges stay on the
            CPU, as diffusers advises for its uneven-shard modes) or any `init_process_group` backend string.
        timeout_s: wall-clock limit for the whole job; on expiry every rank is terminated and `TimeoutError` raised.
        collective_timeout_s: the process group's timeout, so that a collective missing a partner fails instead of
            waiting forever.
        num_threads: intra-op threads per rank (`None` keeps torch's default).
        start_method: `"spawn"` (every rank a fresh interpreter) or `"forkserver"` (ranks forked from one server
            process per caller, started on the first such launch; each rank gets the caller's environment of the
            moment, as with spawn).
        preload: modules the forkserver imports once before its first fork (ignored once the server runs).

    Raises:
        RankFailedError: a rank raised (the others are terminated); the message names the rank and has its traceback.
        TimeoutError: the job ran past `timeout_s`.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}.")
    if start_method not in ("spawn", "forkserver"):
        raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {start_method!r}")
    if start_method == "forkserver" and preload:
        multiprocessing.set_forkserver_preload(list(preload))
    with tempfile.TemporaryDirectory(prefix="diffusers_h3_ranks_") as result_dir:
        context = mp.start_processes(
            _rank_entry,
            args=(fn, tuple(args), world_size, free_port(), backend, collective_timeout_s, result_dir, num_threads,
                  dict(os.environ) if start_method == "forkserver" else None),
            nprocs=world_size,
            join=False,
            start_method=start_method,
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size}-rank job did not finish within {timeout_s:.0f} s.")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
            first = _first_failure(result_dir)
            if first is not None:
                raise RankFailedError(f"rank {first[0]} failed:\n{first[1]}") from None
            raise RankFailedError(f"rank {error.error_index} failed:\n{error}") from None
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
            for process in context.processes:
                process.join(5)
        results = []
        for rank in range(world_size):
            with open(os.path.join(result_dir, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
