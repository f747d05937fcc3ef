"""The Hopper (Gluon) attention kernels compile for sm_90a on a machine without a GPU.

Gluon kernels do not run under the Triton interpreter, so CPU CI checks what it can: every variant the dispatcher
launches lowers to PTX with wgmma / TMA, and ``ptxas`` assembles it without spilling registers. Numerics are tested
on an H200 (``tests/gpu/test_bsa_sm90_gpu.py``). Each variant compiles in a fresh interpreter without
``TRITON_INTERPRET`` (``tests/_compile_sm90.py``).
"""

import atexit
import json
import os
import re
import subprocess
import sys

import pytest


pytest.importorskip("triton")

from diffusers_h3.kernels.attention.bsa_sm90 import HAS_GLUON  # noqa: E402


pytestmark = pytest.mark.skipif(not HAS_GLUON, reason="needs Triton with Gluon")

HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_compile_sm90.py")


_SERVER = []  # one helper process per test worker, started by the first variant


def _server():
    if _SERVER and _SERVER[0].poll() is None:
        return _SERVER[0]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # the repository root, not tests/: there `import kernels` (transformers' hub kernels) would find tests/kernels
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(HELPER))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    process = subprocess.Popen([sys.executable, HELPER, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    atexit.register(process.kill)
    _SERVER[:] = [process]
    return process


def _compile(*args):
    process = _server()
    process.stdin.write(" ".join(map(str, args)) + "\n")
    process.stdin.flush()
    line = process.stdout.readline()
    assert line, f"the compile helper exited: {process.stderr.read()[-3000:]}"
    out = json.loads(line)
    assert "error" not in out, out.get("error", "")[-3000:]
    assert out["ptxas_rc"] == 0, out["ptxas"][-2000:]
    return out["ptx"], out["ptxas"]


def _assert_mma_kinds(ptx, report, q_dtype):
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    if q_dtype == "fp8e4nv":
        assert ".e4m3.e4m3" in ptx  # the QK^T product runs on FP8 tensor cores
    if q_dtype == "i8":
        assert ".s32.s8.s8" in ptx  # ... on INT8 tensor cores, int32 accumulation
    assert "0 bytes spill stores" in report
    assert "wgmma.mma_async instructions are serialized" not in report  # ptxas's C7512 performance warning


@pytest.mark.parametrize("q_dtype,v_fp8,mode", [("bf16", 0, "sparse"), ("fp8e4nv", 0, "sparse"),
                                                ("fp8e4nv", 1, "sparse"), ("fp8e4nv", 0, "dense"), ("i8", 0, "sparse"),
                                                ("i8", 1, "sparse")])
def test_single_warpgroup_kernel_compiles_without_spills(q_dtype, v_fp8, mode):
    ptx, report = _compile("single", q_dtype, v_fp8, mode)
    _assert_mma_kinds(ptx, report, q_dtype)


@pytest.mark.parametrize("q_dtype,v_fp8,block_n", [("fp8e4nv", 0, 128), ("fp8e4nv", 1, 128), ("fp8e4nv", 0, 64),
                                                   ("i8", 0, 128)])
def test_warp_specialized_dense_kernel_compiles(q_dtype, v_fp8, block_n):
    ptx, report = _compile("ws", q_dtype, v_fp8, block_n)
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+232;", ptx)  # consumers take the producer's registers
    _assert_mma_kinds(ptx, report, q_dtype)


@pytest.mark.parametrize("q_dtype,v_fp8", [("bf16", 0), ("fp8e4nv", 1)])
def test_warp_specialized_sparse_kernel_compiles(q_dtype, v_fp8):
    ptx, report = _compile("ws_sparse", q_dtype, v_fp8, 3)
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+232;", ptx)
    _assert_mma_kinds(ptx, report, q_dtype)


def test_two_tile_program_refuses_rings_that_do_not_fit():
    # Checked before any launch (CPU tensors suffice): two rings of 4 bf16 K/V slots exceed Hopper's shared memory.
    import torch

    from diffusers_h3.kernels.attention.bsa_sm90 import block_sparse_attention_sm90
    from diffusers_h3.kernels.attention.tuning import TuningOptions

    q = torch.zeros(1, 128, 2, 128, dtype=torch.bfloat16)
    slots, counts = torch.arange(128, dtype=torch.int32), torch.full((2,), 64, dtype=torch.int32)
    index, num = torch.zeros(1, 2, 2, 2, dtype=torch.int32), torch.ones(1, 2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="two_tiles needs two rings of 4"):
        block_sparse_attention_sm90(q, q.clone(), q.clone(), slots, counts, index, num, torch.empty_like(q), block=64,
                                    scale=0.1, tuning=TuningOptions(num_stages=4), two_tiles=True)
