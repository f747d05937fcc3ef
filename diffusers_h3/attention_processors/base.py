"""``MiniMaxH3AttnProcessorBase``: what every attention processor of this package shares.

A processor replaces only the attention core ``softmax(Q K^T / sqrt(d)) V`` of ``MiniMaxH3Attention``. The base owns
the rest, so that subclasses stay numerically identical to diffusers' ``MiniMaxH3AttnProcessor`` outside that core:

* **refiner calls** (``rotary_emb is None``: the token refiner, text only) run diffusers' default processor code path,
  without context parallelism, so that the refiner runs once per rank on the unsharded text;
* **projections → core → output**: :func:`~._projections.project_qkv`, then :meth:`core` on
  ``(batch, seq, heads, head_dim)`` tensors, then :func:`~._projections.project_output`;
* **context parallelism**: the hook points ``_attention_backend`` and ``_parallel_config`` (diffusers'
  ``enable_parallelism`` writes ``_parallel_config`` into every processor that declares it). With
  ``ulysses_degree > 1`` the core runs on the full sequence with ``heads / degree`` heads through
  ``_ulysses.ulysses_attention`` (all-to-all before and after); ring attention is refused (it needs a core that returns
  the log-sum-exp);
* **the call's record**: every transformer call has one :class:`~diffusers_h3.layout.ForwardRecord` (its packed
  layout and the kernels its ops ran). The forward-record hook (:mod:`.forward_record`) hands it to the processors
  before the blocks run (:meth:`start_call`); under autograd the processor also finds it itself, and a
  gradient-checkpointed block, which recomputes its attention during backward after the call's record was closed,
  re-enters the record of the call it recomputes, so processors that read the layout work with checkpointing however
  they were installed;
* **describe_path()** from the :class:`~diffusers_h3.kernels.attention.KernelChoice` that the last call recorded
  (under ``torch.compile`` read from the last call's record: the ops run after tracing).

Subclasses implement :meth:`core` (any head count: under Ulysses it sees a slice of the module's heads) and may add
per-row, per-head tensors that must travel with Q/K/V (:meth:`extras`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple, Union

import torch
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor
from torch.utils.weak import WeakIdKeyDictionary

from ..kernels._triton_utils import PendingChoice
from ..kernels.attention.router import KernelChoice
from ..layout import ForwardRecord, active_forward_record, current_forward_record
from ._projections import project_output, project_qkv


class MiniMaxH3AttnProcessorBase:
    r"""
    Base class of the attention processors for ``MiniMaxH3Attention``: refiner policy, context-parallel seam,
    projection → :meth:`core` → output, and :meth:`describe_path` from the recorded :class:`KernelChoice`.

    Subclasses implement ``core(query, key, value, attention_mask=None, **extras) -> out`` on
    ``(batch, seq, heads, head_dim)`` tensors and record what they ran with :meth:`record_choice`.
    """

    # Context-parallel hook points: diffusers' `enable_parallelism` sets `_parallel_config` on processors that
    # declare it; `set_attention_backend` sets `_attention_backend` (used by the refiner path and dense cores).
    _attention_backend = None
    _parallel_config = None

    def __init__(self):
        self._last_choice: Union[KernelChoice, PendingChoice, None] = None
        self._forward_record: Optional[ForwardRecord] = None  # the record of the last transformer call
        # Under autograd: the record of each call by its rotary tensor (the one object every block of the call gets,
        # also when a checkpointed block recomputes during backward), dropped with the call's tensors.
        self._call_records = WeakIdKeyDictionary()
        self._refiner = MiniMaxH3AttnProcessor()  # never given the parallel config

    # -- installation (attention_processors.install): a registered processor's config and how it is installed -------
    config_class = None  # the frozen config dataclass the processor is registered with (register_attention_processor)

    @classmethod
    def prepare(cls, config, model: torch.nn.Module, blocks) -> Any:
        """Check ``model`` (a transformer) for ``config`` before any block changes (raise the one clear error here);
        returns what :meth:`for_block` needs for this model (``None`` by default)."""
        return None

    @classmethod
    def for_block(cls, config, prepared: Any, index: int, block: torch.nn.Module) -> "MiniMaxH3AttnProcessorBase":
        """The processor of transformer block ``index`` (``prepared``: what :meth:`prepare` returned)."""
        return cls(config)

    @classmethod
    def state(cls, found) -> Dict[str, Any]:
        """What is installed, from ``found``: ``[(block, processor)]`` of the blocks with this processor: ``blocks``,
        the first processor's config fields and ``path`` (its ``describe_path()``: after a call, what ran)."""
        first = found[0][1]
        return {"blocks": len(found), **dataclasses.asdict(first.config), "path": first.describe_path()}

    # -- the seams subclasses fill ------------------------------------------------------------------------------------
    def core(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        **extras: torch.Tensor,
    ) -> torch.Tensor:
        """The attention core on ``(batch, seq, heads, head_dim)`` tensors; returns the same layout."""
        raise NotImplementedError(f"{type(self).__name__} must implement core(query, key, value, attention_mask)")

    def extras(self, attn, hidden_states: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Per-row, per-head tensors ``(batch, seq, heads, ...)`` that :meth:`core` needs besides Q/K/V (they are
        sharded like Q/K/V under context parallelism). None by default."""
        return {}

    def record_choice(self, choice: Union[KernelChoice, PendingChoice]) -> None:
        """Remember what the last call ran (``describe_path`` reports it); under ``torch.compile`` the op's
        :class:`PendingChoice`, read from the call's record when asked."""
        self._last_choice = choice

    def resolve_choice(self, choice: Union[KernelChoice, PendingChoice, None]) -> Optional[KernelChoice]:
        """``choice`` as recorded: a :class:`PendingChoice` is read from the record of the last transformer call."""
        if isinstance(choice, PendingChoice):
            return choice.resolve(self._forward_record)
        return choice

    @property
    def last_choice(self) -> Optional[KernelChoice]:
        return self.resolve_choice(self._last_choice)

    def describe_path(self) -> str:
        """One line: what the last call ran, and why."""
        choice = self.last_choice
        if choice is None:
            return f"{type(self).__name__}: not called yet"
        return f"{type(self).__name__}: {choice.describe()}"

    # -- the transformer call (the forward-record hook, outside the possibly compiled blocks) -------------------------
    def start_call(self, record: ForwardRecord, device: torch.device, only_call: bool) -> None:
        """Before the blocks of a transformer call run: ``record`` is that call's record; ``only_call`` is False when
        another call runs on the same transformer at the same time (threads)."""
        self._forward_record = record

    def finish_call(self) -> None:
        """After the call (also when it raised): forget per-call state."""

    # -- the call ---------------------------------------------------------------------------------------------------
    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        rotary_emb: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
        attention_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if rotary_emb is None:
            return self.refiner_call(attn, hidden_states, attention_mask)
        if torch.is_grad_enabled():
            # A gradient-checkpointed block runs this again during backward, after the call's record was closed.
            record = self._record_to_reenter(rotary_emb[0])
            if record is not None:
                with active_forward_record(record):
                    return self.project_and_attend(attn, hidden_states, rotary_emb, attention_mask)
        return self.project_and_attend(attn, hidden_states, rotary_emb, attention_mask)

    @torch.compiler.disable  # context-variable and dictionary bookkeeping: one eager island under torch.compile
    def _record_to_reenter(self, anchor: torch.Tensor) -> Optional[ForwardRecord]:
        """For a call under autograd: the record to re-enter, or ``None`` when none needs re-entering.

        Inside a transformer call (a record is open) the record is kept for ``anchor``, the call's rotary tensor,
        and ``None`` is returned. Outside one, the call is a gradient-checkpointed block recomputing during backward
        (or on the autograd engine's device thread): the record kept for ``anchor`` by its forward is returned
        (``None`` for a call that never had one: the layout error then says how to publish it).
        """
        record = current_forward_record()
        if record is not None:
            self._forward_record = record
            self._call_records[anchor] = record
            return None
        return self._call_records.get(anchor)

    def project_and_attend(self, attn, hidden_states, rotary_emb, attention_mask=None) -> torch.Tensor:
        """Projections → :meth:`attend` → output projection (a block call with rotary embeddings)."""
        query, key, value = project_qkv(attn, hidden_states, rotary_emb)
        out = self.attend(query, key, value, attention_mask, self.extras(attn, hidden_states))
        return project_output(attn, out, query.dtype)

    def refiner_call(self, attn, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None):
        """Token-refiner calls (text only, ``rotary_emb=None``): diffusers' default processor, on one rank's full
        (unsharded) text, so without the context-parallel config."""
        self._refiner._attention_backend = self._attention_backend
        return self._refiner(attn, hidden_states, None, attention_mask)

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        extras: Optional[Dict[str, torch.Tensor]] = None,
    ) -> torch.Tensor:
        """:meth:`core`, through Ulysses sequence parallelism when the parallel config asks for it."""
        extras = extras or {}
        degree = self._ulysses_degree()
        if degree <= 1:
            return self.core(query, key, value, attention_mask, **extras)
        if attention_mask is not None:
            raise ValueError(f"{type(self).__name__}: context parallelism takes no attention_mask (H3 passes none)")
        try:
            from ._ulysses import ulysses_attention
        except ImportError as error:
            raise NotImplementedError(
                f"{type(self).__name__}: Ulysses context parallelism needs diffusers_h3.attention_processors._ulysses, "
                f"which could not be imported ({error}); run without enable_parallelism"
            ) from error

        def core_fn(q, k, v, shard_extras):
            return self.core(q, k, v, None, **(shard_extras or {}))

        return ulysses_attention(core_fn, query, key, value, self._parallel_config, extras or None)

    def _ulysses_degree(self) -> int:
        """The Ulysses degree of the context-parallel config (1 without one); ring attention is refused here, once for
        every processor."""
        config = getattr(self._parallel_config, "context_parallel_config", None)
        if config is None:
            return 1
        ring = getattr(config, "ring_degree", None) or 1
        if ring > 1:
            raise NotImplementedError(
                f"{type(self).__name__}: ring attention needs a backend with LSE; use ulysses_degree (ring_degree={ring})"
            )
        return getattr(config, "ulysses_degree", None) or 1

