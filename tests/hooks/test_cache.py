"""Diffusers' cache hooks run on H3's blocks, and a skipped step reuses the cached residual exactly as the hook defines."""

from __future__ import annotations

import pytest
import torch
from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

from diffusers_h3.hooks.cache import cache_config, register_cache_blocks
from diffusers_h3.testing.tiny import tiny_transformer, tiny_transformer_inputs


def _forward(model, inputs, step=None):
    if step is None:
        return model(**inputs, return_dict=False)
    with model.cache_context("cond", step_index=step, num_inference_steps=4):
        return model(**inputs, return_dict=False)


def _pair():
    torch.manual_seed(0)
    model = tiny_transformer(num_layers=3)
    reference = tiny_transformer(num_layers=3)
    reference.load_state_dict(model.state_dict())
    return model, reference


def test_first_block_cache_skip_reuses_the_tail_residual_of_the_previous_step():
    register_cache_blocks()
    model, reference = _pair()
    model.enable_cache(FirstBlockCacheConfig(threshold=1e9))  # every step after the first skips the tail blocks
    step0 = tiny_transformer_inputs(seed=1)
    step1 = {**step0, "hidden_states": step0["hidden_states"] * 0.9, "timestep": torch.tensor([0.6])}

    # Oracle on an uncached twin: record the first block's output and the last block's output at step 0.
    seen = {}
    first, last = reference.transformer_blocks[0], reference.transformer_blocks[-1]
    h_first = first.register_forward_hook(lambda m, a, out: seen.__setitem__("first", out.clone()))
    h_last = last.register_forward_hook(lambda m, a, out: seen.__setitem__("last", out.clone()))
    expected0 = _forward(reference, step0)
    tail_residual = seen["last"] - seen["first"]
    h_last.remove()
    # At step 1 the cached model runs the first block only and adds the step-0 tail residual to its output.
    h_last = last.register_forward_hook(lambda m, a, out: seen["first"] + tail_residual)
    expected1 = _forward(reference, step1)
    h_first.remove(), h_last.remove()

    got0 = _forward(model, step0, step=0)
    got1 = _forward(model, step1, step=1)
    for got, expected in ((got0, expected0), (got1, expected1)):
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=0, atol=1e-6)
    # The skip changed the result (the oracle is not the plain forward).
    plain1 = _forward(reference, step1)
    assert not torch.allclose(plain1[0], got1[0], atol=1e-4)


def test_first_block_cache_with_zero_threshold_never_skips():
    register_cache_blocks()
    model, reference = _pair()
    model.enable_cache(FirstBlockCacheConfig(threshold=0.0))
    for step in range(3):
        inputs = tiny_transformer_inputs(seed=10 + step)
        for g, e in zip(_forward(model, inputs, step=step), _forward(reference, inputs)):
            torch.testing.assert_close(g, e, rtol=0, atol=1e-6)


def test_mag_cache_and_taylorseer_enable_and_run_on_h3_blocks():
    register_cache_blocks()
    for config in (
        MagCacheConfig(threshold=0.06, num_inference_steps=4, calibrate=True),
        TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1, max_order=1),
    ):
        model, reference = _pair()
        model.enable_cache(config)
        outputs = [_forward(model, tiny_transformer_inputs(seed=20), step=s)[0] for s in range(4)]
        expected = _forward(reference, tiny_transformer_inputs(seed=20))[0]
        # The first step is always computed in full.
        torch.testing.assert_close(outputs[0], expected, rtol=0, atol=1e-6)
        assert all(torch.isfinite(o).all() for o in outputs)
        model.disable_cache()


def test_cache_config_choices_and_errors():
    assert isinstance(cache_config("first-block"), FirstBlockCacheConfig)
    assert cache_config("first-block", threshold=0.2).threshold == 0.2
    calibrating = cache_config("mag", num_inference_steps=8)
    assert calibrating.calibrate and calibrating.mag_ratios is None
    # The pipeline's num_inference_steps counts sigma points; MagCache counts transformer forwards (one fewer).
    assert calibrating.num_inference_steps == 7
    with pytest.raises(ValueError, match="num_inference_steps >= 2"):
        cache_config("mag", num_inference_steps=1)
    tuned = cache_config("mag", num_inference_steps=2, mag_ratios=[1.0, 0.9])
    assert not tuned.calibrate
    assert isinstance(cache_config("taylorseer"), TaylorSeerCacheConfig)
    with pytest.raises(ValueError, match="num_inference_steps"):
        cache_config("mag")
    with pytest.raises(ValueError, match="no threshold"):
        cache_config("taylorseer", threshold=0.1)
    for method in ("first-block", "mag"):
        for threshold in (float("nan"), float("inf"), -0.1):
            with pytest.raises(ValueError, match="the cache threshold must be a finite number >= 0"):
                cache_config(method, num_inference_steps=8, threshold=threshold)
    with pytest.raises(ValueError, match="unknown cache method 'teacache'"):
        cache_config("teacache")
