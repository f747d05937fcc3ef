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
from diffusers_h3.testing.tiny import TINY_DURATION_LIMITS, TINY_NUM_FRAMES, save_hub_layout, tiny_components


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


RUN = {"prompt": "x", "height": 32, "width": 32, "num_frames": TINY_NUM_FRAMES, "num_inference_steps": 2, "output_type": "latent"}


def _latents(pipe):
    return pipe(**RUN, generator=torch.Generator().manual_seed(0))


def test_pipeline_save_pretrained_shows_diffusers_parameters():
    """`inspect.signature(pipe.save_pretrained)` lists diffusers' parameters with their defaults, not `**kwargs`."""
    def described(method):
        return [(p.name, p.default, p.kind) for p in inspect.signature(method).parameters.values()]

    assert described(diffusers_h3.MiniMaxH3Pipeline.save_pretrained) == described(DiffusionPipeline.save_pretrained)


def test_serialization_with_variants_reaches_the_transformer(components, tmp_path):
    """On the model of diffusers' `test_serialization_with_variants` / `test_loading_with_variants`."""
    pipe = diffusers_h3.MiniMaxH3Pipeline(**components, **TINY_DURATION_LIMITS)
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


class _WeightDownload(Exception):
    """The stand-in hub stops where the weights would be downloaded."""


FOREIGN_INDEX = {"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"]}
H3_HUB_INDEX = {"_class_name": "MiniMaxH3ModularPipeline", "transformer": ["diffusers", "MiniMaxH3Transformer3DModel"]}
H3_OWN_INDEX = {"_class_name": "MiniMaxH3Pipeline", "transformer": ["diffusers", "MiniMaxH3Transformer3DModel"]}


@pytest.fixture
def stand_in_hub(monkeypatch, tmp_path):
    """An online hub without network: `repos[repo_id]` is its `model_index.json`; every call that would reach the hub
    is recorded in `calls` as `(function, repo_id, detail)`, and `snapshot_download` stops the load."""
    import huggingface_hub
    from diffusers.pipelines import pipeline_utils
    from huggingface_hub.errors import EntryNotFoundError

    repos, calls = {}, []
    files = {"unet": ["unet/config.json", "unet/diffusion_pytorch_model.safetensors"]}

    def hf_hub_download(repo_id, filename, **kwargs):
        calls.append(("hf_hub_download", repo_id, filename))
        if filename != "model_index.json":
            raise EntryNotFoundError(f"{repo_id} has no {filename}")
        path = tmp_path / "downloads" / repo_id / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(repos[repo_id]))
        return str(path)

    def model_info(repo_id, **kwargs):
        calls.append(("model_info", repo_id, None))
        names = ["model_index.json"] + [f for name in repos[repo_id] for f in files.get(name, [])]
        return type("Info", (), {"siblings": [type("Sibling", (), {"rfilename": n}) for n in names]})

    def resolve_revision(repo_id, revision=None, **kwargs):
        calls.append(("resolve_revision", repo_id, None))
        return revision

    def snapshot_download(repo_id, allow_patterns=None, **kwargs):
        calls.append(("snapshot_download", repo_id, tuple(sorted(allow_patterns or ()))))
        raise _WeightDownload

    for module in (pipeline_utils, huggingface_hub):
        monkeypatch.setattr(module, "hf_hub_download", hf_hub_download)
        monkeypatch.setattr(module, "snapshot_download", snapshot_download)
    monkeypatch.setattr(pipeline_utils, "model_info", model_info)
    monkeypatch.setattr(pipeline_utils, "_resolve_revision", resolve_revision)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    # The stand-in answers as the Hub would: its host resolves (this machine may have no DNS at all).
    monkeypatch.setattr("diffusers_h3.pipelines.loading._hub_reachable", lambda hub_kwargs: True)
    return repos, calls


