"""The diffusers quantizer on models: from_pretrained (on the fly and pre-quantized), save / load round trip
(bit-exact, no re-quantization), checkpoints written by earlier versions, ModelOpt-style exports, clear errors, the
tiny pipeline with each format, the full-size memory targets."""

import json

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel
from diffusers.quantizers import PipelineQuantizationConfig

from diffusers_h3.quantizers import (
    FP8Config,
    NVFP4Config,
    NVFP4Tensor,
    W8A16Config,
    W8A16Tensor,
    is_quantized_linear,
    quantize,
    register_quantizers,
)
from diffusers_h3.testing.tiny import (
    TINY_DURATION_LIMITS,
    TINY_NUM_FRAMES,
    TINY_TRANSFORMER_CONFIG,
    tiny_components,
    tiny_transformer,
)

from ._helpers import CONFIGS, MODEL_TOL, WEIGHTS, rel, run_transformer


register_quantizers()


@pytest.mark.parametrize("method", list(CONFIGS))
def test_from_pretrained_quantizes_the_right_layers(dense_dir, method):
    dense = MiniMaxH3Transformer3DModel.from_pretrained(dense_dir)
    model = MiniMaxH3Transformer3DModel.from_pretrained(dense_dir, quantization_config=CONFIGS[method]())
    quantized = {n for n, m in model.named_modules() if is_quantized_linear(m)}
    assert all(isinstance(model.get_submodule(n).weight, WEIGHTS[method]) for n in quantized)
    # kept: fp32 modules / projections / embedders / norms
    for kept in ("proj_in", "audio_proj_in", "context_embedder", "time_embedder.linear_1", "proj_out",
                 "audio_proj_out", "norm_out.linear"):  # fmt: skip
        assert not is_quantized_linear(model.get_submodule(kept)), kept
    # quantized: attention, FFN, AdaLN projection, refiner
    for q in ("transformer_blocks.0.attn.to_q", "transformer_blocks.1.ff.net.2", "transformer_blocks.0.adaln_proj.linear",
              "token_refiner.refiner_blocks.0.attn.to_out.0"):  # fmt: skip
        assert q in quantized, q
    assert len(quantized) == 2 * 7 + 6
    assert rel(run_transformer(model), run_transformer(dense)) < MODEL_TOL[method]
    assert model.config.quantization_config.quant_method.value == f"h3_{method}"


def test_modules_to_not_convert_overrides_defaults(dense_dir):
    model = MiniMaxH3Transformer3DModel.from_pretrained(
        dense_dir, quantization_config=W8A16Config(modules_to_not_convert=["adaln_proj", "transformer_blocks.1"])
    )
    assert not is_quantized_linear(model.transformer_blocks[0].adaln_proj.linear)
    assert isinstance(model.transformer_blocks[0].attn.to_q.weight, W8A16Tensor)
    assert not any(is_quantized_linear(m) for m in model.transformer_blocks[1].modules())
    # explicit list replaces the defaults: the output head is quantized now (keep_in_fp32 still applies via the loader)
    assert isinstance(model.get_submodule("norm_out.linear").weight, W8A16Tensor)


@pytest.mark.parametrize("method", list(CONFIGS))
def test_save_load_round_trip_is_bit_exact_without_requantizing(dense_dir, tmp_path, method, monkeypatch):
    model = MiniMaxH3Transformer3DModel.from_pretrained(dense_dir, quantization_config=CONFIGS[method]())
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == f"h3_{method}"

    def _no_requant(*a, **k):
        raise AssertionError("reload must not re-quantize")

    monkeypatch.setattr(WEIGHTS[method], "pack", _no_requant)
    reloaded = MiniMaxH3Transformer3DModel.from_pretrained(tmp_path)
    sd, sd2 = model.state_dict(), reloaded.state_dict()
    assert sd.keys() == sd2.keys()
    for key in sd:
        assert sd[key].dtype == sd2[key].dtype, key
        assert torch.equal(sd[key].view(torch.uint8) if sd[key].dtype == torch.float8_e4m3fn else sd[key],
                           sd2[key].view(torch.uint8) if sd2[key].dtype == torch.float8_e4m3fn else sd2[key]), key  # fmt: skip
    assert torch.equal(run_transformer(model), run_transformer(reloaded))
    # torch_dtype does not touch the fp32 scales
    half = MiniMaxH3Transformer3DModel.from_pretrained(tmp_path, torch_dtype=torch.bfloat16)
    layer = half.transformer_blocks[0].attn.to_q
    assert layer.weight.dtype == torch.bfloat16 and layer.weight.scale.dtype == model.transformer_blocks[0].attn.to_q.weight.scale.dtype
    assert torch.equal(layer.weight.scale.float(), model.transformer_blocks[0].attn.to_q.weight.scale.float())


