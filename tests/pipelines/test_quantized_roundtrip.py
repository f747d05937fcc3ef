"""A pipeline with a quantized text encoder and DiT saves and reloads bit-exact in both layouts (ours and the hub's);
`PipelineQuantizationConfig` in its global form quantizes both; a component whose quantized tensors its config.json
does not explain is refused in one line, before anything loads."""

import json
import shutil

import pytest
import torch
from diffusers.quantizers import PipelineQuantizationConfig

from diffusers_h3 import MiniMaxH3Pipeline, W8A16Config, W8A16Tensor, quantize
from diffusers_h3.quantizers import is_quantized_linear
from diffusers_h3.testing.tiny import TINY_DURATION_LIMITS, TINY_NUM_FRAMES, save_hub_layout, tiny_components


RUN = {"prompt": "x", "height": 32, "width": 32, "num_frames": TINY_NUM_FRAMES, "num_inference_steps": 2, "output_type": "latent"}
QUANTIZED = ("transformer", "text_encoder")


def _latents(pipe):
    return pipe(**RUN, generator=torch.Generator().manual_seed(0)).frames


def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The dense hub layout, then the W8A16 components (quantized with `quantize()`) in both layouts."""
    root = tmp_path_factory.mktemp("quantized")
    components = tiny_components(seed=5, text_encoder_layers=2, with_transformer_ref=False)
    save_hub_layout(components, root / "dense")
    for name in QUANTIZED:
        quantize(components[name], W8A16Config())
    MiniMaxH3Pipeline(**components, text_encoder_layer=1, **TINY_DURATION_LIMITS).save_pretrained(root / "own")
    save_hub_layout(components, root / "hub")
    reference = _latents(MiniMaxH3Pipeline(**components, text_encoder_layer=1, **TINY_DURATION_LIMITS))
    return {"own": root / "own", "hub": root / "hub", "dense": root / "dense"}, components, reference


def _load(directory, **kwargs):
    # the hub layout's index does not carry the pipeline's own options
    hub = (directory / "modular_model_index.json").is_file()
    return MiniMaxH3Pipeline.from_pretrained(directory, **kwargs, **({"text_encoder_layer": 1, **TINY_DURATION_LIMITS} if hub else {}))


@pytest.mark.parametrize("layout", ["own", "hub"])
def test_quantized_pipeline_round_trip_is_bit_exact(layout, saved):
    folders, quantized_components, reference = saved
    config = json.loads((folders[layout] / "text_encoder" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "h3_w8a16"
    pipe = _load(folders[layout])
    for name in QUANTIZED:
        original, reloaded = quantized_components[name].state_dict(), getattr(pipe, name).state_dict()
        assert original.keys() == reloaded.keys(), name
        for key, value in original.items():
            assert value.dtype == reloaded[key].dtype and torch.equal(_bits(value), _bits(reloaded[key])), key
        assert any(isinstance(getattr(m, "weight", None), W8A16Tensor) for m in getattr(pipe, name).modules()), name
    assert torch.equal(_latents(pipe), reference)


def test_global_pipeline_quantization_config_covers_the_text_encoder(saved):
    config = PipelineQuantizationConfig(
        quant_backend="h3_w8a16", quant_kwargs={"large_m_rows": 512}, components_to_quantize=list(QUANTIZED)
    )
    pipe = _load(saved[0]["dense"], quantization_config=config)
    for name in QUANTIZED:
        layers = [m for m in getattr(pipe, name).modules() if is_quantized_linear(m)]
        assert layers and all(type(m.weight) is W8A16Tensor and m.weight.options["large_m_rows"] == 512 for m in layers), name
    assert not any(is_quantized_linear(m) for m in pipe.vae.modules())


@pytest.mark.parametrize("component", QUANTIZED)
@pytest.mark.parametrize("layout", ["own", "hub"])
def test_stripped_quantization_config_is_refused_in_one_line(layout, component, saved, tmp_path):
    directory = shutil.copytree(saved[0][layout], tmp_path / layout)
    config_path = directory / component / "config.json"
    config = json.loads(config_path.read_text())
    del config["quantization_config"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="holds quantized tensors .* no quantization_config") as error:
        _load(directory)
    assert "\n" not in str(error.value)


def test_a_transformer_loaded_alone_with_a_stripped_config_is_refused_by_the_check(saved, tmp_path):
    """diffusers' own `from_pretrained` of a DiT alone is not patched: the documented check refuses the folder."""
    from diffusers import MiniMaxH3Transformer3DModel

    from diffusers_h3.quantizers import check_checkpoint_quantization

    directory = shutil.copytree(saved[0]["own"] / "transformer", tmp_path / "transformer")
    loaded = MiniMaxH3Transformer3DModel.from_pretrained(directory)  # intact: loads as saved
    assert isinstance(getattr(loaded.transformer_blocks[0].attn.to_q, "weight", None), W8A16Tensor)
    config = json.loads((directory / "config.json").read_text())
    del config["quantization_config"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="holds quantized tensors .* no quantization_config"):
        check_checkpoint_quantization(directory)
