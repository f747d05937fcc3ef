"""`VideoWriter` encodes chunks as they arrive: the same decoded frames as the one-shot export for the same options,
atomic on an error or Ctrl-C inside the block and on an encoder failure, and misuse is one line."""

import os
import threading
import time

import numpy as np
import pytest
import torch

from diffusers_h3 import VideoWriter, export_to_video
from diffusers_h3.pipelines import export


av = pytest.importorskip("av")

RATE = 32000
FRAMES = np.random.default_rng(0).random((23, 32, 48, 3)).astype(np.float32)
AUDIO = (0.1 * torch.randn(2, RATE, generator=torch.Generator().manual_seed(0))).numpy()


def _decoded(path):
    with av.open(str(path)) as container:
        frames = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])
    with av.open(str(path)) as container:
        audio = [(s.codec_context.name, s.codec_context.channels, s.codec_context.sample_rate) for s in container.streams.audio]
    return frames, audio


@pytest.mark.parametrize("options", [{}, {"crf": 30, "preset": "ultrafast", "pix_fmt": "yuv444p"}])
def test_chunks_give_the_frames_of_the_one_shot_export(tmp_path, options):
    one_shot = export_to_video(FRAMES, tmp_path / "one_shot.mp4", fps=24, audio=AUDIO, sampling_rate=RATE, **options)
    with VideoWriter(tmp_path / "streamed.mp4", fps=24, sampling_rate=RATE, **options) as writer:
        # uneven chunks, as the VAE's temporal chunks are (the first is shorter), in three input types
        writer.write_frames(FRAMES[:5])
        writer.write_frames(torch.from_numpy(FRAMES[5:17]).permute(0, 3, 1, 2))
        writer.write_frames((FRAMES[17:] * 255).round().astype(np.uint8))
        writer.write_audio(AUDIO)
    assert writer.path == str(tmp_path / "streamed.mp4") and writer.num_frames == len(FRAMES)
    expected, expected_audio = _decoded(one_shot)
    streamed, streamed_audio = _decoded(writer.path)
    assert expected.shape[0] == len(FRAMES) and np.array_equal(streamed, expected)
    assert streamed_audio == expected_audio == [("aac", 2, RATE)]
    assert sorted(os.listdir(tmp_path)) == ["one_shot.mp4", "streamed.mp4"]


def test_the_encoder_runs_while_the_caller_produces_the_next_chunk(tmp_path, monkeypatch):
    # The first chunk's frames reach the encoder before the caller writes the second chunk: it does not wait for the end.
    handed_to_the_encoder = []
    from_ndarray = av.VideoFrame.from_ndarray

    def counting_from_ndarray(*args, **kwargs):
        handed_to_the_encoder.append(threading.current_thread().name)
        return from_ndarray(*args, **kwargs)

    monkeypatch.setattr(av.VideoFrame, "from_ndarray", counting_from_ndarray)
    with VideoWriter(tmp_path / "clip.mp4") as writer:
        writer.write_frames(FRAMES[:5])
        finished_first_chunk = threading.Event()
        for _ in range(1000):
            if len(handed_to_the_encoder) == 5:
                finished_first_chunk.set()
                break
            finished_first_chunk.wait(0.01)
        writer.write_frames(FRAMES[5:])
    assert finished_first_chunk.is_set(), handed_to_the_encoder
    assert set(handed_to_the_encoder) == {"h3-video-encoder"} and len(handed_to_the_encoder) == len(FRAMES)


@pytest.mark.parametrize("error", [RuntimeError("decode failed"), KeyboardInterrupt()])
def test_an_error_inside_the_block_keeps_the_existing_file_and_leaves_no_temporary(tmp_path, error):
    target = tmp_path / "clip.mp4"
    export_to_video(FRAMES, target)
    good = target.read_bytes()
    with pytest.raises(type(error)):
        with VideoWriter(target, sampling_rate=RATE) as writer:
            writer.write_frames(FRAMES[:10])
            # (the file itself appears with the first packet, after libx264's lookahead: not checked here)
            assert os.path.dirname(writer._temporary) == str(tmp_path), "writes beside the target"
            raise error
    assert target.read_bytes() == good and os.listdir(tmp_path) == ["clip.mp4"]
    with pytest.raises(RuntimeError, match="this VideoWriter is aborted: create a new one"):
        writer.write_frames(FRAMES)


def test_an_encoder_failure_reaches_the_caller_and_cleans_up(tmp_path, monkeypatch):
    def failing_encode(self):
        self._encoder_error = RuntimeError("libx264 failed")

    monkeypatch.setattr(export.VideoWriter, "_encode_chunks", failing_encode)
    with pytest.raises(RuntimeError, match="libx264 failed"):
        with VideoWriter(tmp_path / "clip.mp4") as writer:
            for start in range(0, len(FRAMES), 4):
                writer.write_frames(FRAMES[start : start + 4])
    assert os.listdir(tmp_path) == []


