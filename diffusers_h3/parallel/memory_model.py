"""A memory model by packed rows: the device and host peaks of one request under one measured recipe entry.

Every H3 request is one packed sequence: text rows, keyframe or reference rows, audio rows and video rows
(:mod:`diffusers_h3.packing` lays them out; :func:`packed_rows` counts them with that code). What a request needs
beyond a recipe's fixed part grows with those rows (the DiT's activations), with the canvas (a decoded video chunk on
the device) and with the LoRA rank (the adapter's weights), so each measured entry of the recipe table (a recipe under
its settings and cap: ``memory_recipes.json``) gets one linear law per peak (the activations live on the device; the
host holds the decoded clip, whose size tracks the rows too closely for both to be fitted)::

    device_peak_gib = fixed + a * (rows / 10,000) + b * (canvas megapixels) + c * (LoRA rank / 64)
    host_peak_gib   = fixed + b * (canvas megapixel-frames / 100) + c * (LoRA rank / 64)

``device_peak_gib`` is the process's whole device memory as the card counts it (the allocator's peak, the CUDA
context and the libraries' workspaces), ``host_peak_gib`` its peak RSS, load included. A third law of the same terms
fits the allocator's peak (what the request needs under the recipe's cap): a request fits the entry when that need
stays below the cap. Under a cap the allocator keeps freed blocks cached up to the cap, so the card-counted peak of a
fitting request is bounded by the cap plus the measured memory outside the allocator (``device_bound_gib``), and the
device prediction is clipped to that bound. Requests that ran out of memory under the cap are not fitted; they are
listed under ``beyond_cap`` with the need the model predicts for them (it must exceed the cap). Chunking the feed-forward (a
recipe setting) bounds part of the per-row term: each settings variant is its own entry with its own law.

With an activation trace (``benchmarks/activation_trace.py``: the DiT forward's activation peak by rows, traced on the
meta device for each feed-forward chunking) and per-stage peaks in the records, the allocations are predicted per
stage instead, as the largest of::

    forwards     = fixed + traced activations(rows) + c * (LoRA rank / 64)
    video_decode = fixed + b * (canvas megapixels)
    other stages = the largest measured (text encode, audio decode, condition encode)

The trace carries the forward's curve beyond the measured rows (where the rotary embedding's temporaries overtake a
chunked feed-forward, it steepens), which a straight line through a few measured peaks, most of them set by the video
decode, cannot show.

:func:`derive_memory_model` fits the laws by least squares on measured requests (``benchmarks/memory_model.py`` runs
it on ``benchmarks/results/placement_<device>.json``; the package's ``memory_model.json`` is its result, checked by a
test). A term whose least-squares weight comes out negative is dropped and the law refit: memory does not shrink as a
request grows, so a negative weight is noise the few measured shapes cannot resolve. Requests marked as holdout are
not fit; their prediction errors are reported next to the fitted ones'.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
    MINIMAX_H3_AUDIO_CHANNELS,
    MINIMAX_H3_FPS,
    align_num_frames,
    audio_latent_num_frames,
    resolve_canvas_size,
    video_latent_num_frames,
)

from ..packing import ref2va_layout, t2va_fl2va_layout
from ..tasks import get_task, reference_image_size


MEMORY_MODEL_PATH = Path(__file__).with_name("memory_model.json")

# The released checkpoint's geometry (a test checks these against the diffusers classes' defaults): video VAE
# spatial compression, frames per VAE chunk and latents kept per chunk, the DiT's patch, the pipeline's canvas rule
# and the short edge image references are encoded at.
RELEASED_GEOMETRY = {
    "vae_spatial_compression_ratio": 16,
    "vae_frames_per_chunk": 17,
    "vae_latents_per_chunk": 5,
    "patch_size": (1, 2, 2),
    "canvas_short_edge": 768,
    "canvas_max_pixels": 768 * 1344,
    "reference_image_short_edge": 2048,
}
# The DiT's dimensions (released defaults), for a forward's FLOPs.
DIT_BLOCKS, DIT_HIDDEN, DIT_ATTENTION_WIDTH, DIT_FFN = 50, 5376, 56 * 128, 14336

# The terms of each peak: name -> (what it counts, the unit its weight is per).
FEATURES = {
    "device_gib": ("rows", "decode_megapixels", "lora_rank"),
    "allocated_gib": ("rows", "decode_megapixels", "lora_rank"),
    "host_gib": ("clip_megapixel_frames", "lora_rank"),
}
# Each law's target field in a measured request's record.
LAW_FIELDS = {"device_gib": "device_peak_gib", "allocated_gib": "peak_allocated_gib", "host_gib": "host_peak_rss_gib"}

# A request-sized allocator cap (opt-in: ``MemoryBudgetConfig(request_sized_cap=True)``): each call holds the allocator
# to its predicted allocations plus this headroom, so what the caching allocator keeps follows the request instead of
# the entry's cap. The margin covers the allocations law's fitted error (2.3 % at most); the slack, fragmentation.
REQUEST_CAP_MARGIN = 0.05
REQUEST_CAP_SLACK_GIB = 0.25


def request_cap_gib(allocated_gib: float, ceiling_gib: Optional[float] = None) -> float:
    """The allocator cap of a request predicted to allocate ``allocated_gib``, no higher than ``ceiling_gib``."""
    cap = allocated_gib * (1 + REQUEST_CAP_MARGIN) + REQUEST_CAP_SLACK_GIB
    return round(min(cap, ceiling_gib) if ceiling_gib is not None else cap, 2)


FEATURE_UNITS = {
    "rows": "10,000 packed rows (text, keyframe / reference, audio and video rows)",
    "decode_megapixels": "megapixel of canvas (height x width / 1e6): a decoded video chunk on the device",
    "clip_megapixel_frames": "100 megapixel-frames (height x width x frames / 1e8): the decoded clip",
    "lora_rank": "64 of LoRA rank",
}
# Above this condition number (terms scaled to their largest value) the measured requests barely tell two terms apart:
# their weights would trade off against each other, so the fit is refused instead.
MAX_CONDITION = 1e3
# The records' fields that name a request's shape.
SHAPE_FIELDS = ("task", "height", "width", "num_frames", "prompt_tokens", "reference_images", "reference_videos",
                "lora_rank", "keyframes")  # fmt: skip


@dataclass(frozen=True)
class RequestShape:
    """What of a request decides its memory: task, canvas, aligned frame count, text rows (the prompt's tokens as
    presented, the references' vision tokens included), reference images and videos (ref2va; each video carries a
    soundtrack and as many frames as the clip, the worst case), keyframes (fl2va: 1 or 2) and the LoRA's rank
    (0: none)."""

    task: str = "t2va"
    height: int = 768
    width: int = 1344
    num_frames: int = 124
    prompt_tokens: int = 512
    reference_images: int = 0
    reference_videos: int = 0
    lora_rank: int = 0
    keyframes: Optional[int] = None  # fl2va: 1 unless given

    def __post_init__(self):
        get_task(self.task)
        if self.task != "ref2va" and (self.reference_images or self.reference_videos):
            raise ValueError(f"{self.task} takes no references; references route a request to ref2va")
        if self.task == "ref2va" and not (self.reference_images or self.reference_videos):
            raise ValueError("a ref2va request needs at least one image or video reference")
        keyframes = (1 if self.task == "fl2va" else 0) if self.keyframes is None else int(self.keyframes)
        if keyframes and self.task != "fl2va" or self.task == "fl2va" and keyframes not in (1, 2):
            raise ValueError(f"keyframes={self.keyframes}: fl2va takes 1 or 2 keyframes, other tasks none")
        object.__setattr__(self, "keyframes", keyframes)

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> "RequestShape":
        """The shape of a measured request record (fields :data:`SHAPE_FIELDS`; missing counts are 0)."""
        fields = {name: record[name] for name in SHAPE_FIELDS if record.get(name) is not None}
        return cls(**fields)

    def label(self) -> str:
        refs = []
        if self.reference_images:
            refs.append(f"{self.reference_images} image ref{'s' * (self.reference_images > 1)}")
        if self.reference_videos:
            refs.append(f"{self.reference_videos} video ref{'s' * (self.reference_videos > 1)}")
        if self.task == "fl2va" and self.keyframes == 2:
            refs.append("2 keyframes")
        if self.lora_rank:
            refs.append(f"LoRA rank {self.lora_rank}")
        extra = f", {', '.join(refs)}" if refs else ""
        return (f"{self.task} {self.height}x{self.width}x{self.num_frames} ({self.num_frames / MINIMAX_H3_FPS:.1f} s), "
                f"{self.prompt_tokens} text rows{extra}")  # fmt: skip

    def key(self) -> str:
        """Compact name of the canvas and frames, e.g. ``768x1344x124``."""
        return f"{self.height}x{self.width}x{self.num_frames}"


def packed_rows(shape: RequestShape, geometry: Optional[Mapping[str, Any]] = None) -> Dict[str, int]:
    """The packed rows of ``shape``'s request by kind (``text``, ``keyframe``, ``reference``, ``audio``, ``video``)
    and in all (``total``), laid out by :mod:`diffusers_h3.packing` as the pipeline lays them out. ``geometry``:
    :data:`RELEASED_GEOMETRY` unless given."""
    g = {**RELEASED_GEOMETRY, **(geometry or {})}
    per_chunk, kept = g["vae_frames_per_chunk"], g["vae_latents_per_chunk"]
    ratio, patch = g["vae_spatial_compression_ratio"], tuple(g["patch_size"])
    num_frames = align_num_frames(shape.num_frames, per_chunk, kept)
    latent = (video_latent_num_frames(num_frames, per_chunk, kept), shape.height // ratio, shape.width // ratio,
              audio_latent_num_frames(num_frames))  # fmt: skip
    if shape.task == "ref2va":
        multiple = ratio * patch[2]
        references, visual, audio = [], [], []
        width, height = reference_image_size(shape.width, shape.height, g["reference_image_short_edge"], multiple)
        for _ in range(shape.reference_images):
            references.append(_Reference("image", False))
            visual.append(_latent(1, height, width, ratio, per_chunk, kept))
        video_h, video_w = resolve_canvas_size(shape.width, shape.height, multiple, g["canvas_short_edge"],
                                               g["canvas_max_pixels"])  # fmt: skip
        # the encode snaps a video reference down to 17n+5 frames (tasks._encode_references)
        video_frames = max(1, (num_frames - kept) // per_chunk) * per_chunk + kept
        for _ in range(shape.reference_videos):
            references.append(_Reference("video", True))
            visual.append(_latent(video_frames, video_h, video_w, ratio, per_chunk, kept))
            audio.append(torch.empty(MINIMAX_H3_AUDIO_CHANNELS * audio_latent_num_frames(num_frames), 1, device="meta"))
        layout = ref2va_layout(shape.prompt_tokens, references, visual, audio, *latent, patch, MINIMAX_H3_AUDIO_CHANNELS)
    else:
        layout = t2va_fl2va_layout(shape.prompt_tokens, shape.keyframes, *latent, patch, MINIMAX_H3_AUDIO_CHANNELS)
    rows = {"text": 0, "keyframe": 0, "reference": 0, "audio": 0, "video": 0}
    for segment in layout.segments:
        kind = segment.kind if segment.role in ("prompt", "target") else segment.role
        rows[kind] += segment.stop - segment.start
    rows["total"] = layout.seq_len
    return rows


@dataclass(frozen=True)
class _Reference:  # what ref2va_layout reads of a reference
    kind: str
    has_audio: bool


def _latent(frames, height, width, ratio, per_chunk, kept):
    """A meta tensor with the shape of a visual condition's VAE latents (ref2va_layout reads shapes only)."""
    latent_frames = 1 if frames == 1 else video_latent_num_frames(frames, per_chunk, kept)
    return torch.empty(1, 1, latent_frames, height // ratio, width // ratio, device="meta")


def features(shape: RequestShape, rows: Optional[int] = None) -> Dict[str, float]:
    """The model's terms of ``shape`` in their units (:data:`FEATURE_UNITS`)."""
    rows = packed_rows(shape)["total"] if rows is None else rows
    pixels = shape.height * shape.width
    return {"rows": rows / 1e4, "decode_megapixels": pixels / 1e6,
            "clip_megapixel_frames": pixels * shape.num_frames / 1e8, "lora_rank": shape.lora_rank / 64}  # fmt: skip


def forward_flops(rows: int) -> float:
    """FLOPs of one DiT forward on ``rows`` packed rows: the blocks' GEMMs (QKV, output, SwiGLU up and down) and
    dense attention (4 * rows^2 * attention width per block)."""
    per_row = 2 * (DIT_HIDDEN * 3 * DIT_ATTENTION_WIDTH + DIT_ATTENTION_WIDTH * DIT_HIDDEN
                   + DIT_HIDDEN * 2 * DIT_FFN + DIT_FFN * DIT_HIDDEN)  # fmt: skip
    return DIT_BLOCKS * (rows * per_row + 4 * rows * rows * DIT_ATTENTION_WIDTH)


# -- fitting -------------------------------------------------------------------------------------------------------


def _fit_law(xs: List[Dict[str, float]], ys: List[float], names: Sequence[str]) -> Dict[str, Any]:
    """Least squares of ``ys`` on an intercept and the terms ``names`` of ``xs``; terms that do not vary over the
    records, or whose weight comes out negative, are dropped (with the reason) and the rest refit."""
    kept, dropped = list(names), {}
    for name in names:
        values = [x[name] for x in xs]
        if max(values) - min(values) < 1e-12:
            kept.remove(name)
            dropped[name] = "does not vary over the measured requests"
    while True:
        matrix = np.array([[1.0] + [x[name] for name in kept] for x in xs])
        scaled = matrix / np.abs(matrix).max(axis=0)
        if np.linalg.matrix_rank(matrix) < matrix.shape[1] or np.linalg.cond(scaled) > MAX_CONDITION:
            raise ValueError(f"the measured requests cannot separate the terms {kept} (give shapes that vary them "
                             "independently)")  # fmt: skip
        weights = np.linalg.lstsq(matrix, np.array(ys, dtype=float), rcond=None)[0]
        negative = [(w, name) for w, name in zip(weights[1:], kept) if w < 0]
        if not negative:
            break
        name = min(negative)[1]
        kept.remove(name)
        dropped[name] = "its least-squares weight was negative (noise the measured shapes cannot resolve)"
    law = {"fixed": round(float(weights[0]), 4)}
    law.update({name: round(float(w), 4) for name, w in zip(kept, weights[1:])})
    law.update({name: 0.0 for name in names if name not in kept})
    return {"law": law, "dropped": dropped}


def _apply(law: Mapping[str, float], x: Mapping[str, float]) -> float:
    return law["fixed"] + sum(weight * x[name] for name, weight in law.items() if name != "fixed")


FEATURE_NAMES = tuple(dict.fromkeys(name for names in FEATURES.values() for name in names))


def _predict_entry(entry: Mapping[str, Any], x: Mapping[str, float]) -> Dict[str, float]:
    """Each law of ``entry`` at ``x``; the device peak no higher than the entry's bound (cap + outside the allocator)
    while the need fits the cap."""
    out = {law_name: _apply(entry[law_name], x) for law_name in LAW_FIELDS if law_name in entry}
    if "allocated_stages" in entry:
        out["allocated_gib"] = _stage_allocations(entry["allocated_stages"], x)
    bound = entry.get("device_bound_gib")
    if bound is not None and "device_gib" in out and out.get("allocated_gib", 0.0) <= entry["cap_gib"]:
        out["device_gib"] = min(out["device_gib"], bound)
    outside = entry.get("outside_allocator_gib")
    if "allocated_gib" in out and outside is not None:
        # under a request-sized cap the card holds no more than that cap and what lies outside the allocator
        out["request_cap_gib"] = request_cap_gib(out["allocated_gib"], entry.get("cap_gib"))
        out["request_capped_device_gib"] = out["request_cap_gib"] + outside
        if entry.get("request_sized_cap") and "device_gib" in out:  # the entry's requests ran under such caps
            out["device_gib"] = min(out["device_gib"], out["request_capped_device_gib"])
    return out


# The measured stages whose allocation peaks the stage laws fit; the other stages' largest peak is taken as it is.
FORWARD_STAGE, DECODE_STAGE = "forwards", "video_decode"


def traced_activations_gib(trace: Mapping[str, Sequence[float]], rows: float) -> float:
    """The traced forward activation peak at ``rows`` (in 10,000s), linear between the traced rows and along the last
    (first) segment beyond them."""
    xs, ys = trace["rows"], trace["gib"]
    if len(xs) < 2:
        raise ValueError("an activation trace needs at least two traced row counts")
    index = max(1, min(len(xs) - 1, int(np.searchsorted(xs, rows))))
    x0, x1, y0, y1 = xs[index - 1], xs[index], ys[index - 1], ys[index]
    return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)


