"""Triton building blocks shared by the tiled weight-dequantizing GEMMs (W8A16, NVFP4 weight-only).

Each is a `@triton.jit` function that Triton inlines into the calling kernel, so sharing costs nothing at run time.
"""

from __future__ import annotations

from .._triton_utils import HAS_TRITON


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def grouped_tile_ids(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """(row tile, column tile) of program `pid` in grouped order: GROUP_M row tiles share the weight tiles they
        read, which keeps those in L2."""
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        width = GROUP_M * num_n
        first_m = (pid // width) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        return first_m + (pid % width) % size_m, (pid % width) // size_m

    @triton.jit
    def accumulate_dot(x, w, acc, SWAP_AB: tl.constexpr, IEEE: tl.constexpr):
        """acc += x @ w.T (or, with SWAP_AB, acc += w @ x.T, i.e. the transposed tile); IEEE for fp32 tests."""
        if SWAP_AB:
            if IEEE:
                acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
            else:
                acc = tl.dot(w, tl.trans(x), acc)
        else:
            if IEEE:
                acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc)
        return acc

    @triton.jit
    def store_output_tile(acc, o_ptr, b_ptr, offs_m, offs_n, mask_m, mask_n, stride_om, HAS_BIAS: tl.constexpr):
        """Add the bias in fp32, round once to the output dtype, store the masked (partial) tile."""
        if HAS_BIAS:
            b = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0)
            acc = acc + b[None, :].to(tl.float32)
        o_ptrs = o_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
