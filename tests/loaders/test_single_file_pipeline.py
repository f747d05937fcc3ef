"""Single-file DiTs inside the pipeline: `MiniMaxH3Pipeline.from_pretrained(folder, transformer=load_transformer_file(...))`
end to end on the tiny model, the speed presets, LoRA through PEFT on GGUF and fp8-scaled layers, `describe()`."""

from __future__ import annotations

import pytest
import torch

from diffusers_h3 import MiniMaxH3Pipeline, SpeedPresetConfig, describe, load_transformer_file
from diffusers_h3.loaders.single_file import is_gguf_linear
from diffusers_h3.quantizers import FP8Tensor, is_quantized_linear
from diffusers_h3.testing.single_file import (
    dense_reference,
    write_comfy_safetensors,
    write_fp8_scaled_safetensors,
    write_gguf,
)
from diffusers_h3.testing.tiny import TINY_NUM_FRAMES, TINY_TRANSFORMER_CONFIG, tiny_pipeline, tiny_transformer_inputs

from ._lora_helpers import TinyLoraPipeline, canonical_lora, save_lora, write_layout


pytest.importorskip("gguf")

TINY = dict(TINY_TRANSFORMER_CONFIG)
RUN = {"height": 32, "width": 32, "num_frames": TINY_NUM_FRAMES, "num_inference_steps": 2, "output_type": "latent"}


