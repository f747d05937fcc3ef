"""``quantize(module, config)`` on any module (plain, the Qwen3-VL text encoder), the quantized-layer interface,
memory accounting and clear errors."""

import pytest
import torch

from diffusers_h3.quantizers import (
    FP8Config,
    NVFP4Config,
    W8A16Config,
    W8A16Tensor,
    is_quantized_linear,
    quantization_summary,
    quantize,
)

from ._helpers import CONFIGS, WEIGHTS, rel


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
    assert isinstance(layer.weight, WEIGHTS[method]) and layer.weight.quant_method == f"h3_{method}"
    assert (layer.in_features, layer.out_features) == (48, 64) and layer.bias is not None and net[2].bias is None
    assert layer.weight.dequantize().shape == (64, 48) and layer.weight.dequantize().dtype == torch.float32
    assert layer.weight.device == layer.bias.device and layer.weight.is_floating_point() and not layer.weight.qdata.is_floating_point() or method == "fp8"
    assert set(net.state_dict()) >= {"0.weight", "0.weight_scale", "0.bias"} and net.state_dict()["0.weight"].dtype != torch.float32
    assert "cpu" in layer.weight.describe_path() and layer.weight.describe_path().count("\n") == 0
    out = net(x)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert rel(out, ref) < {"w8a16": 0.02, "nvfp4": 0.2, "fp8": 0.08}[method]
    # effective weight == what forward uses (weight-only methods: exactly the dense GEMM on dequantize())
    if method != "fp8":
        dense_out = torch.nn.functional.linear(x, layer.weight.dequantize(), layer.bias)
        assert rel(layer(x), dense_out) < 1e-5
    # requantize_ from a dense weight (LoRA fuse / unfuse)
    new_w = torch.randn(64, 48)
    layer.weight.copy_(new_w)
    assert rel(layer.weight.dequantize(), new_w) < {"w8a16": 0.01, "nvfp4": 0.15, "fp8": 0.05}[method]
    with pytest.raises(ValueError, match="shape"):
        layer.weight.copy_(torch.randn(48, 64))
    with pytest.raises(ValueError, match="input features"):
        layer(torch.randn(2, 47))


def test_memory_accounting():
    net = quantize(torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 32)), NVFP4Config())
    summary = quantization_summary(net)
    expected = sum(n * k // 2 + n * k // 16 + 4 for n, k in ((48, 64), (32, 48)))
    assert summary["quantized_weight_bytes"] == expected
    assert summary["other_bytes"] == (48 + 32) * 4  # fp32 biases
    w8 = quantize(torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False)), W8A16Config())
    assert quantization_summary(w8)["quantized_weight_bytes"] == 48 * 64 + 48 * 4


def test_quantize_qwen3vl_text_encoder():
    from diffusers_h3.testing.tiny import tiny_text_encoder

    te = tiny_text_encoder(num_hidden_layers=3)
    ids = torch.randint(0, 256, (1, 7))
    with torch.no_grad():
        ref = te.model.language_model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    quantize(te, W8A16Config())
    lm_linears = [m for n, m in te.named_modules() if n.startswith("model.language_model") and isinstance(getattr(m, "weight", None), W8A16Tensor)]
    assert len(lm_linears) == 3 * 7
    assert not is_quantized_linear(te.lm_head)  # output head kept
    with torch.no_grad():
        out = te.model.language_model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    assert rel(out, ref) < 0.05


@pytest.mark.parametrize("method", list(CONFIGS))
def test_quantize_while_moving_to_a_device(method, monkeypatch):
    """`quantize(..., device=)` moves each selected linear right before quantizing it (one 16-bit layer at a time on
    the device), then the rest; the result is the same as quantizing in place."""
    import diffusers_h3.quantizers.apply as apply

    torch.manual_seed(2)
    net = torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 32))
    twin = torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 32))
    twin.load_state_dict(net.state_dict())
    events = []
    linear_to, module_to, quantize_linear = torch.nn.Linear.to, torch.nn.Sequential.to, apply.quantize_linear_
    monkeypatch.setattr(torch.nn.Linear, "to", lambda self, *a, **k: events.append(("to", id(self))) or
                        linear_to(self, *a, **k))  # fmt: skip
    monkeypatch.setattr(torch.nn.Sequential, "to", lambda self, *a, **k: events.append(("to all", id(self))) or
                        module_to(self, *a, **k))  # fmt: skip
    monkeypatch.setattr(apply, "quantize_linear_", lambda linear, *a, **k: events.append(("quantize", id(linear))) or
                        quantize_linear(linear, *a, **k))  # fmt: skip
    quantize(net, CONFIGS[method](), device="cpu")
    assert events == [("to", id(net[0])), ("quantize", id(net[0])), ("to", id(net[2])), ("quantize", id(net[2])),
                      ("to all", id(net))]  # fmt: skip
    monkeypatch.undo()
    quantize(twin, CONFIGS[method]())
    moved, in_place = net.state_dict(), twin.state_dict()
    assert moved.keys() == in_place.keys() and all(torch.equal(moved[k], in_place[k]) for k in moved)
