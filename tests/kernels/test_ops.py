"""The kernel entry points as ``torch.library`` custom ops (``diffusers_h3::*``, kernels/_triton_utils.py: kernel_op).

``torch.library.opcheck`` checks each op's schema, fake implementation (shapes, dtypes, strides of the real outputs)
and its behaviour under make_fx / AOT dispatch, on CPU with small shapes: the torch references, and the Triton
kernels under the interpreter (fp16 / fp32). Paths that need a GPU (cuBLAS FP8, the CUDA FA-V100 kernel, the Hopper
attention kernel) are checked through their fake implementation: under ``FakeTensorMode`` on a CUDA device they give
the shape, dtype and strides of the CPU reference's output.
"""

import os

import torch


if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from diffusers_h3.attention_processors.vsa import vsa_attention, vsa_attention_op  # noqa: E402
from diffusers_h3.kernels._triton_utils import HAS_TRITON, OP_NAMESPACE  # noqa: E402
from diffusers_h3.kernels.attention.dense_quantized import fp8_attention, fp8_attention_op  # noqa: E402
from diffusers_h3.kernels.attention.fa_v100 import fa_v100_attention, fa_v100_attention_op  # noqa: E402
from diffusers_h3.kernels.attention.flashinfer_dense import (  # noqa: E402
    flashinfer_dense_attention_op,
    flashinfer_fp8_attention_op,
)
from diffusers_h3.kernels.attention.router import block_sparse_attention, block_sparse_attention_op  # noqa: E402
from diffusers_h3.kernels.attention.tuning import launch_options  # noqa: E402
from diffusers_h3.kernels.attention.vsa_pool import tile_pool  # noqa: E402
from diffusers_h3.kernels.attention.vsa_select import select_tiles, topk_for_sparsity  # noqa: E402
from diffusers_h3.kernels.gemm import (  # noqa: E402
    fp8_linear,
    fp8_quantize_weight,
    nvfp4_linear,
    nvfp4_quantize,
    w8a16_linear,
    w8a16_quantize,
)

from .attention._inputs import tile_plan  # noqa: E402


ON_CPU = not torch.cuda.is_available()
interpreter = pytest.mark.skipif(not (ON_CPU and HAS_TRITON), reason="Triton interpreter runs on CPU only")
# The launch options of the attention ops with no FP4 P and no tuning knob (kernels.attention.tuning.launch_options).
NO_OPTIONS = launch_options(None)

REGISTERED = ("w8a16_linear", "fp8_linear", "nvfp4_linear", "block_sparse_attention", "fp8_attention",
              "vsa_attention", "fa_v100_attention", "flashinfer_dense_attention", "flashinfer_fp8_attention")  # fmt: skip


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def opcheck(op, args):
    """``torch.library.opcheck``; with float8 inputs (which its schema test cannot compare on CPU) the other tests,
    and the no-mutation part of the schema test done here on the raw bytes."""
    op = getattr(op, "op", op)  # the registered op behind a kernel_op entry point
    fp8 = [a for a in args if isinstance(a, torch.Tensor) and a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)]
    if not fp8:
        torch.library.opcheck(op, args)
        return
    before = [a.view(torch.uint8).clone() for a in fp8]
    torch.library.opcheck(op, args, test_utils=("test_autograd_registration", "test_faketensor",
                                                "test_aot_dispatch_dynamic"))  # fmt: skip
    op(*args)
    assert all(torch.equal(a.view(torch.uint8), b) for a, b in zip(fp8, before)), "an op mutated its input"


def test_every_kernel_entry_point_is_a_registered_custom_op():
    namespace = getattr(torch.ops, OP_NAMESPACE)
    for name in REGISTERED:
        assert hasattr(namespace, name), name
    # the public functions the rest of the package calls are (or wrap) these ops
    for function in (w8a16_linear, fp8_linear, nvfp4_linear, block_sparse_attention_op, fp8_attention_op,
                     vsa_attention_op, fa_v100_attention_op, flashinfer_dense_attention_op):  # fmt: skip
        assert isinstance(function.op, torch._library.custom_ops.CustomOpDef)


def test_every_op_takes_at_most_ten_arguments():
    """Ops take tensors and a few ints or strings: what a call decided travels as its plan's fields, not as
    two dozen loose options."""
    namespace = getattr(torch.ops, OP_NAMESPACE)
    for name in REGISTERED:
        schema = getattr(namespace, name).default._schema
        assert len(schema.arguments) <= 10, f"{name} takes {len(schema.arguments)} arguments: {schema}"


