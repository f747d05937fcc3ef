"""Text-to-video+audio and first/last-keyframe generation with MiniMaxH3Pipeline.

Runs offline on the embedded tiny demo checkpoint (random weights: the output is noise, the code path is real):

    python examples/generate_t2va_fl2va.py --out-dir outputs

With the real model (one H200, or two 80 GB GPUs; see README):

    python examples/generate_t2va_fl2va.py --model MiniMaxAI/MiniMax-H3 --dtype bfloat16 --out-dir outputs
"""

import argparse
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import diffusers_h3
from diffusers_h3 import MiniMaxH3Pipeline, export_to_video
from diffusers_h3.testing.tiny import demo_checkpoint_dir


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="folder or hub repo id; default: tiny demo checkpoint")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out-dir", default="outputs")
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()

    tiny = args.model is None
    model = demo_checkpoint_dir() if tiny else args.model
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pipe = MiniMaxH3Pipeline.from_pretrained(model, task="fl2va", dtype=getattr(torch, args.dtype)).to(device)
    size = {"height": 64, "width": 96} if tiny else {}
    steps = args.steps or (4 if tiny else 50)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    # 1. t2va: text only; 124 frames = 5.2 s at 24 fps with a stereo soundtrack at 32 kHz.
    result = pipe(
        prompt="A street drummer plays under neon lights, the crowd claps along.",
        num_frames=124,
        num_inference_steps=steps,
        generator=torch.Generator().manual_seed(0),
        **size,
    )
    export_to_video(result.frames[0], out_dir / "t2va.mp4", audio=result.audio[0], sampling_rate=result.sampling_rate)

    # 2. fl2va: animate from a first keyframe to a last keyframe (either alone works too).
    first = Image.fromarray(np.full((360, 640, 3), (30, 60, 200), dtype=np.uint8))
    last = Image.fromarray(np.full((360, 640, 3), (220, 120, 40), dtype=np.uint8))
    result = pipe(
        prompt="The sky turns from deep blue to a warm sunset while waves roll in.",
        image=first,
        last_image=last,
        num_frames=124,
        num_inference_steps=steps,
        generator=torch.Generator().manual_seed(0),
        **size,
    )
    export_to_video(result.frames[0], out_dir / "fl2va.mp4", audio=result.audio[0], sampling_rate=result.sampling_rate)
    print(diffusers_h3.describe(pipe)["pipeline"])
    print(f"wrote {out_dir / 't2va.mp4'} and {out_dir / 'fl2va.mp4'}")


if __name__ == "__main__":
    main()
