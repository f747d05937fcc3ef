"""The Triton twins of kernels/numerics.py (kernels/_numerics_triton.py): the same constants, and E4M3 / E2M1
round-to-nearest-even bit for bit (fp16 and fp32 inputs, under the interpreter on CPU)."""

import os

import torch


if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from diffusers_h3.kernels import _numerics_triton as twins  # noqa: E402
from diffusers_h3.kernels import numerics  # noqa: E402


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _apply_kernel(X, OUT, N, E2M1: tl.constexpr, SATURATE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if E2M1:
        y = twins.round_to_e2m1(tl.abs(x))
        y = tl.where(x < 0, -y, y)
    else:
        if SATURATE:
            x = tl.minimum(tl.maximum(x, -twins.E4M3_MAX), twins.E4M3_MAX)
        y = twins.round_to_e4m3(x)
    tl.store(OUT + offs, y, mask=mask)


def _apply(x, e2m1):
    out = torch.full(x.shape, float("nan"), device=x.device, dtype=torch.float32)
    block = 128
    _apply_kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), E2M1=e2m1, SATURATE=True, BLOCK=block)
    return out


def test_constants_match_numerics():
    assert twins.E4M3_MAX.value == numerics.E4M3_MAX == 448.0
    assert twins.E2M1_MAX.value == numerics.E2M1_MAX == 6.0
    assert twins.INT8_MAX.value == numerics.INT8_MAX == 127.0
    assert twins.LOG2E.value == numerics.LOG2E


def _values(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    # Log-uniform magnitudes across the E4M3 range (subnormals included), both signs, odd size, exact grid points,
    # ties between grid points and values beyond the range (saturated).
    mag = torch.exp2(torch.empty(3001).uniform_(-12, 9.5, generator=gen))
    sign = torch.where(torch.rand(3001, generator=gen) < 0.5, -1.0, 1.0)
    grid = numerics.round_to_e4m3(torch.linspace(-448, 448, 257))
    ties = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([mag * sign, grid, ties, torch.tensor([0.0, -0.0, 1e-9, -1e-9, 500.0, -1e4])])
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_round_to_e4m3_is_bitwise_torch(dtype):
    x = _values(dtype, seed=0)
    got = _apply(x, e2m1=False)
    expected = numerics.round_to_e4m3(x.float())
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))  # signed zeros included


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_round_to_e2m1_is_bitwise_torch(dtype):
    gen = torch.Generator().manual_seed(1)
    grid = numerics.e2m1_values()
    ties = (grid[1:8] + grid[:7]) / 2  # the midpoints of the positive codes: ties to even
    x = torch.cat([torch.empty(2001).uniform_(-8, 8, generator=gen), ties, -ties, grid, torch.tensor([7.0, -100.0])])
    x = x.to(dtype).to(DEVICE)
    got = _apply(x, e2m1=True)
    expected = numerics.round_to_e2m1(x.float())
    assert torch.equal(got.abs(), expected.abs()) and torch.equal(got, expected)
