"""Memory recipes: which single-GPU placement recipe fits a GPU and host memory budget for a request, from measured
numbers.

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

:func:`select_recipe` picks the fastest recipe that fits (for a request's shape: the needs the memory model by rows
predicts, :mod:`diffusers_h3.parallel.memory_model`), :func:`enable_memory_budget` places an already loaded pipeline
(``diffusers_h3.pipelines.recipe_loading.load_for_memory_budget`` also loads it the way the recipe needs).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from diffusers.utils import logging

from .._hooks import H3_SINGLE_FILE_HOOK, H3_STREAM_FROM_DISK_HOOK, H3Hook, h3_record, partitions_of, register_h3_hook
from .._utils import config_from_call, gpu_model_name, with_device_index
from ..quantizers import is_quantized_linear
from .memory_model import (
    REQUEST_CAP_MARGIN,
    REQUEST_CAP_SLACK_GIB,
    MemoryModel,
    RequestShape,
    frames_of_seconds,
    largest_fitting,
    load_memory_model,
    packed_rows,
    request_cap_gib,
    time_scale,
)


logger = logging.get_logger(__name__)

GiB = 2**30
RECIPE_TABLE_PATH = Path(__file__).with_name("memory_recipes.json")
# What a budget read from the machine (``--memory auto``, ``gpu_gib=None`` / ``host_gib=None``) leaves to others.
# Host: the OS, a desktop and a browser hold 4-8 GiB of a PC's memory; the budget is at most the memory less this
# headroom (and never more than MemAvailable). GPU: PyTorch's allocator is not all a process holds there: the CUDA
# context grows as kernels load lazily and libraries keep handles outside the allocator (0.68-0.75 GiB outside it
# after a request on the H200, the context included: ``non_torch_gib`` in the placement results); the context
# already exists when the free memory is read, so the margin covers the rest.
HOST_HEADROOM_GIB = 4.0
GPU_MARGIN_GIB = 0.5
# A request predicted to take longer than this is pointed at a few-step LoRA (named below: the parallel layer does
# not import the loaders; a test checks the names against ``diffusers_h3.loaders.lora_presets``).
PRACTICAL_REQUEST_S = 600.0
FEW_STEP_LORA_PRESET = "lightx2v-fl2v-turbo-4step-768p"
FEW_STEP_LORA_FILE = "minimax_h3_fl2v_turbo_4step_v1.2_768p.safetensors"
FEW_STEP_LORA_REPO = "lightx2v/Minimax-h3-Turbo"
# The requests every table entry was measured with (benchmarks/placement.py): a t2va request and an fl2va request with
# the rank-64 Light4 LoRA, at 768x1344x124. Without a memory model, their needs bound only requests no larger.
MEASURED_SHAPES = (RequestShape(), RequestShape(task="fl2va", lora_rank=64))
# The longest clip the suggestions of a refusal look at (seconds).
LONGEST_PLANNED_S = 60.0


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
    """No recipe fits the budget, or the budget cannot be read (raised before anything is loaded). ``what`` is the
    problem and ``fix`` what to do, so that a command line can word the fix in its own options."""

    def __init__(self, what: str, fix: str = ""):
        super().__init__(f"{what}: {fix}" if fix else what)
        self.what, self.fix = what, fix


@dataclass(frozen=True)
class MemoryRecipe:
    """One measured entry of the recipe table: a recipe under the settings and GPU cap of one measured case, what it
    needed and how fast it ran. ``reason`` says why :func:`select_recipe` chose it (empty when named directly)."""

    spec: RecipeSpec
    gpu_gib: float
    host_gib: float
    request_s: float
    case: str
    measured: bool
    basis: str
    cap_gib: Optional[float] = None
    settings: Dict[str, Any] = dataclasses.field(default_factory=dict, hash=False, compare=False)
    reason: str = ""
    request: Optional[str] = None  # the request the needs are for (None: the measured requests)
    needs_basis: str = ""
    time_scale: float = 1.0  # the request's time over the measured request's (predicted from the forward's FLOPs)
    whole_device: bool = False  # gpu_gib counts the whole process's device memory (the memory model's), not the allocator
    budget: Optional["MemoryBudget"] = dataclasses.field(default=None, compare=False)  # what select_recipe compared
    # under a request-sized cap: the request's allocator cap and the card's predicted peak under it (memory model)
    request_cap: Optional[Tuple[float, float]] = dataclasses.field(default=None, compare=False)
    # the entry was measured under request-sized caps, so a placed pipeline uses them by default
    request_cap_measured: bool = dataclasses.field(default=False, compare=False)
    measured_on: str = "an H200"  # the GPU whose request time ``request_s`` is

    @property
    def name(self) -> str:
        return self.spec.name

    def for_request(self, shape: RequestShape, memory_model: Optional[MemoryModel]) -> Optional["MemoryRecipe"]:
        """This entry with its needs for ``shape``'s request: predicted by ``memory_model`` when it has this entry,
        else the measured needs when they bound the request (no larger than the measured ones); None when neither
        says."""
        modelled = memory_model is not None and memory_model.models(self.case, shape)
        request_cap = None
        request_cap_measured = memory_model is not None and measured_with_request_sized_caps(self, memory_model)
        if modelled:
            prediction = memory_model.predict(self.case, shape)
            gpu, host, basis = prediction.device_gib, prediction.host_gib, prediction.basis
            if prediction.request_cap_gib is not None and prediction.fits_cap:
                request_cap = (prediction.request_cap_gib, prediction.request_capped_device_gib)
            if not prediction.fits_cap:  # the allocator would run out under the entry's cap, whatever the card
                gpu = math.inf
                basis = (f"needs {prediction.allocated_gib:.2f} GiB of allocations, above the {prediction.cap_gib:g} "
                         f"GiB cap it was measured under ({basis})")  # fmt: skip
        elif memory_model is not None and memory_model.has(self.case):
            return None  # the model replaced this entry's measurements and was not fitted on a request like this one
        elif bounded_by_measured(shape):
            gpu, host = self.gpu_gib, self.host_gib
            basis = "the measured needs of the 768x1344x124 requests, which bound this request (no memory model yet)"
        else:
            return None
        scale = time_scale(shape, MEASURED_SHAPES[0])
        whole_device = modelled or self.whole_device
        return dataclasses.replace(self, gpu_gib=gpu, host_gib=host, request=shape.label(), needs_basis=basis,
                                   time_scale=scale, whole_device=whole_device, request_cap=request_cap,
                                   request_cap_measured=request_cap_measured)  # fmt: skip

    def line(self) -> str:
        """The one line that says which recipe runs and why: what it needs, the budget it was compared with and the
        time it takes."""
        if self.measured:
            cap = f" under a {self.cap_gib:g} GiB cap" if self.cap_gib is not None else ""
            measured = f"measured as {self.case}{cap}"
        else:
            measured = f"NOT measured ({self.basis})"
        settings = f", {', '.join(f'{k}={v}' for k, v in self.settings.items())}" if self.settings else ""
        approx = f"; approximate: {self.spec.approximate}" if self.spec.approximate else ""
        reason = f"; {self.reason}" if self.reason else ""
        if self.request is None:
            return (f"memory recipe {self.name!r} ({measured}{settings}): needs {self.gpu_gib:.2f} GiB GPU / "
                    f"{self.host_gib:.2f} GiB host, {self.request_s:.0f} s per 50-step t2va request on {self.measured_on}"
                    f"{reason}{approx}")  # fmt: skip
        time = f"{self.request_s:.0f} s per 50-step t2va request on {self.measured_on}"
        if self.time_scale > 1.0:
            time = (f"about {self.request_s * self.time_scale:.0f} s per 50-step request of this shape on "
                    f"{self.measured_on} "
                    f"(predicted: the measured 768x1344x124 request's {self.request_s:.0f} s x {self.time_scale:.2f}, "
                    "the ratio of the forwards' FLOPs)")  # fmt: skip
        return (f"memory recipe {self.name!r} ({measured}{settings}) for {self.request}: needs "
                f"{self.gpu_gib:.2f} GiB GPU / {self.host_gib:.2f} GiB host ({self.needs_basis}), {time}"
                f"{reason}{approx}")  # fmt: skip


# -- the table: derived from the measured JSON -----------------------------------------------------------------------


def case_forward_ms(case: Dict[str, Any]) -> float:
    """The milliseconds of one forward of a measured case: the median of the forwards it measured at its canvas (its
    t2va forward and, where it ran, the fl2va Light4 request's), so that one forward that read its weights from a cold
    page cache does not stand for all of a request's."""
    measured = [case["stages"]["forwards"] / case["forwards"]]
    measured += [float(ms) for request in _later_requests(case) for ms in request.get("forward_ms") or ()]
    return statistics.median(measured)


def _case_request_s(case: Dict[str, Any]) -> float:
    """Seconds of the full request: the timed one-forward request with a forward for every sigma step
    (:func:`case_forward_ms` each)."""
    forwards = case["sigma_points"] - 1
    return (case["ms"] - case["stages"]["forwards"] + forwards * case_forward_ms(case)) / 1000


# A case's fields for its t2va request alone: its case-level ones also span a shape sweep that ran after it.
_T2VA_FIELDS = {"device_peak_gib": "device_peak_t2va_gib", "host_peak_rss_gib": "host_peak_rss_t2va_gib"}


def _later_requests(case: Dict[str, Any]):
    """The records of the requests a case ran after its timed t2va one (the fl2va Light4 request), when they ran."""
    light4 = case.get("fl2va_light4")
    return [light4] if isinstance(light4, dict) and light4.get("peak_reserved_gib") is not None else []


def merged_placement_results(base: Dict[str, Any], newer: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """``base``'s placement result with the measured cases of each result in ``newer`` in place of those of the same
    name, each case keeping the device it was measured on (``case["device"]``)."""
    merged = {**base, "cases": dict(base.get("cases", {}))}
    for other in newer:
        for name, case in other.get("cases", {}).items():
            if case.get("ms") is not None:
                merged["cases"][name] = {**case, "device": other.get("device")}
    return merged


def derive_recipe_table(
    results: Dict[str, Any],
    source: str = "benchmarks/results/placement_h200.json",
    predictions: Optional[Dict[str, Any]] = None,
    predictions_source: str = "benchmarks/results/consumer_model.json",
):
    """The recipe table (the content of ``memory_recipes.json``) from a placement result file.

    One entry per passing case (a recipe measured under several caps or settings has several), in the order of
    :data:`RECIPES`, then by GPU need. GPU need: the peak reserved memory of the request (the allocator's cap bounds
    it). Host need: the peak RSS of the case's process; for cases whose process built their weights on the GPU
    instead of loading them (``host_includes_load`` false), at least the weights' size too, since a load goes through
    host memory (labelled in ``basis``). ``settings``: the case's recipe settings (e.g. activation chunking). Recipes
    with no passing case are left out.

    ``predictions`` (the consumer-GPU model's result, ``benchmarks/consumer_model.py``) adds the predicted request
    times of the table's cases per GPU (:func:`predicted_request_times`), labelled as predictions.
    """
    entries = []
    for case_name, case in sorted(results.get("cases", {}).items()):
        recipe = case.get("recipe_name") or _legacy_recipe_name(case_name)
        if recipe not in RECIPES or case.get("ms") is None or case.get("peak_reserved_gib") is None:
            continue
        # the case's own t2va request: its fields where the case has them (the case-level peaks also span a shape
        # sweep that ran after it), and the requests it ran after that one
        swept = any(shape.get("host_peak_reset") for shape in case.get("shapes") or ())
        own = {field: case[name] for field, name in _T2VA_FIELDS.items() if swept and case.get(name) is not None}
        requests = [{**case, **own}]
        requests += _later_requests(case)
        host = max(r["host_peak_rss_gib"] for r in requests if r.get("host_peak_rss_gib") is not None)
        basis = "host peak RSS of a fresh process, load included"
        if not case.get("host_includes_load", False):
            weights = sum(case.get("weights_gib", {}).values())
            host = max(host, weights)
            basis = ("host need: max(peak RSS of a process that built its weights on the GPU, the weights' size, "
                     "which a load moves through host memory)")  # fmt: skip
        # the GPU need: the largest peak of the case's requests (the fl2va Light4 request runs after the t2va one),
        # as the card counts it where the case measured that (the allocator's reserved peak otherwise)
        whole_device = all(r.get("device_peak_gib") is not None for r in requests)
        field = "device_peak_gib" if whole_device else "peak_reserved_gib"
        gpu = max(r[field] for r in requests)
        entry = {"recipe": recipe, "case": case_name, "cap_gib": case.get("cap_gib"),
                 "gpu_gib": round(gpu, 2), "host_gib": round(host, 2),
                 "request_s": round(_case_request_s(case), 1), "measured": True, "basis": basis,
                 "settings": dict(case.get("settings") or {})}  # fmt: skip
        if whole_device:
            entry.update(whole_device=True, device=case.get("device") or results.get("device"))
        entries.append(entry)
    order = list(RECIPES)
    entries.sort(key=lambda e: (order.index(e["recipe"]), e["gpu_gib"], e["host_gib"], e["case"]))
    table = {"source": source, "device": results.get("device"), "commit": results.get("commit"), "recipes": entries}
    if predictions is not None:
        table["predicted"] = predicted_request_times(predictions, predictions_source)
    return table


def predicted_request_times(predictions: Dict[str, Any], source: str) -> Dict[str, Any]:
    """The part of the consumer-GPU model's result the recipe table carries: per GPU (by its CUDA name), its compute
    capability and SM count, and per measured case that fits it, the predicted seconds of a 50-step t2va request and
    of a 4-step (LoRA) t2va request, at the model's slower NVMe rate."""
    nvme = min(predictions["nvme_gb_s"])
    gpus = {}
    for gpu in predictions["gpus"]:
        cases = {}
        for row in predictions["predictions"]:
            if row["gpu"] == gpu["name"] and row["nvme_gb_s"] == nvme and row["measured_memory"]:
                cases[row["case"]] = {"t2va_s": row["t2va_50_s"], "t2va_4step_s": row["t2va_4step_s"]}
        gpus[gpu["cuda_name"]] = {"name": gpu["name"], "capability": gpu["capability"], "sms": gpu["sms"],
                                  "memory_gib": gpu["memory_gib"], "cases": cases}  # fmt: skip
    return {"label": "predicted from the measured H200 forward, the GPUs' published specs and the bytes each recipe "
                     "moves; not measured on these GPUs", "source": source, "nvme_gb_s": nvme, "gpus": gpus}  # fmt: skip


def _legacy_recipe_name(case_name: str) -> str:
    # cases measured before the JSON named their recipe: "resident_80gb", "offload_24gb", ...
    return case_name.rsplit("_", 1)[0]


def load_recipe_table(path: Union[str, Path, None] = None) -> Tuple[MemoryRecipe, ...]:
    """The entries of the table at ``path`` (default: the packaged ``memory_recipes.json``), one per measured case."""
    data = json.loads(Path(path or RECIPE_TABLE_PATH).read_text())
    out = []
    for entry in data["recipes"]:
        out.append(MemoryRecipe(RECIPES[entry["recipe"]], gpu_gib=float(entry["gpu_gib"]),
                                host_gib=float(entry["host_gib"]), request_s=float(entry["request_s"]),
                                case=entry["case"], measured=bool(entry["measured"]), basis=entry["basis"],
                                cap_gib=entry.get("cap_gib"), settings=dict(entry.get("settings") or {}),
                                whole_device=bool(entry.get("whole_device", False)),
                                measured_on=_gpu_article(entry.get("device") or data.get("device"))))
    return tuple(out)  # fmt: skip


def _gpu_article(device: Optional[str]) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``an H100``: the GPU a table entry's time was measured on (the full name when it
    holds no model code)."""
    model = gpu_model_name(device)
    if model is None:
        return device or "an unnamed GPU"
    return f"{'an' if model[0] in 'AEFHILMNORSX' else 'a'} {model}"


def load_predictions(path: Union[str, Path, None] = None) -> Dict[str, Any]:
    """The predicted request times the table at ``path`` carries (empty when it carries none)."""
    return json.loads(Path(path or RECIPE_TABLE_PATH).read_text()).get("predicted") or {}


def predicted_seconds(recipe: MemoryRecipe, gpu_name: Optional[str], capability=None, sms: Optional[int] = None,
                      predictions: Optional[Dict[str, Any]] = None) -> Optional[Dict[str, Any]]:
    """The predicted times of ``recipe``'s case on the GPU ``gpu_name`` (``{"t2va_s", "t2va_4step_s", "basis"}``),
    or None. A GPU the model does not list is predicted from a listed one of the same compute capability, scaled by
    their SM counts (the model's GPUs of one architecture run at similar clocks)."""
    predictions = load_predictions() if predictions is None else predictions
    gpus = predictions.get("gpus") or {}
    if gpu_name in gpus and recipe.case in gpus[gpu_name]["cases"]:
        return {**gpus[gpu_name]["cases"][recipe.case], "basis": f"predicted for the {gpu_name}, not measured"}
    if capability is None or not sms:
        return None
    peers = [(name, g) for name, g in gpus.items()
             if tuple(g["capability"]) == tuple(capability) and recipe.case in g["cases"]]  # fmt: skip
    if not peers:
        return None
    name, peer = min(peers, key=lambda item: abs(item[1]["sms"] - sms))
    scale = peer["sms"] / sms
    times = {k: round(v * scale, 1) for k, v in peer["cases"][recipe.case].items()}
    return {**times, "basis": f"predicted from the {name}'s prediction scaled by SM count ({peer['sms']} vs {sms}), "
                              "not measured"}  # fmt: skip


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


@dataclass(frozen=True)
class MemoryBudget:
    """The GPU and host memory (GiB) a recipe may use, how each number was found, and the GPU they were read on."""

    gpu_gib: float
    host_gib: float
    gpu_basis: str = "given"
    host_basis: str = "given"
    gpu_name: Optional[str] = None
    gpu_capability: Optional[Tuple[int, int]] = None
    gpu_sms: Optional[int] = None
    # The margin taken off free memory for what a process holds outside PyTorch's allocator (read budgets only): a
    # whole-device need (the memory model's, the CUDA context included) is compared without it, since this process's
    # context is already missing from the free memory read.
    gpu_margin_gib: float = 0.0


def visible_host_gib(headroom_gib: float = HOST_HEADROOM_GIB) -> Tuple[float, str]:
    """Host memory this process may use, and how it was found: ``MemAvailable``, at most ``MemTotal`` less
    ``headroom_gib`` (left to the OS, a desktop, a browser), lowered by a cgroup v2 limit (psutil's figures where
    there is no /proc/meminfo)."""
    available, total = _meminfo_bytes("MemAvailable"), _meminfo_bytes("MemTotal")
    if available is None or total is None:
        try:
            import psutil

            memory = psutil.virtual_memory()
            available, total = memory.available, memory.total
        except ImportError:
            raise MemoryBudgetError("cannot read the host memory (no /proc/meminfo, no psutil)",
                                    "pass host_gib") from None  # fmt: skip
    budget = min(available, total - headroom_gib * GiB)
    basis = (f"the smaller of MemAvailable {available / GiB:.2f} GiB and MemTotal {total / GiB:.2f} GiB less "
             f"{headroom_gib:g} GiB headroom")  # fmt: skip
    limit = _cgroup_limit_bytes()
    if limit is not None and limit < budget:
        budget = limit
        basis += f", lowered to the {limit / GiB:.2f} GiB left under the cgroup's memory.max"
    return max(budget, 0) / GiB, basis


def visible_gpu(device: Union[str, torch.device, None] = None, margin_gib: float = GPU_MARGIN_GIB) -> MemoryBudget:
    """The GPU part of a budget read from the CUDA ``device``: its free memory (``torch.cuda.mem_get_info``) plus
    what PyTorch already holds there, less ``margin_gib``; with the GPU's name, capability and SM count."""
    if not torch.cuda.is_available():
        raise MemoryBudgetError("gpu_gib=None reads the free memory of a CUDA GPU, but no CUDA GPU is visible",
                                "pass gpu_gib and host_gib, or run on a GPU host")  # fmt: skip
    device = torch.device(device if device is not None else "cuda")
    free, _ = torch.cuda.mem_get_info(device)
    usable = free + torch.cuda.memory_reserved(device)
    properties = torch.cuda.get_device_properties(device)
    basis = f"{usable / GiB:.2f} GiB free on the {properties.name} less {margin_gib:g} GiB margin"
    return MemoryBudget(gpu_gib=max(usable / GiB - margin_gib, 0), host_gib=math.nan, gpu_basis=basis,
                        gpu_name=properties.name, gpu_capability=(properties.major, properties.minor),
                        gpu_sms=properties.multi_processor_count, gpu_margin_gib=margin_gib)  # fmt: skip


def read_budget(gpu_gib: Optional[float] = None, host_gib: Optional[float] = None, device=None) -> MemoryBudget:
    """The budget: the numbers given, the machine's (:func:`visible_gpu`, :func:`visible_host_gib`) where None. A
    CUDA GPU that is visible is named even with a given GPU budget (its predicted request times)."""
    for name, value in (("gpu_gib", gpu_gib), ("host_gib", host_gib)):
        if value is not None and not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
            raise MemoryBudgetError(f"{name}={value!r} is not a budget", "give a positive number of GiB, or None to "
                                    "read the machine's")  # fmt: skip
    on_cuda = device is None or torch.device(device).type == "cuda"
    if gpu_gib is None:
        budget = visible_gpu(device)
    elif on_cuda and torch.cuda.is_available():
        budget = dataclasses.replace(visible_gpu(device), gpu_gib=float(gpu_gib), gpu_basis="given", gpu_margin_gib=0.0)
    else:
        budget = MemoryBudget(gpu_gib=float(gpu_gib), host_gib=math.nan)
    if host_gib is None:
        host, basis = visible_host_gib()
        return dataclasses.replace(budget, host_gib=host, host_basis=basis)
    return dataclasses.replace(budget, host_gib=float(host_gib), host_basis="given")


def _few_step_hint(recipe: MemoryRecipe, budget: MemoryBudget, predictions=None) -> str:
    """The request time of ``recipe`` on the budget's GPU, and when it is over :data:`PRACTICAL_REQUEST_S`, the
    few-step LoRA that makes it practical."""
    predicted = predicted_seconds(recipe, budget.gpu_name, budget.gpu_capability, budget.gpu_sms, predictions)
    if predicted is not None:
        seconds, few_steps = predicted["t2va_s"], predicted["t2va_4step_s"]
        said = f"{seconds / 60:.0f} min per 50-step t2va ({predicted['basis']})"
    else:
        seconds, few_steps = recipe.request_s, None
        said = ""
    if seconds <= PRACTICAL_REQUEST_S:
        return f"; {said}" if said else ""
    lora = (f"the LightX2V 4-step LoRA ({FEW_STEP_LORA_FILE} from {FEW_STEP_LORA_REPO}, preset "
            f"{FEW_STEP_LORA_PRESET!r}) runs 4 forwards instead of 49")  # fmt: skip
    lora += f", about {few_steps / 60:.1f} min" if few_steps is not None else ""
    return f"; {said or f'{seconds / 60:.0f} min per 50-step t2va'}: over {PRACTICAL_REQUEST_S / 60:.0f} min, {lora}"


def check_request_fits(recipe: MemoryRecipe, shape: RequestShape, memory_model: Optional[MemoryModel] = None) -> None:
    """Refuse (one :class:`MemoryBudgetError` line) a request that the recipe a pipeline was placed with does not fit
    in the budget it was chosen for, as the memory model predicts; a request neither modelled nor bounded by the
    measurements is logged once and left to run. Nothing is checked for a recipe named directly (no budget)."""
    if recipe.budget is None:
        return
    memory_model = load_memory_model() if memory_model is None else memory_model
    needs = recipe.for_request(shape, memory_model)
    if needs is None:
        key = (recipe.case, shape)
        if key not in _UNMODELLED_WARNED:
            _UNMODELLED_WARNED.add(key)
            logger.warning(f"memory recipe {recipe.name!r} ({recipe.case}) is neither modelled nor measured for "
                           f"{shape.label()}: running it unchecked (docs/memory.md)")  # fmt: skip
        return
    if _fits(needs, recipe.budget):
        return
    suggestion = _suggestion((recipe,), recipe.budget, shape, memory_model)
    raise MemoryBudgetError(
        f"{shape.label()} needs {needs.gpu_gib:.2f} GiB GPU / {needs.host_gib:.2f} GiB host under memory recipe "
        f"{recipe.name!r} ({recipe.case}, {needs.needs_basis}), more than the {recipe.budget.gpu_gib:.2f} GiB GPU / "
        f"{recipe.budget.host_gib:.2f} GiB host it was placed for; with it {suggestion}",
        "shorten the clip or lower the resolution, or load for this request's shape "
        "(load_for_memory_budget(..., shape=RequestShape(...)))",
    )


_UNMODELLED_WARNED = set()


def bounded_by_measured(shape: RequestShape) -> bool:
    """Whether the measured requests (:data:`MEASURED_SHAPES`) bound ``shape``'s needs: no more packed rows, canvas
    pixels or LoRA rank than the largest of them."""
    rows = max(packed_rows(m)["total"] for m in MEASURED_SHAPES)
    pixels = max(m.height * m.width for m in MEASURED_SHAPES)
    rank = max(m.lora_rank for m in MEASURED_SHAPES)
    return packed_rows(shape)["total"] <= rows and shape.height * shape.width <= pixels and shape.lora_rank <= rank


def _fits(recipe: Optional[MemoryRecipe], budget: MemoryBudget) -> bool:
    if recipe is None:
        return False
    gpu = budget.gpu_gib + (budget.gpu_margin_gib if recipe.whole_device else 0.0)
    return recipe.gpu_gib <= gpu and recipe.host_gib <= budget.host_gib


def _canvas(shape: RequestShape, short_edge: int) -> Tuple[int, int]:
    """``(height, width)`` of ``shape``'s aspect at ``short_edge``, on the 32-pixel canvas multiple."""
    long_edge = max(32, round(short_edge * max(shape.height, shape.width) / min(shape.height, shape.width) / 32) * 32)
    return (short_edge, long_edge) if shape.height <= shape.width else (long_edge, short_edge)


def largest_requests_that_fit(table, budget: MemoryBudget, shape: RequestShape,
                              memory_model: Optional[MemoryModel]) -> Tuple[Optional[int], Optional[Tuple[int, int]]]:
    """The most frames at ``shape``'s canvas, and the largest canvas of its aspect at its frame count, that some
    entry of ``table`` fits in ``budget`` (None where even the smallest does not: one VAE chunk, a 256-pixel short
    edge)."""

    def fits(candidate: RequestShape) -> bool:
        return any(_fits(r.for_request(candidate, memory_model), budget) for r in table)

    longest = frames_of_seconds(LONGEST_PLANNED_S)
    frames = largest_fitting(lambda f: fits(dataclasses.replace(shape, num_frames=f)), 22, longest, 17)
    short = min(shape.height, shape.width)
    edge = largest_fitting(lambda e: fits(dataclasses.replace(shape, **dict(zip(("height", "width"), _canvas(shape, e))))),
                           256, max(256, short), 32)  # fmt: skip
    return frames, None if edge is None else _canvas(shape, edge)


def _suggestion(table, budget, shape, memory_model) -> str:
    frames, canvas = largest_requests_that_fit(table, budget, shape, memory_model)
    at_canvas = (f"at {shape.height}x{shape.width} up to {frames} frames ({frames / 24:.1f} s) fit" if frames else
                 f"at {shape.height}x{shape.width} not even one VAE chunk (22 frames) fits")  # fmt: skip
    at_length = (f"at {shape.num_frames} frames up to {canvas[0]}x{canvas[1]}" if canvas else
                 f"at {shape.num_frames} frames no canvas from a 256-pixel short edge up")  # fmt: skip
    return f"{at_canvas}, {at_length}"


def select_recipe(
    gpu_gib: Optional[float] = None,
    host_gib: Optional[float] = None,
    *,
    device: Union[str, torch.device, None] = None,
    table: Optional[Tuple[MemoryRecipe, ...]] = None,
    predictions: Optional[Dict[str, Any]] = None,
    shape: Optional[RequestShape] = None,
    memory_model: Optional[MemoryModel] = None,
) -> MemoryRecipe:
    """The fastest measured entry of the recipe table whose needs fit ``gpu_gib`` of GPU memory and ``host_gib`` of
    host memory (ties: the one that needs the least GPU, then host memory). None reads the machine: the visible GPU's
    free memory less :data:`GPU_MARGIN_GIB`, the host's available memory less :data:`HOST_HEADROOM_GIB`. The
    recipe's ``reason`` (in its ``line()``) gives the numbers compared and, when its request is predicted to take
    more than :data:`PRACTICAL_REQUEST_S` on this GPU, names the few-step LoRA.

    With ``shape`` (a :class:`~diffusers_h3.parallel.memory_model.RequestShape`), each entry's needs are those of
    that request (:meth:`MemoryRecipe.for_request`: the memory model, default the packaged one; an entry the model
    does not cover counts only for requests its measurements bound). Raises :class:`MemoryBudgetError` (one line)
    when none fits; for a shape, the line names the longest clip at its canvas and the largest canvas at its length
    that fit."""
    budget = read_budget(gpu_gib, host_gib, device)
    table = load_recipe_table() if table is None else table
    gpu_said = f"{budget.gpu_gib:.2f} GiB of GPU memory" + ("" if budget.gpu_basis == "given" else
                                                            f" ({budget.gpu_basis})")  # fmt: skip
    host_said = f"{budget.host_gib:.2f} GiB of host memory" + ("" if budget.host_basis == "given" else
                                                               f" ({budget.host_basis})")  # fmt: skip
    unknown = []
    if shape is not None:
        memory_model = load_memory_model() if memory_model is None else memory_model
        for_shape = [(r, r.for_request(shape, memory_model)) for r in table]
        unknown = [r.case for r, needs in for_shape if needs is None]
        candidates = [needs for _, needs in for_shape if needs is not None]
    else:
        candidates = list(table)
    beyond_cap = [r for r in candidates if math.isinf(r.gpu_gib)]
    candidates = [r for r in candidates if not math.isinf(r.gpu_gib)]
    fitting = [r for r in candidates if _fits(r, budget)]
    if not fitting:
        request = f" {shape.label()}" if shape is not None else ""
        if not candidates and beyond_cap:
            suggestion = _suggestion(table, budget, shape, memory_model)
            raise MemoryBudgetError(
                f"no memory recipe holds{request}: " + "; ".join(f"{r.case} {r.needs_basis}" for r in beyond_cap)
                + (f"; {', '.join(unknown)} not modelled for this request" if unknown else "")
                + f"; on this machine {suggestion}",
                "shorten the clip or lower the resolution, or use a larger GPU (docs/memory.md)",
            )
        if not candidates:
            raise MemoryBudgetError(
                f"no memory recipe is measured or modelled for{request}: the table's entries were measured at "
                "768x1344x124 and the memory model covers none of them for larger requests",
                "make the request no larger than the measured ones (a shorter clip, a smaller canvas, fewer "
                "references), or fit the memory model (docs/memory.md)",
            )
        least_gpu = min(candidates, key=lambda r: (r.gpu_gib, r.host_gib))
        least_host = min(candidates, key=lambda r: (r.host_gib, r.gpu_gib))
        what = (f"no memory recipe fits{request} in {gpu_said} and {host_said}: the smallest GPU need is "
                f"{least_gpu.gpu_gib:.2f} GiB ({least_gpu.name!r} as {least_gpu.case}, with {least_gpu.host_gib:.2f} GiB "
                f"host), the smallest host need {least_host.host_gib:.2f} GiB ({least_host.name!r} as "
                f"{least_host.case})")  # fmt: skip
        if unknown:
            what += f"; {', '.join(unknown)} not modelled for this request"
        if shape is None:
            raise MemoryBudgetError(what, "free memory, or use several GPUs (docs/memory.md)")
        suggestion = _suggestion(table, budget, shape, memory_model)
        raise MemoryBudgetError(f"{what}; on this machine {suggestion}",
                                "shorten the clip or lower the resolution, free memory, or use several GPUs "
                                "(docs/memory.md)")  # fmt: skip
    best = min(fitting, key=lambda r: (r.request_s, r.gpu_gib, r.host_gib))
    which = "the only table entry that fits" if len(fitting) == 1 else f"the fastest of {len(fitting)} that fit"
    reason = f"chosen for {gpu_said} and {host_said}: {which}" + _few_step_hint(best, budget, predictions)
    if best.whole_device and budget.gpu_margin_gib:
        reason += (f"; its device need counts the CUDA context, which the free memory already lacks: compared "
                   f"without the {budget.gpu_margin_gib:g} GiB margin")  # fmt: skip
    return dataclasses.replace(best, reason=reason, budget=budget)


# -- planning a request on a machine, named or this one ------------------------------------------------------------


def usable_card_gib(card_gb: float) -> float:
    """What an ``card_gb`` GB card leaves one process: its memory less what the driver and a desktop hold, 0.7 GiB or
    1/16 of the card, whichever is more (8 GB: 7.3 GiB, 12 GB: 11.25, 24 GB: 22.5, 80 GB: 75)."""
    return round(card_gb - max(0.7, card_gb / 16), 2)


def _gpu_key(name: str) -> str:
    key = re.sub(r"[^a-z0-9]", "", name.lower().replace("nvidia", "").replace("geforce", ""))
    return re.sub(r"\d+gb$", "", key)


def named_gpu_budget(gpu: str, predictions: Optional[Dict[str, Any]] = None) -> MemoryBudget:
    """The GPU part of a budget for a card named by its memory (``"8"``: an 8 GB card) or by a name the consumer-GPU
    model lists (``"RTX 4070"``, ``"NVIDIA GeForce RTX 4070"``): :func:`usable_card_gib` of its memory."""
    try:
        card_gb = float(gpu)
    except ValueError:
        card_gb = None
    if card_gb is not None:
        if not (card_gb > 0 and math.isfinite(card_gb)):
            raise MemoryBudgetError(f"gpu={gpu!r} is not a card size", "give the card's memory in GB, e.g. 8")
        usable = usable_card_gib(card_gb)
        return MemoryBudget(gpu_gib=usable, host_gib=math.nan,
                            gpu_basis=f"a {card_gb:g} GB card: {usable:.2f} GiB usable")  # fmt: skip
    gpus = (load_predictions() if predictions is None else predictions).get("gpus") or {}
    for cuda_name, entry in gpus.items():
        if _gpu_key(gpu) in (_gpu_key(cuda_name), _gpu_key(entry.get("name", cuda_name))):
            usable = usable_card_gib(entry["memory_gib"])
            return MemoryBudget(gpu_gib=usable, host_gib=math.nan, gpu_name=cuda_name,
                                gpu_capability=tuple(entry["capability"]), gpu_sms=entry["sms"],
                                gpu_basis=f"the {cuda_name}, a {entry['memory_gib']:g} GB card: {usable:.2f} GiB "
                                          "usable")  # fmt: skip
    known = ", ".join(entry.get("name", name) for name, entry in gpus.items())
    raise MemoryBudgetError(f"gpu={gpu!r} is not a card size nor a GPU the consumer-GPU model lists ({known})",
                            "give the card's memory in GB, e.g. 8, or one of those names")  # fmt: skip


@dataclass(frozen=True)
class RequestPlan:
    """What a request would run as on a machine: the recipe entry (with its needs for the request), the budget it was
    compared with, and the predicted request times."""

    recipe: MemoryRecipe
    budget: MemoryBudget
    shape: RequestShape
    seconds: float
    few_step_seconds: Optional[float]
    time_basis: str

    def lines(self) -> List[str]:
        rows = packed_rows(self.shape)
        parts = ", ".join(f"{kind} {count:,}" for kind, count in rows.items() if kind != "total" and count)
        settings = ", ".join(f"{k}={v}" for k, v in self.recipe.settings.items()) or "its defaults"
        held = recipe_gpu_cap(self.recipe, self.budget.gpu_gib)
        cap = ("" if self.recipe.cap_gib is None else f", GPU cap {self.recipe.cap_gib:g} GiB" if held == self.recipe.cap_gib
               else f", GPU cap {held:g} GiB: the entry's {self.recipe.cap_gib:g}, no higher than this machine's")  # fmt: skip
        few = (f"; {FEW_STEP_LORA_PRESET} (4 forwards) about {_minutes(self.few_step_seconds)}"
               if self.few_step_seconds is not None else "")  # fmt: skip
        return [
            f"request: {self.shape.label()}: {rows['total']:,} packed rows ({parts})",
            f"machine: {self.budget.gpu_gib:.2f} GiB of GPU memory ({self.budget.gpu_basis}), "
            f"{self.budget.host_gib:.2f} GiB of host memory ({self.budget.host_basis})",
            f"recipe: {self.recipe.name!r} as {self.recipe.case} ({settings}{cap})",
            (f"peaks (predicted): {self.recipe.gpu_gib:.2f} GiB device, {self.recipe.host_gib:.2f} GiB host "
             f"({self.recipe.needs_basis})" if self.recipe.whole_device else
             f"needs (measured): {self.recipe.gpu_gib:.2f} GiB GPU (the allocator's peak, without the CUDA context), "
             f"{self.recipe.host_gib:.2f} GiB host ({self.recipe.needs_basis})"),
            f"time: 50 steps about {_minutes(self.seconds)}{few} ({self.time_basis})",
        ] + self._request_cap_lines()

    def _request_cap_lines(self) -> List[str]:
        cap = self.recipe.request_cap
        if cap is None:
            return []
        if self.recipe.request_cap_measured:  # the entry runs under request-sized caps by default
            return [f"allocator: capped at {cap[0]:.2f} GiB for this request, as the entry was measured "
                    f"(--no-request-sized-cap: its whole {self.recipe.cap_gib:g} GiB cap)"]  # fmt: skip
        return [f"with --request-sized-cap: allocator capped at {cap[0]:.2f} GiB for this request, device peak about "
                f"{cap[1]:.2f} GiB (predicted; this entry was measured under its whole cap)"]  # fmt: skip


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def plan_request(
    shape: RequestShape,
    gpu_gib: Optional[float] = None,
    host_gib: Optional[float] = None,
    *,
    gpu: Optional[str] = None,
    device: Union[str, torch.device, None] = None,
    table: Optional[Tuple[MemoryRecipe, ...]] = None,
    memory_model: Optional[MemoryModel] = None,
    predictions: Optional[Dict[str, Any]] = None,
) -> RequestPlan:
    """The recipe ``shape``'s request runs as on a machine (``gpu``: a card named as :func:`named_gpu_budget` takes
    it; else ``gpu_gib`` / ``host_gib``, None reading this machine), its predicted peaks and times. Raises
    :class:`MemoryBudgetError` (the one line of :func:`select_recipe`) when nothing fits."""
    predictions = load_predictions() if predictions is None else predictions
    if gpu is not None:
        named = named_gpu_budget(gpu, predictions)
        if host_gib is None:
            host_gib_read, host_basis = visible_host_gib()
        else:
            host_gib_read, host_basis = float(host_gib), "given"
        budget = dataclasses.replace(named, host_gib=host_gib_read, host_basis=host_basis)
    else:
        budget = read_budget(gpu_gib, host_gib, device)
    chosen = select_recipe(budget.gpu_gib, budget.host_gib, device="cpu", table=table, predictions=predictions,
                           shape=shape, memory_model=memory_model)  # fmt: skip
    predicted = predicted_seconds(chosen, budget.gpu_name, budget.gpu_capability, budget.gpu_sms, predictions)
    scale = chosen.time_scale
    scaled = f" x {scale:.2f} (the forwards' FLOPs over the measured 768x1344x124 request's)" if scale > 1.0 else ""
    if predicted is not None:
        seconds, few, basis = predicted["t2va_s"] * scale, predicted["t2va_4step_s"] * scale, predicted["basis"]
    else:
        seconds, few = chosen.request_s * scale, None
        basis = (f"the {chosen.case} request measured on {chosen.measured_on}, not this card: name a card the "
                 "consumer-GPU model lists for its predicted time")  # fmt: skip
    return RequestPlan(recipe=chosen, budget=budget, shape=shape, seconds=seconds, few_step_seconds=few,
                       time_basis=basis + scaled)  # fmt: skip


def recipe_gpu_cap(recipe: "MemoryRecipe", gpu_gib: Optional[float]) -> Optional[float]:
    """The allocator cap a placed recipe runs under: the cap its table entry was measured under (its figures, the
    card-counted peak included, hold under that cap and not under a looser one: the caching allocator keeps freed
    blocks up to whatever cap it is given), no higher than the budget ``gpu_gib``; the budget alone for an entry
    measured without a cap; None when neither is known."""
    caps = [c for c in (getattr(recipe, "cap_gib", None), gpu_gib) if c is not None]
    return min(caps) if caps else None


def hold_allocator_for_recipe(recipe: "MemoryRecipe", gpu_gib: Optional[float],
                              device: Union[str, torch.device]) -> Optional[str]:
    """Run the caching allocator on a CUDA ``device`` as the recipe's figures were measured: expandable segments
    (:func:`use_recipe_allocator_settings`) and :func:`apply_gpu_cap` with :func:`recipe_gpu_cap`. Returns the line
    ``describe(pipe)["placement"]["allocator"]`` shows, or None off CUDA."""
    if torch.device(device).type != "cuda":
        return None
    return hold_allocator(recipe_gpu_cap(recipe, gpu_gib), device)


def hold_allocator(cap_gib: Optional[float], device: Union[str, torch.device]) -> str:
    """On a CUDA ``device``: expandable segments (:func:`use_recipe_allocator_settings`) and the allocator held to
    ``cap_gib`` (:func:`apply_gpu_cap`; None: no cap); returns the line that says so."""
    settings = use_recipe_allocator_settings()
    if cap_gib is None or apply_gpu_cap(cap_gib, device) is None:
        return f"{settings}; no cap (the whole card)"
    return f"{settings}; capped at {cap_gib:g} GiB (set_per_process_memory_fraction)"


# The allocator setting the recipes' figures are measured with: segments that grow in place, so freed memory serves
# later requests of any size. With fixed-size segments, blocks split by one stage cannot serve a larger request of the
# next, and under a cap that is an out-of-memory error well below the cap.
RECIPE_ALLOCATOR_SETTINGS = "expandable_segments:True"
ALLOCATOR_ENVIRONMENT = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def use_recipe_allocator_settings() -> str:
    """Turn on the allocator's expandable segments (:data:`RECIPE_ALLOCATOR_SETTINGS`) unless the environment's
    allocator configuration already names them (the user's choice stands); returns what the allocator runs with.
    Segments allocated before keep their kind, so this runs before a recipe loads anything on the GPU."""
    for name in ALLOCATOR_ENVIRONMENT:
        configured = os.environ.get(name, "")
        if "expandable_segments" in configured:
            return f"allocator settings from {name}={configured!r} (not changed)"
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch < 2.9 names it in torch.cuda.memory
        setter = torch.cuda.memory._set_allocator_settings
    setter(RECIPE_ALLOCATOR_SETTINGS)
    return "expandable segments (the allocator setting the recipe was measured with)"


def apply_gpu_cap(gpu_gib: float, device: Union[str, torch.device] = "cuda") -> Optional[float]:
    """Hold PyTorch's caching allocator to ``gpu_gib`` on ``device`` (the condition the recipes were measured under);
    returns the fraction set, None when the budget is the whole device or more."""
    return set_allocator_cap(gpu_gib, device) if gpu_gib * GiB < _total_memory(device) else None


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
        if h3_record(component, H3_SINGLE_FILE_HOOK) is not None:
            continue  # a DiT from one file runs in the file's format (load_for_memory_budget's transformer_file)
        found = _stored_formats(component)
        if not found & methods:
            raise MemoryBudgetError(
                f"memory recipe {recipe.name!r} needs the {name} in {' or '.join(sorted(wanted))} "
                f"(found {sorted(found) or 'dense weights'}): load with "
                "diffusers_h3.load_for_memory_budget(...) so the weights arrive in that form"
            )


@dataclass(frozen=True)
class MemoryBudgetConfig:
    """The budget and options of :func:`enable_memory_budget`.

    Args:
        gpu_gib / host_gib (`float`, *optional*): the budget in GiB (None: read the visible GPU / host memory).
        device (`str` or `torch.device`, defaults to `"cuda"`): where computation runs.
        recipe (`str` or `MemoryRecipe`, *optional*): a recipe name or one from :func:`select_recipe`, instead of
            selecting one.
        offload_folder (`str`, *optional*): where the ``low_ram`` recipe writes the text encoder's offload files
            (default: a new folder under the system's temporary directory; it must be on disk, not in a RAM-backed
            tmpfs).
        cap_gpu (`bool`, defaults to `True`): run the allocator as the chosen recipe entry was measured: expandable
            segments, held to the entry's cap, no higher than ``gpu_gib`` (:func:`hold_allocator_for_recipe`).
        request_sized_cap (`bool`, *optional*): before each call, hold the allocator to that request's predicted
            allocations plus headroom instead (:func:`apply_request_sized_cap`), no higher than the cap above: a
            short or small clip then leaves the rest of the card free, and the card's peak is what the memory model
            predicts. None (the default): as the recipe entry was measured (:func:`measured_with_request_sized_caps`;
            the 12 GB entry was, docs/memory.md).
    """

    gpu_gib: Optional[float] = None
    host_gib: Optional[float] = None
    device: Union[str, torch.device] = "cuda"
    recipe: Union[str, "MemoryRecipe", None] = None
    offload_folder: Union[str, os.PathLike, None] = None
    cap_gpu: bool = True
    request_sized_cap: Optional[bool] = None


@dataclass(frozen=True)
class RequestSizedCap:
    """What a pipeline placed with ``request_sized_cap=True`` keeps: the device whose allocator each call caps, and
    the cap no request may exceed (the recipe's, :func:`recipe_gpu_cap`)."""

    device: torch.device
    ceiling_gib: Optional[float]


def measured_with_request_sized_caps(recipe: "MemoryRecipe", memory_model: Optional[MemoryModel] = None) -> bool:
    """Whether the memory model's entry for ``recipe`` was fitted on requests that ran under request-sized caps: its
    predicted device peaks hold under them, so a placed pipeline runs that way unless told otherwise."""
    memory_model = load_memory_model() if memory_model is None else memory_model
    return bool(memory_model is not None and memory_model.cases.get(recipe.case, {}).get("request_sized_cap"))


def keep_request_sized_cap(pipe, recipe: "MemoryRecipe", gpu_gib: Optional[float], device) -> None:
    """Make each later call of ``pipe`` hold the allocator to its request's size (CUDA only)."""
    device = torch.device(device)
    if device.type == "cuda":
        from .placement import _record_placement

        ceiling = recipe_gpu_cap(recipe, gpu_gib)
        pipe._h3_request_sized_cap = RequestSizedCap(with_device_index(device), ceiling)
        # until the first call sets its own line: what each call will be held to
        _record_placement(pipe, request_cap=(
            f"each call held to its request's predicted allocations + {REQUEST_CAP_MARGIN:.0%} + "
            f"{REQUEST_CAP_SLACK_GIB:g} GiB, no higher than {'the card' if ceiling is None else f'{ceiling:g} GiB'}"))


def apply_request_sized_cap(pipe, recipe: "MemoryRecipe", shape: RequestShape,
                            memory_model: Optional[MemoryModel] = None) -> Optional[str]:
    """For a pipeline placed with ``request_sized_cap=True``: hold the allocator to ``shape``'s predicted allocations
    plus headroom (:func:`~diffusers_h3.parallel.memory_model.request_cap_gib`), no higher than the recipe's cap, or to
    the recipe's cap when the model does not predict this request; cached blocks above the new cap go back to the card
    first. Recorded as ``describe(pipe)["placement"]["request_cap"]``; returns that line (None when not enabled)."""
    state = getattr(pipe, "_h3_request_sized_cap", None)
    if state is None:
        return None
    from .placement import _record_placement

    memory_model = load_memory_model() if memory_model is None else memory_model
    prediction = None
    if memory_model is not None and memory_model.models(recipe.case, shape):
        prediction = memory_model.predict(recipe.case, shape)
    if prediction is None or prediction.allocated_gib is None:
        cap = state.ceiling_gib
        line = (f"{shape.label()}: not predicted by the memory model, the recipe's cap "
                f"({'none' if cap is None else f'{cap:g} GiB'})")  # fmt: skip
    else:
        cap = request_cap_gib(prediction.allocated_gib, state.ceiling_gib)
        line = (f"capped at {cap:.2f} GiB for {shape.label()}: predicted allocations {prediction.allocated_gib:.2f} "
                f"GiB + {REQUEST_CAP_MARGIN:.0%} + {REQUEST_CAP_SLACK_GIB:g} GiB")  # fmt: skip
    torch.cuda.empty_cache()
    set_allocator_cap(cap, state.device)  # always set: a smaller cap of an earlier call must not stay
    _record_placement(pipe, request_cap=line)
    return line


def set_allocator_cap(gpu_gib: Optional[float], device: Union[str, torch.device]) -> float:
    """Hold the caching allocator on ``device`` to ``gpu_gib`` (None, or more than the card: the whole card), replacing
    whatever cap it had; returns the fraction set."""
    device = with_device_index(device)  # the allocator's cap needs the index
    fraction = 1.0 if gpu_gib is None else min(1.0, gpu_gib * GiB / _total_memory(device))
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def _total_memory(device: Union[str, torch.device]) -> int:
    return torch.cuda.get_device_properties(with_device_index(device)).total_memory


def enable_memory_budget(pipe, config: Optional[MemoryBudgetConfig] = None, *args, **legacy) -> MemoryRecipe:
    """Place a pipeline (on the CPU, loaded in the recipe's weight formats) with the fastest recipe that fits
    ``config`` (a :class:`MemoryBudgetConfig`; default: the visible GPU's and host's memory). The budget and options
    as separate arguments still work for one release, with a ``FutureWarning``.

    Returns:
        The recipe applied; `describe(pipe)["placement"]` says where each component lives and streams from.
    """
    config = config_from_call(MemoryBudgetConfig, config, legacy, call="enable_memory_budget",
                              legacy_positional=("gpu_gib", "host_gib"), legacy_args=args)  # fmt: skip
    gpu_gib, host_gib, device, recipe = config.gpu_gib, config.host_gib, config.device, config.recipe
    from .placement import _record_placement, drop_unused_text_encoder_layers

    recipe = resolve_recipe(recipe, gpu_gib, host_gib, device)
    check_weights_for_recipe(pipe, recipe)
    logger.info(recipe.line())
    if getattr(pipe, "text_encoder", None) is not None:
        drop_unused_text_encoder_layers(pipe)
    device = torch.device(device)
    allocator = hold_allocator_for_recipe(recipe, gpu_gib, device) if config.cap_gpu else None
    place_for_recipe(pipe, recipe, device, config.offload_folder)
    _record_placement(pipe, memory_recipe=recipe.line(), **({"allocator": allocator} if allocator else {}))
    pipe._h3_memory_recipe = recipe  # each call's request is checked against it (check_request_fits)
    request_sized = config.request_sized_cap
    if request_sized is None:
        request_sized = measured_with_request_sized_caps(recipe)
    if request_sized:
        keep_request_sized_cap(pipe, recipe, gpu_gib, device)
    return recipe


def resolve_recipe(recipe, gpu_gib, host_gib, device, shape: Optional[RequestShape] = None) -> MemoryRecipe:
    """``recipe`` as a :class:`MemoryRecipe`: selected for the budget (and ``shape``'s request) when None; when a
    string, the table entry of that measured case, or of that recipe: the fastest of its entries that fits the budget
    given, else (no budget given, or none fits) the one that needs the least GPU memory. An entry named directly is
    not refused for the request's shape: its line says what the request is predicted to need, where known."""
    if device is not None and torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise MemoryBudgetError(f"device={str(device)!r}, but no CUDA GPU is visible",
                                "run on a GPU host (the recipes place the model on a CUDA GPU)")  # fmt: skip
    if isinstance(recipe, MemoryRecipe):
        return recipe
    if recipe is None:
        return select_recipe(gpu_gib, host_gib, device=device, shape=shape)
    table = load_recipe_table()
    by_case = {r.case: r for r in table}
    if recipe in by_case:
        return _with_request(by_case[recipe], shape)
    entries = [r for r in table if r.name == recipe]
    if not entries:
        names = sorted({r.name for r in table})
        raise MemoryBudgetError(f"recipe={recipe!r} is not in the recipe table",
                                f"choose one of {names} or a measured case {sorted(by_case)}, or None to select by "
                                "budget")  # fmt: skip
    if gpu_gib is not None and host_gib is not None:
        try:
            return select_recipe(gpu_gib, host_gib, device=device, table=tuple(entries), shape=shape)
        except MemoryBudgetError:
            pass
    return _with_request(min(entries, key=lambda r: (r.gpu_gib, r.host_gib)), shape)


def _with_request(recipe: MemoryRecipe, shape: Optional[RequestShape]) -> MemoryRecipe:
    """A directly named entry with its needs for ``shape``'s request where they are known (else as measured, said)."""
    if shape is None:
        return recipe
    known = recipe.for_request(shape, load_memory_model())
    if known is not None:
        return known
    return dataclasses.replace(recipe, reason=f"named directly; its needs for {shape.label()} are neither measured nor "
                                              "modelled")  # fmt: skip


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
        source = offload_folder
        if any(is_quantized_linear(m) for m in text_encoder.modules()):
            # diffusers' disk offload writes plain tensors only: the quantized weights are written once in their
            # packed checkpoint layout and streamed from those files like a pre-quantized checkpoint
            from .checkpoint_streaming import stream_from_checkpoint

            text_encoder.save_pretrained(offload_folder)
            stream_from_checkpoint(text_encoder, offload_folder, device)
        else:
            options = {"onload_device": device, "offload_device": torch.device("cpu"), "low_cpu_mem_usage": True,
                       "use_stream": device.type == "cuda", "offload_to_disk_path": offload_folder}  # fmt: skip
            _offload_leaf_level(text_encoder, options)
    register_h3_hook(text_encoder, StreamFromDiskHook(StreamFromDiskRecord(source, checkpoint_folder is not None)),
                     H3_STREAM_FROM_DISK_HOOK)  # fmt: skip
    if text_encoder is not pipe_or_text_encoder:
        _record_placement(pipe_or_text_encoder,
                          text_encoder=text_encoder_stream_placement(source, checkpoint_folder, text_encoder))
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


def text_encoder_stream_placement(source: str, checkpoint_folder=None, text_encoder=None) -> str:
    """How ``describe()`` names a text encoder that :func:`stream_text_encoder_from_disk` streams from ``source``."""
    if checkpoint_folder is not None:
        return f"streamed from its checkpoint files (leaf level, {source}; nothing copied)"
    from .checkpoint_streaming import streaming_of

    if text_encoder is not None and streaming_of(text_encoder) is not None:
        return (f"written once to {source} in its packed checkpoint layout (quantized weights), streamed from those "
                "files by decoder layer")  # fmt: skip
    return f"group offload to disk (leaf level, streamed from {source})"