def _trace_of(activations: Optional[Mapping[str, Any]], settings: Mapping[str, Any]) -> Optional[Dict[str, list]]:
    """The trace of the entry's feed-forward chunking from an activation-trace result (rows in 10,000s)."""
    if not activations:
        return None
    chunk = settings.get("ffn_chunk_rows")
    peaks = activations.get("peaks_gib", {}).get(str(chunk) if chunk else "none")
    if peaks is None:
        return None
    return {"rows": [r / 1e4 for r in activations["rows"]], "gib": list(peaks),
            "ffn_chunk_rows": chunk, "label": activations.get("label", "traced")}  # fmt: skip


def _fit_stages(records, xs, trace) -> Dict[str, Any]:
    """The stage laws of the allocations (see the module's docstring) from the records' ``stage_peak_gib``."""
    forwards = [float(r["stage_peak_gib"][FORWARD_STAGE][0]) - traced_activations_gib(trace, x["rows"])
                for r, x in zip(records, xs)]  # fmt: skip
    decode = [float(r["stage_peak_gib"][DECODE_STAGE][0]) for r in records]
    rest = max(float(peaks[0]) for r in records for stage, peaks in r["stage_peak_gib"].items()
               if stage not in (FORWARD_STAGE, DECODE_STAGE))  # fmt: skip
    return {"forwards": _fit_law(xs, forwards, ("lora_rank",)),
            "video_decode": _fit_law(xs, decode, ("decode_megapixels",)), "rest_gib": round(rest, 4)}  # fmt: skip


