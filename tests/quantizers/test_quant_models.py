"""Quantizers on models: registration with diffusers, module selection, from_pretrained (on the fly and
pre-quantized), save / load round trip (bit-exact, no re-quantization), clear errors, quantize() on any module
(incl. the Qwen3-VL text encoder), the tiny pipeline with each method, dtype moves, memory accounting."""

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from diffusers import MiniMaxH3Transformer3DModel  # noqa: E402
from diffusers.quantizers import PipelineQuantizationConfig  # noqa: E402

from diffusers_h3.quantizers import (  # noqa: E402
    FP8Config,
    FP8Linear,
    H3QuantizedLinear,
    NVFP4Config,
    NVFP4Linear,
    W8A16Config,
    W8A16Linear,
    quantization_summary,
    quantize,
    register_quantizers,
)
from diffusers_h3.testing.tiny import TINY_TRANSFORMER_CONFIG, tiny_components, tiny_transformer  # noqa: E402

register_quantizers()

CONFIGS = {"w8a16": W8A16Config, "nvfp4": NVFP4Config, "fp8": FP8Config}
LAYERS = {"w8a16": W8A16Linear, "nvfp4": NVFP4Linear, "fp8": FP8Linear}
# rel-L2 of a tiny transformer's output vs its dense twin (random weights; NVFP4 and FP8-with-activations are coarse)
MODEL_TOL = {"w8a16": 0.03, "nvfp4": 0.35, "fp8": 0.12}


