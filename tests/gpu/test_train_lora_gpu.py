"""LoRA training on a CUDA GPU: the quantized base's Triton forward records no autograd, so the gradients come from
the quantized layer's autograd function (dequantized backward); they must match the dequantized bf16 model's, and a
few training steps over a streamed NVFP4 base must equal the resident base's.

Run on the device machine: ``python -m pytest tests/gpu/test_train_lora_gpu.py -m gpu -q -o addopts=""``.
"""

import pytest
import torch
import torch.utils.checkpoint

from tests.training.test_quantized_base import _lora_gradients, _with_lora


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("method,tolerance", [("w8a16", 6e-2), ("nvfp4", 6e-2), ("fp8", 1.5e-1)])
def test_gradients_through_the_gpu_kernels_match_the_dequantized_model(method, tolerance):
    import diffusers_h3
    from diffusers_h3.quantizers import QuantizedTensor
    from diffusers_h3.quantizers.registry import get_format
    from diffusers_h3.testing.tiny import tiny_transformer

    torch.manual_seed(0)
    quantized = tiny_transformer().to(torch.bfloat16)
    dequantized = tiny_transformer().to(torch.bfloat16)
    dequantized.load_state_dict(quantized.state_dict())
    diffusers_h3.quantize(quantized, get_format(method).config_cls())
    for (_, module), (_, dense) in zip(quantized.named_modules(), dequantized.named_modules()):
        if isinstance(getattr(module, "weight", None), QuantizedTensor):
            dense.weight = torch.nn.Parameter(module.weight.dequantize(torch.bfloat16), requires_grad=False)
    got = _lora_gradients(_with_lora(quantized).cuda().train())
    want = _lora_gradients(_with_lora(dequantized).cuda().train())
    for name in want:
        assert torch.isfinite(got[name]).all() and got[name].abs().sum() > 0, name
        error = ((got[name] - want[name]).norm() / want[name].norm()).item()
        assert error < tolerance, (name, error)


def test_streamed_nvfp4_base_trains_like_the_resident_one(tmp_path):
    from diffusers import MiniMaxH3Transformer3DModel

    import diffusers_h3
    from diffusers_h3.parallel.checkpoint_streaming import stream_from_checkpoint
    from diffusers_h3.testing.tiny import tiny_transformer

    torch.manual_seed(0)
    model = tiny_transformer().to(torch.bfloat16)
    diffusers_h3.quantize(model, diffusers_h3.NVFP4Config())
    model.save_pretrained(tmp_path)
    grads = {}
    for stream in (False, True):
        loaded = _with_lora(MiniMaxH3Transformer3DModel.from_pretrained(tmp_path))
        loaded.enable_gradient_checkpointing()
        loaded.train()
        if stream:
            for name, param in loaded.named_parameters():
                if "lora_" in name:
                    param.data = param.data.cuda()
            stream_from_checkpoint(loaded, tmp_path, "cuda", resident_below_bytes=0)
        else:
            loaded.cuda()
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):  # as the trainer runs it
            grads[stream] = _lora_gradients(loaded)
    for name in grads[False]:
        assert torch.allclose(grads[True][name], grads[False][name], rtol=1e-3, atol=1e-6), name
