"""`export_to_video` is atomic: it writes a hidden temporary file beside the target and renames it on success; a
failure mid-write (here: the audio muxing raising after the video packets went out) leaves
an existing file's bytes and no temporary file. Bad paths are refused before anything is encoded."""

import os

import numpy as np
import pytest
import torch

from diffusers_h3 import export_to_video
from diffusers_h3.pipelines import export


av = pytest.importorskip("av")

FRAMES = np.random.default_rng(0).random((6, 32, 32, 3)).astype(np.float32)
AUDIO = (0.1 * torch.randn(2, 3200, generator=torch.Generator().manual_seed(0))).numpy()


def _files(directory):
    return sorted(os.listdir(directory))


def test_success_writes_only_the_target(tmp_path):
    target = tmp_path / "clip.mp4"
    assert export_to_video(FRAMES, target, audio=AUDIO, sampling_rate=32000) == str(target)
    assert _files(tmp_path) == ["clip.mp4"]
    with av.open(str(target)) as container:
        assert len(container.streams.video) == 1 and len(container.streams.audio) == 1


@pytest.mark.parametrize("error", [RuntimeError("encoder failed"), KeyboardInterrupt()])
def test_failure_mid_write_keeps_the_existing_file_and_leaves_no_temporary(tmp_path, monkeypatch, error):
    target = tmp_path / "clip.mp4"
    export_to_video(FRAMES, target, audio=AUDIO)
    good = target.read_bytes()
    written = []

    def failing_write_audio(container, *args, **kwargs):
        # The video stream is already muxed into the file being written when the audio write fails.
        written.extend(name for name in _files(tmp_path) if name != "clip.mp4")
        raise error

    monkeypatch.setattr(export, "_encode_audio", failing_write_audio)
    with pytest.raises(type(error)):
        export_to_video(FRAMES[::-1].copy(), target, audio=AUDIO)
    assert written and all(name.startswith(".clip.mp4.") for name in written), "it wrote beside the target"
    assert target.read_bytes() == good
    assert _files(tmp_path) == ["clip.mp4"]

    fresh = tmp_path / "new.mp4"
    with pytest.raises(type(error)):
        export_to_video(FRAMES, fresh, audio=AUDIO)
    assert not fresh.exists() and _files(tmp_path) == ["clip.mp4"]


def test_bad_paths_are_refused_before_encoding(tmp_path, monkeypatch):
    monkeypatch.setattr(export.VideoWriter, "_open", lambda *a, **k: pytest.fail("must not encode"))
    missing = tmp_path / "no" / "such" / "dir" / "clip.mp4"
    with pytest.raises(FileNotFoundError, match=str(missing.parent)):
        export_to_video(FRAMES, missing)
    with pytest.raises(ValueError, match=r"must end in \.mp4, not \.gif"):
        export_to_video(FRAMES, tmp_path / "clip.gif")
    with pytest.raises(ValueError, match=r"must end in \.mp4"):
        export_to_video(FRAMES, tmp_path / "clip")
    with pytest.raises(IsADirectoryError):
        export_to_video(FRAMES, tmp_path)
    assert _files(tmp_path) == []


def test_a_full_disk_names_the_target_and_the_cause_not_the_temporary(tmp_path, monkeypatch):
    import errno

    target = tmp_path / "clip.mp4"
    export_to_video(FRAMES, target, audio=AUDIO)
    good = target.read_bytes()

    def disk_full(container, *args, **kwargs):  # PyAV's error as the muxer hits ENOSPC, naming the file it writes
        raise av.error.OSError(errno.ENOSPC, "No space left on device", container.name)

    monkeypatch.setattr(export, "_encode_audio", disk_full)
    with pytest.raises(OSError) as raised:
        export_to_video(FRAMES[::-1].copy(), target, audio=AUDIO)
    message = str(raised.value)
    assert raised.value.errno == errno.ENOSPC and "No space left on device" in message
    assert str(target) in message and ".partial" not in message, message
    assert raised.value.__cause__ is None and raised.value.__suppress_context__
    assert target.read_bytes() == good and _files(tmp_path) == ["clip.mp4"]


def test_two_writers_of_one_target_leave_one_complete_clip(tmp_path):
    """Two runs writing the same `--out` (what docs/getting_started.md says): each encodes into its own temporary
    file, and the one that finishes last replaces the target with its complete clip; no mix, no leftovers."""
    from diffusers_h3 import VideoWriter

    target = tmp_path / "clip.mp4"
    long_clip, short_clip = FRAMES, FRAMES[:2]
    first, second = VideoWriter(target, 24, None), VideoWriter(target, 24, None)
    with first:
        with second:
            first.write_frames((long_clip * 255).astype(np.uint8))
            second.write_frames((short_clip * 255).astype(np.uint8))
        assert target.exists()  # the second finished first: its clip is there while the first still encodes
    with av.open(str(target)) as container:
        assert container.streams.video[0].frames == len(long_clip), "the run that finished last owns the file"
    assert _files(tmp_path) == ["clip.mp4"]
