"""The attention router: which kernel runs (a KernelChoice recorded at run time), tuning knobs, and input errors.

The selection is tested on CPU tensors with a faked Hopper capability (``sm90_available=True``): the choice depends
on dtypes, shapes and layouts only, so it is the same decision a GPU run takes.
"""

import os

import torch


if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402

import pytest  # noqa: E402

from diffusers_h3.kernels.attention import (  # noqa: E402
    KernelChoice,
    TuningOptions,
    block_sparse_attention,
    block_sparse_attention_reference,
    fp8_attention,
    select_kernel,
)
from diffusers_h3.kernels.attention.bsa_sm90 import two_rings_fit  # noqa: E402
from diffusers_h3.kernels.attention.router import AttentionOperands  # noqa: E402
from diffusers_h3.kernels.attention.vsa_select import build_block_mask, mask_to_index_reference  # noqa: E402

from ._inputs import DEVICE, DTYPE  # noqa: E402


def _qkv(seq=128, heads=2, head_dim=64, dtype=torch.bfloat16):
    q = torch.empty(1, seq, heads, head_dim, dtype=dtype)
    return q, torch.empty_like(q), torch.empty_like(q)


def test_32_row_tiles_route_to_triton_even_on_hopper():
    """enable_vsa(tile=(2, 4, 4)) gives 32-row tiles: the Hopper kernel cannot take them, Triton runs."""
    q, k, v = _qkv()
    choice = select_kernel(AttentionOperands.of(q, k, v), block=32, sm90_available=True)
    assert choice.kernel == "triton" and choice.variant == "sparse"
    assert "64/128-row tiles" in choice.reason
    assert select_kernel(AttentionOperands.of(q, k, v), block=64, sm90_available=True).kernel == "sm90-gluon"


def test_sm90_variants_and_their_reasons():
    q, k, v = _qkv()
    assert select_kernel(AttentionOperands.of(q, k, v), block=64, sm90_available=True).variant == "two-tile"
    q8 = q.to(torch.float8_e4m3fn)
    scale = torch.ones(1, 128, 2)
    eight_bit = select_kernel(AttentionOperands.of(q8, q8, v, q_scale=scale), block=64, sm90_available=True)
    assert eight_bit.variant == "one-tile" and "8-bit" in eight_bit.reason
    dense = select_kernel(AttentionOperands.of(q, k, v), block=128, dense=True, sm90_available=True)
    assert dense.variant == "dense-warp-specialized"
    small = select_kernel(AttentionOperands.of(q, k, v), block=128, dense=True, tuning=TuningOptions(block_m=64), sm90_available=True)
    assert small.variant == "dense-one-warpgroup"


def test_two_tiles_only_when_two_rings_fit():
    """bf16 promises two query tiles only when the two K/V rings fit the shared memory."""
    q, k, v = _qkv(head_dim=128)
    assert not two_rings_fit(4, 128, 128, 2, 2) and two_rings_fit(3, 64, 128, 2, 2)
    deep = select_kernel(AttentionOperands.of(q, k, v), block=128, tuning=TuningOptions(num_stages=4), sm90_available=True)
    assert deep.kernel == "sm90-gluon" and deep.variant == "one-tile" and "do not fit" in deep.reason
    with pytest.raises(ValueError, match="two_tiles needs two rings"):
        select_kernel(AttentionOperands.of(q, k, v), block=128, tuning=TuningOptions(num_stages=4, two_tiles=True), sm90_available=True)


def test_forced_kernels_and_knob_conflicts():
    q, k, v = _qkv()
    assert select_kernel(AttentionOperands.of(q, k, v), block=64, tuning=TuningOptions(kernel="triton"), sm90_available=True).kernel == "triton"
    knobs = select_kernel(AttentionOperands.of(q, k, v), block=64, tuning=TuningOptions(num_warps=8), sm90_available=True)
    assert knobs.kernel == "triton" and "knobs" in knobs.reason
    with pytest.raises(ValueError, match="kernel='sm90'"):
        select_kernel(AttentionOperands.of(q, k, v), block=64, tuning=TuningOptions(kernel="sm90"), sm90_available=False)
    with pytest.raises(ValueError, match="knobs of the Triton kernel"):
        select_kernel(AttentionOperands.of(q, k, v), block=64, tuning=TuningOptions(kernel="sm90", tma=True), sm90_available=True)
    with pytest.raises(ValueError, match="two_tiles"):
        select_kernel(AttentionOperands.of(q, k, v), block=32, tuning=TuningOptions(two_tiles=True), sm90_available=True)
    with pytest.raises(ValueError, match="TuningOptions.kernel"):
        TuningOptions(kernel="cuda")
    with pytest.raises(dataclasses.FrozenInstanceError):
        TuningOptions().kernel = "sm90"


