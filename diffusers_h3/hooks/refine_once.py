"""The token refiner runs once per request instead of once per denoising step.

H3's token refiner is timestep-free: within one request it receives the same prompt rows at every step. While a
request denoises, :func:`refine_text_once` registers :class:`RefineTextOnceHook` (``H3_REFINE_TEXT_ONCE_HOOK``) on
``transformer.token_refiner``; the hook answers a call whose input equals the previous one with the previous output
(exact: it is what the refiner would recompute) and runs the refiner otherwise. ``reset_state`` drops the cached
pair, at the start of each request and again when the hook is removed at its end, so nothing carries over.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from .._hooks import H3_REFINE_TEXT_ONCE_HOOK, H3Hook, get_h3_hook, register_h3_hook, remove_h3_hook


@dataclass
class RefineOnceRecord:
    """Refiner runs of the current request (1 when every step reused the first run's output)."""

    runs: int = 0


class RefineTextOnceHook(H3Hook):
    """Replaces the refiner's forward within the hook chain: an identical input returns the cached output."""

    _is_stateful = True

    def __init__(self) -> None:
        super().__init__(RefineOnceRecord())
        self._entry = None  # (input, output) of the last run

    def new_forward(self, module, hidden_states, *args, **kwargs):
        cached = self._entry
        if (
            not args
            and not kwargs
            and cached is not None
            and cached[0].shape == hidden_states.shape
            and torch.equal(cached[0], hidden_states)
        ):
            return cached[1]
        output = self.fn_ref.original_forward(hidden_states, *args, **kwargs)
        self._entry = (hidden_states.detach().clone(), output)
        self.record.runs += 1
        return output

    def reset_state(self, module):
        self._entry = None
        self.record = RefineOnceRecord()
        return module


@contextlib.contextmanager
def refine_text_once(transformer: torch.nn.Module) -> Iterator[Optional[RefineOnceRecord]]:
    """Within the block, ``transformer``'s token refiner runs once per distinct input (once per request); yields the
    hook's :class:`RefineOnceRecord` (``None`` for a transformer without a refiner)."""
    refiner = getattr(transformer, "token_refiner", None)
    if refiner is None:
        yield None
        return
    hook = get_h3_hook(refiner, H3_REFINE_TEXT_ONCE_HOOK)
    if hook is None:
        hook = register_h3_hook(refiner, RefineTextOnceHook(), H3_REFINE_TEXT_ONCE_HOOK, root=transformer)
    hook.reset_state(refiner)
    try:
        yield hook.record
    finally:
        hook.reset_state(refiner)
        remove_h3_hook(refiner, H3_REFINE_TEXT_ONCE_HOOK, recurse=False, root=transformer)
