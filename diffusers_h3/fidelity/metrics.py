# Copyright 2026 The diffusers-h3 authors. Licensed under the Apache License, Version 2.0.
"""Distances between two clips, in pure torch: PSNR and SSIM per frame over 8-bit YUV 4:2:0 planes, a log-mel
spectral cosine, an RMS ratio, SI-SDR and waveform correlation for the audio, and LPIPS when its network weights are on this machine.

torchvision has no PSNR / SSIM and torchmetrics is not a dependency (its SSIM is the same Gaussian-window SSIM as
this one); the formulas are short, so they live here.

Definitions (docs/fidelity.md):

* **Frames as YUV 4:2:0, 8 bit.** The planes an H.264 `yuv420p` MP4 stores, read as stored; pipeline output (RGB in
  [0, 1]) is converted with BT.601 limited range and 2x2 chroma averaging, what the export's `yuv420p` conversion does.
* **PSNR** per plane: ``10 log10(255^2 / MSE)``, infinite for identical planes. ``yuv420`` combines the planes as
  ffmpeg's `psnr` filter does: the MSE weighted by pixel count (Y 4/6, U 1/6, V 1/6), then the PSNR of that.
* **SSIM** per plane (Wang et al. 2004): 11x11 Gaussian window (sigma 1.5), K1 = 0.01, K2 = 0.03, data range 255,
  the mean of the SSIM map over the window positions inside the plane. ``yuv420`` weights the planes' SSIM 4:1:1,
  as ffmpeg's `ssim` filter's "All".
* **Audio spectral cosine**: the cosine between the two log-mel spectrograms (both channels; 64 mel bands, 1024-point
  Hann STFT, hop 10 ms), each in dB relative to its own peak and floored 80 dB below it. Relative to each clip's own
  peak, so a louder copy of the same sound scores 1: loudness is the RMS ratio's job.
* **RMS ratio**: the candidate's RMS over the reference's, over all samples of both channels.
* **SI-SDR** per channel (scale-invariant signal-to-distortion ratio, Le Roux et al. 2019), in dB: both channels made
  zero-mean, the reference scaled by ``alpha = <candidate, reference> / ||reference||^2`` (the projection of the
  candidate on it), then ``10 log10(||alpha reference||^2 / ||candidate - alpha reference||^2)``. Infinite for a
  candidate that is a nonzero multiple of the reference (an inverted copy too: the correlation tells those apart).
  It compares waveforms sample by sample, so two clips of the same spectrum but another phase (another seed) score
  far below 0 dB where the spectral cosine stays near 1.
* **Waveform correlation** per channel: Pearson's correlation of the samples (1 for identical channels).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F


PIXEL_MAX = 255.0
SSIM_WINDOW = 11
SSIM_SIGMA = 1.5
SSIM_K1, SSIM_K2 = 0.01, 0.03
# ffmpeg's psnr / ssim filters: a 4:2:0 frame has 4 luma samples per chroma sample of each plane.
YUV420_PLANE_WEIGHTS = (4.0 / 6.0, 1.0 / 6.0, 1.0 / 6.0)
MEL_BANDS = 64
STFT_SIZE = 1024
HOP_SECONDS = 0.010
DB_RANGE = 80.0


# ---------------------------------------------------------------------------------------------------------------------
# Frames
# ---------------------------------------------------------------------------------------------------------------------
def rgb_to_yuv420(frames: torch.Tensor) -> List[torch.Tensor]:
    """uint8 (or [0, 1] float) RGB frames ``(F, H, W, 3)`` -> ``[Y (F, H, W), U (F, H/2, W/2), V]`` as uint8, BT.601
    limited range (Y in 16..235), chroma averaged over 2x2 blocks; H and W must be even (as H.264 yuv420p needs)."""
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be (F, H, W, 3) RGB, got {tuple(frames.shape)}.")
    if frames.shape[1] % 2 or frames.shape[2] % 2:
        raise ValueError(f"YUV 4:2:0 needs an even height and width, got {frames.shape[1]}x{frames.shape[2]}.")
    rgb = frames.float() / PIXEL_MAX if frames.dtype == torch.uint8 else frames.float()
    r, g, b = rgb.unbind(-1)
    y = 16.0 + 65.481 * r + 128.553 * g + 24.966 * b
    u = 128.0 - 37.797 * r - 74.203 * g + 112.0 * b
    v = 128.0 + 112.0 * r - 93.786 * g - 18.214 * b
    planes = [y]
    for chroma in (u, v):
        planes.append(F.avg_pool2d(chroma[:, None], 2)[:, 0])
    return [plane.round().clamp(0, 255).to(torch.uint8) for plane in planes]


def _mse_per_frame(a: torch.Tensor, b: torch.Tensor, device=None) -> torch.Tensor:
    device = torch.device(device) if device is not None else a.device
    return torch.stack([(a[i].to(device, torch.float64) - b[i].to(device, torch.float64)).pow(2).mean()
                        for i in range(a.shape[0])]).cpu()  # fmt: skip


def psnr_from_mse(mse: torch.Tensor) -> torch.Tensor:
    """PSNR in dB for 8-bit data; ``inf`` where the MSE is 0."""
    return 10.0 * torch.log10(PIXEL_MAX**2 / mse)


def psnr_per_frame(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """PSNR of each frame of two uint8 planes ``(F, H, W)`` (float64, ``inf`` for identical frames)."""
    _check_same_shape(a, b)
    return psnr_from_mse(_mse_per_frame(a, b))


def _gaussian_window(device) -> torch.Tensor:
    offsets = torch.arange(SSIM_WINDOW, dtype=torch.float64) - (SSIM_WINDOW - 1) / 2
    weights = torch.exp(-(offsets**2) / (2 * SSIM_SIGMA**2))
    return (weights / weights.sum()).to(device)


def ssim_per_frame(a: torch.Tensor, b: torch.Tensor, chunk: int = 8, device=None) -> torch.Tensor:
    """Mean SSIM of each frame of two uint8 planes ``(F, H, W)`` (float64; 1 for identical frames). The statistics
    are Gaussian-weighted over the window positions that lie inside the plane (no padding), in float64 (in float32 the
    variances ``E[x^2] - E[x]^2`` of 8-bit data lose about 1e-5 of SSIM to cancellation) on ``device`` (default: the
    planes')."""
    _check_same_shape(a, b)
    if min(a.shape[-2:]) < SSIM_WINDOW:
        raise ValueError(f"SSIM's {SSIM_WINDOW}x{SSIM_WINDOW} window needs planes of at least that size, got "
                         f"{tuple(a.shape[-2:])}.")  # fmt: skip
    device = torch.device(device) if device is not None else a.device
    window = _gaussian_window(device)
    rows, cols = window.view(1, 1, -1, 1), window.view(1, 1, 1, -1)
    c1, c2 = (SSIM_K1 * PIXEL_MAX) ** 2, (SSIM_K2 * PIXEL_MAX) ** 2
    out = []
    for start in range(0, a.shape[0], chunk):  # bounded memory for long, large clips
        x = a[start : start + chunk, None].to(device, torch.float64)
        y = b[start : start + chunk, None].to(device, torch.float64)
        stack = torch.cat([x, y, x * x, y * y, x * y])
        filtered = F.conv2d(F.conv2d(stack, rows), cols)
        mx, my, xx, yy, xy = filtered.chunk(5)
        vx, vy, cxy = xx - mx * mx, yy - my * my, xy - mx * my
        ssim_map = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
        out.append(ssim_map.flatten(1).mean(1).cpu())
    return torch.cat(out)


def plane_metrics(planes_a: Sequence[torch.Tensor], planes_b: Sequence[torch.Tensor], device=None
                  ) -> Dict[str, torch.Tensor]:  # fmt: skip
    """Per-frame ``psnr_y``, ``ssim_y``, ``psnr_yuv420`` and ``ssim_yuv420`` of two ``[Y, U, V]`` uint8 clips, and the
    per-frame MSEs the PSNRs come from (``mse_y``, ``mse_yuv420``); computed on ``device`` (default: the planes')."""
    mses = [_mse_per_frame(pa, pb, device) for pa, pb in zip(planes_a, planes_b)]
    ssims = [ssim_per_frame(pa, pb, device=device) for pa, pb in zip(planes_a, planes_b)]
    weights = YUV420_PLANE_WEIGHTS
    mse_yuv420 = sum(w * m for w, m in zip(weights, mses))
    return {
        "psnr_y": psnr_from_mse(mses[0]),
        "ssim_y": ssims[0],
        "psnr_yuv420": psnr_from_mse(mse_yuv420),
        "ssim_yuv420": sum(w * s for w, s in zip(weights, ssims)),
        "mse_y": mses[0],
        "mse_yuv420": mse_yuv420,
    }


def temporal_summary(values: torch.Tensor, fps: float, mse: Optional[torch.Tensor] = None) -> Dict[str, Optional[float]]:
    """``mean``, ``worst`` (the lowest) with its ``worst_frame``, and ``drift_per_s``: the least-squares slope of the
    per-frame values over time (per second; negative: the clip departs further as it plays), over the finite values
    only (``None`` with fewer than two). For a PSNR pass its per-frame ``mse``: the mean is then the PSNR of the mean
    MSE (ffmpeg's "average"), infinite only when every frame is identical, not as soon as one is."""
    values = values.double().cpu()
    worst_frame = int(values.argmin())
    finite = torch.isfinite(values)
    drift = None
    if int(finite.sum()) >= 2:
        t = torch.arange(len(values), dtype=torch.float64)[finite] / fps
        v = values[finite]
        t_centered = t - t.mean()
        denominator = float((t_centered**2).sum())
        drift = float((t_centered * (v - v.mean())).sum()) / denominator if denominator > 0 else 0.0
    mean = float(values.mean()) if mse is None else float(psnr_from_mse(mse.double().mean()))
    return {"mean": mean, "worst": float(values[worst_frame]), "worst_frame": worst_frame,
            "drift_per_s": drift}  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# Audio
# ---------------------------------------------------------------------------------------------------------------------
def _hz_to_mel(hz):
    return 2595.0 * math.log10(1.0 + hz / 700.0) if isinstance(hz, float) else 2595.0 * torch.log10(1.0 + hz / 700.0)


def _mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    return 700.0 * (10.0 ** (mel / 2595.0) - 1.0)


def mel_filterbank(sample_rate: int, n_fft: int = STFT_SIZE, bands: int = MEL_BANDS) -> torch.Tensor:
    """Triangular filters ``(bands, n_fft // 2 + 1)`` on the HTK mel scale from 0 Hz to Nyquist."""
    bins = torch.linspace(0.0, sample_rate / 2, n_fft // 2 + 1, dtype=torch.float64)
    edges = _mel_to_hz(torch.linspace(0.0, _hz_to_mel(sample_rate / 2.0), bands + 2, dtype=torch.float64))
    lower, center, upper = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rising = (bins - lower) / (center - lower)
    falling = (upper - bins) / (upper - center)
    return torch.clamp(torch.minimum(rising, falling), min=0.0)


def log_mel(audio: torch.Tensor, sample_rate: int) -> torch.Tensor:
    """``(channels, bands, frames)`` mel power in dB relative to the clip's own peak, floored at -80 dB."""
    audio = torch.as_tensor(audio, dtype=torch.float64)
    audio = audio[None] if audio.ndim == 1 else audio
    hop = max(1, round(HOP_SECONDS * sample_rate))
    n_fft = STFT_SIZE if audio.shape[-1] >= STFT_SIZE else 1 << max(1, (audio.shape[-1]).bit_length() - 1)
    spectrum = torch.stft(audio, n_fft, hop_length=hop, window=torch.hann_window(n_fft, dtype=torch.float64),
                          return_complex=True).abs().pow(2)  # fmt: skip
    mel = torch.einsum("mf,cft->cmt", mel_filterbank(sample_rate, n_fft), spectrum)
    peak = mel.max()
    if peak <= 0:
        return torch.full_like(mel, -DB_RANGE)
    return 10.0 * torch.log10(torch.clamp(mel / peak, min=10.0 ** (-DB_RANGE / 10)))


def si_sdr_db(reference: torch.Tensor, candidate: torch.Tensor) -> List[float]:
    """SI-SDR in dB of each channel of two ``(channels, samples)`` tracks of the same length (float64). ``inf`` when
    the candidate is exactly a nonzero multiple of the reference, inverted copies included (silent channels: ``inf``
    when both are silent, ``-inf`` when only the reference is)."""
    reference, candidate = (torch.as_tensor(t, dtype=torch.float64) for t in (reference, candidate))
    reference = reference - reference.mean(-1, keepdim=True)
    candidate = candidate - candidate.mean(-1, keepdim=True)
    values = []
    for ref, cand in zip(reference.reshape(-1, reference.shape[-1]), candidate.reshape(-1, candidate.shape[-1])):
        energy = float(ref.pow(2).sum())
        if energy == 0.0:
            values.append(math.inf if float(cand.pow(2).sum()) == 0.0 else -math.inf)
            continue
        target = (float((cand * ref).sum()) / energy) * ref
        target_energy, residual = float(target.pow(2).sum()), float((cand - target).pow(2).sum())
        if residual == 0.0:
            values.append(math.inf)
        elif target_energy == 0.0:
            values.append(-math.inf)
        else:
            values.append(10.0 * math.log10(target_energy / residual))
    return values


def waveform_correlation(reference: torch.Tensor, candidate: torch.Tensor) -> List[float]:
    """Pearson correlation of each channel's samples (float64); a constant channel correlates 1 with an identical
    one and 0 with anything else."""
    reference, candidate = (torch.as_tensor(t, dtype=torch.float64) for t in (reference, candidate))
    values = []
    for ref, cand in zip(reference.reshape(-1, reference.shape[-1]), candidate.reshape(-1, candidate.shape[-1])):
        ref_c, cand_c = ref - ref.mean(), cand - cand.mean()
        norms = float(ref_c.norm() * cand_c.norm())
        if norms == 0.0:
            values.append(1.0 if torch.equal(ref, cand) else 0.0)
        else:
            values.append(float((ref_c * cand_c).sum()) / norms)
    return values


def audio_metrics(reference: torch.Tensor, candidate: torch.Tensor, sample_rate: int) -> Dict[str, Optional[float]]:
    """``spectral_cosine`` (log-mel), ``rms_ratio`` (candidate / reference), ``si_sdr_db`` and ``correlation`` (the
    worst channel's; ``..._per_channel`` lists every channel's) of two ``(channels, samples)`` tracks; the longer one is
    cut to the shorter (AAC pads its last frame)."""
    reference, candidate = (torch.as_tensor(t, dtype=torch.float64) for t in (reference, candidate))
    if reference.shape[:-1] != candidate.shape[:-1]:
        raise ValueError(f"the audio tracks have {reference.shape[0]} and {candidate.shape[0]} channels.")
    length = min(reference.shape[-1], candidate.shape[-1])
    reference, candidate = reference[..., :length], candidate[..., :length]
    ref_rms, cand_rms = float(reference.pow(2).mean().sqrt()), float(candidate.pow(2).mean().sqrt())
    # Shift the dB values to [0, 80] above each clip's floor: silence is 0, the cosine compares where the energy is.
    ref_mel = log_mel(reference, sample_rate) + DB_RANGE
    cand_mel = log_mel(candidate, sample_rate) + DB_RANGE
    norms = float(ref_mel.norm() * cand_mel.norm())
    if norms == 0.0:  # a silent track: the same only when both are silent
        cosine = 1.0 if ref_rms == cand_rms == 0.0 else 0.0
    else:
        cosine = float((ref_mel * cand_mel).sum()) / norms
    si_sdr = si_sdr_db(reference, candidate)
    correlation = waveform_correlation(reference, candidate)
    return {
        "spectral_cosine": cosine,
        "si_sdr_db": min(si_sdr),
        "si_sdr_db_per_channel": si_sdr,
        "correlation": min(correlation),
        "correlation_per_channel": correlation,
        "rms_ratio": cand_rms / ref_rms if ref_rms > 0 else (1.0 if cand_rms == 0 else math.inf),
        "rms_reference": ref_rms,
        "rms_candidate": cand_rms,
        "samples": length,
    }


# ---------------------------------------------------------------------------------------------------------------------
# LPIPS (optional)
# ---------------------------------------------------------------------------------------------------------------------
LPIPS_NET = "alex"


def lpips_unavailable_reason() -> Optional[str]:
    """Why LPIPS cannot be computed here without a download (``None`` when it can): it needs the `lpips` package
    (its linear layers ship inside it) and torchvision's AlexNet weights already in the torch hub cache."""
    import importlib.util
    import os

    if importlib.util.find_spec("lpips") is None:
        return "the `lpips` package is not installed (pip install lpips)"
    from torchvision.models import AlexNet_Weights

    url = AlexNet_Weights.IMAGENET1K_V1.url
    cached = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(url))
    if not os.path.isfile(cached):
        return f"torchvision's AlexNet weights are not in the torch hub cache ({cached}); nothing is downloaded"
    return None


def lpips_per_frame(rgb_a: torch.Tensor, rgb_b: torch.Tensor, frames: Sequence[int]) -> torch.Tensor:
    """LPIPS (AlexNet) of the chosen frames of two uint8 ``(F, H, W, 3)`` clips; call only when
    :func:`lpips_unavailable_reason` is ``None``."""
    import lpips

    net = lpips.LPIPS(net=LPIPS_NET, verbose=False).eval()
    index = torch.as_tensor(list(frames), dtype=torch.long)

    def prepare(rgb):
        return rgb[index].permute(0, 3, 1, 2).float() / 127.5 - 1.0

    with torch.no_grad():
        return net(prepare(rgb_a), prepare(rgb_b)).flatten().double()


def _check_same_shape(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(f"planes of different shapes: {tuple(a.shape)} and {tuple(b.shape)}.")
