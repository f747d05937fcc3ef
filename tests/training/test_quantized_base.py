"""Training over a quantized or streamed base: the LoRA's gradients are the dequantized model's."""

import pytest
import torch
import torch.utils.checkpoint
from peft import LoraConfig

from .conftest import train_config


TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "net.0.proj", "net.2"]
# rel-L2 of the LoRA gradients against the dequantized model's. In float32 the weight-only formats compute the same
# product (rounding order only); in bf16 the dequantized weight is rounded to bf16 while the quantized product runs in
# float32. FP8's forward also rounds the activations per token to E4M3 (its backward passes that straight through).
FORMAT_TOLERANCE = {
    (torch.float32, "w8a16"): 1e-4, (torch.float32, "nvfp4"): 1e-4, (torch.float32, "fp8"): 1.5e-1,
    (torch.bfloat16, "w8a16"): 6e-2, (torch.bfloat16, "nvfp4"): 6e-2, (torch.bfloat16, "fp8"): 1.5e-1,
}


def _with_lora(model):
    model.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=TARGETS))
        for name, param in model.named_parameters():
            param.requires_grad_("lora_" in name)
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.2)  # non-zero B: every factor gets a gradient
    return model


def _lora_gradients(model, seed=0):
    from diffusers_h3.testing.tiny import tiny_transformer_inputs

    inputs = tiny_transformer_inputs(seed=seed)
    dtype = next(p.dtype for n, p in model.named_parameters() if "context_embedder" in n)
    device = next(p.device for n, p in model.named_parameters() if "lora_" in n)
    inputs = {k: (v.to(dtype) if v.is_floating_point() else v).to(device) for k, v in inputs.items()}
    video, audio = model(**inputs, return_dict=False)
    (video.float().square().mean() + audio.float().square().mean()).backward()
    return {name: param.grad.float().clone() for name, param in model.named_parameters() if param.requires_grad}


@pytest.mark.parametrize("dtype,method", sorted(FORMAT_TOLERANCE, key=str))
def test_gradients_over_a_quantized_base_match_the_dequantized_model(dtype, method):
    import diffusers_h3
    from diffusers_h3.quantizers import QuantizedTensor
    from diffusers_h3.quantizers.registry import get_format
    from diffusers_h3.testing.tiny import tiny_transformer

    torch.manual_seed(0)
    quantized = tiny_transformer().to(dtype)
    dequantized = tiny_transformer().to(dtype)
    dequantized.load_state_dict(quantized.state_dict())
    diffusers_h3.quantize(quantized, get_format(method).config_cls())
    layers = 0
    for (name, module), (_, dense) in zip(quantized.named_modules(), dequantized.named_modules()):
        weight = getattr(module, "weight", None)
        if isinstance(weight, QuantizedTensor):  # the dense model runs the weights the quantized one holds
            dense.weight = torch.nn.Parameter(weight.dequantize(dtype), requires_grad=False)
            layers += 1
    assert layers > 0
    got = _lora_gradients(_with_lora(quantized).train())
    want = _lora_gradients(_with_lora(dequantized).train())
    assert got.keys() == want.keys() and len(got) == 2 * 6 * 3  # A and B of 6 targets in 3 blocks
    for name in want:
        error = (got[name] - want[name]).norm() / want[name].norm()
        assert error < FORMAT_TOLERANCE[dtype, method], (name, error.item())


def test_quantized_linear_backward_is_the_dequantized_weights():
    """F.linear over a quantized weight: the forward is the inference product bitwise, grad_x is grad @ W_deq, the
    weight gets no gradient."""
    from diffusers_h3.quantizers.tensors import W8A16Tensor

    weight = W8A16Tensor.from_float(torch.randn(24, 32))
    x = torch.randn(5, 32, requires_grad=True)
    out = torch.nn.functional.linear(x, weight)
    with torch.no_grad():
        assert torch.equal(out, torch.nn.functional.linear(x, weight))
    grad = torch.randn_like(out)
    out.backward(grad)
    assert torch.allclose(x.grad, grad @ weight.dequantize(torch.float32), atol=1e-6)
    assert weight.grad is None


def test_streamed_base_trains_like_the_resident_one(tmp_path, two_clip_folder, demo_model, shared_cache):
    """`stream_base=True` reads each block from the checkpoint files in the forward and again in the recomputed
    forward of the backward: the same losses and LoRA, bitwise."""
    from safetensors.torch import load_file

    from diffusers_h3.training import train_lora

    runs = {}
    for stream in (False, True):
        runs[stream] = train_lora(train_config(demo_model, two_clip_folder, tmp_path / str(stream), shared_cache,
                                               max_train_steps=3, checkpointing_steps=0, stream_base=stream))  # fmt: skip
    assert runs[True].losses == runs[False].losses
    a, b = (load_file(str(runs[s].files["diffusers"])) for s in (False, True))
    assert all(torch.equal(a[key], b[key]) for key in a)


