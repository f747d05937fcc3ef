"""V100 mode keeps the residual stream in fp32 without casting block inputs: the embedders are fp32 and every hooked
linear returns fp32, so every block sees and returns fp32 hidden states (this is what makes a block-input cast
unnecessary; if a hooked linear ever returned fp16, these tests fail)."""

import warnings

import pytest
import torch
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

import diffusers_h3._utils as h3_utils
from diffusers_h3 import V100ModeConfig
from diffusers_h3.hooks.v100_mode import enable_v100_mode
from diffusers_h3.testing.tiny import TINY_TRANSFORMER_CONFIG, tiny_transformer_inputs


@pytest.fixture(autouse=True)
def quiet_fallback_warnings(monkeypatch):
    monkeypatch.setattr(h3_utils, "_WARNED", set())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="MiniMaxH3FAV100Processor falls back", category=RuntimeWarning)
        yield


@pytest.mark.parametrize("attention", ["fa_v100", "keep"])
def test_every_block_sees_and_returns_fp32_hidden_states(attention):
    torch.manual_seed(0)
    model = MiniMaxH3Transformer3DModel(**TINY_TRANSFORMER_CONFIG).eval()
    inputs = tiny_transformer_inputs(0)
    with torch.no_grad():
        ref = model(**inputs).sample
    enable_v100_mode(model, V100ModeConfig(attention=attention))
    assert model.transformer_blocks[0].attn.to_q.weight.dtype == torch.float16  # the mode is on
    seen = []
    blocks = list(model.transformer_blocks) + list(model.token_refiner.refiner_blocks)
    hooks = [b.register_forward_hook(lambda m, args, out: seen.append((args[0].dtype, out.dtype))) for b in blocks]
    try:
        with torch.no_grad():
            out = model(**inputs).sample
    finally:
        for h in hooks:
            h.remove()
    assert len(seen) == len(blocks)
    assert all(dtypes == (torch.float32, torch.float32) for dtypes in seen), seen
    assert ((out.float() - ref).norm() / ref.norm()).item() < 5e-3
