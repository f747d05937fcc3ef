"""Speed presets on the tiny pipeline (CPU: emulated / interpreted paths, compile=False)."""

import shutil
from unittest.mock import patch

import pytest
import torch
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor

import diffusers_h3
from diffusers_h3 import (
    FastVAEDecodeConfig,
    MiniMaxH3LowPrecisionAttnProcessor,
    MiniMaxH3VSAProcessor,
    SpeedPresetConfig,
)
from diffusers_h3._hooks import H3_FAST_VAE_DECODE_HOOK, get_h3_hook
from diffusers_h3.hooks.fast_vae_decode import fast_vae_decode_state
from diffusers_h3.quantizers import is_quantized_linear
from diffusers_h3.testing.tiny import TINY_NUM_FRAMES, tiny_pipeline


CALL = {"prompt": "a cat", "height": 32, "width": 32, "num_frames": TINY_NUM_FRAMES, "num_inference_steps": 2,
        "output_type": "latent"}


def _pipe():
    return tiny_pipeline(seed=3, with_transformer_ref=False)


def _run(pipe):
    frames = pipe(**CALL, generator=torch.Generator().manual_seed(0)).frames
    assert torch.isfinite(frames).all()
    return frames


def _block_processors(pipe):
    return [block.attn.processor for block in pipe.transformer.transformer_blocks]


def _quantized(pipe):
    return [m for m in pipe.transformer.modules() if is_quantized_linear(m)]


@pytest.fixture(scope="module")
def native_frames():
    return _run(_pipe())


def test_unknown_preset_lists_presets():
    pipe = _pipe()
    with pytest.raises(ValueError, match=r"unknown speed preset 'turbo'.*'exact', 'fast', 'fastest'"):
        pipe.enable_speed_preset("turbo")
    assert getattr(pipe, "_h3_speed_preset", None) is None
    assert not _quantized(pipe)


def test_exact_is_bitwise_the_native_output(native_frames):
    pipe = _pipe()
    assert diffusers_h3.enable_speed_preset(pipe, SpeedPresetConfig("exact", compile=False)) is pipe
    record = diffusers_h3.speed_preset_record(pipe)
    assert all(type(p) is MiniMaxH3AttnProcessor for p in _block_processors(pipe))
    assert not _quantized(pipe)
    report = diffusers_h3.describe(pipe)["speed_preset"]
    assert report == record.describe() and report["preset"] == "exact"
    assert "not quantized" in report["weights"]["transformer"] and "dense float32" in report["attention"]["transformer"]
    assert report["compile"]["transformer"] == "off (compile=False)"
    assert torch.equal(_run(pipe), native_frames)


@pytest.mark.parametrize("preset", ["fast", "fastest"])
def test_fast_presets_turn_on_what_they_report(preset, native_frames):
    pipe = _pipe()
    pipe.enable_speed_preset(SpeedPresetConfig(preset, compile=True))  # CPU: compile reported as off, not dropped
    processors = _block_processors(pipe)
    expected = MiniMaxH3LowPrecisionAttnProcessor if preset == "fast" else MiniMaxH3VSAProcessor
    assert processors and all(type(p) is expected for p in processors)
    assert all(p.precision == "int8" for p in processors)
    if preset == "fastest":
        assert all(p.sparsity == 0.8 for p in processors)
    quantized = _quantized(pipe)
    assert quantized and all(m.weight.quant_method == "h3_w8a16" for m in quantized)  # no FP8 tensor cores on a CPU

    report = diffusers_h3.describe(pipe)
    assert report["speed_preset"]["preset"] == preset
    assert "W8A16Config" in report["speed_preset"]["weights"]["transformer"]
    assert "no FP8 tensor cores" in report["speed_preset"]["weights"]["transformer"]
    assert "INT8" in report["speed_preset"]["attention"]["transformer"]
    assert "CUDA only" in report["speed_preset"]["compile"]["transformer"]
    assert report["components"]["transformer"]["quantization"] == "W8A16Config"

    frames = _run(pipe)
    rel = ((frames - native_frames).norm() / native_frames.norm()).item()
    assert 0 < rel < 0.1, f"{preset}: rel-L2 {rel} vs the exact output (0 would mean the preset did nothing)"
    # What ran, as the processors recorded it.
    paths = diffusers_h3.describe(pipe)["components"]["transformer"]["attention"]
    assert any(("VSA sparsity=0.8" if preset == "fastest" else "dense low-precision") in path for path in paths)


