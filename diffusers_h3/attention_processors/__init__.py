"""Attention processors for ``MiniMaxH3Attention`` (all built on :class:`MiniMaxH3AttnProcessorBase`); the
packed-layout side channel they read is ``diffusers_h3.layout``."""

from .base import MiniMaxH3AttnProcessorBase
from .fa_v100 import MiniMaxH3FAV100Processor
from .flashinfer import MiniMaxH3FlashInferProcessor, enable_flashinfer_attention
from .low_precision import (
    MiniMaxH3LowPrecisionAttnProcessor,
    disable_low_precision_attention,
    enable_low_precision_attention,
)
from .tiling import TilePlan, build_tile_plan
from .vsa import MiniMaxH3VSAProcessor, VSAConfig, add_gate_compress, disable_vsa, enable_vsa, vsa_attention


__all__ = [
    "MiniMaxH3AttnProcessorBase",
    "MiniMaxH3FAV100Processor",
    "MiniMaxH3FlashInferProcessor",
    "MiniMaxH3LowPrecisionAttnProcessor",
    "MiniMaxH3VSAProcessor",
    "VSAConfig",
    "TilePlan",
    "build_tile_plan",
    "add_gate_compress",
    "disable_low_precision_attention",
    "disable_vsa",
    "enable_flashinfer_attention",
    "enable_low_precision_attention",
    "enable_vsa",
    "vsa_attention",
]
