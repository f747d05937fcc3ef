"""`get_memory_footprint()` (diffusers' and transformers') of a quantized model counts the packed weights."""

import pytest
import torch

from diffusers_h3.quantizers import quantize
from diffusers_h3.quantizers.tensors import QuantizedTensor
from diffusers_h3.testing.tiny import tiny_text_encoder, tiny_transformer

from ._helpers import CONFIGS


def _held_bytes(model) -> int:
    """What the model holds, from the tensors themselves: each quantized weight's inner tensors (codes and scales),
    every other parameter and buffer at its dtype."""
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if isinstance(tensor, QuantizedTensor):
            inner = [getattr(tensor, name) for name in tensor.__tensor_flatten__()[0]]
            total += sum(t.untyped_storage().nbytes() for t in inner)
        else:
            total += tensor.numel() * tensor.element_size()
    return total


@pytest.mark.parametrize("method", list(CONFIGS))
@pytest.mark.parametrize("model_name", ["transformer", "text_encoder"])
def test_footprint_of_a_quantized_model_is_its_packed_size(method, model_name):
    """It reported the dense size (the tiny W8A16 DiT in fp32: 271,536 B reported, 96,432 B held)."""
    torch.manual_seed(0)
    model = tiny_transformer() if model_name == "transformer" else tiny_text_encoder(num_hidden_layers=2)
    dense = model.get_memory_footprint()
    quantize(model, CONFIGS[method]())
    weights = [p for p in model.parameters() if isinstance(p, QuantizedTensor)]
    assert weights, "nothing was quantized"
    held = _held_bytes(model)
    # Each weight's packed bytes are counted in whole logical elements: at most element_size - 1 bytes more.
    slack = sum(w.element_size() - 1 for w in weights)
    assert held <= model.get_memory_footprint() <= held + slack < dense
    assert all(w.numel() == w.shape.numel() for w in weights), "numel() stays the logical element count"