def test_switching_presets_never_quantizes_twice():
    pipe = _pipe()
    pipe.enable_speed_preset(SpeedPresetConfig("fast", compile=False))
    layers = _quantized(pipe)
    pipe.enable_speed_preset(SpeedPresetConfig("fast", compile=False))  # re-applying keeps the quantized weights
    pipe.enable_speed_preset(SpeedPresetConfig("fastest", compile=False))
    assert _quantized(pipe) == layers
    assert all(type(p) is MiniMaxH3VSAProcessor for p in _block_processors(pipe))
    assert "already quantized: kept" in diffusers_h3.describe(pipe)["speed_preset"]["weights"]["transformer"]
    pipe.enable_speed_preset(SpeedPresetConfig("fast", compile=False))
    assert all(type(p) is MiniMaxH3LowPrecisionAttnProcessor for p in _block_processors(pipe))

    with pytest.raises(ValueError, match=r"'exact' runs bf16 weights.*already quantized \(h3_w8a16\).*reload"):
        pipe.enable_speed_preset("exact")
    assert diffusers_h3.describe(pipe)["speed_preset"]["preset"] == "fast"  # the failed call changed nothing


def test_other_quantization_is_refused_not_stacked():
    pipe = _pipe()
    diffusers_h3.quantize(pipe.transformer, diffusers_h3.NVFP4Config())
    with pytest.raises(ValueError, match=r"already quantized \(h3_nvfp4\); reload it in bf16"):
        pipe.enable_speed_preset("fast")
    assert all(type(p) is MiniMaxH3AttnProcessor for p in _block_processors(pipe))


def test_preset_logs_what_it_turned_on(caplog):
    from diffusers.utils import logging as diffusers_logging

    pipe = _pipe()
    logger = diffusers_logging.get_logger("diffusers_h3.pipelines.speed_presets")
    logger.addHandler(caplog.handler)
    level = logger.level
    logger.setLevel("INFO")
    try:
        pipe.enable_speed_preset(SpeedPresetConfig("fastest", compile=False))
    finally:
        logger.removeHandler(caplog.handler)
        logger.setLevel(level)
    assert "speed preset 'fastest' on transformer" in caplog.text and "VSA sparsity=0.8" in caplog.text


def test_fast_presets_batch_the_vae_tiles_and_exact_keeps_diffusers_decode():
    pipe = _pipe()
    pipe.enable_speed_preset(SpeedPresetConfig("fastest", compile=False))
    assert get_h3_hook(pipe.vae, H3_FAST_VAE_DECODE_HOOK) is not None
    assert diffusers_h3.describe(pipe)["speed_preset"]["decode"].startswith("batched tiles")
    exact = _pipe()
    exact.enable_speed_preset(SpeedPresetConfig("exact", compile=False))
    assert get_h3_hook(exact.vae, H3_FAST_VAE_DECODE_HOOK) is None
    assert diffusers_h3.describe(exact)["speed_preset"]["decode"] == "diffusers' tiled decode"


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor's CPU backend needs a C++ compiler"
)
@pytest.mark.parametrize("preset", ["exact", "fast", "fastest"])
def test_preset_compile_keeps_eager_bf16_numerics(preset):
    """Every preset's compile options make inductor round fused intermediates to bf16 as eager does: the compiled
    blocks come closer to the eager output than inductor's default options (~5e-3 here) and are bitwise equal to eager.
    torch's CPU inductor honours the option from 2.14 (CI); torch 2.11's came out farther from eager with it than
    without (0.0904 against 0.0858, cpu_suite_gpu_host_h100.json), so there is nothing to check on CPU before 2.14. The 8-bit presets
    compiled without it were half as far again from native on the GPU (docs/speed.md)."""
    if tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 14):
        pytest.skip(f"torch {torch.__version__}'s CPU inductor does not honour emulate_precision_casts (2.14 does)")
    from diffusers_h3.pipelines import speed_presets
    from diffusers_h3.testing.tiny import tiny_transformer, tiny_transformer_inputs

    def compiled_output(options):
        torch.manual_seed(0)
        model = tiny_transformer(num_layers=4).to(torch.bfloat16).eval()
        with torch.no_grad():
            eager = model(**inputs)[0]
            torch._dynamo.reset()
            with patch.object(speed_presets, "COMPILE_OPTIONS", options):
                line = speed_presets.compile_blocks(model, preset)
            try:
                compiled = model(**inputs)[0]
            finally:
                torch._dynamo.reset()
        assert all(getattr(b, "_compiled_call_impl", None) is not None for b in model.transformer_blocks)
        return compiled, eager, line

    inputs = {**tiny_transformer_inputs(seed=1, grid=(2, 4, 4)), "return_dict": False}
    inputs = {
        k: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()
    }
    compiled, eager, line = compiled_output(speed_presets.COMPILE_OPTIONS)
    default, _, _ = compiled_output({name: {} for name in speed_presets.SPEED_PRESETS})
    assert "emulate_precision_casts=True" in line
    assert (compiled.float() - eager.float()).norm() < (default.float() - eager.float()).norm()
    torch.testing.assert_close(compiled, eager, atol=0, rtol=0)


