"""FlashInfer's dense kernel through MiniMaxH3FlashInferProcessor against cuDNN on the GPU (needs flashinfer-python).

Run on a GPU machine with FlashInfer installed: ``python -m pytest tests/gpu/test_flashinfer_gpu.py -m gpu -q``.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from diffusers_h3 import SpeedPresetConfig


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("seq", [1000, 4133])  # partial tiles at both lengths
@pytest.mark.parametrize("asked", ["auto", "fa2"])  # auto: FA3 on Hopper
def test_flashinfer_core_matches_cudnn(seq, asked):
    pytest.importorskip("flashinfer")
    from diffusers_h3.attention_processors import MiniMaxH3FlashInferProcessor
    from diffusers_h3.kernels.attention.flashinfer_dense import resolve_backend

    backend = resolve_backend(asked, torch.cuda.get_device_capability())
    gen = torch.Generator("cuda").manual_seed(seq)
    q, k, v = (torch.randn(2, seq, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    processor = MiniMaxH3FlashInferProcessor(backend)
    out = processor.core(q, k, v)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    exact = F.scaled_dot_product_attention(*(t.transpose(1, 2).double() for t in (q, k, v))).transpose(1, 2)
    err = ((out.double() - exact).norm() / exact.norm()).item()
    ref_err = ((ref.double() - exact).norm() / exact.norm()).item()
    assert err < 2 * ref_err + 1e-4, (err, ref_err)  # bf16 attention: the same rounding level as cuDNN
    assert f"single_prefill {backend}" in processor.describe_path()


def _tiny_model():
    from diffusers import MiniMaxH3Transformer3DModel

    from diffusers_h3.testing.tiny import TINY_TRANSFORMER_CONFIG

    torch.manual_seed(0)
    config = {**TINY_TRANSFORMER_CONFIG, "attention_head_dim": 128}  # FlashInfer's FA3 head sizes: 64/128/256
    return MiniMaxH3Transformer3DModel(**config).to("cuda", torch.bfloat16).eval()


def _forward(model):
    from diffusers_h3.testing.tiny import tiny_transformer_inputs

    inputs = tiny_transformer_inputs(seed=5, grid=(5, 12, 16))
    inputs = {k: v.cuda() for k, v in inputs.items()}
    for name in ("hidden_states", "audio_hidden_states", "encoder_hidden_states"):
        inputs[name] = inputs[name].bfloat16()
    with torch.no_grad():
        return model(**inputs).sample.double()


def _native_forward():
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor

    from diffusers_h3.pipelines.speed_presets import set_attention_backend_on_model

    native = _tiny_model()
    native.set_attn_processor(MiniMaxH3AttnProcessor())
    set_attention_backend_on_model(native, "_native_cudnn")  # not the process-wide backend the other tests run on
    return _forward(native)


def test_exact_preset_takes_flashinfer_and_is_deterministic():
    pytest.importorskip("flashinfer")
    from diffusers_h3.attention_processors import MiniMaxH3FlashInferProcessor
    from diffusers_h3.pipelines.speed_presets import enable_speed_preset_on_transformer

    fast = _tiny_model()
    expected = "fa3" if torch.cuda.get_device_capability()[0] == 9 else None
    record = enable_speed_preset_on_transformer(fast, SpeedPresetConfig("exact", compile=False))
    if expected is None:
        pytest.skip("the exact preset takes FlashInfer on Hopper only")
    assert "FlashInfer FA3" in record.attention["transformer"]
    assert all(isinstance(b.attn.processor, MiniMaxH3FlashInferProcessor) for b in fast.transformer_blocks)
    first, second, ref = _forward(fast), _forward(fast), _native_forward()
    assert torch.equal(first, second)  # the preset's determinism claim
    assert ((first - ref).norm() / ref.norm()).item() < 2e-2  # bf16 attention on either kernel


def test_fast_preset_with_flashinfer_fp8_is_deterministic():
    pytest.importorskip("flashinfer")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("FlashInfer's FP8 attention is FA3: Hopper only")
    from diffusers_h3.attention_processors import MiniMaxH3FlashInferProcessor
    from diffusers_h3.pipelines.speed_presets import enable_speed_preset_on_transformer

    fast = _tiny_model()
    record = enable_speed_preset_on_transformer(fast, SpeedPresetConfig("fast", compile=False, flashinfer=True))
    assert "FlashInfer FA3 FP8" in record.attention["transformer"]
    assert all(isinstance(b.attn.processor, MiniMaxH3FlashInferProcessor) for b in fast.transformer_blocks)
    first, second, ref = _forward(fast), _forward(fast), _native_forward()
    assert torch.equal(first, second)  # the preset's determinism claim, with FA3 FP8 attention
    assert ((first - ref).norm() / ref.norm()).item() < 8e-2  # FP8 GEMMs and FP8 attention


@pytest.mark.parametrize("seq", [1000, 4133])
def test_flashinfer_fp8_core_matches_its_reference(seq):
    pytest.importorskip("flashinfer")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("FlashInfer's FP8 attention is FA3: Hopper only")
    from diffusers_h3.attention_processors import MiniMaxH3FlashInferProcessor
    from diffusers_h3.kernels.attention.flashinfer_dense import flashinfer_fp8_reference

    gen = torch.Generator("cuda").manual_seed(seq)
    q, k, v = (torch.randn(2, seq, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    processor = MiniMaxH3FlashInferProcessor("fa3", precision="fp8")
    out = processor.core(q, k, v).double()
    reference = flashinfer_fp8_reference(q, k, v).double()  # same operands, P kept in fp32
    exact = F.scaled_dot_product_attention(*(t.transpose(1, 2).double() for t in (q, k, v))).transpose(1, 2)
    assert ((out - reference).norm() / reference.norm()).item() < 3e-2  # the kernel's FP8 P on top of the operands
    assert ((out - exact).norm() / exact.norm()).item() < 8e-2
    assert "single_prefill fa3 fp8" in processor.describe_path()
