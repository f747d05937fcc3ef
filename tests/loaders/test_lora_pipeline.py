"""End to end on the tiny MiniMaxH3Pipeline: a LoRA changes the output, unloading restores it exactly, a quantized
transformer takes the same LoRA, and a distillation LoRA sets the schedule of `pipe(...)`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ._lora_helpers import canonical_lora, save_lora, write_layout


CALL = {"prompt": "a fox in the snow", "height": 32, "width": 64, "num_frames": 22, "output_type": "latent"}  # no VAE decode: fast


@pytest.fixture(scope="module")
def pipe():
    from diffusers_h3.testing.tiny import tiny_pipeline

    return tiny_pipeline(seed=0, with_transformer_ref=False)


def _run(pipe, **kwargs):
    out = pipe(**{**CALL, "num_inference_steps": 3, **kwargs}, generator=torch.Generator().manual_seed(0))
    return out.frames.float().numpy(), out.audio.float().numpy()


def _lora_for(model, seed):
    from ._lora_helpers import tiny_transformer

    reference = tiny_transformer(**{k: model.config[k] for k in ("attention_head_dim", "num_attention_heads")})
    names = {n for n, _ in model.named_modules()}
    lora = canonical_lora(reference, seed=seed)
    assert set(lora) <= names, "the tiny pipeline's transformer config differs from the test's tiny transformer"
    return lora


def test_lora_changes_output_and_unload_restores_it(pipe, tmp_path):
    base_frames, base_audio = _run(pipe)
    lora = _lora_for(pipe.transformer, seed=50)
    report = pipe.load_lora_weights(save_lora(tmp_path / "l.safetensors", write_layout(lora, "native")), "style")
    assert report.num_matched_modules == len(lora)
    frames, audio = _run(pipe)
    assert np.abs(frames - base_frames).max() > 1e-4 or np.abs(audio - base_audio).max() > 1e-4

    pipe.set_adapters("style", 0.0)
    frames0, audio0 = _run(pipe)
    np.testing.assert_allclose(frames0, base_frames, atol=1e-6)
    pipe.unload_lora_weights()
    frames, audio = _run(pipe)
    np.testing.assert_array_equal(frames, base_frames)
    np.testing.assert_array_equal(audio, base_audio)


def test_distillation_lora_sets_the_schedule(pipe, tmp_path, h3_logs):
    lora = _lora_for(pipe.transformer, seed=51)
    path = save_lora(tmp_path / "minimax_h3_fl2v_turbo_4step_v1.2_768p.safetensors", write_layout(lora, "peft_dump"),
                     {"alpha": "4"})
    report = pipe.load_lora_weights(path, "turbo")
    try:
        assert report.preset.num_inference_steps == 5
        calls = []
        original = pipe.transformer.forward

        def counting_forward(*args, **kwargs):
            calls.append(1)
            return original(*args, **kwargs)

        pipe.transformer.forward = counting_forward
        try:
            with h3_logs.expect_none():
                pipe(**CALL, generator=torch.Generator().manual_seed(0))
        finally:
            del pipe.transformer.forward
        assert len(calls) == 4  # 5 sigma points -> 4 evaluations
        assert pipe.scheduler.shift == 6.0 and pipe.audio_scheduler.shift == 3.0
        with h3_logs.expect(r"num_inference_steps=3 \(trained: 5\)"):
            _run(pipe, num_inference_steps=3)
    finally:
        pipe.unload_lora_weights()


def test_lora_on_quantized_transformer_matches_dequantized_dense_end_to_end(pipe, tmp_path):
    import copy

    from diffusers_h3.quantizers import W8A16Config, is_quantized_linear, quantize

    original = pipe.transformer
    quantized, dense = copy.deepcopy(original), copy.deepcopy(original)
    quantize(quantized, W8A16Config())
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if is_quantized_linear(module):
                dense.get_submodule(name).weight.copy_(module.weight.dequantize(torch.float32))
    path = save_lora(tmp_path / "l.safetensors", write_layout(_lora_for(dense, seed=52), "ai_toolkit"))
    try:
        pipe.register_modules(transformer=quantized)
        base_q, _ = _run(pipe)
        report = pipe.load_lora_weights(path, "q")
        num_quantized = sum(is_quantized_linear(m) for m in quantized.modules())
        assert num_quantized > 10
        assert report.components["transformer"].quantized_modules == {"h3_w8a16": num_quantized}
        frames_q, audio_q = _run(pipe)
        assert np.abs(frames_q - base_q).max() > 1e-4

        pipe.register_modules(transformer=dense)
        pipe.load_lora_weights(path, "d")
        frames_d, audio_d = _run(pipe)
        np.testing.assert_allclose(frames_q, frames_d, atol=2e-4, rtol=1e-4)
        np.testing.assert_allclose(audio_q, audio_d, atol=2e-4, rtol=1e-4)
    finally:
        pipe.register_modules(transformer=original)


def test_non_finite_adapter_weights_are_refused_before_they_apply(pipe, tmp_path):
    """`set_adapters` with NaN or inf (a float, a list entry or a per-component dict value) is one `ValueError`;
    the adapter keeps its weight (a generation on NaN would only fail at export)."""
    lora = _lora_for(pipe.transformer, seed=51)
    pipe.load_lora_weights(save_lora(tmp_path / "l.safetensors", write_layout(lora, "native")), "style")
    try:
        pipe.set_adapters("style", 0.5)
        before = _run(pipe)
        for weights, where in ((float("nan"), "`adapter_weights`"), ([float("inf")], r"`adapter_weights\[0\]`"),
                               ({"transformer": float("-inf")}, r"`adapter_weights\['transformer'\]`")):  # fmt: skip
            with pytest.raises(ValueError, match=f"{where} is .*must be a finite number"):
                pipe.set_adapters("style", weights)
        after = _run(pipe)
        np.testing.assert_array_equal(after[0], before[0])
    finally:
        pipe.unload_lora_weights()


def test_a_file_that_is_not_a_lora_is_named_in_one_line(pipe, tmp_path):
    """A text file given as a LoRA: safetensors said "header too small" / "too large" without the file's name; a
    mistyped path went to the hub as a repo id (HFValidationError)."""
    for name in ("notes.safetensors", "notes.txt", "adapter.pt"):
        path = tmp_path / name
        path.write_text("these are my notes, not a LoRA\n")
        with pytest.raises(ValueError, match=rf"^{path} is not a (safetensors|torch.save) LoRA.*Pass a LoRA") as error:
            pipe.load_lora_weights(str(path))
        assert "\n" not in str(error.value)
    missing = tmp_path / "missing.safetensors"
    with pytest.raises(FileNotFoundError, match=rf"{missing}: no such LoRA file or folder"):
        pipe.load_lora_weights(str(missing))