def test_calls_that_record_autograd_run_the_function_itself():
    """Training through the torch references stays differentiable (the ops have no autograd formula)."""
    x = torch.randn(3, 32, generator=_gen(), requires_grad=True)
    q, s = w8a16_quantize(torch.randn(16, 32, generator=_gen(1)))
    w8a16_linear(x, q, s, None, backend="torch").sum().backward()
    torch.testing.assert_close(x.grad, (q.float() * s[:, None]).sum(0).expand(3, -1))
    with torch.no_grad():
        assert w8a16_linear(x, q, s, None, backend="torch").grad_fn is None


# -- GEMMs -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group_size", [None, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_w8a16_linear_op(group_size, bias):
    x = torch.randn(2, 5, 32, generator=_gen())
    q, s = w8a16_quantize(torch.randn(24, 32, generator=_gen(1)), group_size)
    b = torch.randn(24, generator=_gen(2)) if bias else None
    opcheck(w8a16_linear, (x, q, s, b, "torch", 1024))
    opcheck(w8a16_linear, (x, q, s, b, "dequant", 1024))


@interpreter
def test_w8a16_linear_op_triton_interpreter():
    x = torch.randn(3, 32, generator=_gen(), dtype=torch.float16)
    q, s = w8a16_quantize(torch.randn(16, 32, generator=_gen(1)))
    opcheck(w8a16_linear, (x, q, s, None, "triton", 1024))


def test_fp8_linear_op():
    x = torch.randn(2, 5, 32, generator=_gen())
    wq, ws = fp8_quantize_weight(torch.randn(16, 32, generator=_gen(1)))
    b = torch.randn(16, generator=_gen(2))
    for backend in ("torch", "dequant"):
        opcheck(fp8_linear, (x, wq, ws, b, backend, True))


@pytest.mark.parametrize("activation", [None, "nvfp4"])
def test_nvfp4_linear_op(activation):
    x = torch.randn(2, 5, 32, generator=_gen())
    packed, block_scale, global_scale = nvfp4_quantize(torch.randn(16, 32, generator=_gen(1)))
    opcheck(nvfp4_linear, (x, packed, block_scale, global_scale, None, activation, "torch", 1024))


def test_gemm_fakes_give_the_gpu_paths_outputs():
    """cuBLAS FP8 (scaled_mm) and the Triton GEMMs on a GPU: the fake output has the reference output's metadata."""
    x = torch.randn(2, 5, 32, generator=_gen(), dtype=torch.bfloat16)
    wq, ws = fp8_quantize_weight(torch.randn(16, 32, generator=_gen(1)))
    q, s = w8a16_quantize(torch.randn(16, 32, generator=_gen(1)))
    p, bs, g = nvfp4_quantize(torch.randn(16, 32, generator=_gen(1)))
    references = [
        (fp8_linear, (x, wq, ws, None), "scaled_mm"),
        (w8a16_linear, (x, q, s, None), "triton"),
        (nvfp4_linear, (x, p, bs, g, None), "triton"),
    ]
    for op, args, gpu_backend in references:
        ref = op(*args, backend="torch")
        with FakeTensorMode() as mode:
            fake_args = [mode.from_tensor(a).to("cuda") if isinstance(a, torch.Tensor) else a for a in args]
            out = op(*fake_args, backend=gpu_backend)
        assert (out.shape, out.dtype, out.stride(), out.device.type) == (ref.shape, ref.dtype, ref.stride(), "cuda")


# -- attention -------------------------------------------------------------------------------------------------------


def _sparse_inputs(dtype=torch.float32, heads=2, head_dim=16):
    plan = tile_plan()  # block 16, 157 rows
    q = torch.randn(1, plan.seq_len, heads, head_dim, generator=_gen(), dtype=dtype)
    k = torch.randn(1, plan.seq_len, heads, head_dim, generator=_gen(1), dtype=dtype)
    v = torch.randn(1, plan.seq_len, heads, head_dim, generator=_gen(2), dtype=dtype)
    rows = (plan.slot_rows, plan.tile_counts, plan.block)
    _, kp = tile_pool(k, *rows, pooled=False, packed=True, backend="torch")
    _, vp = tile_pool(v, *rows, pooled=False, packed=True, backend="torch")
    scores = torch.randn(1, heads, plan.num_tiles, plan.num_tiles, generator=_gen(3))
    kv_index, kv_num = select_tiles(scores, plan.num_prefix_tiles, 2, backend="torch")
    return plan, q, k, v, kp, vp, kv_index, kv_num


def test_block_sparse_attention_op_reference():
    plan, q, _, _, kp, vp, kv_index, kv_num = _sparse_inputs()
    sparse = (q, kp, vp, [plan.slot_rows, plan.tile_counts, kv_index, kv_num], [None] * 3, plan.block, 0.25, None,
              "torch-reference:sparse", NO_OPTIONS)  # fmt: skip
    opcheck(block_sparse_attention_op, sparse)
    q16 = q[:, :64].contiguous()
    dense = (q16, q16, q16, [None] * 4, [None] * 3, 16, 0.5, torch.float16, "torch-reference:dense",
             launch_options(None, "two_level"))  # fmt: skip
    opcheck(block_sparse_attention_op, dense)


