"""Loading by hub repo id: an offline `huggingface_hub` cache holding the tiny official layout (and our own layout)
resolves, through `DiffusionPipeline` and `MiniMaxH3Pipeline`, to the same loader as the folder itself."""

import os

import huggingface_hub
import pytest
import torch
from diffusers import DiffusionPipeline

from diffusers_h3 import MiniMaxH3Pipeline
from diffusers_h3.pipelines.loading import NotAnH3CheckpointError
from diffusers_h3.testing.tiny import HUB_REPO_ID, save_to_hub_cache, tiny_components


RUN = {"prompt": "x", "height": 32, "width": 32, "num_frames": 124, "num_inference_steps": 2, "output_type": "latent"}
OWN_REPO_ID = "someone/h3-own-layout"
REVISION = "feedfacefeedfacefeedfacefeedfacefeedface"


def _latents(pipe):
    return pipe(**RUN, generator=torch.Generator().manual_seed(0))


def _assert_same_output(pipe, reference):
    out, expected = _latents(pipe), _latents(reference)
    # Identical weights; CPU GEMMs may round differently for differently aligned (mmapped) buffers.
    assert torch.allclose(out.frames, expected.frames, atol=1e-5, rtol=0)
    assert torch.allclose(out.audio, expected.audio, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def components():
    return tiny_components(seed=21)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, components):
    cache = tmp_path_factory.mktemp("hf-cache")
    snapshots = {
        "hub": save_to_hub_cache(components, cache, HUB_REPO_ID, revision=REVISION, layout="hub"),
        "ours": save_to_hub_cache(components, cache, OWN_REPO_ID, layout="ours"),
    }
    return cache, snapshots


@pytest.fixture
def offline(hub_cache, monkeypatch):
    """The cache as `HF_HUB_CACHE` in offline mode, for the environment and for the already imported hub library."""
    cache, snapshots = hub_cache
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return snapshots


def test_diffusion_pipeline_loads_hub_repo_id_like_its_folder(offline):
    pipe = DiffusionPipeline.from_pretrained(HUB_REPO_ID)
    assert type(pipe) is MiniMaxH3Pipeline
    assert pipe.transformer is not None and pipe.transformer_ref is not None
    _assert_same_output(pipe, MiniMaxH3Pipeline.from_pretrained(offline["hub"]))


def test_pipeline_loads_repo_id_per_task_like_its_folder(offline):
    pipe = MiniMaxH3Pipeline.from_pretrained(HUB_REPO_ID, task="t2va")
    assert pipe.transformer is not None and pipe.transformer_ref is None
    _assert_same_output(pipe, MiniMaxH3Pipeline.from_pretrained(offline["hub"], task="t2va"))
    ref = MiniMaxH3Pipeline.from_pretrained(HUB_REPO_ID, task="ref2va", revision=REVISION)
    assert ref.transformer is None and ref.transformer_ref is not None


def test_own_layout_repo_id_loads_through_both_entry_points(offline):
    reference = MiniMaxH3Pipeline.from_pretrained(offline["ours"], task="t2va")
    for pipe in (
        DiffusionPipeline.from_pretrained(OWN_REPO_ID, task="t2va"),
        MiniMaxH3Pipeline.from_pretrained(OWN_REPO_ID, task="t2va"),
    ):
        assert type(pipe) is MiniMaxH3Pipeline and pipe.transformer_ref is None
        _assert_same_output(pipe, reference)


def test_explicit_cache_dir_and_local_files_only(hub_cache, monkeypatch, tmp_path):
    cache, _ = hub_cache
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))  # an empty default cache
    pipe = MiniMaxH3Pipeline.from_pretrained(HUB_REPO_ID, task="t2va", cache_dir=str(cache), local_files_only=True)
    assert pipe.transformer is not None
    with pytest.raises(NotAnH3CheckpointError, match="neither a local folder nor a hub repo"):
        MiniMaxH3Pipeline.from_pretrained(HUB_REPO_ID, task="t2va", cache_dir=str(tmp_path), local_files_only=True)


def test_only_the_needed_partition_is_requested(offline, monkeypatch):
    requested = []
    original = huggingface_hub.snapshot_download

    def recording(repo_id, **kwargs):
        requested.append(kwargs.get("allow_patterns"))
        return original(repo_id, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording)
    MiniMaxH3Pipeline.from_pretrained(HUB_REPO_ID, task="t2va")
    MiniMaxH3Pipeline.from_pretrained(HUB_REPO_ID, task="ref2va")
    t2va, ref2va = (set(patterns) for patterns in requested)
    shared = {"text_encoder/*", "tokenizer/*", "processor/*", "vae/*", "audio_vae/*", "scheduler/*"}
    assert shared <= t2va and shared <= ref2va
    assert "README.md" in t2va  # the repo's card: the cards of what is saved from it take its license
    assert "transformer/*" in t2va and "transformer_ref/*" not in t2va
    assert "transformer_ref/*" in ref2va and "transformer/*" not in ref2va


def test_unknown_repo_id_goes_to_diffusers_and_gets_our_error_directly(offline):
    with pytest.raises(Exception) as error:
        DiffusionPipeline.from_pretrained("nobody/not-cached")
    assert not isinstance(error.value, NotAnH3CheckpointError)  # diffusers' own error
    with pytest.raises(NotAnH3CheckpointError, match="offline mode"):
        MiniMaxH3Pipeline.from_pretrained("nobody/not-cached")


# Options diffusers' `load_sub_model` forwards to the model components; the hub layout must forward the same.
FORWARDED = ("use_safetensors", "offload_state_dict", "offload_folder", "disable_mmap", "low_cpu_mem_usage", "variant")


