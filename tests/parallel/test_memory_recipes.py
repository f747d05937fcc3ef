"""Memory budgets: recipe selection from the measured table, one-line refusals before loading, and pre-quantized loads
that never materialize dense weights."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from diffusers_h3 import MemoryBudgetConfig, cli
from diffusers_h3.parallel import memory_recipes as mb
from diffusers_h3.pipelines import MiniMaxH3Pipeline
from diffusers_h3.quantizers import NVFP4Config, QuantizedTensor, W8A16Config, is_quantized_linear, quantize
from diffusers_h3.testing import tiny


ROOT = Path(__file__).resolve().parents[2]


def _recipe(name, gpu, host, seconds):
    return mb.MemoryRecipe(mb.RECIPES[name], gpu, host, seconds, f"{name}_case", True, "test")


TABLE = (_recipe("resident", 76.0, 63.0, 290.0), _recipe("offload", 16.4, 71.0, 470.0),
         _recipe("low_ram", 15.0, 30.0, 520.0))  # fmt: skip


@pytest.mark.parametrize(
    "gpu, host, expected",
    [(80, 128, "resident"), (80, 64, "offload"), (24, 64, "low_ram"), (16, 32, "low_ram"), (48, 128, "offload")],
)
def test_the_fastest_recipe_that_fits_is_selected(gpu, host, expected):
    # resident needs 63 GiB host: an 80 GB GPU with 64 GiB RAM still fits it; 64 GiB is too little for offload's 71
    if (gpu, host) == (80, 64):
        expected = "resident"
    assert mb.select_recipe(gpu, host, table=TABLE).name == expected


@pytest.mark.parametrize("gpu, host", [(8, 128), (24, 16), (12, 24)])
def test_an_impossible_budget_is_one_line_naming_the_smallest_needs(gpu, host):
    with pytest.raises(mb.MemoryBudgetError) as error:
        mb.select_recipe(gpu, host, table=TABLE)
    message = str(error.value)
    assert "\n" not in message and f"{gpu:.2f} GiB of GPU" in message and "15.00 GiB ('low_ram'" in message


def test_auto_without_a_gpu_is_refused_in_the_apis_words(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(mb.MemoryBudgetError, match="no CUDA GPU") as error:
        mb.select_recipe(None, 32, table=TABLE)
    assert "gpu_gib" in str(error.value) and "--memory" not in str(error.value)


def test_host_budget_auto_reads_meminfo_and_a_cgroup_limit(monkeypatch):
    monkeypatch.setattr(mb, "_meminfo_bytes", lambda field: 100 * mb.GiB)
    monkeypatch.setattr(mb, "_cgroup_limit_bytes", lambda: 31 * mb.GiB)
    assert mb.visible_host_gib()[0] == 31
    monkeypatch.setattr(mb, "_cgroup_limit_bytes", lambda: None)
    assert mb.visible_host_gib()[0] == 100 - mb.HOST_HEADROOM_GIB


def test_packaged_table_is_the_one_derived_from_the_committed_measurements():
    packaged = json.loads(mb.RECIPE_TABLE_PATH.read_text())
    base, *newer = [json.loads((ROOT / path).read_text()) for path in packaged["source"].split(" + ")]
    results = mb.merged_placement_results(base, newer)
    consumer = ROOT / "benchmarks" / "results" / "consumer_model.json"
    predictions = json.loads(consumer.read_text()) if consumer.exists() else None
    derived = mb.derive_recipe_table(results, predictions=predictions)
    assert packaged["commit"] == derived["commit"]
    measured = [e for e in packaged["recipes"] if e["measured"]]
    assert measured == derived["recipes"]
    assert packaged.get("predicted") == derived.get("predicted")
    # every recipe the table holds can be loaded by name, and unmeasured ones say so in their line
    for recipe in mb.load_recipe_table():
        assert recipe.measured or "NOT measured" in recipe.line()


def test_a_case_that_counted_the_card_needs_its_device_peak_and_keeps_its_device():
    case = {"ms": 1000.0, "stages": {"forwards": 100.0}, "forwards": 1, "sigma_points": 50, "peak_reserved_gib": 6.3,
            "device_peak_gib": 7.05, "host_peak_rss_gib": 4.0, "host_includes_load": True, "cap_gib": 6.4,
            "recipe_name": "low_ram"}  # fmt: skip
    base = {"device": "NVIDIA H200", "cases": {"pc_8gb_16gib": {**case, "device_peak_gib": None}}}
    newer = {"device": "NVIDIA H100 80GB HBM3", "cases": {"pc_8gb_16gib": case, "failed": {"ms": None}}}
    merged = mb.merged_placement_results(base, [newer])
    assert set(merged["cases"]) == {"pc_8gb_16gib"}
    [entry] = mb.derive_recipe_table(merged)["recipes"]
    assert entry["gpu_gib"] == 7.05 and entry["whole_device"] is True and entry["device"] == "NVIDIA H100 80GB HBM3"
    [old] = mb.derive_recipe_table(base)["recipes"]
    assert old["gpu_gib"] == 6.3 and "whole_device" not in old


def test_cases_built_on_the_gpu_need_at_least_their_weights_in_host_memory():
    case = {"ms": 1000.0, "stages": {"forwards": 100.0}, "forwards": 1, "sigma_points": 50, "peak_reserved_gib": 10.0,
            "host_peak_rss_gib": 4.0, "weights_gib": {"a": 30.0, "b": 20.0}}  # fmt: skip
    table = mb.derive_recipe_table({"cases": {"resident_80gb": case}})["recipes"]
    assert table[0]["host_gib"] == 50.0 and table[0]["request_s"] == pytest.approx(0.9 + 4.9)
    loaded = mb.derive_recipe_table({"cases": {"resident_80gb": {**case, "host_includes_load": True}}})["recipes"]
    assert loaded[0]["host_gib"] == 4.0


@pytest.fixture
def no_loading(monkeypatch, tmp_path):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the memory check")

    monkeypatch.setattr(MiniMaxH3Pipeline, "from_pretrained", classmethod(refuse))
    monkeypatch.setattr("diffusers_h3.testing.tiny.demo_checkpoint_dir", refuse)
    return tmp_path


@pytest.mark.parametrize(
    "flags, expected",
    [(["--memory", "1,1"], "--memory 1,1: the memory recipes place the model on a CUDA GPU, and this host has none"),
     (["--memory", "16"], "'<GPU GiB>,<host GiB>'"), (["--memory", "auto"], "this host has none"),
     (["--memory", "16,32", "--low-memory"], "--low-memory asks for its own")],
)  # fmt: skip
def test_cli_memory_refusals_are_one_line_before_loading(flags, expected, no_loading, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = no_loading / "clip.mp4"
    with pytest.raises(SystemExit):
        cli.main(["generate", "--prompt", "a cat", "--out", str(out), "--device", "cpu", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
    assert not out.exists()


class _DenseAllocations(TorchDispatchMode):
    """Shapes of the 16/32-bit tensors written while active. Uninitialized allocations (``empty*``) are left out:
    accelerate's ``init_empty_weights`` creates each parameter that way and moves it to the meta device at once,
    one at a time, never touched; any data written into a tensor shows up as the op that writes it."""

    UNWRITTEN = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default,
                 torch.ops.aten.empty_strided.default}  # fmt: skip

    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.UNWRITTEN:
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            # a quantized weight's wrapper has the dense shape and dtype but allocates nothing (its packed tensors do)
            dense = isinstance(t, torch.Tensor) and not isinstance(t, QuantizedTensor)
            if dense and t.device.type != "meta" and t.is_floating_point() and t.element_size() >= 2:
                self.shapes.add(tuple(t.shape))
        return out


def _dense_shapes(model):
    return {(m.out_features, m.in_features) for m in model.modules() if is_quantized_linear(m)}


@pytest.mark.parametrize("config", [NVFP4Config(), W8A16Config()], ids=["nvfp4", "w8a16"])
def test_a_pre_quantized_checkpoint_loads_without_dense_weights(config, tmp_path):
    from diffusers import MiniMaxH3Transformer3DModel

    torch.manual_seed(0)
    dense = tiny.tiny_transformer(hidden_size=64, attention_head_dim=32, ffn_dim=128, text_dim=32)
    dense.save_pretrained(tmp_path / "dense")
    quantized = quantize(dense, config)
    quantized.save_pretrained(tmp_path / "quantized")
    shapes = _dense_shapes(quantized)
    # the detector sees dense weights where a load has them: quantizing while loading a dense checkpoint
    with _DenseAllocations() as seen:
        MiniMaxH3Transformer3DModel.from_pretrained(tmp_path / "dense", quantization_config=config)
    assert shapes & seen.shapes
    with _DenseAllocations() as seen:
        loaded = MiniMaxH3Transformer3DModel.from_pretrained(tmp_path / "quantized")
    assert not shapes & seen.shapes, sorted(shapes & seen.shapes)
    assert _dense_shapes(loaded) == shapes


def test_low_ram_streams_the_text_encoder_from_disk_and_loads_it_first(tmp_path, monkeypatch):
    from diffusers_h3.pipelines import recipe_loading as loader

    components = tiny.tiny_components(seed=0, with_transformer_ref=False)
    components.pop("transformer_ref")
    quantize(components["transformer"], NVFP4Config())
    quantize(components["text_encoder"], W8A16Config())
    MiniMaxH3Pipeline(**components).save_pretrained(tmp_path / "ckpt")
    order = []
    real_te, real_pipe = loader._load_text_encoder_alone, MiniMaxH3Pipeline.from_pretrained.__func__
    monkeypatch.setattr(loader, "_load_text_encoder_alone", lambda *a: order.append("text_encoder") or real_te(*a))

    def pipe_after(cls, *args, **kwargs):
        assert mb.streams_from_disk(kwargs["text_encoder"]), "the text encoder is not streamed yet"
        order.append("pipeline")
        return real_pipe(cls, *args, **kwargs)

    monkeypatch.setattr(MiniMaxH3Pipeline, "from_pretrained", classmethod(pipe_after))
    pipe = loader.load_for_memory_budget(tmp_path / "ckpt", "t2va", recipe="low_ram", device="cpu",
                                         offload_folder=tmp_path / "offload")  # fmt: skip
    assert order == ["text_encoder", "pipeline"]
    # pre-quantized in the recipe's format: it streams from its own files, nothing is written
    assert not (tmp_path / "offload").exists() or not any((tmp_path / "offload").iterdir())
    placement = pipe._diffusers_h3_placement
    assert placement["text_encoder"].startswith("streamed from its checkpoint files") and "low_ram" in placement["memory_recipe"]
    assert str(tmp_path / "ckpt" / "text_encoder") in placement["text_encoder"]
    assert placement["transformer"].startswith("streamed from its checkpoint files")  # a converted DiT streams
    # a checkpoint pre-quantized in another format than the recipe's is refused before loading
    with pytest.raises(mb.MemoryBudgetError, match="needs h3_w8a16"):
        loader.load_for_memory_budget(tmp_path / "ckpt", "t2va", recipe="offload", device="cpu")


def test_low_ram_streams_a_converted_dit_and_vaes_with_the_outputs_of_the_resident_pipeline(tmp_path, monkeypatch):
    """The converted checkpoint's DiT block by block, the VAEs per stage and the feed-forward in row chunks: the
    request's frames and audio are bitwise those of the same checkpoint loaded in memory, and nothing stays loaded."""
    from diffusers_h3.parallel import checkpoint_streaming as cs
    from diffusers_h3.pipelines import recipe_loading as loader

    monkeypatch.setattr(cs, "RESIDENT_BELOW_BYTES", 1024)  # the tiny models' groups stream too
    components = tiny.tiny_components(seed=0, with_transformer_ref=False)
    components.pop("transformer_ref")
    quantize(components["transformer"], NVFP4Config())
    quantize(components["text_encoder"], W8A16Config())
    MiniMaxH3Pipeline(**components, **tiny.TINY_DURATION_LIMITS).save_pretrained(tmp_path / "ckpt")
    request = {"prompt": "a red fox runs through snow", "height": 64, "width": 96, "num_frames": 22,
               "num_inference_steps": 2, "output_type": "np"}  # fmt: skip
    resident = MiniMaxH3Pipeline.from_pretrained(tmp_path / "ckpt", task="t2va", dtype=torch.bfloat16)
    for model in (resident.transformer, resident.vae, resident.audio_vae):  # own memory, as streamed tensors have
        for tensor in list(model.parameters()) + list(model.buffers()):
            tensor.data = tensor.data.clone()
    expected = resident(**request, generator=torch.Generator().manual_seed(0))
    recipe = dataclasses.replace(mb.resolve_recipe("low_ram", None, None, "cpu"),
                                 settings={"read_ahead": 1, "ffn_chunk_rows": 7, "attention_head_groups": 2})  # fmt: skip
    pipe = loader.load_for_memory_budget(tmp_path / "ckpt", "t2va", recipe=recipe, device="cpu")
    placement = pipe._diffusers_h3_placement
    for name in ("transformer", "vae", "audio_vae"):
        assert placement[name].startswith("streamed from its checkpoint files"), placement[name]
    assert placement["feed_forward"] == "chunked over 7 rows"
    assert placement["attention"] == "video sparse attention, when enabled, over 2 head groups in turn"
    from diffusers_h3.attention_processors.vsa import disable_vsa, vsa_state

    pipe.enable_vsa(sparsity=0.5)  # the recipe's setting reaches VSA enabled after the load
    assert vsa_state(pipe.transformer)["head_groups"] == 2
    disable_vsa(pipe)
    got = pipe(**request, generator=torch.Generator().manual_seed(0))
    assert np.array_equal(got.frames, expected.frames) and np.array_equal(got.audio, expected.audio)
    from diffusers_h3 import describe

    assert describe(pipe)["placement"]["transformer"] == placement["transformer"]
    for name in ("transformer", "vae", "audio_vae"):
        record = cs.streaming_of(getattr(pipe, name))
        assert record.groups > 0 and record.stats.group_loads > 0
        held = [p for p in getattr(pipe, name).parameters()
                if (p.quantized_nbytes() if isinstance(p, QuantizedTensor) else p.numel() * p.element_size()) >= 1024]
        assert not held, f"{name} still holds streamed weights after the request"


