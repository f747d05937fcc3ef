"""Host-side helpers shared by the GEMMs of this family: device support, input checks, the rows threshold of the
large-M path, autotuning configs and the launch of a tiled weight-dequantizing kernel (W8A16, NVFP4 weight-only)."""

from __future__ import annotations

from typing import Optional

import torch

from ..._utils import cuda_capability
from .._triton_utils import HAS_TRITON, triton_interpreter_active


if HAS_TRITON:
    import triton

# Rows from which a compute-bound GEMM is faster as "Triton dequantize to a 16-bit scratch weight + cuBLAS" than as
# the fused in-register dequantization GEMM (see benchmarks/results/gemm_h200.json).
LARGE_M_ROWS = 1024

# A fixed small tile for the Triton interpreter (autotuning there would only cost time).
INTERPRETER_TILE = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2, "SWAP_AB": False}


def triton_gemm_supported(device: torch.device) -> bool:
    """Triton tensor-core GEMMs: CUDA SM80+ (SM70 has no tensor-core ``tl.dot``), or CPU under the interpreter."""
    if not HAS_TRITON:
        return False
    if device.type == "cuda":
        cap = cuda_capability(device)
        return cap is not None and cap >= (8, 0)
    return device.type == "cpu" and triton_interpreter_active()


def check_2d_weight(name: str, weight: torch.Tensor) -> None:
    """A weight to quantize must be a 2-D floating point ``[out_features, in_features]`` tensor."""
    if weight.dim() != 2:
        raise ValueError(f"{name} must be a 2-D [out_features, in_features] tensor, got shape {tuple(weight.shape)}.")
    if not weight.is_floating_point():
        raise TypeError(f"{name} must be a floating point tensor to quantize, got {weight.dtype}.")


def m_bucket(m: int) -> int:
    """Autotune key for M: the next power of two (re-tune per size class, not per exact row count)."""
    return 1 << max(m - 1, 0).bit_length()


def dequant_tile() -> tuple:
    """(BLOCK_N, BLOCK_K) of the dequantize-to-scratch kernels: small in the interpreter, wide rows on GPU."""
    return (16, 32) if triton_interpreter_active() else (32, 256)


def gemm_configs():
    """A few large tiles for compute-bound prefill GEMMs (M in the tens of thousands) plus small ones."""
    # Autotuning time grows with every config: keep the tiles that win at H3's prefill sizes on Hopper; swapped
    # (weight-as-A) and BLOCK_K = 128 variants never won there.
    return [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "SWAP_AB": False},
            num_stages=stages,
            num_warps=warps,
        )
        for bm, bn, bk, stages, warps in (
            (128, 128, 64, 4, 8),
            (256, 128, 64, 3, 8),
            (128, 256, 64, 3, 8),
            (64, 128, 64, 4, 4),
        )
    ]


def launch_gemm(kernel_jit, kernel_tuned, args, m, n, meta, tile=None):
    """Run a GEMM kernel: autotuned on GPU, a fixed small tile in the interpreter (or a caller-fixed tile)."""
    if tile is None and triton_interpreter_active():
        tile = INTERPRETER_TILE
    if tile is not None:
        grid = (triton.cdiv(m, tile["BLOCK_M"]) * triton.cdiv(n, tile["BLOCK_N"]),)
        kernel_jit[grid](*args, **meta, **tile)
    else:

        def grid(cfg):
            return (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)

        kernel_tuned[grid](*args, **meta)


def prepare_gemm_io(op: str, x: torch.Tensor, n: int, k: int, out: Optional[torch.Tensor]):
    """Host-side checks shared by the weight-only Triton GEMMs: device, activation dtype and width; returns the
    activations as contiguous rows ``[M, K]`` and the (validated or new) output ``[M, N]``."""
    if not triton_gemm_supported(x.device):
        raise RuntimeError(
            f"The Triton {op} GEMM needs a CUDA GPU with compute capability >= 8.0 (or CPU with TRITON_INTERPRET=1); "
            f"got device {x.device}. Use backend='torch' or the dequantize fallback."
        )
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"{op} activations must be fp16, bf16 or fp32, got {x.dtype}.")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features but the {op} weight has {k}.")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if out is None:
        out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    elif out.shape != (m, n) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {(m, n)} {x.dtype} tensor, got {tuple(out.shape)} {out.dtype}.")
    return x2, out


def linear_fake(x: torch.Tensor, weight: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The fake implementation of every GEMM op here (``x``, then the packed weight whose rows are the output
    features): ``x``'s dtype, ``[*x.shape[:-1], weight.shape[0]]``, contiguous."""
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
