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
* **the call's plan**: every transformer call has one frozen :class:`~diffusers_h3.layout.CallPlan` (its packed
  layout and each processor's plan: route, tile plan, kernel choice, precisions), made by the call-plan hook
  (:mod:`.call_plan`) before the blocks run, outside any compiled region, from the layout, the call's device and
  dtype and the kernels' pure selection; a processor reads its plan with :meth:`current_plan` and its ops write
  nothing back. A processor set by hand (no hook) plans its first block call itself, in one eager island. A
  gradient-checkpointed block, which recomputes its attention during backward after the call ended, runs under the
  plan of the call it recomputes: the call-plan hook hands the checkpoint function blocks that publish it;
* **describe_path()** from the plan of the last call (its :class:`~diffusers_h3.kernels.attention.KernelChoice`).

Subclasses implement :meth:`core` (any head count: under Ulysses it sees a slice of the module's heads), may add
per-row, per-head tensors that must travel with Q/K/V (:meth:`extras`), and plan their calls with :meth:`plan_call`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

import torch
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor

from ..kernels.attention.router import KernelChoice
from ..layout import current_call_plan, current_packed_layout
from ._projections import project_output, project_qkv


@dataclasses.dataclass(frozen=True)
class CallInputs:
    """What a processor's plan of a transformer call is made from: the published layout (``None``: none), the device
    and dtype of the attention inputs and the head dim (a plan is checked against the inputs it meets: ``fits``)."""

    layout: Any
    device: torch.device
    dtype: torch.dtype
    head_dim: int


def made_for(plan: Any, query: torch.Tensor, *, dtype: bool = True) -> bool:
    """Whether ``plan`` (a frozen plan with ``device``, ``head_dim`` and, unless ``dtype=False``, ``dtype`` fields) was
    made for attention inputs like ``query``: the check behind every plan's ``fits``."""
    return (query.device == plan.device and query.shape[-1] == plan.head_dim
            and (not dtype or query.dtype == plan.dtype))  # fmt: skip


@dataclasses.dataclass(frozen=True)
class PlanForInputs:
    """Base of a processor's frozen plan of one call: the ``kernel`` it runs, for attention inputs of one ``device``,
    ``dtype`` and ``head_dim``."""

    kernel: KernelChoice
    device: torch.device
    dtype: torch.dtype
    head_dim: int

    def fits(self, query: torch.Tensor) -> bool:
        return made_for(self, query)

    def describe(self) -> str:
        return self.kernel.describe()


class MiniMaxH3AttnProcessorBase:
    r"""
    Base class of the attention processors for ``MiniMaxH3Attention``: refiner policy, context-parallel seam,
    projection → :meth:`core` → output, and :meth:`describe_path` from the call's plan.

    Subclasses implement ``core(query, key, value, attention_mask=None, **extras) -> out`` on
    ``(batch, seq, heads, head_dim)`` tensors; what a call decides is planned in :meth:`plan_call` and read with
    :meth:`current_plan` (a frozen plan, e.g. a :class:`PlanForInputs`, whose ``kernel`` :meth:`describe_path` reports).
    """

    # Context-parallel hook points: diffusers' `enable_parallelism` sets `_parallel_config` on processors that
    # declare it; `set_attention_backend` sets `_attention_backend` (used by the refiner path and dense cores).
    _attention_backend = None
    _parallel_config = None

    def __init__(self):
        self.last_plan: Any = None  # this processor's plan of the last transformer call (describe_path)
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

    @property
    def last_choice(self) -> Optional[KernelChoice]:
        """The kernel of the last call, from its plan."""
        return getattr(self.last_plan, "kernel", None)

    def describe_path(self) -> str:
        """One line: what the last call ran, and why."""
        choice = self.last_choice
        if choice is None:
            return f"{type(self).__name__}: not called yet"
        return f"{type(self).__name__}: {choice.describe()}"

    # -- the call's plan (made by the call-plan hook, outside the possibly compiled blocks) ---------------------------
    @property
    def plan_key(self) -> Any:
        """What the call plan files this processor's plan under: its frozen config, one object shared by the blocks
        that run one plan (``None``: the processor plans each call itself, through :meth:`current_plan`)."""
        return getattr(self, "config", None)

    # Whether a plan depends on the call's layout (then every call is planned anew; otherwise a processor set by hand
    # reuses its last plan while it fits the inputs, so its compiled blocks read plain data after the first call).
    plans_read_layout = True

    def plan_call(self, call: "CallInputs") -> Any:
        """The frozen plan of a transformer call (``call``: its layout, device, attention dtype and head dim), made
        once per call before the blocks run; ``None`` (the default) for a core that needs none, whose calls
        ``describe_path`` then cannot name."""
        return None

    def current_plan(self, query: torch.Tensor) -> Any:
        """This processor's plan for the running call, checked against ``query``: the one the call plan holds, or,
        without one (a processor set by hand) or when it was made for other inputs, a plan made here."""
        call_plan = current_call_plan()
        plan = call_plan.plan_for(self.plan_key) if call_plan is not None else None
        if plan is None and not self.plans_read_layout:
            plan = self.last_plan  # a plan that does not depend on the call's layout holds for the next call too
        if plan is None or not plan.fits(query):
            plan = self._plan_here(query.shape[-1], query.device, query.dtype)
        return plan

    @torch.compiler.disable  # context-variable reads and plan caches: one eager island under torch.compile
    def _plan_here(self, head_dim: int, device: torch.device, dtype: torch.dtype) -> Any:
        plan = self.plan_call(CallInputs(current_packed_layout(), device, dtype, head_dim))
        self.last_plan = plan
        return plan

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
        return self.project_and_attend(attn, hidden_states, rotary_emb, attention_mask)

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

