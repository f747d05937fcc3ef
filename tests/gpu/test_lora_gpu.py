"""LoRA on the real quantized layers on a GPU (marked ``gpu``; run with ``pytest -m gpu tests/test_lora_gpu.py -s``).

On CUDA the quantized layers run their kernels (Triton W8A16, FP8 ``scaled_mm``, NVFP4 where the hardware has it, a
dequantize fallback otherwise); the LoRA wrapper must leave that path alone and add ``scaling * B(A(x))`` computed on
the unquantized input. Checks, per method, at an H3-like width with odd token counts: unfused output == base kernel
output + LoRA delta (fp32 oracle), == LoRA over the dequantized bf16 layer for the weight-only methods, fuse / unfuse
restores the packed tensors bit-exactly, and prints the cost of the unfused LoRA relative to the base GEMM.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _config(method):
    from diffusers_h3.quantizers import FP8Config, NVFP4Config, W8A16Config

    return {"w8a16": W8A16Config, "nvfp4": NVFP4Config, "fp8": FP8Config}[method](modules_to_not_convert=[])


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _time_ms(fn, iters=20):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


@pytest.mark.parametrize("method", ["w8a16", "fp8", "nvfp4"])
@pytest.mark.parametrize("tokens", [1, 1037])
def test_lora_on_quantized_layer_gpu(method, tokens):
    from peft import LoraConfig
    from peft.tuners.lora import Linear as LoraLinear

    from diffusers_h3.quantizers import describe_layer, is_quantized_linear, quantize

    torch.manual_seed(0)
    hidden, rank = 2048, 64
    model = nn.Sequential(nn.Linear(hidden, 3 * hidden, bias=False), nn.Linear(3 * hidden, hidden)).cuda().bfloat16()
    quantize(model, _config(method))
    assert all(is_quantized_linear(m) for m in model)
    dense = [nn.Linear(m.in_features, m.out_features).cuda().bfloat16() for m in model]
    for d, q in zip(dense, model):
        d.weight.data.copy_(q.weight.dequantize(torch.bfloat16))
        d.bias = None if q.bias is None else nn.Parameter(q.bias.data.clone())

    config = LoraConfig(r=rank, lora_alpha=rank / 2, target_modules=["0", "1"])
    from peft import inject_adapter_in_model

    inject_adapter_in_model(config, model, adapter_name="a")
    for layer in model:
        assert isinstance(layer, LoraLinear) and is_quantized_linear(layer.get_base_layer())
        nn.init.normal_(layer.lora_A["a"].weight, std=0.02)
        nn.init.normal_(layer.lora_B["a"].weight, std=0.02)

    for i, layer in enumerate(model):
        x = torch.randn(tokens, layer.in_features, device="cuda", dtype=torch.bfloat16)
        out = torch.full((tokens, layer.out_features), float("nan"), device="cuda", dtype=torch.bfloat16)
        out.copy_(layer(x))
        base = layer.get_base_layer()(x)
        A, B = layer.lora_A["a"].weight.float(), layer.lora_B["a"].weight.float()
        oracle = base.float() + (x.float() @ A.T @ B.T) * 0.5
        assert torch.isfinite(out).all()
        assert _rel(out, oracle) < 1e-2, (method, i, _rel(out, oracle))
        if method != "fp8":  # weight-only methods: same as LoRA over the dequantized bf16 layer
            ref = dense[i](x).float() + (x.float() @ A.T @ B.T) * 0.5
            assert _rel(out, ref) < 2e-2, (method, i, _rel(out, ref))

        if tokens > 1:
            base_ms = _time_ms(lambda: layer.get_base_layer()(x))
            lora_ms = _time_ms(lambda: layer(x))
            print(f"\n{method} {layer.in_features}x{layer.out_features} tokens={tokens}: base {base_ms:.3f} ms, "
                  f"with unfused LoRA r={rank} {lora_ms:.3f} ms ({lora_ms / base_ms:.2f}x); "
                  f"{describe_layer(layer)}")

    before = [{k: v.clone() for k, v in layer.get_base_layer().state_dict().items()} for layer in model]
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    unfused = model(x)
    for layer in model:
        layer.merge()
    # fusing re-quantizes W + BA: one more rounding of the whole weight (coarse for FP4)
    assert _rel(model(x), unfused) < (0.25 if method == "nvfp4" else 0.1)
    for layer, saved in zip(model, before):
        layer.unmerge()
        for k, v in layer.get_base_layer().state_dict().items():
            assert torch.equal(v, saved[k]), k
