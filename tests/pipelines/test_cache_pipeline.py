"""diffusers' step caches (FirstBlockCache, MagCache, TaylorSeer) through `MiniMaxH3Pipeline.__call__`: they skip
steps (the output changes), compose with VSA and a quantizer, keep no state between requests, and are reported."""

from __future__ import annotations

import pytest
import torch

import diffusers_h3
from diffusers_h3 import W8A16Config
from diffusers_h3.hooks.cache import cache_config
from diffusers_h3.testing.tiny import TINY_NUM_FRAMES, tiny_pipeline


# 5 sigma points = 4 transformer forwards; latents only (the cache acts on the denoiser, the decoders are not needed).
RUN = {"height": 32, "width": 32, "num_frames": TINY_NUM_FRAMES, "num_inference_steps": 5, "output_type": "latent"}


def _pipe(cache=None):
    pipe = tiny_pipeline(seed=5, with_transformer_ref=False)
    pipe.set_progress_bar_config(disable=True)
    if cache is not None:
        pipe.transformer.enable_cache(cache)
    return pipe


def _call(pipe, prompt="a fox in snow", seed=0, **kwargs):
    out = pipe(prompt=prompt, **{**RUN, **kwargs}, generator=torch.Generator().manual_seed(seed))
    return out.frames


def _cache_report(pipe):
    return diffusers_h3.describe(pipe)["components"]["transformer"].get("cache")


# Per method: the config and the forwards it skips out of 4, derived from the hook's rule.
CASES = {
    # threshold far above any relative change: every step after the first reuses the tail residual.
    "first-block": (lambda: cache_config("first-block", threshold=1e9), [1, 2, 3]),
    # retention int(0.2 * 4 + 0.5) = 1 step computed; unit ratios accumulate no error; at most 3 skips in a row.
    "mag": (lambda: cache_config("mag", num_inference_steps=5, mag_ratios=[1.0] * 4), [1, 2, 3]),
    # steps 0-2 warm up; step 3 is not a refresh step ((3 - 3 - 1) % 5 != 0): the attention outputs are predicted.
    "taylorseer": (lambda: cache_config("taylorseer"), [3]),
    # The same schedule; the blocks are skipped and both outputs (video, audio) extrapolated.
    "taylorseer-lite": (lambda: cache_config("taylorseer-lite"), [3]),
}


@pytest.fixture(scope="module")
def uncached():
    return _call(_pipe())


@pytest.mark.parametrize("method", list(CASES))
def test_cache_skips_steps_through_the_pipeline_and_reports_them(method, uncached):
    make_config, skipped = CASES[method]
    pipe = _pipe(make_config())
    first = _call(pipe)
    assert torch.isfinite(first).all()
    assert not torch.allclose(first, uncached, atol=1e-5), "a skipped step must change the output"
    report = _cache_report(pipe)
    assert report["config"] == repr(pipe.transformer._cache_config)
    steps = ", ".join(map(str, skipped))
    assert report["last_request"] == f"skipped {len(skipped)} of 4 steps (steps {steps})"
    # No state leaks: the same request again gives the same output.
    assert torch.equal(_call(pipe), first)
    pipe.transformer.disable_cache()
    assert _cache_report(pipe) is None


def test_never_skipping_cache_equals_no_cache(uncached):
    """Sanity of the comparison above: a cache that never skips leaves the pipeline output unchanged."""
    pipe = _pipe(cache_config("first-block", threshold=0.0))
    assert torch.allclose(_call(pipe), uncached, rtol=0, atol=1e-6)
    assert _cache_report(pipe)["last_request"] == "skipped 0 of 4 steps (steps none)"


def test_no_state_leaks_between_the_clips_of_one_call():
    """Two identical clips in one call: the second must not start from the first one's cached residual."""
    pipe = _pipe(cache_config("first-block", threshold=1e9))
    both = pipe(
        prompt=["a fox in snow", "a fox in snow"], **RUN,
        generator=[torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)],
    ).frames  # fmt: skip
    assert torch.equal(both[0], both[1])
    assert _cache_report(pipe)["last_request"] == "skipped 3 of 4 steps (steps 1, 2, 3)"


def test_a_call_after_a_different_and_an_interrupted_call_equals_a_fresh_pipeline():
    config = CASES["first-block"][0]
    fresh = _call(_pipe(config()), prompt="waves", seed=3)
    pipe = _pipe(config())
    _call(pipe, prompt="a drummer under neon lights", seed=1)

    def stop(pipe, step, timestep, tensors):
        raise KeyboardInterrupt  # a request aborted mid-way leaves the hooks' state behind

    with pytest.raises(KeyboardInterrupt):
        _call(pipe, prompt="rain on a window", seed=2, callback_on_step_end=stop)
    assert torch.equal(_call(pipe, prompt="waves", seed=3), fresh)


