"""MiniMaxH3AttnProcessorBase: refiner policy, projection -> core -> output, the context-parallel seam, describe_path."""

import sys

import pytest
import torch
from diffusers.models.transformers.transformer_minimax_h3 import (
    MiniMaxH3Attention,
    MiniMaxH3AttnProcessor,
    MiniMaxH3RotaryPosEmbed,
)

from diffusers_h3.attention_processors import MiniMaxH3AttnProcessorBase, PlanForInputs
from diffusers_h3.kernels.attention import KernelChoice


ULYSSES_MODULE = "diffusers_h3.attention_processors._ulysses"


class SDPACore(MiniMaxH3AttnProcessorBase):
    """A processor whose core is plain SDPA; it counts its calls and the shapes it saw."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def plan_call(self, call):
        return PlanForInputs(KernelChoice("torch-sdpa", "dense", "test core"), call.device, call.dtype, call.head_dim)

    def core(self, query, key, value, attention_mask=None, **extras):
        self.calls.append((tuple(query.shape), sorted(extras)))
        assert self.current_plan(query).kernel.kernel == "torch-sdpa"
        out = torch.nn.functional.scaled_dot_product_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=attention_mask
        )
        return out.transpose(1, 2)


class GatedCore(SDPACore):
    def extras(self, attn, hidden_states):
        return {"gate": hidden_states[..., : attn.heads * 4].unflatten(-1, (attn.heads, 4))}


def _attn(seed=0):
    torch.manual_seed(seed)
    attn = MiniMaxH3Attention(hidden_size=64, heads=4, dim_head=32)
    with torch.no_grad():
        attn.norm_q.weight.uniform_(0.5, 1.5)
    return attn


def _rotary(seq):
    pos = torch.stack(torch.meshgrid(torch.arange(2), torch.arange(3), torch.arange(seq // 6 + 1), indexing="ij"), -1)
    return MiniMaxH3RotaryPosEmbed(rope_freq_dim=4)(pos.reshape(-1, 3)[:seq])


def _ulysses_config(ulysses=2, ring=1):
    cp = type("ContextParallelConfig", (), {"ulysses_degree": ulysses, "ring_degree": ring})()
    return type("ParallelConfig", (), {"context_parallel_config": cp})()


def test_refiner_calls_run_diffusers_default_without_the_core_or_context_parallel(monkeypatch):
    attn, x = _attn(), torch.randn(2, 11, 64)
    processor = SDPACore()
    processor._parallel_config = _ulysses_config()
    monkeypatch.setitem(sys.modules, ULYSSES_MODULE, None)  # any use of the CP seam would raise
    expected = MiniMaxH3AttnProcessor()(attn, x)
    assert torch.equal(processor(attn, x), expected)
    assert processor.calls == [] and processor.last_choice is None
    assert processor._refiner._parallel_config is None  # the refiner runs once per rank on unsharded text


def test_projection_core_output_matches_the_default_processor():
    attn, x = _attn(1), torch.randn(2, 13, 64)
    rotary = _rotary(13)
    processor = SDPACore()
    got = processor(attn, x, rotary)
    assert processor.calls == [((2, 13, 4, 32), [])]
    torch.testing.assert_close(got, MiniMaxH3AttnProcessor()(attn, x, rotary), rtol=1e-5, atol=1e-6)
    assert processor.describe_path() == "SDPACore: torch-sdpa kernel (dense; test core)"


def test_base_without_core_and_before_a_call():
    base = MiniMaxH3AttnProcessorBase()
    assert "not called yet" in base.describe_path()
    with pytest.raises(NotImplementedError, match="must implement core"):
        base(_attn(), torch.randn(1, 4, 64), _rotary(4))
    assert MiniMaxH3AttnProcessorBase._parallel_config is None and MiniMaxH3AttnProcessorBase._attention_backend is None


def test_ulysses_seam_passes_shards_core_and_extras(monkeypatch):
    seen = {}

    def fake_ulysses_attention(core_fn, query, key, value, parallel_config, extras=None):
        seen.update(shapes=tuple(query.shape), config=parallel_config, extras=sorted(extras or {}))
        heads = query.shape[2] // 2  # stand-in for the all-to-all: a core call on half of the heads
        sliced = {name: t[:, :, :heads] for name, t in (extras or {}).items()}
        first = core_fn(query[:, :, :heads], key[:, :, :heads], value[:, :, :heads], sliced)
        second = core_fn(query[:, :, heads:], key[:, :, heads:], value[:, :, heads:], None)
        return torch.cat([first, second], dim=2)

    fake = type(sys)("fake_ulysses")
    fake.ulysses_attention = fake_ulysses_attention
    monkeypatch.setitem(sys.modules, ULYSSES_MODULE, fake)
    attn, x = _attn(2), torch.randn(1, 9, 64)
    processor = GatedCore()
    processor._parallel_config = config = _ulysses_config(ulysses=2)
    got = processor(attn, x, _rotary(9))
    assert seen == {"shapes": (1, 9, 4, 32), "config": config, "extras": ["gate"]}
    assert processor.calls == [((1, 9, 2, 32), ["gate"]), ((1, 9, 2, 32), [])]  # the core takes any head count
    torch.testing.assert_close(got, MiniMaxH3AttnProcessor()(attn, x, _rotary(9)), rtol=1e-5, atol=1e-6)


def test_context_parallel_errors(monkeypatch):
    attn, x, rotary = _attn(), torch.randn(1, 6, 64), _rotary(6)
    processor = SDPACore()
    processor._parallel_config = _ulysses_config(ulysses=1, ring=2)
    with pytest.raises(NotImplementedError, match="ring attention needs a backend with LSE; use ulysses_degree"):
        processor(attn, x, rotary)
    monkeypatch.setitem(sys.modules, ULYSSES_MODULE, None)
    processor._parallel_config = _ulysses_config(ulysses=2)
    with pytest.raises(NotImplementedError, match="_ulysses"):
        processor(attn, x, rotary)
    processor._parallel_config = _ulysses_config(ulysses=1)  # degree 1: no parallelism, the core runs as is
    processor(attn, x, rotary)
    assert processor.calls == [((1, 6, 4, 32), [])]