def _inputs(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    n_video, n_audio, n_text = 8, 3, 5
    s = n_text + n_audio + n_video
    return dict(
        hidden_states=torch.randn(1, n_video, cfg.in_channels * 4, generator=g),
        audio_hidden_states=torch.randn(1, n_audio, cfg.audio_in_channels, generator=g),
        encoder_hidden_states=torch.randn(1, n_text, cfg.text_dim, generator=g),
        timestep=torch.tensor([0.7, 0.3]),
        timestep_indices=torch.cat([torch.zeros(n_text + n_audio), torch.ones(n_video)]).long(),
        token_tags=torch.tensor([1] * n_text + [2] * n_audio + [0] * n_video),
        position_ids=torch.randint(0, 4, (s, 3), generator=g),
        video_indices=torch.arange(n_text + n_audio, s),
        audio_indices=torch.arange(n_text, n_text + n_audio),
        text_indices=torch.arange(n_text),
    )


def _run(model, seed=0):
    with torch.no_grad():
        out = model(**_inputs(model, seed), return_dict=False)
    return torch.cat([out[0].flatten(), out[1].flatten()])


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = tiny_transformer()
    path = tmp_path_factory.mktemp("dense")
    model.save_pretrained(path)
    return path


def test_registered_with_diffusers_and_no_name_clash():
    from diffusers.quantizers import auto

    for method in ("h3_w8a16", "h3_nvfp4", "h3_fp8"):
        assert method in auto.AUTO_QUANTIZER_MAPPING and method in auto.AUTO_QUANTIZATION_CONFIG_MAPPING
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING as tf_map

    assert not {"h3_w8a16", "h3_nvfp4", "h3_fp8"} & set(tf_map)
    assert W8A16Config().quant_method.value == "h3_w8a16"  # an Enum member, as diffusers requires


@pytest.mark.parametrize("method", list(CONFIGS))
def test_from_pretrained_quantizes_the_right_layers(dense_dir, method):
    dense = MiniMaxH3Transformer3DModel.from_pretrained(dense_dir)
    model = MiniMaxH3Transformer3DModel.from_pretrained(dense_dir, quantization_config=CONFIGS[method]())
    quantized = {n for n, m in model.named_modules() if isinstance(m, H3QuantizedLinear)}
    assert all(isinstance(model.get_submodule(n), LAYERS[method]) for n in quantized)
    # kept: fp32 modules / projections / embedders / norms
    for kept in ("proj_in", "audio_proj_in", "context_embedder", "time_embedder.linear_1", "proj_out",
                 "audio_proj_out", "norm_out.linear"):  # fmt: skip
        assert type(model.get_submodule(kept)) is torch.nn.Linear, kept
    # quantized: attention, FFN, AdaLN projection, refiner
    for q in ("transformer_blocks.0.attn.to_q", "transformer_blocks.1.ff.net.2", "transformer_blocks.0.adaln_proj.linear",
              "token_refiner.refiner_blocks.0.attn.to_out.0"):  # fmt: skip
        assert q in quantized, q
    assert len(quantized) == 2 * 7 + 6
    assert _rel(_run(model), _run(dense)) < MODEL_TOL[method]
    assert model.config.quantization_config.quant_method.value == f"h3_{method}"


def test_modules_to_not_convert_overrides_defaults(dense_dir):
    model = MiniMaxH3Transformer3DModel.from_pretrained(
        dense_dir, quantization_config=W8A16Config(modules_to_not_convert=["adaln_proj", "transformer_blocks.1"])
    )
    assert type(model.transformer_blocks[0].adaln_proj.linear) is torch.nn.Linear
    assert isinstance(model.transformer_blocks[0].attn.to_q, W8A16Linear)
    assert not any(isinstance(m, H3QuantizedLinear) for m in model.transformer_blocks[1].modules())
    # explicit list replaces the defaults: the output head is quantized now (keep_in_fp32 still applies via the loader)
    assert isinstance(model.get_submodule("norm_out.linear"), W8A16Linear)


@pytest.mark.parametrize("method", list(CONFIGS))
def test_save_load_round_trip_is_bit_exact_without_requantizing(dense_dir, tmp_path, method, monkeypatch):
    model = MiniMaxH3Transformer3DModel.from_pretrained(dense_dir, quantization_config=CONFIGS[method]())
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == f"h3_{method}"

    def _no_requant(*a, **k):
        raise AssertionError("reload must not re-quantize")

    monkeypatch.setattr(LAYERS[method], "_quantize", _no_requant)
    reloaded = MiniMaxH3Transformer3DModel.from_pretrained(tmp_path)
    sd, sd2 = model.state_dict(), reloaded.state_dict()
    assert sd.keys() == sd2.keys()
    for key in sd:
        assert sd[key].dtype == sd2[key].dtype, key
        assert torch.equal(sd[key].view(torch.uint8) if sd[key].dtype == torch.float8_e4m3fn else sd[key],
                           sd2[key].view(torch.uint8) if sd2[key].dtype == torch.float8_e4m3fn else sd2[key]), key  # fmt: skip
    assert torch.equal(_run(model), _run(reloaded))
    # torch_dtype does not touch the fp32 scales
    half = MiniMaxH3Transformer3DModel.from_pretrained(tmp_path, torch_dtype=torch.bfloat16)
    layer = half.transformer_blocks[0].attn.to_q
    assert layer.compute_dtype == torch.bfloat16 and layer.weight_scale.dtype == model.transformer_blocks[0].attn.to_q.weight_scale.dtype
    assert torch.equal(layer.weight_scale.float(), model.transformer_blocks[0].attn.to_q.weight_scale.float())


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


def test_bad_configs_raise():
    with pytest.raises(ValueError, match="group_size"):
        W8A16Config(group_size=10)
    with pytest.raises(ValueError, match="backend"):
        FP8Config(backend="triton")
    with pytest.raises(ValueError, match="activation"):
        NVFP4Config(activation="int4")
    with pytest.raises(TypeError, match="list of module names"):
        W8A16Config(modules_to_not_convert="proj_in")
    with pytest.raises(TypeError, match="W8A16Config"):
        quantize(torch.nn.Linear(16, 16), object())
    with pytest.raises(ValueError, match="already contains"):
        quantize(quantize(torch.nn.Sequential(torch.nn.Linear(32, 32)), W8A16Config()), W8A16Config())


@pytest.mark.parametrize("method", list(CONFIGS))
def test_quantize_any_module_and_layer_interface(method):
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.GELU(), torch.nn.Linear(64, 32, bias=False))
    x = torch.randn(3, 5, 48)
    ref = net(x)
    quantize(net, CONFIGS[method]())
    layer = net[0]
    assert isinstance(layer, LAYERS[method]) and layer.quant_method == f"h3_{method}"
    assert (layer.in_features, layer.out_features) == (48, 64) and layer.bias is not None and net[2].bias is None
    assert layer.dequantize().shape == (64, 48) and layer.dequantize().dtype == torch.float32
    assert layer.weight.device == layer.bias.device and not layer.weight.is_floating_point() or method == "fp8"
    assert "cpu" in layer.describe_path() and layer.describe_path().count("\n") == 0
    out = net(x)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert _rel(out, ref) < {"w8a16": 0.02, "nvfp4": 0.2, "fp8": 0.08}[method]
    # effective weight == what forward uses (weight-only methods: exactly the dense GEMM on dequantize())
    if method != "fp8":
        dense_out = torch.nn.functional.linear(x, layer.dequantize(), layer.bias)
        assert _rel(layer(x), dense_out) < 1e-5
    # requantize_ from a dense weight (LoRA fuse / unfuse)
    new_w = torch.randn(64, 48)
    layer.requantize_(new_w)
    assert _rel(layer.dequantize(), new_w) < {"w8a16": 0.01, "nvfp4": 0.15, "fp8": 0.05}[method]
    with pytest.raises(ValueError, match="shape"):
        layer.requantize_(torch.randn(48, 64))
    with pytest.raises(ValueError, match="input features"):
        layer(torch.randn(2, 47))


