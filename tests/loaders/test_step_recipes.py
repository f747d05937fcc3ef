"""One step-reduction recipe at a time: a distillation LoRA (LightX2V Turbo), a PDD Acc-LoRA or a FastH3 stack loaded
on top of another is refused in one line naming both, unless `allow_step_recipe_stacking=True`."""

from __future__ import annotations

import types

import pytest

from ._lora_helpers import TinyLoraPipeline, canonical_lora, save_lora, tiny_transformer, write_layout
from .test_pdd import FL2VA_FILE, METADATA, alibaba_state_dict


TURBO = "minimax_h3_fl2v_turbo_4step_v1.2_768p.safetensors"


def _turbo(tmp_path, model, seed=0, name=TURBO):
    reference = tiny_transformer(seed=1)  # the file is written from an unwrapped twin of `model`
    lora = canonical_lora(reference, seed=seed, skip=("proj_out",))
    return save_lora(tmp_path / name, write_layout(lora, "peft_dump"), {"alpha": "4"})


def _pdd(tmp_path, model):
    sd, _ = alibaba_state_dict(tiny_transformer(seed=1), seed=2)
    return save_lora(tmp_path / FL2VA_FILE, sd, METADATA)


def _adapters(pipe):
    return sorted({a for adapters in pipe.get_list_adapters().values() for a in adapters})


def test_turbo_then_pdd_and_pdd_then_turbo_are_refused_naming_both(tmp_path):
    pipe = TinyLoraPipeline(transformer=tiny_transformer(seed=1))
    pipe.load_lora_weights(_turbo(tmp_path, pipe.transformer), adapter_name="turbo")
    with pytest.raises(ValueError) as error:
        pipe.load_lora_weights(_pdd(tmp_path, pipe.transformer), adapter_name="pdd")
    message = str(error.value)
    assert "\n" not in message
    assert f"PDD Acc-LoRA {tmp_path / FL2VA_FILE}" in message
    assert "distillation LoRA 'turbo' (lightx2v-fl2v-turbo-4step-768p) on `transformer` is already loaded" in message
    assert "allow_step_recipe_stacking=True" in message
    assert _adapters(pipe) == ["turbo"]  # nothing of the PDD file loaded
    assert pipe.transformer.proj_out.weight.shape[0] == pipe.transformer.proj_out.out_features

    pipe.unload_lora_weights()
    pipe.load_lora_weights(_pdd(tmp_path, pipe.transformer), adapter_name="pdd")
    with pytest.raises(ValueError, match=r"distillation LoRA .*turbo_4step.* is a step-reduction recipe and PDD "
                                         r"Acc-LoRA 'pdd' \(pdd-acc-8step-fl2va\) on `transformer` is already loaded"):  # fmt: skip
        pipe.load_lora_weights(_turbo(tmp_path, pipe.transformer), adapter_name="turbo")
    assert _adapters(pipe) == ["pdd"]


def test_two_distillation_loras_are_refused_and_ordinary_loras_are_not(tmp_path):
    pipe = TinyLoraPipeline(transformer=tiny_transformer(seed=1))
    style = save_lora(tmp_path / "style.safetensors", write_layout(canonical_lora(pipe.transformer, seed=3), "diffusers"))
    pipe.load_lora_weights(style, adapter_name="style")
    pipe.load_lora_weights(_turbo(tmp_path, pipe.transformer), adapter_name="turbo")  # a style LoRA is no recipe
    pipe.load_lora_weights(style, adapter_name="style2")  # and neither on top of one
    eight = _turbo(tmp_path, pipe.transformer, seed=4, name="minimax_h3_fl2v_turbo_8step_v1.0.safetensors")
    with pytest.raises(ValueError, match="'turbo' .* is already loaded"):
        pipe.load_lora_weights(eight, adapter_name="eight")
    pipe.delete_adapters("turbo")
    pipe.load_lora_weights(eight, adapter_name="eight")  # the first one is gone
    assert _adapters(pipe) == ["eight", "style", "style2"]


