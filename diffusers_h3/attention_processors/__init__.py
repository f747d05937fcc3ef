"""Attention processors for ``MiniMaxH3Attention`` and the packed-layout side channel they read."""

from .layout import (
    LayoutSegment,
    PackedLayout,
    current_packed_layout,
    require_packed_layout,
    use_packed_layout,
)
from .tiling import TilePlan, build_tile_plan
from .vsa import MiniMaxH3VSAProcessor, add_gate_compress, disable_vsa, enable_vsa, vsa_attention

__all__ = [
    "LayoutSegment",
    "PackedLayout",
    "current_packed_layout",
    "require_packed_layout",
    "use_packed_layout",
    "TilePlan",
    "build_tile_plan",
    "MiniMaxH3VSAProcessor",
    "add_gate_compress",
    "disable_vsa",
    "enable_vsa",
    "vsa_attention",
]
