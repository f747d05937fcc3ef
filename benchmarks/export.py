"""MP4 export on the CPU: libx264's crf / preset against wall time, file size and quality, and the streaming writer.

The clip is the released size (1344x768, 124 frames at 24 fps, 5.175 s of 32 kHz stereo audio). Two contents:
`smooth` (moving gradients and a soft disc drifting across them, a stand-in for generated video) and `noise` (uniform
noise, what random-weight checkpoints decode to: the worst case for H.264). Each case exports with
`diffusers_h3.export_to_video`, decodes the file back with PyAV and records the PSNR of the decoded RGB frames
against the source frames. The `streaming` part feeds `VideoWriter` the clip in the video VAE's 17-frame chunks,
waiting `--chunk-decode-s` before each one (a GPU decode that leaves the CPU free), and records how long the export
takes after the last chunk, against the one-shot export started after the whole decode. The `streaming_pipeline`
part runs the pipeline's own paths on the tiny pipeline at the released size: `MiniMaxH3Pipeline.decode_to_video`
(what `diffusers-h3 generate` runs: chunked decode, uint8 conversion, the writer, the audio muxed at the end) against
`_decode_video` + `_decode_audio` + `export_to_video` (`output_type="np"` then the export), its VAE's per-chunk decode
answering the `smooth` clip's frames after `--chunk-decode-s` (a GPU decode), and records the time from the last
decoded chunk to the finished file.

    PYTHONPATH=. python benchmarks/export.py --out benchmarks/results/export_cpu.json
    PYTHONPATH=. python benchmarks/export.py --parts streaming_pipeline --merge   # one part, the others kept
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

import numpy as np
import torch

from _common import result_header, write_json


WIDTH, HEIGHT, NUM_FRAMES, FPS = 1344, 768, 124, 24
SAMPLING_RATE, AUDIO_SECONDS = 32000, 5.175
VAE_CHUNK_FRAMES = 17
# (content, crf, preset); medium at crf 23 is libx264's default, what the export wrote before it took options.
CASES = [
    ("smooth", 23, "medium"),
    ("smooth", 18, "medium"),
    ("smooth", 23, "faster"),
    ("smooth", 23, "veryfast"),
    ("smooth", 18, "veryfast"),
    ("smooth", 23, "superfast"),
    ("smooth", 23, "ultrafast"),
    ("noise", 23, "medium"),
    ("noise", 23, "superfast"),
    ("noise", 23, "ultrafast"),
]


def smooth_clip() -> np.ndarray:
    """uint8 `(F, H, W, 3)`: two drifting sine gradients and a soft-edged disc crossing the frame."""
    y = torch.linspace(0, 1, HEIGHT)[:, None]
    x = torch.linspace(0, 1, WIDTH)[None]
    frames = np.empty((NUM_FRAMES, HEIGHT, WIDTH, 3), np.uint8)
    for index in range(NUM_FRAMES):
        t = index / NUM_FRAMES
        red = 0.5 + 0.4 * torch.sin(7 * x + 3 * y + 2 * math.pi * t)
        green = 0.5 + 0.4 * torch.cos(5 * y - 4 * x * y + 2 * math.pi * t)
        blue = (0.3 + 0.5 * x * (1 - y)).expand(HEIGHT, WIDTH)
        centre_x, centre_y = 0.15 + 0.7 * t, 0.5 + 0.25 * math.sin(2 * math.pi * t)
        distance = torch.sqrt(((x - centre_x) * WIDTH / HEIGHT) ** 2 + (y - centre_y) ** 2)
        disc = torch.sigmoid((0.18 - distance) * 60)
        picture = torch.stack([red, green, blue], -1) * (1 - disc[..., None]) + disc[..., None] * torch.tensor([0.95, 0.85, 0.2])
        frames[index] = picture.mul(255).round().clamp(0, 255).to(torch.uint8).numpy()
    return frames


def noise_clip() -> np.ndarray:
    return torch.randint(0, 256, (NUM_FRAMES, HEIGHT, WIDTH, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)).numpy()


def audio_track() -> np.ndarray:
    t = np.arange(round(AUDIO_SECONDS * SAMPLING_RATE)) / SAMPLING_RATE
    return np.stack([0.3 * np.sin(2 * np.pi * 220 * t), 0.2 * np.sin(2 * np.pi * 330 * t + 1.0)]).astype(np.float32)


def _psnr(mean_squared_error: float) -> float:
    return round(10 * math.log10(255**2 / mean_squared_error), 2) if mean_squared_error > 0 else float("inf")


def decoded_psnr(path: str, source: np.ndarray, pix_fmt: str) -> dict:
    """PSNR (dB) of the file's frames, decoded back to RGB with PyAV: against `source` (what a viewer gets, chroma
    subsampling included) and against `source` converted to `pix_fmt` and back (the encoder's own loss)."""
    import av

    error_to_source, error_to_encoder_input, count = 0.0, 0.0, 0
    with av.open(path) as container:
        for index, frame in enumerate(container.decode(video=0)):
            decoded = frame.to_ndarray(format="rgb24").astype(np.float32)
            source_frame = av.VideoFrame.from_ndarray(source[index], format="rgb24")
            encoder_input = source_frame.reformat(format=pix_fmt).to_ndarray(format="rgb24").astype(np.float32)
            error_to_source += float(np.square(decoded - source[index].astype(np.float32)).mean())
            error_to_encoder_input += float(np.square(decoded - encoder_input).mean())
            count += 1
    count = max(count, 1)
    return {"psnr_db": _psnr(error_to_source / count), "codec_psnr_db": _psnr(error_to_encoder_input / count),
            "decoded_frames": count}  # fmt: skip


def measure_case(content, frames, audio, crf: int, preset: str, folder: str, repeats: int) -> dict:
    """The fastest of `repeats` exports (wall time), the file's size and its quality."""
    from diffusers_h3 import export_to_video

    path = os.path.join(folder, f"{content}_{preset}_crf{crf}.mp4")
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        export_to_video(frames, path, fps=FPS, audio=audio, sampling_rate=SAMPLING_RATE, crf=crf, preset=preset)
        times.append(time.perf_counter() - start)
    case = {"content": content, "crf": crf, "preset": preset, "pix_fmt": "yuv420p", "export_s": round(min(times), 2),
            "export_s_runs": [round(t, 2) for t in times], "size_mb": round(os.path.getsize(path) / 1e6, 2),
            **decoded_psnr(path, frames, "yuv420p")}  # fmt: skip
    os.remove(path)
    return case


def measure_streaming(frames: np.ndarray, audio: np.ndarray, chunk_decode_s: float, folder: str) -> dict:
    """One-shot export after a simulated chunked decode against `VideoWriter` fed while the chunks arrive (defaults)."""
    from diffusers_h3 import VideoWriter, export_to_video

    chunks = [frames[i : i + VAE_CHUNK_FRAMES] for i in range(0, NUM_FRAMES, VAE_CHUNK_FRAMES)]
    decode_s = chunk_decode_s * len(chunks)

    start = time.perf_counter()
    time.sleep(decode_s)  # the whole decode, then the export
    export_start = time.perf_counter()
    export_to_video(frames, os.path.join(folder, "one_shot.mp4"), fps=FPS, audio=audio, sampling_rate=SAMPLING_RATE)
    one_shot = {"total_s": round(time.perf_counter() - start, 2), "after_last_chunk_s": round(time.perf_counter() - export_start, 2)}

    start = time.perf_counter()
    with VideoWriter(os.path.join(folder, "streamed.mp4"), fps=FPS, sampling_rate=SAMPLING_RATE) as writer:
        for chunk in chunks:
            time.sleep(chunk_decode_s)  # the VAE decodes this chunk on the GPU
            writer.write_frames(chunk)
        last_chunk = time.perf_counter()
        writer.write_audio(audio)
    streamed = {"total_s": round(time.perf_counter() - start, 2), "after_last_chunk_s": round(time.perf_counter() - last_chunk, 2)}
    return {"chunks": len(chunks), "chunk_frames": VAE_CHUNK_FRAMES, "chunk_decode_s": chunk_decode_s,
            "simulated_decode_s": round(decode_s, 2), "one_shot": one_shot, "streamed": streamed}  # fmt: skip


def measure_pipeline_streaming(frames: np.ndarray, chunk_decode_s: float, folder: str) -> dict:
    """`decode_to_video` against the one-shot decode + export, through the tiny pipeline's code at the released size.

    The VAE's per-chunk decode is a stand-in that returns the `frames` of that chunk (the smooth clip in the VAE's
    pixel space, prepared before the timing) after `chunk_decode_s`, so the content and the decode's timing are those
    of a GPU decode; the audio is decoded once before the timing and handed over at once in both paths (its GPU decode
    is not what is compared). Timed from the moment the last chunk's frames are ready for the writer (streamed) or the
    whole clip's frames are (one-shot), and from the last chunk decode's end, which adds the pipeline's conversion of
    the last chunk to uint8 (on the CPU here, on the device in a GPU run)."""
    from diffusers_h3 import export_to_video
    from diffusers_h3._vae_tiles import chunk_inputs
    from diffusers_h3.pipelines import export
    from diffusers_h3.pipelines.pipeline_minimax_h3 import PIXEL_MEAN, PIXEL_STD
    from diffusers_h3.testing.tiny import tiny_pipeline

    pipe = tiny_pipeline(seed=0, with_transformer_ref=False)
    vae, device = pipe.vae, torch.device("cpu")
    geometry = pipe._latent_geometry(NUM_FRAMES, HEIGHT, WIDTH)
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(1, vae.config.latent_channels, geometry.num_latent_frames, geometry.latent_height,
                          geometry.latent_width, generator=generator)  # fmt: skip
    audio_latents = torch.randn(2, pipe.audio_vae.config.latent_channels, geometry.num_audio_latents,
                                generator=generator)  # fmt: skip
    audio = pipe._decode_audio(audio_latents, device)

    # Chunk i's 28 decoded frames: its 17 (after the 3 leading pad frames) and the 5 it overflows into chunk i + 1.
    mean = torch.tensor(PIXEL_MEAN).view(-1, 1, 1, 1)
    std = torch.tensor(PIXEL_STD).view(-1, 1, 1, 1)
    clip = torch.from_numpy(frames).permute(3, 0, 1, 2)  # (3, F, H, W) uint8
    chunk_frames = vae.tokens_chunk_size * vae.temporal_compression_ratio
    clip_frames = (vae.tokens_chunk_size + vae.token_overlap) * vae.temporal_compression_ratio
    num_chunks = len(chunk_inputs(vae, latents))
    decoded = []
    for index in range(num_chunks):
        first = index * VAE_CHUNK_FRAMES - vae.frame_pre_padding
        order = [first + (k if k < chunk_frames else k - vae.frame_pre_padding) for k in range(clip_frames)]
        decoded.append(((clip[:, torch.tensor(order).clamp(0, NUM_FRAMES - 1)].float() / 255 - mean) / std)[None])
    decoded_at, ready_at = [], []

    def stand_in_decode_clip(clip_latents):
        time.sleep(chunk_decode_s)  # the GPU decodes this chunk
        decoded_at.append(time.perf_counter())
        return decoded[len(decoded_at) - 1]

    write_frames = export.VideoWriter.write_frames

    def timed_write_frames(writer, chunk):
        ready_at.append(time.perf_counter())
        return write_frames(writer, chunk)

    vae._decode_clip = stand_in_decode_clip
    pipe._decode_audio = lambda audio_latents, device: audio
    export.VideoWriter.write_frames = timed_write_frames
    try:
        start = time.perf_counter()
        video = pipe._decode_video(latents, "np", device)
        ready_at.append(time.perf_counter())
        one_shot_path = export_to_video(video[0], os.path.join(folder, "pipeline_one_shot.mp4"), fps=FPS,
                                        audio=pipe._decode_audio(audio_latents, device)[0],
                                        sampling_rate=SAMPLING_RATE)  # fmt: skip
        done = time.perf_counter()
        one_shot = {"total_s": round(done - start, 2), "after_last_chunk_s": round(done - ready_at[0], 2),
                    "after_last_decode_s": round(done - decoded_at[-1], 2)}  # fmt: skip
        del video
        decoded_at.clear()
        ready_at.clear()
        start = time.perf_counter()
        streamed_path = pipe.decode_to_video(latents, audio_latents, os.path.join(folder, "pipeline_streamed.mp4"))
        done = time.perf_counter()
        streamed = {"total_s": round(done - start, 2), "after_last_chunk_s": round(done - ready_at[-1], 2),
                    "after_last_decode_s": round(done - decoded_at[-1], 2)}  # fmt: skip
    finally:
        export.VideoWriter.write_frames = write_frames
        del vae._decode_clip, pipe._decode_audio
    import av

    def decoded_frames(path):
        with av.open(path) as container:
            return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])

    same = bool(np.array_equal(decoded_frames(one_shot_path), decoded_frames(streamed_path)))
    return {"chunks": num_chunks, "chunk_writes": len(ready_at), "chunk_decode_s": chunk_decode_s,
            "simulated_decode_s": round(chunk_decode_s * num_chunks, 2),
            "export": dict(pipe._h3_last_export, path=os.path.basename(streamed_path)),
            "same_decoded_frames": same, "one_shot": one_shot, "streamed": streamed}  # fmt: skip


