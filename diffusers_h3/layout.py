"""The packed-sequence layout side channel.

H3 packs ``[text | keyframes or references | target audio | target video]`` into one sequence, but attention
processors only receive ``(attn, hidden_states, rotary_emb, attention_mask)``. The pipeline builds one
:class:`PackedLayout` per request and publishes it for the duration of every transformer call with
:func:`use_packed_layout`. Each transformer call has one frozen :class:`CallPlan`: the layout and, once the
transformer's call-plan hook has planned the call (outside any compiled region), each attention processor's plan
(route, tile plan, kernel choice, precisions); it is the one per-call state the processors read
(:func:`current_call_plan`). Processors that need the layout call :func:`require_packed_layout`. Processors must read segment
kinds and row ranges from the layout and never assume an order (ref2va interleaves reference audio and video).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional, Tuple

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
    a sampling loop), so processors can run dense for the first steps. ``sigma_interval`` / ``audio_sigma_interval``
    are the ``(sigma, next sigma)`` that step moves the video / audio latents across (``None`` outside a sampling
    loop): a PDD head bank picks its interval heads from them.
    """

    segments: Tuple[LayoutSegment, ...]
    seq_len: int
    step_index: Optional[int] = None
    num_steps: Optional[int] = None
    sigma_interval: Optional[Tuple[float, float]] = None
    audio_sigma_interval: Optional[Tuple[float, float]] = None

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

    def at_step(
        self,
        step_index: Optional[int],
        num_steps: Optional[int] = None,
        sigma_interval: Optional[Tuple[float, float]] = None,
        audio_sigma_interval: Optional[Tuple[float, float]] = None,
    ) -> "PackedLayout":
        """The same layout tagged with a denoising step and the sigma intervals it spans (the pipeline publishes one
        per transformer call)."""
        return dataclasses.replace(
            self,
            step_index=step_index,
            num_steps=num_steps,
            sigma_interval=sigma_interval,
            audio_sigma_interval=audio_sigma_interval,
        )

    def describe(self) -> str:
        parts = []
        for s in self.segments:
            extra = f" grid={s.grid}" if s.grid else (f" channels={s.channels}" if s.channels > 1 else "")
            parts.append(f"{s.role}:{s.kind}[{s.start}:{s.stop}]{extra}")
        return f"PackedLayout(seq_len={self.seq_len}: " + ", ".join(parts) + ")"


@dataclass(frozen=True, eq=False)
class CallPlan:
    """Everything a transformer call decided before its blocks run: the :class:`PackedLayout` it was given and the
    plan of each attention processor that planned it (``attention``: ``((key, plan), ...)``, a processor's key being
    its frozen config, shared by the blocks that run one plan).

    The call-plan hook (``H3_CALL_PLAN_HOOK``, installed by the attention ``enable_*`` helpers) builds it at the top of
    every transformer forward, outside any compiled region, and publishes it for the call (:func:`use_call_plan`);
    processors read their plan with :meth:`plan_for` (also inside a compiled block, where ``torch.compile`` guards on
    the plan's sizes and choices, not on the object); ``describe()`` reads the last one. Nothing writes into it.
    """

    layout: Optional[PackedLayout] = None
    attention: Tuple[Tuple[Any, Any], ...] = ()

    def plan_for(self, key: Any) -> Any:
        """The plan made for the processors of ``key`` (``None``: not planned in this call)."""
        for planned_key, plan in self.attention:
            if planned_key is key:
                return plan
        return None

    def describe(self) -> Dict[str, Any]:
        layout = self.layout.describe() if self.layout is not None else "none published"
        return {"layout": layout, "attention": [plan.describe() for _, plan in self.attention]}


# The plan of the transformer call running in this thread (a context variable: concurrent calls in other threads have
# their own). use_packed_layout publishes one holding the caller's layout; the call-plan hook publishes the full plan
# of each transformer forward.
_CALL_PLAN: contextvars.ContextVar[Optional[CallPlan]] = contextvars.ContextVar("diffusers_h3_call_plan", default=None)

# The same plan in a thread-local mirror, for code that torch.compile traces: dynamo traces ContextVar.get only in
# recent torch (older releases raise under fullgraph=True and break the graph otherwise), but it traces an attribute of
# a threading.local on every supported release, guarding (in the calling thread) only on the fields the traced code
# reads: a processor's plan, its sizes and choices, never the step. use_call_plan keeps it equal to the context
# variable; the call-plan hook publishes each call's plan in the calling thread right before the blocks run.
_COMPILED = threading.local()


@contextlib.contextmanager
def use_call_plan(plan: Optional[CallPlan]) -> Iterator[Optional[CallPlan]]:
    """Publish ``plan`` for the calls made inside the block (what :func:`current_call_plan` returns)."""
    token = _CALL_PLAN.set(plan)
    _COMPILED.plan = plan
    try:
        yield plan
    finally:
        _CALL_PLAN.reset(token)
        _COMPILED.plan = _CALL_PLAN.get()


def current_call_plan() -> Optional[CallPlan]:
    """The published plan: the context variable's in eager code, its thread-local mirror's in code that
    ``torch.compile`` traces (see ``_COMPILED``)."""
    if torch.compiler.is_compiling():
        return getattr(_COMPILED, "plan", None)
    return _CALL_PLAN.get()


@contextlib.contextmanager
def use_packed_layout(layout: Optional[PackedLayout]) -> Iterator[Optional[PackedLayout]]:
    """Publish ``layout`` for the transformer calls made inside the block: their call plans are made from it."""
    with use_call_plan(CallPlan(layout=layout)):
        yield layout


def current_packed_layout() -> Optional[PackedLayout]:
    plan = current_call_plan()
    return None if plan is None else plan.layout


def require_packed_layout(who: str, seq_len: Optional[int] = None) -> PackedLayout:
    """The published layout, or an error that tells the caller how to provide one."""
    layout = current_packed_layout()
    # torch._C._current_graph_task_id(): -1 outside a backward pass (torch has no public query for it)
    if layout is None and torch._C._current_graph_task_id() != -1:
        raise RuntimeError(
            f"{who} runs during backward without a published plan (a gradient-checkpointed block recomputing): the "
            "call-plan hook re-enters each call's plan for blocks the model checkpoints through "
            "enable_gradient_checkpointing; register it with `diffusers_h3.install_call_plan_hook(transformer)` (the "
            "attention enable_* helpers do), and checkpoint through the model's checkpoint function, not around the "
            "whole transformer call."
        )
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