def test_low_ram_from_a_dense_checkpoint_quantizes_the_text_encoder_and_offloads_it_to_files(tmp_path):
    from diffusers_h3.pipelines import recipe_loading as loader

    components = tiny.tiny_components(seed=0, with_transformer_ref=False)
    components.pop("transformer_ref")
    MiniMaxH3Pipeline(**components).save_pretrained(tmp_path / "dense")
    pipe = loader.load_for_memory_budget(tmp_path / "dense", "t2va", recipe="low_ram", device="cpu",
                                         offload_folder=tmp_path / "offload")  # fmt: skip
    # the files hold bf16/fp32 weights, the model int8 codes: they cannot be the source, so the codes are written once
    assert any(p.suffix == ".safetensors" for p in (tmp_path / "offload").iterdir())
    assert pipe._diffusers_h3_placement["text_encoder"].startswith(f"written once to {tmp_path / 'offload'} in its "
                                                                   "packed checkpoint layout")  # fmt: skip
    assert is_quantized_linear(pipe.text_encoder.model.language_model.layers[0].mlp.up_proj)


def test_pipeline_method_places_with_the_recipe_and_describe_reports_it():
    from diffusers_h3 import describe

    pipe = tiny.tiny_pipeline(seed=0, with_transformer_ref=False)
    with pytest.raises(mb.MemoryBudgetError, match="no memory recipe fits"):
        pipe.enable_memory_budget(MemoryBudgetConfig(1, 1, device="cpu"))
    assert not getattr(pipe, "_diffusers_h3_placement", None)  # refused before anything moved
    for name in ("transformer", "text_encoder"):
        quantize(getattr(pipe, name), W8A16Config())
    recipe = pipe.enable_memory_budget(MemoryBudgetConfig(device="cpu", recipe="offload"))
    assert recipe.name == "offload"
    placement = describe(pipe)["placement"]
    assert "offload" in placement["memory_recipe"] and placement["transformer"].startswith("group offload")


