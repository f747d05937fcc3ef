"""`enable_v100_mode` options that the default-path tests do not tell apart: `detect_non_finite`, `activation_limit`
and `attention="keep"`, each against the default and against what the option defines."""

import warnings

import pytest
import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor

import diffusers_h3._utils as h3_utils
from diffusers_h3 import V100ModeConfig
from diffusers_h3.attention_processors.fa_v100 import MiniMaxH3FAV100Processor
from diffusers_h3.hooks.v100_mode import NonFiniteActivationError, enable_v100_mode, v100_mode_of

from .test_v100_mode import _inputs, _model, _run


@pytest.fixture(autouse=True)
def quiet_fallback_warnings(monkeypatch):
    monkeypatch.setattr(h3_utils, "_WARNED", set())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def test_detect_non_finite_off_lets_nan_through_silently():
    for detect in (True, False):
        model = _model(seed=3, hot=False)
        mode = v100_mode_of(enable_v100_mode(model, V100ModeConfig(attention="keep", detect_non_finite=detect)))
        with torch.no_grad():
            model.transformer_blocks[1].attn.to_v.weight[0, 0] = float("nan")
        if detect:
            with pytest.raises(NonFiniteActivationError):
                _run(model, _inputs())
        else:
            video, _ = _run(model, _inputs())
            assert not torch.isfinite(video).all()  # no check: the NaN reaches the output
            assert "non-finite detection off" in mode.describe_path()


@pytest.mark.parametrize("limit", [2048.0, 16.0])
def test_activation_limit_bounds_every_fp16_gemm_input(limit):
    model = _model(seed=2, hot=False)
    inputs = _inputs(seed=2)
    with torch.no_grad():
        model.transformer_blocks[0].norm2.weight.mul_(300)  # FFN inputs of a few hundred: above 16, below 2048
    fc_in = model.transformer_blocks[0].ff.net[0].proj
    raw, scaled = {}, {}
    fc_in.register_forward_pre_hook(lambda mod, args: raw.__setitem__("x", args[0].detach().float().clone()))

    class Probe(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            scaled["x"] = args[0].detach().float().clone()
            return args, kwargs

    # registered in the registry before V100 mode's hook, so inside it: sees the fp16 input the GEMM gets
    HookRegistry.check_if_exists_or_initialize(fc_in).register_hook(Probe(), "probe")
    enable_v100_mode(model, V100ModeConfig(attention="keep", activation_limit=limit))
    _run(model, inputs)
    x, y = raw["x"], scaled["x"]
    assert y.abs().max() <= limit
    # the option's definition: per row, divide by the smallest power of two (>= 1) that brings the row within limit
    amax = x.abs().amax(-1, keepdim=True)
    factor = torch.exp2(torch.clamp(torch.ceil(torch.log2(amax / limit)), min=0))
    torch.testing.assert_close(y, (x / factor).half().float(), atol=0, rtol=0)
    if limit == 16.0:
        assert (factor > 1).any()
    else:
        assert (factor == 1).all()


def test_attention_option_selects_the_processor():
    model = _model(seed=5, hot=False)
    enable_v100_mode(model)
    assert isinstance(model.transformer_blocks[0].attn.processor, MiniMaxH3FAV100Processor)
    kept = _model(seed=5, hot=False)
    enable_v100_mode(kept, V100ModeConfig(attention="keep"))
    assert type(kept.transformer_blocks[0].attn.processor) is MiniMaxH3AttnProcessor


def test_fp32_modules_keeps_the_named_module_in_fp32_and_only_it():
    default, extra = _model(seed=6, hot=False), _model(seed=6, hot=False)
    enable_v100_mode(default, V100ModeConfig(attention="keep"))
    mode = v100_mode_of(enable_v100_mode(extra, V100ModeConfig(attention="keep",
                                                               fp32_modules=["transformer_blocks.1.ff"])))  # fmt: skip
    assert default.transformer_blocks[1].ff.net[2].weight.dtype == torch.float16
    assert extra.transformer_blocks[1].ff.net[2].weight.dtype == torch.float32
    assert extra.transformer_blocks[0].ff.net[2].weight.dtype == torch.float16
    assert "transformer_blocks.1.ff" in mode.fp32_modules
    assert not any(name.startswith("transformer_blocks.1.ff") for name in mode.hooked_linears)
