"""The written LoRA in ComfyUI's layout is the same adapter as the diffusers file."""

import torch
from safetensors.torch import load_file


def _transformer_output(pipe):
    from diffusers_h3.testing.tiny import tiny_transformer_inputs

    inputs = tiny_transformer_inputs(seed=3)
    with torch.no_grad():
        video, audio = pipe.transformer(**inputs, return_dict=False)
    return torch.cat([video.flatten(), audio.flatten()])


def test_comfyui_file_loads_as_the_same_adapter(overfit_run, demo_model):
    from diffusers_h3.loaders.lora import detect_lora_layout
    from diffusers_h3.training.cache import _load_pipeline

    comfy = load_file(str(overfit_run.files["comfyui"]))
    assert all(key.startswith("diffusion_model.") for key in comfy)
    assert "ComfyUI" in detect_lora_layout(list(comfy))
    # reference names: fused qkv, mlp.fc1/fc2, blocks., token_refiner.blocks., final_layer outputs
    names = {key.rsplit(".lora_", 1)[0].rsplit(".alpha", 1)[0] for key in comfy}
    assert "diffusion_model.blocks.0.attn.qkv_proj" in names and "diffusion_model.blocks.1.mlp.fc1" in names
    assert "diffusion_model.token_refiner.blocks.0.attn.out_proj" in names
    assert "diffusion_model.final_layer.video_out" in names and "diffusion_model.final_layer.audio_out" in names

    outputs = {}
    for layout in ("diffusers", "comfyui"):
        pipe = _load_pipeline(demo_model, ("transformer",), "t2va", torch.float32, "cpu")
        report = pipe.load_lora_weights(str(overfit_run.files[layout]), adapter_name="trained")
        assert not report.unmatched_keys
        outputs[layout] = _transformer_output(pipe)
        pipe.transformer.disable_adapters()
        outputs["base"] = _transformer_output(pipe)
    change = (outputs["diffusers"] - outputs["base"]).norm()
    assert change > 1e-2 * outputs["base"].norm()  # the adapter does something
    assert torch.allclose(outputs["comfyui"], outputs["diffusers"], rtol=1e-4, atol=1e-5)


def test_comfyui_layout_round_trip_of_split_qkv_and_swiglu():
    """Unit check of the conversion against diffusers' own converter: the update B A of every module survives."""
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_minimax_h3_lora_to_diffusers

    from diffusers_h3.training.lora_files import to_comfyui_layout

    gen = torch.Generator().manual_seed(0)
    hidden, rank = 8, 2
    state, scales = {}, {}
    for module, out_features in (("transformer_blocks.0.attn.to_q", hidden), ("transformer_blocks.0.attn.to_k", hidden),
                                 ("transformer_blocks.0.attn.to_v", hidden), ("transformer_blocks.0.ff.net.0.proj", 2 * hidden),
                                 ("proj_out", 4)):  # fmt: skip
        state[f"{module}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen)
        state[f"{module}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen)
        scales[module] = 0.5
    back = _convert_non_diffusers_minimax_h3_lora_to_diffusers(to_comfyui_layout(state, scales))
    for module, scale in scales.items():
        want = scale * state[f"{module}.lora_B.weight"] @ state[f"{module}.lora_A.weight"]
        got = back[f"transformer.{module}.lora_B.weight"] @ back[f"transformer.{module}.lora_A.weight"]
        assert torch.allclose(got, want, atol=1e-5), module
