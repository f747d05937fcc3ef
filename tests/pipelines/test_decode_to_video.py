"""`MiniMaxH3Pipeline.decode_to_video`: the latents of `output_type="latent"` decoded chunk by chunk into the MP4
writer. Its frames are bitwise those of `output_type="np"` + `export_to_video` before encoding and equal after
(decoded back with PyAV), the audio is there, a failure half way leaves nothing behind, and the encoder options come
from the call, the speed preset or the measured defaults. Tiny pipeline, fp32, CPU."""

import os

import numpy as np
import pytest
import torch

from diffusers_h3 import FastVAEDecodeConfig, export_to_video
from diffusers_h3.pipelines.export import _frames_to_uint8
from diffusers_h3.pipelines.speed_presets import SpeedPresetRecord
from diffusers_h3.testing.tiny import tiny_pipeline


av = pytest.importorskip("av")

NUM_FRAMES = 56  # 17*3+5: three temporal chunks of the VAE, so that a decode can fail mid-stream
CALL = {"prompt": "a cat", "height": 64, "width": 96, "num_frames": NUM_FRAMES, "num_inference_steps": 2}


def _pipe():
    pipe = tiny_pipeline(seed=3, with_transformer_ref=False)
    with torch.no_grad():
        for param in pipe.vae.decoder.parameters():  # the released init makes the decoder blocks identities
            param.normal_(0.0, 0.3)
    pipe.vae.enable_tiling(32, 32, 16, 16)  # 2x3 tiles per temporal chunk
    return pipe


@pytest.fixture(scope="module")
def outputs():
    pipe = _pipe()
    latent = pipe(**CALL, output_type="latent", generator=torch.Generator().manual_seed(0))
    frames = pipe(**CALL, output_type="np", generator=torch.Generator().manual_seed(0))
    return pipe, latent, frames


def _decoded(path):
    with av.open(str(path)) as container:
        frames = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])
    with av.open(str(path)) as container:
        audio = [(s.codec_context.name, s.codec_context.channels, s.codec_context.sample_rate)
                 for s in container.streams.audio]  # fmt: skip
        samples = sum(frame.samples for frame in container.decode(audio=0))
    return frames, audio, samples


def test_the_chunks_are_bitwise_the_frames_export_to_video_encodes(outputs):
    pipe, latent, frames = outputs
    chunks = list(pipe._decode_video_chunks(latent.frames, torch.device("cpu")))
    assert [len(chunk) for chunk in chunks] == [17] * 2 + [22]  # 3 temporal chunks, the last with its overflow
    assert all(chunk.dtype == np.uint8 for chunk in chunks)
    assert np.array_equal(np.concatenate(chunks), _frames_to_uint8(frames.frames[0]))


@pytest.mark.parametrize("options", [{}, {"crf": 30, "preset": "ultrafast", "pix_fmt": "yuv444p"}])
def test_streamed_file_equals_the_one_shot_export(outputs, tmp_path, options):
    pipe, latent, frames = outputs
    one_shot = export_to_video(frames.frames[0], tmp_path / "one_shot.mp4", fps=24, audio=frames.audio[0],
                               sampling_rate=frames.sampling_rate, **options)  # fmt: skip
    streamed = pipe.decode_to_video(latent.frames, latent.audio, tmp_path / "streamed.mp4", **options)
    assert streamed == str(tmp_path / "streamed.mp4")
    expected, expected_audio, expected_samples = _decoded(one_shot)
    got, got_audio, got_samples = _decoded(streamed)
    assert got.shape == (NUM_FRAMES, 64, 96, 3) and np.array_equal(got, expected)
    assert got_audio == expected_audio == [("aac", 2, 32000)] and got_samples == expected_samples
    record = pipe._h3_last_export
    assert record["decode"].startswith("streamed") and record["num_frames"] == NUM_FRAMES
    assert {key: record[key] for key in ("crf", "preset", "pix_fmt")} == {
        "crf": options.get("crf", 23), "preset": options.get("preset", "superfast"),
        "pix_fmt": options.get("pix_fmt", "yuv420p"),
    }  # fmt: skip
    assert sorted(os.listdir(tmp_path)) == ["one_shot.mp4", "streamed.mp4"]


@pytest.mark.parametrize("error", [RuntimeError("decode failed"), KeyboardInterrupt()])
def test_a_failure_mid_stream_leaves_no_file_and_keeps_an_existing_one(outputs, tmp_path, monkeypatch, error):
    pipe, latent, _ = outputs
    fresh, existing = tmp_path / "fresh.mp4", tmp_path / "existing.mp4"
    existing.write_bytes(b"an earlier clip")
    decode_clip = type(pipe.vae)._decode_clip
    calls = []

    def failing_decode_clip(vae, clip):
        calls.append(clip.shape[2])
        if len(calls) == 3:  # two chunks are already with the encoder
            raise error
        return decode_clip(vae, clip)

    monkeypatch.setattr(type(pipe.vae), "_decode_clip", failing_decode_clip)
    for target in (fresh, existing):
        calls.clear()
        with pytest.raises(type(error)):
            pipe.decode_to_video(latent.frames, latent.audio, target)
        assert len(calls) == 3
    assert sorted(os.listdir(tmp_path)) == ["existing.mp4"] and existing.read_bytes() == b"an earlier clip"