def _hopper(monkeypatch):
    """Make the CPU look like an SM90 GPU to the preset's and the FlashInfer installer's capability checks."""
    from diffusers_h3.attention_processors import flashinfer as flashinfer_processors
    from diffusers_h3.pipelines import speed_presets

    monkeypatch.setattr(speed_presets, "cuda_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(flashinfer_processors, "cuda_capability", lambda device=None: (9, 0))


def _tiny_bf16_transformer():
    from diffusers import MiniMaxH3Transformer3DModel

    from diffusers_h3.testing.tiny import TINY_TRANSFORMER_CONFIG

    torch.manual_seed(0)
    return MiniMaxH3Transformer3DModel(**TINY_TRANSFORMER_CONFIG).to(torch.bfloat16).eval()


def _forward(model):
    from diffusers_h3.testing.tiny import tiny_transformer_inputs

    inputs = tiny_transformer_inputs(seed=5)
    for name in ("hidden_states", "audio_hidden_states", "encoder_hidden_states"):
        inputs[name] = inputs[name].bfloat16()
    with torch.no_grad():
        return model(**inputs).sample


def test_exact_runs_flashinfer_on_hopper_when_installed(monkeypatch, flashinfer_stand_in):
    from diffusers_h3.attention_processors import MiniMaxH3FlashInferProcessor
    from diffusers_h3.pipelines.speed_presets import enable_speed_preset_on_transformer

    _hopper(monkeypatch)
    native = _tiny_bf16_transformer()
    native.set_attn_processor(MiniMaxH3AttnProcessor())
    model = _tiny_bf16_transformer()
    record = enable_speed_preset_on_transformer(model, SpeedPresetConfig("exact", compile=False))
    assert "FlashInfer FA3" in record.attention["transformer"]
    assert all(isinstance(b.attn.processor, MiniMaxH3FlashInferProcessor) for b in model.transformer_blocks)
    # The stand-in computes diffusers' SDPA call: the preset's glue must not change a bit.
    assert torch.equal(_forward(model), _forward(native))
    assert {c["backend"] for c in flashinfer_stand_in.calls} == {"fa3"}


def test_exact_without_flashinfer_says_what_it_would_gain(monkeypatch):
    import sys

    from diffusers_h3.pipelines.speed_presets import enable_speed_preset_on_transformer

    _hopper(monkeypatch)
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # not installed
    model = _tiny_bf16_transformer()
    record = enable_speed_preset_on_transformer(model, SpeedPresetConfig("exact", compile=False))
    assert "flashinfer-python not installed" in record.attention["transformer"]
    assert all(type(b.attn.processor) is MiniMaxH3AttnProcessor for b in model.transformer_blocks)
    # Asked for explicitly, a missing package is one clear error, and nothing changes.
    model = _tiny_bf16_transformer()
    before = [type(b.attn.processor) for b in model.transformer_blocks]
    with pytest.raises(ImportError, match="pip install flashinfer-python"):
        enable_speed_preset_on_transformer(model, SpeedPresetConfig("exact", compile=False, flashinfer=True))
    assert [type(b.attn.processor) for b in model.transformer_blocks] == before


def test_flashinfer_choice_is_checked_before_anything_changes(flashinfer_stand_in):
    from diffusers_h3.pipelines.speed_presets import enable_speed_preset_on_transformer

    model = _tiny_bf16_transformer()
    weights = {name: p.clone() for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match="needs a CUDA GPU of SM80"):  # the CPU cannot run FlashInfer
        enable_speed_preset_on_transformer(model, SpeedPresetConfig("exact", compile=False, flashinfer=True))
    with pytest.raises(ValueError, match="no FlashInfer kernel runs the 'fastest' preset's video sparse attention"):
        enable_speed_preset_on_transformer(model, SpeedPresetConfig("fastest", compile=False, flashinfer=True))
    with pytest.raises(ValueError, match="needs a CUDA GPU of SM80"):
        enable_speed_preset_on_transformer(model, SpeedPresetConfig("fast", compile=False, flashinfer=True))
    with pytest.raises(TypeError, match="None .automatic., True or False"):
        enable_speed_preset_on_transformer(model, SpeedPresetConfig("exact", compile=False, flashinfer="yes"))
    assert not any(is_quantized_linear(m) for m in model.modules())
    assert all(torch.equal(p, weights[name]) for name, p in model.named_parameters())
    assert all(type(b.attn.processor) is not MiniMaxH3LowPrecisionAttnProcessor for b in model.transformer_blocks)
    # Automatic off the Hopper GPU: diffusers' attention, no note.
    record = enable_speed_preset_on_transformer(model, SpeedPresetConfig("exact", compile=False))
    assert "FlashInfer" not in record.attention["transformer"] and not flashinfer_stand_in.calls


def test_fast_runs_flashinfer_fp8_only_when_asked(monkeypatch, flashinfer_stand_in):
    from diffusers_h3.attention_processors import MiniMaxH3FlashInferProcessor
    from diffusers_h3.pipelines.speed_presets import enable_speed_preset_on_transformer

    _hopper(monkeypatch)
    # Automatic: INT8 attention (more exact), and the record says what flashinfer=True would run.
    model = _tiny_bf16_transformer()
    record = enable_speed_preset_on_transformer(model, SpeedPresetConfig("fast", compile=False))
    assert all(type(b.attn.processor) is MiniMaxH3LowPrecisionAttnProcessor for b in model.transformer_blocks)
    assert "dense INT8" in record.attention["transformer"] and "flashinfer=True: FlashInfer's FA3 FP8" in (
        record.attention["transformer"])
    # Asked for: FA3's FP8 kernel in every block, and the forward runs through it.
    model = _tiny_bf16_transformer()
    record = enable_speed_preset_on_transformer(model, SpeedPresetConfig("fast", compile=False, flashinfer=True))
    assert "FlashInfer FA3 FP8" in record.attention["transformer"] and "INT8" not in record.attention["transformer"]
    processors = [b.attn.processor for b in model.transformer_blocks]
    assert all(isinstance(p, MiniMaxH3FlashInferProcessor) and p.precision == "fp8" for p in processors)
    out = _forward(model)
    assert torch.isfinite(out).all()
    assert flashinfer_stand_in.calls and all(c["fp8"] and c["backend"] == "fa3" for c in flashinfer_stand_in.calls)
    assert "not yet checked on hardware" in record.determinism  # until the GPU test has run


def test_pipeline_preset_passes_the_flashinfer_choice(monkeypatch, flashinfer_stand_in):
    from diffusers_h3.attention_processors import MiniMaxH3FlashInferProcessor

    _hopper(monkeypatch)
    pipe = _pipe()
    pipe.transformer.to(torch.bfloat16)  # FlashInfer runs bf16 / fp16 models only
    pipe.enable_speed_preset(SpeedPresetConfig("exact", compile=False, flashinfer=False))
    assert all(type(p) is MiniMaxH3AttnProcessor for p in _block_processors(pipe))
    pipe.enable_speed_preset(SpeedPresetConfig("exact", compile=False))
    assert all(isinstance(p, MiniMaxH3FlashInferProcessor) for p in _block_processors(pipe))
    assert "FlashInfer FA3" in str(diffusers_h3.describe(pipe)["speed_preset"]["attention"])


def test_exact_keeps_cudnn_when_flashinfer_cannot_build(monkeypatch, tmp_path, flashinfer_stand_in):
    from diffusers_h3.kernels.attention import flashinfer_dense
    from diffusers_h3.pipelines.speed_presets import enable_speed_preset_on_transformer

    _hopper(monkeypatch)
    for name in ("FLASHINFER_NVCC", "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(flashinfer_dense, "DEFAULT_CUDA_HOME", str(tmp_path / "no-cuda"))
    model = _tiny_bf16_transformer()
    record = enable_speed_preset_on_transformer(model, SpeedPresetConfig("exact", compile=False))
    assert "cannot build its kernels: no nvcc found" in record.attention["transformer"]
    assert all(type(b.attn.processor) is MiniMaxH3AttnProcessor for b in model.transformer_blocks)
    with pytest.raises(RuntimeError, match="no nvcc was found"):  # asked for explicitly: one clear error
        enable_speed_preset_on_transformer(_tiny_bf16_transformer(), SpeedPresetConfig("exact", compile=False,
                                                                                       flashinfer=True))  # fmt: skip


def test_exact_sets_the_backend_on_its_processors_only(monkeypatch):
    # diffusers' set_attention_backend also sets the process-wide active backend: after the preset, every other model
    # (an fp32 VAE, a second pipeline) would run on cuDNN. Fake a GPU where the preset picks cuDNN.
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    from diffusers_h3.pipelines import speed_presets

    monkeypatch.setattr(speed_presets, "exact_attention_backend", lambda device, dtype: "_native_cudnn")
    before = _AttentionBackendRegistry.get_active_backend()[0]
    model = _tiny_bf16_transformer()
    record = speed_presets.enable_speed_preset_on_transformer(model, SpeedPresetConfig("exact", compile=False,
                                                                                       flashinfer=False))  # fmt: skip
    assert "'_native_cudnn'" in record.attention["transformer"]
    assert _AttentionBackendRegistry.get_active_backend()[0] == before
    processors = [m.processor for m in model.modules() if hasattr(getattr(m, "processor", None), "_attention_backend")]
    assert processors and all(p._attention_backend == AttentionBackendName._NATIVE_CUDNN for p in processors)


@pytest.mark.parametrize("preset", ["exact", "fast", "fastest"])
def test_presets_record_their_decode_and_export(preset):
    from diffusers_h3.pipelines.speed_presets import EXPORT_SETTINGS

    pipe = _pipe()
    pipe.enable_speed_preset(SpeedPresetConfig(preset, compile=True))
    report = diffusers_h3.describe(pipe)["speed_preset"]
    if preset == "exact":
        assert report["decode"] == "diffusers' tiled decode" and fast_vae_decode_state(pipe.vae) is None
        assert report["decode_compile"].startswith("off: 'exact' runs diffusers' eager decode")
    else:
        assert report["decode"].startswith("batched tiles (enable_fast_vae_decode)")
        assert report["decode_compile"] == "off: the VAE decoder is compiled on CUDA only (device cpu)"
        state = fast_vae_decode_state(pipe.vae)
        assert state.compile is False and state.fp8_linears is False
    assert ("no FP8 tensor cores on cpu" in report["decode"]) is (preset == "fastest")
    export = report["export"]
    assert {key: export[key] for key in ("crf", "preset", "pix_fmt")} == EXPORT_SETTINGS[preset]
    assert "benchmarks/results/export_cpu.json" in export["source"]


def test_fast_after_an_fp8_decoder_keeps_it_and_exact_refuses_it():
    pipe = _pipe()
    diffusers_h3.enable_fast_vae_decode(pipe, FastVAEDecodeConfig(fp8_linears=True))  # "fastest" on an FP8 GPU
    with pytest.raises(ValueError, match=r"'exact' runs diffusers' own video decode.*already FP8"):
        pipe.enable_speed_preset(SpeedPresetConfig("exact", compile=False))
    assert getattr(pipe, "_h3_speed_preset", None) is None and not _quantized(pipe)  # nothing changed
    assert fast_vae_decode_state(pipe.vae) is not None
    pipe.enable_speed_preset(SpeedPresetConfig("fast", compile=False))
    assert fast_vae_decode_state(pipe.vae).fp8_linears and "already quantized: kept" in pipe._h3_speed_preset.decode


# -- the text encoder ------------------------------------------------------------------------------------------------


def _text_encoder_quantized(pipe):
    return [m for m in pipe.text_encoder.modules() if is_quantized_linear(m)]


def _prompt_embeds(pipe):
    embeds, _ = pipe.encode_prompt("a street drummer under neon lights")
    return embeds.float()


@pytest.mark.parametrize("preset", ["fast", "fastest"])
def test_fast_presets_quantize_the_text_encoder_to_w8a16(preset):
    pipe = _pipe()
    reference = _prompt_embeds(pipe)
    pipe.enable_speed_preset(SpeedPresetConfig(preset, compile=False))
    quantized = _text_encoder_quantized(pipe)
    assert quantized and all(m.weight.quant_method == "h3_w8a16" for m in quantized)
    decoder_linears = [name for name, m in pipe.text_encoder.named_modules()
                       if ".layers." in name and isinstance(m, torch.nn.Linear)]  # fmt: skip
    assert decoder_linears and all(
        is_quantized_linear(pipe.text_encoder.get_submodule(name)) for name in decoder_linears
    )
    assert "W8A16Config" in diffusers_h3.describe(pipe)["speed_preset"]["weights"]["text_encoder"]
    embeds = _prompt_embeds(pipe)
    rel = ((embeds - reference).norm() / reference.norm()).item()
    assert 0 < rel < 0.02, f"prompt embeddings moved by rel-L2 {rel} (0: the text encoder was not quantized)"


def test_quantize_text_encoder_false_keeps_it_as_loaded():
    pipe = _pipe()
    reference = _prompt_embeds(pipe)
    pipe.enable_speed_preset(SpeedPresetConfig("fastest", compile=False, quantize_text_encoder=False))
    assert _quantized(pipe) and not _text_encoder_quantized(pipe)
    assert "quantize_text_encoder=False" in diffusers_h3.describe(pipe)["speed_preset"]["weights"]["text_encoder"]
    assert torch.equal(_prompt_embeds(pipe), reference)


def test_exact_leaves_the_text_encoder_and_refuses_to_quantize_it():
    pipe = _pipe()
    with pytest.raises(ValueError, match=r"quantize_text_encoder=True: the 'exact' preset runs the text encoder as"):
        pipe.enable_speed_preset(SpeedPresetConfig("exact", compile=False, quantize_text_encoder=True))
    assert getattr(pipe, "_h3_speed_preset", None) is None
    pipe.enable_speed_preset(SpeedPresetConfig("exact", compile=False))
    assert not _text_encoder_quantized(pipe)
    assert "not quantized" in diffusers_h3.describe(pipe)["speed_preset"]["weights"]["text_encoder"]
    with pytest.raises(TypeError, match=r"quantize_text_encoder must be None \(automatic\), True or False"):
        pipe.enable_speed_preset(SpeedPresetConfig("fast", compile=False, quantize_text_encoder="yes"))
    assert not _quantized(pipe)  # nothing changed by the refused call
    without = _pipe()
    without.text_encoder = None
    with pytest.raises(ValueError, match=r"quantize_text_encoder=True: the pipeline has no text encoder"):
        without.enable_speed_preset(SpeedPresetConfig("fast", compile=False, quantize_text_encoder=True))
    assert not _quantized(without)
    # automatic: nothing to quantize, nothing recorded for it
    without.enable_speed_preset(SpeedPresetConfig("fast", compile=False))
    assert "text_encoder" not in diffusers_h3.describe(without)["speed_preset"]["weights"]


def test_a_text_encoder_loaded_quantized_is_kept():
    pipe = _pipe()
    diffusers_h3.quantize(pipe.text_encoder, diffusers_h3.W8A16Config())
    layers = _text_encoder_quantized(pipe)
    pipe.enable_speed_preset(SpeedPresetConfig("fast", compile=False))
    assert _text_encoder_quantized(pipe) == layers
    assert "already quantized: kept" in diffusers_h3.describe(pipe)["speed_preset"]["weights"]["text_encoder"]


def test_an_offloaded_text_encoder_is_left_as_placed():
    from accelerate.hooks import ModelHook, add_hook_to_module

    pipe = _pipe()
    add_hook_to_module(pipe.text_encoder, ModelHook())  # what enable_model_cpu_offload leaves on a component
    with pytest.raises(ValueError, match=r"the text encoder is offloaded .* cannot be quantized in place"):
        pipe.enable_speed_preset(SpeedPresetConfig("fast", compile=False, quantize_text_encoder=True))
    assert not _quantized(pipe)
    pipe.enable_speed_preset(SpeedPresetConfig("fast", compile=False))
    assert not _text_encoder_quantized(pipe)
    assert "offloaded (not quantized" in diffusers_h3.describe(pipe)["speed_preset"]["weights"]["text_encoder"]