def _record_from_pretrained(monkeypatch, model_class, calls):
    original = model_class.from_pretrained.__func__

    def recording(cls, *args, **kwargs):
        calls.append({k: v for k, v in kwargs.items() if k in FORWARDED and v is not None})
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(model_class, "from_pretrained", classmethod(recording))


def test_model_loading_options_reach_components_as_diffusers_forwards_them(offline, components, monkeypatch):
    calls = {"transformer": [], "text_encoder": []}
    for name in calls:
        _record_from_pretrained(monkeypatch, type(components[name]), calls[name])
    options = {"use_safetensors": True, "offload_state_dict": False, "disable_mmap": True, "low_cpu_mem_usage": True}
    passed = {k: components[k] for k in ("vae", "audio_vae", "tokenizer", "processor")}  # only the two models load
    for layout in ("ours", "hub"):  # "ours" loads through diffusers' own DiffusionPipeline.from_pretrained
        MiniMaxH3Pipeline.from_pretrained(offline[layout], task="t2va", **options, **passed)
    for name, (diffusers_kwargs, hub_kwargs) in calls.items():
        assert hub_kwargs == diffusers_kwargs, name
    assert calls["transformer"][0] == options


def test_missing_variant_is_refused_on_both_layouts_as_diffusers_does(offline):
    with pytest.raises(ValueError) as diffusers_error:
        MiniMaxH3Pipeline.from_pretrained(offline["ours"], task="t2va", variant="fp16")
    for source in (offline["hub"], HUB_REPO_ID):
        with pytest.raises(ValueError) as error:
            MiniMaxH3Pipeline.from_pretrained(source, task="t2va", variant="fp16")
        assert str(error.value) == str(diffusers_error.value)
    assert "variant=fp16" in str(diffusers_error.value)


@pytest.fixture
def no_network(hub_cache, monkeypatch):
    """Online mode on a machine whose network cannot resolve the Hub; any download attempt fails the test."""
    import socket

    cache, snapshots = hub_cache
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)

    def unresolvable(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", unresolvable)

    def download(repo_id, filename, local_files_only=False, **kwargs):
        assert local_files_only, f"a request for {repo_id}/{filename} went to the network"
        return original_download(repo_id, filename, local_files_only=True, **kwargs)

    def snapshot(repo_id, local_files_only=False, **kwargs):
        assert local_files_only, f"a snapshot of {repo_id} was requested from the network"
        return original_snapshot(repo_id, local_files_only=True, **kwargs)

    original_download, original_snapshot = huggingface_hub.hf_hub_download, huggingface_hub.snapshot_download
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    return snapshots


def test_unreachable_hub_fails_fast_naming_the_network(no_network):
    """Without a network a repo id retried for close to a minute, then suggested passing the very id passed."""
    import time

    start = time.perf_counter()
    with pytest.raises(OSError, match=r"'nobody/not-cached': cannot reach the Hugging Face Hub \(the network cannot "
                                      r"resolve huggingface.co\) and the local cache .* check the network") as error:
        MiniMaxH3Pipeline.from_pretrained("nobody/not-cached")
    assert time.perf_counter() - start < 5 and "\n" not in str(error.value)


def test_unreachable_hub_loads_a_cached_repo_with_a_warning(no_network, h3_logs):
    with h3_logs.expect(r"Cannot reach the Hugging Face Hub .* from the local cache"):
        pipe = MiniMaxH3Pipeline.from_pretrained(HUB_REPO_ID, task="t2va", revision=REVISION)
    assert pipe.transformer is not None


@pytest.fixture
def hub_kernels_unreachable(monkeypatch):
    """transformers' default as a user gets it (no `USE_HUB_KERNELS` set) with Hub kernels that cannot be fetched, as
    offline on CUDA: every `kernelize` is recorded and fails."""
    import transformers.modeling_utils

    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    calls = []

    def unreachable(model, **kwargs):
        calls.append(type(model).__name__)
        raise OSError("cannot reach the Hub to fetch kernels (offline)")

    monkeypatch.setattr(transformers.modeling_utils, "kernelize", unreachable)
    return calls


@pytest.mark.parametrize("layout", ["hub", "ours"])
def test_offline_load_does_not_fetch_hub_kernels(offline, hub_kernels_unreachable, layout):
    repo_id = HUB_REPO_ID if layout == "hub" else OWN_REPO_ID
    pipe = MiniMaxH3Pipeline.from_pretrained(repo_id, task="t2va")
    assert hub_kernels_unreachable == []
    assert pipe.text_encoder.use_kernels is False
    assert "USE_HUB_KERNELS" not in os.environ  # the load's scope is restored


def test_use_kernels_true_asks_transformers_for_hub_kernels(offline, hub_kernels_unreachable):
    pytest.importorskip("kernels", reason="transformers refuses use_kernels=True without the kernels package")
    with pytest.raises(OSError, match="fetch kernels"):
        MiniMaxH3Pipeline.from_pretrained(HUB_REPO_ID, task="t2va", use_kernels=True)
    assert hub_kernels_unreachable and "USE_HUB_KERNELS" not in os.environ


def test_use_kernels_must_be_a_bool(offline):
    with pytest.raises(TypeError, match="use_kernels must be True or False"):
        MiniMaxH3Pipeline.from_pretrained(HUB_REPO_ID, task="t2va", use_kernels="yes")


def test_recipe_loader_text_encoder_does_not_fetch_hub_kernels(offline, hub_kernels_unreachable):
    from pathlib import Path

    from diffusers_h3.pipelines.recipe_loading import _load_text_encoder_alone

    model = _load_text_encoder_alone(Path(offline["ours"]), None, torch.float32, 2)
    assert hub_kernels_unreachable == [] and model.use_kernels is False
