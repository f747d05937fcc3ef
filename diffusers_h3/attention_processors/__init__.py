"""Attention processors for ``MiniMaxH3Attention`` and the packed-layout side channel they read."""

from .layout import (
    LayoutSegment,
    PackedLayout,
    current_packed_layout,
    require_packed_layout,
    use_packed_layout,
)
