"""Quantized layers: dtype / device moves keep the packed storage; the path each GPU generation gets is described."""

import torch

from diffusers_h3.quantizers import FP8Config, NVFP4Config, W8A16Config, quantize


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

