"""VSA over groups of heads on the GPU kernels (Hopper's sm90 kernel where it runs): the same output bit for bit as
one call over all heads, at H3's head dim (run with ``pytest -m gpu tests/gpu/test_vsa_head_groups_gpu.py``)."""

import pytest
import torch

from diffusers_h3.attention_processors.vsa import VSAConfig, disable_vsa, enable_vsa, vsa_state
from diffusers_h3.layout import LayoutSegment, PackedLayout, use_packed_layout
from diffusers_h3.testing.tiny import tiny_transformer, tiny_transformer_inputs


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GRID = (8, 16, 16)  # 2,048 video rows: 32 tiles of 4x4x4
TEXT, AUDIO = 5, 4


def _layout():
    n_video = GRID[0] * GRID[1] * GRID[2]
    segs = (
        LayoutSegment("text", "prompt", 0, TEXT),
        LayoutSegment("audio", "target", TEXT, TEXT + AUDIO, channels=2),
        LayoutSegment("video", "target", TEXT + AUDIO, TEXT + AUDIO + n_video, grid=GRID),
    )
    return PackedLayout(segs, seq_len=TEXT + AUDIO + n_video)


def _run(model, device):
    inputs = tiny_transformer_inputs(seed=1, seq_text=TEXT, seq_audio=AUDIO, grid=GRID)
    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}
    with torch.no_grad(), use_packed_layout(_layout()):
        return model(**inputs, return_dict=False)[0]


@pytest.mark.parametrize("precision", ["bf16", "int8", "fp8"])
def test_head_groups_are_bitwise_on_the_gpu_kernels(precision):
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = tiny_transformer(num_attention_heads=8, attention_head_dim=128).to(device, torch.bfloat16)
    outputs = {}
    for groups in (None, 4):
        enable_vsa(model, VSAConfig(sparsity=0.75, precision=precision, head_groups=groups))
        outputs[groups] = _run(model, device)
        path = vsa_state(model)["path"]
        assert ("4 head groups in turn" in path) == (groups == 4), path
        disable_vsa(model)
    assert torch.isfinite(outputs[None]).all()
    assert torch.equal(outputs[None], outputs[4])