PARTS = ("cases", "streaming", "streaming_pipeline")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/export_cpu.json")
    parser.add_argument("--chunk-decode-s", type=float, default=0.6,
                        help="simulated GPU decode time of one 17-frame chunk (request_h200.json: t2va_fastest's "
                             "video decode over its chunks)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=2, help="exports per smooth case; the fastest is recorded")
    parser.add_argument("--commit", default=None, help="the commit measured, when the tree has no .git")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma list of parts to run, of {', '.join(PARTS)}")
    parser.add_argument("--merge", action="store_true",
                        help="keep the parts already in --out that this run does not measure; the header stays that "
                             "of the run that measured the cases, each merged part records its own commit, date and "
                             "command")  # fmt: skip
    args = parser.parse_args(argv)
    parts = [part for part in args.parts.split(",") if part]
    if not parts or any(part not in PARTS for part in parts):
        raise SystemExit(f"--parts: choose from {', '.join(PARTS)}, got {args.parts!r}")

    header = result_header("export", commit=args.commit, device="cpu")
    result = header if not args.merge or not os.path.exists(args.out) else json.load(open(args.out))
    if result.get("suite") != "export":
        raise SystemExit(f"--merge: {args.out} is not an export result")
    result.update({
        "cpu_cores": os.cpu_count(),
        "clip": {"width": WIDTH, "height": HEIGHT, "frames": NUM_FRAMES, "fps": FPS, "audio": f"stereo {SAMPLING_RATE} Hz, {AUDIO_SECONDS} s"},
        "quality": "PSNR (dB) over all frames of the decoded rgb24 frames: psnr_db against the source frames, "
                   "codec_psnr_db against the source converted to yuv420p and back (the encoder's own loss)",
    })  # fmt: skip
    provenance = {key: header[key] for key in ("commit", "date", "command", "device", "torch")}
    audio = audio_track()
    smooth = smooth_clip()
    with tempfile.TemporaryDirectory() as folder:
        if "cases" in parts:
            result.update({key: header[key] for key in provenance})
            result["cases"] = {}
            contents = {"smooth": smooth, "noise": noise_clip()}
            for content, crf, preset in CASES:
                repeats = args.repeats if content == "smooth" else 1  # a noise export is slow and varies little
                case = measure_case(content, contents[content], audio, crf, preset, folder, repeats)
                result["cases"][f"{content}_{preset}_crf{crf}"] = case
                print(case, flush=True)
        if "streaming" in parts:
            result["streaming_smooth"] = measure_streaming(smooth, audio, args.chunk_decode_s, folder)
            if "cases" not in parts:
                result["streaming_smooth"]["measured"] = provenance
            print(result["streaming_smooth"], flush=True)
        if "streaming_pipeline" in parts:
            load_before = os.getloadavg()[0]
            part = measure_pipeline_streaming(smooth, args.chunk_decode_s, folder)
            # The CPU may be shared: its 1-minute load average (runnable processes) before and after the part.
            part["load_average_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
            result["streaming_pipeline"] = {**part, "measured": provenance}
            print(result["streaming_pipeline"], flush=True)
    write_json(args.out, result)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
