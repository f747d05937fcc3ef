"""Shared helpers of the benchmark scripts (the measuring protocol of docs/benchmarking.md).

The scripts import this module as ``_common``: Python puts a script's own folder first on ``sys.path``, so
``python benchmarks/<script>.py`` finds it, and the package itself comes from the installed ``diffusers_h3``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import re
import statistics
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch


REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "benchmarks" / "results"
EXPERIMENTS = REPO_ROOT / "docs" / "experiments"


# ---------------------------------------------------------------------------------------------------------------------
# Measuring and recording


def cuda_median_ms(fn: Callable[[], object], warmup: int = 3, reps: int = 7) -> float:
    """Median of ``reps`` CUDA-event timings of ``fn()`` in milliseconds, after ``warmup`` untimed calls."""
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


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU): wall-clock timings end here."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp32."""
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm()).item()


def git_commit(given: Optional[str] = None) -> Optional[str]:
    """The commit being measured: ``given`` if set (a copy of the tree without ``.git``), else ``git rev-parse HEAD``
    of this checkout with "+uncommitted" when the tree is dirty, else None."""
    if given:
        return given
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO_ROOT,
                             timeout=10)  # fmt: skip
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, cwd=REPO_ROOT,
                               timeout=10)  # fmt: skip
        return sha.stdout.strip() + ("+uncommitted" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def device_name() -> str:
    """The CUDA device the suite runs on (``"cpu"`` without one)."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def result_header(suite: str, commit: Optional[str] = None, device: Optional[str] = None) -> Dict[str, Any]:
    """The fields every results JSON starts with: suite, device, torch, commit, date and the command that ran."""
    return {
        "suite": suite,
        "device": device or device_name(),
        "torch": torch.__version__,
        "commit": git_commit(commit) or "unknown",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python " + " ".join([os.path.relpath(sys.argv[0], REPO_ROOT), *sys.argv[1:]]),
    }


def write_json(path, data: Dict[str, Any]) -> None:
    """Write ``data`` as indented JSON to ``path``, creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


class DeviceMemorySampler:
    """The process's whole device memory as the card counts it (``nvidia-smi``'s figure, not only PyTorch's caching
    allocator: the CUDA context, cuBLAS / cuDNN workspaces and lazily loaded kernels come on top), sampled in a
    background thread every ``interval_s`` (>= 5 Hz) from :meth:`start` to :meth:`stop`.

    ``read`` returns the bytes to count now. The default reads NVML without creating a CUDA context: this process's
    entry in the device's running compute processes when NVML lists it (``source`` "nvml per-process"), else the
    device's used memory less what was used when the sampler was made (``source`` "nvml device used - baseline"; make
    the sampler before this process touches CUDA, with the device otherwise idle). ``window(name)`` records the peak
    inside a ``with`` block (one request of a case) next to the whole run's :attr:`peak_bytes`.
    """

    def __init__(self, device_index: int = 0, interval_s: float = 0.1, read: Optional[Callable[[], int]] = None):
        if interval_s > 0.2:
            raise ValueError(f"interval_s={interval_s} samples below 5 Hz: pass at most 0.2")
        self.interval_s = interval_s
        self.source = "given"
        self._read = read if read is not None else self._nvml_reader(device_index)
        self.peak_bytes = 0
        self.samples = 0
        self.windows: Dict[str, int] = {}
        self._open: Dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = None
        self._thread = None

    def _nvml_reader(self, device_index: int) -> Callable[[], int]:
        try:
            import pynvml
        except ImportError as error:
            raise RuntimeError("DeviceMemorySampler needs NVML's Python binding (pip install nvidia-ml-py)") from error
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        pid = os.getpid()

        def own_process():
            for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if process.pid == pid and process.usedGpuMemory is not None:
                    return int(process.usedGpuMemory)
            return None

        try:
            listed = own_process() is not None
        except pynvml.NVMLError:
            listed = False
        if listed:
            self.source = "nvml per-process"
            return lambda: own_process() or 0
        # Not listed (no context yet, or a container that hides host PIDs): the device's used memory less a baseline.
        baseline = int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        self.baseline_bytes = baseline
        self.source = "nvml device used - baseline"
        return lambda: max(0, int(pynvml.nvmlDeviceGetMemoryInfo(handle).used) - baseline)

    def sample(self) -> int:
        """Take one sample now (the thread calls this; a stage boundary may too)."""
        value = int(self._read())
        with self._lock:
            self.samples += 1
            self.peak_bytes = max(self.peak_bytes, value)
            for name in self._open:
                self._open[name] = max(self._open[name], value)
        return value

    def _loop(self):
        while not self._stop.wait(self.interval_s):
            self.sample()

    def start(self) -> "DeviceMemorySampler":
        self._stop = threading.Event()
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="device_memory_sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        self.sample()

    @contextlib.contextmanager
    def window(self, name: str):
        """``with sampler.window("fl2va_light4"):`` the peak of the samples taken inside the block."""
        with self._lock:
            self._open[name] = 0
        self.sample()
        try:
            yield self
        finally:
            self.sample()
            with self._lock:
                self.windows[name] = max(self.windows.get(name, 0), self._open.pop(name))


def device_peak_fields(sampled_bytes: int, peak_reserved_gib: Optional[float], source: str) -> Dict[str, Any]:
    """The record's ``device_peak_gib`` (and how it was counted) from a sampled peak. The card holds at least what the
    allocator reserved, so a sampled peak below the reserved peak means the sampler missed a short-lived top: the
    record then says so and reports the reserved peak as the lower bound it is, never a figure below it."""
    sampled = round(sampled_bytes / 2**30, 2)
    fields = {"device_peak_gib": sampled, "device_peak_source": source}
    if peak_reserved_gib is not None and sampled < peak_reserved_gib:
        fields["device_peak_gib"] = peak_reserved_gib
        fields["device_peak_source"] = (f"{source}; sampled {sampled} GiB < the allocator's reserved peak: "
                                        "reported as the reserved peak (a lower bound)")  # fmt: skip
    return fields


def require_cuda(script: str) -> None:
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} needs a CUDA GPU")