def test_streamed_quantized_checkpoint_gradients_are_bitwise(tmp_path):
    """A pre-quantized (W8A16) DiT streamed from its files: LoRA gradients equal the resident model's, with gradient
    checkpointing (blocks re-read in the backward) and without it for the groups outside the checkpointed blocks."""
    from diffusers import MiniMaxH3Transformer3DModel

    import diffusers_h3
    from diffusers_h3._hooks import H3_CHECKPOINT_STREAM_MODEL_HOOK, get_h3_hook
    from diffusers_h3.parallel.checkpoint_streaming import stream_from_checkpoint, streaming_of
    from diffusers_h3.testing.tiny import tiny_transformer

    torch.manual_seed(0)
    model = tiny_transformer()
    diffusers_h3.quantize(model, diffusers_h3.W8A16Config())
    model.save_pretrained(tmp_path)
    grads = {}
    for stream in (False, True):
        loaded = _with_lora(MiniMaxH3Transformer3DModel.from_pretrained(tmp_path))
        loaded.enable_gradient_checkpointing()
        loaded.train()
        if stream:
            stream_from_checkpoint(loaded, tmp_path, "cpu", resident_below_bytes=0)
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):  # as the trainer runs it
            grads[stream] = _lora_gradients(loaded)
        if stream:
            assert streaming_of(loaded).stats.group_loads > streaming_of(loaded).groups  # re-read in the backward
            streamer = get_h3_hook(loaded, H3_CHECKPOINT_STREAM_MODEL_HOOK).streamer
            assert not streamer.running  # every recomputed block released its weights
    for name in grads[False]:
        assert torch.equal(grads[True][name], grads[False][name]), name


@pytest.mark.parametrize("method", ["w8a16", "nvfp4"])
def test_train_lora_quantizes_the_base_on_load(method, tmp_path, two_clip_folder, demo_model, shared_cache):
    """`quantize=` loads the DiT quantized (frozen packed weights, LoRA factors on top) and trains."""
    import math

    from diffusers_h3.quantizers import QuantizedTensor
    from diffusers_h3.training import train_lora
    from diffusers_h3.training.trainer import add_lora, load_base_transformer

    config = train_config(demo_model, two_clip_folder, tmp_path, shared_cache, max_train_steps=2, checkpointing_steps=0,
                          quantize=method)  # fmt: skip
    transformer, _ = load_base_transformer(config, "cpu")
    add_lora(transformer, config)
    quantized = [m for m in transformer.modules() if isinstance(getattr(m, "weight", None), QuantizedTensor)]
    assert quantized and all(not m.weight.requires_grad for m in quantized)
    result = train_lora(config)
    assert all(math.isfinite(loss) for loss in result.losses)
    assert result.files["diffusers"].is_file()


@pytest.mark.parametrize("kind", ["comfy_safetensors", "gguf_q8_0", "fp8_scaled"])
def test_train_lora_on_a_single_file_base(kind, tmp_path, two_clip_folder, demo_model, shared_cache):
    """A ComfyUI-named safetensors, a GGUF (Q8_0) and an fp8-scaled DiT file train: the LoRA's B factors (zero at
    start) move, so gradients crossed the file's layers."""
    import math

    from safetensors.torch import load_file

    from diffusers_h3.testing import single_file
    from diffusers_h3.training import train_lora
    from diffusers_h3.training.cache import _load_pipeline

    base = _load_pipeline(demo_model, ("transformer",), "t2va", torch.float32, "cpu").transformer
    path = tmp_path / ("dit.gguf" if kind.startswith("gguf") else "dit.safetensors")
    if kind == "gguf_q8_0":
        single_file.write_gguf(base, path, kind="Q8_0")
    elif kind == "fp8_scaled":
        single_file.write_fp8_scaled_safetensors(base, path)
    else:
        single_file.write_comfy_safetensors(base, path, dtype=torch.float32)
    config = train_config(demo_model, two_clip_folder, tmp_path / "out", shared_cache, max_train_steps=2,
                          checkpointing_steps=0, transformer_file=str(path))  # fmt: skip
    result = train_lora(config)
    assert all(math.isfinite(loss) for loss in result.losses)
    factors = load_file(str(result.files["diffusers"]))
    assert any(value.abs().sum() > 0 for key, value in factors.items() if "lora_B" in key)


def test_streamed_base_reads_ahead_in_the_backward_too(tmp_path):
    """Once the reader has seen a whole step (forward, the backward's reversed recomputation, the next step's start),
    every read is started ahead: no miss in the third step."""
    from diffusers import MiniMaxH3Transformer3DModel

    import diffusers_h3
    from diffusers_h3.parallel.checkpoint_streaming import stream_from_checkpoint, streaming_of
    from diffusers_h3.testing.tiny import tiny_transformer

    torch.manual_seed(0)
    model = tiny_transformer(num_layers=6)
    diffusers_h3.quantize(model, diffusers_h3.W8A16Config())
    model.save_pretrained(tmp_path)
    loaded = _with_lora(MiniMaxH3Transformer3DModel.from_pretrained(tmp_path))
    loaded.enable_gradient_checkpointing()
    loaded.train()
    stream_from_checkpoint(loaded, tmp_path, "cpu", resident_below_bytes=0)
    stats = streaming_of(loaded).stats
    counts = []
    for _ in range(3):
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            _lora_gradients(loaded)
        counts.append((stats.misses, stats.prefetch_hits, stats.group_loads))
    (_, hits_before, loads_before), (misses, hits, loads) = counts[1], counts[2]
    assert misses == counts[1][0], counts
    assert hits - hits_before == loads - loads_before > streaming_of(loaded).groups, counts  # blocks read twice
