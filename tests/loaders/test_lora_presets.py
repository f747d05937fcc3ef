"""Step-distillation presets: detection from file names and metadata, overrides, and the pipeline schedule hook."""

from __future__ import annotations

import pytest

from diffusers_h3.loaders.lora_presets import (
    KNOWN_PRESETS,
    LoraDistillationPreset,
    detect_preset,
    get_preset,
    preset_from_file_name,
)

from ._lora_helpers import TinyLoraPipeline, canonical_lora, save_lora, tiny_transformer, write_layout


@pytest.mark.parametrize(
    "file_name, expected",
    [
        ("minimax_h3_fl2v_turbo_4step_v1.2_768p.safetensors", ("lightx2v-fl2v-turbo-4step-768p", 5, 6.0, 3.0)),
        ("minimax_h3_fl2v_turbo_4step_v1.0_768p_bf16.safetensors", ("lightx2v-fl2v-turbo-4step-768p", 5, 6.0, 3.0)),
        ("minimax_h3_fl2v_turbo_4step_v1.1.safetensors", ("lightx2v-fl2v-turbo-4step", 5, 12.0, 3.0)),
        ("sub/minimax_h3_fl2v_turbo_8step_v1.0.safetensors", ("lightx2v-fl2v-turbo-8step", 9, 12.0, 3.0)),
        ("minimax_h3_ref2v_turbo_4step_v1.0_768p.safetensors", ("lightx2v-ref2v-turbo-4step-768p", 5, 6.0, 3.0)),
        ("minimax_h3_ref2v_turbo_8step_v1.0.safetensors", ("lightx2v-ref2v-turbo-8step", 9, 12.0, 3.0)),
        ("my_style_lora.safetensors", None),
        (None, None),
    ],
)
def test_preset_from_file_name(file_name, expected):
    preset = preset_from_file_name(file_name)
    if expected is None:
        assert preset is None
    else:
        assert (preset.name, preset.num_inference_steps, preset.flow_shift, preset.audio_flow_shift) == expected
        assert preset.tasks == (("ref2va",) if "ref2v" in file_name else ("t2va", "fl2va"))


def test_metadata_overrides_and_validation():
    base = detect_preset("minimax_h3_fl2v_turbo_4step_v1.2_768p.safetensors", {"flow_shift": "5", "alpha": "8"})
    assert (base.num_inference_steps, base.flow_shift, base.audio_flow_shift) == (5, 5.0, 3.0)
    assert "metadata" in base.source
    only_meta = detect_preset("x.safetensors", {"num_denoising_steps": "6", "audio_shift": "2.5"})
    assert (only_meta.num_inference_steps, only_meta.flow_shift, only_meta.audio_flow_shift) == (7, None, 2.5)
    named = detect_preset(None, {"distillation_preset": "lightx2v-ref2v-turbo-8step"})
    assert named.num_inference_steps == 9 and named.tasks == ("ref2va",)
    assert detect_preset("x.safetensors", {"alpha": "8"}) is None
    with pytest.raises(ValueError, match="not a number"):
        detect_preset(None, {"flow_shift": "six"})
    with pytest.raises(ValueError, match="Known presets"):
        get_preset("turbo-3step")
    with pytest.raises(ValueError, match="sigma points"):
        LoraDistillationPreset("bad", num_inference_steps=1)
    assert set(KNOWN_PRESETS) >= {"lightx2v-fl2v-turbo-4step-768p", "lightx2v-fl2v-turbo-8step"}


def _pipe_with(tmp_path, file_name, metadata=None, **load_kwargs):
    model = tiny_transformer()
    pipe = TinyLoraPipeline(transformer=model)
    path = save_lora(tmp_path / file_name, write_layout(canonical_lora(model), "peft_dump"), metadata)
    report = pipe.load_lora_weights(path, adapter_name="turbo", **load_kwargs)
    return pipe, report


def test_schedule_hook_fills_from_the_active_preset(tmp_path, h3_logs):
    pipe, report = _pipe_with(tmp_path, "minimax_h3_fl2v_turbo_4step_v1.2_768p.safetensors", {"alpha": "4"})
    assert report.preset.name == "lightx2v-fl2v-turbo-4step-768p"
    assert "lightx2v-fl2v-turbo-4step-768p" in str(report)
    with h3_logs.expect_none():
        assert pipe._resolve_lora_schedule(None, None, None) == (5, 6.0, 3.0)
        assert pipe._resolve_lora_schedule(5, 6.0, None, task="fl2va") == (5, 6.0, 3.0)
    assert any("turbo" in line and "4step-768p" in line for line in pipe.lora_summary())


