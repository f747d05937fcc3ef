"""`export_to_video`'s encoder options reach the file (read back with PyAV), and bad options are one line, refused
before any frame is converted or any file is created."""

import os

import numpy as np
import pytest

from diffusers_h3 import export_to_video
from diffusers_h3._video_encoding import DEFAULT_CRF, DEFAULT_PIX_FMT, DEFAULT_PRESET, X264_PRESETS
from diffusers_h3.pipelines import export


av = pytest.importorskip("av")

RATE = 32000


def _clip(num_frames=12, height=64, width=96):
    """Smooth moving content (coded well at any crf, so that a crf change shows in the size)."""
    y, x = np.meshgrid(np.linspace(0, 1, height), np.linspace(0, 1, width), indexing="ij")
    frames = [np.stack([0.5 + 0.4 * np.sin(6 * x + f / 3), y, 0.5 + 0.4 * np.cos(5 * y - f / 4)], -1) for f in range(num_frames)]
    return np.stack(frames).astype(np.float32)


def _audio(seconds=0.5):
    t = np.arange(int(RATE * seconds)) / RATE
    return np.stack([0.3 * np.sin(2 * np.pi * 440 * t), 0.2 * np.sin(2 * np.pi * 660 * t)]).astype(np.float32)


def _x264_settings(path) -> str:
    """libx264 writes its settings (`crf=... / preset-dependent options`) into the stream's SEI as text."""
    data = open(path, "rb").read()
    start = data.index(b"x264 - core")
    return data[start : data.index(b"\x00", start)].decode("ascii", "replace")


def _read_back(path):
    with av.open(str(path)) as container:
        video = container.streams.video[0]
        audio = container.streams.audio
        info = {
            "codec": video.codec_context.name,
            "pix_fmt": video.codec_context.pix_fmt,
            "fps": video.average_rate,
            "frames": sum(1 for _ in container.decode(video)),
            "audio": [(a.codec_context.name, a.codec_context.channels, a.codec_context.sample_rate) for a in audio],
        }
    return info


@pytest.mark.parametrize("crf, preset, pix_fmt", [(DEFAULT_CRF, DEFAULT_PRESET, DEFAULT_PIX_FMT), (30, "ultrafast", "yuv444p"),
                                                  (12, "medium", "yuv422p")])  # fmt: skip
def test_options_reach_the_file(tmp_path, crf, preset, pix_fmt):
    path = export_to_video(_clip(), tmp_path / "clip.mp4", fps=12, audio=_audio(), sampling_rate=RATE, crf=crf,
                           preset=preset, pix_fmt=pix_fmt)  # fmt: skip
    assert path == str(tmp_path / "clip.mp4")
    info = _read_back(path)
    assert info == {"codec": "h264", "pix_fmt": pix_fmt, "fps": 12, "frames": 12, "audio": [("aac", 2, RATE)]}
    settings = _x264_settings(path)
    assert f"crf={crf}.0" in settings, settings
    # ultrafast turns CABAC off and uses one reference frame; medium uses CABAC and three.
    assert ("cabac=0" in settings) == (preset == "ultrafast") and ("ref=3" in settings) == (preset == "medium"), settings


def test_defaults_are_the_documented_ones():
    import inspect

    for function in (export_to_video, export.VideoWriter):
        parameters = inspect.signature(function).parameters
        assert parameters["crf"].default == DEFAULT_CRF and parameters["preset"].default == DEFAULT_PRESET
        assert parameters["pix_fmt"].default == "yuv420p"  # the pixel format every player decodes


def test_lower_crf_is_a_larger_closer_file(tmp_path):
    frames = _clip(24)
    source = (frames * 255).round()
    sizes, errors = {}, {}
    for crf in (10, 35):
        path = export_to_video(frames, tmp_path / f"crf{crf}.mp4", crf=crf, pix_fmt="yuv444p")
        sizes[crf] = os.path.getsize(path)
        with av.open(path) as container:
            decoded = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)]).astype(float)
        errors[crf] = np.abs(decoded - source).mean()
    assert sizes[10] > sizes[35] and errors[10] < errors[35], (sizes, errors)


def test_no_audio_writes_no_audio_stream(tmp_path):
    info = _read_back(export_to_video(_clip(), tmp_path / "silent.mp4"))
    assert info["audio"] == [] and info["frames"] == 12


@pytest.mark.parametrize(
    "options, message",
    [
        ({"crf": 52}, r"^`crf` must be from 0 to 51, got 52 — "),
        ({"crf": -1}, r"^`crf` must be from 0 to 51, got -1 — "),
        ({"crf": 18.0}, r"^`crf` must be an integer, got 18\.0 — "),
        ({"crf": True}, r"^`crf` must be an integer"),
        ({"preset": "fastest"}, r"^`preset` 'fastest' is not an x264 preset — choose one of ultrafast, "),
        ({"pix_fmt": "rgb24"}, r"^`pix_fmt` 'rgb24' is not supported — choose one of yuv420p, yuv422p, yuv444p$"),
        ({"fps": 0}, r"^`fps` must be a positive number, got 0\.$"),
        ({"fps": "24"}, r"^`fps` must be a positive number, got '24'\.$"),
    ],
)
def test_bad_options_are_one_line_before_any_work(tmp_path, monkeypatch, options, message):
    def refuse(*args, **kwargs):
        raise AssertionError("frames were converted before the options were checked")

    monkeypatch.setattr(export, "_frames_to_uint8", refuse)
    with pytest.raises(ValueError, match=message) as raised:
        export_to_video(_clip(), tmp_path / "clip.mp4", **options)
    assert "\n" not in str(raised.value)
    assert os.listdir(tmp_path) == []


def test_every_preset_is_one_libx264_takes(tmp_path):
    # The option list is ours; libx264 must accept every name in it (a typo would fail only at export time).
    frames = _clip(2, 32, 32)
    for preset in X264_PRESETS:
        assert _x264_settings(export_to_video(frames, tmp_path / f"{preset}.mp4", preset=preset))


def test_odd_sizes_follow_the_pixel_format(tmp_path):
    odd_height = _clip(2, 33, 32)
    with pytest.raises(ValueError, match=r"H\.264 \(yuv420p\) needs even height and width, got height=33"):
        export_to_video(odd_height, tmp_path / "a.mp4")
    with pytest.raises(ValueError, match=r"H\.264 \(yuv422p\) needs an even width"):
        export_to_video(_clip(2, 32, 33), tmp_path / "b.mp4", pix_fmt="yuv422p")
    assert os.listdir(tmp_path) == []
    assert _read_back(export_to_video(odd_height, tmp_path / "c.mp4", pix_fmt="yuv444p"))["frames"] == 2
