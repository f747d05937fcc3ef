"""The H.264 encoder options of the MP4 export and their checks, in the standard library only: the CLI validates
`--crf`, `--preset` and `--pix-fmt` with them before torch or the package is imported.

The defaults were chosen by measurement (`benchmarks/export.py`, `benchmarks/results/export_cpu.json`, the
"MP4 export" section of docs/pipeline.md).
"""

from __future__ import annotations


# libx264's presets, fastest first.
X264_PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow")
# Pixel formats libx264 encodes 8-bit RGB input to; yuv420p is the one every player decodes.
PIXEL_FORMATS = ("yuv420p", "yuv422p", "yuv444p")
# libx264's constant-rate-factor scale for 8-bit video: 0 is lossless, higher is smaller and worse.
CRF_RANGE = (0, 51)

DEFAULT_CRF = 23
DEFAULT_PRESET = "superfast"
DEFAULT_PIX_FMT = "yuv420p"


def encoding_option_problem(crf, preset, pix_fmt) -> str:
    """Why `(crf, preset, pix_fmt)` cannot be passed to libx264, as one line `<what> — <fix>`; `""` when they can."""
    low, high = CRF_RANGE
    if isinstance(crf, bool) or not isinstance(crf, int):
        return f"`crf` must be an integer, got {crf!r} — pass a whole number from {low} to {high}"
    if not low <= crf <= high:
        return f"`crf` must be from {low} to {high}, got {crf} — pass {low} (lossless) to {high}; lower is better and larger"
    if preset not in X264_PRESETS:
        return f"`preset` {preset!r} is not an x264 preset — choose one of {', '.join(X264_PRESETS)}"
    if pix_fmt not in PIXEL_FORMATS:
        return f"`pix_fmt` {pix_fmt!r} is not supported — choose one of {', '.join(PIXEL_FORMATS)}"
    return ""


def check_encoding_options(crf, preset, pix_fmt) -> None:
    """Raise `ValueError` (one line) for options libx264 would refuse or misread, before any frame is encoded."""
    problem = encoding_option_problem(crf, preset, pix_fmt)
    if problem:
        raise ValueError(problem)
