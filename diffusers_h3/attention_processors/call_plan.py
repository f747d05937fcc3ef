"""One frozen plan per transformer call: the hook that makes it before the blocks run and publishes it for the call.

The attention ``enable_*`` helpers register :class:`CallPlanHook` on the transformer (``H3_CALL_PLAN_HOOK``). At the
top of every forward, eagerly (outside the compiled blocks), it asks each attention processor of this package in the
blocks for its plan of the call (:meth:`~.base.MiniMaxH3AttnProcessorBase.plan_call`: route, tile plan, kernel choice,
precisions, from the published :class:`~diffusers_h3.layout.PackedLayout`, the call's device and the attention dtype),
puts the plans in one frozen :class:`~diffusers_h3.layout.CallPlan`, publishes it for the call (a context variable,
mirrored thread-locally for compiled code: a call in another thread has its own) and keeps it as the transformer's last plan, which ``describe()`` reads. The
blocks read their processor's plan as plain data, so compiled blocks specialize on the route and the plan's sizes and
choices, never on a layout object or a denoising step; the kernels they call write nothing back.

Under gradient checkpointing a block runs again during backward, after the call returned (on CUDA, in the autograd
engine's own thread, where nothing the call published is visible). The hook therefore wraps the model's checkpoint
function once (:class:`PlanReenteringCheckpoint`): it hands the checkpoint function each block wrapped in a callable
that publishes the plan of the call that checkpointed it, so the recompute runs under that call's plan (a call in
another thread captures its own). This holds for a checkpoint function that calls the module it is given (diffusers'
default, torch's reentrant and non-reentrant checkpoint), not for one that checkpoints blocks some other way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from .._hooks import H3_CALL_PLAN_HOOK, H3Hook, get_h3_hook, register_h3_hook, remove_h3_hook
from ..layout import CallPlan, current_call_plan, current_packed_layout, use_call_plan
from .base import CallInputs, MiniMaxH3AttnProcessorBase


@dataclass
class CallPlans:
    """The hook's record: how many transformer calls ran, and the plan of the last one (``None`` before a call)."""

    calls: int = 0
    last: Optional[CallPlan] = None


class CallPlanHook(H3Hook):
    """Makes and publishes one :class:`CallPlan` per transformer call (see the module docstring)."""

    def __init__(self):
        super().__init__(CallPlans())

    def new_forward(self, transformer, *args, **kwargs):
        hidden_states = kwargs.get("hidden_states", args[0] if args else None)
        plan = plan_transformer_call(transformer, hidden_states)
        wrap_checkpoint_function(transformer)  # again after each enable_gradient_checkpointing
        try:
            with use_call_plan(plan):
                return self.fn_ref.original_forward(*args, **kwargs)
        finally:  # also when the call raises: describe() reports the plan of the call that ran last
            self.record.calls += 1
            self.record.last = plan


class PlanReenteringCheckpoint:
    """A model's checkpoint function (diffusers' ``_gradient_checkpointing_func``, the one place a model hands its
    blocks to checkpointing), handing it each block wrapped so that the block runs under the call plan published when
    it was checkpointed: in the forward, and again when backward recomputes it."""

    def __init__(self, checkpoint):
        self.checkpoint = checkpoint

    def __call__(self, block, *args, **kwargs):
        plan = current_call_plan()
        return self.checkpoint(block if plan is None else _BlockUnderPlan(block, plan), *args, **kwargs)


def wrap_checkpoint_function(transformer) -> None:
    """Wrap ``transformer``'s checkpoint function in a :class:`PlanReenteringCheckpoint` (once; none before
    ``enable_gradient_checkpointing``)."""
    checkpoint = transformer.__dict__.get("_gradient_checkpointing_func")
    if checkpoint is not None and not isinstance(checkpoint, PlanReenteringCheckpoint):
        transformer._gradient_checkpointing_func = PlanReenteringCheckpoint(checkpoint)


