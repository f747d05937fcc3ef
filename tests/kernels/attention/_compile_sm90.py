"""Compile one Hopper (Gluon) attention kernel variant for sm_90a and print what the tests check (JSON).

Run by tests/test_sm90_compile.py in a fresh interpreter without TRITON_INTERPRET (under the interpreter, Gluon
functions are wrapped for interpretation and cannot be compiled).
"""

import inspect
import json
import os
import subprocess
import sys
import tempfile

import triton

from diffusers_h3.kernels.attention import bsa_sm90 as sm90


D = 128


def _compile(fn, consts, q_dtype, v_fp8, block_n, num_warps, **options):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    gl_dtype = {"bf16": gl.bfloat16, "fp8e4nv": gl.float8e4nv, "i8": gl.int8}
    k_layout = gl.NVMMASharedLayout.get_default_for([block_n, D], gl_dtype[q_dtype])
    v_shape = [D, block_n] if v_fp8 else [block_n, D]
    v_dtype = "fp8e4nv" if v_fp8 else "bf16"
    v_layout = gl.NVMMASharedLayout.get_default_for(v_shape, gl_dtype[v_dtype])
    pointers = {"Q": f"*{q_dtype}", "O": "*bf16", "Q_SCALE": "*fp32", "K_SCALE": "*fp32", "V_SCALE": "*fp32",
                "SLOT_ROWS": "*i32", "TILE_COUNTS": "*i32", "KV_INDEX": "*i32", "KV_NUM": "*i32"}
    names = list(inspect.signature(fn.fn).parameters)
    signature = {}
    for name in names:
        if name in pointers:
            signature[name] = pointers[name]
        elif name == "k_desc":
            signature[name] = f"tensordesc<{q_dtype}[{block_n}, {D}],{k_layout!r}>"
        elif name == "v_desc":
            signature[name] = f"tensordesc<{v_dtype}[{v_shape[0]}, {v_shape[1]}],{v_layout!r}>"
        elif name in consts:
            signature[name] = "constexpr"
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
    src = GluonASTSource(fn, signature, constexprs={(names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, **options))


def _ptxas_report(kernel):
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        result = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", os.devnull], capture_output=True, text=True)
    return result.returncode, result.stderr


def main(variant, q_dtype, v_fp8, dense_or_block_n):
    v_fp8 = v_fp8 == "1"
    if variant == "single":
        dense = dense_or_block_n == "dense"
        consts = {"HEAD_DIM": D, "BLOCK_M": 64, "BLOCK_N": 64, "STAGES": 3, "DENSE": dense, "QK_8BIT": q_dtype != "bf16",
                      "num_warps": 4}
        kernel = _compile(sm90._bsa_fwd_sm90_kernel, consts, q_dtype, v_fp8, 64, 4)
    elif variant == "ws_sparse":
        consts = {"HEAD_DIM": D, "BLOCK_N": 64, "STAGES": int(dense_or_block_n), "CONSUMER_REGS": 232, "PRODUCER_REGS": 40}
        kernel = _compile(sm90._sparse_fwd_sm90_ws_kernel, consts, q_dtype, v_fp8, 64, 4, maxnreg=168)
    else:
        block_n = int(dense_or_block_n)
        consts = {"HEAD_DIM": D, "BLOCK_N": block_n, "STAGES": 3, "QK_8BIT": True, "CONSUMER_REGS": 232, "PRODUCER_REGS": 40}
        kernel = _compile(sm90._dense_fwd_sm90_ws_kernel, consts, q_dtype, v_fp8, block_n, 4, maxnreg=168)
    code, report = _ptxas_report(kernel)
    print(json.dumps({"ptx": kernel.asm["ptx"], "ptxas_rc": code, "ptxas": report}))


def serve():
    """One variant per stdin line (its four arguments, space-separated), one JSON line back per variant: the tests keep
    one such process per worker instead of paying an interpreter start and the imports for every variant."""
    import traceback

    for line in sys.stdin:
        try:
            main(*line.split())
        except Exception:  # noqa: BLE001 - reported to the test that asked, the next variant still compiles
            print(json.dumps({"error": traceback.format_exc()}))
        sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        main(*sys.argv[1:])


