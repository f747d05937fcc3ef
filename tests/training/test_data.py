"""The data folder: one line naming every problem, before any model loads."""

import numpy as np
import pytest

from .conftest import TRAIN_CANVAS, clip_audio, clip_frames, train_config


def test_bad_folder_is_reported_in_one_line_before_training(tmp_path, demo_model, monkeypatch):
    from PIL import Image

    from diffusers_h3.training import DataFolderError, train_lora, write_clip, write_metadata
    from diffusers_h3.training import cache as cache_module

    write_clip(tmp_path / "good.mp4", clip_frames(0), clip_audio(0), 32000)
    write_clip(tmp_path / "short.mp4", clip_frames(0, 10), clip_audio(0, 10), 32000)
    write_clip(tmp_path / "silent.mp4", clip_frames(1), None, 32000)
    (tmp_path / "broken.mp4").write_bytes(b"\x00\x01 not a video")
    write_clip(tmp_path / "uncaptioned.mp4", clip_frames(1), clip_audio(1), 32000)
    Image.fromarray(clip_frames(0)[0]).save(tmp_path / "still.png")
    write_metadata(tmp_path, [("good.mp4", "fine"), ("short.mp4", "too short"), ("silent.mp4", "no sound"),
                              ("broken.mp4", "cannot decode"), ("still.png", "  "), ("gone.mp4", "missing")])  # fmt: skip
    monkeypatch.setattr(cache_module, "_load_pipeline", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(DataFolderError) as error:
        train_lora(train_config(demo_model, tmp_path, tmp_path / "out"))
    message = str(error.value)
    assert "\n" not in message
    assert "6 problems" in message
    for expected in ("short.mp4: 10 frames at 24 fps, the clips must have at least 22", "silent.mp4: no audio track",
                     "broken.mp4: cannot decode", "still.png: no caption", "gone.mp4: file not found",
                     "uncaptioned.mp4: no caption (not in metadata.jsonl)"):  # fmt: skip
        assert expected in message, expected
    assert "good.mp4" not in message
    assert not (tmp_path / "out" / "cache").exists()


def test_missing_metadata_and_not_a_folder(tmp_path):
    from diffusers_h3.training import DataFolderError, check_data_folder

    with pytest.raises(DataFolderError, match="no metadata.jsonl — write one line per clip"):
        check_data_folder(tmp_path, 22)
    with pytest.raises(DataFolderError, match="not a folder"):
        check_data_folder(tmp_path / "nope", 22)


def test_clips_are_resampled_to_24_fps_and_fitted_to_the_canvas(tmp_path):
    """A 48 fps clip keeps every other frame; a larger frame is cover-resized and centre-cropped."""
    from diffusers_h3.training import decode_sample, read_metadata, write_clip, write_metadata

    frames = np.zeros((44, 128, 192, 3), np.uint8)
    for i in range(44):
        frames[i, :, :, 0] = 5 * i  # the frame index, readable after compression
    write_clip(tmp_path / "fast.mp4", frames, clip_audio(0, 22), 32000, fps=48)
    write_metadata(tmp_path, [("fast.mp4", "a ramp")])
    items, problems = read_metadata(tmp_path)
    assert not problems
    sample = decode_sample(items[0], 22, TRAIN_CANVAS["height"], TRAIN_CANVAS["width"], 32000)
    assert sample.frames.shape == (22, 64, 96, 3)
    red = sample.frames[:, 32, 48, 0].astype(float)
    assert np.allclose(red, 10 * np.arange(22), atol=4)
    assert sample.audio.shape == (2, round(22 / 24 * 32000))
