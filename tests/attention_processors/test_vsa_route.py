"""The VSA route of a transformer call, prepared by enable_vsa's hooks before the blocks run (so that compiled blocks
read plain state, tests/pipelines/test_compile_fullgraph.py), and only while one call runs on the transformer."""

import math

import torch

from diffusers_h3.attention_processors.layout import LayoutSegment, PackedLayout, use_packed_layout
from diffusers_h3.attention_processors.vsa import _ROUTE_HOOKS, disable_vsa, enable_vsa
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
    hooks = getattr(model, _ROUTE_HOOKS)
    x = torch.zeros(1, 3)
    with use_packed_layout(_layout(step=1)):
        hooks.before(model, (), {"hidden_states": x})
    (mode0, plan0), (mode1, plan1) = _routes(model)
    assert mode0 == "sparse" and plan0.num_video_tiles == 2 and plan0.seq_len == 5 + math.prod(GRID)
    assert (mode1, plan1) == ("dense", None)  # a dense layer
    with use_packed_layout(_layout(step=1)):
        hooks.before(model, (), {"hidden_states": x})  # a second call while the first runs (another thread)
    assert _routes(model) == [None, None]  # both read their own thread's layout in the blocks
    hooks.after(model, (), {}, None)
    hooks.after(model, (), {}, None)
    assert _routes(model) == [None, None]
    with use_packed_layout(_layout(step=0)):  # a dense first step
        hooks.before(model, (), {"hidden_states": x})
    assert _routes(model) == [("dense", None), ("dense", None)]
    hooks.after(model, (), {}, None)
    with use_packed_layout(_layout(step=2)):  # the plan is shared by the blocks and across steps
        hooks.before(model, (), {"hidden_states": x})
        plan_a = _routes(model)[0][1]
        hooks.after(model, (), {}, None)
        hooks.before(model, (), {"hidden_states": x})
        assert _routes(model)[0][1] is plan_a
        hooks.after(model, (), {}, None)
    disable_vsa(model)
    assert not hasattr(model, _ROUTE_HOOKS) and not model._forward_pre_hooks and not model._forward_hooks