def test_device_map_auto_without_dtype_loads_in_the_dense_default(dense_dir):
    # diffusers sizes the model for device_map="auto" with the quantizer's dtype: it must not be None
    model = MiniMaxH3Transformer3DModel.from_pretrained(dense_dir, quantization_config=W8A16Config(), device_map="auto")
    dense = MiniMaxH3Transformer3DModel.from_pretrained(dense_dir)
    layer = model.transformer_blocks[0].attn.to_q
    assert isinstance(layer.weight, W8A16Tensor) and layer.weight.dtype == dense.dtype
    assert rel(run_transformer(model), run_transformer(dense)) < MODEL_TOL["w8a16"]


def test_loading_another_method_or_shape_fails_clearly(dense_dir, tmp_path):
    model = MiniMaxH3Transformer3DModel.from_pretrained(dense_dir, quantization_config=W8A16Config())
    model.save_pretrained(tmp_path / "w8")
    cfg_path = tmp_path / "w8" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    # 1. the config claims NVFP4 but the tensors are W8A16
    cfg["quantization_config"] = NVFP4Config().to_dict()
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="another method"):
        MiniMaxH3Transformer3DModel.from_pretrained(tmp_path / "w8")
    # 2. FP8 config over int8 tensors (same shape, other dtype)
    cfg["quantization_config"] = FP8Config().to_dict()
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="another method"):
        MiniMaxH3Transformer3DModel.from_pretrained(tmp_path / "w8")
    # 3. a dense checkpoint whose config claims it is pre-quantized
    dense_cfg = json.loads((dense_dir / "config.json").read_text())
    (tmp_path / "fake").mkdir()
    for f in dense_dir.iterdir():
        (tmp_path / "fake" / f.name).write_bytes(f.read_bytes())
    dense_cfg["quantization_config"] = W8A16Config().to_dict()
    (tmp_path / "fake" / "config.json").write_text(json.dumps(dense_cfg))
    with pytest.raises(ValueError, match="another method"):
        MiniMaxH3Transformer3DModel.from_pretrained(tmp_path / "fake")
    # 4. mismatched shapes: an NVFP4 checkpoint of a wider model
    wide = tiny_transformer(ffn_dim=96)
    quantize(wide, NVFP4Config())
    wide.save_pretrained(tmp_path / "wide")
    cfg = json.loads((tmp_path / "wide" / "config.json").read_text())
    cfg["ffn_dim"] = TINY_TRANSFORMER_CONFIG["ffn_dim"]
    (tmp_path / "wide" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="expects"):
        MiniMaxH3Transformer3DModel.from_pretrained(tmp_path / "wide")


