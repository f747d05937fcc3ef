"""One plan per transformer call: the layout, routes and kernel choices of a call live in the CallPlan the model's
hook makes before the blocks run, so two models in one process report their own paths, also when their blocks are
compiled (the plans are made outside the compiled region and the ops write nothing back)."""

import os

import pytest
import torch

from diffusers_h3 import describe
from diffusers_h3.attention_processors.call_plan import last_call_plan
from diffusers_h3.attention_processors.vsa import disable_vsa, enable_vsa
from diffusers_h3.layout import current_call_plan, use_packed_layout
from diffusers_h3.packing import build_layout
from diffusers_h3.testing.tiny import tiny_transformer, tiny_transformer_inputs


TEXT, AUDIO, GRID = 5, 4, (4, 4, 8)  # two 4x4x4 video tiles: VSA at sparsity 0.5 runs sparse


def _run(model, step):
    inputs = tiny_transformer_inputs(seed=1, seq_text=TEXT, seq_audio=AUDIO, grid=GRID)
    with torch.no_grad(), use_packed_layout(build_layout(TEXT, [], AUDIO, GRID, 1).at_step(step, 4)):
        return model(**inputs, return_dict=False)


@pytest.mark.triton_interpreter  # model a runs the interpreted Triton kernels
@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="backend='triton' on CPU tensors needs the Triton interpreter; a CUDA host compiles the kernels for the GPU",
)
def test_two_compiled_models_report_their_own_kernels_and_layouts():
    import torch._dynamo

    torch.manual_seed(0)
    a, b = tiny_transformer(), tiny_transformer()
    enable_vsa(a, sparsity=0.5, backend="triton")
    enable_vsa(b, sparsity=0.5, backend="torch")
    torch._dynamo.reset()
    try:
        for model in (a, b):
            model.compile_repeated_blocks(fullgraph=True, backend="eager")
        _run(a, step=1)
        _run(b, step=3)  # b runs last: a must not report b's kernels
    finally:
        torch._dynamo.reset()
    path_a = a.transformer_blocks[0].attn.processor.describe_path()
    path_b = b.transformer_blocks[0].attn.processor.describe_path()
    assert "triton kernel (sparse" in path_a and "torch reference" not in path_a, path_a
    assert "torch reference kernels (backend='torch')" in path_b and "triton kernel" not in path_b, path_b
    report_a, report_b = describe(a)["model"], describe(b)["model"]
    assert report_a["attention"][path_a] == len(a.transformer_blocks)  # every block, the refiner aside
    assert report_b["attention"][path_b] == len(b.transformer_blocks)
    (plan_a,), (plan_b,) = report_a["last_forward"]["attention"], report_b["last_forward"]["attention"]
    assert plan_a.startswith("VSA sparse (TilePlan(") and ": triton kernel (sparse" in plan_a, plan_a
    assert ": torch-reference kernel (sparse" in plan_b, plan_b
    assert last_call_plan(a).layout.step_index == 1 and last_call_plan(b).layout.step_index == 3
    assert current_call_plan() is None  # nothing stays published after the calls
    disable_vsa(a)
    assert last_call_plan(a) is None and "last_forward" not in describe(a)["model"]
