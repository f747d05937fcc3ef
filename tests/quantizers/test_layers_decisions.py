"""Decision of the FP8 quantizers that must not flip: the per-token scale has an eps floor (and an all-zero weight row
scale 1), so an all-zero row (padding, a masked token, a pruned channel) quantizes to zero codes, never 0/0 = NaN,
and its output row is exactly the bias."""

import pytest
import torch
from torch import nn

from diffusers_h3.kernels.gemm.fp8 import fp8_quantize_per_token, fp8_quantize_weight
from diffusers_h3.quantizers import FP8Config, quantize


def _with_zero_row(rows=4, cols=32, zero_row=1, seed=0):
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    x[zero_row] = 0
    return x


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton_interpreter)])  # triton: the fused kernel, under the interpreter on CPU
def test_an_all_zero_activation_row_gives_zero_codes(backend):
    q, scale = fp8_quantize_per_token(_with_zero_row(), backend=backend)
    codes = q.float()
    assert not codes.isnan().any() and scale.isfinite().all() and (scale > 0).all()
    assert torch.equal(codes[1], torch.zeros(32))
    assert (codes[[0, 2, 3]].abs().amax(dim=1) == 448).all()  # the other rows still use the whole E4M3 range


def test_an_all_zero_weight_row_gives_zero_codes_and_scale_one():
    q, scale = fp8_quantize_weight(_with_zero_row(zero_row=2))
    assert not q.float().isnan().any() and scale[2] == 1 and torch.equal(q[2].float(), torch.zeros(32))


def _fp8_layer():
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(32, 16))
    dense[0].weight.data[3] = 0  # an all-zero output channel
    return quantize(dense, FP8Config())[0]


def test_fp8_linear_maps_a_zero_row_to_its_bias():
    layer = _fp8_layer()
    out = layer(_with_zero_row())
    assert out.isfinite().all()
    torch.testing.assert_close(out[1], layer.bias.float(), atol=0, rtol=0)
    torch.testing.assert_close(out[:, 3], layer.bias[3].float().expand(4), atol=0, rtol=0)


def test_fp8_linear_row_shard_maps_a_zero_row_to_its_bias(monkeypatch):
    """Under tensor parallelism the row-parallel layer takes its amax from a MAX all-reduce (one shard here)."""
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, op=None, group=None: None)
    layer = _fp8_layer()
    layer.input_shard_group = "one shard"
    out = layer(_with_zero_row())
    assert out.isfinite().all()
    torch.testing.assert_close(out[1], layer.bias.float(), atol=0, rtol=0)
