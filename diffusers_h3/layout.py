"""The packed-sequence layout side channel.

H3 packs ``[text | keyframes or references | target audio | target video]`` into one sequence, but attention
processors only receive ``(attn, hidden_states, rotary_emb, attention_mask)``. The pipeline builds one
:class:`PackedLayout` per request and publishes it for the duration of every transformer call with
:func:`use_packed_layout`; processors that need it call :func:`require_packed_layout`. Processors must read segment
kinds and row ranges from the layout and never assume an order (ref2va interleaves reference audio and video).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import torch


SEGMENT_KINDS = ("text", "video", "audio")
SEGMENT_ROLES = ("prompt", "target", "keyframe", "reference")


@dataclass(frozen=True)
class LayoutSegment:
    """A contiguous run of rows ``[start, stop)`` of one modality and role.

    ``grid`` is the ``(T, H, W)`` token grid of a video segment, rows in (t, h, w) row-major order; ``None`` for
    text and audio. ``channels`` is the number of channel-major sub-blocks of an audio segment (2 for stereo).
    """

    kind: str
    role: str
    start: int
    stop: int
    grid: Optional[Tuple[int, int, int]] = None
    channels: int = 1

    def __post_init__(self):
        if self.kind not in SEGMENT_KINDS:
            raise ValueError(f"segment kind must be one of {SEGMENT_KINDS}, got {self.kind!r}")
        if self.role not in SEGMENT_ROLES:
            raise ValueError(f"segment role must be one of {SEGMENT_ROLES}, got {self.role!r}")
        if not 0 <= self.start < self.stop:
            raise ValueError(f"segment rows must satisfy 0 <= start < stop, got [{self.start}, {self.stop})")
        if self.kind == "video":
            if self.grid is None or len(self.grid) != 3:
                raise ValueError("a video segment needs grid=(T, H, W)")
            t, h, w = self.grid
            if t * h * w != self.length:
                raise ValueError(
                    f"video grid {self.grid} has {t * h * w} tokens but the segment has {self.length} rows"
                )
        elif self.grid is not None:
            raise ValueError(f"only video segments carry a grid, got grid={self.grid} on a {self.kind} segment")

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class PackedLayout:
    """All segments of one packed sequence, sorted by row, covering ``[0, seq_len)`` without gaps.

    ``step_index`` / ``num_steps`` say which denoising step the current transformer call belongs to (``None`` outside
    a sampling loop), so processors can run dense for the first steps.
    """

    segments: Tuple[LayoutSegment, ...]
    seq_len: int
    step_index: Optional[int] = None
    num_steps: Optional[int] = None

    def __post_init__(self):
        segments = tuple(sorted(self.segments, key=lambda s: s.start))
        object.__setattr__(self, "segments", segments)
        row = 0
        for segment in segments:
            if segment.start != row:
                raise ValueError(
                    f"layout segments must tile the sequence: expected a segment at row {row}, got {segment}"
                )
            row = segment.stop
        if row != self.seq_len:
            raise ValueError(f"layout segments end at row {row} but seq_len is {self.seq_len}")

    def select(self, kind: Optional[str] = None, role: Optional[str] = None) -> Tuple[LayoutSegment, ...]:
        return tuple(s for s in self.segments if (kind is None or s.kind == kind) and (role is None or s.role == role))

    def at_step(self, step_index: Optional[int], num_steps: Optional[int] = None) -> "PackedLayout":
        """The same layout tagged with a denoising step (the pipeline publishes one per transformer call)."""
        return dataclasses.replace(self, step_index=step_index, num_steps=num_steps)

    def describe(self) -> str:
        parts = []
        for s in self.segments:
            extra = f" grid={s.grid}" if s.grid else (f" channels={s.channels}" if s.channels > 1 else "")
            parts.append(f"{s.role}:{s.kind}[{s.start}:{s.stop}]{extra}")
        return f"PackedLayout(seq_len={self.seq_len}: " + ", ".join(parts) + ")"


_CURRENT_LAYOUT: contextvars.ContextVar[Optional[PackedLayout]] = contextvars.ContextVar(
    "diffusers_h3_packed_layout", default=None
)


@contextlib.contextmanager
def use_packed_layout(layout: Optional[PackedLayout]) -> Iterator[Optional[PackedLayout]]:
    """Publish ``layout`` to attention processors for the duration of a transformer call."""
    token = _CURRENT_LAYOUT.set(layout)
    try:
        yield layout
    finally:
        _CURRENT_LAYOUT.reset(token)


def current_packed_layout() -> Optional[PackedLayout]:
    return _CURRENT_LAYOUT.get()


def require_packed_layout(who: str, seq_len: Optional[int] = None) -> PackedLayout:
    """The published layout, or an error that tells the caller how to provide one."""
    layout = _CURRENT_LAYOUT.get()
    if layout is None:
        raise RuntimeError(
            f"{who} needs the packed-sequence layout, but none is published. Run the transformer through "
            "MiniMaxH3Pipeline (it publishes one per call), or wrap your own transformer call in "
            "`with diffusers_h3.use_packed_layout(layout):` with a PackedLayout describing the packed rows."
        )
    if seq_len is not None and seq_len != layout.seq_len:
        raise RuntimeError(
            f"{who} got a sequence of {seq_len} rows but the published PackedLayout has {layout.seq_len}; the "
            "layout does not belong to this call (with context parallelism, gather the sequence first)."
        )
    return layout


# Set on the rotary-embedding tensor of a transformer call: every block of the call receives that same tensor object,
# also when gradient checkpointing recomputes the block during backward (the checkpoint keeps its arguments).
_LAYOUT_ATTRIBUTE = "_diffusers_h3_packed_layout"


@torch.compiler.disable  # attribute and context-variable bookkeeping: one eager island under torch.compile
def layout_to_reenter(anchor: torch.Tensor) -> Optional[PackedLayout]:
    """For an attention call under autograd: the layout to re-enter, or ``None`` when none needs re-entering.

    With a layout published (the forward), it is pinned to ``anchor`` (the call's rotary-embedding tensor) and
    ``None`` is returned. With none published, the call is a gradient-checkpointed block recomputing during backward,
    after the forward's :func:`use_packed_layout` has exited (or on the autograd engine's device thread, which does
    not see it): the layout pinned by the forward is returned. Processors call this themselves, so checkpointing
    works however they were installed (``enable_vsa`` or ``set_attn_processor``) and whatever checkpoint function
    the model uses.
    """
    layout = _CURRENT_LAYOUT.get()
    if layout is not None:
        setattr(anchor, _LAYOUT_ATTRIBUTE, layout)
        return None
    return getattr(anchor, _LAYOUT_ATTRIBUTE, None)
