"""The FA-V100 processor's fallback when an attention mask is given: the mask must take effect, on the CPU SDPA path
and on the fp16 SDPA path (memory-efficient on GPUs), checked against masked attention written in plain torch."""

import contextlib
import math
import warnings

import pytest
import torch

import diffusers_h3._utils as h3_utils
from diffusers_h3.attention_processors import fa_v100 as fa_v100_module
from diffusers_h3.attention_processors.fa_v100 import (
    PATH_SDPA_CPU,
    PATH_SDPA_EFFICIENT,
    MiniMaxH3FAV100Processor,
)


B, S, H, D = 2, 37, 3, 64


@pytest.fixture(autouse=True)
def quiet_fallback_warnings(monkeypatch):
    monkeypatch.setattr(h3_utils, "_WARNED", set())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="MiniMaxH3FAV100Processor falls back", category=RuntimeWarning)
        yield


def _qkv(seed=0, device="cpu", scale=2.0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, H, D, generator=g) for _ in range(3))
    return (q * scale).to(device), (k * scale).to(device), v.to(device)


def _masks(seed=1, device="cpu"):
    """A bool mask (True = attend) and an additive float mask (-inf on masked keys plus finite biases), both
    ``[B, 1, S, S]``; every query keeps at least key 0, about half of the keys are masked."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(B, 1, S, S, generator=g) > 0.5
    keep[..., 0] = True
    bias = torch.randn(B, 1, S, S, generator=g)
    additive = torch.where(keep, bias, torch.tensor(float("-inf")))
    return keep.to(device), additive.to(device)


def _reference(q, k, v, mask):
    """softmax(Q K^T / sqrt(d) + mask) V in float64, from the definition (bool: -inf on masked keys)."""
    q, k, v = (x.double().transpose(1, 2) for x in (q, k, v))  # [B, H, S, D]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.double()
    return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2)


def _core(processor, *args, **kwargs):
    """The processor's attention core (``core``; ``attention`` is its earlier name)."""
    core = processor.core
    return core(*args, **kwargs)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_cpu_fallback_applies_the_mask(kind):
    q, k, v = _qkv()
    mask = _masks()[0 if kind == "bool" else 1]
    processor = MiniMaxH3FAV100Processor()
    out = _core(processor, q, k, v, attention_mask=mask)
    assert processor.select_path(q, mask)[0] == PATH_SDPA_CPU
    assert "attention mask" in processor.describe_path()
    expected = _reference(q, k, v, mask)
    unmasked = _reference(q, k, v, None)
    assert _rel(expected, unmasked) > 0.1  # the mask matters
    assert _rel(out, expected) < 1e-5
    assert _rel(out, unmasked) > 0.1


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp16_fallback_applies_the_mask(monkeypatch, kind, dtype):
    """The fp16 SDPA fallback a GPU takes with a mask (memory-efficient backend), forced here on CPU: only the
    backend pinning is replaced (CPU SDPA has no memory-efficient kernel); casts, V scaling and mask handling are the
    processor's."""
    q, k, v = _qkv()
    v = v * 3e4  # beyond fp16 after the products: the V power-of-two scale must be undone as well
    mask = _masks()[0 if kind == "bool" else 1]
    processor = MiniMaxH3FAV100Processor()
    monkeypatch.setattr(processor, "_device_path", lambda device: (PATH_SDPA_EFFICIENT, "forced by the test"))
    monkeypatch.setattr(fa_v100_module, "sdpa_kernel", lambda backends: contextlib.nullcontext())
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out = _core(processor, q, k, v, attention_mask=mask)
    assert processor.select_path(q, mask)[0] == PATH_SDPA_EFFICIENT
    assert out.dtype == dtype
    expected = _reference(q, k, v, mask)
    unmasked = _reference(q, k, v, None)
    assert _rel(expected, unmasked) > 0.1
    assert torch.isfinite(out).all()
    assert _rel(out, expected) < 1e-2
    assert _rel(out, unmasked) > 0.1


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_processor_call_with_mask_matches_plain_torch_attention_module(kind):
    """Through the attention module (projections, QK-norm, output projection), against the module computed by hand."""
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Attention

    torch.manual_seed(0)
    attn = MiniMaxH3Attention(hidden_size=48, heads=H, dim_head=D).eval()
    with torch.no_grad():
        attn.norm_q.weight.copy_(torch.rand(D) * 3 + 0.5)  # sharpen so that masking matters
    attn.set_processor(MiniMaxH3FAV100Processor())
    x = torch.randn(B, S, 48)
    mask = _masks(seed=2)[0 if kind == "bool" else 1]
    identity_rotary = (torch.ones(S, 2), torch.zeros(S, 2))  # not None: None routes to the refiner path
    with torch.no_grad():
        out = attn(x, identity_rotary, mask)
        q = _rms((x @ attn.to_q.weight.T).unflatten(-1, (H, D)), attn.norm_q.weight, attn.norm_q.eps)
        k = _rms((x @ attn.to_k.weight.T).unflatten(-1, (H, D)), attn.norm_k.weight, attn.norm_k.eps)
        v = (x @ attn.to_v.weight.T).unflatten(-1, (H, D))
        expected = _reference(q, k, v, mask).flatten(2).float() @ attn.to_out[0].weight.T
        unmasked = _reference(q, k, v, None).flatten(2).float() @ attn.to_out[0].weight.T
    assert _rel(expected, unmasked) > 0.05
    assert _rel(out, expected) < 1e-5
    assert "attention mask" in attn.processor.describe_path()  # the FA-V100 processor's own fallback ran


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_gpu_memory_efficient_fallback_applies_the_mask(kind):
    q, k, v = _qkv(device="cuda")
    mask = _masks(device="cuda")[0 if kind == "bool" else 1]
    processor = MiniMaxH3FAV100Processor()  # not SM70 and allow_non_volta=False: the SDPA fallback
    q, k, v = q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)
    out = _core(processor, q, k, v, attention_mask=mask)
    assert processor.select_path(q, mask)[0] == PATH_SDPA_EFFICIENT
    expected = _reference(q, k, v, mask)
    assert _rel(out, expected) < 1e-2
    assert _rel(out, _reference(q, k, v, None)) > 0.1
