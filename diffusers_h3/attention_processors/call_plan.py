"""One record per transformer call: the hook that opens it and hands it to the attention processors.

The attention ``enable_*`` helpers register :class:`ForwardRecordHook` on the transformer (``H3_CALL_PLAN_HOOK``).
At the top of every forward it opens a fresh :class:`~diffusers_h3.layout.ForwardRecord` holding the published
:class:`~diffusers_h3.layout.PackedLayout`, gives it to every processor of this package in the blocks (the VSA
processor derives its route of the call from it, so that compiled blocks read plain state and specialize on the mode
and the plan's sizes, never on a layout object or a denoising step), keeps it open while the blocks run (the kernel ops
write what they ran into it, also inside a compiled graph) and keeps it as the transformer's last record afterwards,
which ``describe()`` reads. Two transformers in one process therefore report their own paths.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import List, Optional

import torch

from .._hooks import H3_CALL_PLAN_HOOK, H3Hook, get_h3_hook, register_h3_hook, remove_h3_hook
from ..layout import ForwardRecord, active_forward_record, current_packed_layout
from .base import MiniMaxH3AttnProcessorBase


@dataclass
class ForwardRecords:
    """The hook's record: how many transformer calls ran, and the record of the last one (``None`` before a call)."""

    calls: int = 0
    last: Optional[ForwardRecord] = None


class ForwardRecordHook(H3Hook):
    """Opens one :class:`ForwardRecord` per transformer call. Per-call processor state (the VSA route) is prepared only
    while exactly one call runs on the transformer: a call that starts while another one runs (threads serving
    requests) clears it, so that every block of both reads its own call's record instead."""

    _lock = threading.Lock()  # one for every transformer (a class-level lock keeps the model deep-copyable)

    def __init__(self):
        super().__init__(ForwardRecords())
        self._running = 0

    def new_forward(self, transformer, *args, **kwargs):
        hidden_states = kwargs.get("hidden_states", args[0] if args else None)
        record = ForwardRecord(layout=current_packed_layout())
        processors = _processors(transformer)
        with self._lock:
            self._running += 1
            only_call = self._running == 1 and isinstance(hidden_states, torch.Tensor)
            device = hidden_states.device if isinstance(hidden_states, torch.Tensor) else None
            if not only_call:
                for processor in processors:
                    processor.finish_call()
            for processor in processors:
                processor.start_call(record, device, only_call)
        try:
            with active_forward_record(record):
                return self.fn_ref.original_forward(*args, **kwargs)
        finally:  # also when the call raises: the next call must not read stale per-call state
            with self._lock:
                self._running -= 1
                self.record.calls += 1
                self.record.last = record
                for processor in processors:
                    processor.finish_call()


def _processors(transformer) -> List[MiniMaxH3AttnProcessorBase]:
    found = {}
    for block in getattr(transformer, "transformer_blocks", ()):
        processor = getattr(getattr(block, "attn", None), "processor", None)
        if isinstance(processor, MiniMaxH3AttnProcessorBase):
            found[id(processor)] = processor  # one instance may serve every block (set_attn_processor)
    return list(found.values())


def install_call_plan_hook(transformer) -> None:
    """Register the forward-record hook on ``transformer`` (once; an attention ``enable_*`` calls it)."""
    if get_h3_hook(transformer, H3_CALL_PLAN_HOOK) is None:
        register_h3_hook(transformer, ForwardRecordHook(), H3_CALL_PLAN_HOOK)


def remove_call_plan_hook(transformer) -> None:
    remove_h3_hook(transformer, H3_CALL_PLAN_HOOK, recurse=False)


def last_forward_record(transformer) -> Optional[ForwardRecord]:
    """The record of ``transformer``'s last call (``None`` before one, or without the hook)."""
    hook = get_h3_hook(transformer, H3_CALL_PLAN_HOOK)
    return None if hook is None else hook.record.last