def test_dtype_moves_keep_packed_storage():
    net = quantize(torch.nn.Sequential(torch.nn.Linear(32, 16)), FP8Config())
    before = {k: v.clone() for k, v in net.state_dict().items()}
    net = net.to(torch.bfloat16)
    layer = net[0]
    assert layer.compute_dtype == torch.bfloat16 and layer.bias.dtype == torch.bfloat16
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.dtype == torch.float32
    assert torch.equal(layer.weight.view(torch.uint8), before["0.weight"].view(torch.uint8))
    assert torch.equal(layer.weight_scale, before["0.weight_scale"])
    assert net(torch.randn(2, 32, dtype=torch.bfloat16)).dtype == torch.bfloat16
    net.float()
    assert layer.compute_dtype == torch.float32


def test_memory_accounting():
    net = quantize(torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 32)), NVFP4Config())
    summary = quantization_summary(net)
    expected = sum(n * k // 2 + n * k // 16 + 4 for n, k in ((48, 64), (32, 48)))
    assert summary["quantized_weight_bytes"] == expected
    assert summary["other_bytes"] == (48 + 32) * 4  # fp32 biases
    w8 = quantize(torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False)), W8A16Config())
    assert quantization_summary(w8)["quantized_weight_bytes"] == 48 * 64 + 48 * 4