def _stage_allocations(stages: Mapping[str, Any], x: Mapping[str, float]) -> float:
    forwards = _apply(stages["forwards"], x) + traced_activations_gib(stages["activation_trace"], x["rows"])
    return max(forwards, _apply(stages["video_decode"], x), stages["rest_gib"])


def shape_records(results: Mapping[str, Any]) -> List[Tuple[str, Dict[str, Any]]]:
    """``(case, record)`` of every measured request of a placement result: the records listed under each case's
    ``shapes`` that carry a device peak."""
    out = []
    for case_name, case in sorted(results.get("cases", {}).items()):
        for record in case.get("shapes") or ():
            if record.get("device_peak_gib") is not None and record.get("host_peak_rss_gib") is not None:
                out.append((case_name, record))
    return out


def _holdout_key(record: Mapping[str, Any]) -> str:
    return f"{record['height']}x{record['width']}x{record['num_frames']}"


def derive_memory_model(
    results: Mapping[str, Any],
    source: str,
    holdout: Iterable[str] = (),
    activations: Optional[Mapping[str, Any]] = None,
) -> Dict[str, Any]:
    """The memory model (the content of ``memory_model.json``) from a placement result's measured requests.

    Per case: the two laws fitted on its requests, except the holdout ones (a record with ``"holdout": true``, or
    whose ``HxWxF`` is in ``holdout``), and every request's predicted and measured peaks: ``fit_shapes`` and
    ``holdout`` with their relative errors. A case with fewer fitted requests than terms is left out (named in
    ``not_fit``). With ``activations`` (an activation-trace result) and per-stage peaks on every fitted request, the
    allocations are fitted per stage (``allocated_stages``)."""
    holdout = set(holdout)
    by_case: Dict[str, List[Dict[str, Any]]] = {}
    for case_name, record in shape_records(results):
        by_case.setdefault(case_name, []).append(record)
    model: Dict[str, Any] = {
        "source": source, "device": results.get("device"), "commit": results.get("commit"),
        "label": "fitted on measured requests; holdout requests were not fitted",
        "units": FEATURE_UNITS, "holdout_shapes": sorted(holdout), "cases": {}, "fit_shapes": [], "holdout": [],
        "beyond_cap": [], "not_fit": {},
    }  # fmt: skip
    for case_name, all_records in sorted(by_case.items()):
        case = results["cases"][case_name]
        records = [r for r in all_records if r.get("fits", True) and r.get(LAW_FIELDS["allocated_gib"]) is not None]
        beyond = [r for r in all_records if not r.get("fits", True)]
        shapes = [RequestShape.from_record(r) for r in records]
        xs = [features(s) for s in shapes]
        is_holdout = [bool(r.get("holdout")) or _holdout_key(r) in holdout for r in records]
        fit_index = [i for i, h in enumerate(is_holdout) if not h]
        varying = [n for n in FEATURE_NAMES if len({round(xs[i][n], 9) for i in fit_index}) > 1]
        needed = 1 + max(len([n for n in names if n in varying]) for names in FEATURES.values())
        if len(fit_index) < max(needed, 2):
            model["not_fit"][case_name] = (f"{len(fit_index)} measured requests that fit the cap to fit, "
                                           f"{max(needed, 2)} needed")  # fmt: skip
            continue
        entry = {"recipe": case.get("recipe_name") or records[0].get("recipe"),
                 "settings": dict(case.get("settings") or records[0].get("settings") or {}),
                 "cap_gib": case.get("cap_gib"), "fitted_requests": len(fit_index),
                 # terms every fitted request shared: a request that differs in one is not modelled
                 "constant_terms": {n: round(xs[fit_index[0]][n], 6) for n in FEATURE_NAMES if n not in varying}}  # fmt: skip
        outside = [float(records[i]["device_peak_gib"]) - float(records[i]["peak_reserved_gib"]) for i in fit_index
                   if records[i].get("peak_reserved_gib") is not None]  # fmt: skip
        if entry["cap_gib"] is not None and outside:
            entry["outside_allocator_gib"] = round(max(outside), 3)
            entry["device_bound_gib"] = round(entry["cap_gib"] + max(outside), 3)
        if all(records[i].get("request_cap_gib") is not None for i in fit_index):
            entry["request_sized_cap"] = {"margin": REQUEST_CAP_MARGIN, "slack_gib": REQUEST_CAP_SLACK_GIB}
        trace = _trace_of(activations, entry["settings"])
        fitted_records = [records[i] for i in fit_index]
        per_stage = trace is not None and all(FORWARD_STAGE in (r.get("stage_peak_gib") or {}) and DECODE_STAGE in
                                              r["stage_peak_gib"] for r in fitted_records)  # fmt: skip
        for law_name, field in LAW_FIELDS.items():
            if law_name == "allocated_gib" and per_stage:
                continue  # the stage laws below predict the allocations
            fitted = _fit_law([xs[i] for i in fit_index], [float(records[i][field]) for i in fit_index],
                              FEATURES[law_name])  # fmt: skip
            entry[law_name] = fitted["law"]
            if fitted["dropped"]:
                entry[f"{law_name}_dropped"] = fitted["dropped"]
        if per_stage:
            stages = _fit_stages(fitted_records, [xs[i] for i in fit_index], trace)
            entry["allocated_stages"] = {"forwards": stages["forwards"]["law"],
                                         "video_decode": stages["video_decode"]["law"],
                                         "rest_gib": stages["rest_gib"], "activation_trace": trace}  # fmt: skip
        model["cases"][case_name] = entry
        for record, shape, x, held in zip(records, shapes, xs, is_holdout):
            row = {"case": case_name, "shape": shape.label(), "rows": packed_rows(shape)["total"]}
            predicted_peaks = _predict_entry(entry, x)
            for law_name, field in LAW_FIELDS.items():
                predicted, measured = predicted_peaks[law_name], float(record[field])
                prefix = law_name[: -len("_gib")]
                row[f"predicted_{prefix}_gib"] = round(predicted, 3)
                row[f"measured_{prefix}_gib"] = round(measured, 3)
                row[f"{prefix}_error"] = round((predicted - measured) / measured, 4)
            model["holdout" if held else "fit_shapes"].append(row)
        for record in beyond:
            shape = RequestShape.from_record(record)
            need = _predict_entry(entry, features(shape))["allocated_gib"]
            model["beyond_cap"].append({
                "case": case_name, "shape": shape.label(), "rows": packed_rows(shape)["total"],
                "predicted_allocated_gib": round(need, 3), "cap_gib": entry["cap_gib"],
                "model_refuses": entry["cap_gib"] is not None and need > entry["cap_gib"],
                "measured": (record.get("error") or "ran out of memory under the cap")[:160]})  # fmt: skip
    for name in ("fit_shapes", "holdout"):
        errors = [abs(r[f"{p}_error"]) for r in model[name] for p in ("device", "allocated", "host")]
        model[f"{name}_max_error"] = round(max(errors), 4) if errors else None
    return model