@pytest.mark.gpu
def test_low_ram_runs_a_request_under_a_gpu_cap(tmp_path):
    from diffusers_h3.pipelines.recipe_loading import load_for_memory_budget

    components = tiny.tiny_components(seed=0, with_transformer_ref=False)
    components.pop("transformer_ref")
    quantize(components["transformer"], NVFP4Config())
    quantize(components["text_encoder"], W8A16Config())
    MiniMaxH3Pipeline(**components).save_pretrained(tmp_path / "ckpt")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    cap_gib = 2.0
    pipe = load_for_memory_budget(tmp_path / "ckpt", "t2va", gpu_gib=cap_gib, recipe="low_ram", device="cuda")
    out = pipe(prompt="a red fox", height=64, width=96, num_frames=124, num_inference_steps=2,
               generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert np.isfinite(out.frames).all() and np.isfinite(out.audio).all()
    assert torch.cuda.max_memory_reserved() <= cap_gib * 2**30
    placement = pipe._diffusers_h3_placement
    assert placement["text_encoder"].startswith("streamed from its checkpoint files")
    assert "capped at 2 GiB" in placement["allocator"], placement


def test_gpu_cap_on_plain_cuda_resolves_the_current_device_index(monkeypatch):
    """`device="cuda"` (no index) is what users pass; the allocator's cap needs the current device's index."""
    from types import SimpleNamespace

    GiB = mb.GiB
    calls = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=100 * GiB))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: calls.append((f, device)))
    assert mb.apply_gpu_cap(25, "cuda") == 0.25
    assert calls == [(0.25, torch.device("cuda", 3))]
    mb.apply_gpu_cap(50, "cuda:1")
    assert calls[-1] == (0.5, torch.device("cuda", 1))


