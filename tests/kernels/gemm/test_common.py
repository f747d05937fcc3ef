"""Helpers shared by the GEMMs (``kernels/gemm/_common.py``): device support, input checks, autotune bucketing."""

import pytest
import torch

from diffusers_h3.kernels.gemm import _common

from ._helpers import DEVICE


def test_triton_gemm_supported_follows_device_and_interpreter(monkeypatch):
    assert _common.triton_gemm_supported(torch.device(DEVICE)) == _common.HAS_TRITON
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not _common.triton_gemm_supported(torch.device("cpu"))


def test_m_bucket_is_the_next_power_of_two():
    assert [_common.m_bucket(m) for m in (0, 1, 2, 3, 17, 1024, 1025)] == [1, 1, 2, 4, 32, 1024, 2048]


def test_prepare_gemm_io_checks_and_reshapes():
    x = torch.randn(2, 3, 32, device=DEVICE, dtype=torch.float16)
    x2, out = _common.prepare_gemm_io("TEST", x, 8, 32, None)
    assert x2.shape == (6, 32) and out.shape == (6, 8) and out.dtype == torch.float16
    with pytest.raises(TypeError, match="fp16, bf16 or fp32"):
        _common.prepare_gemm_io("TEST", x.to(torch.float64), 8, 32, None)
    with pytest.raises(ValueError, match="input features"):
        _common.prepare_gemm_io("TEST", x, 8, 16, None)
    with pytest.raises(ValueError, match="contiguous"):
        _common.prepare_gemm_io("TEST", x, 8, 32, torch.empty(6, 8, device=DEVICE, dtype=torch.float32))


def test_check_2d_weight_names_the_problem():
    _common.check_2d_weight("weight", torch.randn(4, 8))
    with pytest.raises(ValueError, match="weight must be a 2-D"):
        _common.check_2d_weight("weight", torch.randn(8))
    with pytest.raises(TypeError, match="floating point"):
        _common.check_2d_weight("weight", torch.ones(4, 8, dtype=torch.int8))