# -- predicting ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryPrediction:
    """The predicted peaks of one request under one recipe entry, and what they rest on."""

    case: str
    device_gib: float
    host_gib: float
    rows: int
    basis: str
    allocated_gib: Optional[float] = None  # the allocator's need (fits the entry when no more than cap_gib)
    cap_gib: Optional[float] = None
    request_cap_gib: Optional[float] = None  # the request-sized cap (request_cap_gib) and the card's peak under it
    request_capped_device_gib: Optional[float] = None

    @property
    def fits_cap(self) -> bool:
        return self.cap_gib is None or self.allocated_gib is None or self.allocated_gib <= self.cap_gib


@dataclass(frozen=True)
class MemoryModel:
    """The fitted laws per recipe entry (case name) and the model's provenance (``source``, ``device``)."""

    cases: Mapping[str, Mapping[str, Any]]
    source: str = ""
    device: Optional[str] = None
    holdout_max_error: Optional[float] = None
    fit_max_error: Optional[float] = None
    data: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def has(self, case: str) -> bool:
        return case in self.cases

    def models(self, case: str, shape: RequestShape) -> bool:
        """Whether the entry's laws speak for ``shape``: every term its measured requests held fixed (a LoRA rank,
        typically) has the same value in ``shape``."""
        if case not in self.cases:
            return False
        x = features(shape)
        return all(abs(x[n] - v) < 1e-6 for n, v in self.cases[case].get("constant_terms", {}).items())

    def _holdout_errors(self, case: str) -> str:
        """``", holdout error up to ..."``: this entry's largest holdout errors per peak when the model's data lists
        them (the allocations decide a fit; the device peak under a loose cap depends on the allocator's cache),
        else the model's largest."""
        rows = [r for r in self.data.get("holdout", ()) if r.get("case") == case]
        if rows:
            worst = {p: max(abs(r[f"{p}_error"]) for r in rows) for p in ("allocated", "device", "host")}
            return (f", holdout error up to {worst['allocated']:.0%} for the allocations, {worst['device']:.0%} for "
                    f"the device peak, {worst['host']:.0%} for the host peak")  # fmt: skip
        return f", holdout error up to {self.holdout_max_error:.0%}" if self.holdout_max_error is not None else ""

    def predict(self, case: str, shape: RequestShape) -> MemoryPrediction:
        """The peaks of ``shape``'s request under the recipe entry ``case``."""
        entry = self.cases[case]
        rows = packed_rows(shape)["total"]
        x = features(shape, rows)
        peaks = _predict_entry(entry, x)
        device, host, allocated = peaks["device_gib"], peaks["host_gib"], peaks.get("allocated_gib")
        error = self._holdout_errors(case)
        basis = (f"predicted by the memory model fitted on {entry['fitted_requests']} requests measured as {case} on "
                 f"the {self.device}{error}")  # fmt: skip
        capped = peaks.get("request_capped_device_gib")
        return MemoryPrediction(case, round(device, 2), round(host, 2), rows, basis,
                                None if allocated is None else round(allocated, 2), entry.get("cap_gib"),
                                peaks.get("request_cap_gib"), None if capped is None else round(capped, 2))  # fmt: skip


