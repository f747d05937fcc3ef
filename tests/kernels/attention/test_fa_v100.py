"""FA-V100 kernel module on CPU: the torch reference, argument checking, build errors, and a compile-only check of the
CUDA source with the local nvcc (skipped where there is none). The kernel itself runs in tests/gpu/test_fa_v100_gpu.py.
"""

import math
import re
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from diffusers_h3.kernels.attention import fa_v100
from diffusers_h3.kernels.attention.fa_v100 import (
    FAV100BuildError,
    fa_v100_attention,
    fa_v100_reference,
    load_extension,
)

from ._compile_fa_v100 import compile_device_code_sm70, compile_kernel_source


def _qkv(batch, seq_q, seq_k, heads, head_dim, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq_q, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, seq_k, heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, seq_k, heads, head_dim, generator=gen).to(dtype)
    return q, k, v


def _sdpa(q, k, v, scale=None):
    out = F.scaled_dot_product_attention(
        q.double().transpose(1, 2), k.double().transpose(1, 2), v.double().transpose(1, 2), scale=scale
    )
    return out.transpose(1, 2)


def _rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seq_q,seq_k", [(77, 77), (130, 33), (5, 201)])
def test_reference_exact_mode_matches_sdpa(head_dim, seq_q, seq_k):
    q, k, v = _qkv(2, seq_q, seq_k, 3, head_dim, seed=seq_q + seq_k)
    out = fa_v100_reference(q, k, v, round_probabilities=False, chunk_size=32)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert _rel_l2(out, _sdpa(q, k, v)) < 1e-6


def test_reference_rounds_probabilities_like_the_kernel():
    q, k, v = _qkv(1, 64, 96, 2, 64, seed=3)
    q = q * 3.0  # peaky softmax: many probabilities far from 1, so fp16 rounding of P shows
    exact = fa_v100_reference(q, k, v, round_probabilities=False)
    rounded = fa_v100_reference(q, k, v)
    err = _rel_l2(rounded, exact)
    assert 0.0 < err < 2e-3
    # the contract's fp16 rounding of P: recompute by hand
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(64)
    p = torch.exp(scores - scores.amax(-1, keepdim=True)).half().float()
    manual = torch.einsum("bhqk,bkhd->bqhd", p, v) / p.sum(-1).transpose(1, 2).unsqueeze(-1)
    assert _rel_l2(rounded, manual) < 0.05 * err


def test_reference_fp16_inputs_and_custom_scale():
    q, k, v = _qkv(1, 33, 47, 2, 128, dtype=torch.float16, seed=5)
    out = fa_v100_attention(q, k, v, softmax_scale=0.05, backend="reference")
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    assert _rel_l2(out, _sdpa(q, k, v, scale=0.05)) < 2e-3


@pytest.mark.parametrize(
    "shapes,match",
    [
        (((1, 8, 2, 32), (1, 8, 2, 32), (1, 8, 2, 32)), "head_dim"),
        (((1, 8, 2, 64), (1, 9, 2, 64), (1, 8, 2, 64)), "same shape"),
        (((1, 8, 2, 64), (1, 8, 3, 64), (1, 8, 3, 64)), "batch, heads and head_dim"),
        (((8, 2, 64), (8, 2, 64), (8, 2, 64)), "batch, seq, heads, head_dim"),
    ],
)
def test_bad_shapes_are_named(shapes, match):
    q, k, v = (torch.randn(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        fa_v100_attention(q, k, v, backend="reference")


def test_bad_options_are_named():
    q, k, v = _qkv(1, 8, 8, 1, 64)
    with pytest.raises(ValueError, match="query_tile"):
        fa_v100_attention(q, k, v, query_tile=32, backend="reference")
    with pytest.raises(ValueError, match="backend"):
        fa_v100_attention(q, k, v, backend="triton")
    with pytest.raises(TypeError, match="float16"):
        fa_v100_attention(q, k, v, backend="cuda")
    with pytest.raises(ValueError, match="CUDA device"):
        fa_v100_attention(q.half(), k.half(), v.half(), backend="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_load_extension_without_gpu_raises_clear_error(tmp_path):
    with pytest.raises(FAV100BuildError, match="needs a CUDA GPU"):
        load_extension(build_dir=tmp_path)


def test_source_digest_tracks_both_sources():
    digest = fa_v100.source_digest()
    assert re.fullmatch(r"[0-9a-f]{64}", digest)
    assert fa_v100.KERNEL_SOURCE.exists() and fa_v100.BINDING_SOURCE.exists()
    # the kernel file must stay free of torch headers so CI can compile it alone
    assert "torch" not in "\n".join(
        line for line in fa_v100.KERNEL_SOURCE.read_text().splitlines() if line.startswith("#include")
    )


def _compile_arch():
    """sm_70 where the local nvcc still has it (CUDA <= 12), else the oldest it lists (CUDA 13 dropped sm_70)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None, None
    listed = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, timeout=60).stdout
    archs = sorted(int(m) for m in re.findall(r"compute_(\d+)", listed) if int(m) >= 70)
    return nvcc, (str(archs[0]) if archs else None)


def test_cuda_source_compiles_with_local_nvcc(tmp_path):
    nvcc, arch = _compile_arch()
    if nvcc is None or arch is None:
        pytest.skip("no nvcc with an sm_70+ target on this machine")
    report = compile_kernel_source(tmp_path / "fa_v100.o", arch, nvcc=nvcc)
    assert (tmp_path / "fa_v100.o").stat().st_size > 0
    # four variants: head_dim {64, 128} x query tile {64, 128}; none may spill registers
    kernels = re.findall(r"Compiling entry function '(\S*fa_v100_forward_kernel\S*)'", report)
    assert len(kernels) == 4, report
    spills = re.findall(r"(\d+) bytes spill stores", report)
    assert spills and all(s == "0" for s in spills), report


def test_device_code_builds_for_sm70_with_cuda12(tmp_path):
    """The V100 build: CUDA 13's nvcc dropped sm_70, so CI compiles the device code with CUDA 12 NVRTC + ptxas
    (wheels from the `sm70-check` extra). Skipped where those wheels are not installed."""
    import importlib.util

    if any(importlib.util.find_spec(f"nvidia.{name}") is None for name in ("cuda_nvrtc", "cuda_nvcc", "cuda_runtime")):
        pytest.skip('CUDA 12 NVRTC / ptxas wheels not installed (pip install "diffusers-h3[sm70-check]")')
    report = compile_device_code_sm70(tmp_path)
    kernels = re.findall(r"Compiling entry function '(\S*fa_v100_forward_kernel\S*)' for 'sm_70'", report)
    assert len(kernels) == 4, report
    spills = re.findall(r"(\d+) bytes spill stores", report)
    assert len(spills) == 4 and all(s == "0" for s in spills), report
    assert (tmp_path / "fa_v100_sm70.cubin").stat().st_size > 0