def test_misuse_is_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"^no frames were written: call `write_frames` before closing the clip\.$"):
        with VideoWriter(tmp_path / "a.mp4"):
            pass
    with pytest.raises(ValueError, match=r"^the clip declares an audio stream \(`sampling_rate`\) but `write_audio`"):
        with VideoWriter(tmp_path / "b.mp4", sampling_rate=RATE) as writer:
            writer.write_frames(FRAMES)
    with pytest.raises(ValueError, match=r"^this VideoWriter has no audio stream: pass `sampling_rate`"):
        VideoWriter(tmp_path / "c.mp4").write_audio(AUDIO)
    with pytest.raises(ValueError, match=r"^the audio track was already written: call `write_audio` once per clip\.$"):
        with VideoWriter(tmp_path / "e.mp4", sampling_rate=RATE) as writer:
            writer.write_audio(AUDIO)
            writer.write_frames(FRAMES)
            writer.write_audio(AUDIO)
    assert not (tmp_path / "e.mp4").exists()
    with pytest.raises(ValueError, match=r"^every chunk must have the first chunk's size \(32, 48\), got \(32, 32\)\.$"):
        with VideoWriter(tmp_path / "d.mp4") as writer:
            writer.write_frames(FRAMES)
            writer.write_frames(FRAMES[:, :, :32])
    with pytest.raises(ValueError, match=r"^`sampling_rate` must be a positive integer \(Hz\) or None, got 0\.$"):
        VideoWriter(tmp_path / "e.mp4", sampling_rate=0)
    with pytest.raises(ValueError, match=r"^`preset` 'slowest' is not an x264 preset"):
        VideoWriter(tmp_path / "f.mp4", preset="slowest")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("audio_first", [True, False])
def test_the_audio_is_encoded_in_the_writer_thread_before_the_close(tmp_path, monkeypatch, audio_first):
    """Written before the video (as `decode_to_video` does), the AAC encode runs in the encoder thread ahead of the
    frames, so `close` waits only for the last chunk; written after the frames, it still runs there, in order."""
    events = []
    encode_audio = export._encode_audio
    monkeypatch.setattr(export, "_encode_audio", lambda *args: (events.append(("audio", threading.current_thread().name)),
                                                                 encode_audio(*args))[1])  # fmt: skip
    from_ndarray = av.VideoFrame.from_ndarray
    monkeypatch.setattr(av.VideoFrame, "from_ndarray",
                        lambda *args, **kwargs: events.append(("frame", None)) or from_ndarray(*args, **kwargs))
    writer = VideoWriter(tmp_path / "clip.mp4", fps=24, sampling_rate=RATE)
    if audio_first:
        writer.write_audio(AUDIO)
    writer.write_frames(FRAMES)
    if not audio_first:
        writer.write_audio(AUDIO)
    deadline = time.monotonic() + 60
    while not any(kind == "audio" for kind, _ in events) and time.monotonic() < deadline:
        time.sleep(0.01)  # the encoder thread takes the track from the queue without waiting for the close
    events.append(("close", None))
    writer.close()
    audio = [i for i, (kind, _) in enumerate(events) if kind == "audio"]
    assert len(audio) == 1 and events[audio[0]][1] == "h3-video-encoder"
    frames = [i for i, (kind, _) in enumerate(events) if kind == "frame"]
    assert (audio[0] < frames[0]) if audio_first else (audio[0] > frames[-1])
    assert audio[0] < events.index(("close", None))  # nothing left for the close but the flush
    expected, expected_audio = _decoded(export_to_video(FRAMES, tmp_path / "one_shot.mp4", fps=24, audio=AUDIO,
                                                        sampling_rate=RATE))  # fmt: skip
    got, got_audio = _decoded(writer.path)
    assert np.array_equal(got, expected) and got_audio == expected_audio


def test_close_raises_an_encoder_failure_even_with_a_full_queue(tmp_path, monkeypatch):
    """The encoder fails while the bounded queue is full: `close` raises its error and removes the partial file
    instead of waiting forever for room for the end marker."""
    release = threading.Event()
    from_ndarray = av.VideoFrame.from_ndarray

    def failing_from_ndarray(*args, **kwargs):
        release.wait(60)  # hold the encoder on its first frame while the caller fills the queue
        raise RuntimeError("encoder failed")

    monkeypatch.setattr(av.VideoFrame, "from_ndarray", failing_from_ndarray)
    writer = VideoWriter(tmp_path / "clip.mp4", fps=24)
    for _ in range(1 + export.MAX_QUEUED_CHUNKS):  # one in the encoder's hands, the queue full behind it
        writer.write_frames(FRAMES[:2])
    deadline = time.monotonic() + 60
    while not writer._chunks.full() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert writer._chunks.full()
    release.set()
    raised = []

    def close():
        try:
            writer.close()
        except RuntimeError as error:
            raised.append(str(error))

    closing = threading.Thread(target=close, daemon=True)
    closing.start()
    closing.join(60)
    assert not closing.is_alive(), "close waited forever on the full queue"
    assert raised == ["encoder failed"]
    assert not (tmp_path / "clip.mp4").exists() and os.listdir(tmp_path) == []
    monkeypatch.setattr(av.VideoFrame, "from_ndarray", from_ndarray)
