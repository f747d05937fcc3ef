# Copyright 2026 The diffusers-h3 authors. Licensed under the Apache License, Version 2.0.
"""Compare two clips: every metric of :mod:`.metrics`, per frame and summarized over time, as one JSON-ready record,
and its one-line-per-metric text (``diffusers-h3 compare``)."""

from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Optional, Union

import torch

from .clips import Clip, read_clip
from .metrics import audio_metrics, lpips_per_frame, lpips_unavailable_reason, plane_metrics, temporal_summary


VIDEO_METRICS = ("psnr_y", "ssim_y", "psnr_yuv420", "ssim_yuv420")
# LPIPS runs a network per frame: at most this many frames, evenly spaced (first and last included).
LPIPS_FRAMES = 16


class ClipMismatchError(ValueError):
    """The two clips cannot be compared frame by frame (frame count, size or audio channels differ)."""


def _as_clip(clip: Union[Clip, str, os.PathLike]) -> Clip:
    return clip if isinstance(clip, Clip) else read_clip(clip)


def evenly_spaced(count: int, total: int) -> List[int]:
    """``count`` frame indices spread over ``total`` frames, first and last included (all when ``count >= total``)."""
    if count >= total:
        return list(range(total))
    if count == 1:
        return [0]
    return sorted({round(i * (total - 1) / (count - 1)) for i in range(count)})


def compare_clips(reference: Union[Clip, str, os.PathLike], candidate: Union[Clip, str, os.PathLike],
                  lpips: bool = True, device=None) -> Dict[str, Any]:  # fmt: skip
    """Distances of ``candidate`` from ``reference`` (files or :class:`Clip`), computed on ``device`` (default: CUDA
    when available, else the CPU). The record holds, per video metric,
    the temporal summary and the ``per_frame`` values; ``audio`` (``None`` when either clip has no audio track) and
    ``lpips`` (``{"value": None, "reason": ...}`` when not computed). Raises :class:`ClipMismatchError` for clips of
    different frame counts or sizes."""
    reference, candidate = _as_clip(reference), _as_clip(candidate)
    if reference.num_frames != candidate.num_frames:
        raise ClipMismatchError(f"the clips have {reference.num_frames} and {candidate.num_frames} frames; "
                                "compare clips of the same length")  # fmt: skip
    if reference.size != candidate.size:
        raise ClipMismatchError(f"the clips are {reference.size[1]}x{reference.size[0]} and {candidate.size[1]}x"
                                f"{candidate.size[0]} pixels; compare clips of the same size")  # fmt: skip
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    per_frame = plane_metrics(reference.planes, candidate.planes, device=device)
    record: Dict[str, Any] = {
        "reference": reference.source,
        "candidate": candidate.source,
        "frames": reference.num_frames,
        "height": reference.size[0],
        "width": reference.size[1],
        "fps": reference.fps,
        "identical_video": bool(all(torch.equal(a, b) for a, b in zip(reference.planes, candidate.planes))),
    }
    for name in VIDEO_METRICS:
        mse = per_frame[name.replace("psnr", "mse")] if name.startswith("psnr") else None
        record[name] = {**temporal_summary(per_frame[name], reference.fps, mse=mse),
                        "per_frame": [float(v) for v in per_frame[name]]}  # fmt: skip
    record["lpips"] = _lpips(reference, candidate) if lpips else {"value": None, "reason": "not asked for"}
    record["audio"] = None
    if reference.audio is not None and candidate.audio is not None:
        if reference.sample_rate != candidate.sample_rate:
            raise ClipMismatchError(f"the audio tracks are at {reference.sample_rate} and {candidate.sample_rate} Hz")
        if reference.audio.shape[0] != candidate.audio.shape[0]:
            raise ClipMismatchError(f"the audio tracks have {reference.audio.shape[0]} and "
                                    f"{candidate.audio.shape[0]} channels")  # fmt: skip
        record["audio"] = {"sample_rate": reference.sample_rate,
                           **audio_metrics(reference.audio, candidate.audio, reference.sample_rate)}  # fmt: skip
    elif (reference.audio is None) != (candidate.audio is None):
        missing = "reference" if reference.audio is None else "candidate"
        record["audio_missing"] = f"the {missing} clip has no audio track"
    return record


def _lpips(reference: Clip, candidate: Clip) -> Dict[str, Any]:
    reason = lpips_unavailable_reason()
    if reason is not None:
        return {"value": None, "reason": reason}
    frames = evenly_spaced(LPIPS_FRAMES, reference.num_frames)
    values = lpips_per_frame(reference.rgb, candidate.rgb, frames)
    return {"value": float(values.mean()), "worst": float(values.max()), "frames": frames,
            "per_frame": [float(v) for v in values], "net": "alex"}  # fmt: skip


def _number(value: Optional[float], digits: int) -> str:
    if value is None:
        return "n/a"
    if math.isinf(value):
        return "inf"
    return f"{value:.{digits}f}"


def format_comparison(record: Dict[str, Any]) -> str:
    """One line per metric, for a terminal."""
    lines = [f"frames        {record['frames']} at {record['fps']:g} fps, {record['width']}x{record['height']}"
             + (" (identical video)" if record["identical_video"] else "")]  # fmt: skip
    for name in VIDEO_METRICS:
        entry = record[name]
        unit, digits = (" dB", 2) if name.startswith("psnr") else ("", 4)
        drift = entry["drift_per_s"]
        lines.append(f"{name:13s} mean {_number(entry['mean'], digits)}{unit}, worst {_number(entry['worst'], digits)}"
                     f"{unit} (frame {entry['worst_frame']}), drift {_number(drift, digits)}{unit}/s")  # fmt: skip
    lpips = record["lpips"]
    if lpips["value"] is None:
        lines.append(f"lpips         not computed: {lpips['reason']}")
    else:
        lines.append(f"lpips         mean {lpips['value']:.4f}, worst {lpips['worst']:.4f} over {len(lpips['frames'])} "
                     f"frames (AlexNet)")  # fmt: skip
    audio = record["audio"]
    if audio is None:
        lines.append(f"audio         not compared: {record.get('audio_missing', 'neither clip has an audio track')}")
    else:
        lines.append(f"audio_cosine  {audio['spectral_cosine']:.4f} (log-mel)")
        channels = ", ".join(_number(v, 2) for v in audio["si_sdr_db_per_channel"])
        lines.append(f"audio_si_sdr  {_number(audio['si_sdr_db'], 2)} dB worst channel (per channel: {channels})")
        channels = ", ".join(_number(v, 4) for v in audio["correlation_per_channel"])
        lines.append(f"audio_corr    {_number(audio['correlation'], 4)} worst channel (per channel: {channels})")
        lines.append(f"rms_ratio     {_number(audio['rms_ratio'], 4)} (candidate / reference)")
    return "\n".join(lines)


def json_ready(value: Any) -> Any:
    """``value`` with infinite and NaN floats as the strings ``"inf"``, ``"-inf"``, ``"nan"`` (strict JSON has no
    such numbers; ``float()`` reads the strings back)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {key: json_ready(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(item) for item in value]
    return value
