"""The kernel a call runs is chosen before the call, from a description of the operands the call will build. These
tests hold the description to what the calls build: for each precision path, the operands the fine kernel receives
are the ones the plan chose its kernel for (else the Hopper kernel could be planned for inputs it refuses), and the
op runs the planned kernel or refuses, never another one."""

import math

import pytest
import torch

from diffusers_h3.attention_processors import vsa as vsa_module
from diffusers_h3.attention_processors.tiling import build_tile_plan
from diffusers_h3.attention_processors.vsa import plan_vsa_kernel, vsa_attention
from diffusers_h3.kernels.attention import dense_quantized
from diffusers_h3.kernels.attention.dense_quantized import fp8_attention, plan_fp8_attention
from diffusers_h3.kernels.attention.router import AttentionOperands, KernelChoice, block_sparse_attention
from diffusers_h3.kernels.attention.tuning import read_launch_options
from diffusers_h3.layout import LayoutSegment, PackedLayout


GRID = (2, 4, 8)


def _inputs(seed=0, heads=2, head_dim=16):
    video = math.prod(GRID)
    layout = PackedLayout((LayoutSegment("text", "prompt", 0, 7), LayoutSegment("video", "target", 7, 7 + video,
                                                                                  grid=GRID)), seq_len=7 + video)
    plan = build_tile_plan(layout, tile=(2, 4, 4))  # 32-row tiles (FP8 P·V needs >= 32)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, layout.seq_len, heads, head_dim, generator=gen) for _ in range(3))
    return plan, q, k, v


def _capture(monkeypatch, module):
    seen = []
    original = module.block_sparse_attention_op

    def spy(q, k, v, tiles, scales, block, scale, out_dtype, launch, options):
        p_fp4, _ = read_launch_options(options, launch)
        seen.append((AttentionOperands.of(q, k, v, q_scale=scales[0], v_scale=scales[2], p_fp4=p_fp4), launch))
        return original(q, k, v, tiles, scales, block, scale, out_dtype, launch, options)

    monkeypatch.setattr(module, "block_sparse_attention_op", spy)
    return seen


@pytest.mark.triton_interpreter
@pytest.mark.parametrize(
    "precision, pv_precision, emulate",
    [("bf16", "bf16", False), ("fp8", "bf16", False), ("int8", "fp8", False), ("fp8", "fp8", True), ("fp4", "bf16", False)],
)
def test_vsa_plans_the_operands_its_fine_stage_receives(monkeypatch, precision, pv_precision, emulate):
    plan, q, k, v = _inputs()
    options = {"precision": precision, "pv_precision": pv_precision, "emulate": emulate, "fp4_p": "two_level"}
    choice, operands = plan_vsa_kernel(q.shape[-1], q.dtype, q.device, block=plan.block, backend="triton", **options)
    seen = _capture(monkeypatch, vsa_module)
    with torch.no_grad():
        vsa_attention(q, k, v, plan, sparsity=0.5, backend="triton", choice=choice, **options)
    assert seen == [(operands, choice.launch)]


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("pv_fp8", [False, True])
def test_fp8_attention_plans_the_operands_its_kernel_receives(monkeypatch, pv_fp8):
    _, q, k, v = _inputs(seed=1)
    choice, block_n = plan_fp8_attention(q.shape[-1], q.device, pv_fp8=pv_fp8, qk_dtype=torch.int8, out_dtype=q.dtype,
                                         backend="triton")  # fmt: skip
    seen = _capture(monkeypatch, dense_quantized)
    with torch.no_grad():
        fp8_attention(q, k, v, pv_fp8=pv_fp8, qk_dtype=torch.int8, block_n=block_n, choice=choice)
    (operands, launch), = seen
    assert launch == choice.launch == "triton:dense" and block_n == 64
    v_layout = "channel-major" if pv_fp8 else "contiguous"
    assert operands == AttentionOperands(q.shape[-1], torch.int8, torch.float8_e4m3fn if pv_fp8 else q.dtype,
                                         v_layout=v_layout, q_scaled=True, v_scaled=pv_fp8)  # fmt: skip


@pytest.mark.triton_interpreter
def test_the_op_runs_the_planned_kernel_or_refuses():
    _, q, k, v = _inputs(seed=2)
    reference = KernelChoice("torch-reference", "dense", "planned")
    out, ran = block_sparse_attention(q, k, v, None, None, None, None, block=16, dense=True, choice=reference,
                                      return_choice=True)  # fmt: skip
    assert ran is reference  # the plan's choice runs, not the one the router would make here (Triton)
    torch.testing.assert_close(out, block_sparse_attention(q, k, v, None, None, None, None, block=16, dense=True,
                                                           backend="torch"), rtol=0, atol=0)  # fmt: skip
    hopper = KernelChoice("sm90-gluon", "dense-warp-specialized", "planned elsewhere")
    with pytest.raises(ValueError, match="planned on the Hopper kernel, which cannot run these inputs"):
        block_sparse_attention(q, k, v, None, None, None, None, block=16, dense=True, choice=hopper)
