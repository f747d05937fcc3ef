"""Probe (CPU of the GPU host): how much of the request benchmark's MP4 mux time is the random-weight content?

The request benchmark (``benchmarks/request.py``) decodes random latents with random-weight VAEs, so its frames are
close to uniform noise, the worst case for H.264: every macroblock is expensive to code and the bitstream is huge.
This times ``diffusers_h3.export_to_video`` (libx264 at its defaults, AAC stereo, diffusers' ``encode_video``) on the
benchmark's clip size (124 frames, 768x1344, 3.9 s of 32 kHz stereo) for three contents: uniform noise, smooth
moving gradients (a stand-in for natural video) and the noise blurred to half its bandwidth, plus, for reference,
libx264's faster presets through PyAV on the same frames (not what the package writes).

    PYTHONPATH=. python docs/experiments/mux_content_probe.py OUT.json
"""

import json
import os
import sys
import tempfile
import time

import numpy as np
import torch


FRAMES, HEIGHT, WIDTH, FPS, RATE = 124, 768, 1344, 24, 32000


def contents():
    generator = torch.Generator().manual_seed(0)
    noise = torch.rand(FRAMES, HEIGHT, WIDTH, 3, generator=generator)
    y = torch.linspace(0, 1, HEIGHT)[:, None]
    x = torch.linspace(0, 1, WIDTH)[None]
    smooth = torch.stack([
        torch.stack([0.5 + 0.5 * torch.sin(6 * x + 0.15 * f) * torch.cos(4 * y + 0.05 * f),
                     x.expand(HEIGHT, WIDTH), (0.5 + 0.5 * torch.sin(3 * y - 0.1 * f)).expand(HEIGHT, WIDTH)], -1)
        for f in range(FRAMES)
    ])  # fmt: skip
    blurred = torch.nn.functional.avg_pool2d(noise.permute(0, 3, 1, 2), 3, 1, 1).permute(0, 2, 3, 1)
    return {"noise": noise.numpy(), "smooth": smooth.numpy(), "noise_blur3": blurred.contiguous().numpy()}


def x264_preset(frames_uint8, path, preset):
    import av

    with av.open(path, mode="w") as container:
        stream = container.add_stream("libx264", rate=FPS, options={"preset": preset})
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        for frame in frames_uint8:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def main(out):
    from diffusers_h3 import export_to_video

    audio = torch.randn(2, int(FRAMES / FPS * RATE)) * 0.1
    result = {"what": __doc__.split("\n\n")[0], "clip": f"{FRAMES} frames {HEIGHT}x{WIDTH}, audio 2 x {audio.shape[1]}",
              "cpus": os.cpu_count(), "cases": {}}  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        for name, frames in contents().items():
            path = os.path.join(folder, f"{name}.mp4")
            start = time.perf_counter()
            export_to_video(frames, path, fps=FPS, audio=audio, sampling_rate=RATE)
            case = {"export_s": round(time.perf_counter() - start, 2), "export_mb": round(os.path.getsize(path) / 2**20, 1)}
            uint8 = (frames * 255).round().astype(np.uint8)
            for preset in ("veryfast", "ultrafast"):
                start = time.perf_counter()
                x264_preset(uint8, path, preset)
                case[f"x264_{preset}_video_only_s"] = round(time.perf_counter() - start, 2)
                case[f"x264_{preset}_mb"] = round(os.path.getsize(path) / 2**20, 1)
            result["cases"][name] = case
            print(name, case, flush=True)
    with open(out, "w") as handle:
        json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
