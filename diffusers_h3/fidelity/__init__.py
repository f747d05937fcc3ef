# Copyright 2026 The diffusers-h3 authors. Licensed under the Apache License, Version 2.0.
"""What a fast path costs in the clip: distances between two clips (video PSNR / SSIM over YUV 4:2:0, LPIPS when its
weights are local, audio log-mel cosine and RMS ratio), and fidelity runs that generate the same prompts and seeds
with several cases and report the distances, the speed and gates (docs/fidelity.md)."""

from .cases import FIDELITY_CASES, FidelityCase, apply_case, get_case
from .clips import Clip, clip_from_output, read_clip
from .compare import ClipMismatchError, compare_clips, format_comparison, json_ready
from .run import FidelityRunError, FidelitySettings, Gates, evaluate_gates, run_fidelity


__all__ = [
    "FIDELITY_CASES",
    "Clip",
    "ClipMismatchError",
    "FidelityCase",
    "FidelityRunError",
    "FidelitySettings",
    "Gates",
    "apply_case",
    "clip_from_output",
    "compare_clips",
    "evaluate_gates",
    "format_comparison",
    "get_case",
    "json_ready",
    "read_clip",
    "run_fidelity",
]
