# Copyright 2026 The diffusers-h3 authors. Licensed under the Apache License, Version 2.0.
"""The fidelity page: per case and clip a frame strip (reference, case, difference at fixed times), a per-frame
PSNR / SSIM plot and the spectrograms of both audio tracks, as PNG files beside ``index.html``, plus the table of
distances, gates and speed.

The pictures are drawn with PIL and torch alone (no plotting library), so the command runs from a plain install."""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any, Dict, List, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont

from .clips import Clip
from .metrics import log_mel


# Fractions of the clip the frame strip shows.
STRIP_POSITIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
# The difference row is |reference - case| times this (small differences become visible).
DIFFERENCE_GAIN = 4
PLOT_SIZE = (640, 300)
SPECTROGRAM_SIZE = (480, 96)
BACKGROUND, INK, GRID = (255, 255, 255), (40, 40, 40), (225, 225, 225)
PSNR_COLOUR, SSIM_COLOUR = (31, 119, 180), (214, 39, 40)
# Anchor colours of the spectrogram colour map, from the floor (-80 dB) to the peak.
COLOUR_MAP = np.array([(0, 0, 4), (80, 18, 123), (182, 54, 121), (251, 136, 97), (252, 253, 191)], dtype=np.float64)


def strip_frames(num_frames: int) -> List[int]:
    """The frame indices of :data:`STRIP_POSITIONS`."""
    return [min(num_frames - 1, round(p * (num_frames - 1))) for p in STRIP_POSITIONS]


def _thumbnail(frame: torch.Tensor, width: int) -> torch.Tensor:
    """uint8 (H, W, 3) -> uint8 (h, width, 3), area-averaged."""
    height = max(2, round(frame.shape[0] * width / frame.shape[1]))
    resized = F.interpolate(frame.permute(2, 0, 1)[None].float(), size=(height, width), mode="area")
    return resized[0].permute(1, 2, 0).round().clamp(0, 255).to(torch.uint8)


def _font():
    return ImageFont.load_default()