@interpreter
def test_block_sparse_attention_op_triton_interpreter():
    q = torch.randn(1, 32, 1, 16, generator=_gen())
    dense = (q, q, q, [None] * 4, [None] * 3, 16, 0.25, None, "triton:dense", NO_OPTIONS)
    opcheck(block_sparse_attention_op, dense)


@pytest.mark.parametrize("qk_dtype", [torch.float8_e4m3fn, torch.int8])
def test_fp8_attention_op_reference(qk_dtype):
    q, k, v = (torch.randn(1, 40, 2, 16, generator=_gen(i)) for i in range(3))
    opcheck(fp8_attention_op, (q, k, v, True, True, None, 16, qk_dtype, "torch-reference:dense", NO_OPTIONS))


@interpreter
def test_fp8_attention_op_triton_interpreter():
    q, k, v = (torch.randn(1, 32, 1, 16, generator=_gen(i)) for i in range(3))
    opcheck(fp8_attention_op, (q, k, v, True, False, None, 16, torch.int8, "triton:dense", NO_OPTIONS))


@pytest.mark.parametrize("precision,compress", [("bf16", True), ("int8", False), ("fp8", True), ("fp4", False)])
def test_vsa_attention_op_reference(precision, compress):
    plan, q, k, v, *_ = _sparse_inputs()
    topk = topk_for_sparsity(0.5, plan.num_video_tiles)
    options = launch_options(None, "two_level" if precision == "fp4" else None)
    args = (q, k, v, [plan.slot_rows, plan.tile_counts], [plan.block, plan.num_prefix_tiles, topk], precision,
            [1, 0, 0, int(compress)], "torch-reference:sparse", options)  # fmt: skip
    opcheck(vsa_attention_op, args)
    out, coarse = vsa_attention(q, k, v, plan, sparsity=0.5, precision=precision, compress=compress, backend="torch")
    assert out.shape == q.shape and (coarse is None) == (not compress)


def test_fa_v100_attention_op_reference():
    q, k, v = (torch.randn(1, 24, 2, 64, generator=_gen(i)) for i in range(3))
    opcheck(fa_v100_attention_op, (q, k, v, None, 64, "reference", None))
    out = torch.empty(1, 24, 2, 64, dtype=torch.float16)
    assert fa_v100_attention(q.half(), k.half(), v.half(), backend="reference", out=out) is out


def test_flashinfer_ops_with_the_stand_in(flashinfer_stand_in):
    q, k, v = (torch.randn(2, 24, 2, 16, generator=_gen(i), dtype=torch.bfloat16) for i in range(3))
    opcheck(flashinfer_dense_attention_op, (q, k, v, "fa3"))
    opcheck(flashinfer_fp8_attention_op, (q, k, v, True))


def test_attention_fakes_give_the_gpu_kernels_outputs():
    """The Hopper / Triton attention kernels and the CUDA FA-V100 kernel on a GPU: the fake output has the metadata
    of the CPU reference's output (what the kernels return)."""
    plan, q, _, _, kp, vp, kv_index, kv_num = _sparse_inputs(dtype=torch.bfloat16, head_dim=64)
    lists = (plan.slot_rows, plan.tile_counts, kv_index, kv_num)
    q8 = q.to(torch.float8_e4m3fn)
    scales = {"q_scale": torch.ones(q.shape[:3]), "k_scale": torch.ones(1, plan.num_tiles, 2)}
    cases = [
        (block_sparse_attention, (q, kp, vp, *lists), {"block": plan.block}),
        (block_sparse_attention, (q8, kp.to(torch.float8_e4m3fn), vp, *lists), {"block": plan.block, **scales}),
        (fp8_attention, (q, q, q), {"qk_dtype": torch.int8}),
        (fa_v100_attention, (q.half(), q.half(), q.half()), {}),
    ]
    for function, args, kwargs in cases:
        ref = function(*args, **kwargs, backend="reference" if function is fa_v100_attention else "torch")
        with FakeTensorMode() as mode:
            fake = [mode.from_tensor(a).to("cuda") if isinstance(a, torch.Tensor) else a for a in args]
            fake_kwargs = {k: mode.from_tensor(a).to("cuda") if isinstance(a, torch.Tensor) else a
                           for k, a in kwargs.items()}  # fmt: skip
            out = function(*fake, **fake_kwargs, backend="cuda" if function is fa_v100_attention else "triton")
        assert (out.shape, out.dtype, out.stride()) == (ref.shape, ref.dtype, ref.stride()), function.__name__
