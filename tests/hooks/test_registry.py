"""One hook system: every behaviour diffusers_h3 attaches to a model is a named hook in the model's diffusers
`HookRegistry`, holding a record that `describe()` reads; `disable_*` removes it by name; per-request state is reset
through `reset_state`; nothing is attached as a torch hook, a `forward` swap or an `_h3_*` attribute."""

from __future__ import annotations

import pytest
import torch

import diffusers_h3
from diffusers_h3 import FastVAEDecodeConfig, V100ModeConfig
from diffusers_h3._hooks import (
    H3_CACHE_STATS_HOOK,
    H3_CALL_PLAN_HOOK,
    H3_CONTEXT_PARALLEL_HOOK,
    H3_FAST_VAE_DECODE_HOOK,
    H3_HOOK_NAMES,
    H3_LIGHT_VAE_HOOK,
    H3_REFINE_TEXT_ONCE_HOOK,
    H3_TENSOR_PARALLEL_HOOK,
    H3_TENSOR_PARALLEL_REDUCE_HOOK,
    H3_V100_MODE_HOOK,
    PARTITIONS,
    H3Hook,
    get_h3_hook,
    h3_record,
    h3_records,
    hooked_modules,
    moves_weights,
    partitions_of,
    register_h3_hook,
    remove_h3_hook,
    transformers_of,
)
from diffusers_h3.hooks.cache import CacheStatsHook, cache_config, cache_stats
from diffusers_h3.hooks.fast_vae_decode import fast_vae_decode_state
from diffusers_h3.hooks.refine_once import RefineTextOnceHook, refine_text_once
from diffusers_h3.hooks.v100_mode import v100_mode_of
from diffusers_h3.testing.tiny import TINY_NUM_FRAMES, tiny_pipeline, tiny_transformer, tiny_transformer_inputs


RUN = {"height": 32, "width": 32, "num_frames": TINY_NUM_FRAMES, "num_inference_steps": 3}
# Not modules (no hook registry): pipeline-wide records kept on the pipeline object.
PIPELINE_ATTRIBUTES_ALLOWED = {
    "_h3_speed_preset", "_diffusers_h3_placement", "_h3_lora_presets", "_h3_last_export", "_h3_fasth3",
}


def _call(pipe, output_type="latent"):
    return pipe(prompt="a fox", **RUN, output_type=output_type, generator=torch.Generator().manual_seed(0))


def _modules(pipe):
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            yield from component.named_modules()


def _torch_hooks(pipe):
    """Every torch forward (pre-)hook on the pipeline's modules (weight norm's own pre-hooks included)."""
    return {(name, id(hook)) for name, m in _modules(pipe)
            for hook in [*m._forward_pre_hooks.values(), *m._forward_hooks.values()]}  # fmt: skip


def _assert_nothing_outside_the_registry(pipe, baseline):
    added = _torch_hooks(pipe) - baseline
    assert not added, f"torch hooks attached outside the registry: {sorted(added)[:5]}"
    stamped = [(name, attr) for name, m in _modules(pipe) for attr in vars(m)
               if attr.startswith(("_h3_", "_diffusers_h3_"))]  # fmt: skip
    assert not stamped, f"attributes stamped on modules: {stamped[:5]}"
    on_pipe = {attr for attr in vars(pipe) if attr.startswith(("_h3_", "_diffusers_h3_"))}
    assert on_pipe <= PIPELINE_ATTRIBUTES_ALLOWED, on_pipe - PIPELINE_ATTRIBUTES_ALLOWED