def frame_strip(reference: Clip, candidate: Clip, path: Path, thumbnail_width: int) -> None:
    """Three rows at the strip's times: the reference, the candidate, ``|difference| x 4``; the time above each."""
    frames = strip_frames(reference.num_frames)
    thumbnail_width = min(thumbnail_width, reference.size[1])  # never enlarged
    rows = []
    for clip in (reference, candidate):
        rows.append([_thumbnail(clip.rgb[i], thumbnail_width) for i in frames])
    rows.append([((a.int() - b.int()).abs() * DIFFERENCE_GAIN).clamp(0, 255).to(torch.uint8)
                 for a, b in zip(rows[0], rows[1])])  # fmt: skip
    label_h, pad = 14, 2
    tile_h, tile_w = rows[0][0].shape[:2]
    canvas = Image.new("RGB", (len(frames) * (tile_w + pad) + 70, label_h + 3 * (tile_h + pad)), BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    for col, index in enumerate(frames):
        draw.text((70 + col * (tile_w + pad), 1), f"{index / reference.fps:.2f} s", fill=INK, font=_font())
    for row, (label, tiles) in enumerate(zip(("reference", "case", f"|diff| x{DIFFERENCE_GAIN}"), rows)):
        top = label_h + row * (tile_h + pad)
        draw.text((2, top + tile_h // 2 - 5), label, fill=INK, font=_font())
        for col, tile in enumerate(tiles):
            canvas.paste(Image.fromarray(tile.numpy()), (70 + col * (tile_w + pad), top))
    canvas.save(path, optimize=True)


def _finite(values: Sequence[Any]) -> List[float]:
    return [float(v) for v in values]


def metric_plot(record: Dict[str, Any], path: Path) -> None:
    """Per-frame PSNR (Y, dB, left panel) and SSIM (Y, right panel) of one comparison; infinite PSNR (identical
    frames) is drawn at the top of its axis and said in the title."""
    width, height = PLOT_SIZE
    canvas = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    panels = (("psnr_y", "PSNR Y (dB)", PSNR_COLOUR), ("ssim_y", "SSIM Y", SSIM_COLOUR))
    panel_w = width // 2
    for number, (key, title, colour) in enumerate(panels):
        values = _finite(record[key]["per_frame"])
        finite = [v for v in values if math.isfinite(v)]
        infinite = len(values) - len(finite)
        low = min(finite) if finite else 0.0
        high = max(finite) if finite else 1.0
        if key == "ssim_y":
            high = max(high, 1.0)
        if high - low < 1e-6:
            low, high = low - 0.5, high + 0.5
        left, top, right, bottom = number * panel_w + 50, 24, (number + 1) * panel_w - 10, height - 30
        label = title + (f" ({infinite} identical frames: inf)" if infinite else "")
        draw.text((left, 4), label, fill=INK, font=_font())
        for k in range(5):
            y = bottom - k * (bottom - top) / 4
            draw.line([(left, y), (right, y)], fill=GRID)
            draw.text((left - 46, y - 6), f"{low + k * (high - low) / 4:.3g}", fill=INK, font=_font())
        draw.rectangle([left, top, right, bottom], outline=INK)
        count = max(1, len(values) - 1)
        points = []
        for i, v in enumerate(values):
            v = high if not math.isfinite(v) else v
            points.append((left + i * (right - left) / count, bottom - (v - low) / (high - low) * (bottom - top)))
        if len(points) > 1:
            draw.line(points, fill=colour, width=2)
        elif points:
            draw.ellipse([points[0][0] - 2, points[0][1] - 2, points[0][0] + 2, points[0][1] + 2], fill=colour)
        draw.text((left, bottom + 6), "frame 0", fill=INK, font=_font())
        draw.text((right - 60, bottom + 6), f"frame {len(values) - 1}", fill=INK, font=_font())
    canvas.save(path, optimize=True)


def _colour(values: np.ndarray) -> np.ndarray:
    """Values in [0, 1] -> RGB uint8 through :data:`COLOUR_MAP`."""
    position = np.clip(values, 0.0, 1.0) * (len(COLOUR_MAP) - 1)
    lower = np.floor(position).astype(int).clip(0, len(COLOUR_MAP) - 2)
    fraction = (position - lower)[..., None]
    return (COLOUR_MAP[lower] * (1 - fraction) + COLOUR_MAP[lower + 1] * fraction).round().astype(np.uint8)


def spectrograms(reference: Clip, candidate: Clip, path: Path) -> bool:
    """The log-mel spectrograms (mean of the channels, low frequencies at the bottom) of the reference above the
    candidate's; ``False`` (nothing written) when either clip has no audio."""
    if reference.audio is None or candidate.audio is None:
        return False
    images = []
    for clip in (reference, candidate):
        mel = log_mel(clip.audio, clip.sample_rate).mean(0)  # (bands, frames) in [-80, 0] dB
        picture = _colour(((mel + 80.0) / 80.0).flip(0).numpy())
        images.append(Image.fromarray(picture).resize(SPECTROGRAM_SIZE))  # time stretched or squeezed to the width
    label_h = 14
    canvas = Image.new("RGB", (SPECTROGRAM_SIZE[0], 2 * (SPECTROGRAM_SIZE[1] + label_h)), BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    seconds = reference.audio.shape[-1] / reference.sample_rate
    for row, (label, image) in enumerate(zip(("reference", "case"), images)):
        top = row * (SPECTROGRAM_SIZE[1] + label_h)
        draw.text((2, top + 1), f"{label}: log-mel 0-{reference.sample_rate // 2} Hz over {seconds:.2f} s, -80 to 0 dB "
                                "of its peak", fill=INK, font=_font())  # fmt: skip
        canvas.paste(image, (0, top + label_h))
    canvas.save(path, optimize=True)
    return True


def clip_images(reference: Clip, candidate: Clip, record: Dict[str, Any], folder: Path, stem: str,
                thumbnail_width: int = 160) -> Dict[str, str]:  # fmt: skip
    """Write the three pictures of one comparison into ``folder``; returns their paths relative to its parent."""
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    frame_strip(reference, candidate, folder / f"{stem}_frames.png", thumbnail_width)
    written["frames"] = f"{folder.name}/{stem}_frames.png"
    metric_plot(record, folder / f"{stem}_psnr_ssim.png")
    written["psnr_ssim"] = f"{folder.name}/{stem}_psnr_ssim.png"
    if spectrograms(reference, candidate, folder / f"{stem}_spectrograms.png"):
        written["spectrograms"] = f"{folder.name}/{stem}_spectrograms.png"
    return written


def _fmt(value, digits=4) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v, digits) for v in value) + "]"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def write_page(report: Dict[str, Any], out_dir: Path) -> Path:
    """``index.html`` in ``out_dir`` from a fidelity report (the pictures already written by :func:`clip_images`)."""
    settings = report["settings"]
    esc = html.escape
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>diffusers-h3 fidelity</title>",
             "<style>body{font-family:sans-serif;margin:1.5em;max-width:1300px}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:3px 7px;text-align:right}th{background:#f3f3f3}"
             ".fail{color:#b00;font-weight:bold}.pass{color:#070}.note{background:#fff4d6;padding:.6em}"
             "img{max-width:100%}</style></head><body>",
             f"<h1>Fidelity against <code>{esc(settings['against'])}</code></h1>"]  # fmt: skip
    if report.get("note"):
        parts.append(f"<p class='note'>{esc(report['note'])}</p>")
    verdict = "pass" if report["passed"] else "fail"
    parts.append(f"<p>Model <code>{esc(str(settings.get('model')))}</code>, {len(settings['prompts'])} prompt(s) x "
                 f"seeds {esc(str(settings['seeds']))}, {settings.get('num_frames')} frames at "
                 f"{settings.get('height')}x{settings.get('width')}, {settings.get('steps')} steps; device "
                 f"{esc(report['environment']['device'])}. Overall: <span class='{verdict}'>{verdict}</span>.</p>")
    parts.append("<h2>Cases</h2><table><tr><th>case</th><th>status</th><th>seconds / clip</th><th>speed-up</th>"
                 "<th>SSIM 4:2:0</th><th>PSNR 4:2:0 (dB)</th><th>SSIM Y</th><th>PSNR Y (dB)</th>"
                 "<th>worst frame SSIM</th><th>LPIPS</th><th>audio cosine</th><th>SI-SDR (dB)</th><th>audio corr.</th>"
                 "<th>RMS ratio</th><th>gates</th></tr>")
    for name, case in report["cases"].items():
        summary = case.get("summary") or {}
        speed = case["speed"]
        gates = case.get("gates") or {}
        failed_gates = [g for g, r in gates.items() if not r["passed"]]
        gate_cell = ("-" if not gates else ("<span class='pass'>pass</span>" if not failed_gates else
                     "<span class='fail'>" + esc(", ".join(failed_gates)) + "</span>"))  # fmt: skip
        status = case["status"] if not case.get("error") else f"failed: {case['error']}"
        cls = " class='fail'" if case.get("error") else ""
        parts.append(f"<tr><th>{esc(name)}</th><td{cls}>{esc(status)}</td><td>{_fmt(speed.get('seconds'), 2)}</td>"
                     f"<td>{_fmt(speed.get('speedup_vs_reference'), 2)}</td>"
                     + "".join(f"<td>{_fmt(summary.get(k), d)}</td>" for k, d in
                               (("ssim_yuv420", 4), ("psnr_yuv420", 2), ("ssim_y", 4), ("psnr_y", 2),
                                ("worst_frame_ssim_yuv420", 4), ("lpips", 4), ("audio_cosine", 4),
                                ("audio_si_sdr_db", 2), ("audio_correlation", 4), ("rms_ratio", 4)))
                     + f"<td>{gate_cell}</td></tr>")  # fmt: skip
    parts.append("</table><p>Each value is the worst clip of the case (lowest similarity, highest LPIPS, the RMS ratio "
                 "farthest from 1); seconds: median wall time of a clip (generation, decode, MP4), the first clip of a "
                 "case excluded when there are more (it compiles). Descriptions:</p><ul>")  # fmt: skip
    for name, case in report["cases"].items():
        applied = "".join(f"<br><small>{esc(line)}</small>" for line in case.get("applied") or ())
        parts.append(f"<li><b>{esc(name)}</b>: {esc(case['description'])}{applied}</li>")
    parts.append("</ul>")
    for name, case in report["cases"].items():
        for clip in case.get("clips") or ():
            prompt = settings["prompts"][clip["prompt_index"]]
            parts.append(f"<h3>{esc(name)} — prompt {clip['prompt_index']} (\"{esc(prompt[:120])}\"), seed "
                         f"{clip['seed']}</h3>")  # fmt: skip
            cache = (clip.get("generation") or {}).get("cache")
            if cache:
                parts.append(f"<p>step cache: {esc('; '.join(f'{k}: {v}' for k, v in cache.items()))}</p>")
            lpips = clip["metrics"]["lpips"]
            parts.append(f"<p>{esc(_clip_line(clip['summary']))}"
                         + ("" if lpips.get("value") is not None else f"; LPIPS not computed: {esc(lpips['reason'])}")
                         + "</p>")  # fmt: skip
            for key, alt in (("frames", "frame strip"), ("psnr_ssim", "per-frame PSNR and SSIM"),
                             ("spectrograms", "spectrograms")):  # fmt: skip
                if key in (clip.get("images") or {}):
                    parts.append(f"<p><img src='{esc(clip['images'][key])}' alt='{alt}'></p>")
    parts.append("</body></html>")
    path = Path(out_dir) / "index.html"
    path.write_text("\n".join(parts))
    return path


def _clip_line(summary: Dict[str, Any]) -> str:
    return (f"SSIM 4:2:0 {_fmt(summary['ssim_yuv420'])}, PSNR 4:2:0 {_fmt(summary['psnr_yuv420'], 2)} dB, SSIM Y "
            f"{_fmt(summary['ssim_y'])} (worst frame {_fmt(summary['worst_frame_ssim_yuv420'])}, drift "
            f"{_fmt(summary['ssim_yuv420_drift_per_s'])}/s), audio cosine {_fmt(summary['audio_cosine'])}, SI-SDR "
            f"{_fmt(summary.get('audio_si_sdr_db'), 2)} dB, correlation {_fmt(summary.get('audio_correlation'))}, "
            f"RMS ratio "
            f"{_fmt(summary['rms_ratio'])}")  # fmt: skip