def test_each_partition_has_its_own_recipe(tmp_path):
    pipe = TinyLoraPipeline(transformer=tiny_transformer(seed=1), transformer_ref=tiny_transformer(seed=1))
    ref_turbo = _turbo(tmp_path, pipe.transformer, name="minimax_h3_ref2v_turbo_8step_v1.0.safetensors")
    pipe.load_lora_weights(ref_turbo, adapter_name="ref", load_into_transformer_ref=True)
    pipe.load_lora_weights(_pdd(tmp_path, pipe.transformer), adapter_name="pdd")  # t2va / fl2va run `transformer`
    with pytest.raises(ValueError, match="'ref' .* on `transformer_ref` is already loaded"):
        pipe.load_lora_weights(ref_turbo, adapter_name="ref2", load_into_transformer_ref=True)


def test_opting_in_stacks_with_a_warning(tmp_path, h3_logs):
    pipe = TinyLoraPipeline(transformer=tiny_transformer(seed=1))
    pipe.load_lora_weights(_turbo(tmp_path, pipe.transformer), adapter_name="turbo")
    pipe.load_lora_weights(_pdd(tmp_path, pipe.transformer), adapter_name="pdd", allow_step_recipe_stacking=True)
    assert _adapters(pipe) == ["pdd", "turbo"]
    stacking = {r.getMessage() for r in h3_logs.caplog.records if "Stacking step recipes" in r.getMessage()}
    assert len(stacking) == 1 and "PDD Acc-LoRA" in stacking.pop()  # one warning, naming the file
    assert sorted(pipe.get_lora_distillation_presets()) == ["pdd", "turbo"]


def test_fasth3_preset_and_distillation_loras_exclude_each_other(tmp_path):
    from diffusers_h3 import enable_fasth3_preset
    from diffusers_h3.pipelines.fasth3 import disable_fasth3_preset
    from diffusers_h3.testing.tiny import tiny_pipeline

    pipe = tiny_pipeline(seed=0, with_transformer_ref=False)
    enable_fasth3_preset(pipe, "fasth3-4step-preview-dense")
    enable_fasth3_preset(pipe, "fasth3-4step-preview-dense")  # a FastH3 preset replaces the previous one
    turbo = _turbo(tmp_path, pipe.transformer)
    with pytest.raises(ValueError, match=r"is a step-reduction recipe and FastH3 stack \(fasth3-4step-preview-dense\) on `transformer`"):
        pipe.load_lora_weights(turbo, adapter_name="turbo")
    assert _adapters(pipe) == []
    pipe.load_lora_weights(turbo, adapter_name="turbo", allow_step_recipe_stacking=True)

    disable_fasth3_preset(pipe)
    with pytest.raises(ValueError, match="FastH3 preset fasth3-4step-preview-dense is a step-reduction recipe and "
                                         "distillation LoRA 'turbo'"):  # fmt: skip
        enable_fasth3_preset(pipe, "fasth3-4step-preview-dense")
    enable_fasth3_preset(pipe, "fasth3-4step-preview-dense", allow_step_recipe_stacking=True)


def test_cli_names_the_flag(tmp_path):
    from diffusers_h3 import cli

    pipe = TinyLoraPipeline(transformer=tiny_transformer(seed=1))
    pipe.load_lora_weights(_pdd(tmp_path, pipe.transformer), adapter_name="pdd")
    turbo = _turbo(tmp_path, pipe.transformer)
    args = types.SimpleNamespace(lora=turbo, lora_allow_unmatched=False, allow_step_recipe_stacking=False,
                                 lora_scale=None)  # fmt: skip
    with pytest.raises(cli.UsageError) as error:
        cli._load_lora(pipe, args)
    assert "already loaded" in str(error.value) and "--allow-step-recipe-stacking" in str(error.value)
    args.allow_step_recipe_stacking = True
    cli._load_lora(pipe, args)
    assert _adapters(pipe) == ["cli", "pdd"]
