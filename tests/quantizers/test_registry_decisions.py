"""Decision of the format registry that must not flip: a config is resolved through its class hierarchy, so a
subclass of a registered config (a user's preset of FP8Config) is that format, and a registered subclass is its own
(the nearest registered class wins)."""

import torch
from torch import nn

from diffusers_h3.quantizers import FP8Config, W8A16Config, quantize
from diffusers_h3.quantizers.registry import format_for_config, register_format, unregister_format
from diffusers_h3.quantizers.tensors import FP8Tensor, W8A16Tensor


class _MyW8A16(W8A16Config):
    """A user's preset: the W8A16 format with its own defaults."""

    def __init__(self, **kwargs):
        super().__init__(group_size=64, **kwargs)


def test_subclass_of_a_registered_config_is_that_format():
    config = _MyW8A16()
    assert format_for_config(config).name == "w8a16"
    model = quantize(nn.Sequential(nn.Linear(64, 32)), config)
    assert type(model[0].weight) is W8A16Tensor and model[0].weight.options["group_size"] == 64


class _OwnFP8Config(FP8Config):
    pass


class _OwnFP8Linear(FP8Tensor):
    pass


def test_the_nearest_registered_class_wins():
    register_format(name="own_fp8", method="h3_test_own_fp8", config_cls=_OwnFP8Config, weight_cls=_OwnFP8Linear)
    try:
        assert format_for_config(_OwnFP8Config()).name == "own_fp8"
        assert format_for_config(FP8Config()).name == "fp8"
        torch.manual_seed(0)
        model = quantize(nn.Sequential(nn.Linear(32, 32)), _OwnFP8Config())
        assert type(model[0].weight) is _OwnFP8Linear
    finally:
        unregister_format("own_fp8")
