"""Import-time integration: folder classification by files, and `DiffusionPipeline.from_pretrained` dispatch."""

import inspect
import json
import os

import pytest
import torch
from diffusers import DiffusionPipeline, MiniMaxH3Transformer3DModel

import diffusers_h3
from diffusers_h3._integration import _is_h3_folder, install_diffusion_pipeline_dispatch
from diffusers_h3.pipelines.loading import NotAnH3CheckpointError, classify_checkpoint
from diffusers_h3.testing.tiny import save_hub_layout, tiny_components


@pytest.fixture(scope="module")
def components():
    return tiny_components(seed=5, with_transformer_ref=False)


@pytest.fixture(scope="module")
def ours(tmp_path_factory, components):
    directory = tmp_path_factory.mktemp("ours") / "pipe"
    diffusers_h3.MiniMaxH3Pipeline(**components).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def hub(tmp_path_factory, components):
    return save_hub_layout(components, tmp_path_factory.mktemp("hub") / "MiniMax-H3")


def _write(directory, name, content):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(json.dumps(content))
    return directory


def test_classifies_ours_and_hub(ours, hub, tmp_path):
    assert classify_checkpoint(ours) == "ours"
    assert classify_checkpoint(hub) == "hub"
    # Without its modular index, the hub layout's root index still names the modular H3 pipeline.
    root_only = _write(tmp_path / "root-only", "model_index.json", json.loads((hub / "model_index.json").read_text()))
    assert classify_checkpoint(root_only) == "hub"


def test_classifies_native_folders(tmp_path):
    native = _write(tmp_path / "FL2VA", "model_index.json", {"_class_name": "X", "_minimax_h3": {"partition": "fl2va"}})
    assert classify_checkpoint(native) == "native"
    repo = tmp_path / "repo"
    (repo / "Ref2VA").mkdir(parents=True)
    assert classify_checkpoint(repo) == "native"


def test_classifies_foreign_folders(tmp_path):
    sd = _write(tmp_path / "sd", "model_index.json", {"_class_name": "StableDiffusionPipeline"})
    assert classify_checkpoint(sd) == "foreign"
    modular = _write(tmp_path / "flux", "modular_model_index.json", {"_class_name": "FluxModularPipeline"})
    assert classify_checkpoint(modular) == "foreign"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert classify_checkpoint(empty) == "foreign"
    assert not _is_h3_folder(sd) and not _is_h3_folder(empty) and not _is_h3_folder(tmp_path / "missing")


def test_foreign_folder_goes_to_diffusers_unchanged(tmp_path):
    sd = _write(tmp_path / "sd", "model_index.json", {"_class_name": "StableDiffusionPipeline"})
    with pytest.raises(Exception) as error:
        DiffusionPipeline.from_pretrained(sd)
    assert not isinstance(error.value, NotAnH3CheckpointError)  # diffusers' own error, not ours
    with pytest.raises(NotAnH3CheckpointError, match="StableDiffusionPipeline"):
        diffusers_h3.MiniMaxH3Pipeline.from_pretrained(sd)


def test_native_folder_gets_our_explanation_through_diffusers(tmp_path):
    repo = tmp_path / "repo"
    (repo / "FL2VA").mkdir(parents=True)
    with pytest.raises(NotAnH3CheckpointError, match="native FL2VA/ / Ref2VA/ folders"):
        DiffusionPipeline.from_pretrained(repo)


def test_diffusion_pipeline_from_pretrained_loads_ours_and_hub(ours, hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for directory in (ours, hub):
        pipe = DiffusionPipeline.from_pretrained(directory)
        assert type(pipe) is diffusers_h3.MiniMaxH3Pipeline
        assert pipe.transformer is not None and pipe.transformer_ref is None


def test_dispatch_is_installed_once():
    import diffusers

    assert diffusers.MiniMaxH3Pipeline is diffusers_h3.MiniMaxH3Pipeline
    installed = DiffusionPipeline.from_pretrained.__func__
    assert installed._diffusers_h3_dispatch
    install_diffusion_pipeline_dispatch()
    assert DiffusionPipeline.from_pretrained.__func__ is installed


RUN = {"prompt": "x", "height": 32, "width": 32, "num_frames": 124, "num_inference_steps": 2, "output_type": "latent"}


def _latents(pipe):
    return pipe(**RUN, generator=torch.Generator().manual_seed(0))


def test_transformer_save_pretrained_keeps_diffusers_signature(components):
    # `DiffusionPipeline.save_pretrained` passes these on only when the component's signature names them.
    parameters = inspect.signature(components["transformer"].save_pretrained).parameters
    assert {"variant", "safe_serialization", "max_shard_size", "is_main_process"} <= set(parameters)


def test_serialization_with_variants_reaches_the_transformer(components, tmp_path):
    """On the model of diffusers' `test_serialization_with_variants` / `test_loading_with_variants`."""
    pipe = diffusers_h3.MiniMaxH3Pipeline(**components)
    pipe.save_pretrained(tmp_path, variant="fp16", safe_serialization=False)
    index = json.loads((tmp_path / "model_index.json").read_text())
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module):
            assert name in index and any(f.split(".")[1].startswith("fp16") for f in os.listdir(tmp_path / name)), name
    weights = sorted(f for f in os.listdir(tmp_path / "transformer") if f.startswith("diffusion_pytorch_model"))
    assert weights == ["diffusion_pytorch_model.fp16.bin"]  # the variant and the pickle format both reached the DiT
    assert (tmp_path / "transformer" / "README.md").is_file()  # and the card is still written

    reloaded = diffusers_h3.MiniMaxH3Pipeline.from_pretrained(tmp_path, variant="fp16")
    out, expected = _latents(reloaded), _latents(pipe)
    # Identical weights; CPU GEMMs may round differently for differently aligned buffers.
    assert torch.allclose(out.frames, expected.frames, atol=1e-5, rtol=0)
    assert torch.allclose(out.audio, expected.audio, atol=1e-5, rtol=0)


def test_max_shard_size_reaches_the_transformer(components, tmp_path):
    transformer = components["transformer"]
    pipe = diffusers_h3.MiniMaxH3Pipeline(**dict(components, text_encoder=None, vae=None, audio_vae=None))
    pipe.save_pretrained(tmp_path, max_shard_size="100KB")
    shards = [f for f in os.listdir(tmp_path / "transformer") if f.endswith(".safetensors")]
    assert len(shards) > 1 and (tmp_path / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    reloaded = MiniMaxH3Transformer3DModel.from_pretrained(tmp_path / "transformer")
    expected = transformer.state_dict()
    assert all(torch.equal(value, expected[name]) for name, value in reloaded.state_dict().items())