def test_mag_cache_built_for_another_step_count_is_refused():
    pipe = _pipe(cache_config("mag", num_inference_steps=8, mag_ratios=[1.0] * 7))
    with pytest.raises(ValueError, match=r"configured for 7 transformer forwards but this request runs 4 .*"
                                         r"num_inference_steps=5"):  # fmt: skip
        _call(pipe)


def test_cache_composes_with_vsa_and_a_quantizer():
    def build(with_cache):
        pipe = _pipe()
        pipe.enable_vsa(sparsity=0.5, backend="torch")  # the reference kernels: fast on CPU, same selection
        diffusers_h3.quantize(pipe.transformer, W8A16Config())
        if with_cache:
            pipe.transformer.enable_cache(cache_config("first-block", threshold=1e9))
        return pipe

    # 3 sigma points = 2 forwards: step 1 is skipped.
    plain, cached = build(False), build(True)
    expected, got = _call(plain, num_inference_steps=3), _call(cached, num_inference_steps=3)
    assert torch.isfinite(got).all() and not torch.allclose(got, expected, atol=1e-5)
    transformer = diffusers_h3.describe(cached)["components"]["transformer"]
    assert transformer["cache"]["last_request"] == "skipped 1 of 2 steps (steps 1)"
    assert any("W8A16" in path for path in transformer["quantized_layers"])
    processors = [block.attn.processor for block in cached.transformer.transformer_blocks]
    assert any(p._last_sparse_kernel is not None for p in processors), "the sparse VSA path must have run"


def test_pipeline_reports_current_timestep_for_diffusers_attention_caches():
    """diffusers' pyramid attention broadcast and FasterCache read `pipe.current_timestep` (an AttributeError before
    the pipeline had it). On diffusers' flow-matching scale (1000 * sigma) their default skip ranges apply: at flow
    shift 1 the sigmas fall linearly, so the middle steps skip attention and the output changes."""
    from diffusers import FasterCacheConfig, PyramidAttentionBroadcastConfig

    run = {"num_inference_steps": 8, "flow_shift": 1.0}
    expected = _call(_pipe(), **run)
    for make_config in (PyramidAttentionBroadcastConfig, FasterCacheConfig):
        pipe, seen = _pipe(), []

        def timestep(pipe=pipe, seen=seen):
            seen.append(pipe.current_timestep)
            return pipe.current_timestep

        extra = {"is_guidance_distilled": True} if make_config is FasterCacheConfig else {}
        pipe.transformer.enable_cache(make_config(current_timestep_callback=timestep, **extra))
        assert pipe.current_timestep is None
        frames = _call(pipe, **run)
        assert pipe.current_timestep is None, "outside the loop there is no current timestep"
        assert seen[0] == 1000.0 and min(seen) < 300 and seen == sorted(seen, reverse=True), seen
        assert not torch.equal(frames, expected), f"{make_config.__name__} skipped no attention"


def test_taylorseer_profile_computes_twelve_of_the_fifty_step_requests_forwards():
    """The cache profiles' TaylorSeer computes forwards on a fixed schedule, not on the weights: of a 50-sigma-point
    request's 49 forwards it computes steps 0-2 and every 5th from 4 (12 in all). docs/speed.md predicts the profiles'
    request times from this count and the measured forward times."""
    from diffusers_h3.hooks.cache import cache_stats

    pipe = _pipe(cache_config("taylorseer"))
    _call(pipe, num_inference_steps=50)
    stats = cache_stats(pipe.transformer)
    computed = [step for step in range(stats.forwards) if step not in stats.skipped_steps]
    assert stats.forwards == 49 and computed == [0, 1, 2, 4, 9, 14, 19, 24, 29, 34, 39, 44]