def test_foreign_repo_id_costs_no_hub_call_beyond_diffusers(stand_in_hub):
    from diffusers_h3.pipelines.loading import _DIFFUSERS_FROM_PRETRAINED

    repos, calls = stand_in_hub
    repos["someone/sd"] = FOREIGN_INDEX
    with pytest.raises(_WeightDownload):
        _DIFFUSERS_FROM_PRETRAINED(DiffusionPipeline, "someone/sd")  # diffusers alone
    diffusers_calls = list(calls)
    calls.clear()
    with pytest.raises(_WeightDownload):
        DiffusionPipeline.from_pretrained("someone/sd")  # through the dispatch
    assert calls == diffusers_calls
    assert [c[0] for c in calls].count("hf_hub_download") == 1


@pytest.mark.parametrize("index", [H3_HUB_INDEX, H3_OWN_INDEX], ids=["hub", "ours"])
def test_h3_repo_id_is_recognised_from_the_index_diffusers_fetches(stand_in_hub, index):
    repos, calls = stand_in_hub
    repos["someone/h3"] = index
    with pytest.raises(_WeightDownload):
        DiffusionPipeline.from_pretrained("someone/h3")
    downloads = [c for c in calls if c[0] == "snapshot_download"]
    assert len(downloads) == 1  # diffusers stopped after reading the index; our loader picks the partitions
    assert "transformer/*" in downloads[0][2]


def test_h3_repo_id_from_the_cache_or_with_task_skips_diffusers(stand_in_hub, tmp_path):
    import huggingface_hub

    repos, calls = stand_in_hub
    repos["someone/h3"] = H3_HUB_INDEX
    with pytest.raises(_WeightDownload):
        DiffusionPipeline.from_pretrained("someone/h3", task="t2va")  # the caller asks for MiniMax-H3
    assert not [c for c in calls if c[0] in ("model_info", "resolve_revision")]  # diffusers' loader never ran

    calls.clear()
    cache = tmp_path / "cache"
    snapshot = cache / "models--someone--h3" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "model_index.json").write_text(json.dumps(H3_HUB_INDEX))
    (cache / "models--someone--h3" / "refs").mkdir()
    (cache / "models--someone--h3" / "refs" / "main").write_text("0" * 40)
    huggingface_hub.constants.HF_HUB_CACHE = str(cache)  # restored by the fixture's monkeypatch
    with pytest.raises(_WeightDownload):
        DiffusionPipeline.from_pretrained("someone/h3")
    assert not [c for c in calls if c[0] in ("model_info", "resolve_revision")]
    assert ("hf_hub_download", "someone/h3", "model_index.json") not in calls  # read from the cache


_UPSTREAM_PIPELINE_SCRIPT = """
import diffusers
from diffusers import DiffusionPipeline
from diffusers.hooks._helpers import TransformerBlockRegistry
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock
from diffusers.quantizers.auto import AUTO_QUANTIZER_MAPPING


class UpstreamMiniMaxH3Pipeline(DiffusionPipeline):
    pass


UpstreamMiniMaxH3Pipeline.__name__ = "MiniMaxH3Pipeline"
diffusers.MiniMaxH3Pipeline = UpstreamMiniMaxH3Pipeline
dispatch = DiffusionPipeline.from_pretrained.__func__

import diffusers_h3

assert diffusers.MiniMaxH3Pipeline is UpstreamMiniMaxH3Pipeline, "diffusers' own class keeps its name"
assert DiffusionPipeline.from_pretrained.__func__ is dispatch, "diffusers' own loader stays in place"
assert "h3_w8a16" in AUTO_QUANTIZER_MAPPING, "quantizers registered"
TransformerBlockRegistry.get(MiniMaxH3TransformerBlock)  # cache hooks registered (raises if not)
print("OK")
"""


def test_upstream_pipeline_class_keeps_its_name_and_the_plugin_still_registers(tmp_path):
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(
        [sys.executable, "-c", _UPSTREAM_PIPELINE_SCRIPT], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stderr[-2000:]
    warnings = [line for line in result.stderr.splitlines() if "ships its own MiniMaxH3Pipeline" in line]
    assert len(warnings) == 1 and "diffusers_h3.MiniMaxH3Pipeline" in warnings[0], result.stderr[-2000:]