def test_fp4_p_and_fp32_stay_on_triton():
    q, k, v = _qkv()
    assert "FP4" in select_kernel(AttentionOperands.of(q, k, v, p_fp4="two_level"), block=64, sm90_available=True).reason
    q32, k32, v32 = _qkv(dtype=torch.float32)
    assert select_kernel(AttentionOperands.of(q32, k32, v32), block=64, sm90_available=True).kernel == "triton"


def _sparse_args(seed=0, seq=80, block=16, heads=2, d=32):
    gen = torch.Generator().manual_seed(seed)
    n_tiles = -(-seq // block)
    slot_rows = torch.arange(n_tiles * block, dtype=torch.int32).clamp_max(seq - 1)
    counts = torch.full((n_tiles,), block, dtype=torch.int32)
    counts[-1] = seq - block * (n_tiles - 1)
    scores = torch.randn(1, heads, n_tiles, n_tiles, generator=gen)
    index, num = mask_to_index_reference(build_block_mask(scores, 1, 2))
    q = torch.randn(1, seq, heads, d, generator=gen, dtype=torch.float32).to(DTYPE)
    k = torch.randn(1, n_tiles * block, heads, d, generator=gen, dtype=torch.float32).to(DTYPE)
    valid = (torch.arange(block).repeat(n_tiles) < counts.repeat_interleave(block)).view(1, -1, 1, 1)
    k = torch.where(valid, k, 0)
    v = torch.where(valid, torch.randn(k.shape, generator=gen).to(DTYPE), 0)
    to = {"device": DEVICE}
    return [t.to(**to) for t in (q, k, v, slot_rows, counts, index, num)], block


def test_router_records_what_ran_and_matches_the_reference():
    args, block = _sparse_args()
    out, choice = block_sparse_attention(*args, block=block, backend="triton", return_choice=True)
    assert isinstance(choice, KernelChoice) and choice.kernel in ("triton", "sm90-gluon")
    assert "block=16" not in choice.describe() and choice.kernel in choice.describe()
    if DEVICE == "cpu":
        assert choice.kernel == "triton" and "no compute capability 9.x" in choice.reason
    ref, ref_choice = block_sparse_attention(*args, block=block, backend="torch", return_choice=True)
    assert ref_choice == KernelChoice("torch-reference", "sparse", "backend='torch'")
    torch.testing.assert_close(ref, block_sparse_attention_reference(*args, block=block))
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-3, atol=2e-3)


def test_tuning_is_refused_where_the_reference_runs():
    args, block = _sparse_args()
    with pytest.raises(ValueError, match="torch reference"):
        block_sparse_attention(*args, block=block, backend="torch", tuning=TuningOptions(num_warps=4))
    with pytest.raises(ValueError, match="block_m applies to dense"):
        block_sparse_attention(*args, block=block, backend="triton", tuning=TuningOptions(block_m=64))
    with pytest.raises(TypeError, match="TuningOptions"):
        block_sparse_attention(*args, block=block, backend="triton", tuning={"num_warps": 4})


def test_fp8_attention_records_its_choice():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 70, 2, 32, generator=gen).to(DEVICE, DTYPE) for _ in range(3))
    out, choice = fp8_attention(q, k, v, block_n=32, backend="triton", return_choice=True,
                                tuning=TuningOptions(kernel="triton"))
    assert choice.kernel == "triton" and choice.variant == "dense" and choice.reason == "TuningOptions(kernel='triton')"
    assert out.shape == q.shape and torch.isfinite(out).all()
    _, ref_choice = fp8_attention(q.cpu(), k.cpu(), v.cpu(), block_n=32, backend="torch", return_choice=True)
    assert ref_choice.kernel == "torch-reference"
