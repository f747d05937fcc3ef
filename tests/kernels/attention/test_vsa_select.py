"""Tile selection (kernels/attention/vsa_select.py): block mask -> index lists vs the torch reference.

On a machine without CUDA the Triton kernels run under the interpreter (fp16/fp32 inputs only).
"""

import os

import torch


if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from diffusers_h3.kernels.attention.vsa_select import (  # noqa: E402
    build_block_mask,
    mask_to_index,
    mask_to_index_reference,
    select_tiles,
)

from ._inputs import DEVICE  # noqa: E402


def test_mask_to_index_matches_reference():
    scores = torch.randn(2, 3, 37, 37, device=DEVICE)
    mask = build_block_mask(scores, num_prefix_tiles=5, topk=7)
    index, num = mask_to_index(mask, backend="triton")
    ref_index, ref_num = mask_to_index_reference(mask)
    torch.testing.assert_close(num, ref_num)
    assert (num[:, :, :5] == 37).all() and (num[:, :, 5:] == 5 + 7).all()
    width = torch.arange(37, device=DEVICE)
    listed = width < num.unsqueeze(-1)
    assert torch.equal(torch.where(listed, index, -1), torch.where(listed, ref_index, -1))
    # Lists are ascending and name exactly the selected tiles.
    rebuilt = torch.zeros(2, 3, 37, 38, dtype=torch.bool, device=DEVICE)
    rebuilt.scatter_(-1, torch.where(listed, index, 37).long(), True)
    assert torch.equal(rebuilt[..., :37], mask)
    assert (index.gather(-1, (num - 1).clamp_min(0).unsqueeze(-1).long()) >= 0).all()


@pytest.mark.parametrize("b,h,t,prefix,topk", [(2, 3, 37, 5, 7), (1, 2, 20, 0, 4), (1, 1, 9, 9, 0),
                                                (1, 2, 40, 3, 37), (1, 1, 33, 4, 1)])
def test_select_tiles_matches_mask_then_index(b, h, t, prefix, topk):
    scores = torch.randn(b, h, t, t, device=DEVICE)
    scores[..., 2:6] = 0.5  # ties at and around the threshold: the lower tile index wins
    scores[..., 7] = -0.0
    scores[..., 8] = 0.0
    index, num = select_tiles(scores, prefix, topk, backend="triton")
    ref_index, ref_num = mask_to_index_reference(build_block_mask(scores, prefix, topk))
    assert torch.equal(num, ref_num)
    assert (num[:, :, prefix:] == prefix + topk).all()
    listed = torch.arange(t, device=DEVICE) < num.unsqueeze(-1)
    assert torch.equal(torch.where(listed, index, -1), torch.where(listed, ref_index, -1))


def test_select_tiles_rejects_a_topk_beyond_the_video_tiles():
    with pytest.raises(ValueError, match="topk must be in"):
        select_tiles(torch.randn(1, 1, 10, 10, device=DEVICE), 4, 7)
