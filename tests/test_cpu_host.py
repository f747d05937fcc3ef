"""The CPU suite hides the host's GPUs from itself (tests/_cpu_host.py), so that a GPU host runs it as CI does."""

import os
import subprocess
import sys
from pathlib import Path

import torch

from tests._cpu_host import selects_gpu_tests


ROOT = Path(__file__).resolve().parents[1]


def test_marker_expressions_that_keep_or_leave_out_the_gpu_tests():
    assert not selects_gpu_tests("not gpu and not slow")  # the default run
    assert not selects_gpu_tests("slow") and not selects_gpu_tests("multi_gpu")
    assert selects_gpu_tests("gpu") and selects_gpu_tests("gpu or slow") and selects_gpu_tests("not slow")
    assert selects_gpu_tests("")  # no -m: every test, the GPU ones included


def test_this_run_sees_no_gpu_when_it_leaves_out_the_gpu_tests(request):
    expression = request.config.option.markexpr
    if request.config.pluginmanager.has_plugin("tests._cpu_host") and not selects_gpu_tests(expression):
        assert os.environ.get("CUDA_VISIBLE_DEVICES") == ""


def test_the_plugin_hides_the_gpus_before_the_conftest_imports_torch(tmp_path):
    """A child pytest run with the default marker expression sees CUDA_VISIBLE_DEVICES="" in the conftest's first
    line, and one that selects the gpu tests keeps the caller's value."""
    (tmp_path / "conftest.py").write_text("import os\nprint('SEEN', repr(os.environ.get('CUDA_VISIBLE_DEVICES')))\n")
    (tmp_path / "test_x.py").write_text("def test_x():\n    pass\n")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for expression, seen in (("not gpu and not slow", "''"), ("gpu", "'0'")):
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "tests._cpu_host", "-o", "addopts=",
                                 "-p", "no:cacheprovider", "-m", expression, str(tmp_path)],
                                capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)  # fmt: skip
        assert f"SEEN {seen}" in result.stdout, result.stdout + result.stderr


def test_the_interpreter_probe_agrees_with_a_kernel_loop_here():
    """The probe that decides the interpreter skip says "broken" exactly where a kernel that loops over an argument
    fails with the interpreter's scalar error: never on CI's versions (where it finds nothing to skip, so no kernel test
    is skipped for it), and only with that error elsewhere (every other error still fails its test)."""
    import numpy
    import pytest

    triton = pytest.importorskip("triton")
    import triton.language as tl

    from tests.conftest import _INTERPRETER_SCALAR_BUG, _interpreter_cannot_loop_over_arguments

    out = torch.zeros(48)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRITON_INTERPRET", "1")  # read when the kernel is decorated and launched

        @triton.jit
        def _fill(X, N, BLOCK: tl.constexpr):
            for start in range(0, N, BLOCK):
                tl.store(X + start + tl.arange(0, BLOCK), tl.full((BLOCK,), 2.0, tl.float32))

        try:
            _fill[(1,)](out, 48, BLOCK=16)
            loop_fails = False
        except Exception as error:
            loop_fails = _INTERPRETER_SCALAR_BUG in str(error)
    assert _interpreter_cannot_loop_over_arguments() is loop_fails, (triton.__version__, numpy.__version__)
    if not loop_fails:
        assert torch.equal(out, torch.full((48,), 2.0))
