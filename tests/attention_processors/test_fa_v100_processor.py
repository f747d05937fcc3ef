"""MiniMaxH3FAV100Processor on CPU: diffusers' projection / QK-norm / rotary reuse, path choice and fallbacks,
describe_path, and the fp16 V scaling."""

import pytest
import torch
from diffusers.models.transformers.transformer_minimax_h3 import (
    MiniMaxH3Attention,
    MiniMaxH3AttnProcessor,
    MiniMaxH3RotaryPosEmbed,
    MiniMaxH3Transformer3DModel,
)

import diffusers_h3._utils as h3_utils
from diffusers_h3.attention_processors import fa_v100 as proc_mod
from diffusers_h3.attention_processors.base import CallInputs
from diffusers_h3.attention_processors.call_plan import install_call_plan_hook, last_call_plan
from diffusers_h3.attention_processors.fa_v100 import (
    FAV100Plan,
    MiniMaxH3FAV100Processor,
    to_fp16_with_value_scale,
)
from diffusers_h3.kernels.attention import KernelChoice
from diffusers_h3.kernels.attention.fa_v100 import FAV100BuildError, fa_v100_reference
from diffusers_h3.layout import CallPlan, use_call_plan
from diffusers_h3.testing.tiny import TINY_TRANSFORMER_CONFIG, tiny_transformer_inputs

from ._plans import spy_on_plan_call


TINY = TINY_TRANSFORMER_CONFIG


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(h3_utils, "_WARNED", set())


def _attention_module(seed=0, heads=2, head_dim=64, hidden=96):
    torch.manual_seed(seed)
    attn = MiniMaxH3Attention(hidden_size=hidden, heads=heads, dim_head=head_dim)
    with torch.no_grad():
        attn.norm_q.weight.uniform_(0.5, 1.5)
        attn.norm_k.weight.uniform_(0.5, 1.5)
    return attn


