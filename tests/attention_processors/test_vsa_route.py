"""The VSA route of a transformer call is planned by the call-plan hook enable_vsa registers, before the blocks run
(so that compiled blocks read plain data, tests/pipelines/test_compile_fullgraph.py): one frozen plan per call,
published for that call only, so concurrent calls in two threads each read their own."""

import math
import threading

import pytest
import torch

from diffusers_h3._hooks import H3_CALL_PLAN_HOOK, get_h3_hook
from diffusers_h3.attention_processors.vsa import disable_vsa, enable_vsa
from diffusers_h3.layout import LayoutSegment, PackedLayout, current_call_plan, use_packed_layout
from diffusers_h3.testing.tiny import tiny_transformer


GRID = (4, 4, 8)


def _layout(step=None):
    video = math.prod(GRID)
    segments = (LayoutSegment("text", "prompt", 0, 5), LayoutSegment("video", "target", 5, 5 + video, grid=GRID))
    return PackedLayout(segments, seq_len=5 + video, step_index=step, num_steps=4)


def _seen_plans(model, seen, wait=None):
    def blocks(*args, **kwargs):  # stands in for the blocks: the plan each of them reads while the call runs
        if wait is not None:
            wait.wait(timeout=10)
        plan = current_call_plan()
        seen.append((plan, [plan.plan_for(b.attn.processor.plan_key) for b in model.transformer_blocks]))
        return "out"

    return blocks


def test_one_plan_per_call_made_before_the_blocks_and_published_for_the_call_only():
    model = tiny_transformer()
    enable_vsa(model, sparsity=0.5, dense_first_steps=1, dense_layers=(1,))
    hook = get_h3_hook(model, H3_CALL_PLAN_HOOK)
    assert hook is not None and not model._forward_pre_hooks and not model._forward_hooks  # a registry hook only
    original = hook.fn_ref.original_forward
    processors = [block.attn.processor for block in model.transformer_blocks]
    x = torch.zeros(1, 3)
    seen = []
    hook.fn_ref.original_forward = _seen_plans(model, seen)
    try:
        with use_packed_layout(_layout(step=1)):
            assert hook.new_forward(model, hidden_states=x) == "out"
        call, (plan0, plan1) = seen[-1]
        assert len(call.attention) == 1 and plan0 is plan1  # the blocks of one enable_vsa share one plan
        assert plan0.route == "sparse" and plan0.tiles.num_video_tiles == 2 and plan0.tiles.seq_len == 5 + 128
        assert plan0.topk == 1 and plan0.sparse_kernel.kernel == "torch-reference"
        assert processors[1].layer_dense and not processors[0].layer_dense  # block 1 runs dense whatever the route
        assert current_call_plan() is None  # nothing published after the call
        assert all(p.last_plan is plan0 for p in processors)  # what describe_path reports

        with use_packed_layout(_layout(step=0)):  # a dense first step
            hook.new_forward(model, hidden_states=x)
        assert seen[-1][1][0].route == "dense" and seen[-1][1][0].tiles is None
        with use_packed_layout(_layout(step=2)):  # the tile plan is shared across steps
            hook.new_forward(model, hidden_states=x)
            hook.new_forward(model, hidden_states=x)
        assert seen[-1][1][0].tiles is seen[-2][1][0].tiles and seen[-1][0] is not seen[-2][0]

        def failing(*args, **kwargs):
            raise RuntimeError("a block failed")

        hook.fn_ref.original_forward = failing
        with use_packed_layout(_layout(step=2)), pytest.raises(RuntimeError, match="a block failed"):
            hook.new_forward(model, hidden_states=x)
        assert current_call_plan() is None and hook.record.calls == 5
        assert hook.record.last.layout.step_index == 2  # the plan of the failed call
    finally:
        hook.fn_ref.original_forward = original
    disable_vsa(model)
    assert get_h3_hook(model, H3_CALL_PLAN_HOOK) is None
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_concurrent_calls_in_two_threads_read_their_own_plans():
    model = tiny_transformer()
    enable_vsa(model, sparsity=0.5, dense_first_steps=1)
    hook = get_h3_hook(model, H3_CALL_PLAN_HOOK)
    original = hook.fn_ref.original_forward
    both_running = threading.Barrier(2)
    seen = []
    hook.fn_ref.original_forward = _seen_plans(model, seen, wait=both_running)

    def call(step):
        with use_packed_layout(_layout(step=step)):
            hook.new_forward(model, hidden_states=torch.zeros(1, 3))

    try:
        threads = [threading.Thread(target=call, args=(step,)) for step in (0, 3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
    finally:
        hook.fn_ref.original_forward = original
    routes = sorted((plan.layout.step_index, plans[0].route) for plan, plans in seen)
    assert routes == [(0, "dense"), (3, "sparse")]  # each call's blocks read the plan of their own call


@pytest.mark.parametrize("hook", [True, False])
def test_a_layout_of_other_rows_is_refused_in_one_line(hook):
    from diffusers_h3.attention_processors.vsa import MiniMaxH3VSAProcessor
    from diffusers_h3.packing import build_layout
    from diffusers_h3.testing.tiny import tiny_transformer_inputs

    model = tiny_transformer()
    if hook:
        enable_vsa(model, sparsity=0.5, backend="torch")
    else:
        model.set_attn_processor(MiniMaxH3VSAProcessor(sparsity=0.5, backend="torch"))
    inputs = tiny_transformer_inputs(seed=1, seq_text=5, seq_audio=4, grid=GRID)
    other = build_layout(5, [], 4, (4, 4, 4), 1)  # one video tile less than the inputs have
    with torch.no_grad(), use_packed_layout(other), pytest.raises(RuntimeError, match="PackedLayout has"):
        model(**inputs, return_dict=False)