# ---------------------------------------------------------------------------------------------------------------------
# The attention benchmarks' inputs and references (attention.py, attention_sweep.py, attention_profile.py and
# flashinfer_peers.py time the same seeded inputs so that their cases are comparable)


def h3_inputs(heads: int = 56, device="cuda"):
    """``(layout, plan, (q, k, v))``: the packed H3 sequence of a 768x1344, 124-frame t2va call and its seeded random
    bf16 ``[1, S, H, 128]`` inputs."""
    from diffusers_h3.attention_processors.tiling import build_tile_plan
    from diffusers_h3.packing import t2va_fl2va_layout

    torch.manual_seed(0)
    # [text | audio | target video] as the t2va pipeline packs 768x1344x124 (37 latent frames of 48x84 latents).
    layout = t2va_fl2va_layout(512, 0, 37, 48, 84, 207, (1, 2, 2), 2)
    dev = torch.device(device)
    plan = build_tile_plan(layout, (4, 4, 4), device=dev)
    q = torch.randn(1, layout.seq_len, heads, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn_like(q)
    v = torch.randn_like(q)
    # Give the keys a shared offset (real H3 keys are far from zero-mean; K smoothing exists for that).
    k = (k + 0.5 * torch.randn(1, 1, heads, 128, device=dev)).to(torch.bfloat16)
    return layout, plan, (q, k, v)


def error_heads(num_heads: int, count: int):
    """``count`` evenly spaced head indices on which the fp32 references are computed."""
    return torch.linspace(0, num_heads - 1, count).round().long().tolist()


def errors(out: torch.Tensor, ref: torch.Tensor) -> Dict[str, float]:
    a, b = out.float().flatten(), ref.float().flatten()
    return {
        "rel_l2": ((a - b).norm() / b.norm()).item(),
        "cosine": torch.nn.functional.cosine_similarity(a, b, dim=0).item(),
        "rel_l1": ((a - b).abs().sum() / b.abs().sum()).item(),
    }


def cudnn_attention(q, k, v):
    """Dense bf16 attention through cuDNN (the baseline of the attention suites) on ``[B, S, H, D]`` rows."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        ).transpose(1, 2)


def dense_reference(q, k, v, heads):
    """fp32 dense attention for the chosen heads: ``[B, S, len(heads), D]``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qh, kh, vh = (x[:, :, heads].float().transpose(1, 2) for x in (q, k, v))
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh)
    return out.transpose(1, 2)