@pytest.fixture
def pipe():
    pipe = tiny_pipeline(seed=3, with_transformer_ref=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_every_behaviour_is_a_named_registry_hook_and_describe_reads_the_records(pipe, monkeypatch):
    resets = []
    for cls in (CacheStatsHook, RefineTextOnceHook):
        original = cls.reset_state
        monkeypatch.setattr(cls, "reset_state", lambda self, m, _o=original, _c=cls: resets.append(_c) or _o(self, m))
    baseline = _torch_hooks(pipe)  # the models' own (weight norm) before anything is enabled
    refiner_runs = []
    probe = pipe.transformer.token_refiner.refiner_blocks[0].register_forward_hook(lambda *a: refiner_runs.append(1))

    pipe.enable_v100_mode(V100ModeConfig(attention="keep"))
    pipe.enable_fast_vae_decode(FastVAEDecodeConfig(batch_tiles=2))
    pipe.transformer.enable_cache(cache_config("first-block", threshold=1e9))
    _call(pipe, output_type="pt")

    transformer, vae = pipe.transformer, pipe.vae
    assert {H3_V100_MODE_HOOK, H3_CACHE_STATS_HOOK} <= set(h3_records(transformer))
    assert H3_FAST_VAE_DECODE_HOOK in h3_records(vae)
    linears = hooked_modules(transformer, H3_V100_MODE_HOOK)
    assert len(linears) > len(v100_mode_of(transformer).hooked_linears)  # the linears, the watches and the root
    assert get_h3_hook(transformer.token_refiner, H3_REFINE_TEXT_ONCE_HOOK) is None  # only during a request

    # reset_state ran at the start of the request (cache counter) and at its start and end (refiner once); the refiner
    # ran once for the request's 2 transformer forwards.
    assert resets.count(CacheStatsHook) == 1 and resets.count(RefineTextOnceHook) == 2
    refiner_blocks = len(transformer.token_refiner.refiner_blocks)
    assert len(refiner_runs) == 1 and refiner_blocks >= 1
    _call(pipe)
    assert resets.count(CacheStatsHook) == 2 and resets.count(RefineTextOnceHook) == 4
    assert len(refiner_runs) == 2

    report = diffusers_h3.describe(pipe)["components"]
    assert report["transformer"]["v100 mode"] == v100_mode_of(transformer).describe_path()
    assert report["transformer"]["cache"]["last_request"] == cache_stats(transformer).describe_path()
    assert report["transformer"]["hooks"][H3_V100_MODE_HOOK] == len(linears)
    assert report["vae"]["hooks"] == {H3_FAST_VAE_DECODE_HOOK: 1}
    fast_vae_decode_state(vae).last_run = "what the record says"
    assert diffusers_h3.describe(pipe)["components"]["vae"]["decode"].endswith("what the record says")

    probe.remove()
    _assert_nothing_outside_the_registry(pipe, baseline)

    transformer.disable_cache()
    _call(pipe)
    assert cache_stats(transformer) is None  # a request without a cache takes the counter off
    diffusers_h3.disable_v100_mode(pipe)  # the weights keep their fp16 / fp32 split
    diffusers_h3.disable_fast_vae_decode(pipe)
    assert not hooked_modules(transformer, H3_V100_MODE_HOOK) and v100_mode_of(transformer) is None
    assert fast_vae_decode_state(vae) is None and "_decode" not in vae.__dict__
    assert not any(h3_records(m) for _, m in _modules(pipe))
    _assert_nothing_outside_the_registry(pipe, baseline)


def test_tensor_parallel_and_offload_hooks_are_registry_hooks():
    from diffusers_h3.parallel.tensor_parallel import _apply_tensor_parallel, tensor_parallel_state

    model = tiny_transformer()
    _apply_tensor_parallel(model, rank=0, tp_degree=2, group=None, reduce_dtype=None)  # forward needs a group
    record = h3_record(model, H3_TENSOR_PARALLEL_HOOK)
    assert tensor_parallel_state(model) == record.as_dict() and record.tp_degree == 2
    owners = hooked_modules(model, H3_TENSOR_PARALLEL_REDUCE_HOOK)
    assert len(owners) == 2 * (len(model.transformer_blocks) + len(model.token_refiner.refiner_blocks))
    assert diffusers_h3.describe(model)["model"]["tensor parallel"] == record.as_dict()
    with pytest.raises(RuntimeError, match="load LoRA adapters before"):
        model.load_lora_adapter({})
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    remove_h3_hook(model, H3_TENSOR_PARALLEL_HOOK, recurse=False)
    assert "load_lora_adapter" not in model.__dict__  # removing the hook lifts the refusal


def test_context_parallel_record_is_read_from_its_hook():
    from diffusers_h3.parallel.context_parallel import (
        ContextParallelHook,
        ContextParallelRecord,
        context_parallel_state,
    )

    model = tiny_transformer()
    record = ContextParallelRecord(ulysses_degree=2, ring_degree=1, world_size=2, uneven_shards=True, backend="gloo")
    register_h3_hook(model, ContextParallelHook(record), H3_CONTEXT_PARALLEL_HOOK)
    assert context_parallel_state(model) == record.as_dict()
    assert diffusers_h3.describe(model)["model"]["context parallel"] == record.as_dict()
    assert remove_h3_hook(model, H3_CONTEXT_PARALLEL_HOOK) and context_parallel_state(model) is None


def test_helpers():
    model = tiny_transformer()
    with pytest.raises(ValueError, match="not one of diffusers_h3's hook names"):
        register_h3_hook(model, H3Hook(), "mine")
    register_h3_hook(model, H3Hook("record"), H3_CACHE_STATS_HOOK)
    with pytest.raises(ValueError, match="already exists"):
        register_h3_hook(model, H3Hook(), H3_CACHE_STATS_HOOK)
    assert h3_records(model) == {H3_CACHE_STATS_HOOK: "record"} and not moves_weights(model)
    assert remove_h3_hook(model, H3_CACHE_STATS_HOOK) and not remove_h3_hook(model, H3_CACHE_STATS_HOOK)
    assert moves_weights(model)  # an empty registry: the marker group offload leaves on a component
    assert len(set(H3_HOOK_NAMES)) == len(H3_HOOK_NAMES)

    class Pipe:
        transformer = model
        transformer_ref = None

    assert partitions_of(Pipe()) == [("transformer", model)] and partitions_of(model) == [("transformer", model)]
    assert transformers_of(Pipe(), "enable_x") == [model] and PARTITIONS == ("transformer", "transformer_ref")
    with pytest.raises(TypeError, match="enable_x expects a MiniMaxH3Transformer3DModel"):
        transformers_of(torch.nn.Linear(2, 2), "enable_x")


def test_refine_text_once_reuses_the_refiner_output_within_the_block():
    model = tiny_transformer().eval()
    inputs = tiny_transformer_inputs(seed=0)
    with torch.no_grad():
        reference = model(**inputs).sample
        with refine_text_once(model) as record:
            first, second = model(**inputs).sample, model(**inputs).sample
            assert record.runs == 1
    assert torch.equal(first, reference) and torch.equal(second, reference)
    assert get_h3_hook(model.token_refiner, H3_REFINE_TEXT_ONCE_HOOK) is None


def test_fasth3_paths_keep_their_records_in_registries(pipe):
    """A FastH3 preset (VSA through the trained gates, the trained schedule) and the light VAE's NVFP4 decoder: the
    VAE's record is a registry hook, the preset's a pipeline-wide record; nothing is stamped on a module."""
    from diffusers_h3.attention_processors import add_gate_compress
    from diffusers_h3.loaders.fasth3_vae import light_vae_record, load_nvfp4_decoder
    from diffusers_h3.pipelines.fasth3 import disable_fasth3_preset, enable_fasth3_preset, fasth3_record
    from diffusers_h3.testing.fasth3 import nvfp4_decoder_export

    baseline = _torch_hooks(pipe)
    add_gate_compress(pipe.transformer)
    enable_fasth3_preset(pipe, "fasth3-4step-preview-vsa")
    record = load_nvfp4_decoder(pipe.vae, nvfp4_decoder_export(pipe.vae, 1, seed=5))
    _call(pipe, output_type="pt")

    assert h3_record(pipe.vae, H3_LIGHT_VAE_HOOK) is record and light_vae_record(pipe.vae) is record
    assert H3_CALL_PLAN_HOOK in h3_records(pipe.transformer) and fasth3_record(pipe) is not None
    report = diffusers_h3.describe(pipe)
    assert report["components"]["vae"]["hooks"] == {H3_LIGHT_VAE_HOOK: 1}
    assert report["fasth3"]["light_vae"] == record.describe()
    _assert_nothing_outside_the_registry(pipe, baseline)
    disable_fasth3_preset(pipe)
    assert fasth3_record(pipe) is None and not any(a.startswith("_h3_fasth3") for a in vars(pipe))