@pytest.fixture(scope="module")
def file_and_checkpoint(tmp_path_factory):
    """A tiny checkpoint converted for ``low_ram``'s text encoder, and its DiT as a ComfyUI-GGUF Q8_0 file."""
    pytest.importorskip("gguf")
    from diffusers_h3.testing.single_file import write_gguf

    path = tmp_path_factory.mktemp("file_and_checkpoint")
    components = tiny.tiny_components(seed=0, with_transformer_ref=False)
    components.pop("transformer_ref")
    write_gguf(components["transformer"], path / "dit-Q8_0.gguf", "Q8_0")
    quantize(components["text_encoder"], W8A16Config())
    MiniMaxH3Pipeline(**components, **tiny.TINY_DURATION_LIMITS).save_pretrained(path / "ckpt")
    return path / "dit-Q8_0.gguf", path / "ckpt"


def test_a_memory_recipe_runs_a_gguf_dit_file_with_the_outputs_of_the_file_loaded_in_memory(file_and_checkpoint,
                                                                                              monkeypatch):
    """`low_ram` with `transformer_file`: the text encoder and VAEs stream from the checkpoint, the GGUF DiT (in its
    own format, not the recipe's NVFP4) is offloaded block by block; the request equals the same file loaded whole."""
    from diffusers_h3 import describe
    from diffusers_h3.loaders.single_file import load_transformer_file
    from diffusers_h3.parallel import checkpoint_streaming as cs
    from diffusers_h3.pipelines import recipe_loading as loader

    monkeypatch.setattr(cs, "RESIDENT_BELOW_BYTES", 1024)
    gguf_file, ckpt = file_and_checkpoint
    request = {"prompt": "a red fox runs through snow", "height": 64, "width": 96, "num_frames": 22,
               "num_inference_steps": 2, "output_type": "np"}  # fmt: skip
    transformer = load_transformer_file(gguf_file, ckpt / "transformer", dtype=torch.bfloat16)
    resident = MiniMaxH3Pipeline.from_pretrained(ckpt, task="t2va", dtype=torch.bfloat16, transformer=transformer)
    for model in (resident.vae, resident.audio_vae):  # own memory, as streamed tensors have
        for tensor in list(model.parameters()) + list(model.buffers()):
            tensor.data = tensor.data.clone()
    expected = resident(**request, generator=torch.Generator().manual_seed(0))
    recipe = dataclasses.replace(mb.resolve_recipe("low_ram", None, None, "cpu"), settings={"read_ahead": 1})
    pipe = loader.load_for_memory_budget(ckpt, "t2va", recipe=recipe, device="cpu", transformer_file=gguf_file)
    placement = describe(pipe)["placement"]
    assert placement["transformer"].startswith("group offload"), placement["transformer"]
    assert placement["vae"].startswith("streamed from its checkpoint files"), placement["vae"]
    assert describe(pipe)["components"]["transformer"]["quantization"] == "GGUFQuantizationConfig"
    got = pipe(**request, generator=torch.Generator().manual_seed(0))
    assert np.array_equal(got.frames, expected.frames) and np.array_equal(got.audio, expected.audio)