def test_export_options_come_from_the_call_then_the_speed_preset(outputs, tmp_path):
    pipe, latent, _ = outputs
    pipe._h3_speed_preset = SpeedPresetRecord(
        preset="fast", export={"crf": 28, "preset": "veryfast", "pix_fmt": "yuv444p", "source": "a test"}
    )
    try:
        pipe.decode_to_video(latent.frames, latent.audio, tmp_path / "preset.mp4", crf=20)
    finally:
        del pipe._h3_speed_preset
    with av.open(str(tmp_path / "preset.mp4")) as container:
        assert container.streams.video[0].codec_context.pix_fmt == "yuv444p"
    record = pipe._h3_last_export
    assert (record["crf"], record["preset"], record["pix_fmt"]) == (20, "veryfast", "yuv444p")


def test_context_parallel_decodes_the_whole_clip_and_only_rank_zero_writes(outputs, tmp_path, monkeypatch):
    from diffusers_h3.parallel import ranks

    pipe, latent, frames = outputs
    streamed = []
    monkeypatch.setattr(type(pipe), "_decode_video_chunks", lambda *args: streamed.append(1) or iter(()))
    pipe._context_parallel_group = object()  # no process group: parallel_vae_decode is vae.decode
    try:
        monkeypatch.setattr(ranks, "is_main_rank", lambda: False)
        assert pipe.decode_to_video(latent.frames, latent.audio, tmp_path / "other_rank.mp4") is None
        monkeypatch.setattr(ranks, "is_main_rank", lambda: True)
        written = pipe.decode_to_video(latent.frames, latent.audio, tmp_path / "rank0.mp4")
    finally:
        pipe._context_parallel_group = None
    assert not streamed and os.listdir(tmp_path) == ["rank0.mp4"]
    assert pipe._h3_last_export["decode"].startswith("whole clip (context-parallel decode)")
    one_shot = export_to_video(frames.frames[0], tmp_path / "one_shot.mp4", audio=frames.audio[0])
    assert np.array_equal(_decoded(written)[0], _decoded(one_shot)[0])


def test_misuse_is_one_clear_error(outputs, tmp_path):
    pipe, latent, _ = outputs
    with pytest.raises(ValueError, match=r"writes one clip: `latents` must be \(1, C, latent_frames, h, w\)"):
        pipe.decode_to_video(latent.frames.repeat(2, 1, 1, 1, 1), latent.audio, tmp_path / "a.mp4")
    with pytest.raises(ValueError, match=r"`audio_latents` must be its \(2, C, n\) left/right pair"):
        pipe.decode_to_video(latent.frames, latent.audio[:1], tmp_path / "a.mp4")
    with pytest.raises(ValueError, match=r"must end in \.mp4"):
        pipe.decode_to_video(latent.frames, latent.audio, tmp_path / "a.mkv")
    with pytest.raises(ValueError, match=r"`crf` must be from 0 to 51, got 60"):
        pipe.decode_to_video(latent.frames, latent.audio, tmp_path / "a.mp4", crf=60)
    assert os.listdir(tmp_path) == []


def test_the_streamed_decode_takes_the_fast_decode_when_enabled(outputs):
    """With `enable_fast_vae_decode` the chunks come from batched tile decodes (its record says so) and equal the
    whole-clip fast decode's frames; without it, diffusers' own tile loop."""
    from diffusers_h3 import disable_fast_vae_decode, enable_fast_vae_decode
    from diffusers_h3.hooks.fast_vae_decode import fast_vae_decode_state

    pipe, latent, _ = outputs
    enable_fast_vae_decode(pipe, FastVAEDecodeConfig(batch_tiles=True, compile=False))
    try:
        with torch.no_grad():  # as inside the pipeline's calls
            whole = pipe._decode_video(latent.frames, "np", torch.device("cpu"))
            chunks = list(pipe._decode_video_chunks(latent.frames, torch.device("cpu")))
        assert "decoded chunk by chunk" in fast_vae_decode_state(pipe.vae).last_run
        assert np.array_equal(np.concatenate(chunks), _frames_to_uint8(whole[0]))
    finally:
        disable_fast_vae_decode(pipe)
    assert fast_vae_decode_state(pipe.vae) is None
