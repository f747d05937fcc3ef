"""Quantized layers: dtype / device moves keep the packed storage; the path each GPU generation gets is described."""

import pytest
import torch

from diffusers_h3.quantizers import FP8Config, NVFP4Config, W8A16Config, quantize


def test_dtype_moves_keep_packed_storage():
    net = quantize(torch.nn.Sequential(torch.nn.Linear(32, 16)), FP8Config())
    before = {k: v.clone() for k, v in net.state_dict().items()}
    net = net.to(torch.bfloat16)
    layer = net[0]
    assert layer.weight.dtype == torch.bfloat16 and layer.bias.dtype == torch.bfloat16
    assert layer.weight.qdata.dtype == torch.float8_e4m3fn and layer.weight.scale.dtype == torch.float32
    assert torch.equal(layer.weight.qdata.view(torch.uint8), before["0.weight"].view(torch.uint8))
    assert torch.equal(layer.weight.scale, before["0.weight_scale"])
    assert net(torch.randn(2, 32, dtype=torch.bfloat16)).dtype == torch.bfloat16
    net.float()
    assert layer.weight.dtype == torch.float32


def test_paths_per_hardware_are_described(monkeypatch):
    """describe_path() names the path each GPU generation gets (capabilities faked; the numerics of every path are
    tested above on CPU)."""
    from diffusers_h3.quantizers import tensors as L

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
        backend, reason = layer.weight._select(cuda)
        assert backend == "dequant" and "sm_70" in reason and "fallback" in reason
    assert "emulation" in w4a4.weight._select(cuda)[1]
    # H200: Triton GEMMs with the large-M switch, FP8 through _scaled_mm
    monkeypatch.setattr(L, "triton_gemm_supported", lambda d: True)
    monkeypatch.setattr(L, "fp8_scaled_mm_supported", lambda d, n, k: True)
    assert w8.weight._select(cuda)[0] == "auto" and "1024 rows" in w8.weight._select(cuda)[1]
    assert fp4.weight._select(cuda)[0] == "auto" and fp8.weight._select(cuda)[0] == "scaled_mm"
    # Blackwell with flashinfer: W4A4 through mm_fp4, labelled as not run on hardware
    monkeypatch.setattr(L, "flashinfer_fp4_available", lambda d: True)
    backend, reason = w4a4.weight._select(cuda)
    assert backend == "flashinfer" and "not run on hardware" in reason
    # a forced backend is reported as forced
    forced = quantize(torch.nn.Sequential(torch.nn.Linear(32, 32)), W8A16Config(backend="dequant"))[0]
    assert "forced" in forced.weight.describe_path()



@pytest.mark.parametrize("method", ["w8a16", "w8a16_grouped", "fp8", "nvfp4"])
def test_fuse_qkv_projections_on_a_quantized_dit(method):
    """diffusers' fuse_qkv_projections(): W8A16 / FP8 stack their packed codes and per-row scales (outputs unchanged,
    the fused layer really runs); NVFP4 (per-tensor scale per projection) is refused before any module changes."""
    from diffusers_h3.testing.tiny import tiny_transformer, tiny_transformer_inputs

    config = {"w8a16": W8A16Config(), "w8a16_grouped": W8A16Config(group_size=16), "fp8": FP8Config(),
              "nvfp4": NVFP4Config()}[method]  # fmt: skip
    torch.manual_seed(0)
    model = quantize(tiny_transformer(), config)
    inputs = tiny_transformer_inputs(seed=1)
    with torch.no_grad():
        unfused = model(**inputs, return_dict=False)
    attentions = [m for m in model.modules() if hasattr(m, "fused_projections")]
    assert attentions
    if method == "nvfp4":
        with pytest.raises(ValueError, match="weight_scale_2"):
            model.fuse_qkv_projections()
        assert not any(a.fused_projections or hasattr(a, "to_qkv") for a in attentions)
        return

    model.fuse_qkv_projections()
    layer_type = type(attentions[0].to_q.weight)
    for attn in attentions:
        assert attn.fused_projections and type(attn.to_qkv.weight) is layer_type
        assert attn.to_qkv.weight.dtype == attn.to_q.weight.dtype  # still packed, not a float copy
        attn.to_q.weight.copy_(torch.zeros(attn.to_q.weight.shape))  # the fused layer is what runs now
    with torch.no_grad():
        fused = model(**inputs, return_dict=False)
    for a, b in zip(fused, unfused):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    packed = model.state_dict()  # the fused layers are written in the packed layout too
    assert packed["transformer_blocks.0.attn.to_qkv.weight"].dtype == packed["transformer_blocks.0.attn.to_q.weight"].dtype
    assert "transformer_blocks.0.attn.to_qkv.weight_scale" in packed
    model.unfuse_qkv_projections()
    assert not any(a.fused_projections or hasattr(a, "to_qkv") for a in attentions)