def test_a_dit_file_the_host_budget_cannot_hold_beside_the_recipe_is_refused_before_loading(file_and_checkpoint,
                                                                                             monkeypatch):
    from diffusers_h3.loaders import single_file
    from diffusers_h3.pipelines import recipe_loading as loader

    gguf_file, ckpt = file_and_checkpoint
    monkeypatch.setattr(single_file, "load_transformer_file", lambda *a, **k: pytest.fail("loaded before the check"))
    recipe = mb.resolve_recipe("low_ram", None, None, "cpu")
    with pytest.raises(mb.MemoryBudgetError) as error:
        loader.load_for_memory_budget(ckpt, "t2va", recipe=recipe, device="cpu", transformer_file=gguf_file,
                                      host_gib=recipe.host_gib)  # fmt: skip
    message = str(error.value)
    assert "\n" not in message and "dit-Q8_0.gguf" in message and "stays in host memory" in message, message


def test_a_placed_recipe_runs_under_the_cap_its_entry_was_measured_under():
    """The card-counted figures of a capped entry hold under its cap: a budget read from the card (None) or larger
    than the entry's cap does not loosen it; a smaller budget tightens it; an entry measured without a cap takes the
    budget."""
    from types import SimpleNamespace

    entry = SimpleNamespace(cap_gib=6.4)
    assert mb.recipe_gpu_cap(entry, None) == 6.4
    assert mb.recipe_gpu_cap(entry, 7.3) == 6.4
    assert mb.recipe_gpu_cap(entry, 6.0) == 6.0
    assert mb.recipe_gpu_cap(SimpleNamespace(cap_gib=None), 20.0) == 20.0
    assert mb.recipe_gpu_cap(SimpleNamespace(cap_gib=None), None) is None
    table = {r.case: r for r in mb.load_recipe_table()}
    for case in ("pc_8gb_16gib", "pc_12gb_32gib"):
        assert mb.recipe_gpu_cap(table[case], None) == table[case].cap_gib