def selection(q, k, plan, sparsity):
    """VSA's tile selection mask ``[B, H, T, T]`` at ``sparsity`` (pooled scores, prefix tiles always kept)."""
    from diffusers_h3.kernels.attention.vsa_pool import tile_pool
    from diffusers_h3.kernels.attention.vsa_select import build_block_mask, topk_for_sparsity

    rows = (plan.slot_rows, plan.tile_counts, plan.block)
    pq, _ = tile_pool(q, *rows)
    pk, _ = tile_pool(k, *rows)
    scores = pq @ pk.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return build_block_mask(scores, plan.num_prefix_tiles, topk_for_sparsity(sparsity, plan.num_video_tiles))


def sparse_reference(q, k, v, plan, mask, heads, chunk=8192):
    """fp32 attention restricted to the selected tiles, for the chosen heads (chunked over query rows)."""
    s, d = q.shape[1], q.shape[-1]
    out = torch.empty(q.shape[0], s, len(heads), d, device=q.device, dtype=torch.float32)
    row_tile = plan.row_tile
    for bi in range(q.shape[0]):
        for hi, h in enumerate(heads):
            kf, vf = k[bi, :, h].float(), v[bi, :, h].float()
            tile_mask = mask[bi, h]
            for a in range(0, s, chunk):
                qf = q[bi, a : a + chunk, h].float()
                scores = (qf @ kf.T) / math.sqrt(d)
                allowed = tile_mask[row_tile[a : a + chunk]][:, row_tile]
                scores.masked_fill_(~allowed, float("-inf"))
                out[bi, a : a + chunk, hi] = torch.softmax(scores, -1) @ vf
    return out


def computed_pairs(plan, mask):
    """Valid (query row, key row) pairs the sparse kernel computes, summed over heads."""
    counts = plan.tile_counts.to(torch.float64)
    keys_per_qtile = (mask.to(torch.float64) * counts).sum(-1)  # [B, H, T]
    return float((keys_per_qtile * counts).sum())


class AttentionCases:
    """Times attention cases against one baseline and records them in the results schema.

    ``record`` runs ``fn`` once (compilation, autotuning), measures the error of that output against ``ref`` on the
    error heads, then times ``fn`` alone; a failing case is recorded with ``ms: null`` and the reason, and the
    others go on.
    """

    def __init__(self, err_heads, dense_flops: float, head_dim: int, rows: int, heads: int, reps: int = 7,
                 baseline: str = "cudnn_dense", skip=()):  # fmt: skip
        self.err_heads, self.dense_flops, self.head_dim = err_heads, dense_flops, head_dim
        self.all_pairs = float(rows) * rows * heads
        self.reps, self.baseline, self.skip = reps, baseline, [s for s in skip if s]
        self.baseline_ms: Optional[float] = None
        self.cases: Dict[str, Dict[str, Any]] = {}
        self.notes: Dict[str, str] = {}

    def not_measured(self, name: str, why: str) -> None:
        self.cases[name] = {"ms": None, "baseline": self.baseline, "ratio": None, "rel_l2": None, "peak_gib": None}
        self.notes[name] = why
        print(f"{name:34s} not measured: {why}", flush=True)

    def record(self, name, fn, ref, pairs=None, note=None, to_rows=None, vs_baseline=True) -> Optional[float]:
        """``pairs``: computed (query, key) pairs of a sparse case (else dense); ``to_rows`` maps an output in
        another layout to ``[B, S, H, D]`` rows for the error only (the timed call stays ``fn`` alone);
        ``vs_baseline=False`` for a case on other inputs than the baseline (no ratio, no density)."""
        if any(part in name for part in self.skip):
            return None
        try:
            ms = self._record(name, fn, ref, pairs, to_rows, vs_baseline)
        except Exception as error:  # noqa: BLE001 - one failing case must not lose the others
            self.not_measured(name, f"failed: {type(error).__name__}: {str(error)[:400]}")
            return None
        if note:
            self.notes[name] = note
        if name == self.baseline:
            self.baseline_ms = ms
            self.cases[name]["ratio"] = 1.0
        return ms

    def _record(self, name, fn, ref, pairs, to_rows, vs_baseline):
        torch.cuda.reset_peak_memory_stats()
        base_mem = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base_mem) / 2**30
        if to_rows is not None:
            out = to_rows(out)
        err = errors(out[:, :, self.err_heads], ref) if ref is not None else {}
        del out
        ms = cuda_median_ms(fn, reps=self.reps)
        flops = self.dense_flops if pairs is None else 4.0 * pairs * self.head_dim
        case = self.cases[name] = {
            "ms": round(ms, 3),
            "baseline": self.baseline if vs_baseline else None,
            "ratio": round(self.baseline_ms / ms, 3) if vs_baseline and self.baseline_ms else None,
            "rel_l2": err.get("rel_l2"),
            "cosine": err.get("cosine"),
            "rel_l1": err.get("rel_l1"),
            "peak_gib": round(peak, 3),
            "tflops": round(flops / ms / 1e9, 1),
            "density": round(pairs / self.all_pairs, 4) if vs_baseline and pairs is not None else None,
        }
        print(f"{name:34s} {ms:8.2f} ms  ratio {case['ratio']}  rel_l2 {case['rel_l2']}  {case['tflops']} TF/s",
              flush=True)  # fmt: skip
        return ms


