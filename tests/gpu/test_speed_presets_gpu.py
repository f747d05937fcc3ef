"""Determinism of the speed presets on a GPU: two identical requests give bitwise identical outputs (docs/speed.md).

Run on the device machine: `python -m pytest -m gpu tests/gpu/test_speed_presets_gpu.py`.
"""

import pytest
import torch

import diffusers_h3
from diffusers_h3 import SpeedPresetConfig
from diffusers_h3.testing.tiny import tiny_pipeline


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# A canvas whose video rows fill several VSA tiles (partial ones included), decoded to pixels and audio.
CALL = {"prompt": "a cat", "height": 64, "width": 96, "num_frames": 124, "num_inference_steps": 3, "output_type": "pt"}


@pytest.mark.parametrize("preset", ["exact", "fast", "fastest"])
def test_two_identical_requests_are_bitwise_equal(preset):
    pipe = tiny_pipeline(seed=5, with_transformer_ref=False).to("cuda", torch.bfloat16)
    native = pipe(**CALL, generator=torch.Generator().manual_seed(0))
    pipe.enable_speed_preset(SpeedPresetConfig(preset, compile=True))
    first = pipe(**CALL, generator=torch.Generator().manual_seed(0))
    second = pipe(**CALL, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(first.frames).all() and torch.isfinite(first.audio).all()
    assert torch.equal(first.frames, second.frames), f"{preset}: video differs between identical requests"
    assert torch.equal(first.audio, second.audio), f"{preset}: audio differs between identical requests"

    report = diffusers_h3.describe(pipe)
    assert report["speed_preset"]["preset"] == preset
    assert report["speed_preset"]["compile"]["transformer"].startswith("regional torch.compile")
    if preset == "exact":
        assert "_native_cudnn" in report["speed_preset"]["attention"]["transformer"]
    else:  # the preset is not a no-op: its output differs from the native one
        assert not torch.equal(first.frames, native.frames)
        fp8 = torch.cuda.get_device_capability() >= (8, 9)
        assert ("FP8Config" if fp8 else "W8A16Config") in report["speed_preset"]["weights"]["transformer"]
