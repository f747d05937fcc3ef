"""Slices of a quantized weight (tensor-parallel shards, fused projections): a slice keeps exactly its rows / columns
of the effective weight, scales included, and a split through a scale group is refused in one line."""

import pytest
import torch

from diffusers_h3.quantizers import FP8Config, NVFP4Config, W8A16Config, quantize


CONFIGS = {
    "w8a16": W8A16Config(compute_dtype=torch.float32),
    "w8a16_group16": W8A16Config(group_size=16, compute_dtype=torch.float32),
    "fp8": FP8Config(compute_dtype=torch.float32),
    "nvfp4": NVFP4Config(compute_dtype=torch.float32),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dim,ranges", [(0, [(24, 48)]), (0, [(12, 24), (36, 48)]), (1, [(32, 64)])])
def test_slices_keep_their_part_of_the_effective_weight(name, dim, ranges):
    torch.manual_seed(0)
    weight = quantize(torch.nn.Sequential(torch.nn.Linear(64, 48)), CONFIGS[name])[0].weight
    full = weight.dequantize(torch.float32)
    pieces = [weight.narrow(dim, a, b - a) for a, b in ranges]
    sliced = torch.cat(pieces, dim) if len(pieces) > 1 else pieces[0]
    expected = torch.cat([full.narrow(dim, a, b - a) for a, b in ranges], dim)
    assert type(sliced) is type(weight) and tuple(sliced.shape) == tuple(expected.shape)
    assert torch.equal(sliced.dequantize(torch.float32), expected)
    x = torch.randn(3, sliced.shape[1])
    out, dense = torch.nn.functional.linear(x, sliced), torch.nn.functional.linear(x, expected)
    assert ((out - dense).norm() / dense.norm()).item() < (1e-5 if name != "fp8" else 0.08)


@pytest.mark.parametrize("config,group", [(W8A16Config(group_size=32), 32), (NVFP4Config(), 16)])
def test_slices_refuse_to_split_a_scale_group(config, group):
    weight = quantize(torch.nn.Sequential(torch.nn.Linear(64, 16)), config)[0].weight
    with pytest.raises(ValueError, match=f"would split a weight_scale group of {group}"):
        weight[:, 8:16]


def test_w4a4_refuses_an_input_split():
    weight = quantize(torch.nn.Sequential(torch.nn.Linear(64, 16)), NVFP4Config(activation="nvfp4"))[0].weight
    with pytest.raises(ValueError, match="activation='nvfp4'"):
        weight[:, :32]
    assert weight[:8].shape == (8, 64)  # output rows are independent
