"""Shared setup of the GEMM kernel tests: device, dtypes, odd shapes and tolerances.

CPU: the Triton interpreter (tests/conftest.py switches it on) with fp16 / fp32, since bf16 ``tl.dot`` is wrong there;
GPU: the same tests on hardware."""

import torch


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float16, torch.float32] if DEVICE == "cpu" else [torch.bfloat16, torch.float16]
# Odd sizes: partial M/N/K tiles for the interpreter tile (16, 32, 32) and the GPU tiles.
SHAPES = [(1, 17, 48), (37, 45, 96), (19, 70, 80)]
# A small tile forced on GPU too, so partial tiles are exercised there as well.
SMALL_TILE = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2, "SWAP_AB": False}


def tol(dtype):
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()
