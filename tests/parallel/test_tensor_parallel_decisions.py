"""Decision of the tensor-parallel reduction that must not flip: partial outputs are added in rank order,
`((p0 + p1) + p2) + p3`, the order the module docstring and `tensor_parallel_state` document.

The partials are chosen so that bf16 rounding makes every other order (reversed, pairwise, fp32 accumulation) give a
different result. The all-gather is faked (4 ranks, no process group)."""

import pytest
import torch

from diffusers_h3.parallel.tensor_parallel import ordered_sum_reduce


ULP = 2.0**-8  # half the bf16 spacing at 1.0: 1 + ULP rounds back to 1 (ties to even)
PARTIALS = [1.0, ULP, ULP, ULP]  # rank r holds PARTIALS[r]


@pytest.fixture
def four_ranks(monkeypatch):
    dist = torch.distributed

    def all_gather(parts, tensor, group=None):
        for rank, part in enumerate(parts):
            part.copy_(torch.full_like(tensor, PARTIALS[rank]))

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: len(PARTIALS))
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "all_gather", all_gather)


def _bf16(value):
    return torch.tensor([value], dtype=torch.bfloat16)


def test_partials_are_added_in_rank_order(four_ranks):
    p = [_bf16(v) for v in PARTIALS]
    in_rank_order = ((p[0] + p[1]) + p[2]) + p[3]
    reversed_order = ((p[3] + p[2]) + p[1]) + p[0]
    pairwise = (p[0] + p[1]) + (p[2] + p[3])
    fp32_accumulated = torch.stack(p).float().sum(0).bfloat16()
    # The chosen partials tell the orders apart (otherwise this test would prove nothing).
    assert not any(torch.equal(in_rank_order, other) for other in (reversed_order, pairwise, fp32_accumulated))

    out = ordered_sum_reduce(_bf16(PARTIALS[0]), group="four ranks")
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, in_rank_order)


def test_reduce_dtype_accumulates_in_that_dtype_then_casts_back(four_ranks):
    out = ordered_sum_reduce(_bf16(PARTIALS[0]), group="four ranks", reduce_dtype=torch.float32)
    expected = (((torch.tensor([PARTIALS[0]]) + PARTIALS[1]) + PARTIALS[2]) + PARTIALS[3]).bfloat16()
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
