"""Shared inputs of the attention kernel tests: a ref2va-like packed layout with partial tiles everywhere."""

import torch

from diffusers_h3.attention_processors.tiling import build_tile_plan
from diffusers_h3.layout import LayoutSegment, PackedLayout


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.float16 if torch.cuda.is_available() else torch.float32


def rel_l2(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def layout():
    # ref2va-like interleaving with partial tiles everywhere: text, reference video, audio, target video, audio.
    segs = [
        LayoutSegment("text", "prompt", 0, 21),
        LayoutSegment("video", "reference", 21, 21 + 2 * 3 * 3, grid=(2, 3, 3)),
        LayoutSegment("audio", "reference", 39, 50, channels=2),
        LayoutSegment("video", "target", 50, 50 + 3 * 5 * 6, grid=(3, 5, 6)),
        LayoutSegment("audio", "target", 140, 157, channels=2),
    ]
    return PackedLayout(tuple(segs), seq_len=157)


def tile_plan():
    return build_tile_plan(layout(), tile=(2, 2, 4), device=DEVICE)  # block 16


def poison(t):
    return t.fill_(float("nan"))