def test_full_size_h3_weight_memory_targets():
    """The 50-block H3 DiT (computed on the meta device): W8A16 <= 0.52x, NVFP4 <= 0.30x of bf16."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gemm.py"
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


def test_quantize_qwen3vl_text_encoder():
    from diffusers_h3.testing.tiny import tiny_text_encoder

    te = tiny_text_encoder(num_hidden_layers=3)
    ids = torch.randint(0, 256, (1, 7))
    with torch.no_grad():
        ref = te.model.language_model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    quantize(te, W8A16Config())
    lm_linears = [m for n, m in te.named_modules() if n.startswith("model.language_model") and isinstance(m, W8A16Linear)]
    assert len(lm_linears) == 3 * 7
    assert type(te.lm_head) is torch.nn.Linear  # output head kept
    with torch.no_grad():
        out = te.model.language_model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    assert _rel(out, ref) < 0.05


RUN = dict(prompt="a cat", height=32, width=32, num_frames=124, num_inference_steps=2, output_type="latent")


@pytest.fixture(scope="module")
def pipe_dir(tmp_path_factory):
    from diffusers_h3 import MiniMaxH3Pipeline

    components = tiny_components(seed=3, with_transformer_ref=False)
    pipe = MiniMaxH3Pipeline(**components, text_encoder_layer=50)
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
    assert isinstance(pipe.transformer.transformer_blocks[0].attn.to_q, LAYERS[method])
    quantize(pipe.text_encoder, CONFIGS[method]())  # the text encoder goes through quantize()
    ref, out = _latents(dense), _latents(pipe)
    assert torch.isfinite(out).all() and out.shape == ref.shape
    assert not torch.equal(out, ref)
    import diffusers_h3

    report = diffusers_h3._report(pipe)
    layers = report["components"]["transformer"]["quantized_layers"]
    assert sum(layers.values()) == 20 and all(f"h3_{method}" in k for k in layers)


def test_reads_modelopt_style_nvfp4_export(dense_dir, tmp_path):
    """A ModelOpt-style export (uint8 [N, K/2] + E4M3 [N, K/16] + fp32 weight_scale_2 [1] + input_scale, config.json
    without our quantization_config) loads with NVFP4Config as pre-quantized: no re-quantization, tensors unchanged."""
    from safetensors.torch import load_file, save_file

    from diffusers_h3.kernels.numerics import e2m1_encode, pack_nibbles, to_e4m3

    dense_sd = load_file(str(dense_dir / "diffusion_pytorch_model.safetensors"))
    reference = MiniMaxH3Transformer3DModel.from_pretrained(dense_dir, quantization_config=NVFP4Config())
    names = {n for n, m in reference.named_modules() if isinstance(m, NVFP4Linear)}
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

    with mock.patch.object(NVFP4Linear, "_quantize", _no_requant):
        loaded = MiniMaxH3Transformer3DModel.from_pretrained(out_dir, quantization_config=NVFP4Config())
    layer = loaded.transformer_blocks[0].attn.to_q
    assert isinstance(layer, NVFP4Linear) and layer.weight_scale_2.dim() == 0
    key = "transformer_blocks.0.attn.to_q"
    assert torch.equal(layer.weight, export[f"{key}.weight"])
    assert torch.equal(layer.weight_scale.view(torch.uint8), export[f"{key}.weight_scale"].view(torch.uint8))
    # Same recipe as our quantizer: identical outputs to on-the-fly NVFP4
    assert torch.equal(_run(loaded), _run(reference))


def test_paths_per_hardware_are_described(monkeypatch):
    """describe_path() names the path each GPU generation gets (capabilities faked; the numerics of every path are
    tested above on CPU)."""
    from diffusers_h3.quantizers import layers as L

    w8 = quantize(torch.nn.Sequential(torch.nn.Linear(32, 32)), W8A16Config())[0]
    fp4 = quantize(torch.nn.Sequential(torch.nn.Linear(32, 32)), NVFP4Config())[0]
    w4a4 = quantize(torch.nn.Sequential(torch.nn.Linear(32, 32)), NVFP4Config(activation="nvfp4"))[0]
    fp8 = quantize(torch.nn.Sequential(torch.nn.Linear(32, 32)), FP8Config())[0]
    cuda = torch.device("cuda", 0)
    # V100: no tensor-core Triton, no FP8 -> dequantize fallbacks, with the reason
    monkeypatch.setattr(L, "triton_gemm_supported", lambda d: False)
    monkeypatch.setattr(L, "cuda_capability", lambda d=None: (7, 0))
    monkeypatch.setattr(L, "has_fp8_tensor_cores", lambda d=None: False)
    monkeypatch.setattr(L, "fp8_scaled_mm_supported", lambda d, n, k: False)
    monkeypatch.setattr(L, "flashinfer_fp4_available", lambda d: False)
    for layer in (w8, fp4, fp8):
        backend, reason = layer._select(cuda)
        assert backend == "dequant" and "sm_70" in reason and "fallback" in reason
    assert "emulation" in w4a4._select(cuda)[1]
    # H200: Triton GEMMs with the large-M switch, FP8 through _scaled_mm
    monkeypatch.setattr(L, "triton_gemm_supported", lambda d: True)
    monkeypatch.setattr(L, "fp8_scaled_mm_supported", lambda d, n, k: True)
    assert w8._select(cuda)[0] == "auto" and "1024 rows" in w8._select(cuda)[1]
    assert fp4._select(cuda)[0] == "auto" and fp8._select(cuda)[0] == "scaled_mm"
    # Blackwell with flashinfer: W4A4 through mm_fp4, labelled as not run on hardware
    monkeypatch.setattr(L, "flashinfer_fp4_available", lambda d: True)
    backend, reason = w4a4._select(cuda)
    assert backend == "flashinfer" and "not run on hardware" in reason
    # a forced backend is reported as forced
    forced = quantize(torch.nn.Sequential(torch.nn.Linear(32, 32)), W8A16Config(backend="dequant"))[0]
    assert "forced" in forced.describe_path()
