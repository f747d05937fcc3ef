"""Decisions of the speed presets that must not flip: the automatic FlashInfer choice is Hopper only (SM90, where it
was measured; not Ampere/Ada, not Blackwell SM100/SM120), and `exact` puts diffusers' own processor back on every block
whatever was installed before. The GPU is faked through `torch.cuda.get_device_capability`."""

import pytest
import torch
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor

from diffusers_h3 import LowPrecisionAttentionConfig, SpeedPresetConfig
from diffusers_h3.pipelines.speed_presets import (
    attention_dtype,
    enable_speed_preset_on_transformer,
    exact_attention_backend,
    plan_flashinfer,
)


def _fake_gpu(monkeypatch, capability=(9, 0)):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)


@pytest.mark.parametrize("capability", [(9, 0), (8, 0), (8, 6), (8, 9), (10, 0), (10, 3), (12, 0)])
def test_automatic_flashinfer_is_hopper_only(monkeypatch, flashinfer_stand_in, capability):
    _fake_gpu(monkeypatch, capability)
    hopper = capability[0] == 9
    assert plan_flashinfer(None, torch.device("cuda:0"), "exact") == ("on" if hopper else "off")
    assert plan_flashinfer(None, torch.device("cuda:0"), "fast") == ("available" if hopper else "off")
    assert plan_flashinfer(False, torch.device("cuda:0"), "exact") == "off"


@pytest.mark.parametrize("dtype, expected", [(torch.bfloat16, "_native_cudnn"), (torch.float16, "_native_cudnn"),
                                             (torch.float32, None)])  # fmt: skip
def test_exact_takes_cudnn_only_for_half_precision_models(monkeypatch, dtype, expected):
    # cuDNN's fused attention has no float32 kernel: a float32 model on it ends its first forward in "No available
    # kernel" (the demo checkpoint on a GPU with --speed exact did).
    _fake_gpu(monkeypatch)
    assert exact_attention_backend(torch.device("cuda:0"), dtype) == expected


def test_flashinfer_is_never_chosen_for_a_float32_model(monkeypatch, flashinfer_stand_in):
    _fake_gpu(monkeypatch)
    cuda = torch.device("cuda:0")
    assert plan_flashinfer(None, cuda, "exact", torch.bfloat16) == "on"
    assert plan_flashinfer(None, cuda, "exact", torch.float32) == "off"
    assert plan_flashinfer(None, cuda, "fast", torch.float32) == "off"
    with pytest.raises(ValueError, match=r"run bf16 / fp16 models, this transformer is torch.float32: load it with "):
        plan_flashinfer(True, cuda, "exact", torch.float32)


def test_the_attention_dtype_is_the_blocks_and_the_exact_record_names_it():
    model = _tiny_transformer().to(torch.bfloat16)
    model.proj_in.float()  # diffusers keeps a few modules in float32 in a bf16 model
    assert next(model.parameters()).dtype == torch.float32 and attention_dtype(model) == torch.bfloat16
    record = enable_speed_preset_on_transformer(_tiny_transformer(), SpeedPresetConfig("exact", compile=False,
                                                                                       flashinfer=False))  # fmt: skip
    assert record.attention["transformer"].startswith("dense float32, ")
    record = enable_speed_preset_on_transformer(model, SpeedPresetConfig("exact", compile=False, flashinfer=False))
    assert record.attention["transformer"].startswith("dense bfloat16, ")


def _tiny_transformer():
    from diffusers import MiniMaxH3Transformer3DModel

    from diffusers_h3.testing.tiny import TINY_TRANSFORMER_CONFIG

    torch.manual_seed(0)
    return MiniMaxH3Transformer3DModel(**TINY_TRANSFORMER_CONFIG).eval()


def _int8_attention(model):
    from diffusers_h3.attention_processors import enable_low_precision_attention

    enable_low_precision_attention(model, LowPrecisionAttentionConfig("int8"))


def _flashinfer_attention(model):
    from diffusers_h3.attention_processors import MiniMaxH3FlashInferProcessor

    for block in model.transformer_blocks:
        block.attn.set_processor(MiniMaxH3FlashInferProcessor("fa3"))


@pytest.mark.parametrize("install", [_int8_attention, _flashinfer_attention], ids=["int8", "flashinfer"])
def test_exact_restores_diffusers_processor_on_every_block(install):
    model = _tiny_transformer()
    refiner_before = {name: type(p) for name, p in model.attn_processors.items() if name.startswith("token_refiner")}
    install(model)
    assert not any(type(b.attn.processor) is MiniMaxH3AttnProcessor for b in model.transformer_blocks)

    enable_speed_preset_on_transformer(model, SpeedPresetConfig("exact", compile=False))

    assert all(type(b.attn.processor) is MiniMaxH3AttnProcessor for b in model.transformer_blocks)
    refiner_after = {name: type(p) for name, p in model.attn_processors.items() if name.startswith("token_refiner")}
    assert refiner_after == refiner_before


@pytest.mark.parametrize("capability", [(7, 0), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)])
def test_fastest_takes_the_fp8_decoder_only_where_fp8_runs(monkeypatch, capability):
    from diffusers_h3.pipelines.speed_presets import plan_vae_decode

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    fp8 = capability >= (8, 9)  # FP8 tensor cores: Ada, Hopper, Blackwell
    plan = plan_vae_decode("fastest", torch.device("cuda:0"), compile=True)
    assert plan.batched and plan.compile and plan.fp8_linears is fp8
    assert plan.decode.startswith("batched tiles + torch.compile")
    assert ("FP8 decoder linears" in plan.decode) is fp8
    assert ("no FP8 tensor cores on cuda:0" in plan.decode) is not fp8
    # "fast" never quantizes the decoder, "exact" never leaves diffusers' eager decode.
    fast = plan_vae_decode("fast", torch.device("cuda:0"), compile=True)
    assert fast.batched and fast.compile and not fast.fp8_linears and "FP8" not in fast.decode
    exact = plan_vae_decode("exact", torch.device("cuda:0"), compile=True)
    assert not (exact.batched or exact.compile or exact.fp8_linears)


def test_the_decoder_is_compiled_on_cuda_only():
    from diffusers_h3.pipelines.speed_presets import plan_vae_decode

    cpu = plan_vae_decode("fastest", torch.device("cpu"), compile=True)
    assert not cpu.compile and not cpu.fp8_linears
    assert cpu.decode_compile == "off: the VAE decoder is compiled on CUDA only (device cpu)"
    assert "no FP8 tensor cores on cpu" in cpu.decode
    assert plan_vae_decode("fast", torch.device("cpu"), compile=False).decode_compile == "off (compile=False)"


def test_an_fp8_decoder_is_kept_by_fast_and_refused_by_exact():
    from diffusers_h3.pipelines.speed_presets import plan_vae_decode

    kept = plan_vae_decode("fast", torch.device("cpu"), compile=False, decoder_fp8=True)
    assert kept.fp8_linears and "already quantized: kept" in kept.decode
    with pytest.raises(ValueError, match=r"'exact' runs diffusers' own video decode.*already FP8.*reload the VAE"):
        plan_vae_decode("exact", torch.device("cpu"), compile=False, decoder_fp8=True)
