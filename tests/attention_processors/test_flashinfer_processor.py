"""MiniMaxH3FlashInferProcessor: the glue to FlashInfer (layout, scale, batch loop, compile island), its installation
checks and what describe() reports. FlashInfer's kernels need a GPU; on the CPU a stand-in module answers
`single_prefill_with_kv_cache` with the same SDPA math diffusers' processor uses, so a wrong layout, scale or batch
handling changes the output. The kernel itself is compared with cuDNN in tests/gpu/test_flashinfer_gpu.py."""

import sys

import pytest
import torch
import torch.nn.functional as F
from diffusers import MiniMaxH3Transformer3DModel
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor

import diffusers_h3
from diffusers_h3 import FlashInferAttentionConfig
from diffusers_h3.attention_processors import (
    MiniMaxH3FlashInferProcessor,
    disable_flashinfer_attention,
    enable_flashinfer_attention,
    flashinfer_attention_state,
)
from diffusers_h3.kernels.attention.flashinfer_dense import resolve_backend
from diffusers_h3.testing.tiny import TINY_TRANSFORMER_CONFIG, tiny_transformer_inputs

from ._plans import spy_on_plan_call


def _model():
    torch.manual_seed(0)
    return MiniMaxH3Transformer3DModel(**TINY_TRANSFORMER_CONFIG).to(torch.bfloat16).eval()


def _run(model, batch=2):
    inputs = tiny_transformer_inputs(seed=3)
    for name in ("hidden_states", "audio_hidden_states", "encoder_hidden_states"):
        inputs[name] = (inputs[name].repeat(batch, 1, 1) * torch.linspace(1.0, 0.4, batch).view(-1, 1, 1)).bfloat16()
    with torch.no_grad():
        out = model(**inputs)
    return out.sample.float(), out.audio_sample.float()


def test_processor_equals_diffusers_attention(flashinfer_stand_in):
    model = _model()
    model.set_attn_processor(MiniMaxH3AttnProcessor())
    expected = _run(model)
    for block in model.transformer_blocks:
        block.attn.set_processor(MiniMaxH3FlashInferProcessor("fa3"))
    got = _run(model)
    # The stand-in runs the SDPA call diffusers' native backend makes, so the glue must not change a bit.
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    # One call per batch item and block, FlashInfer's NHD layout, the 1/sqrt(d) scale, no causal mask.
    heads, dim = TINY_TRANSFORMER_CONFIG["num_attention_heads"], TINY_TRANSFORMER_CONFIG["attention_head_dim"]
    assert len(flashinfer_stand_in.calls) == 2 * TINY_TRANSFORMER_CONFIG["num_layers"]
    assert all(c["shape"][1:] == (heads, dim) for c in flashinfer_stand_in.calls)
    assert {(c["causal"], c["layout"], c["backend"]) for c in flashinfer_stand_in.calls} == {(False, "NHD", "fa3")}
    assert all(c["scale"] == pytest.approx(dim**-0.5) for c in flashinfer_stand_in.calls)
    # The refiner keeps diffusers' processor; describe() reports what ran.
    assert not isinstance(model.token_refiner.refiner_blocks[0].attn.processor, MiniMaxH3FlashInferProcessor)
    path = model.transformer_blocks[0].attn.processor.describe_path()
    assert "flashinfer kernel (single_prefill fa3" in path and "tests/gpu/test_flashinfer_gpu.py" in path
    assert "flashinfer" in str(diffusers_h3.describe(model))


def test_processor_is_one_eager_island_under_compile(flashinfer_stand_in):
    model = _model()
    model.set_attn_processor(MiniMaxH3AttnProcessor())
    expected = _run(model, batch=1)
    for block in model.transformer_blocks:
        block.attn.set_processor(MiniMaxH3FlashInferProcessor("fa2"))
        block.compile(backend="eager")
    got = _run(model, batch=1)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert {c["backend"] for c in flashinfer_stand_in.calls} == {"fa2"}