@pytest.mark.parametrize("method", ["taylorseer", "taylorseer-lite"])
def test_taylorseer_factor_estimate_is_what_the_hooks_keep(method):
    """`taylorseer_factor_bytes` counts what diffusers' TaylorSeer hooks hold after a request (every cached output's
    Taylor factors), from the packed row count alone, before the first forward."""
    from diffusers.hooks.taylorseer_cache import _TAYLORSEER_CACHE_HOOK

    from diffusers_h3.hooks.cache import taylorseer_factor_bytes
    from diffusers_h3.layout import current_packed_layout

    pipe = _pipe(cache_config(method))
    rows, held = set(), []

    def factors_held(*args):  # after each forward, inside the request (the hooks' state is reset after it)
        total = 0
        for module in pipe.transformer.modules():
            registry = getattr(module, "_diffusers_hook", None)
            if registry is not None and _TAYLORSEER_CACHE_HOOK in registry.hooks:
                state = registry.hooks[_TAYLORSEER_CACHE_HOOK].state_manager.get_state()
                total += sum(f.numel() * f.element_size() for fs in state.taylor_factors.values() for f in fs.values())
        held.append(total)

    pipe.transformer.register_forward_pre_hook(lambda *args: rows.add(current_packed_layout().seq_len))
    pipe.transformer.register_forward_hook(factors_held)
    _call(pipe)
    assert len(rows) == 1 and len(held) == 4
    held = max(held)
    assert held > 0
    rows = rows.pop()
    assert taylorseer_factor_bytes(pipe.transformer, rows) == held
    if method == "taylorseer-lite":  # two outputs instead of every block's attention
        assert held < taylorseer_factor_bytes(_pipe(cache_config("taylorseer")).transformer, rows)
    assert taylorseer_factor_bytes(_pipe().transformer, 100) is None  # no TaylorSeer: nothing to count


def test_taylorseer_that_cannot_fit_is_refused_before_the_first_forward(monkeypatch):
    """When the factors alone exceed what the GPU has free the request stops in one line, before any forward; with
    room it runs."""
    import diffusers_h3.pipelines.pipeline_minimax_h3 as module
    from diffusers_h3.hooks.cache import CacheMemoryError

    pipe = _pipe(cache_config("taylorseer"))
    forwards = []
    pipe.transformer.register_forward_pre_hook(lambda *args: forwards.append(1))
    monkeypatch.setattr(module, "free_device_bytes", lambda device: 1000)
    with pytest.raises(CacheMemoryError, match=r"^TaylorSeer would keep [\d.]+ MiB of Taylor factors .*\(2 per cached "
                                                r"output of [\d,]+ rows\), more than the 0\.0 MiB it has free: "
                                                r"use a shorter clip") as error:  # fmt: skip
        _call(pipe)
    assert "\n" not in str(error.value) and forwards == []
    monkeypatch.setattr(module, "free_device_bytes", lambda device: 2**40)
    assert torch.isfinite(_call(pipe)).all() and forwards


def test_taylorseer_lite_extrapolates_the_audio_output_too():
    """`taylorseer-lite` hooks both outputs (diffusers' `use_lite_mode` only hooks `proj_out`, and is refused: H3's
    audio would be computed from skipped blocks)."""
    from diffusers.hooks import TaylorSeerCacheConfig
    from diffusers.hooks.taylorseer_cache import _TAYLORSEER_CACHE_HOOK

    pipe = _pipe(cache_config("taylorseer-lite"))
    hooked = [name for name, module in pipe.transformer.named_modules()
              if _TAYLORSEER_CACHE_HOOK in getattr(getattr(module, "_diffusers_hook", None), "hooks", {})]  # fmt: skip
    blocks = [f"transformer_blocks.{i}" for i in range(len(pipe.transformer.transformer_blocks))]
    assert sorted(hooked) == sorted([*blocks, "proj_out", "audio_proj_out"])
    lite = _pipe(TaylorSeerCacheConfig(cache_interval=5, disable_cache_before_step=3, use_lite_mode=True))
    with pytest.raises(ValueError, match=r"use_lite_mode=True\) extrapolates proj_out only.*'taylorseer-lite'"):
        _call(lite)


@pytest.mark.parametrize("method", ["first-block", "taylorseer-lite"])
def test_regionally_compiled_cache_compiles_nothing_after_its_first_requests(method):
    """The speed presets compile the blocks with the cache hooks in place. Skipped, predicted and recomputed steps each
    reach their own graphs once (the first request may compile more than its warm-up did); a later request of the
    same shape compiles nothing: no per-request recompiles from the hooks' state."""
    from torch._dynamo.utils import counters

    make_config = CASES[method][0]
    pipe = _pipe(make_config() if method != "first-block" else cache_config("first-block", threshold=0.5))
    pipe.transformer.compile_repeated_blocks(backend="eager", fullgraph=False)
    torch._dynamo.reset()
    try:
        compiled = []
        for _ in range(3):
            counters.clear()
            _call(pipe, num_inference_steps=7)
            compiled.append(counters["stats"]["unique_graphs"])
        assert compiled[0] > 0 and compiled[2] == 0, compiled
        assert diffusers_h3.describe(pipe)["components"]["transformer"]["cache"]["last_request"].startswith("skipped ")
    finally:
        torch._dynamo.reset()
