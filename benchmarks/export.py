"""MP4 export on the CPU: libx264's crf / preset against wall time, file size and quality, and the streaming writer.

The clip is the released size (1344x768, 124 frames at 24 fps, 5.175 s of 32 kHz stereo audio). Two contents:
`smooth` (moving gradients and a soft disc drifting across them, a stand-in for generated video) and `noise` (uniform
noise, what random-weight checkpoints decode to: the worst case for H.264). Each case exports with
`diffusers_h3.export_to_video`, decodes the file back with PyAV and records the PSNR of the decoded RGB frames
against the source frames. The `streaming` part feeds `VideoWriter` the clip in the video VAE's 17-frame chunks,
waiting `--chunk-decode-s` before each one (a GPU decode that leaves the CPU free), and records how long the export
takes after the last chunk, against the one-shot export started after the whole decode.

    PYTHONPATH=. python benchmarks/export.py --out benchmarks/results/export_cpu.json
"""

from __future__ import annotations

import argparse
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/export_cpu.json")
    parser.add_argument("--chunk-decode-s", type=float, default=0.6,
                        help="simulated GPU decode time of one 17-frame chunk (request_h200.json: t2va_fastest's "
                             "video decode over its chunks)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=2, help="exports per smooth case; the fastest is recorded")
    parser.add_argument("--commit", default=None, help="the commit measured, when the tree has no .git")
    args = parser.parse_args(argv)

    result = result_header("export", commit=args.commit, device="cpu")
    result.update({
        "cpu_cores": os.cpu_count(),
        "clip": {"width": WIDTH, "height": HEIGHT, "frames": NUM_FRAMES, "fps": FPS, "audio": f"stereo {SAMPLING_RATE} Hz, {AUDIO_SECONDS} s"},
        "quality": "PSNR (dB) over all frames of the decoded rgb24 frames: psnr_db against the source frames, "
                   "codec_psnr_db against the source converted to yuv420p and back (the encoder's own loss)",
        "cases": {},
    })  # fmt: skip
    audio = audio_track()
    contents = {"smooth": smooth_clip(), "noise": noise_clip()}
    with tempfile.TemporaryDirectory() as folder:
        for content, crf, preset in CASES:
            repeats = args.repeats if content == "smooth" else 1  # a noise export is slow and varies little
            case = measure_case(content, contents[content], audio, crf, preset, folder, repeats)
            result["cases"][f"{content}_{preset}_crf{crf}"] = case
            print(case, flush=True)
        result["streaming_smooth"] = measure_streaming(contents["smooth"], audio, args.chunk_decode_s, folder)
        print(result["streaming_smooth"], flush=True)
    write_json(args.out, result)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
