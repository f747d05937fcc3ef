"""GPU checks of the pipeline (run on the device machine: `python -m pytest -m gpu tests/gpu`)."""

import pytest
import torch

from diffusers_h3.testing.tiny import tiny_pipeline


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CALL = {"prompt": "a cat", "height": 64, "width": 96, "num_frames": 124, "num_inference_steps": 3, "output_type": "latent"}


def _run(pipe):
    return pipe(**CALL, generator=torch.Generator().manual_seed(0))


def test_gpu_matches_across_offload_modes():
    base = _run(tiny_pipeline(seed=1).to("cuda"))
    assert base.frames.is_cuda and torch.isfinite(base.frames).all() and torch.isfinite(base.audio).all()

    model_offload = tiny_pipeline(seed=1)
    model_offload.enable_model_cpu_offload(device="cuda")
    out = _run(model_offload)
    assert torch.equal(out.frames.cpu(), base.frames.cpu()) and torch.equal(out.audio.cpu(), base.audio.cpu())
    # The text encoder went back to the CPU after encoding.
    assert next(model_offload.text_encoder.parameters()).device.type == "cpu"

    sequential = tiny_pipeline(seed=1)
    sequential.enable_sequential_cpu_offload(device="cuda")
    out = _run(sequential)
    assert torch.allclose(out.frames.cpu(), base.frames.cpu(), atol=1e-5) and torch.allclose(out.audio.cpu(), base.audio.cpu(), atol=1e-5)


def test_gpu_bf16_runs_and_decodes():
    pipe = tiny_pipeline(seed=2).to("cuda", torch.bfloat16)
    out = pipe(**{**CALL, "output_type": "pt"}, generator=torch.Generator().manual_seed(0))
    assert out.frames.shape == (1, 124, 3, 64, 96)
    assert torch.isfinite(out.frames).all() and torch.isfinite(out.audio).all()


def test_components_on_different_devices():
    """Text encoder and VAEs on the CPU, transformer on the GPU (as `device_map="balanced"` or a TE-on-GPU1 setup
    places whole components): the pipeline moves tensors to each component's device."""
    base = _run(tiny_pipeline(seed=4).to("cuda"))
    split = tiny_pipeline(seed=4)
    split.transformer.to("cuda")
    split.transformer_ref.to("cuda")
    out = _run(split)
    assert out.frames.device.type == "cuda"
    assert torch.allclose(out.frames.cpu(), base.frames.cpu(), atol=1e-3) and torch.allclose(
        out.audio.cpu(), base.audio.cpu(), atol=1e-3
    )