def test_schedule_hook_warns_on_settings_the_lora_was_not_trained_for(tmp_path, h3_logs):
    pipe, _ = _pipe_with(tmp_path, "minimax_h3_fl2v_turbo_8step_v1.0.safetensors")
    with h3_logs.expect(r"num_inference_steps=50 \(trained: 9\).*audio_flow_shift=4 \(trained: 3\)"):
        assert pipe._resolve_lora_schedule(50, None, 4.0) == (50, 12.0, 4.0)
    with h3_logs.expect(r"5 video sigmas \(trained: 9 sigma points\)"):
        pipe._resolve_lora_schedule(None, None, None, sigmas=[1.0, 0.8, 0.5, 0.2, 0.0])


def test_weights_stacking_disable_and_unload(tmp_path, h3_logs):
    pipe, _ = _pipe_with(tmp_path, "minimax_h3_fl2v_turbo_4step_v1.2_768p.safetensors")
    pipe.set_adapters("turbo", 0.5)
    with h3_logs.expect("weight 0.5"):
        pipe._resolve_lora_schedule(None, None, None)
    pipe.load_lora_weights(write_layout(canonical_lora(tiny_transformer(), seed=9), "diffusers"), "style")
    pipe.set_adapters(["turbo", "style"], [1.0, 0.7])
    with h3_logs.expect(r"together with \['style'\]"):
        assert pipe._resolve_lora_schedule(None, None, None) == (5, 6.0, 3.0)

    pipe.disable_lora()
    with h3_logs.expect_none():
        assert pipe._resolve_lora_schedule(None, None, None) == (None, None, None)
    pipe.enable_lora()
    pipe.delete_adapters("turbo")
    assert pipe.get_lora_distillation_presets() == {}
    assert pipe._resolve_lora_schedule(None, 7.0, None) == (None, 7.0, None)
    pipe.unload_lora_weights()
    assert pipe._resolve_lora_schedule(None, None, None) == (None, None, None)


def test_explicit_preset_arguments(tmp_path):
    custom = LoraDistillationPreset("my-6step", num_inference_steps=7, flow_shift=8.0, audio_flow_shift=3.0)
    pipe, report = _pipe_with(tmp_path, "minimax_h3_fl2v_turbo_4step_v1.2_768p.safetensors",
                              distillation_preset=custom)
    assert report.preset is custom
    assert pipe._resolve_lora_schedule(None, None, None) == (7, 8.0, 3.0)

    pipe, report = _pipe_with(tmp_path, "minimax_h3_fl2v_turbo_4step_v1.2_768p.safetensors", distillation_preset=None)
    assert report.preset is None
    assert pipe._resolve_lora_schedule(None, None, None) == (None, None, None)

    pipe, report = _pipe_with(tmp_path, "plain.safetensors", distillation_preset="lightx2v-fl2v-turbo-8step")
    assert report.preset.num_inference_steps == 9 and report.preset.source == "argument"
    with pytest.raises(ValueError, match="No adapter"):
        pipe.set_lora_distillation_preset("missing", None)
    with pytest.raises(TypeError, match="distillation_preset"):
        _pipe_with(tmp_path, "p2.safetensors", distillation_preset=42)


def test_no_lora_means_no_change(h3_logs):
    pipe = TinyLoraPipeline(transformer=tiny_transformer())
    with h3_logs.expect_none():
        assert pipe._resolve_lora_schedule(None, None, None) == (None, None, None)
        assert pipe._resolve_lora_schedule(50, 12.0, 3.0) == (50, 12.0, 3.0)


def test_ref2v_preset_loaded_into_transformer_ref(tmp_path, h3_logs):
    fl2v, ref = tiny_transformer(0), tiny_transformer(1)
    pipe = TinyLoraPipeline(transformer=fl2v, transformer_ref=ref)
    path = save_lora(tmp_path / "minimax_h3_ref2v_turbo_8step_v1.0.safetensors",
                     write_layout(canonical_lora(ref), "peft_dump"))
    report = pipe.load_lora_weights(path, "ref_turbo", load_into_transformer_ref=True)
    assert list(report.components) == ["transformer_ref"]
    # ref2va calls see it; t2va / fl2va calls (which run `transformer`) do not
    assert pipe._resolve_lora_schedule(None, None, None, task="ref2va") == (9, 12.0, 3.0)
    assert pipe._resolve_lora_schedule(None, None, None, task="t2va") == (None, None, None)

    # loading a ref2v adapter into the fl2v partition is flagged
    with h3_logs.expect("was trained for ref2va"):
        pipe.load_lora_weights(path, "wrong")
    with h3_logs.expect("trained for ref2va, not t2va"):
        assert pipe._resolve_lora_schedule(None, None, None, task="t2va") == (9, 12.0, 3.0)
