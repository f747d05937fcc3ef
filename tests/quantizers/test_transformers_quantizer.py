"""The transformers quantizer on the tiny Qwen3-VL text encoder: quantize-on-load layer by layer, save / load round
trip (bit-exact, no re-quantization, quantization_config in config.json), checkpoints it cannot read fail in one line."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3VLForConditionalGeneration

from diffusers_h3.quantizers import check_checkpoint_quantization, is_quantized_linear, quantize, register_quantizers
from diffusers_h3.testing.tiny import tiny_text_encoder

from ._helpers import CONFIGS, WEIGHTS


register_quantizers()

IDS = torch.tensor([[1, 2, 3, 4, 5, 6]])


@pytest.fixture(scope="module")
def te_dense(tmp_path_factory):
    torch.manual_seed(0)
    model = tiny_text_encoder(num_hidden_layers=2, hidden_size=32)
    path = tmp_path_factory.mktemp("te_dense")
    model.save_pretrained(path)
    return model, path


def _hidden(model):
    with torch.no_grad():
        return model(input_ids=IDS, output_hidden_states=True).hidden_states[-1]


def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def assert_state_dicts_identical(a, b):
    sd, sd2 = a.state_dict(), b.state_dict()
    assert sd.keys() == sd2.keys()
    for key in sd:
        assert sd[key].dtype == sd2[key].dtype, key
        assert torch.equal(_bits(sd[key]), _bits(sd2[key])), key


@pytest.mark.parametrize("method", list(CONFIGS))
def test_quantizes_each_linear_as_its_weight_arrives(te_dense, method, monkeypatch):
    dense, path = te_dense
    materialized = []
    quantize_weight = WEIGHTS[method].pack

    def spy(dense, options):
        # one dense weight at a time, as it arrives
        materialized.append(dense.shape)
        return quantize_weight(dense, options)

    monkeypatch.setattr(WEIGHTS[method], "pack", spy)
    model = Qwen3VLForConditionalGeneration.from_pretrained(path, quantization_config=CONFIGS[method]())
    layers = [m for m in model.modules() if is_quantized_linear(m)]
    assert layers and all(type(m.weight) is WEIGHTS[method] for m in layers)
    assert len(materialized) == len(layers)
    monkeypatch.undo()
    # the same layers and bits as quantize() on the dense model
    reference = tiny_text_encoder(num_hidden_layers=2, hidden_size=32)
    reference.load_state_dict(dense.state_dict())
    assert_state_dicts_identical(quantize(reference, CONFIGS[method]()), model)


@pytest.mark.parametrize("method", list(CONFIGS))
def test_save_load_round_trip_is_bit_exact_without_requantizing(te_dense, tmp_path, method, monkeypatch):
    model = Qwen3VLForConditionalGeneration.from_pretrained(te_dense[1], quantization_config=CONFIGS[method]())
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["quant_method"] == f"h3_{method}"

    def no_requantize(*args, **kwargs):
        raise AssertionError("reload must not re-quantize")

    monkeypatch.setattr(WEIGHTS[method], "pack", no_requantize)
    reloaded = Qwen3VLForConditionalGeneration.from_pretrained(tmp_path)
    assert_state_dicts_identical(model, reloaded)
    assert torch.equal(_hidden(model), _hidden(reloaded))


def _saved_w8a16(te_dense, directory):
    model = Qwen3VLForConditionalGeneration.from_pretrained(te_dense[1], quantization_config=CONFIGS["w8a16"]())
    model.save_pretrained(directory)
    return directory / "config.json", directory / "model.safetensors"


def test_checkpoints_it_cannot_read_fail_in_one_line(te_dense, tmp_path):
    config_path, weights_path = _saved_w8a16(te_dense, tmp_path)
    config = json.loads(config_path.read_text())
    cases = []
    # another method's config over int8 codes: FP8 (same shape, other dtype), NVFP4 (other shape)
    for method in ("fp8", "nvfp4"):
        cases.append(({**config, "quantization_config": CONFIGS[method]().to_dict()}, None, "another method"))
    # a scale missing from the checkpoint
    tensors = load_file(weights_path)
    dropped = next(k for k in tensors if k.endswith(".weight_scale"))
    cases.append((config, {k: v for k, v in tensors.items() if k != dropped}, "missing from the checkpoint"))
    for config_dict, state, match in cases:
        config_path.write_text(json.dumps(config_dict))
        save_file(state if state is not None else tensors, weights_path, metadata={"format": "pt"})
        with pytest.raises(ValueError, match=match) as error:
            Qwen3VLForConditionalGeneration.from_pretrained(tmp_path)
        assert "\n" not in str(error.value)


def test_stripped_quantization_config_is_refused(te_dense, tmp_path):
    config_path, _ = _saved_w8a16(te_dense, tmp_path)
    check_checkpoint_quantization(tmp_path)  # the saved folder explains its tensors
    check_checkpoint_quantization(te_dense[1])  # a dense folder holds none
    config = json.loads(config_path.read_text())
    stripped = {k: v for k, v in config.items() if k != "quantization_config"}
    for bad, match in ((stripped, "has no quantization_config"), ({**config, "quantization_config": {"quant_method": "h3_int3"}}, "unknown here")):  # fmt: skip
        config_path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=match) as error:
            check_checkpoint_quantization(tmp_path)
        assert "\n" not in str(error.value) and "model.safetensors" in str(error.value)


def test_direct_transformers_load_of_a_stripped_folder_is_the_documented_gap(te_dense, tmp_path):
    """transformers picks its quantizer from the config alone and has no hook to inspect a checkpoint first: loaded
    with its own class, a folder that lost `quantization_config` gives float weights. docs/quantization.md says so
    in one place and names the check to run instead; if this load starts refusing, update that paragraph."""
    from pathlib import Path

    config_path, _ = _saved_w8a16(te_dense, tmp_path)
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({k: v for k, v in config.items() if k != "quantization_config"}))
    loaded = Qwen3VLForConditionalGeneration.from_pretrained(tmp_path)
    assert not any(is_quantized_linear(m) for m in loaded.modules())  # the gap: codes read as floats
    with pytest.raises(ValueError, match="has no quantization_config"):
        check_checkpoint_quantization(tmp_path)
    docs = " ".join((Path(__file__).resolve().parents[2] / "docs" / "quantization.md").read_text().split())
    assert "Not checked: a quantized component folder loaded with diffusers' or transformers' own classes." in docs
    assert "`diffusers_h3.quantizers.check_checkpoint_quantization(folder)`" in docs


@pytest.mark.gpu
@pytest.mark.parametrize("method", list(CONFIGS))
def test_quantize_on_load_and_round_trip_on_cuda(te_dense, tmp_path, method):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    kwargs = {"dtype": torch.bfloat16, "device_map": "cuda"}
    model = Qwen3VLForConditionalGeneration.from_pretrained(te_dense[1], quantization_config=CONFIGS[method](), **kwargs)
    layers = [m for m in model.modules() if is_quantized_linear(m)]
    assert layers and all(m.weight.is_cuda and m.weight.dtype == torch.bfloat16 for m in layers)
    model.save_pretrained(tmp_path)
    reloaded = Qwen3VLForConditionalGeneration.from_pretrained(tmp_path, **kwargs)
    assert_state_dicts_identical(model, reloaded)
    with torch.no_grad():
        ids = IDS.cuda()
        out = model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
        assert torch.equal(out, reloaded(input_ids=ids, output_hidden_states=True).hidden_states[-1])
