"""The fidelity metrics against values computed independently here (formulas, closed forms, numpy)."""

import math

import numpy as np
import pytest
import torch

from diffusers_h3 import export_to_video
from diffusers_h3.fidelity import compare_clips, read_clip
from diffusers_h3.fidelity.clips import Clip, clip_from_output
from diffusers_h3.fidelity.metrics import (
    audio_metrics,
    plane_metrics,
    psnr_per_frame,
    rgb_to_yuv420,
    ssim_per_frame,
    temporal_summary,
)


def _planes(frames=3, height=32, width=48, seed=0):
    generator = torch.Generator().manual_seed(seed)
    # Values in [10, 245]: the test's offsets below never clip.
    y = torch.randint(10, 246, (frames, height, width), generator=generator, dtype=torch.int32)
    u = torch.randint(10, 246, (frames, height // 2, width // 2), generator=generator, dtype=torch.int32)
    v = torch.randint(10, 246, (frames, height // 2, width // 2), generator=generator, dtype=torch.int32)
    return [p.to(torch.uint8) for p in (y, u, v)]


def _offset(plane, amplitude):
    """``plane`` plus a checkerboard of +-amplitude: every pixel moves by exactly ``amplitude`` (MSE = amplitude^2)."""
    rows = torch.arange(plane.shape[-2])[:, None]
    cols = torch.arange(plane.shape[-1])[None, :]
    sign = ((rows + cols) % 2) * 2 - 1
    return (plane.int() + amplitude * sign).to(torch.uint8)


def test_identical_planes_give_infinite_psnr_and_ssim_one():
    planes = _planes()
    metrics = plane_metrics(planes, [p.clone() for p in planes])
    assert torch.isinf(metrics["psnr_y"]).all() and torch.isinf(metrics["psnr_yuv420"]).all()
    assert torch.allclose(metrics["ssim_y"], torch.ones(3, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(metrics["ssim_yuv420"], torch.ones(3, dtype=torch.float64), atol=1e-12)


def test_known_noise_gives_the_psnr_formula():
    planes = _planes()
    for amplitude in (1, 3, 7):
        expected = 10 * math.log10(255.0**2 / amplitude**2)
        assert psnr_per_frame(planes[0], _offset(planes[0], amplitude)).tolist() == pytest.approx([expected] * 3)
    # 4:2:0: the planes' MSEs weighted 4:1:1 by pixel count (ffmpeg's "average"), not the mean of the PSNRs.
    moved = [_offset(planes[0], 2), _offset(planes[1], 4), _offset(planes[2], 8)]
    mse = (4 * 2**2 + 4**2 + 8**2) / 6
    assert plane_metrics(planes, moved)["psnr_yuv420"].tolist() == pytest.approx([10 * math.log10(255**2 / mse)] * 3)


def test_ssim_of_constant_planes_is_the_closed_form():
    # Constant planes have no variance or covariance: SSIM = (2ab + C1) / (a^2 + b^2 + C1), window or not.
    a, b = 100.0, 140.0
    c1 = (0.01 * 255) ** 2
    x = torch.full((2, 20, 24), int(a), dtype=torch.uint8)
    y = torch.full((2, 20, 24), int(b), dtype=torch.uint8)
    assert ssim_per_frame(x, y).tolist() == pytest.approx([(2 * a * b + c1) / (a * a + b * b + c1)] * 2, rel=1e-12)


def test_ssim_falls_with_the_noise():
    plane = _planes()[0]
    values = [float(ssim_per_frame(plane, _offset(plane, a)).mean()) for a in (0, 2, 8, 30)]
    assert values[0] == pytest.approx(1.0) and values == sorted(values, reverse=True) and values[-1] < 0.9


def test_psnr_mean_is_that_of_the_mean_mse():
    # One identical frame must not make the clip's PSNR infinite: the mean is the PSNR of the mean MSE.
    planes = _planes(frames=2)
    moved = [torch.stack([planes[0][0], _offset(planes[0][1], 4)])] + planes[1:]
    metrics = plane_metrics(planes, moved)
    summary = temporal_summary(metrics["psnr_y"], fps=24.0, mse=metrics["mse_y"])
    assert summary["mean"] == pytest.approx(10 * math.log10(255**2 / (16 / 2)))
    assert summary["worst_frame"] == 1 and summary["drift_per_s"] is None  # one finite frame: no slope


def test_temporal_summary_drift_is_the_slope_per_second():
    values = torch.tensor([0.99, 0.97, 0.95, 0.93], dtype=torch.float64)
    summary = temporal_summary(values, fps=2.0)  # frames 0.5 s apart: -0.02 per frame = -0.04 per second
    assert summary["drift_per_s"] == pytest.approx(-0.04) and summary["worst"] == pytest.approx(0.93)
    assert summary["worst_frame"] == 3 and summary["mean"] == pytest.approx(0.96)


def test_rgb_to_yuv420_uses_bt601_limited_range():
    frames = torch.zeros(2, 4, 4, 3, dtype=torch.uint8)
    frames[1] = 255
    y, u, v = rgb_to_yuv420(frames)
    assert y[0].unique().tolist() == [16] and y[1].unique().tolist() == [235]
    assert u.unique().tolist() == [128] and v.unique().tolist() == [128] and u.shape == (2, 2, 2)


def _tone(seconds=1.0, rate=32000):
    t = np.arange(int(rate * seconds)) / rate
    return torch.tensor(np.stack([0.3 * np.sin(2 * np.pi * 440 * t), 0.2 * np.sin(2 * np.pi * 660 * t)]))


def test_audio_of_a_scaled_signal():
    audio = _tone()
    result = audio_metrics(audio, 0.5 * audio, 32000)
    assert result["spectral_cosine"] == pytest.approx(1.0, abs=1e-9)
    rms = float(np.sqrt(np.mean(audio.numpy() ** 2)))
    assert result["rms_reference"] == pytest.approx(rms)
    assert result["rms_ratio"] == pytest.approx(float(np.sqrt(np.mean((0.5 * audio.numpy()) ** 2))) / rms)
    assert result["rms_ratio"] == pytest.approx(0.5)


def test_audio_cosine_drops_for_another_sound():
    other = _tone()
    other[:, ::2] *= -1  # a different spectrum (the tones mirrored to Nyquist - f), same RMS
    result = audio_metrics(_tone(), other, 32000)
    assert result["spectral_cosine"] < 0.9 and result["rms_ratio"] == pytest.approx(1.0)
    silent = audio_metrics(_tone(), torch.zeros_like(_tone()), 32000)
    assert silent["spectral_cosine"] == 0.0 and silent["rms_ratio"] == 0.0


def _clip_file(path, frames, audio):
    return export_to_video(frames[None], path, fps=24, audio=audio[None].float().numpy(), sampling_rate=32000)


def test_compare_reads_mp4_files(tmp_path):
    yy, xx = np.meshgrid(np.linspace(0, 1, 64), np.linspace(0, 1, 96), indexing="ij")
    picture = np.stack([yy, xx, 0.5 * (yy + xx)], axis=-1)
    frames = np.stack([picture * (0.5 + 0.5 * i / 23) for i in range(24)]).astype(np.float32)
    a = _clip_file(tmp_path / "a.mp4", frames, _tone())
    b = _clip_file(tmp_path / "b.mp4", frames, _tone())
    record = compare_clips(a, b)
    assert record["identical_video"] and record["psnr_y"]["mean"] == math.inf
    assert record["ssim_yuv420"]["mean"] == pytest.approx(1.0) and record["frames"] == 24
    assert record["audio"]["spectral_cosine"] == pytest.approx(1.0) and record["audio"]["rms_ratio"] == 1.0
    # The file's planes are what libx264 stored: near the BT.601 conversion of the frames we wrote.
    clip = read_clip(a)
    source = clip_from_output(frames, _tone(), 32000)
    assert clip.planes[0].shape == (24, 64, 96) and clip.planes[1].shape == (24, 32, 48)
    assert float(psnr_per_frame(clip.planes[0], source.planes[0]).min()) > 35
    darker = _clip_file(tmp_path / "c.mp4", frames * 0.8, _tone())
    record = compare_clips(a, darker)
    assert not record["identical_video"] and 10 < record["psnr_y"]["mean"] < 40


def test_clips_of_other_lengths_are_refused():
    rgb = torch.zeros(4, 16, 16, 3, dtype=torch.uint8)
    a = Clip(rgb_to_yuv420(rgb), rgb, 24.0, None, None, "a")
    b = Clip(rgb_to_yuv420(rgb[:3]), rgb[:3], 24.0, None, None, "b")
    with pytest.raises(ValueError, match="4 and 3 frames"):
        compare_clips(a, b)


# ---- SI-SDR and waveform correlation --------------------------------------------------------------------------------
def test_si_sdr_matches_a_hand_computation_on_synthetic_signals():
    from diffusers_h3.fidelity.metrics import si_sdr_db

    n = 4000
    t = np.arange(n)
    s = np.sin(2 * np.pi * t / 50.0) + 0.25  # a tone with a DC offset (SI-SDR removes it)
    noise = np.cos(2 * np.pi * t / 7.0)  # another tone, not orthogonal to s after zero-meaning only by accident
    estimate = 0.7 * s + 0.1 * noise
    # by hand: zero-mean both, project the estimate on the reference, energy of the projection over the residual
    s0, e0 = s - s.mean(), estimate - estimate.mean()
    alpha = np.dot(e0, s0) / np.dot(s0, s0)
    target, residual = alpha * s0, e0 - alpha * s0
    expected = 10 * np.log10(np.sum(target**2) / np.sum(residual**2))
    got = si_sdr_db(torch.tensor(np.stack([s, s])), torch.tensor(np.stack([estimate, 2.0 * s])))
    assert got[0] == pytest.approx(expected, abs=1e-9)
    # s and noise are (nearly) orthogonal tones: 0.7 s against 0.1 noise is 20 log10(7) dB = 16.9 dB
    assert got[0] == pytest.approx(20 * np.log10(7.0), abs=0.05)
    assert got[1] == math.inf  # a scaled copy is perfect: scale-invariant


def test_si_sdr_and_correlation_edge_cases():
    from diffusers_h3.fidelity.metrics import si_sdr_db, waveform_correlation

    tone = _tone(0.25)
    # inverted: a scale of -1 reproduces it (SI-SDR is blind to the sign), the correlation is not
    assert si_sdr_db(tone, -tone) == [math.inf, math.inf]
    assert waveform_correlation(tone, -tone) == pytest.approx([-1.0, -1.0])
    silent = torch.zeros_like(tone)
    assert si_sdr_db(silent, silent) == [math.inf, math.inf] and si_sdr_db(silent, tone) == [-math.inf, -math.inf]
    assert waveform_correlation(silent, silent) == [1.0, 1.0] and waveform_correlation(silent, tone) == [0.0, 0.0]


def test_correlation_matches_numpy_per_channel():
    from diffusers_h3.fidelity.metrics import waveform_correlation

    g = np.random.default_rng(0)
    a, b = g.standard_normal((2, 3000)), g.standard_normal((2, 3000))
    mixed = a + 0.5 * b
    got = waveform_correlation(torch.tensor(a), torch.tensor(mixed))
    assert got == pytest.approx([np.corrcoef(a[c], mixed[c])[0, 1] for c in range(2)], abs=1e-12)


def test_audio_metrics_report_the_worst_channel():
    clean = _tone()
    noisy = clean.clone()
    noisy[1] += 0.05 * torch.sin(torch.arange(clean.shape[1], dtype=torch.float64) * 0.37)
    result = audio_metrics(clean, noisy, 32000)
    assert result["si_sdr_db_per_channel"][0] == math.inf and math.isfinite(result["si_sdr_db_per_channel"][1])
    assert result["si_sdr_db"] == result["si_sdr_db_per_channel"][1]
    assert result["correlation"] == min(result["correlation_per_channel"]) < 1.0
