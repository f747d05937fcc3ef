"""MiniMaxH3LowPrecisionAttnProcessor on the tiny H3 transformer: the dense FP8 / INT8 / FP4 core, its installation,
its errors, and the VSA processor's dense calls delegating to it."""

import os

import torch


if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor  # noqa: E402

from diffusers_h3 import LowPrecisionAttentionConfig
from diffusers_h3.attention_processors import (  # noqa: E402
    MiniMaxH3LowPrecisionAttnProcessor,
    disable_low_precision_attention,
    enable_low_precision_attention,
    enable_vsa,
    low_precision_attention_state,
)
from diffusers_h3.attention_processors._projections import project_output, project_qkv  # noqa: E402
from diffusers_h3.kernels.attention import fp8_attention  # noqa: E402

from .test_vsa_processor import DEVICE, _reset, _run, model, rel_l2  # noqa: E402, F401


@pytest.mark.parametrize("precision", ["fp8", "int8", "fp4"])
def test_equals_vsa_sparsity_zero_bitwise(model, precision):  # noqa: F811
    _reset(model)
    ref = _run(model)
    enable_vsa(model, sparsity=0.0, precision=precision)
    via_vsa = _run(model)
    assert enable_low_precision_attention(model, LowPrecisionAttentionConfig(precision=precision)) is model
    assert low_precision_attention_state(model)["blocks"] == 2
    assert all(isinstance(b.attn.processor, MiniMaxH3LowPrecisionAttnProcessor) for b in model.transformer_blocks)
    assert not isinstance(model.token_refiner.refiner_blocks[0].attn.processor, MiniMaxH3LowPrecisionAttnProcessor)
    got = _run(model)
    assert torch.equal(got[0], via_vsa[0]) and torch.equal(got[1], via_vsa[1])
    assert 1e-6 < rel_l2(got[0], ref[0]) < (0.25 if precision == "fp4" else 0.08)  # quantized, not the bf16 path
    disable_low_precision_attention(model)
    assert torch.equal(_run(model)[0], ref[0])
    _reset(model)


@pytest.mark.triton_interpreter
def test_fp8_core_is_projection_fp8_attention_output(model):  # noqa: F811
    attn = model.transformer_blocks[0].attn
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 40, 32, generator=gen).to(DEVICE)
    rotary = (torch.ones(40, 24, device=DEVICE), torch.zeros(40, 24, device=DEVICE))
    processor = MiniMaxH3LowPrecisionAttnProcessor("fp8")
    with torch.no_grad():
        got = processor(attn, x, rotary)
        q, k, v = project_qkv(attn, x, rotary)
        expected = project_output(attn, fp8_attention(q, k, v.contiguous()), q.dtype)
    assert torch.equal(got, expected)
    choice = processor.last_choice
    assert choice is not None and choice.describe() in processor.describe_path()
    assert "FP8 E4M3 Q per token" in processor.describe_path()
    # The refiner (rotary_emb=None) runs diffusers' default processor.
    with torch.no_grad():
        assert torch.equal(processor(attn, x), MiniMaxH3AttnProcessor()(attn, x))


def test_options_are_validated_with_one_clear_line():
    with pytest.raises(ValueError, match=r"precision must be one of \('fp8', 'int8', 'fp4'\), got 'bf16'"):
        MiniMaxH3LowPrecisionAttnProcessor("bf16")
    with pytest.raises(ValueError, match="pv_precision='fp8' needs precision='fp8' or 'int8'"):
        MiniMaxH3LowPrecisionAttnProcessor("fp4", pv_precision="fp8")
    with pytest.raises(ValueError, match="kernel must be"):
        MiniMaxH3LowPrecisionAttnProcessor("fp8", kernel="cuda")
    with pytest.raises(NotImplementedError, match="strict=False"):
        MiniMaxH3LowPrecisionAttnProcessor("fp4", strict=True)
    with pytest.raises(TypeError, match="MiniMaxH3Transformer3DModel"):
        enable_low_precision_attention(torch.nn.Linear(2, 2), LowPrecisionAttentionConfig(precision="fp8"))
    with pytest.raises(ValueError, match="no attention_mask"):
        MiniMaxH3LowPrecisionAttnProcessor("int8").core(*(torch.zeros(1, 4, 1, 16) for _ in range(3)),
                                                         attention_mask=torch.ones(4, 4, dtype=torch.bool))


def test_pipeline_like_objects_install_on_every_partition(model):  # noqa: F811
    class Pipe:
        transformer = model

    _reset(model)
    pipe = Pipe()
    assert enable_low_precision_attention(pipe, LowPrecisionAttentionConfig(precision="int8")) is pipe
    assert low_precision_attention_state(model)["precision"] == "int8"
    assert isinstance(model.transformer_blocks[1].attn.processor, MiniMaxH3LowPrecisionAttnProcessor)
    assert disable_low_precision_attention(pipe) is pipe
    assert low_precision_attention_state(model) is None
    assert type(model.transformer_blocks[1].attn.processor) is MiniMaxH3AttnProcessor
