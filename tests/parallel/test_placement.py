"""Placement recipes on the CPU where Accelerate allows (cpu / disk maps, CPU group offload); GPU ones marked `gpu`."""

import pytest
import torch

from diffusers_h3.parallel.placement import (
    balanced_kwargs,
    drop_unused_text_encoder_layers,
    enable_low_memory_offload,
    single_gpu_resident_kwargs,
    split_transformer_kwargs,
)
from diffusers_h3.testing.tiny import tiny_pipeline, tiny_transformer, tiny_transformer_inputs


RUN = {"prompt": "a drum", "height": 32, "width": 32, "num_frames": 22, "num_inference_steps": 2}


def _forward(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out.sample, out.audio_sample


def test_split_transformer_over_cpu_and_disk_keeps_blocks_whole(tmp_path):
    from diffusers import MiniMaxH3Transformer3DModel

    torch.manual_seed(0)
    reference = tiny_transformer(num_layers=4)
    reference.save_pretrained(tmp_path / "transformer")
    size = sum(p.numel() * p.element_size() for p in reference.parameters())
    # Room on the "cpu" for about half the weights: the rest goes to disk.
    kwargs = split_transformer_kwargs({"cpu": int(size * 0.5)}, offload_folder=str(tmp_path / "offload"))
    model = MiniMaxH3Transformer3DModel.from_pretrained(tmp_path / "transformer", **kwargs).eval()

    device_map = model.hf_device_map
    assert set(device_map.values()) == {"cpu", "disk"}, device_map
    for name in device_map:  # no block is split between devices
        assert name.count(".") <= 1 or not name.startswith(("transformer_blocks.", "token_refiner.refiner_blocks.")), name
    inputs = tiny_transformer_inputs()
    for got, expected in zip(_forward(model, inputs), _forward(reference, inputs)):
        torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_low_memory_offload_runs_the_pipeline_and_keeps_weight_norm_whole():
    reference = tiny_pipeline(seed=2)
    expected = reference(**RUN, output_type="latent", generator=torch.Generator().manual_seed(0))

    pipe = tiny_pipeline(seed=2)
    placements = enable_low_memory_offload(pipe, "cpu")
    assert placements["transformer"].startswith("group offload")
    assert placements["text_encoder"].startswith("group offload")
    assert placements["audio_vae"] == "model offload"
    got = pipe(**RUN, output_type="latent", generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(got.frames, expected.frames, atol=0, rtol=0)
    torch.testing.assert_close(got.audio, expected.audio, atol=0, rtol=0)


def test_weight_norm_component_is_never_group_offloaded():
    pipe = tiny_pipeline(seed=2)
    pipe.register_modules(text_encoder=pipe.audio_vae)  # a weight-norm module where group offload would go
    placements = enable_low_memory_offload(pipe, "cpu")
    assert placements["text_encoder"] == "model offload (weight norm: no group offload)"


def test_recipe_arguments_are_checked():
    with pytest.raises(ValueError, match="choose one of"):
        single_gpu_resident_kwargs(transformer="int4")
    with pytest.raises(ValueError, match="max_memory"):
        balanced_kwargs({})
    config = single_gpu_resident_kwargs()["quantization_config"]
    assert type(config.quant_mapping["transformer"]).__name__ == "FP8Config"
    assert type(config.quant_mapping["text_encoder"]).__name__ == "W8A16Config"


@pytest.mark.gpu
def test_balanced_pipeline_over_two_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    from diffusers_h3 import MiniMaxH3Pipeline

    reference = tiny_pipeline(seed=2)
    reference.save_pretrained(tmp_path)
    expected = reference.to("cuda:0")(**RUN, output_type="latent", generator=torch.Generator().manual_seed(0))
    pipe = MiniMaxH3Pipeline.from_pretrained(tmp_path, **balanced_kwargs({0: "2GiB", 1: "2GiB"}))
    out = pipe(**RUN, output_type="latent", generator=torch.Generator().manual_seed(0))
    assert len({str(d) for d in pipe.hf_device_map.values()}) >= 1
    torch.testing.assert_close(out.frames.cpu(), expected.frames.cpu(), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out.audio.cpu(), expected.audio.cpu(), atol=1e-5, rtol=1e-4)


def _onloaded_during(monkeypatch, fn):
    """Ids of the tensors whose offload group was onloaded while ``fn()`` ran."""
    from diffusers.hooks.group_offloading import ModuleGroup

    onloaded, original = set(), ModuleGroup.onload_

    def spy(group):
        for module in group.modules:
            onloaded.update(id(t) for t in (*module.parameters(), *module.buffers()))
        onloaded.update(id(t) for t in (*group.parameters, *group.buffers))
        return original(group)

    monkeypatch.setattr(ModuleGroup, "onload_", spy)
    fn()
    return onloaded


def test_low_memory_offload_onloads_every_text_encoder_weight_the_prompt_encode_uses(monkeypatch):
    # The pipeline runs `text_encoder.model` up to the layer it reads (early exit), never the top-level forward, and
    # Qwen3-VL has no top-level block list: an offload group hooked only on the top module would never be onloaded
    # (the weights would stay on the CPU: a device error on a GPU).
    pipe = tiny_pipeline(seed=2)
    enable_low_memory_offload(pipe, "cpu", low_cpu_mem_usage=True)
    # a hook registry on the top module makes `_device_of` answer the execution device (also without streams, when
    # diffusers hooks only the leaves), not the CPU where the offloaded weights rest
    assert hasattr(pipe.text_encoder, "_diffusers_hook")
    onloaded = _onloaded_during(monkeypatch, lambda: pipe.encode_prompt("a drum"))
    language_model = pipe.text_encoder.model.language_model
    used = [language_model.embed_tokens, *language_model.layers[: pipe.config.text_encoder_layer]]
    missing = [name for module in used for name, t in module.named_parameters() if id(t) not in onloaded]
    assert not missing, missing[:5]


def test_low_cpu_mem_usage_reaches_the_offload_groups():
    from diffusers.hooks.group_offloading import _GROUP_OFFLOADING

    def groups(modules):
        hooks = [m._diffusers_hook.get_hook(_GROUP_OFFLOADING) for m in modules if hasattr(m, "_diffusers_hook")]
        return [h.group for h in hooks if h is not None and (h.group.modules or h.group.parameters)]

    for flag in (False, True):
        pipe = tiny_pipeline(seed=2)
        placements = enable_low_memory_offload(pipe, "cpu", low_cpu_mem_usage=flag)
        assert placements["transformer"].startswith("group offload (block level")
        assert placements["text_encoder"].startswith("group offload (leaf level")
        assert f"low_cpu_mem_usage={flag}" in placements["transformer"]
        assert f"low_cpu_mem_usage={flag}" in placements["text_encoder"]
        # diffusers' own group of the DiT's non-block modules never streams and ignores the flag; the blocks take it
        blocks = groups(pipe.transformer.transformer_blocks)
        leaves = groups(pipe.text_encoder.modules())
        assert len(blocks) == len(pipe.transformer.transformer_blocks) and len(leaves) > 10
        assert {g.low_cpu_mem_usage for g in blocks + leaves} == {flag}


def test_dropping_never_run_text_encoder_layers_keeps_outputs_and_is_reported():
    import diffusers_h3

    reference = tiny_pipeline(seed=3, text_encoder_layers=8, text_encoder_layer=5)
    expected = reference(**RUN, output_type="latent", generator=torch.Generator().manual_seed(0))

    pipe = tiny_pipeline(seed=3, text_encoder_layers=8, text_encoder_layer=5)
    before = sum(p.numel() for p in pipe.text_encoder.parameters())
    record = drop_unused_text_encoder_layers(pipe)
    assert record["kept_layers"] == 6 and record["removed_layers"] == 2 and record["freed_gib"] >= 0
    layers = pipe.text_encoder.model.language_model.layers
    assert len(layers) == 6 and pipe.text_encoder.config.text_config.num_hidden_layers == 6
    assert sum(p.numel() for p in pipe.text_encoder.parameters()) < before
    got = pipe(**RUN, output_type="latent", generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(got.frames, expected.frames, atol=0, rtol=0)
    torch.testing.assert_close(got.audio, expected.audio, atol=0, rtol=0)
    assert (
        "6 decoder layers kept, 2 never-run layers removed"
        in diffusers_h3.describe(pipe)["placement"]["text_encoder_layers"]
    )
    # a second call removes nothing more
    assert drop_unused_text_encoder_layers(pipe)["removed_layers"] == 0


def test_dropping_layers_needs_a_text_encoder():
    pipe = tiny_pipeline(seed=3)
    pipe.register_modules(text_encoder=None)
    with pytest.raises(ValueError, match="needs a pipeline with a text encoder"):
        drop_unused_text_encoder_layers(pipe)


def _stream_group(block, config=None):
    """A diffusers ModuleGroup on the stream path for `block` (a stand-in stream object drives that path on the
    CPU), hooked on `block` as group offloading hooks it; returns (group, config)."""
    from diffusers.hooks import HookRegistry
    from diffusers.hooks.group_offloading import (
        _GROUP_OFFLOADING,
        GroupOffloadingConfig,
        GroupOffloadingHook,
        ModuleGroup,
    )

    group = ModuleGroup(modules=[block], offload_device=torch.device("cpu"), onload_device=torch.device("cpu"),
                        offload_leader=block, onload_leader=block, stream=object(), record_stream=True,
                        low_cpu_mem_usage=True)  # fmt: skip
    config = config or GroupOffloadingConfig(
        onload_device=torch.device("cpu"), offload_device=torch.device("cpu"), offload_type="block_level",
        num_blocks_per_group=1, non_blocking=True, record_stream=True, low_cpu_mem_usage=True,
    )  # fmt: skip
    registry = HookRegistry.check_if_exists_or_initialize(block)
    if registry.get_hook(_GROUP_OFFLOADING) is not None:
        registry.remove_hook(_GROUP_OFFLOADING)
    registry.register_hook(GroupOffloadingHook(group, config=config), _GROUP_OFFLOADING)
    return group, config


def test_stream_offload_moves_quantized_weights_as_parameters():
    """A quantized layer's packed codes and scales live in its weight parameter, so diffusers' own stream path (onload:
    `param.data = moved`, offload: `param.data = cpu_param_dict[param]`) moves them: no fix of diffusers needed."""
    from diffusers_h3.quantizers import W8A16Config, quantize

    torch.manual_seed(0)
    block = quantize(torch.nn.Sequential(torch.nn.Linear(32, 16)), W8A16Config())[0]
    x = torch.randn(3, 32)
    expected = block(x)
    group, _ = _stream_group(block)
    host = group.cpu_param_dict[block.weight]
    assert type(host) is type(block.weight) and not block.weight.is_pinned()
    block.weight.data = block.weight.data.clone()  # what onloading leaves: other storage for the packed tensors
    assert block.weight.qdata.data_ptr() != host.qdata.data_ptr()
    group._offload_to_memory()  # diffusers' own offload
    assert block.weight.qdata.data_ptr() == host.qdata.data_ptr()
    assert block.weight.scale.data_ptr() == host.scale.data_ptr()
    group.record_stream = False  # no CUDA stream to record on here
    group._transfer_tensor_to_device(block.weight, host, None)  # diffusers' own onload of a parameter (CPU here)
    assert torch.equal(torch.nn.functional.linear(x, block.weight, block.bias), expected)  # (the hook is the group's)


def test_lora_into_a_transformer_split_onto_cpu_and_disk_is_refused_before_loading(tmp_path):
    """diffusers would turn the split into sequential CPU offload (and offloaded blocks hold no weights to adapt):
    one clear error, nothing loaded, the device map kept."""
    from diffusers import MiniMaxH3Transformer3DModel

    from ..loaders._lora_helpers import canonical_lora, save_lora, write_layout
    from ..loaders._lora_helpers import tiny_transformer as lora_transformer

    pipe = tiny_pipeline(seed=2, with_transformer_ref=False)
    pipe.transformer.save_pretrained(tmp_path / "transformer")
    size = sum(p.numel() * p.element_size() for p in pipe.transformer.parameters())
    kwargs = split_transformer_kwargs({"cpu": int(size * 0.5)}, offload_folder=str(tmp_path / "offload"))
    split = MiniMaxH3Transformer3DModel.from_pretrained(tmp_path / "transformer", **kwargs).eval()
    pipe.register_modules(transformer=split)
    device_map = dict(split.hf_device_map)
    config = {k: pipe.transformer.config[k] for k in ("attention_head_dim", "num_attention_heads")}
    lora = write_layout(canonical_lora(lora_transformer(**config), seed=7), "native")
    with pytest.raises(ValueError, match="offloads to the CPU or disk through its device map"):
        pipe.load_lora_weights(save_lora(tmp_path / "l.safetensors", lora), "style")
    assert split.hf_device_map == device_map and not getattr(split, "peft_config", None)


def test_lora_and_a_quantizer_in_the_low_memory_recipe_equal_the_plain_pipeline(tmp_path):
    """W8A16 + a LoRA under enable_low_memory_offload, the LoRA loaded before and after the offload is set up."""
    from diffusers_h3.quantizers import W8A16Config, quantize

    from ..loaders._lora_helpers import canonical_lora, save_lora, write_layout
    from ..loaders._lora_helpers import tiny_transformer as lora_transformer

    def build(lora_path=None):
        pipe = tiny_pipeline(seed=2, with_transformer_ref=False)
        quantize(pipe.transformer, W8A16Config())
        if lora_path:
            pipe.load_lora_weights(lora_path, "style")
        return pipe

    def run(pipe):
        return pipe(**RUN, output_type="latent", generator=torch.Generator().manual_seed(0))

    config = {k: build().transformer.config[k] for k in ("attention_head_dim", "num_attention_heads")}
    path = save_lora(tmp_path / "l.safetensors", write_layout(canonical_lora(lora_transformer(**config), seed=7), "native"))
    expected, without = run(build(path)), run(build())
    assert (expected.frames - without.frames).abs().max() > 1e-3  # the LoRA matters
    before = build(path)
    enable_low_memory_offload(before, "cpu")
    after = build()
    enable_low_memory_offload(after, "cpu")
    after.load_lora_weights(path, "style")  # diffusers rebuilds the offload groups around the load
    for pipe in (before, after):
        got = run(pipe)
        torch.testing.assert_close(got.frames, expected.frames, atol=0, rtol=0)
        torch.testing.assert_close(got.audio, expected.audio, atol=0, rtol=0)


@pytest.mark.gpu
def test_lora_into_a_transformer_split_over_two_gpus_keeps_the_map(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    from diffusers import MiniMaxH3Transformer3DModel

    from ..loaders._lora_helpers import canonical_lora, save_lora, write_layout
    from ..loaders._lora_helpers import tiny_transformer as lora_transformer

    pipe = tiny_pipeline(seed=2, with_transformer_ref=False)
    pipe.transformer.save_pretrained(tmp_path / "transformer")
    config = {k: pipe.transformer.config[k] for k in ("attention_head_dim", "num_attention_heads")}
    path = save_lora(tmp_path / "l.safetensors", write_layout(canonical_lora(lora_transformer(**config), seed=7), "native"))
    pipe.load_lora_weights(path, "style")
    expected = pipe.to("cuda:0")(**RUN, output_type="latent", generator=torch.Generator().manual_seed(0))

    size = sum(p.numel() * p.element_size() for p in pipe.transformer.parameters())
    kwargs = split_transformer_kwargs({0: int(size * 0.6), 1: int(size * 0.6)})
    split = MiniMaxH3Transformer3DModel.from_pretrained(tmp_path / "transformer", **kwargs).eval()
    pipe = tiny_pipeline(seed=2, with_transformer_ref=False).to("cuda:0")
    pipe.register_modules(transformer=split)
    device_map = dict(split.hf_device_map)
    assert len(set(device_map.values())) == 2, device_map
    pipe.load_lora_weights(path, "style")
    assert split.hf_device_map == device_map
    got = pipe(**RUN, output_type="latent", generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(got.frames.cpu(), expected.frames.cpu(), atol=1e-5, rtol=1e-4)