# ---------------------------------------------------------------------------------------------------------------------
# Kernel categories of the profile (a pure function of the kernel name: tests/test_benchmark_forward.py)

CATEGORIES = ("gemm", "attention", "inductor_fused", "quantization", "other")
# Inductor's generated Triton kernels: pointwise, persistent / looped reductions, templates (max-autotune GEMM
# templates are inductor_fused too: they only appear when inductor chose to fuse an epilogue into a GEMM), foreach.
INDUCTOR_PREFIXES = ("triton_poi_", "triton_per_", "triton_red_", "triton_tem_", "triton_for_")
# This package's kernels by function name (diffusers_h3/kernels): Triton / Gluon kernels keep their Python name.
OUR_KERNELS = {
    # attention: the block-sparse / dense flash kernels (Triton, Hopper Gluon), VSA's tile selection, FA-V100
    "_bsa_fwd_kernel": "attention",
    "_bsa_fwd_sm90_kernel": "attention",
    "_dense_fwd_sm90_ws_kernel": "attention",
    "_sparse_fwd_sm90_ws_kernel": "attention",
    "_select_tiles_kernel": "attention",
    "_mask_to_index_kernel": "attention",
    "fa_v100_forward_kernel": "attention",
    # quantization: per-token FP8 activations of the FP8 GEMM (gemm/fp8.py), the fused Q/K 8-bit quantization of the
    # attention operands (vsa_pool.py: with VSA it also mean-pools the tiles, with bf16 VSA it only pools / packs),
    # channel-major FP8 V, and the weight dequantization to a scratch weight of W8A16 / NVFP4 at large M
    "_quant_row_kernel": "quantization",
    "_tile_pool_kernel": "quantization",
    "_quantize_v_kernel": "quantization",
    "_w8a16_dequant_kernel": "quantization",
    "_nvfp4_dequant_kernel": "quantization",
    # gemm: the weight-only Triton GEMMs (dequantization in registers)
    "_w8a16_kernel": "gemm",
    "_nvfp4_wo_kernel": "gemm",
}
_OUR_KERNEL = re.compile(r"(?<![A-Za-z0-9_])(" + "|".join(map(re.escape, OUR_KERNELS)) + r")(?![A-Za-z0-9_])")
# Vendor / PyTorch attention: cuDNN fused attention ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_..."),
# FlashAttention ("flash_fwd_kernel", FA3's "flash::FlashAttnFwdSm90"), PyTorch's memory-efficient "fmha_cutlassF",
# CPU SDPA ("aten::_scaled_dot_product_flash_attention_for_cpu"). Checked before gemm: their names mention cutlass,
# wgmma or gemm tiles.
ATTENTION_WORDS = ("flash", "fmha", "sdpa", "attention", "attn", "scaled_dot_product")
# cuBLAS / cuBLASLt (sm90_xmma_gemm_*, nvjet_*, *s16816gemm*, gemv, split-K reduction), CUTLASS, torch._scaled_mm,
# and the CPU ops of a --tiny profile.
GEMM_WORDS = ("gemm", "gemv", "cublas", "cutlass", "scaled_mm", "nvjet", "xmma", "s16816", "s1688", "splitkreduce",
              "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul")  # fmt: skip
