"""The card's memory as it counts it, on a real GPU: the benchmarks' sampler sees what the allocator reserved plus the
CUDA context, and a LoRA on a streamed model holds one block's factors on the device at a time."""

import sys
from pathlib import Path

import pytest
import torch

from diffusers_h3.parallel.checkpoint_streaming import (
    StreamingConfig,
    release_streamed_weights,
    stream_from_checkpoint,
)
from diffusers_h3.testing import tiny

from ..parallel.test_checkpoint_streaming import _load_dit, _resident_dit, _saved_dit


pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def test_the_sampler_counts_the_allocators_memory_and_the_context():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import _common
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    sampler = _common.DeviceMemorySampler(0, interval_s=0.05).start()
    with sampler.window("one_gib"):
        block = torch.empty(2**30, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        sampler.sample()
        reserved = torch.cuda.memory_reserved()
        del block
    sampler.stop()
    fields = _common.device_peak_fields(sampler.windows["one_gib"], round(reserved / 2**30, 2), sampler.source)
    assert "lower bound" not in fields["device_peak_source"]  # sampled, not clamped
    assert fields["device_peak_gib"] > reserved / 2**30  # the context lies outside the allocator
    assert sampler.samples >= 3


def test_a_lora_on_a_streamed_dit_follows_its_block_to_the_gpu_and_back(tmp_path):
    from peft import LoraConfig

    _saved_dit(tmp_path / "dit", dtype=torch.bfloat16, num_layers=4)
    reference = _resident_dit(tmp_path / "dit", torch.bfloat16)
    streamed = _load_dit(tmp_path / "dit", torch.bfloat16)
    config = LoraConfig(r=8, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"], init_lora_weights=False)
    reference.add_adapter(config)
    reference = reference.to("cuda")
    stream_from_checkpoint(streamed, tmp_path / "dit", "cuda", StreamingConfig(read_ahead=1, slot_mib=1),
                           resident_below_bytes=256)  # fmt: skip
    streamed.add_adapter(config)  # after streaming began, as a user loads a LoRA onto a streamed pipeline
    lora = {k: v for k, v in reference.state_dict().items() if "lora_" in k}
    assert lora and streamed.load_state_dict(lora, strict=False).unexpected_keys == []
    lora_params = [p for n, p in streamed.named_parameters() if "lora_" in n]
    inputs = {k: (v.to("cuda", torch.bfloat16) if v.is_floating_point() and k != "timestep" else v.to("cuda"))
              for k, v in tiny.tiny_transformer_inputs().items()}  # fmt: skip
    with torch.no_grad():
        expected = reference(**inputs, return_dict=False)[0]
        for _ in range(2):
            got = streamed(**inputs, return_dict=False)[0]
            assert torch.equal(got, expected)
            assert all(p.device.type == "cpu" for p in lora_params)  # back on the host after each block
    release_streamed_weights(streamed)
