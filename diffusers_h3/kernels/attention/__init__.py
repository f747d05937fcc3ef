"""Attention kernels: block-sparse / dense flash attention (Hopper Gluon and Triton, one router), VSA pooling and
tile selection, FP8 V, dense FP8/INT8 attention and FA-V100. Every kernel has a torch reference with the same
numerics. The kernel a call runs is chosen before the call (``plan_kernel`` / ``select_kernel``, pure functions of a
description of the operands); the kernels know nothing about H3 modules, layouts or processors."""

from .bsa_triton import block_sparse_attention_reference
from .dense_quantized import fp8_attention, fp8_attention_reference
from .fa_v100 import FAV100BuildError, fa_v100_attention, fa_v100_reference
from .router import (
    AttentionOperands,
    KernelChoice,
    TuningOptions,
    block_sparse_attention,
    plan_kernel,
    select_kernel,
    sm90_kernel_supports,
)
from .v_fp8 import quantize_v_fp8_channel_major, quantize_v_fp8_channel_major_reference
from .vsa_pool import tile_pool, tile_pool_reference, tile_quantize_fp8, tile_quantize_fp8_reference
from .vsa_select import mask_to_index, select_tiles, topk_for_sparsity


__all__ = [
    "AttentionOperands",
    "KernelChoice",
    "plan_kernel",
    "TuningOptions",
    "block_sparse_attention",
    "block_sparse_attention_reference",
    "select_kernel",
    "sm90_kernel_supports",
    "fp8_attention",
    "fp8_attention_reference",
    "FAV100BuildError",
    "fa_v100_attention",
    "fa_v100_reference",
    "quantize_v_fp8_channel_major",
    "quantize_v_fp8_channel_major_reference",
    "tile_pool",
    "tile_pool_reference",
    "tile_quantize_fp8",
    "tile_quantize_fp8_reference",
    "mask_to_index",
    "select_tiles",
    "topk_for_sparsity",
]