QUANT_WORDS = ("quant",)


def kernel_category(name: str) -> str:
    """The category of a profiled kernel (or, on CPU, operator) name: one of :data:`CATEGORIES`.

    Order matters: inductor's generated kernels first (``triton_poi_/per_/red_/tem_``: a fused region may contain a
    quantizing cast, it is still inductor's), then this package's kernels by name, then vendor attention (before gemm:
    cuDNN / FlashAttention names contain gemm tile words), quantization, gemm; memcpy / memset and eager elementwise
    kernels are ``other``.
    """
    stripped = name.strip()
    if stripped.startswith(INDUCTOR_PREFIXES):
        return "inductor_fused"
    ours = _OUR_KERNEL.search(stripped)
    if ours:
        return OUR_KERNELS[ours.group(1)]
    lower = stripped.lower()
    if any(word in lower for word in ATTENTION_WORDS):
        return "attention"
    if any(word in lower for word in QUANT_WORDS):
        return "quantization"
    if any(word in lower for word in GEMM_WORDS):
        return "gemm"
    return "other"


def kernel_breakdown(kernels: Iterable[Tuple[str, float, int]], top: int = 15) -> Dict[str, Any]:
    """Kernel time by category from ``(name, total_us, launches)`` rows (one per kernel name).

    Returns ``{"kernel_ms", "categories": {cat: {"ms", "pct", "count", "top"}}, "top_kernels": [...]}``: ``count`` is
    the number of launches, ``top`` the category's 5 most expensive kernel names, ``top_kernels`` the ``top`` most
    expensive kernels overall (name, category, ms, pct, count).
    """
    rows = sorted(((name, float(us), int(count)) for name, us, count in kernels), key=lambda r: -r[1])
    total_us = sum(us for _, us, _ in rows)

    def pct(us):
        return round(100.0 * us / total_us, 2) if total_us else 0.0

    categories: Dict[str, Dict[str, Any]] = {c: {"ms": 0.0, "pct": 0.0, "count": 0, "top": []} for c in CATEGORIES}
    for name, us, count in rows:
        entry = categories[kernel_category(name)]
        entry["ms"] += us / 1000
        entry["count"] += count
        if len(entry["top"]) < 5:
            entry["top"].append(name[:160])
    for entry in categories.values():
        entry["pct"] = pct(entry["ms"] * 1000)
        entry["ms"] = round(entry["ms"], 3)
    top_kernels = [
        {"name": name[:160], "category": kernel_category(name), "ms": round(us / 1000, 3), "pct": pct(us),
         "count": count}
        for name, us, count in rows[:top]
    ]  # fmt: skip
    return {"kernel_ms": round(total_us / 1000, 3), "categories": categories, "top_kernels": top_kernels}


def profile_forward(run, device: torch.device, top: int = 15) -> Dict[str, Any]:
    """One forward under torch.profiler: CUDA kernel times (CPU operator self times on a CPU) by category."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        run()
        synchronize(device)
    # Per kernel name: (device time, launches), counted as torch's own profiler table sums device time: device events
    # that are not record_function ranges (user annotations are on the GPU timeline too: they span kernels and would
    # count them twice). On a CPU (--tiny): the operators' self time.
    totals: Dict[str, List[float]] = {}
    for event in prof.events():
        if event.is_user_annotation:
            continue
        if device.type == "cuda":
            if event.device_type != DeviceType.CUDA:
                continue
            us = event.self_device_time_total
        else:
            if event.device_type != DeviceType.CPU or event.is_async:
                continue
            us = event.self_cpu_time_total
        entry = totals.setdefault(event.name, [0.0, 0])
        entry[0] += us
        entry[1] += 1
    rows = [(name, us, count) for name, (us, count) in totals.items() if us > 0]
    result = kernel_breakdown(rows, top=top)
    result["source"] = "CUDA kernels" if device.type == "cuda" else "CPU operators (self time; --tiny)"
    return result