@pytest.fixture(scope="module")
def pipe():
    pipe = tiny_pipeline(with_transformer_ref=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def folder(pipe, tmp_path_factory):
    path = tmp_path_factory.mktemp("pipe")
    pipe.save_pretrained(path)
    return path


def _with_transformer(pipe, transformer):
    """The same components and config with another DiT (no reload; diffusers' `from_pipe` casts every component to
    one dtype, which a GGUF model refuses)."""
    import inspect

    settings = {n: pipe.config[n] for n in inspect.signature(MiniMaxH3Pipeline.__init__).parameters if n in pipe.config
                and not isinstance(pipe.config[n], (list, tuple))}  # fmt: skip
    return MiniMaxH3Pipeline(**{**pipe.components, **settings, "transformer": transformer})


def _latents(pipe):
    out = pipe(prompt="a fox in the snow", generator=torch.Generator().manual_seed(0), **RUN)
    return out.frames, out.audio


def _rel_l2(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _run(model):
    with torch.no_grad():
        return model(**tiny_transformer_inputs())[0]


def test_from_pretrained_with_a_bf16_file_is_bitwise_the_original(pipe, folder, tmp_path):
    path = tmp_path / "h3.safetensors"
    write_comfy_safetensors(pipe.transformer, path, dtype=torch.float32, prefix="model.diffusion_model.")
    loaded = MiniMaxH3Pipeline.from_pretrained(folder, task="t2va", transformer=load_transformer_file(path, folder))
    # The reference: the same folder with the original DiT object (both DiTs own their memory: CPU GEMM kernels are
    # chosen by the weights' alignment, and the folder's other components load alike in both).
    reference = MiniMaxH3Pipeline.from_pretrained(folder, task="t2va", transformer=pipe.transformer)
    for p in (loaded, reference):
        p.set_progress_bar_config(disable=True)
    (frames, audio), (want_frames, want_audio) = _latents(loaded), _latents(reference)
    assert torch.equal(frames, want_frames) and torch.equal(audio, want_audio)


@pytest.fixture(scope="module")
def gguf_file(pipe, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "h3-Q8_0.gguf"
    decoded = write_gguf(pipe.transformer, path, "Q8_0")
    return path, decoded


def test_pipeline_with_a_gguf_file_runs_like_its_dequantized_weights(pipe, gguf_file):
    path, decoded = gguf_file
    loaded = _with_transformer(pipe, load_transformer_file(path, TINY, dtype=torch.float32))
    (frames, audio), (want_frames, want_audio) = _latents(loaded), _latents(_with_transformer(pipe, dense_reference(TINY, decoded)))
    assert _rel_l2(frames, want_frames) < 1e-3 and _rel_l2(audio, want_audio) < 1e-3
    report = describe(loaded)["components"]["transformer"]
    assert report["quantization"] == "GGUFQuantizationConfig"
    assert "GGUF file h3-Q8_0.gguf (Q8_0 x" in report["checkpoint_file"]["format"]


def test_speed_presets_keep_the_files_weights(pipe, gguf_file, tmp_path):
    path, _ = gguf_file
    loaded = _with_transformer(pipe, load_transformer_file(path, TINY, dtype=torch.float32))
    gguf_layers = sum(map(is_gguf_linear, loaded.transformer.modules()))
    loaded.enable_speed_preset(SpeedPresetConfig("fast", compile=False))
    weights = describe(loaded)["speed_preset"]["weights"]["transformer"]
    assert "GGUF file h3-Q8_0.gguf" in weights and "[the file's weights: kept]" in weights
    assert sum(map(is_gguf_linear, loaded.transformer.modules())) == gguf_layers
    assert not any(is_quantized_linear(m) for m in loaded.transformer.modules())  # nothing quantized twice
    _latents(loaded)  # the preset's attention runs on the GGUF GEMMs
    loaded.enable_speed_preset(SpeedPresetConfig("exact", compile=False))
    assert "exact attention on the file's quantized weights" in describe(loaded)["speed_preset"]["weights"]["transformer"]
    # an fp8-scaled file is kept too, also where the preset would pick another format (CPU: W8A16)
    fp8 = tmp_path / "h3_fp8.safetensors"
    write_fp8_scaled_safetensors(pipe.transformer, fp8)
    loaded = _with_transformer(pipe, load_transformer_file(fp8, TINY, dtype=torch.float32))
    loaded.enable_speed_preset(SpeedPresetConfig("fast", compile=False))
    assert "fp8-scaled file h3_fp8.safetensors" in describe(loaded)["speed_preset"]["weights"]["transformer"]
    assert {m.weight.quant_method for m in loaded.transformer.modules() if is_quantized_linear(m)} == {"h3_fp8"}


def test_lora_on_gguf_layers_runs_unfused_and_refuses_to_fuse(gguf_file, tmp_path):
    path, decoded = gguf_file
    model = load_transformer_file(path, TINY, dtype=torch.float32)
    reference = dense_reference(TINY, decoded)
    lora = save_lora(tmp_path / "lora.safetensors", write_layout(canonical_lora(reference), "diffusers"))
    without = _run(reference)
    for target in (model, reference):
        TinyLoraPipeline(transformer=target).load_lora_weights(lora, adapter_name="x", network_alpha=4)
    assert is_gguf_linear(model.transformer_blocks[0].attn.to_q.base_layer)
    with_lora, want = _run(model), _run(reference)
    assert _rel_l2(want, without) > 0.1  # the LoRA changes the output ...
    assert _rel_l2(with_lora, want) < 1e-3  # ... and runs on the GGUF layers as on their dequantized weights
    with pytest.raises(ValueError, match=r"fuse_lora: \d+ of transformer's LoRA layers wrap GGUF layers") as error:
        TinyLoraPipeline(transformer=model).fuse_lora()
    assert "\n" not in str(error.value)
    assert torch.equal(_run(model), with_lora)  # refused before any layer changed


def test_lora_on_fp8_scaled_layers(pipe, tmp_path):
    path = tmp_path / "h3_fp8.safetensors"
    written = write_fp8_scaled_safetensors(pipe.transformer, path, dtype=torch.float32)
    model = load_transformer_file(path, TINY, dtype=torch.float32, fp8_backend="dequant")
    dequantized = {n: t.float() * written[n.replace(".weight", ".weight_scale")] if t.dtype == torch.float8_e4m3fn else t
                   for n, t in written.items() if not n.endswith((".weight_scale", ".comfy_quant"))}  # fmt: skip
    reference = dense_reference(TINY, dequantized)
    lora = save_lora(tmp_path / "lora.safetensors", write_layout(canonical_lora(reference), "diffusers"))
    for target in (model, reference):
        TinyLoraPipeline(transformer=target).load_lora_weights(lora, adapter_name="x", network_alpha=4)
    assert isinstance(getattr(model.transformer_blocks[0].attn.to_q.base_layer, "weight", None), FP8Tensor)
    unfused = _run(model)
    assert torch.equal(unfused, _run(reference))  # LoRA on the unquantized input, added to the FP8 layer's output
    codes = {n: b.clone() for n, b in model.state_dict().items() if b.dtype == torch.float8_e4m3fn}
    lora_pipe = TinyLoraPipeline(transformer=model)
    lora_pipe.fuse_lora()  # W + BA re-quantized to E4M3 with the layer's own scales
    assert _rel_l2(_run(model), unfused) < 0.05
    assert any(not torch.equal(b, codes[n]) for n, b in model.state_dict().items() if n in codes)
    lora_pipe.unfuse_lora()
    assert all(torch.equal(b, codes[n]) for n, b in model.state_dict().items() if n in codes)  # the file's codes, exactly
    assert _rel_l2(_run(model), unfused) < 1e-5  # (the dense layers' LoRA is subtracted in floating point)


def test_a_merged_turbo_fp8_file_runs_its_trained_schedule(pipe, tmp_path, h3_logs):
    """LightX2V's v1.1 768p fp8 file is the Turbo merged into an fp8-scaled DiT: loaded as the transformer, calls run
    its 4-step 768p schedule (5 sigma points, shifts 6 / 3) unless they set their own (kept, with one warning)."""
    path = tmp_path / "minimax_h3_fl2v_turbo_4step_v1.1_768p_fp8.safetensors"
    write_fp8_scaled_safetensors(pipe.transformer, path)
    loaded = _with_transformer(pipe, load_transformer_file(path, TINY, dtype=torch.float32))
    loaded.set_progress_bar_config(disable=True)
    plain = tmp_path / "h3_fp8.safetensors"
    write_fp8_scaled_safetensors(pipe.transformer, plain)
    other = _with_transformer(pipe, load_transformer_file(plain, TINY, dtype=torch.float32))
    other.set_progress_bar_config(disable=True)

    def sigmas(p, **call):
        p(prompt="a fox", generator=torch.Generator().manual_seed(0), **{**RUN, "num_inference_steps": None, **call})
        return p.scheduler.sigmas.tolist(), p.audio_scheduler.sigmas.tolist()

    trained = sigmas(other, num_inference_steps=5, flow_shift=6.0, audio_flow_shift=3.0)  # the schedule, by hand
    assert sigmas(loaded) == trained and len(trained[0]) == 5
    h3_logs.caplog.clear()
    assert len(sigmas(loaded, num_inference_steps=3)[0]) == 3  # an explicit count is kept, with one warning
    assert "transformer file minimax_h3_fl2v_turbo_4step_v1.1_768p_fp8.safetensors" in h3_logs.text
    assert sigmas(other, num_inference_steps=5) != trained  # a file without a known name: the pipeline's shifts


def test_a_turbo_lora_on_a_merged_turbo_file_is_refused(pipe, tmp_path):
    """The merged file is a step recipe already: a distillation LoRA on top is refused in one line naming both."""
    path = tmp_path / "minimax_h3_fl2v_turbo_4step_v1.1_768p_fp8.safetensors"
    write_fp8_scaled_safetensors(pipe.transformer, path)
    loaded = _with_transformer(pipe, load_transformer_file(path, TINY, dtype=torch.float32))
    lora = canonical_lora(loaded.transformer, seed=3)
    lora_path = save_lora(tmp_path / "minimax_h3_fl2v_turbo_8step_v1.0.safetensors", write_layout(lora, "peft_dump"))
    with pytest.raises(ValueError, match="transformer file minimax_h3_fl2v_turbo_4step_v1.1_768p_fp8.safetensors") as e:
        loaded.load_lora_weights(lora_path, "turbo8")
    assert "\n" not in str(e.value) and "alternatives" in str(e.value)