def test_processor_refuses_32_bit_inputs_and_masks(flashinfer_stand_in):
    processor = MiniMaxH3FlashInferProcessor("fa3")
    q = torch.randn(1, 8, 2, 32)
    with pytest.raises(TypeError, match="bf16 or fp16"):
        processor.core(q, q, q)
    with pytest.raises(ValueError, match="attention_mask"):
        processor.core(q.bfloat16(), q.bfloat16(), q.bfloat16(), attention_mask=torch.ones(1, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="'fa2' or 'fa3'"):
        MiniMaxH3FlashInferProcessor("auto")


def test_enable_checks_package_and_device_before_changing_anything(monkeypatch, flashinfer_stand_in):
    model = _model()
    before = [type(b.attn.processor) for b in model.transformer_blocks]
    with pytest.raises(ValueError, match="needs a CUDA GPU of SM80 or newer"):
        enable_flashinfer_attention(model)  # the tiny model is on the CPU
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # not installed
    with pytest.raises(ImportError, match="pip install flashinfer-python"):
        enable_flashinfer_attention(model)
    assert [type(b.attn.processor) for b in model.transformer_blocks] == before


@pytest.mark.parametrize(
    "backend, capability, expected",
    [("auto", (9, 0), "fa3"), ("auto", (8, 0), "fa2"), ("auto", (12, 0), "fa2"), ("fa2", (9, 0), "fa2"),
     ("fa3", (9, 0), "fa3"), ("fa3", (8, 9), "only"), ("auto", (7, 0), "SM80"), ("auto", None, "SM80"),
     ("cudnn", (9, 0), "one of")],
)  # fmt: skip
def test_backend_resolution(backend, capability, expected):
    if expected in ("fa2", "fa3"):
        assert resolve_backend(backend, capability) == expected
    else:
        with pytest.raises(ValueError, match=expected):
            resolve_backend(backend, capability)


def _no_compiler(monkeypatch, tmp_path):
    """Nothing FlashInfer could build its kernels with, and no prebuilt kernels."""
    from diffusers_h3.kernels.attention import flashinfer_dense

    for name in ("FLASHINFER_NVCC", "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(flashinfer_dense, "DEFAULT_CUDA_HOME", str(tmp_path / "no-cuda"))
    real_find_spec = flashinfer_dense.importlib.util.find_spec
    monkeypatch.setattr(flashinfer_dense.importlib.util, "find_spec",
                        lambda name, *a: None if name == "flashinfer_jit_cache" else real_find_spec(name, *a))  # fmt: skip


def test_kernel_source_follows_flashinfer_lookup(monkeypatch, tmp_path, flashinfer_stand_in):
    from diffusers_h3.kernels.attention.flashinfer_dense import check_flashinfer_kernels, flashinfer_kernel_source

    _no_compiler(monkeypatch, tmp_path)
    assert flashinfer_kernel_source() is None
    with pytest.raises(RuntimeError, match="no nvcc was found .*pip install flashinfer-jit-cache"):
        check_flashinfer_kernels()
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\n")
    monkeypatch.setenv("CUDA_HOME", str(home))
    assert flashinfer_kernel_source() is None  # not executable: FlashInfer could not run it either
    nvcc.chmod(0o755)
    assert flashinfer_kernel_source() == f"built on first use with {nvcc}"


def test_enable_refuses_when_kernels_cannot_be_built(monkeypatch, tmp_path, flashinfer_stand_in):
    from diffusers_h3.attention_processors import flashinfer as flashinfer_processors

    monkeypatch.setattr(flashinfer_processors, "cuda_capability", lambda device=None: (9, 0))
    _no_compiler(monkeypatch, tmp_path)
    model = _model()
    before = [type(b.attn.processor) for b in model.transformer_blocks]
    with pytest.raises(RuntimeError, match="no nvcc was found"):
        enable_flashinfer_attention(model)
    assert [type(b.attn.processor) for b in model.transformer_blocks] == before


def _qkv(batch=2, seq=37, heads=4, dim=64, key_offset=0.0):
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(batch, seq, heads, dim, generator=gen) for _ in range(3))
    return q.bfloat16(), (k + key_offset).bfloat16(), v.bfloat16()


def test_fp8_core_follows_the_per_head_contract(flashinfer_stand_in):
    from diffusers_h3.kernels.attention.flashinfer_dense import flashinfer_fp8_reference

    q, k, v = _qkv()
    processor = MiniMaxH3FlashInferProcessor("fa3", precision="fp8")
    out = processor.core(q, k, v)
    # The stand-in dequantizes FlashInfer's FP8 operands and attends in fp32, as the torch reference does.
    assert out.dtype == torch.bfloat16 and torch.equal(out, flashinfer_fp8_reference(q, k, v))
    assert len(flashinfer_stand_in.calls) == 2 and all(c["fp8"] and c["backend"] == "fa3" for c in flashinfer_stand_in.calls)
    exact = F.scaled_dot_product_attention(*(t.transpose(1, 2).double() for t in (q, k, v))).transpose(1, 2)
    err = ((out.double() - exact).norm() / exact.norm()).item()
    assert 1e-3 < err < 6e-2  # E4M3 operand rounding: present, and at its usual level
    assert "single_prefill fa3 fp8" in processor.describe_path() and "per head" in processor.describe_path()


def test_fp8_smooth_k_removes_a_key_offset(flashinfer_stand_in):
    q, k, v = _qkv(key_offset=8.0)  # a shared key offset: exact under softmax, costly for a per-head E4M3 scale
    exact = F.scaled_dot_product_attention(*(t.transpose(1, 2).double() for t in (q, k, v))).transpose(1, 2)

    def error(smooth_k):
        out = MiniMaxH3FlashInferProcessor("fa3", precision="fp8", smooth_k=smooth_k).core(q, k, v)
        return ((out.double() - exact).norm() / exact.norm()).item()

    assert error(True) < 0.5 * error(False)


def test_fp8_needs_fa3_and_known_precisions(monkeypatch, flashinfer_stand_in):
    from diffusers_h3.attention_processors import flashinfer as flashinfer_processors

    with pytest.raises(ValueError, match="FA3 .Hopper. only"):
        MiniMaxH3FlashInferProcessor("fa2", precision="fp8")
    model = _model()
    before = [type(b.attn.processor) for b in model.transformer_blocks]
    monkeypatch.setattr(flashinfer_processors, "cuda_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="FA3 .Hopper. only"):  # an A100 resolves to FA2
        enable_flashinfer_attention(model, FlashInferAttentionConfig(precision="fp8"))
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # the precision is checked before the package
    with pytest.raises(ValueError, match="precision must be one of"):
        enable_flashinfer_attention(model, FlashInferAttentionConfig(precision="int4"))
    assert [type(b.attn.processor) for b in model.transformer_blocks] == before
    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer_stand_in)
    monkeypatch.setattr(flashinfer_processors, "cuda_capability", lambda device=None: (9, 0))
    assert enable_flashinfer_attention(model, FlashInferAttentionConfig(precision="fp8")) is model
    summary = flashinfer_attention_state(model)
    assert summary["backend"] == "fa3" and summary["precision"] == "fp8"
    assert all(b.attn.processor.precision == "fp8" for b in model.transformer_blocks)
    assert disable_flashinfer_attention(model) is model and flashinfer_attention_state(model) is None
    assert all(type(b.attn.processor) is MiniMaxH3AttnProcessor for b in model.transformer_blocks)


def _count_plans(monkeypatch):
    return spy_on_plan_call(monkeypatch, MiniMaxH3FlashInferProcessor)


def test_enable_plans_the_kernel_once_per_transformer_call(monkeypatch, flashinfer_stand_in):
    from diffusers_h3.attention_processors import flashinfer as flashinfer_processors
    from diffusers_h3.attention_processors.call_plan import last_call_plan

    monkeypatch.setattr(flashinfer_processors, "cuda_capability", lambda device=None: (9, 0))
    model = enable_flashinfer_attention(_model())
    processors = [b.attn.processor for b in model.transformer_blocks]
    assert all(p.plan_key is processors[0].plan_key is p.config for p in processors)  # one key for every block
    assert flashinfer_attention_state(model)["path"] == "MiniMaxH3FlashInferProcessor: not called yet"
    planned = _count_plans(monkeypatch)
    _run(model)
    _run(model)
    assert len(planned) == 2  # one plan per call, not one per block
    ((key, plan),) = last_call_plan(model).attention
    assert key is processors[0].config and plan is planned[-1] and all(p.last_plan is plan for p in processors)
    assert (plan.backend, plan.precision, plan.head_dim) == ("fa3", "bf16", TINY_TRANSFORMER_CONFIG["attention_head_dim"])
    path = flashinfer_attention_state(model)["path"]
    assert path == f"MiniMaxH3FlashInferProcessor: {plan.kernel.describe()}" and "single_prefill fa3" in path
    assert diffusers_h3.describe(model)["model"]["last_forward"]["attention"] == [plan.describe()]


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_core_runs_the_planned_kernel(precision, flashinfer_stand_in):
    from diffusers_h3.attention_processors.base import CallInputs
    from diffusers_h3.attention_processors.flashinfer import FlashInferPlan
    from diffusers_h3.layout import CallPlan, use_call_plan

    q, k, v = _qkv(batch=1)
    processor = MiniMaxH3FlashInferProcessor("fa3", precision=precision)
    own = processor.plan_call(CallInputs(None, q.device, q.dtype, q.shape[-1]))
    # The call plan holds FA2 16-bit (or FP8 without smoothing): that is what runs, not the processor's own options.
    inputs = (own.kernel, q.device, q.dtype, q.shape[-1])
    planned = (FlashInferPlan(*inputs, backend="fa2", precision="bf16", smooth_k=True) if precision == "bf16"
               else FlashInferPlan(*inputs, backend="fa3", precision="fp8", smooth_k=False))  # fmt: skip
    with use_call_plan(CallPlan(attention=((processor.plan_key, planned),))):
        out = processor.core(q, k, v)
    if precision == "bf16":
        assert [c["backend"] for c in flashinfer_stand_in.calls] == ["fa2"]
    else:
        from diffusers_h3.kernels.attention.flashinfer_dense import flashinfer_fp8_reference

        assert torch.equal(out, flashinfer_fp8_reference(q, k, v, smooth_k=False))
        assert not torch.equal(out, flashinfer_fp8_reference(q, k, v, smooth_k=True))


def test_processor_set_by_hand_plans_for_itself(monkeypatch, flashinfer_stand_in):
    """Without the hook (``set_attn_processor``) the first block call plans, later calls reuse the plan while it fits
    the inputs; what it plans is what the kernel functions report."""
    from diffusers_h3.kernels.attention.flashinfer_dense import flashinfer_dense_attention, flashinfer_kernel_choice

    model = _model()
    processor = MiniMaxH3FlashInferProcessor("fa2")
    model.set_attn_processor(processor)
    assert processor.config is None and processor.plan_key is processor
    assert processor.describe_path() == "MiniMaxH3FlashInferProcessor: not called yet"
    planned = _count_plans(monkeypatch)
    _run(model)
    _run(model)
    assert len(planned) == 1 and processor.last_plan is planned[0]
    assert processor.last_plan.kernel == flashinfer_kernel_choice("fa2")
    assert processor.describe_path() == f"MiniMaxH3FlashInferProcessor: {flashinfer_kernel_choice('fa2').describe()}"
    q, k, v = _qkv(batch=1)
    assert flashinfer_dense_attention(q, k, v, "fa2")[1] == flashinfer_kernel_choice("fa2")
    # The plan is checked against the inputs it meets: another head dim is planned anew.
    assert q.shape[-1] != TINY_TRANSFORMER_CONFIG["attention_head_dim"]
    processor.core(q, k, v)
    assert len(planned) == 2 and processor.last_plan.head_dim == q.shape[-1]


@pytest.mark.parametrize("smooth_k", [True, False])
def test_kernel_choice_is_the_one_the_fp8_function_reports(smooth_k, flashinfer_stand_in):
    from diffusers_h3.attention_processors.base import CallInputs
    from diffusers_h3.kernels.attention.flashinfer_dense import flashinfer_fp8_attention, flashinfer_kernel_choice

    q, k, v = _qkv(batch=1)
    choice = flashinfer_kernel_choice("fa3", "fp8", smooth_k, on_cuda=False)
    assert flashinfer_fp8_attention(q, k, v, smooth_k)[1] == choice
    assert ("mean-centred" in choice.reason) == smooth_k and "torch reference" in choice.reason
    assert "one Triton pass each" in flashinfer_kernel_choice("fa3", "fp8", smooth_k, on_cuda=True).reason
    processor = MiniMaxH3FlashInferProcessor("fa3", precision="fp8", smooth_k=smooth_k)
    assert processor.plan_call(CallInputs(None, q.device, q.dtype, q.shape[-1])).kernel == choice
