import contextlib
import logging
import os
import re
import sys
import types

import pytest
import torch
import torch.nn.functional as F


# Run Triton kernels through the interpreter on machines without a GPU (CI). Must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The tests run offline: transformers (5.25+) kernelizes every model it loads with kernels fetched from the Hub when the
# `kernels` package is installed, which fails without a network (and would test the Hub's kernels, not ours).
os.environ.setdefault("USE_HUB_KERNELS", "0")



@pytest.fixture(autouse=True)
def _kernel_references_outside_kernel_tests(request, monkeypatch):
    """On a CPU host the Triton kernels run through the interpreter, whose cost grows with every program launched.
    Kernel tests (tests/kernels/) and tests marked `triton_interpreter` keep it; elsewhere `backend="auto"` takes the
    kernels' torch references (same numerics), as it does on any CPU host without the interpreter."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        return
    if request.node.get_closest_marker("triton_interpreter") or "kernels" in request.node.path.parts:
        return
    monkeypatch.setenv("TRITON_INTERPRET", "0")


# Some Triton interpreters cannot run a loop whose bound is a kernel argument (triton 3.6 with numpy 2.x: "only
# 0-dimensional arrays can be converted to Python scalars"), which most of this package's kernels have. On such a host
# a test that meets this error is skipped with the versions named, after a probe kernel confirms it; every other
# error still fails.
_INTERPRETER_SCALAR_BUG = "only 0-dimensional arrays can be converted to Python scalars"
_interpreter_probe = {}


def _interpreter_cannot_loop_over_arguments() -> bool:
    if "broken" not in _interpreter_probe:
        _interpreter_probe["broken"] = False
        saved = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"  # read when the probe is decorated and launched
        try:
            import triton
            import triton.language as tl

            @triton.jit
            def _loop(X, N, BLOCK: tl.constexpr):
                for start in range(0, N, BLOCK):
                    tl.store(X + start + tl.arange(0, BLOCK), tl.zeros((BLOCK,), tl.float32))

            _loop[(1,)](torch.empty(32), 32, BLOCK=16)
        except Exception as error:  # the interpreter's own error, whatever its wrapper
            _interpreter_probe["broken"] = _INTERPRETER_SCALAR_BUG in str(error)
        finally:
            if saved is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = saved
    return _interpreter_probe["broken"]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    outcome = yield
    error = outcome.excinfo[1] if outcome.excinfo else None
    if error is not None and _INTERPRETER_SCALAR_BUG in str(error) and _interpreter_cannot_loop_over_arguments():
        import numpy
        import triton

        outcome.force_exception(pytest.skip.Exception(
            f"the Triton interpreter of triton {triton.__version__} with numpy {numpy.__version__} cannot loop over "
            "a kernel argument; the CPU kernel tests need one that can (CI's versions)", _use_item_location=True))


# Keep CPU runs deterministic and small.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_components_factory():
    from diffusers_h3.testing.tiny import tiny_components

    return tiny_components


class _H3Logs:
    """Records of the plugin's loggers. They live under diffusers' library root logger, which does not propagate to
    the root logger where pytest's `caplog` listens, so the handler is attached to the package logger itself."""

    def __init__(self, caplog):
        self.caplog = caplog

    @property
    def text(self) -> str:
        return self.caplog.text

    @contextlib.contextmanager
    def expect(self, match: str):
        """Like `pytest.warns(match=...)`, for a warning logged within the block."""
        self.caplog.clear()
        yield
        warnings = [r.getMessage() for r in self.caplog.records if r.levelno >= logging.WARNING]
        assert any(re.search(match, m) for m in warnings), f"no warning logged matching {match!r}: {warnings}"

    @contextlib.contextmanager
    def expect_none(self):
        """Nothing at WARNING or above is logged within the block."""
        self.caplog.clear()
        yield
        warnings = [r.getMessage() for r in self.caplog.records if r.levelno >= logging.WARNING]
        assert not warnings, warnings


@pytest.fixture
def h3_logs(caplog):
    logger = logging.getLogger("diffusers_h3")
    logger.addHandler(caplog.handler)
    try:
        yield _H3Logs(caplog)
    finally:
        logger.removeHandler(caplog.handler)


# Small canvas rule shared by both pipelines in parity tests so that video references stay tiny.
SMALL_CANVAS = {"canvas_short_edge": 32, "canvas_max_pixels": 32 * 64, "reference_image_short_edge": 64}


class _StandIn(types.ModuleType):
    """``flashinfer`` with one function: checks the call's contract and computes SDPA on one (seq, heads, dim) item."""

    def __init__(self):
        super().__init__("flashinfer")
        self.calls = []

    def single_prefill_with_kv_cache(self, q, k, v, *, causal, kv_layout, sm_scale, backend, scale_q=None,
                                     scale_k=None, scale_v=None, o_dtype=None):  # fmt: skip
        assert q.dim() == 3 and q.shape == k.shape == v.shape and q.stride(-1) == 1
        fp8 = q.dtype == torch.float8_e4m3fn
        self.calls.append({"shape": tuple(q.shape), "causal": causal, "layout": kv_layout, "scale": sm_scale,
                           "backend": backend, "fp8": fp8})  # fmt: skip
        if fp8:  # FA3's FP8 contract: E4M3 Q/K/V, one fp32 scale per head, output in o_dtype
            assert k.dtype == v.dtype == q.dtype and all(s.shape == (q.shape[1],) for s in (scale_q, scale_k, scale_v))
            q, k, v = (t.float() * s[None, :, None] for t, s in ((q, scale_q), (k, scale_k), (v, scale_v)))
        qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v))  # NHD -> (1, heads, seq, dim)
        out = F.scaled_dot_product_attention(qh, kh, vh, scale=sm_scale)
        out = out[0].transpose(0, 1).contiguous()
        return out.to(o_dtype) if fp8 else out


@pytest.fixture
def flashinfer_stand_in(monkeypatch, tmp_path):
    """A stand-in ``flashinfer`` module (CPU tests of the FlashInfer glue); ``.calls`` records its calls. A stand-in
    compiler is named through ``FLASHINFER_NVCC`` so that the kernel-source check passes on machines without CUDA."""
    module = _StandIn()
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("FLASHINFER_NVCC", str(nvcc))
    return module
