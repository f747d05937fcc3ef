"""LoRA on quantized linears through PEFT's own ``lora.Linear`` (a quantized layer is an ``nn.Linear`` whose weight is
a quantized tensor): numerics vs. the dequantized dense layer, fuse / unfuse, set_adapters, hotswap, unload."""

from __future__ import annotations

import pytest
import torch
from peft.tuners.lora import Linear as LoraLinear
from torch import nn

from diffusers_h3.quantizers import W8A16Config, describe_layer, is_quantized_linear, quantize

from ._lora_helpers import (
    TinyLoraPipeline,
    assert_deltas,
    canonical_lora,
    dense_twin,
    save_lora,
    tiny_transformer,
    write_layout,
)


def _layer_inputs(model, names, seed=0, tokens=(3, 7)):
    """Fresh random inputs (odd sizes) for the named linear-like modules."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(names):
        module = model.get_submodule(name)
        base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
        dtype = getattr(base, "compute_dtype", None) or base.weight.dtype
        out[name] = torch.randn(*tokens, base.in_features, generator=g).to(dtype)
    return out


def _outputs(model, inputs):
    with torch.no_grad():
        return {name: model.get_submodule(name)(x) for name, x in inputs.items()}


def _quantized_pipe(seed=0, dtype=torch.float32):
    model = tiny_transformer(seed)
    model = quantize(model if dtype == torch.float32 else model.to(dtype), W8A16Config(modules_to_not_convert=[]),
                     keep_in_fp32_modules=[])
    return model, TinyLoraPipeline(transformer=model)


@pytest.mark.parametrize("layout", ["diffusers", "native", "musubi"])
def test_lora_on_quantized_equals_lora_on_dequantized_dense(tmp_path, layout):
    qmodel, qpipe = _quantized_pipe()
    dmodel = dense_twin(qmodel)
    dpipe = TinyLoraPipeline(transformer=dmodel)
    lora = canonical_lora(dmodel, seed=31)
    path = save_lora(tmp_path / "l.safetensors", write_layout(lora, layout))

    report = qpipe.load_lora_weights(path, "a")
    dpipe.load_lora_weights(path, "a")

    assert report.components["transformer"].quantized_modules == {"h3_w8a16": len(lora)}
    wrapped = qmodel.transformer_blocks[0].attn.to_q
    assert isinstance(wrapped, LoraLinear) and is_quantized_linear(wrapped.get_base_layer())
    assert wrapped.get_base_layer().weight.qdata.dtype == torch.int8  # the base weight stays quantized
    assert_deltas(qmodel, lora, "a")

    inputs = _layer_inputs(dmodel, lora, seed=1)
    q_out, d_out = _outputs(qmodel, inputs), _outputs(dmodel, inputs)
    for name in inputs:
        torch.testing.assert_close(q_out[name], d_out[name], atol=1e-5, rtol=1e-5, msg=name)
    # and the LoRA really contributes
    base = {n: qmodel.get_submodule(n).get_base_layer()(x) for n, x in inputs.items()}
    assert all((q_out[n] - base[n]).abs().max() > 1e-3 for n in inputs)
    line = describe_layer(wrapped)
    assert line.startswith("LoRA [a(r=") and "over W8A16Linear[h3_w8a16] on cpu" in line and "unfused" in line


def test_bf16_quantized_lora_within_bf16_tolerance():
    qmodel, qpipe = _quantized_pipe(dtype=torch.bfloat16)
    dmodel = dense_twin(qmodel)
    assert dmodel.dtype == torch.bfloat16
    lora = canonical_lora(dmodel, seed=32)
    qpipe.load_lora_weights(write_layout(lora, "diffusers"), "a")
    TinyLoraPipeline(transformer=dmodel).load_lora_weights(write_layout(lora, "diffusers"), "a")
    inputs = _layer_inputs(dmodel, lora, seed=2)
    q_out, d_out = _outputs(qmodel, inputs), _outputs(dmodel, inputs)
    for name in inputs:
        assert q_out[name].dtype == torch.bfloat16
        scale = d_out[name].float().abs().max().clamp_min(1e-3)
        assert ((q_out[name].float() - d_out[name].float()).abs().max() / scale) < 2e-2, name


def test_fuse_requantizes_and_unfuse_restores_bitwise():
    qmodel, pipe = _quantized_pipe()
    lora = canonical_lora(dense_twin(qmodel), seed=33)
    pipe.load_lora_weights(write_layout(lora, "diffusers"), "a")
    inputs = _layer_inputs(qmodel, lora, seed=3)
    unfused = _outputs(qmodel, inputs)
    before = {k: v.clone() for k, v in qmodel.state_dict().items() if "lora" not in k}

    pipe.fuse_lora()
    layer = qmodel.transformer_blocks[1].ff.net[2]
    assert layer.merged and layer.get_base_layer().weight.qdata.dtype == torch.int8
    assert "fused into the re-quantized weight (a)" in describe_layer(layer)
    assert not torch.equal(layer.get_base_layer().weight.qdata, before["transformer_blocks.1.ff.net.2.base_layer.weight"])
    fused = _outputs(qmodel, inputs)
    for name in inputs:
        # fused = requantize(W + BA): equal to the unfused LoRA output up to int8 rounding of the new weight
        ref = unfused[name]
        err = (fused[name] - ref).abs().max() / ref.abs().max()
        assert err < 3e-2, (name, err)

    pipe.unfuse_lora()
    after = {k: v for k, v in qmodel.state_dict().items() if "lora" not in k}
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    for name, out in _outputs(qmodel, inputs).items():
        torch.testing.assert_close(out, unfused[name], atol=0, rtol=0)


def test_fuse_unfuse_on_dense_layers_restores_weights():
    model = tiny_transformer(4)
    pipe = TinyLoraPipeline(transformer=model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lora = canonical_lora(model, seed=34)
    pipe.load_lora_weights(write_layout(lora, "diffusers"), "a")
    pipe.fuse_lora()
    w = model.transformer_blocks[0].attn.to_q.base_layer.weight
    torch.testing.assert_close(w - before["transformer_blocks.0.attn.to_q.weight"],
                               lora["transformer_blocks.0.attn.to_q"][1] @ lora["transformer_blocks.0.attn.to_q"][0])
    pipe.unfuse_lora()
    pipe.unload_lora_weights()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], atol=1e-6, rtol=0, msg=key)


def test_set_adapters_weights_disable_and_unload_on_quantized():
    qmodel, pipe = _quantized_pipe()
    dense = dense_twin(qmodel)  # canonical_lora walks nn.Linear: take the names from the dense twin
    l1, l2 = canonical_lora(dense, seed=35), canonical_lora(dense, seed=36)
    inputs = _layer_inputs(qmodel, l1, seed=5)
    plain = _outputs(qmodel, inputs)
    pipe.load_lora_weights(write_layout(l1, "diffusers"), "one")
    pipe.load_lora_weights(write_layout(l2, "peft_dump"), "two")
    pipe.set_adapters(["one", "two"], [1.0, 0.5])

    out = _outputs(qmodel, inputs)
    for name, x in inputs.items():
        A1, B1 = l1[name]
        A2, B2 = l2[name]
        expected = plain[name] + x @ (B1 @ A1).T + 0.5 * (x @ (B2 @ A2).T)
        torch.testing.assert_close(out[name], expected, atol=1e-5, rtol=1e-5, msg=name)

    pipe.disable_lora()
    for name, o in _outputs(qmodel, inputs).items():
        torch.testing.assert_close(o, plain[name], atol=0, rtol=0)
    pipe.enable_lora()

    pipe.unload_lora_weights()
    assert is_quantized_linear(qmodel.transformer_blocks[0].attn.to_q)
    for name, o in _outputs(qmodel, inputs).items():
        torch.testing.assert_close(o, plain[name], atol=0, rtol=0)


def test_hotswap_on_quantized(tmp_path):
    qmodel, pipe = _quantized_pipe()
    dense = dense_twin(qmodel)
    l1, l2 = canonical_lora(dense, seed=37), canonical_lora(dense, seed=38)
    pipe.load_lora_weights(save_lora(tmp_path / "1.safetensors", write_layout(l1, "diffusers")), "hot")
    wrapper = qmodel.transformer_blocks[0].attn.to_q
    report = pipe.load_lora_weights(save_lora(tmp_path / "2.safetensors", write_layout(l2, "diffusers")), "hot",
                                    hotswap=True)
    assert report.hotswap and report.adapter_name == "hot"
    assert qmodel.transformer_blocks[0].attn.to_q is wrapper  # swapped in place, no new modules
    assert_deltas(qmodel, l2, "hot")


def test_low_cpu_mem_usage_false_and_manual_add_adapter():
    qmodel, pipe = _quantized_pipe()
    lora = canonical_lora(dense_twin(qmodel), seed=39)
    pipe.load_lora_weights(write_layout(lora, "diffusers"), "slow", low_cpu_mem_usage=False)
    assert_deltas(qmodel, lora, "slow")

    # Building the LoraConfig yourself: diffusers' add_adapter and PEFT's own inject_adapter_in_model take it as is.
    from peft import LoraConfig, inject_adapter_in_model

    model = quantize(tiny_transformer(6), W8A16Config())
    model.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_v"]), adapter_name="plain")
    assert isinstance(model.transformer_blocks[0].attn.to_q, LoraLinear)
    model = quantize(tiny_transformer(6), W8A16Config())
    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_v"]), model, adapter_name="c")
    assert isinstance(model.transformer_blocks[0].attn.to_q, LoraLinear)


def test_unsupported_variants_raise_clearly():
    qmodel, pipe = _quantized_pipe()
    from peft import LoraConfig

    with pytest.raises(NotImplementedError, match="quantized weight"):
        qmodel.add_adapter(LoraConfig(r=2, target_modules=["to_q"], use_dora=True), adapter_name="dora")


# ----------------------------------------------------------------------------------------------------------------------
# The real quantized layers (diffusers_h3.quantizers: W8A16 / NVFP4 / FP8)
# ----------------------------------------------------------------------------------------------------------------------
def _real_config(method):
    from diffusers_h3.quantizers import FP8Config, NVFP4Config, W8A16Config

    return {"w8a16": W8A16Config, "nvfp4": NVFP4Config, "fp8": FP8Config}[method]()


@pytest.mark.parametrize("method", ["w8a16", "nvfp4", "fp8"])
def test_real_quantized_layers(tmp_path, method):

    qmodel = quantize(tiny_transformer(7), _real_config(method))
    pipe = TinyLoraPipeline(transformer=qmodel)
    dense = dense_twin(qmodel, seed=7)
    lora = canonical_lora(dense, seed=40)
    quantized_names = [n for n, m in qmodel.named_modules() if is_quantized_linear(m)]
    assert quantized_names  # the tiny model has quantized and dense (kept) linears: one adapter spans both
    before = {k: v.clone() for k, v in qmodel.state_dict().items()}

    report = pipe.load_lora_weights(save_lora(tmp_path / "l.safetensors", write_layout(lora, "native")), "a")
    counts = report.components["transformer"].quantized_modules
    assert counts == {f"h3_{method}": len(quantized_names)}
    assert_deltas(qmodel, lora, "a")

    inputs = _layer_inputs(qmodel, lora, seed=8)
    out = _outputs(qmodel, inputs)
    with torch.no_grad():
        for name, x in inputs.items():
            layer = qmodel.get_submodule(name)
            A, B = lora[name]
            # base path unchanged + LoRA of the unquantized input
            expected = layer.get_base_layer()(x) + x @ (B @ A).T
            torch.testing.assert_close(out[name], expected, atol=1e-4, rtol=1e-4, msg=name)
            if method != "fp8":  # weight-only: also equal to LoRA on the dequantized dense layer
                d_layer = dense.get_submodule(name)
                torch.testing.assert_close(out[name], d_layer(x) + x @ (B @ A).T, atol=1e-4, rtol=1e-4, msg=name)
    assert f"[h3_{method}] on cpu" in describe_layer(qmodel.get_submodule(quantized_names[0]))

    # fuse re-quantizes W + BA; unfuse restores the packed tensors bit-exactly
    pipe.fuse_lora()
    fused = _outputs(qmodel, inputs)
    for name in quantized_names:
        err = (fused[name] - out[name]).abs().max() / out[name].abs().max()
        assert err < (0.25 if method == "nvfp4" else 0.06), (name, err)
    pipe.unfuse_lora()
    pipe.unload_lora_weights()
    for key, value in qmodel.state_dict().items():
        if key.rpartition(".")[0] in quantized_names:
            assert torch.equal(value, before[key]), key  # packed storage: bit-exact
        else:
            torch.testing.assert_close(value, before[key], atol=1e-6, rtol=0, msg=key)  # dense: B@A subtracted
    assert all(is_quantized_linear(qmodel.get_submodule(n)) for n in quantized_names)


def test_hotswap_with_different_rank_after_enable_lora_hotswap():
    qmodel, pipe = _quantized_pipe()
    dense = dense_twin(qmodel)
    # uniform ranks: PEFT hotswap requires equal alpha_pattern (mixed-rank alpha-less files differ there)
    l1, l2 = canonical_lora(dense, 4, 4, seed=41), canonical_lora(dense, 6, 6, seed=42)
    pipe.enable_lora_hotswap(target_rank=8)
    pipe.load_lora_weights(write_layout(l1, "diffusers"), "hot")
    pipe.load_lora_weights(write_layout(l2, "diffusers"), "hot", hotswap=True)
    inputs = _layer_inputs(qmodel, l2, seed=9)
    out = _outputs(qmodel, inputs)
    for name, x in inputs.items():
        A, B = l2[name]
        expected = qmodel.get_submodule(name).get_base_layer()(x) + x @ (B @ A).T
        torch.testing.assert_close(out[name], expected, atol=1e-5, rtol=1e-5, msg=name)


def test_quantized_transformer_ref_partition(tmp_path):

    fl2v = tiny_transformer(0)
    ref = quantize(tiny_transformer(8), _real_config("fp8"))
    pipe = TinyLoraPipeline(transformer=fl2v, transformer_ref=ref)
    lora = canonical_lora(dense_twin(ref, seed=8), seed=43)
    report = pipe.load_lora_weights(write_layout(lora, "diffusers_ref"), "r")
    assert list(report.components) == ["transformer_ref"]
    num_quantized = sum(is_quantized_linear(m) for m in ref.modules())
    assert report.components["transformer_ref"].quantized_modules == {"h3_fp8": num_quantized}
    assert_deltas(ref, lora, "r")
    assert not hasattr(fl2v, "peft_config")


def test_gradients_reach_the_lora_factors_only():
    qmodel, pipe = _quantized_pipe()
    lora = canonical_lora(dense_twin(qmodel), seed=44)
    pipe.load_lora_weights(write_layout(lora, "diffusers"), "tuned")
    layer = qmodel.transformer_blocks[0].ff.net[2]
    layer.lora_A["tuned"].weight.requires_grad_(True)
    layer.lora_B["tuned"].weight.requires_grad_(True)
    x = torch.randn(5, layer.in_features, requires_grad=True)
    out = layer(x)
    A, B = lora["transformer_blocks.0.ff.net.2"]
    torch.testing.assert_close(out, layer.get_base_layer()(x) + x @ (B @ A).T, atol=1e-5, rtol=1e-5)
    out.square().sum().backward()
    assert layer.lora_A["tuned"].weight.grad is not None and layer.lora_B["tuned"].weight.grad.abs().sum() > 0
    assert x.grad is not None and torch.isfinite(x.grad).all()


# ----------------------------------------------------------------------------------------------------------------------
# diffusers' own add_adapter (PEFT's injection path) on the real quantized layers
# ----------------------------------------------------------------------------------------------------------------------
_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "net.0.proj", "net.2"]


def _add_random_adapter(model, name, seed, rank=4):
    """``model.add_adapter`` with a plain LoraConfig, then a random (non-zero) lora_B."""
    from peft import LoraConfig

    model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=_TARGETS), adapter_name=name)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, param in model.named_parameters():
            if f"lora_B.{name}." in key:
                param.copy_(torch.randn(param.shape, generator=g) * 0.2)


def _dequantized_twin(model):
    """A copy of ``model`` whose quantized linears are plain nn.Linear holding ``dequantize()`` (and the bias)."""
    import copy

    twin = copy.deepcopy(model)
    for module in twin.modules():
        if is_quantized_linear(module):
            module.weight = nn.Parameter(module.weight.dequantize(torch.float32))
    return twin


def _copy_lora(source, target):
    lora = {k: v for k, v in source.state_dict().items() if ".lora_" in k}
    missing = set(lora) - set(target.state_dict())
    assert not missing, sorted(missing)[:4]
    target.load_state_dict(lora, strict=False)


def _dit_loss(model, inputs):
    video, audio = model(**inputs, return_dict=False)
    return video, audio, video.square().mean() + audio.square().mean()


@pytest.mark.parametrize("method", ["w8a16", "fp8", "nvfp4"])
def test_add_adapter_on_quantized_dit_forward_and_gradients(method):
    """diffusers' add_adapter with a plain LoraConfig on a W8A16 / FP8 / NVFP4 DiT: forward equals LoRA on the
    dequantized dense layers (diffusers + PEFT's own nn.Linear LoRA), and backward reaches the LoRA factors only."""
    from diffusers_h3.quantizers import FP8Config
    from diffusers_h3.testing.tiny import tiny_transformer_inputs

    # FP8 with the dequantize backend: weight-only numerics, so that the plain-Linear reference is exact (the LoRA
    # layer does not depend on the base layer's path; the default W8A8 path is covered by test_real_quantized_layers).
    config = FP8Config(backend="dequant") if method == "fp8" else _real_config(method)
    qmodel = quantize(tiny_transformer(11), config)
    reference = _dequantized_twin(qmodel)
    _add_random_adapter(qmodel, "tuned", seed=12)
    reference.add_adapter(qmodel.peft_config["tuned"].__class__(r=4, lora_alpha=4, target_modules=_TARGETS),
                          adapter_name="tuned")
    _copy_lora(qmodel, reference)
    wrapped = [m for m in qmodel.modules() if isinstance(m, LoraLinear) and is_quantized_linear(m.get_base_layer())]
    assert wrapped and all(is_quantized_linear(m.get_base_layer()) for m in wrapped)

    inputs = tiny_transformer_inputs(seed=13)
    q_video, q_audio, q_loss = _dit_loss(qmodel, inputs)
    r_video, r_audio, r_loss = _dit_loss(reference, inputs)
    torch.testing.assert_close(q_video, r_video, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(q_audio, r_audio, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        qmodel.disable_adapters()
        assert not torch.allclose(qmodel(**inputs, return_dict=False)[0], q_video, atol=1e-4)  # the LoRA contributes
        qmodel.enable_adapters()

    q_loss.backward()
    r_loss.backward()
    grads = {n: p.grad for n, p in qmodel.named_parameters() if p.grad is not None}
    assert grads and all(".lora_A." in n or ".lora_B." in n for n in grads), sorted(grads)[:4]
    assert all(p.grad is not None for n, p in qmodel.named_parameters() if ".lora_" in n)
    assert all(not m.weight.requires_grad for m in qmodel.modules() if is_quantized_linear(m))
    ref_grads = dict(reference.named_parameters())
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name].grad, atol=1e-5, rtol=1e-4, msg=name)


def test_add_adapter_set_disable_delete_fuse_on_quantized_dit():
    """The rest of diffusers' adapter API on adapters added with add_adapter to a W8A16 DiT."""
    from diffusers_h3.testing.tiny import tiny_transformer_inputs

    qmodel = quantize(tiny_transformer(14), W8A16Config())
    packed = {k: v.clone() for k, v in qmodel.state_dict().items()}
    inputs = tiny_transformer_inputs(seed=15)

    def run():
        with torch.no_grad():
            return qmodel(**inputs, return_dict=False)[0]

    plain = run()
    _add_random_adapter(qmodel, "one", seed=16)
    one = run()
    _add_random_adapter(qmodel, "two", seed=17)
    qmodel.set_adapters(["one", "two"], [1.0, 0.0])
    torch.testing.assert_close(run(), one, atol=1e-6, rtol=0)
    qmodel.set_adapters(["one", "two"], [1.0, 0.5])
    both = run()
    assert not torch.allclose(both, one, atol=1e-4)

    qmodel.disable_adapters()
    torch.testing.assert_close(run(), plain, atol=0, rtol=0)
    qmodel.enable_adapters()
    torch.testing.assert_close(run(), both, atol=0, rtol=0)

    qmodel.fuse_lora()  # re-quantizes W + BA (docs/lora.md): equal up to int8 rounding of the new weight
    layer = qmodel.transformer_blocks[0].attn.to_q
    assert layer.merged and is_quantized_linear(layer.get_base_layer())
    assert ((run() - both).abs().max() / both.abs().max()) < 5e-2
    qmodel.unfuse_lora()
    torch.testing.assert_close(run(), both, atol=1e-6, rtol=0)

    qmodel.delete_adapters("two")
    qmodel.set_adapters("one")
    torch.testing.assert_close(run(), one, atol=1e-6, rtol=0)
    qmodel.delete_adapters("one")
    torch.testing.assert_close(run(), plain, atol=0, rtol=0)
    for key, value in packed.items():  # the packed weights went through fuse / unfuse bit-exactly
        base_key = key.replace(key.rpartition(".")[0], key.rpartition(".")[0] + ".base_layer", 1)
        current = qmodel.state_dict().get(key, qmodel.state_dict().get(base_key))
        assert current is not None and torch.equal(current, value), key