def unwrap_checkpoint_function(transformer) -> None:
    checkpoint = transformer.__dict__.get("_gradient_checkpointing_func")
    if isinstance(checkpoint, PlanReenteringCheckpoint):
        transformer._gradient_checkpointing_func = checkpoint.checkpoint


class _BlockUnderPlan:
    """``block`` run under ``plan``: what the checkpoint function calls (``module(...)`` or ``module.forward(...)``), in
    the forward and again when it recomputes the block; other attributes are the block's."""

    def __init__(self, block, plan: CallPlan):
        self.block = block
        self.plan = plan

    def __call__(self, *args, **kwargs):
        with use_call_plan(self.plan):
            return self.block(*args, **kwargs)

    def forward(self, *args, **kwargs):
        with use_call_plan(self.plan):
            return self.block.forward(*args, **kwargs)

    def __getattr__(self, name):  # only for names not set in __init__
        if name in ("block", "plan"):
            raise AttributeError(name)
        return getattr(self.block, name)


def plan_transformer_call(transformer, hidden_states) -> CallPlan:
    """The :class:`CallPlan` of a call of ``transformer`` with ``hidden_states`` under the published layout: one plan
    per processor key (the processors of one ``enable_*`` share it), each processor told its plan for reporting."""
    layout = current_packed_layout()
    groups: Dict[int, List[MiniMaxH3AttnProcessorBase]] = {}
    inputs = {}
    for block in getattr(transformer, "transformer_blocks", ()):
        attn = getattr(block, "attn", None)
        processor = getattr(attn, "processor", None)
        if not isinstance(processor, MiniMaxH3AttnProcessorBase) or processor.plan_key is None:
            continue
        key = id(processor.plan_key)
        if key not in groups:
            groups[key] = []
            inputs[key] = _call_inputs(layout, attn, hidden_states)
        if all(p is not processor for p in groups[key]):  # one instance may serve every block (set_attn_processor)
            groups[key].append(processor)
    attention = []
    for key, processors in groups.items():
        if inputs[key] is None:
            continue
        planned = processors[0].plan_call(inputs[key])
        if planned is None:
            continue
        attention.append((processors[0].plan_key, planned))
        for processor in processors:
            processor.last_plan = planned
    return CallPlan(layout=layout, attention=tuple(attention))


def _call_inputs(layout, attn, hidden_states) -> Optional[CallInputs]:
    """The device and dtype Q/K/V will have in ``attn`` (its query projection's compute dtype: a quantized weight
    reports it as its dtype) and the head dim; ``None`` without a tensor input."""
    if not isinstance(hidden_states, torch.Tensor):
        return None
    projection = getattr(attn, "to_qkv", None) if getattr(attn, "fused_projections", False) else None
    weight = getattr(projection if projection is not None else attn.to_q, "weight", None)
    dtype = weight.dtype if isinstance(weight, torch.Tensor) else hidden_states.dtype
    return CallInputs(layout, hidden_states.device, dtype, attn.head_dim)


def install_call_plan_hook(transformer) -> None:
    """Register the call-plan hook on ``transformer`` (once; the attention ``enable_*`` helpers call it). A processor set
    with ``set_attn_processor`` and trained with gradient checkpointing needs it: the hook is what re-enters a call's
    plan when a checkpointed block recomputes."""
    if get_h3_hook(transformer, H3_CALL_PLAN_HOOK) is None:
        register_h3_hook(transformer, CallPlanHook(), H3_CALL_PLAN_HOOK)


def remove_call_plan_hook(transformer) -> None:
    remove_h3_hook(transformer, H3_CALL_PLAN_HOOK, recurse=False)
    unwrap_checkpoint_function(transformer)


def last_call_plan(transformer) -> Optional[CallPlan]:
    """The plan of ``transformer``'s last call (``None`` before one, or without the hook)."""
    hook = get_h3_hook(transformer, H3_CALL_PLAN_HOOK)
    return None if hook is None else hook.record.last
