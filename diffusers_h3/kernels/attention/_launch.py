"""Host-side argument checks and preparation shared by the block-sparse attention router, its two launchers (Triton
and Hopper Gluon) and the torch reference."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..numerics import QK_8BIT_DTYPES


def scale_args(q_scale: Optional[torch.Tensor], k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
               device: torch.device) -> Tuple[Tuple[torch.Tensor, ...], Tuple[int, ...]]:
    """``((q_scale, k_scale, v_scale), q/k scale strides)`` as the kernels take them: a float32 dummy (and zero strides)
    for an absent scale, ``v_scale`` contiguous, ``q_scale`` strides of its batch and row dims (heads are contiguous)."""
    dummy = torch.zeros(1, device=device, dtype=torch.float32)
    tensors = (q_scale if q_scale is not None else dummy, k_scale if k_scale is not None else dummy,
               v_scale.contiguous() if v_scale is not None else dummy)
    qs_strides = (q_scale.stride(0), q_scale.stride(1)) if q_scale is not None else (0, 0)
    ks_strides = tuple(k_scale.stride()) if k_scale is not None else (0, 0, 0)
    return tensors, (*qs_strides, *ks_strides)


def index_args(kv_index: torch.Tensor, kv_num: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, Tuple[int, ...]]:
    """Tile lists with a contiguous last dim, contiguous counts, and the list's (batch, head, tile) strides."""
    if kv_index.stride(-1) != 1:
        kv_index = kv_index.contiguous()
    return kv_index, kv_num.contiguous(), tuple(kv_index.stride()[:3])


def check_attention_args(q, k, v, slot_rows, tile_counts, kv_index, kv_num, block, q_scale, k_scale, v_scale,
                         dense) -> None:
    """The contract checks shared by the router and the torch reference (one clear error per problem)."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("q, k, v must be [batch, seq, heads, head_dim] tensors")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match")
    if (q_scale is None) != (k_scale is None):
        raise ValueError("FP8 Q/K needs both q_scale and k_scale (see kernels.numerics.quantize_fp8_per_token / "
                         "quantize_fp8_per_block)")
    fp8 = torch.float8_e4m3fn
    if q_scale is not None and (q.dtype not in QK_8BIT_DTYPES or k.dtype != q.dtype):
        raise ValueError(f"q_scale/k_scale are given, so q and k must both be float8_e4m3fn or both int8, got "
                         f"{q.dtype} and {k.dtype}")
    if q_scale is None and (q.dtype in QK_8BIT_DTYPES or k.dtype in QK_8BIT_DTYPES):
        raise ValueError("8-bit (float8 / int8) q/k need their per-row scales: pass q_scale and k_scale")
    if k_scale is not None:
        n_key_tiles = -(-k.shape[1] // block)
        if k_scale.shape != (k.shape[0], n_key_tiles, k.shape[2]):
            raise ValueError(
                f"k_scale must hold one scale per key tile of {block} rows and head, [B, T, H] = "
                f"{(k.shape[0], n_key_tiles, k.shape[2])}, got {tuple(k_scale.shape)} (kernels.numerics.quantize_fp8_per_block)"
            )
    if (v_scale is not None) != (v.dtype == fp8):
        raise ValueError("float8 v needs v_scale [B, H, D] and v_scale needs a float8_e4m3fn v")
    if dense:
        if k.shape[1] != q.shape[1]:
            raise ValueError("dense attention needs k/v with the same number of rows as q")
        return
    if slot_rows is None or tile_counts is None or kv_index is None or kv_num is None:
        raise ValueError("block-sparse attention needs slot_rows, tile_counts, kv_index and kv_num (or dense=True)")
    n_tiles = tile_counts.numel()
    if k.shape[1] != n_tiles * block:
        raise ValueError(
            f"k/v must be packed in tile order with {n_tiles} * {block} rows, got {k.shape[1]}; pack them with "
            "diffusers_h3.kernels.attention.vsa_pool.tile_pool(..., packed=True)"
        )
    if kv_index.shape[:3] != (q.shape[0], q.shape[2], n_tiles) or kv_num.shape != kv_index.shape[:3]:
        raise ValueError(
            f"kv_index must be [B, H, T, >=1] and kv_num [B, H, T] with T={n_tiles}, got {tuple(kv_index.shape)} "
            f"and {tuple(kv_num.shape)}"
        )