def _rotary(seq, rope_freq_dim=8):
    pos = torch.stack(torch.meshgrid(torch.arange(3), torch.arange(4), torch.arange(seq // 12 + 1), indexing="ij"), -1)
    return MiniMaxH3RotaryPosEmbed(rope_freq_dim=rope_freq_dim)(pos.reshape(-1, 3)[:seq])


@pytest.mark.parametrize("with_rotary", [True, False])
def test_processor_matches_diffusers_processor_on_cpu(with_rotary, h3_logs):
    attn = _attention_module()
    hidden = torch.randn(2, 37, 96)
    rotary = _rotary(37) if with_rotary else None
    expected = MiniMaxH3AttnProcessor()(attn, hidden, rotary)
    processor = MiniMaxH3FAV100Processor()
    if with_rotary:
        with h3_logs.expect("falls back to sdpa_cpu"):
            got = processor(attn, hidden, rotary)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert processor.describe_path().startswith("fallback: torch SDPA on CPU")
    else:  # refiner calls run diffusers' default processor itself (the base's policy): bitwise equal, nothing recorded
        got = processor(attn, hidden, rotary)
        assert torch.equal(got, expected)
        assert "not called yet" in processor.describe_path()


def test_fallback_warns_once(h3_logs):
    attn = _attention_module()
    processor = MiniMaxH3FAV100Processor()
    hidden = torch.randn(1, 9, 96)
    with h3_logs.expect("falls back"):
        processor(attn, hidden, _rotary(9))
    with h3_logs.expect_none():
        processor(attn, hidden, _rotary(9))


def test_tiny_transformer_runs_with_processor(h3_logs):
    torch.manual_seed(0)
    model = MiniMaxH3Transformer3DModel(**TINY).eval()
    inputs = tiny_transformer_inputs()
    with torch.no_grad():
        expected = model(**inputs).sample
        model.set_attn_processor(MiniMaxH3FAV100Processor())
        with h3_logs.expect("falls back"):
            got = model(**inputs).sample
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    paths = {m.processor.describe_path() for m in model.modules() if isinstance(m, MiniMaxH3Attention)}
    assert len(paths) == 1 and "CPU" in paths.pop()


def _fake_cuda(monkeypatch, capability, build_ok=True):
    monkeypatch.setattr(proc_mod, "cuda_capability", lambda device=None: capability)
    calls = []

    def fake_load(device, build_dir=None):
        calls.append(device)
        if not build_ok:
            raise FAV100BuildError("no nvcc (test)")
        return object()

    monkeypatch.setattr(proc_mod, "load_extension", fake_load)
    return calls


@pytest.mark.parametrize(
    "capability,allow,build_ok,path,reason",
    [
        ((7, 0), False, True, "kernel", "sm_70"),
        ((7, 5), False, True, "kernel", "sm_75"),
        ((7, 0), False, False, "sdpa_efficient", "could not be built: no nvcc"),
        ((9, 0), False, True, "sdpa_efficient", "not SM70-class"),
        ((9, 0), True, True, "kernel", "sm_90"),
        ((6, 1), True, True, "sdpa_efficient", "no fp16 tensor cores"),
    ],
)
def test_device_path_choice(monkeypatch, capability, allow, build_ok, path, reason):
    calls = _fake_cuda(monkeypatch, capability, build_ok)
    processor = MiniMaxH3FAV100Processor(allow_non_volta=allow)
    choice = processor._device_path(torch.device("cuda", 0))
    assert choice[0] == path and reason in choice[1]
    processor._device_path(torch.device("cuda", 0))
    assert len(calls) <= 1  # built (or tried) once per device


def test_mask_and_head_dim_fall_back(monkeypatch):
    _fake_cuda(monkeypatch, (7, 0))
    processor = MiniMaxH3FAV100Processor()
    query = torch.empty(1, 4, 2, 64, device="meta")
    monkeypatch.setattr(processor, "_device_path", lambda device: ("kernel", "sm_70"))
    assert processor.select_path(query) == ("kernel", "sm_70")
    path, reason = processor.select_path(query, attention_mask=torch.ones(1, 4, dtype=torch.bool))
    assert path == "sdpa_efficient" and "mask" in reason
    path, reason = processor.select_path(torch.empty(1, 4, 2, 96, device="meta"))
    assert path == "sdpa_efficient" and "head_dim 96" in reason


def _plan_call_on_cuda(processor, head_dim=64):
    """What the call-plan hook does for a transformer call on a CUDA device: plan, and tell the processor."""
    processor.last_plan = processor.plan_call(CallInputs(None, torch.device("cuda", 0), torch.bfloat16, head_dim))
    return processor.last_plan


def test_describe_path_labels_hardware_honestly(monkeypatch):
    _fake_cuda(monkeypatch, (9, 0))
    processor = MiniMaxH3FAV100Processor(query_tile=128, allow_non_volta=True)
    assert "not run on V100 hardware" in processor.describe_path()
    plan = _plan_call_on_cuda(processor)
    assert plan.kernel == KernelChoice("kernel", "q-tile 128", "sm_90")
    line = processor.describe_path()
    assert "q-tile 128" in line and "proxy" in line and "not run on V100 hardware" in line
    processor = MiniMaxH3FAV100Processor()
    _plan_call_on_cuda(processor)
    assert processor.last_plan.kernel == KernelChoice("sdpa_efficient", "fp16", processor.last_plan.kernel.reason)
    assert processor.describe_path().startswith("fallback: SDPA memory-efficient")
    assert "not SM70-class" in processor.describe_path()


def test_bad_query_tile_is_rejected():
    with pytest.raises(ValueError, match="query_tile"):
        MiniMaxH3FAV100Processor(query_tile=96)


def test_value_scaling_keeps_fp16_finite_where_plain_cast_overflows():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 40, 2, 64, generator=gen)
    k = torch.randn(1, 40, 2, 64, generator=gen)
    v = torch.randn(1, 40, 2, 64, generator=gen) * 3e5  # beyond fp16's 65504
    assert not torch.isfinite(v.half()).all()
    q16, k16, v16, scale = to_fp16_with_value_scale(q, k, v)
    assert torch.isfinite(v16).all() and v16.abs().max() <= 2.0**14
    assert scale.item() >= 16 and torch.log2(scale).item().is_integer()
    out = fa_v100_reference(q16, k16, v16).float() * scale
    exact = fa_v100_reference(q, k, v, round_probabilities=False)
    assert ((out - exact).norm() / exact.norm()).item() < 3e-3


def test_value_scaling_is_identity_for_small_values_and_fp16():
    v = torch.randn(1, 8, 2, 64)
    _, _, v16, scale = to_fp16_with_value_scale(v, v, v)
    assert scale.item() == 1.0 and torch.equal(v16, v.half())
    _, _, v16, scale = to_fp16_with_value_scale(v.half(), v.half(), v.half())
    assert scale is None


def _big_value_qkv(seed=2):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 45, 2, 64, generator=gen)
    k = torch.randn(1, 45, 2, 64, generator=gen)
    v = torch.randn(1, 45, 2, 64, generator=gen) * 2e5
    return q, k, v


def test_sdpa_efficient_fallback_computes_in_fp16_with_value_scale(monkeypatch, h3_logs):
    # CPU has no memory-efficient SDPA: record the backend request and let SDPA pick, checking what it is given
    requested, dtypes = [], []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def fake_sdpa_kernel(backends):
        requested.append(list(backends))
        import contextlib

        return contextlib.nullcontext()

    def spy(q, k, v, **kwargs):
        dtypes.append((q.dtype, v.abs().max().item()))
        return real_sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(proc_mod, "sdpa_kernel", fake_sdpa_kernel)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    processor = MiniMaxH3FAV100Processor()
    monkeypatch.setattr(processor, "_device_path", lambda device: ("sdpa_efficient", "test"))
    q, k, v = _big_value_qkv()
    with h3_logs.expect("sdpa_efficient: test"):
        out = processor.core(q, k, v)
    assert requested == [[proc_mod.SDPBackend.EFFICIENT_ATTENTION]]
    assert dtypes[0][0] == torch.float16 and dtypes[0][1] <= 2.0**14
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    exact = fa_v100_reference(q, k, v, round_probabilities=False)
    assert ((out - exact).norm() / exact.norm()).item() < 3e-3
    assert processor.describe_path() == "fallback: SDPA memory-efficient fp16 (test)"


def test_kernel_path_casts_scales_and_restores(monkeypatch, h3_logs):
    calls = []

    def fake_kernel(q, k, v, *, query_tile, backend, build_dir):
        calls.append((q.dtype, k.dtype, v.dtype, v.abs().max().item(), query_tile))
        return fa_v100_reference(q, k, v)

    monkeypatch.setattr(proc_mod, "fa_v100_attention", fake_kernel)
    processor = MiniMaxH3FAV100Processor(query_tile=64)
    monkeypatch.setattr(processor, "_device_path", lambda device: ("kernel", "sm_70"))
    q, k, v = _big_value_qkv(seed=4)
    with h3_logs.expect_none():  # the kernel path does not warn
        out = processor.core(q, k, v)
    assert calls == [(torch.float16, torch.float16, torch.float16, calls[0][3], 64)] and calls[0][3] <= 2.0**14
    exact = fa_v100_reference(q, k, v, round_probabilities=False)
    assert out.dtype == torch.float32 and ((out - exact).norm() / exact.norm()).item() < 3e-3
    line = processor.describe_path()
    assert line.startswith("FA-V100 CUDA kernel") and "on sm_70;" in line and "proxy" not in line


def test_ring_context_parallel_is_refused():
    processor = MiniMaxH3FAV100Processor()
    cp = type("CP", (), {"ring_degree": 2, "ulysses_degree": 1})()
    processor._parallel_config = type("P", (), {"context_parallel_config": cp})()
    with pytest.raises(NotImplementedError, match="ring attention needs a backend with LSE; use ulysses_degree"):
        processor(_attention_module(), torch.randn(1, 4, 96), _rotary(4))


def test_describe_reports_processor_path():
    from diffusers_h3._report import describe

    torch.manual_seed(0)
    model = MiniMaxH3Transformer3DModel(**TINY)
    model.set_attn_processor(MiniMaxH3FAV100Processor())
    attention = describe(model)["model"]["attention"]
    assert len(attention) == 1 and "FA-V100" in next(iter(attention)) and next(iter(attention.values())) == 3


def _spy_on_plan_call(monkeypatch):
    return spy_on_plan_call(monkeypatch, MiniMaxH3FAV100Processor)


@pytest.mark.parametrize("hook", [True, False])
def test_one_processor_on_every_block_is_planned_once_per_call(monkeypatch, hook, h3_logs):
    """``enable_v100_mode`` sets one processor on every block: the call-plan hook plans it once per transformer call
    (its key is the processor); without the hook it plans its first call and reuses the plan while it fits."""
    torch.manual_seed(0)
    model = MiniMaxH3Transformer3DModel(**TINY).eval()
    processor = MiniMaxH3FAV100Processor()
    model.set_attn_processor(processor)
    if hook:
        install_call_plan_hook(model)
    planned = _spy_on_plan_call(monkeypatch)
    inputs = tiny_transformer_inputs()
    with torch.no_grad(), h3_logs.expect("falls back to sdpa_cpu"):
        model(**inputs)
        model(**inputs)
    assert len(planned) == (2 if hook else 1)  # never one per block
    assert processor.plan_key is processor and processor.last_plan is planned[-1]
    assert planned[-1].path == "sdpa_cpu" and planned[-1].head_dim == TINY["attention_head_dim"]
    if hook:
        assert last_call_plan(model).plan_for(processor) is planned[-1]
    assert processor.describe_path() == planned[-1].describe() and processor.describe_path().startswith(
        "fallback: torch SDPA on CPU (inputs on cpu"
    )


def test_core_runs_the_path_of_the_call_plan(monkeypatch, h3_logs):
    """The plan the call plan holds is what runs: here the kernel with q-tile 64 on CPU inputs, where the processor
    on its own (q-tile 128) would plan plain SDPA."""
    calls = []

    def fake_kernel(q, k, v, *, query_tile, backend, build_dir):
        calls.append(query_tile)
        return fa_v100_reference(q, k, v)

    monkeypatch.setattr(proc_mod, "fa_v100_attention", fake_kernel)
    processor = MiniMaxH3FAV100Processor(query_tile=128)
    q, k, v = _big_value_qkv()
    planned = FAV100Plan("kernel", KernelChoice("kernel", "q-tile 64", "sm_70"), 64, q.device, q.shape[-1])
    with use_call_plan(CallPlan(attention=((processor, planned),))), h3_logs.expect_none():
        out = processor.core(q, k, v)
    assert calls == [64] and out.dtype == torch.float32
    assert processor.last_plan is None  # reading a plan writes nothing back (the hook tells the processor its plan)
    with h3_logs.expect("falls back to sdpa_cpu"):  # outside the call plan: the processor plans for itself
        processor.core(q, k, v)
    assert calls == [64] and processor.last_plan.path == "sdpa_cpu"


def test_mask_fallback_holds_for_its_call_only(monkeypatch, h3_logs):
    """A mask is a per-call input no plan sees: the core takes the plan's SDPA fallback for that call (and
    describe_path says so); the next call without a mask runs the planned kernel again."""
    import contextlib

    kernel_calls = []

    def fake_kernel(q, k, v, *, query_tile, backend, build_dir):
        kernel_calls.append(query_tile)
        return fa_v100_reference(q, k, v)

    monkeypatch.setattr(proc_mod, "fa_v100_attention", fake_kernel)
    monkeypatch.setattr(proc_mod, "sdpa_kernel", lambda backends: contextlib.nullcontext())
    processor = MiniMaxH3FAV100Processor()
    monkeypatch.setattr(processor, "_device_path", lambda device: ("kernel", "sm_70"))
    q, k, v = _big_value_qkv()
    processor.core(q, k, v)
    assert kernel_calls == [128] and processor.describe_path().startswith("FA-V100 CUDA kernel")
    mask = torch.ones(1, 1, q.shape[1], q.shape[1], dtype=torch.bool)
    with h3_logs.expect("falls back to sdpa_efficient: an attention mask was given"):
        processor.core(q, k, v, attention_mask=mask)
    assert kernel_calls == [128]
    assert processor.describe_path() == (
        "fallback: SDPA memory-efficient fp16 (an attention mask was given; the FA-V100 kernel is mask-free)"
    )
    processor.core(q, k, v)
    assert kernel_calls == [128, 128] and processor.describe_path().startswith("FA-V100 CUDA kernel")
