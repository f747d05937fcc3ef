"""Train a MiniMax-H3 LoRA from a folder of clips with captions (docs/training.md), under Accelerate.

One GPU, or several (data parallel, one clip per GPU per step):

    accelerate launch examples/train_lora.py --model MiniMaxAI/MiniMax-H3 --data my_clips --output my_lora \\
        --height 480 --width 832 --frames 124 --rank 32 --quantize w8a16 --mixed-precision bf16 --steps 2000 \\
        --validation-prompt "a cat jumps onto the sofa, a soft thud" --validation-steps 250

Offline on the embedded tiny demo checkpoint (random weights; the code path is real): `--demo` writes a two-clip
data folder into OUTPUT/demo_data and trains a few steps on it:

    python examples/train_lora.py --demo --output demo_lora

The flags are those of `diffusers-h3 train-lora` (`diffusers-h3 train-lora --help`); `--data` is the folder holding
`metadata.jsonl` (one `{"file_name": ..., "text": ...}` per clip or image).
"""

import sys
from pathlib import Path

import numpy as np
import torch

from diffusers_h3.cli import build_parser, cmd_train_lora


def write_demo_data(folder: Path) -> Path:
    """Two short clips (a moving colour ramp with a tone) and their captions, on the demo checkpoint's canvas."""
    from diffusers_h3.training import write_clip, write_metadata

    folder.mkdir(parents=True, exist_ok=True)
    ramp = np.linspace(0, 1, 96)[None, None, :]
    for index in range(2):
        frames = np.zeros((22, 64, 96, 3))
        frames[..., 2 * index] = 200 * ((ramp + np.arange(22)[:, None, None] / 22) % 1.0)
        t = np.arange(round(22 / 24 * 32000)) / 32000
        tone = 0.3 * np.sin(2 * np.pi * (220 + 440 * index) * t)
        write_clip(folder / f"clip{index}.mp4", frames.astype(np.uint8), torch.tensor(np.stack([tone, tone])), 32000)
    write_metadata(folder, [("clip0.mp4", "a red ramp hums low"), ("clip1.mp4", "a blue ramp whistles high")])
    return folder


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--demo" in argv:
        argv.remove("--demo")
        output = Path(argv[argv.index("--output") + 1]) if "--output" in argv else Path("demo_lora")
        data = write_demo_data(output / "demo_data")
        argv = ["--data", str(data), "--output", str(output), "--height", "64", "--width", "96", "--frames", "22",
                "--dtype", "float32", "--rank", "4", "--steps", "4", "--learning-rate", "1e-2",
                "--checkpointing-steps", "2"] + [a for a in argv if a not in ("--output", str(output))]  # fmt: skip
    args = build_parser().parse_args(["train-lora", *argv])
    return cmd_train_lora(args)


if __name__ == "__main__":
    sys.exit(main())