def test_full_size_h3_weight_memory_targets(monkeypatch):
    """The 50-block H3 DiT (computed on the meta device): W8A16 <= 0.52x, NVFP4 <= 0.30x of bf16."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gemm.py"
    monkeypatch.syspath_prepend(str(path.parent))  # the script imports benchmarks/_common.py as a script would
    spec = importlib.util.spec_from_file_location("bench_gemm", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    mem = bench.weight_memory()
    bf16 = mem["bf16"]["bytes"]
    assert 60 * 2**30 < bf16 < 64 * 2**30
    assert mem["w8a16"]["bytes"] / bf16 <= 0.52
    assert mem["nvfp4"]["bytes"] / bf16 <= 0.30
    assert mem["fp8"]["bytes"] / bf16 <= 0.52
    assert mem["w8a16"]["quantized_layers"] == 50 * 7 + 2 * 6


RUN = {"prompt": "a cat", "height": 32, "width": 32, "num_frames": TINY_NUM_FRAMES, "num_inference_steps": 2, "output_type": "latent"}


@pytest.fixture(scope="module")
def pipe_dir(tmp_path_factory):
    from diffusers_h3 import MiniMaxH3Pipeline

    components = tiny_components(seed=3, with_transformer_ref=False)
    pipe = MiniMaxH3Pipeline(**components, text_encoder_layer=50, **TINY_DURATION_LIMITS)
    path = tmp_path_factory.mktemp("pipe")
    pipe.save_pretrained(path)
    return path


def _latents(pipe):
    out = pipe(**RUN, generator=torch.Generator().manual_seed(0))
    frames = getattr(out, "frames", None)
    audio = getattr(out, "audio", None)
    parts = [t for t in (frames, audio) if isinstance(t, torch.Tensor)]
    return torch.cat([p.flatten().float() for p in parts]) if parts else out[0]


@pytest.mark.parametrize("method", list(CONFIGS))
def test_tiny_pipeline_runs_with_each_method(pipe_dir, method):
    from diffusers_h3 import MiniMaxH3Pipeline

    dense = MiniMaxH3Pipeline.from_pretrained(pipe_dir)
    pq = PipelineQuantizationConfig(quant_mapping={"transformer": CONFIGS[method]()})
    pipe = MiniMaxH3Pipeline.from_pretrained(pipe_dir, quantization_config=pq)
    assert isinstance(pipe.transformer.transformer_blocks[0].attn.to_q.weight, WEIGHTS[method])
    quantize(pipe.text_encoder, CONFIGS[method]())  # the text encoder goes through quantize()
    ref, out = _latents(dense), _latents(pipe)
    assert torch.isfinite(out).all() and out.shape == ref.shape
    assert not torch.equal(out, ref)
    import diffusers_h3

    report = diffusers_h3.describe(pipe)
    layers = report["components"]["transformer"]["quantized_layers"]
    assert sum(layers.values()) == 20 and all(f"h3_{method}" in k for k in layers)


def test_reads_modelopt_style_nvfp4_export(dense_dir, tmp_path):
    """A ModelOpt-style export (uint8 [N, K/2] + E4M3 [N, K/16] + fp32 weight_scale_2 [1] + input_scale, config.json
    without our quantization_config) loads with NVFP4Config as pre-quantized: no re-quantization, tensors unchanged."""
    from safetensors.torch import load_file, save_file

    from diffusers_h3.kernels.numerics import e2m1_encode, pack_nibbles, to_e4m3

    dense_sd = load_file(str(dense_dir / "diffusion_pytorch_model.safetensors"))
    reference = MiniMaxH3Transformer3DModel.from_pretrained(dense_dir, quantization_config=NVFP4Config())
    names = {n for n, m in reference.named_modules() if isinstance(getattr(m, "weight", None), NVFP4Tensor)}
    export = {}
    for key, value in dense_sd.items():
        module = key.rpartition(".")[0]
        if module in names and key.endswith(".weight"):
            # written independently of nvfp4_quantize, following the published recipe
            w = value.float()
            amax = w.abs().max()
            g = amax / (448.0 * 6.0)
            blocks = w.reshape(w.shape[0], -1, 16)
            bs = to_e4m3(blocks.abs().amax(-1) / 6.0 / g)
            codes = e2m1_encode(blocks / (bs.float() * g)[..., None]).reshape(w.shape)
            export[key] = pack_nibbles(codes)
            export[f"{module}.weight_scale"] = bs
            export[f"{module}.weight_scale_2"] = g.reshape(1)
            export[f"{module}.input_scale"] = torch.ones(1)
        else:
            export[key] = value
    out_dir = tmp_path / "modelopt"
    out_dir.mkdir()
    save_file(export, str(out_dir / "diffusion_pytorch_model.safetensors"))
    (out_dir / "config.json").write_text((dense_dir / "config.json").read_text())

    def _no_requant(*a, **k):
        raise AssertionError("a pre-quantized export must not be re-quantized")

    from unittest import mock

    with mock.patch.object(NVFP4Tensor, "pack", _no_requant):
        loaded = MiniMaxH3Transformer3DModel.from_pretrained(out_dir, quantization_config=NVFP4Config())
    layer = loaded.transformer_blocks[0].attn.to_q
    assert isinstance(layer.weight, NVFP4Tensor) and layer.weight.scale_2.dim() == 0
    key = "transformer_blocks.0.attn.to_q"
    assert torch.equal(layer.weight.qdata, export[f"{key}.weight"])
    assert torch.equal(layer.weight.scale.view(torch.uint8), export[f"{key}.weight_scale"].view(torch.uint8))
    # Same recipe as our quantizer: identical outputs to on-the-fly NVFP4
    assert torch.equal(run_transformer(loaded), run_transformer(reference))


# config.json "quantization_config" as earlier versions wrote it (H3QuantMethod enum, method set in __init__): written
# by hand so the test keeps checking that format even when our own writer changes.
OLD_QUANTIZATION_CONFIGS = {
    "w8a16": {"group_size": None, "large_m_rows": 1024, "quant_method": "h3_w8a16", "modules_to_not_convert": None,
              "compute_dtype": None, "backend": "auto"},
    "nvfp4": {"activation": None, "large_m_rows": 1024, "quant_method": "h3_nvfp4", "modules_to_not_convert": None,
              "compute_dtype": None, "backend": "auto"},
    "fp8": {"use_fast_accum": True, "quant_method": "h3_fp8", "modules_to_not_convert": None, "compute_dtype": None,
            "backend": "auto"},
}  # fmt: skip


@pytest.mark.parametrize("method", list(CONFIGS))
def test_checkpoint_saved_by_earlier_versions_loads(dense_dir, tmp_path, method, monkeypatch):
    model = MiniMaxH3Transformer3DModel.from_pretrained(dense_dir, quantization_config=CONFIGS[method]())
    model.save_pretrained(tmp_path)
    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = OLD_QUANTIZATION_CONFIGS[method]
    cfg_path.write_text(json.dumps(cfg))

    def _no_requant(*a, **k):
        raise AssertionError("a pre-quantized checkpoint must not be re-quantized")

    monkeypatch.setattr(WEIGHTS[method], "pack", _no_requant)
    loaded = MiniMaxH3Transformer3DModel.from_pretrained(tmp_path)
    assert type(loaded.config.quantization_config) is CONFIGS[method]
    assert isinstance(loaded.transformer_blocks[0].attn.to_q.weight, WEIGHTS[method])
    assert torch.equal(run_transformer(loaded), run_transformer(model))
