"""Shared helpers of the benchmark scripts in `benchmarks/` (DESIGN.md "Measuring")."""

from __future__ import annotations

import statistics
import subprocess
from pathlib import Path
from typing import Callable, Optional


def cuda_median_ms(fn: Callable[[], object], warmup: int = 3, reps: int = 7) -> float:
    """Median of `reps` CUDA-event timings of `fn()` in milliseconds, after `warmup` untimed calls."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def git_commit(given: Optional[str] = None) -> Optional[str]:
    """The commit being measured: `given` if set (the device machine's copy has no .git), else `git rev-parse HEAD`
    of this checkout with "+uncommitted" when the tree is dirty, else None."""
    if given:
        return given
    root = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=root, timeout=10)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, cwd=root, timeout=10)
        return sha.stdout.strip() + ("+uncommitted" if dirty.stdout.strip() else "")
    except Exception:
        return None
