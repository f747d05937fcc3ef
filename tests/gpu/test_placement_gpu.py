"""GPU checks of the low-memory offload recipe: quantized components stream through the GPU and go back.

Run on the device machine: ``python -m pytest tests/gpu/test_placement_gpu.py -m gpu -q``.
"""

import pytest
import torch

from diffusers_h3.parallel.placement import enable_low_memory_offload
from diffusers_h3.quantizers import QuantizedTensor, W8A16Config, quantize
from diffusers_h3.testing.tiny import tiny_pipeline


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

RUN = {"prompt": "a drum", "height": 32, "width": 32, "num_frames": 124, "num_inference_steps": 3,
       "output_type": "latent"}  # fmt: skip


def _quantized_pipeline():
    pipe = tiny_pipeline(seed=4)
    quantize(pipe.transformer, W8A16Config())
    quantize(pipe.text_encoder, W8A16Config())
    return pipe


def _on_cuda(module):
    tensors = list(module.named_parameters()) + list(module.named_buffers())
    return [name for name, t in tensors if t.device.type == "cuda"]


def test_stream_offload_returns_quantized_buffers_to_the_cpu():
    reference = _quantized_pipeline().to("cuda")
    expected = reference(**RUN, generator=torch.Generator().manual_seed(0))

    pipe = _quantized_pipeline()
    # quantized weights are parameters holding the packed tensors: group offload moves them like any parameter
    assert any(isinstance(p, QuantizedTensor) for p in pipe.transformer.parameters())
    placements = enable_low_memory_offload(pipe, "cuda")
    assert "stream=True" in placements["transformer"]
    for _ in range(2):  # the second request runs with the prefetch order learned in the first
        got = pipe(**RUN, generator=torch.Generator().manual_seed(0))
        torch.cuda.synchronize()
        assert _on_cuda(pipe.transformer) == [], "transformer tensors left on the GPU after the request"
        assert _on_cuda(pipe.text_encoder) == [], "text encoder tensors left on the GPU after the request"
    torch.testing.assert_close(got.frames, expected.frames, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got.audio, expected.audio, atol=1e-5, rtol=1e-4)


def test_lora_loaded_after_stream_offload_keeps_the_recipe(tmp_path):
    """diffusers rebuilds the offload groups around a LoRA load: the new groups must send the quantized buffers back
    too, and the LoRA weights must travel with their groups."""
    from ..loaders._lora_helpers import canonical_lora, save_lora, write_layout
    from ..loaders._lora_helpers import tiny_transformer as lora_transformer

    config = {k: _quantized_pipeline().transformer.config[k] for k in ("attention_head_dim", "num_attention_heads")}
    path = save_lora(tmp_path / "l.safetensors", write_layout(canonical_lora(lora_transformer(**config), seed=7), "native"))
    reference = _quantized_pipeline()
    reference.load_lora_weights(path, "style")
    expected = reference.to("cuda")(**RUN, generator=torch.Generator().manual_seed(0))

    pipe = _quantized_pipeline()
    enable_low_memory_offload(pipe, "cuda")
    pipe.load_lora_weights(path, "style")
    for _ in range(2):
        got = pipe(**RUN, generator=torch.Generator().manual_seed(0))
        torch.cuda.synchronize()
        assert _on_cuda(pipe.transformer) == [], "transformer tensors left on the GPU after the request"
    torch.testing.assert_close(got.frames, expected.frames, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got.audio, expected.audio, atol=1e-5, rtol=1e-4)
