"""Memory budgets: which single-GPU placement recipe fits a GPU and host memory budget, from measured numbers.

The recipes (:data:`RECIPES`) say how the weights are stored and where each component lives; what each one needs
(peak GPU memory, host peak RSS including the load) and how fast it runs come from the measured cases of
``benchmarks/results/placement_h200.json``, turned into the data file ``memory_recipes.json`` next to this module by
:func:`derive_recipe_table` (``python benchmarks/placement.py --recipe-table``; a test checks the two agree). No
requirement is written in code.

- ``resident``: 8-bit DiT (FP8 on SM89+, W8A16 elsewhere) and W8A16 text encoder, all on the GPU (the largest GPUs).
- ``offload``: W8A16 DiT and text encoder in host memory, group offloaded to the GPU (DiT block by block with CUDA
  stream prefetch, text encoder leaf by leaf), VAEs model offloaded (mid-size GPUs, ample host memory).
- ``low_ram``: NVFP4 DiT (weight-only 4-bit: approximate, see docs/memory.md) in host memory, group offloaded block
  by block with stream prefetch; W8A16 text encoder streamed from disk leaf by leaf (diffusers' group offload with
  ``offload_to_disk_path``) and loaded before the DiT, so the two never sit in host memory together; VAEs model
  offloaded (small GPUs, little host memory).

What each recipe needs and the GPUs it suits: docs/memory.md.

:func:`select_recipe` picks the fastest recipe that fits, :func:`enable_memory_budget` places an already loaded
pipeline (``diffusers_h3.pipelines.memory_budget.load_for_memory_budget`` also loads it the way the recipe needs).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

import torch
from diffusers.utils import logging

from .._hooks import H3_STREAM_FROM_DISK_HOOK, H3Hook, h3_record, partitions_of, register_h3_hook


logger = logging.get_logger(__name__)

GiB = 2**30
RECIPE_TABLE_PATH = Path(__file__).with_name("memory_recipes.json")


@dataclass(frozen=True)
class RecipeSpec:
    """How a recipe stores and places the weights (the measured needs live in the table)."""

    name: str
    transformer_format: str  # "fp8_or_w8a16", "w8a16", "nvfp4"
    text_encoder_format: str
    transformer_placement: str  # "resident" | "offload"
    text_encoder_placement: str  # "resident" | "offload" | "disk"
    approximate: Optional[str] = None


RECIPES: Dict[str, RecipeSpec] = {
    spec.name: spec
    for spec in (
        RecipeSpec("resident", "fp8_or_w8a16", "w8a16", "resident", "resident"),
        RecipeSpec("offload", "w8a16", "w8a16", "offload", "offload"),
        RecipeSpec("low_ram", "nvfp4", "w8a16", "offload", "disk",
                   approximate="NVFP4 DiT weights (weight-only 4-bit on GPUs without FP4 tensor cores)"),
    )
}  # fmt: skip


class MemoryBudgetError(ValueError):
    """No recipe fits the budget (raised before anything is loaded)."""


@dataclass(frozen=True)
class MemoryRecipe:
    """A recipe with what it needs and how fast it ran, read from the recipe table."""

    spec: RecipeSpec
    gpu_gib: float
    host_gib: float
    request_s: float
    case: str
    measured: bool
    basis: str

    @property
    def name(self) -> str:
        return self.spec.name

    def line(self) -> str:
        """The one line that says which recipe runs and why it fits."""
        measured = f"measured as {self.case}" if self.measured else f"NOT measured ({self.basis})"
        approx = f"; approximate: {self.spec.approximate}" if self.spec.approximate else ""
        return (f"memory recipe {self.name!r}: needs {self.gpu_gib:.1f} GiB GPU / {self.host_gib:.1f} GiB host, "
                f"~{self.request_s:.0f} s per t2va request on an H200 ({measured}){approx}")  # fmt: skip


# -- the table: derived from the measured JSON -----------------------------------------------------------------------


def _case_request_s(case: Dict[str, Any]) -> float:
    """Seconds of the full request: the timed one-forward request with its forward repeated for every sigma step."""
    forwards = case["sigma_points"] - 1
    per_forward = case["stages"]["forwards"] / case["forwards"]
    return (case["ms"] - case["stages"]["forwards"] + forwards * per_forward) / 1000


def derive_recipe_table(results: Dict[str, Any], source: str = "benchmarks/results/placement_h200.json"):
    """The recipe table (the content of ``memory_recipes.json``) from a placement result file.

    For each recipe, its passing case with the smallest GPU need. GPU need: the peak reserved memory of the request
    (the allocator's cap bounds it). Host need: the peak RSS of the case's process; for cases whose process built
    their weights on the GPU instead of loading them (``host_includes_load`` false), at least the weights' size too,
    since a load goes through host memory (labelled in ``basis``). Recipes with no passing case are left out.
    """
    recipes = {}
    for case_name, case in sorted(results.get("cases", {}).items()):
        recipe = case.get("recipe_name") or _legacy_recipe_name(case_name)
        if recipe not in RECIPES or case.get("ms") is None or case.get("peak_reserved_gib") is None:
            continue
        host = case["host_peak_rss_gib"]
        basis = "host peak RSS of a fresh process, load included"
        if not case.get("host_includes_load", False):
            weights = sum(case.get("weights_gib", {}).values())
            host = max(host, weights)
            basis = ("host need: max(peak RSS of a process that built its weights on the GPU, the weights' size, "
                     "which a load moves through host memory)")  # fmt: skip
        entry = {"recipe": recipe, "gpu_gib": round(case["peak_reserved_gib"], 2), "host_gib": round(host, 2),
                 "request_s": round(_case_request_s(case), 1), "case": case_name, "measured": True, "basis": basis,
                 "cap_gib": case.get("cap_gib")}  # fmt: skip
        if recipe not in recipes or entry["gpu_gib"] < recipes[recipe]["gpu_gib"]:
            recipes[recipe] = entry
    return {"source": source, "device": results.get("device"), "commit": results.get("commit"),
            "recipes": [recipes[name] for name in RECIPES if name in recipes]}  # fmt: skip


def _legacy_recipe_name(case_name: str) -> str:
    # cases measured before the JSON named their recipe: "resident_80gb", "offload_24gb", ...
    return case_name.rsplit("_", 1)[0]


def load_recipe_table(path: Union[str, Path, None] = None) -> Tuple[MemoryRecipe, ...]:
    """The recipes of the table at ``path`` (default: the packaged ``memory_recipes.json``)."""
    data = json.loads(Path(path or RECIPE_TABLE_PATH).read_text())
    out = []
    for entry in data["recipes"]:
        out.append(MemoryRecipe(RECIPES[entry["recipe"]], float(entry["gpu_gib"]), float(entry["host_gib"]),
                                float(entry["request_s"]), entry["case"], bool(entry["measured"]), entry["basis"]))
    return tuple(out)  # fmt: skip


# -- budgets -------------------------------------------------------------------------------------------------------


def _meminfo_bytes(field: str) -> Optional[int]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_limit_bytes() -> Optional[int]:
    """The memory left under this process's cgroup v2 ``memory.max`` (None where there is no limit)."""
    try:
        relative = Path("/proc/self/cgroup").read_text().strip().split("\n")[0].split("::", 1)[1]
        folder = Path("/sys/fs/cgroup") / relative.lstrip("/")
        limit = (folder / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((folder / "memory.current").read_text())
    except (OSError, IndexError, ValueError):
        return None


def visible_host_gib() -> float:
    """Host memory this process can use: ``MemAvailable`` (or psutil's), lowered by a cgroup v2 limit."""
    available = _meminfo_bytes("MemAvailable")
    if available is None:
        try:
            import psutil

            available = psutil.virtual_memory().available
        except ImportError:
            raise MemoryBudgetError("cannot read the host memory (no /proc/meminfo, no psutil): pass host_gib") from None
    limit = _cgroup_limit_bytes()
    return (min(available, limit) if limit is not None else available) / GiB


def visible_gpu_gib(device: Union[str, torch.device, None] = None) -> float:
    """Free memory of the CUDA ``device`` (``torch.cuda.mem_get_info``), plus what PyTorch already holds there."""
    if not torch.cuda.is_available():
        raise MemoryBudgetError("--memory auto / gpu_gib=None reads a CUDA GPU's memory, but no CUDA GPU is visible: "
                                "pass the budget, e.g. --memory 16,32")  # fmt: skip
    device = torch.device(device if device is not None else "cuda")
    free, _ = torch.cuda.mem_get_info(device)
    return (free + torch.cuda.memory_reserved(device)) / GiB


def parse_memory_option(text: str) -> Tuple[Optional[float], Optional[float]]:
    """``"auto"`` -> ``(None, None)`` (read the machine); ``"16,32"`` -> ``(16.0, 32.0)`` GiB of GPU and host."""
    text = text.strip().lower()
    if text == "auto":
        return None, None
    parts = text.split(",")
    try:
        gpu, host = (float(p) for p in parts) if len(parts) == 2 else (math.nan, math.nan)
    except ValueError:
        gpu = host = math.nan
    if not (gpu > 0 and host > 0 and math.isfinite(gpu) and math.isfinite(host)):
        raise MemoryBudgetError(f"--memory {text!r}: give 'auto' or '<GPU GiB>,<host GiB>' with positive numbers, "
                                "e.g. --memory 16,32")  # fmt: skip
    return gpu, host


def select_recipe(
    gpu_gib: Optional[float] = None,
    host_gib: Optional[float] = None,
    *,
    device: Union[str, torch.device, None] = None,
    table: Optional[Tuple[MemoryRecipe, ...]] = None,
) -> MemoryRecipe:
    """The fastest recipe whose measured needs fit ``gpu_gib`` of GPU memory and ``host_gib`` of host memory
    (None: read them from the visible GPU and host). Raises :class:`MemoryBudgetError` (one line) when none fits."""
    if gpu_gib is None:
        gpu_gib = visible_gpu_gib(device)
    if host_gib is None:
        host_gib = visible_host_gib()
    for name, value in (("gpu_gib", gpu_gib), ("host_gib", host_gib)):
        if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
            raise MemoryBudgetError(f"{name}={value!r}: give a positive number of GiB")
    table = load_recipe_table() if table is None else table
    fitting = [r for r in table if r.gpu_gib <= gpu_gib and r.host_gib <= host_gib]
    if fitting:
        return min(fitting, key=lambda r: r.request_s)
    least_gpu = min(table, key=lambda r: r.gpu_gib)
    least_host = min(table, key=lambda r: r.host_gib)
    raise MemoryBudgetError(
        f"no placement recipe fits {gpu_gib:.1f} GiB of GPU memory and {host_gib:.1f} GiB of host memory: the "
        f"smallest GPU need is {least_gpu.gpu_gib:.1f} GiB ({least_gpu.name!r}, with {least_gpu.host_gib:.1f} GiB "
        f"host), the smallest host need {least_host.host_gib:.1f} GiB ({least_host.name!r}); free memory or use "
        "several GPUs (docs/memory.md)"
    )


def apply_gpu_cap(gpu_gib: float, device: Union[str, torch.device] = "cuda") -> Optional[float]:
    """Hold PyTorch's caching allocator to ``gpu_gib`` on ``device`` (the condition the recipes were measured under);
    returns the fraction set, None when the budget is the whole device or more."""
    device = torch.device(device)
    if device.index is None:  # "cuda" means the current device; the allocator's cap needs its index
        device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    if gpu_gib * GiB >= total:
        return None
    fraction = gpu_gib * GiB / total
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


# -- placement of a loaded pipeline ----------------------------------------------------------------------------------


def _stored_formats(module: torch.nn.Module):
    from ..quantizers import quantization_summary

    return set(quantization_summary(module)["methods"])


def check_weights_for_recipe(pipe, recipe: MemoryRecipe) -> None:
    """Refuse (one line) a pipeline whose DiT is not stored in the format the recipe was measured with."""
    from ..quantizers import get_format

    wanted = {"fp8_or_w8a16": {"fp8", "w8a16"}}.get(recipe.spec.transformer_format, {recipe.spec.transformer_format})
    methods = {get_format(name).method for name in wanted}
    for name, component in partitions_of(pipe):
        found = _stored_formats(component)
        if not found & methods:
            raise MemoryBudgetError(
                f"memory recipe {recipe.name!r} needs the {name} in {' or '.join(sorted(wanted))} "
                f"(found {sorted(found) or 'dense weights'}): load with "
                "diffusers_h3.load_for_memory_budget(...) so the weights arrive in that form"
            )


def enable_memory_budget(
    pipe,
    gpu_gib: Optional[float] = None,
    host_gib: Optional[float] = None,
    *,
    device: Union[str, torch.device] = "cuda",
    recipe: Union[str, MemoryRecipe, None] = None,
    offload_folder: Union[str, os.PathLike, None] = None,
    cap_gpu: bool = True,
) -> MemoryRecipe:
    """Place a pipeline (on the CPU, loaded in the recipe's weight formats) with the fastest recipe that fits.

    Args:
        pipe: a `MiniMaxH3Pipeline` on the CPU.
        gpu_gib / host_gib: the budget in GiB (None: read the visible GPU / host memory).
        device: where computation runs.
        recipe: a recipe name or one from :func:`select_recipe`, instead of selecting one.
        offload_folder: where the ``low_ram`` recipe writes the text encoder's offload files (default: a new folder
            under the system's temporary directory; it must be on disk, not in a RAM-backed tmpfs).
        cap_gpu: hold the allocator to ``gpu_gib`` (:func:`apply_gpu_cap`) as in the measurement.

    Returns:
        The recipe applied; `describe(pipe)["placement"]` says where each component lives and streams from.
    """
    from .placement import _record_placement, drop_unused_text_encoder_layers

    recipe = resolve_recipe(recipe, gpu_gib, host_gib, device)
    check_weights_for_recipe(pipe, recipe)
    logger.info(recipe.line())
    if getattr(pipe, "text_encoder", None) is not None:
        drop_unused_text_encoder_layers(pipe)
    device = torch.device(device)
    if cap_gpu and gpu_gib is not None and device.type == "cuda":
        apply_gpu_cap(gpu_gib, device)
    place_for_recipe(pipe, recipe, device, offload_folder)
    _record_placement(pipe, memory_recipe=recipe.line())
    return recipe


def resolve_recipe(recipe, gpu_gib, host_gib, device) -> MemoryRecipe:
    """``recipe`` as a :class:`MemoryRecipe`: selected for the budget when None, looked up by name when a string."""
    if isinstance(recipe, MemoryRecipe):
        return recipe
    if recipe is None:
        return select_recipe(gpu_gib, host_gib, device=device)
    by_name = {r.name: r for r in load_recipe_table()}
    if recipe not in by_name:
        raise MemoryBudgetError(f"recipe={recipe!r}: choose one of {sorted(by_name)} (or None to select by budget)")
    return by_name[recipe]


def place_for_recipe(pipe, recipe: MemoryRecipe, device, offload_folder=None) -> Dict[str, str]:
    """Put each component where ``recipe`` says (the pipeline is on the CPU, or its text encoder already streamed)."""
    from .placement import _record_placement, enable_low_memory_offload

    device = torch.device(device)
    spec = recipe.spec
    if spec.transformer_placement == "resident":
        pipe.to(device)
        placements = {name: str(device) for name, c in pipe.components.items() if isinstance(c, torch.nn.Module)}
        _record_placement(pipe, **placements)
        return placements
    if spec.text_encoder_placement == "disk" and getattr(pipe, "text_encoder", None) is not None:
        if streams_from_disk(pipe.text_encoder) is None:
            stream_text_encoder_from_disk(pipe, device, offload_folder)
    return enable_low_memory_offload(pipe, device, low_cpu_mem_usage=True)


def stream_text_encoder_from_disk(pipe_or_text_encoder, device, offload_folder=None, checkpoint_folder=None) -> str:
    """Stream the text encoder's weights from disk leaf by leaf; host memory holds only the leaf in flight. Works on
    a pipeline or on the text encoder alone (so that it can be streamed before the DiT loads). Returns where the
    weights stream from.

    With ``checkpoint_folder`` (the text encoder was loaded from these safetensors files in the format they store,
    e.g. a pre-quantized checkpoint), each leaf reads its tensors straight from those files: nothing is written.
    Otherwise diffusers' group offload writes each leaf once to ``offload_folder`` (default: a new temporary folder)
    and reads it back when the leaf runs.
    """
    import tempfile

    from .placement import _offload_leaf_level, _record_placement

    text_encoder = getattr(pipe_or_text_encoder, "text_encoder", pipe_or_text_encoder)
    device = torch.device(device)
    if checkpoint_folder is not None:
        from .checkpoint_streaming import stream_from_checkpoint

        stream_from_checkpoint(text_encoder, checkpoint_folder, device)
        source = os.fspath(checkpoint_folder)
    else:
        if offload_folder is None:
            offload_folder = tempfile.mkdtemp(prefix="diffusers_h3_text_encoder_")
        else:
            offload_folder = os.fspath(offload_folder)
            os.makedirs(offload_folder, exist_ok=True)
            stale = [f for f in os.listdir(offload_folder) if f.endswith(".safetensors")]
            if stale:  # diffusers reuses files of the same name without checking their content
                raise MemoryBudgetError(f"offload_folder {offload_folder} already holds {len(stale)} offload files; "
                                        "pass an empty folder (files of another model would be read as this one's)")
        text_encoder.to("cpu")
        options = {"onload_device": device, "offload_device": torch.device("cpu"), "use_stream": device.type == "cuda",
                   "low_cpu_mem_usage": True, "offload_to_disk_path": offload_folder}  # fmt: skip
        _offload_leaf_level(text_encoder, options)
        source = offload_folder
    register_h3_hook(text_encoder, StreamFromDiskHook(StreamFromDiskRecord(source, checkpoint_folder is not None)),
                     H3_STREAM_FROM_DISK_HOOK)  # fmt: skip
    if text_encoder is not pipe_or_text_encoder:
        _record_placement(pipe_or_text_encoder, text_encoder=text_encoder_stream_placement(source, checkpoint_folder))
    return source


@dataclass
class StreamFromDiskRecord:
    """Where a text encoder's weights stream from (:func:`stream_text_encoder_from_disk`)."""

    source: str
    checkpoint_files: bool  # its own checkpoint files (nothing copied), else offload files written for it


class StreamFromDiskHook(H3Hook):
    """Holds the :class:`StreamFromDiskRecord` on the text encoder's top module (the leaves carry the hooks that
    stream); adds nothing to the forward."""


def streams_from_disk(text_encoder: torch.nn.Module) -> Optional[str]:
    """Where ``text_encoder``'s weights stream from, or ``None`` when they do not stream from disk."""
    record = h3_record(text_encoder, H3_STREAM_FROM_DISK_HOOK)
    return None if record is None else record.source


def text_encoder_stream_placement(source: str, checkpoint_folder=None) -> str:
    """How ``describe()`` names a text encoder that :func:`stream_text_encoder_from_disk` streams from ``source``."""
    if checkpoint_folder is not None:
        return f"streamed from its checkpoint files (leaf level, {source}; nothing copied)"
    return f"group offload to disk (leaf level, streamed from {source})"
