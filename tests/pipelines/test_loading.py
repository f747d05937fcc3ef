"""Loading: our own save layout, the official hub layout (offline, partition per task), DiffusionPipeline dispatch."""

import json

import pytest
import torch
from diffusers import DiffusionPipeline

import diffusers_h3
from diffusers_h3 import MiniMaxH3Pipeline
from diffusers_h3.pipelines.loading import NotAnH3CheckpointError
from diffusers_h3.testing.tiny import (
    HUB_REPO_ID,
    TINY_DURATION_LIMITS,
    TINY_NUM_FRAMES,
    save_hub_layout,
    tiny_components,
)


RUN = {"prompt": "x", "height": 32, "width": 32, "num_frames": TINY_NUM_FRAMES, "num_inference_steps": 2, "output_type": "latent"}


def _latents(pipe, seed=0):
    return pipe(**RUN, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def components():
    return tiny_components(seed=11)


@pytest.fixture(scope="module")
def hub_dir(tmp_path_factory, components):
    return save_hub_layout(components, tmp_path_factory.mktemp("hub") / "MiniMax-H3")


@pytest.fixture(scope="module")
def own_dir(tmp_path_factory, components):
    directory = tmp_path_factory.mktemp("own") / "pipe"
    MiniMaxH3Pipeline(**components, **TINY_DURATION_LIMITS).save_pretrained(directory)
    return directory


def test_import_registers_pipeline_with_diffusers():
    import diffusers

    assert diffusers.MiniMaxH3Pipeline is diffusers_h3.MiniMaxH3Pipeline


def test_save_pretrained_round_trip(own_dir, components):
    index = json.loads((own_dir / "model_index.json").read_text())
    assert index["_class_name"] == "MiniMaxH3Pipeline"
    assert index["text_encoder_layer"] == 50
    loaded = MiniMaxH3Pipeline.from_pretrained(own_dir)
    assert loaded.transformer is not None and loaded.transformer_ref is not None
    for name in ("text_encoder", "vae", "audio_vae", "transformer", "transformer_ref"):
        saved, reloaded_state = components[name].state_dict(), getattr(loaded, name).state_dict()
        assert saved.keys() == reloaded_state.keys()
        assert all(torch.equal(saved[k], reloaded_state[k]) for k in saved), f"{name} weights changed"
    original = _latents(MiniMaxH3Pipeline(**components, **TINY_DURATION_LIMITS))
    reloaded = _latents(loaded)
    # Weights are bit-identical; CPU GEMMs may round differently for differently aligned (mmapped) buffers.
    assert torch.allclose(original.frames, reloaded.frames, atol=1e-5, rtol=0)
    assert torch.allclose(original.audio, reloaded.audio, atol=1e-5, rtol=0)


def test_own_layout_task_loads_one_partition(own_dir):
    t2va = MiniMaxH3Pipeline.from_pretrained(own_dir, task="t2va")
    assert t2va.transformer is not None and t2va.transformer_ref is None
    ref = MiniMaxH3Pipeline.from_pretrained(own_dir, task="ref2va")
    assert ref.transformer is None and ref.transformer_ref is not None


def test_hub_layout_resolves_subfolders_locally_and_per_task(hub_dir, components, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    index = json.loads((hub_dir / "modular_model_index.json").read_text())
    assert index["transformer"][2]["pretrained_model_name_or_path"] == HUB_REPO_ID

    pipe = MiniMaxH3Pipeline.from_pretrained(hub_dir, task="fl2va")
    assert isinstance(pipe, MiniMaxH3Pipeline)
    assert pipe.transformer is not None and pipe.transformer_ref is None
    for name, param in components["transformer"].state_dict().items():
        assert torch.equal(pipe.transformer.state_dict()[name], param)

    ref = MiniMaxH3Pipeline.from_pretrained(hub_dir, task="ref2va")
    assert ref.transformer is None and ref.transformer_ref is not None
    both = MiniMaxH3Pipeline.from_pretrained(hub_dir)
    assert both.transformer is not None and both.transformer_ref is not None


def test_hub_layout_takes_the_pipeline_config_as_keyword_arguments(hub_dir, monkeypatch):
    """The hub layout stores no pipeline config: the defaults (5-15 s), or what `from_pretrained` is given."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    default = MiniMaxH3Pipeline.from_pretrained(hub_dir, task="t2va")
    assert (default.config.min_duration_s, default.config.max_duration_s) == (5.0, 15.0)
    short = MiniMaxH3Pipeline.from_pretrained(hub_dir, task="t2va", **TINY_DURATION_LIMITS)
    assert short.request_config().min_duration_s == TINY_DURATION_LIMITS["min_duration_s"]


@pytest.mark.parametrize("layout", ["own", "hub"])
def test_dtype_dict_per_component(layout, own_dir, hub_dir):
    directory = own_dir if layout == "own" else hub_dir
    dtype = {"transformer": torch.bfloat16, "default": torch.float16}
    pipe = MiniMaxH3Pipeline.from_pretrained(directory, task="t2va", dtype=dtype)
    assert pipe.transformer.dtype == torch.bfloat16
    assert pipe.text_encoder.dtype == pipe.vae.dtype == torch.float16  # (diffusers keeps the audio VAE's own rule)
    without_default = MiniMaxH3Pipeline.from_pretrained(directory, task="t2va", dtype={"vae": torch.float16})
    assert without_default.vae.dtype == torch.float16 and without_default.transformer.dtype == torch.float32


@pytest.mark.parametrize("layout", ["own", "hub"])
def test_torch_dtype_is_the_deprecated_alias_of_dtype(layout, own_dir, hub_dir):
    import warnings

    directory = own_dir if layout == "own" else hub_dir
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = MiniMaxH3Pipeline.from_pretrained(directory, task="t2va", dtype=torch.bfloat16)
    assert not [w for w in caught if "torch_dtype" in str(w.message)], "`dtype` itself must not warn"
    assert pipe.transformer.dtype == pipe.text_encoder.dtype == torch.bfloat16
    with pytest.warns(FutureWarning, match="torch_dtype"):
        old = MiniMaxH3Pipeline.from_pretrained(directory, task="t2va", torch_dtype=torch.bfloat16)
    assert old.transformer.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="both `dtype` and `torch_dtype`"):
        MiniMaxH3Pipeline.from_pretrained(directory, task="t2va", dtype=torch.float16, torch_dtype=torch.float16)


@pytest.mark.parametrize("layout", ["own", "hub"])
def test_device_map_cpu_and_unsupported_device_map(layout, own_dir, hub_dir):
    directory = own_dir if layout == "own" else hub_dir
    pipe = MiniMaxH3Pipeline.from_pretrained(directory, task="t2va", device_map="cpu")
    assert pipe.hf_device_map == "cpu" and pipe.transformer.device.type == "cpu"
    with pytest.raises(NotImplementedError, match="not supported"):  # diffusers' exception types, both layouts
        MiniMaxH3Pipeline.from_pretrained(directory, task="t2va", device_map="sideways")
    with pytest.raises(ValueError, match="`device_map` must be a string"):
        MiniMaxH3Pipeline.from_pretrained(directory, task="t2va", device_map={"": "cpu"})


def test_hub_layout_variant_files(tmp_path, components):
    directory = save_hub_layout(components, tmp_path / "variant")
    variant = tiny_components(seed=12)["transformer"]  # other weights, saved as the "v2" variant (in shards)
    variant.save_pretrained(directory / "transformer", variant="v2", max_shard_size="100KB")
    default = MiniMaxH3Pipeline.from_pretrained(directory, task="t2va")
    chosen = MiniMaxH3Pipeline.from_pretrained(directory, task="t2va", variant="v2")
    name, param = next(iter(variant.state_dict().items()))
    assert torch.equal(chosen.transformer.state_dict()[name], param)
    assert not torch.equal(default.transformer.state_dict()[name], param)
    vae_name, vae_param = next(iter(components["vae"].state_dict().items()))
    assert torch.equal(chosen.vae.state_dict()[vae_name], vae_param)  # components without the variant: default files


def test_diffusion_pipeline_from_pretrained_dispatches_both_layouts(hub_dir, own_dir):
    assert isinstance(DiffusionPipeline.from_pretrained(hub_dir), MiniMaxH3Pipeline)
    assert isinstance(DiffusionPipeline.from_pretrained(own_dir), MiniMaxH3Pipeline)


def test_missing_partition_for_task_is_a_clear_error(tmp_path, components):
    only_ref = dict(components, transformer=None)
    directory = save_hub_layout(only_ref, tmp_path / "ref-only")
    with pytest.raises(ValueError, match="needs the `transformer` partition"):
        MiniMaxH3Pipeline.from_pretrained(directory, task="t2va")
    pipe = MiniMaxH3Pipeline.from_pretrained(directory, task="ref2va")
    with pytest.raises(ValueError, match="runs on the `transformer` partition"):
        pipe(**RUN)


def test_native_folder_is_refused_with_explanation(tmp_path):
    native = tmp_path / "FL2VA"
    native.mkdir()
    (native / "model_index.json").write_text(
        json.dumps({"_class_name": "MiniMaxH3Pipeline", "_minimax_h3": {"partition": "fl2va"}})
    )
    with pytest.raises(NotAnH3CheckpointError, match="native MiniMax-H3 folder"):
        MiniMaxH3Pipeline.from_pretrained(native)
    with pytest.raises(NotAnH3CheckpointError, match="native MiniMax-H3 folder"):
        DiffusionPipeline.from_pretrained(native)


def test_other_checkpoint_is_refused(tmp_path):
    other = tmp_path / "sd"
    other.mkdir()
    (other / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    with pytest.raises(NotAnH3CheckpointError, match="StableDiffusionPipeline"):
        MiniMaxH3Pipeline.from_pretrained(other)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(NotAnH3CheckpointError, match="no model_index.json"):
        MiniMaxH3Pipeline.from_pretrained(empty)


def test_unknown_task_is_refused(own_dir):
    with pytest.raises(ValueError, match="`task` must be one of"):
        MiniMaxH3Pipeline.from_pretrained(own_dir, task="i2v")


@pytest.mark.parametrize("layout", ["own", "hub"])
def test_pipeline_quantization_config_covers_the_text_encoder(layout, own_dir, hub_dir):
    from diffusers.quantizers import PipelineQuantizationConfig

    from diffusers_h3 import W8A16Config
    from diffusers_h3.quantizers import is_quantized_linear

    directory = own_dir if layout == "own" else hub_dir
    config = PipelineQuantizationConfig(quant_mapping={"transformer": W8A16Config(), "text_encoder": W8A16Config()})
    limits = TINY_DURATION_LIMITS if layout == "hub" else {}  # the hub layout stores no pipeline config
    pipe = MiniMaxH3Pipeline.from_pretrained(directory, task="t2va", quantization_config=config, **limits)
    for name in ("transformer", "text_encoder"):
        quantized = [m for m in getattr(pipe, name).modules() if is_quantized_linear(m)]
        assert quantized and all(m.weight.quant_method == "h3_w8a16" for m in quantized), name
    out = _latents(pipe)
    assert torch.isfinite(out.frames).all()


@pytest.mark.parametrize("layout", ["ours", "hub"])
def test_truncated_text_encoder_weights_are_named(layout, own_dir, hub_dir, tmp_path):
    # transformers raises SafetensorError without the file's name; the DiT and VAE paths (diffusers) name it.
    import shutil

    directory = tmp_path / layout
    shutil.copytree(own_dir if layout == "ours" else hub_dir, directory)
    weights = sorted((directory / "text_encoder").glob("*.safetensors"))[0]
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(OSError, match=f"{weights}: truncated"):
        MiniMaxH3Pipeline.from_pretrained(directory)


def test_missing_folder_is_named_not_sent_to_the_hub(tmp_path, monkeypatch):
    """A path that does not exist said `HFValidationError: Repo id must be in the form ...`."""
    monkeypatch.chdir(tmp_path)
    for source in (str(tmp_path / "nowhere" / "ckpt"), "./missing_ckpt"):
        with pytest.raises(FileNotFoundError, match=r"no such folder \(.* does not exist\): check the path"):
            MiniMaxH3Pipeline.from_pretrained(source)
    (tmp_path / "file.json").write_text("{}")
    with pytest.raises(NotADirectoryError, match="is a file, not a checkpoint folder"):
        MiniMaxH3Pipeline.from_pretrained(tmp_path / "file.json")


@pytest.mark.parametrize("layout", ["own", "hub"])
@pytest.mark.parametrize("damage", ["index", "vae config", "missing vae", "missing tokenizer"])
def test_damaged_checkpoint_is_named_before_loading(layout, damage, own_dir, hub_dir, tmp_path):
    """A corrupt JSON file raised a JSONDecodeError without its name; a checkpoint without `vae/` said "no file named
    config.json found in directory <checkpoint>"; one without `tokenizer/` loaded without a tokenizer."""
    import shutil

    directory = shutil.copytree(own_dir if layout == "own" else hub_dir, tmp_path / "copy")
    index_name = "model_index.json" if layout == "own" else "modular_model_index.json"
    target, message = {
        "index": (directory / index_name, rf"{directory / index_name} is not valid JSON \(.*\): restore it"),
        "vae config": (directory / "vae" / "config.json", r"vae/config.json is not valid JSON"),
        "missing vae": (directory / "vae", r": vae/ is missing \(the index lists the `vae` component\)"),
        "missing tokenizer": (directory / "tokenizer", r": tokenizer/ is missing"),
    }[damage]
    if damage.startswith("missing"):
        shutil.rmtree(target)
    else:
        target.write_text("{not json")
    with pytest.raises(OSError, match=message) as error:
        MiniMaxH3Pipeline.from_pretrained(directory, task="t2va")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("dtype", ["potato", "bfloat16", {"default": torch.float32, "vae": "fp16"}])
def test_dtype_that_is_not_a_torch_dtype_is_refused(own_dir, dtype):
    """`dtype="potato"` loaded float32 without a word."""
    for name in ("dtype", "torch_dtype"):
        with pytest.raises(ValueError, match=rf"`{name}` must be a torch.dtype .* got '(potato|bfloat16|fp16)'"):
            MiniMaxH3Pipeline.from_pretrained(own_dir, **{name: dtype})
