"""The VSA route of a transformer call, prepared by the forward-record hook enable_vsa registers before the blocks run
(so that compiled blocks read plain state, tests/pipelines/test_compile_fullgraph.py), and only while one call runs on
the transformer; each call gets its own record."""

import math

import pytest
import torch

from diffusers_h3._hooks import H3_CALL_PLAN_HOOK, get_h3_hook
from diffusers_h3.attention_processors.vsa import disable_vsa, enable_vsa
from diffusers_h3.layout import LayoutSegment, PackedLayout, use_packed_layout
from diffusers_h3.testing.tiny import tiny_transformer


GRID = (4, 4, 8)


def _layout(step=None):
    video = math.prod(GRID)
    segments = (LayoutSegment("text", "prompt", 0, 5), LayoutSegment("video", "target", 5, 5 + video, grid=GRID))
    return PackedLayout(segments, seq_len=5 + video, step_index=step, num_steps=4)


def _routes(model):
    return [block.attn.processor._call_route for block in model.transformer_blocks]


def test_routes_are_prepared_per_call_and_only_for_one_call_at_a_time():
    model = tiny_transformer()
    enable_vsa(model, sparsity=0.5, dense_first_steps=1, dense_layers=(1,))
    hook = get_h3_hook(model, H3_CALL_PLAN_HOOK)
    assert hook is not None and not model._forward_pre_hooks and not model._forward_hooks  # a registry hook only
    original = hook.fn_ref.original_forward
    x = torch.zeros(1, 3)
    seen = []

    def blocks(*args, **kwargs):  # stands in for the blocks: what they read while the call runs
        seen.append(_routes(model))
        return "out"

    hook.fn_ref.original_forward = blocks
    try:
        with use_packed_layout(_layout(step=1)):
            assert hook.new_forward(model, hidden_states=x) == "out"
        (mode0, plan0), (mode1, plan1) = seen[-1]
        assert mode0 == "sparse" and plan0.num_video_tiles == 2 and plan0.seq_len == 5 + math.prod(GRID)
        assert (mode1, plan1) == ("dense", None)  # a dense layer
        assert _routes(model) == [None, None]  # forgotten after the call

        def outer(*args, **kwargs):  # a second call starts while the first runs (another thread)
            hook.fn_ref.original_forward = blocks
            hook.new_forward(model, hidden_states=x)
            seen.append(_routes(model))
            return "out"

        hook.fn_ref.original_forward = outer
        with use_packed_layout(_layout(step=1)):
            hook.new_forward(model, hidden_states=x)
        assert seen[-2] == [None, None] and seen[-1] == [None, None]  # both read their own thread's layout

        hook.fn_ref.original_forward = blocks
        with use_packed_layout(_layout(step=0)):  # a dense first step
            hook.new_forward(model, hidden_states=x)
        assert seen[-1] == [("dense", None), ("dense", None)]
        with use_packed_layout(_layout(step=2)):  # the plan is shared by the blocks and across steps
            hook.new_forward(model, hidden_states=x)
            hook.new_forward(model, hidden_states=x)
        assert seen[-1][0][1] is seen[-2][0][1]

        def failing(*args, **kwargs):
            raise RuntimeError("a block failed")

        hook.fn_ref.original_forward = failing
        with use_packed_layout(_layout(step=2)), pytest.raises(RuntimeError, match="a block failed"):
            hook.new_forward(model, hidden_states=x)
        assert _routes(model) == [None, None]  # no stale route after a failed call
        assert hook._running == 0
        assert hook.record.last.layout.step_index == 2 and hook.record.calls == 7  # the record of the failed call
    finally:
        hook.fn_ref.original_forward = original
    disable_vsa(model)
    assert get_h3_hook(model, H3_CALL_PLAN_HOOK) is None
    assert not model._forward_pre_hooks and not model._forward_hooks