def _fake_cuda_allocator(monkeypatch):
    """Record what the allocator is asked for, on a machine without CUDA."""
    calls = {"settings": [], "caps": []}
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls["settings"].append, raising=False)
    monkeypatch.setattr(mb, "apply_gpu_cap", lambda gib, device: calls["caps"].append((gib, str(device))) or 0.1)
    for name in mb.ALLOCATOR_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    return calls


def test_a_placed_recipe_runs_the_allocator_as_it_was_measured(monkeypatch):
    """Expandable segments (what the recipes' figures were measured with) and the entry's cap, said in one line."""
    from types import SimpleNamespace

    calls = _fake_cuda_allocator(monkeypatch)
    line = mb.hold_allocator_for_recipe(SimpleNamespace(cap_gib=6.4), None, "cuda:0")
    assert calls == {"settings": ["expandable_segments:True"], "caps": [(6.4, "cuda:0")]}
    assert "expandable segments" in line and "capped at 6.4 GiB" in line
    assert mb.hold_allocator_for_recipe(SimpleNamespace(cap_gib=6.4), None, "cpu") is None
    assert len(calls["settings"]) == 1  # nothing asked off CUDA


@pytest.mark.parametrize("variable", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_the_users_own_expandable_segments_setting_stands(monkeypatch, variable):
    from types import SimpleNamespace

    calls = _fake_cuda_allocator(monkeypatch)
    monkeypatch.setenv(variable, "expandable_segments:False")
    line = mb.hold_allocator_for_recipe(SimpleNamespace(cap_gib=10.3), 8.0, "cuda:0")
    assert calls == {"settings": [], "caps": [(8.0, "cuda:0")]}
    assert variable in line and "capped at 8 GiB" in line


def test_enable_memory_budget_holds_the_allocator_to_the_entrys_cap(monkeypatch):
    """Placed for a budget read from the card, the allocator still gets the entry's measured cap."""
    applied = []
    entry = type("Entry", (), {"cap_gib": 6.4, "name": "low_ram", "case": "pc_8gb_16gib",
                               "line": lambda self: "recipe"})()
    monkeypatch.setattr(mb, "resolve_recipe", lambda *a, **k: entry)
    monkeypatch.setattr(mb, "check_weights_for_recipe", lambda pipe, recipe: None)
    monkeypatch.setattr(mb, "place_for_recipe", lambda *a, **k: None)
    monkeypatch.setattr(mb, "apply_gpu_cap", lambda gib, device: applied.append((gib, str(device))) or 0.08)

    class Pipe:
        text_encoder = None

    pipe = Pipe()
    import diffusers_h3.parallel.placement as placement

    recorded = {}
    monkeypatch.setattr(placement, "_record_placement", lambda pipe, **kw: recorded.update(kw))
    monkeypatch.setattr(mb, "use_recipe_allocator_settings", lambda: "expandable segments")
    assert mb.enable_memory_budget(pipe, mb.MemoryBudgetConfig(device="cuda:0")) is entry
    assert applied == [(6.4, "cuda:0")]
    assert recorded["allocator"].startswith("expandable segments; capped at 6.4 GiB")
    mb.enable_memory_budget(pipe, mb.MemoryBudgetConfig(gpu_gib=5.0, device="cuda:0"))
    assert applied[-1] == (5.0, "cuda:0")


def test_a_recipe_line_names_the_gpu_its_time_was_measured_on():
    """The PC entries were re-measured on an H100, the others on an H200: each line says which."""
    by_case = {entry.case: entry for entry in mb.load_recipe_table()}
    for case, gpu in (("pc_12gb_32gib", "an H100"), ("resident_80gb", "an H200")):
        assert by_case[case].measured_on == gpu and f"t2va request on {gpu}" in by_case[case].line()
    assert mb._gpu_article("NVIDIA A100-SXM4-80GB") == "an A100" and mb._gpu_article("NVIDIA L40S") == "an L40S"
    assert mb._gpu_article(None) == "an unnamed GPU" and mb._gpu_article("NVIDIA GeForce RTX 4090") == "NVIDIA GeForce RTX 4090"
