"""Speed presets on a FastH3 stack: "fastest" runs VSA at the stack's trained sparsity (0.8 elsewhere), and the dense
presets say that they leave the trained gates unused."""

import logging

import pytest

from diffusers_h3 import SpeedPresetConfig, add_gate_compress, enable_fasth3_preset, enable_speed_preset, vsa_state
from diffusers_h3.testing.tiny import tiny_pipeline


@pytest.fixture
def stack():
    pipe = tiny_pipeline(seed=0, with_transformer_ref=False, text_encoder_layers=2, text_encoder_layer=1)
    add_gate_compress(pipe.transformer)
    return enable_fasth3_preset(pipe, "fasth3-4step-preview-vsa")


def test_fastest_keeps_the_stack_sparsity(stack):
    enable_speed_preset(stack, SpeedPresetConfig("fastest", compile=False))
    assert vsa_state(stack.transformer)["sparsity"] == 0.9
    assert "the FastH3 stack's trained sparsity" in stack._h3_speed_preset.attention["transformer"]
    plain = tiny_pipeline(seed=0, with_transformer_ref=False, text_encoder_layers=2, text_encoder_layer=1)
    enable_speed_preset(plain, SpeedPresetConfig("fastest", compile=False))
    assert vsa_state(plain.transformer)["sparsity"] == 0.8


@pytest.mark.parametrize("preset", ["exact", "fast"])
def test_dense_presets_say_the_gates_are_unused(stack, preset, caplog):
    with caplog.at_level(logging.WARNING):
        enable_speed_preset(stack, SpeedPresetConfig(preset, compile=False))
    assert "does not use the FastH3 stack's trained VSA gates" in caplog.text