def _autocast_case(device, config, compute_dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64)).to(device, compute_dtype)
    x = 4 * torch.randn(16, 64, device=device, dtype=compute_dtype)
    quantize(model, config)
    return model, x


@pytest.mark.parametrize("config", [FP8Config, W8A16Config, NVFP4Config])
@pytest.mark.parametrize("autocast_dtype", [torch.float16, torch.bfloat16])
def test_quantized_layers_under_autocast_compute_as_without_it(config, autocast_dtype):
    """Under `torch.autocast("cpu", float16)` the FP8 emulation's E4M3 products used to overflow fp16 (inf/NaN in
    most outputs): a quantized layer computes in its own `compute_dtype` whatever autocast says."""
    model, x = _autocast_case("cpu", config(), torch.float32)
    expected = model(x)
    with torch.autocast("cpu", autocast_dtype):
        out = model(x)
    assert torch.isfinite(out).all() and torch.equal(out, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("config", [FP8Config, W8A16Config, NVFP4Config])
def test_quantized_layers_under_cuda_autocast_compute_as_without_it(config):
    model, x = _autocast_case("cuda", config(), torch.bfloat16)
    expected = model(x)
    with torch.autocast("cuda", torch.float16):
        out = model(x)
    assert torch.isfinite(out).all() and torch.equal(out, expected)


@pytest.mark.parametrize("name", ["w8a16", "w8a16_group16", "nvfp4", "fp8"])
def test_linear_on_a_quantized_weight_is_the_format_kernel(name):
    """F.linear on the weight runs the format's GEMM entry point on the packed tensors (bitwise), at odd shapes."""
    import copy

    from diffusers_h3.kernels.gemm import fp8_linear, nvfp4_linear, w8a16_linear

    config = {"w8a16": W8A16Config(), "w8a16_group16": W8A16Config(group_size=16), "nvfp4": NVFP4Config(),
              "fp8": FP8Config()}[name]  # fmt: skip
    torch.manual_seed(3)
    layer = quantize(torch.nn.Sequential(torch.nn.Linear(48, 37)), config)[0]
    assert type(layer) is torch.nn.Linear and isinstance(layer.weight, torch.nn.Parameter)
    w, x = layer.weight, torch.randn(3, 5, 48)
    kernel = {
        "w8a16": lambda: w8a16_linear(x, w.qdata, w.scale, layer.bias),
        "w8a16_group16": lambda: w8a16_linear(x, w.qdata, w.scale, layer.bias),
        "nvfp4": lambda: nvfp4_linear(x, w.qdata, w.scale, w.scale_2, layer.bias),
        "fp8": lambda: fp8_linear(x, w.qdata, w.scale, layer.bias),
    }[name]
    assert torch.equal(layer(x), kernel())
    # the state dict is the ModelOpt layout, and a deep copy keeps it (the hooks sit on the layer instance)
    expected = {"weight", "weight_scale", "bias"} | ({"weight_scale_2"} if name == "nvfp4" else set())
    assert set(layer.state_dict()) == expected == set(copy.deepcopy(layer).state_dict())
    assert layer.state_dict()["weight"].dtype == w.qdata.dtype


def test_quantized_weight_ops():
    layer = quantize(torch.nn.Sequential(torch.nn.Linear(32, 16)), W8A16Config())[0]
    w = layer.weight
    assert w.detach().qdata.data_ptr() == w.qdata.data_ptr()  # an alias
    clone = w.clone()
    assert clone.qdata.data_ptr() != w.qdata.data_ptr() and torch.equal(clone.dequantize(), w.dequantize())
    half = w.to(torch.float16)
    assert half.dtype == torch.float16 and half.qdata.dtype == torch.int8 and torch.equal(half.qdata, w.qdata)
    with pytest.raises(TypeError, match="floating compute dtype"):
        w.to(torch.int8)
    other = quantize(torch.nn.Sequential(torch.nn.Linear(32, 16)), FP8Config())[0].weight
    with pytest.raises(TypeError, match="Cannot copy a FP8Tensor into a W8A16Tensor"):
        w.copy_(other)
    with pytest.raises(TypeError, match="would dequantize it"):
        torch.zeros(4, 4).copy_(w[:4, :4])
    assert torch.isfinite(w).all()  # PEFT's safe merge checks the merged weight
    with pytest.raises(NotImplementedError, match=r"does not implement aten\.exp.*dequantize\(\)"):
        torch.exp(w)
    # `.data = other` (how PEFT and diffusers' group offloading move parameters) takes other's packed tensors
    layer.weight.data = clone
    assert layer.weight.qdata.data_ptr() == clone.qdata.data_ptr()
