"""FastH3 stacks on a GPU (run on the device machine: `python -m pytest -m gpu tests/gpu/test_fasth3_gpu.py`): the
light VAE's NVFP4 decoder through the Triton weight-only GEMM at the released decoder width, and a tiny stack with its
gates and VSA 0.9 against the same stack on the CPU."""

import pytest
import torch
from diffusers import AutoencoderKLMiniMaxH3

from diffusers_h3 import MiniMaxH3Pipeline, describe, vsa_state
from diffusers_h3.kernels.gemm import nvfp4_dequantize, nvfp4_quantize
from diffusers_h3.loaders.fasth3_vae import DECODER_BLOCK_LINEAR, load_nvfp4_decoder
from diffusers_h3.testing.fasth3 import nvfp4_decoder_export, write_fasth3_stack
from diffusers_h3.testing.tiny import TINY_DURATION_LIMITS, tiny_components


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def rel_l2(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_light_decoder_at_released_width_matches_its_dequantized_weights():
    """Released decoder width (2048, 32 heads), 4 blocks cut to 2: the NVFP4 decoder on the GPU (Triton weight-only
    GEMM) against the same decoder with each linear's weight = the NVFP4 dequantization of its master."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        teacher = AutoencoderKLMiniMaxH3(decoder_num_layers=4).to(torch.bfloat16).eval()
        dense = AutoencoderKLMiniMaxH3(decoder_num_layers=2).to(torch.bfloat16).eval()
    export = nvfp4_decoder_export(teacher, 2)
    load_nvfp4_decoder(teacher, export)
    dense.load_state_dict({k: v for k, v in teacher.state_dict().items() if not k.startswith("decoder.")}, strict=False)
    dense.decoder.load_state_dict({k: v for k, v in export["decoder"].items() if "input_amax" not in k})
    with torch.no_grad():
        for name, module in dense.decoder.named_modules():
            if DECODER_BLOCK_LINEAR.match(name):
                packed = nvfp4_quantize(export["decoder"][f"{name}.weight"].cuda())
                module.weight.copy_(nvfp4_dequantize(*packed, torch.bfloat16))
        latents = torch.randn(1, 24, 7, 16, 16, device="cuda", dtype=torch.bfloat16)
        out = teacher.decode(latents, return_dict=False)[0]
        ref = dense.decode(latents, return_dict=False)[0]
    assert torch.isfinite(out).all() and rel_l2(out, ref) < 2e-2
    # describe() counts layers per path line: "NVFP4Linear[nvfp4] on cuda: auto -- Triton NVFP4 weight-only: ..."
    paths = describe(teacher)["model"]["quantized_layers"]
    assert any("on cuda: auto -- Triton NVFP4 weight-only" in line for line in paths), paths


def test_tiny_stack_on_the_gpu_matches_the_cpu(tmp_path):
    components = tiny_components(seed=4, with_transformer_ref=False)
    root = write_fasth3_stack(tmp_path / "stack", components, decoder_student_layers=1)
    call = {"prompt": "a cat", "height": 64, "width": 96, "num_frames": 22, "output_type": "latent"}
    cpu = MiniMaxH3Pipeline.from_pretrained(root, **TINY_DURATION_LIMITS)
    gpu = MiniMaxH3Pipeline.from_pretrained(root, dtype=torch.bfloat16, **TINY_DURATION_LIMITS).to("cuda")
    assert vsa_state(gpu.transformer)["sparsity"] == 0.9 and vsa_state(gpu.transformer)["gated_blocks"] == 2
    reference = cpu(**call, generator=torch.Generator().manual_seed(0))
    out = gpu(**call, generator=torch.Generator().manual_seed(0))
    assert out.frames.is_cuda and torch.isfinite(out.frames).all()
    # bf16 with the Triton VSA kernels against the fp32 torch references, over 4 steps
    assert rel_l2(out.frames.cpu(), reference.frames) < 2e-2 and rel_l2(out.audio.cpu(), reference.audio) < 2e-2


def test_quantize_while_moving_to_the_gpu_matches_quantizing_there():
    """`quantize(model, config, device="cuda")` on a model built on the CPU: the same FP8 codes and scales as
    moving it whole and quantizing on the GPU, and the same forward."""
    from diffusers_h3.quantizers import FP8Config, quantize
    from diffusers_h3.testing.tiny import tiny_transformer, tiny_transformer_inputs

    torch.manual_seed(0)
    moved = tiny_transformer().to(torch.bfloat16)
    whole = tiny_transformer().to(torch.bfloat16)
    whole.load_state_dict(moved.state_dict())
    quantize(moved, FP8Config(), device="cuda")
    quantize(whole.to("cuda"), FP8Config())
    a, b = moved.state_dict(), whole.state_dict()
    assert a.keys() == b.keys() and all(v.is_cuda and torch.equal(v, b[k]) for k, v in a.items())
    inputs = {k: v.to("cuda", torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else
              (v.to("cuda") if torch.is_tensor(v) else v) for k, v in tiny_transformer_inputs().items()}  # fmt: skip
    with torch.no_grad():
        assert torch.equal(moved(**inputs)[0], whole(**inputs)[0])


def test_tiny_stack_loaded_fp8_on_the_gpu_has_fp8_gates(tmp_path):
    """What fits one 80 GB card, on a tiny stack: the DiT quantized while loading, the gates in FP8 too, VSA 0.9."""
    from diffusers.quantizers import PipelineQuantizationConfig

    from diffusers_h3.quantizers import FP8Config, is_quantized_linear

    components = tiny_components(seed=4, with_transformer_ref=False)
    root = write_fasth3_stack(tmp_path / "stack", components, decoder_student_layers=1)
    quant = PipelineQuantizationConfig(quant_mapping={"transformer": FP8Config()})
    pipe = MiniMaxH3Pipeline.from_pretrained(root, dtype=torch.bfloat16, quantization_config=quant,
                                             **TINY_DURATION_LIMITS).to("cuda")  # fmt: skip
    blocks = pipe.transformer.transformer_blocks
    assert all(is_quantized_linear(b.attn.to_gate_compress) and b.attn.to_gate_compress.weight.is_cuda for b in blocks)
    pipe.enable_speed_preset("fastest")
    assert "already quantized: kept" in describe(pipe)["speed_preset"]["weights"]["transformer"]
    out = pipe(prompt="a cat", height=64, width=96, num_frames=22, output_type="latent",
               generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert torch.isfinite(out.frames).all() and vsa_state(pipe.transformer)["sparsity"] == 0.9
