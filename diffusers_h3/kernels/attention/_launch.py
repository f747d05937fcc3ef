"""Host-side argument preparation shared by the two block-sparse attention launchers (Triton and Hopper Gluon)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch


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
