"""`QuantizedLinear.shard_`: a tensor-parallel slice keeps exactly its rows / columns of the effective weight, scales
included, and refuses a split through a scale group."""

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
@pytest.mark.parametrize("dim,chunks", [(0, 1), (0, 2), (1, 1)])
def test_shard_keeps_its_slice_of_the_effective_weight(name, dim, chunks):
    torch.manual_seed(0)
    layer = quantize(torch.nn.Sequential(torch.nn.Linear(64, 48)), CONFIGS[name])[0]
    full = layer.dequantize(torch.float32)
    world, rank = 2, 1
    ranges = layer.shard_ranges(dim, rank, world, chunks)
    expected = torch.cat([full.narrow(dim, a, b - a) for a, b in ranges], dim)
    bias = layer.bias.detach().clone()
    layer.shard_(dim, rank, world, chunks)
    assert torch.equal(layer.dequantize(torch.float32), expected)
    assert (layer.out_features, layer.in_features) == tuple(expected.shape)
    if dim == 0:
        assert torch.equal(layer.bias, torch.cat([bias[a:b] for a, b in ranges]))
    x = torch.randn(3, layer.in_features)
    assert layer(x).shape == (3, layer.out_features)


@pytest.mark.parametrize(
    "config,group",
    [(W8A16Config(group_size=32), 32), (NVFP4Config(), 16)],
)
def test_shard_refuses_to_split_a_scale_group(config, group):
    layer = quantize(torch.nn.Sequential(torch.nn.Linear(64, 16)), config)[0]
    with pytest.raises(ValueError, match=f"would split a weight_scale group of {group}"):
        layer.shard_(1, 0, 8)  # 8-wide shards
    with pytest.raises(ValueError, match="do not split into"):
        layer.shard_(0, 0, 3)


def test_w4a4_refuses_an_input_split():
    layer = quantize(torch.nn.Sequential(torch.nn.Linear(64, 16)), NVFP4Config(activation="nvfp4"))[0]
    with pytest.raises(ValueError, match="activation='nvfp4'"):
        layer.shard_(1, 0, 2)
    layer.shard_(0, 0, 2)  # output rows are independent