def load_memory_model(path: Union[str, Path, None] = None) -> Optional[MemoryModel]:
    """The model at ``path`` (default: the packaged ``memory_model.json``); None when there is none yet."""
    path = Path(path or MEMORY_MODEL_PATH)
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return MemoryModel(cases=data["cases"], source=data.get("source", ""), device=data.get("device"),
                       holdout_max_error=data.get("holdout_max_error"), fit_max_error=data.get("fit_shapes_max_error"),
                       data=data)  # fmt: skip


def time_scale(shape: RequestShape, reference: RequestShape) -> float:
    """How much longer ``shape``'s request computes than ``reference``'s: the ratio of their DiT forwards' FLOPs, at
    least 1 (the recipes that stream weights read them at every forward whatever the shape)."""
    return max(1.0, forward_flops(packed_rows(shape)["total"]) / forward_flops(packed_rows(reference)["total"]))


def largest_fitting(fits, start: int, stop: int, step: int) -> Optional[int]:
    """The largest value in ``range(start, stop + 1, step)`` for which ``fits(value)`` holds, assuming a need that
    grows with the value (bisection over the steps); None when even ``start`` does not fit."""
    if not fits(start):
        return None
    low, high = 0, (stop - start) // step
    while low < high:
        middle = (low + high + 1) // 2
        if fits(start + middle * step):
            low = middle
        else:
            high = middle - 1
    return start + low * step


def frames_of_seconds(seconds: float) -> int:
    """The aligned frame count of a clip of ``seconds`` at 24 fps (rounded up to 17n+5)."""
    g = RELEASED_GEOMETRY
    return align_num_frames(max(1, math.ceil(seconds * MINIMAX_H3_FPS)), g["vae_frames_per_chunk"],
                            g["vae_latents_per_chunk"])  # fmt: skip
