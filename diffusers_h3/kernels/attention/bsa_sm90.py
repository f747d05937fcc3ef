"""Hopper (SM90) block-sparse flash attention forward, written in Gluon (Triton's explicit-layout dialect).

Same contract and numerics as :mod:`.bsa_triton` (whose torch reference it is tested against); this
kernel only changes *how* the tensor cores are fed, the way FlashAttention-3 does on Hopper:

* K and V tiles arrive by TMA into a ring of ``STAGES`` shared-memory buffers, each with its own mbarrier, issued
  ``STAGES - 1`` key tiles ahead of their use (the tile index is read from the list in time for the copy);
* ``q`` stays in registers as the wgmma A operand (only the K tile is read from shared memory for ``Q K^T``: with
  64-key tiles an all-shared-memory ``Q K^T`` is bound by shared-memory bandwidth);
* the wgmma calls are asynchronous and ordered so that the softmax of key tile ``j + 1`` runs on the CUDA cores
  while the tensor cores compute ``P_j V_j``:

      S_{j+1} = Q K_{j+1}^T   (async)       O += P_j V_j   (async)
      wait S_{j+1}; online softmax -> P_{j+1}, alpha;  wait O; O *= alpha

Query programs own one 64-row query tile (sparse; with 16-bit Q/K two tiles, one per consumer warpgroup, fed by a
producer warp) or ``BLOCK_M`` consecutive rows (dense, 128 rows over two warpgroups). Precisions: bf16/fp16 Q/K/V, or
E4M3 / INT8 Q/K (per-row Q scales, one K scale per key tile, folded into the per-row softmax scale), with bf16 P·V or
FP8 P·V (channel-major E4M3 V with per-channel scales, ``e4m3(448 p)``).
The FP4 emulation stays on the portable Triton kernel.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .._triton_utils import HAS_TRITON
from ..numerics import LOG2E
from ._launch import index_args, scale_args
from .tuning import DEFAULT_TUNING, TuningOptions


# K/V ring depth of every variant unless a benchmark passes TuningOptions(num_stages=...).
DEFAULT_STAGES = 3

# Gluon's API moves between Triton releases: 3.6 is the oldest release these kernels run with on Hopper (CI compiles
# them with the installed Triton); older releases get the portable Triton kernel.
MIN_TRITON = (3, 6)

try:
    import triton

    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < MIN_TRITON:
        raise ImportError(f"Triton {triton.__version__} < {MIN_TRITON}")
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float8_e4m3fn: gl.float8e4nv,
                  torch.int8: gl.int8}

    HAS_GLUON = HAS_TRITON
except (ImportError, ValueError):  # pragma: no cover - depends on the installed Triton
    HAS_GLUON = False


def sm90_kernel_available(device: torch.device) -> bool:
    """True when the Gluon kernel can run: Triton >= 3.6 with Gluon, and a compute capability 9.x GPU (wgmma, TMA)."""
    return (
        HAS_GLUON and device.type == "cuda" and torch.cuda.is_available()
        and torch.cuda.get_device_capability(device)[0] == 9
    )


if HAS_GLUON:

    @gluon.jit
    def _copy_kv(k_desc, v_desc, k_buf, v_buf, k_bar, v_bar, kv, b, h, H, KV_ROWS, HEAD_DIM: gl.constexpr,
                 BLOCK_N: gl.constexpr):
        """TMA copies of key tile ``kv`` of (batch, head) into one ring slot; FP8 V is channel-major
        (``[B*H*D, N]`` rows: the FP8 wgmma wants its B operand K-major)."""
        row = (b * KV_ROWS + kv * BLOCK_N).to(gl.int32)
        mbarrier.expect(k_bar, k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row, h * HEAD_DIM], k_bar, k_buf)
        mbarrier.expect(v_bar, v_desc.block_type.nbytes)
        PV_FP8: gl.constexpr = v_desc.dtype == gl.float8e4nv
        if PV_FP8:
            tma.async_copy_global_to_shared(v_desc, [((b * H + h) * HEAD_DIM).to(gl.int32), kv * BLOCK_N], v_bar,
                                            v_buf)
        else:
            tma.async_copy_global_to_shared(v_desc, [row, h * HEAD_DIM], v_bar, v_buf)

    @gluon.jit
    def _issue_tile_copy(k_desc, v_desc, k_bufs, v_bufs, k_bars, v_bars, tile, kv, b, h, H, KV_ROWS,
                         HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """TMA copies of key tile ``kv`` (list position ``tile``) into ring slot ``tile % STAGES``."""
        slot = tile % STAGES
        _copy_kv(k_desc, v_desc, k_bufs.index(slot), v_bufs.index(slot), k_bars.index(slot), v_bars.index(slot), kv,
                 b, h, H, KV_ROWS, HEAD_DIM, BLOCK_N)

    @gluon.jit
    def _v_operand(v_buf, PV_FP8: gl.constexpr):
        """The ``[keys, D]`` B operand of P·V from a ring slot (FP8 V sits channel-major: a transposed view)."""
        if PV_FP8:
            operand = v_buf.permute((1, 0))
        else:
            operand = v_buf
        return operand

    @gluon.jit
    def _tile_at(j, DENSE: gl.constexpr, list_base):
        """Key tile index of list position ``j`` (``j`` itself in dense mode)."""
        if DENSE:
            kv = j
        else:
            kv = gl.load(list_base + j)
        return kv

    @gluon.jit
    def _tile_rows(kv, DENSE: gl.constexpr, TILE_COUNTS, S, BLOCK_N: gl.constexpr):
        """Valid rows of key tile ``kv``."""
        if DENSE:
            cnt = gl.minimum(S - kv * BLOCK_N, BLOCK_N)
        else:
            cnt = gl.load(TILE_COUNTS + kv)
        return cnt

    @gluon.jit
    def _p_operand(p, p_buf, dtype: gl.constexpr, layout: gl.constexpr):
        """``p`` as the A operand of the P·V wgmma: 16-bit registers (two values per conversion instruction), or
        ``e4m3(448 p)`` staged in shared memory ``p_buf`` for FP8 P·V (an 8-bit register operand cannot be kept
        alive across the asynchronous wgmma)."""
        if dtype == gl.float8e4nv:
            p_buf.store((p * 448.0).to(gl.float8e4nv))
            fence_async_shared()
            operand = p_buf
        elif dtype == gl.bfloat16:
            operand = gl.convert_layout(gl.inline_asm_elementwise(
                "cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [p], dtype=gl.bfloat16, is_pure=True, pack=2), layout)
        else:
            operand = gl.convert_layout(gl.inline_asm_elementwise(
                "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [p], dtype=gl.float16, is_pure=True, pack=2), layout)
        return operand

    @gluon.jit
    def _wait_pv(o_tok, p_op, PV_FP8: gl.constexpr):
        """Wait for ``P V``; a register ``P`` stays alive until then."""
        if PV_FP8:
            acc = warpgroup_mma_wait(0, deps=[o_tok])
        else:
            acc, p_op = warpgroup_mma_wait(0, deps=[o_tok, p_op])
        return acc

    @gluon.jit
    def _softmax_step(s, cnt, row_scale, m_i, l_i, offs_n, BLOCK_N: gl.constexpr):
        """Online softmax (base 2) of raw scores ``s``: returns ``p``, new ``m``, new ``l`` and ``alpha``."""
        s = s.to(gl.float32)  # int32 scores of INT8 Q/K (exact: |q . k| <= D * 127^2 < 2^24)
        if cnt < BLOCK_N:
            s = gl.where(gl.expand_dims(offs_n < cnt, 0), s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * row_scale)
        p = gl.exp2(s * gl.expand_dims(row_scale, 1) - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
        return p, m_new, l_i * alpha + gl.sum(p, 1), alpha

    @gluon.jit
    def _key_tile(j, DENSE: gl.constexpr, list_base, TILE_COUNTS, S, row_scale_q, ks_base, stride_kss,
                  BLOCK_N: gl.constexpr, QK_8BIT: gl.constexpr):
        """Valid rows and per-row score scale of the key tile at list position ``j``."""
        kv = _tile_at(j, DENSE, list_base)
        cnt = _tile_rows(kv, DENSE, TILE_COUNTS, S, BLOCK_N)
        row_scale = row_scale_q
        if QK_8BIT:
            row_scale = row_scale_q * gl.load(ks_base + kv * stride_kss)
        return cnt, row_scale

    @gluon.jit
    def _attend_tiles(q, row_scale_q, num, k_bufs, v_bufs, p_bufs, k_bars, v_bars, empty, p_base, k_desc, v_desc,
                      list_base, TILE_COUNTS, ks_base, stride_kss, S, b, h, H, KV_ROWS,
                      s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr, DENSE: gl.constexpr,
                      QK_8BIT: gl.constexpr, PV_FP8: gl.constexpr, PRODUCER_WARP: gl.constexpr):
        """Online-softmax attention of one warpgroup's 64 query rows over ``num >= 1`` key tiles of the ring.

        Order (FlashAttention-3's intra-warpgroup overlap): ``S_{j+1} = Q K_{j+1}^T`` and ``P_j V_j`` in flight
        together, the softmax of tile ``j + 1`` under ``P_j V_j``. Without a producer warp the warpgroup requests
        tile ``j + STAGES - 1`` itself (its slot held tile ``j - 1``, whose products are complete); with one
        (``PRODUCER_WARP``) it releases each slot on ``empty`` once ``P_j V_j`` is done. Returns ``acc, l``.
        """
        STAGES: gl.constexpr = k_bufs.type.shape[0]
        BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
        HEAD_DIM: gl.constexpr = k_bufs.type.shape[2]
        ROWS: gl.constexpr = q.type.shape[0]
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, s_layout))
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
        S_DTYPE: gl.constexpr = gl.int32 if q.dtype == gl.int8 else gl.float32  # INT8 Q K^T accumulates exactly
        s_zero = gl.zeros([ROWS, BLOCK_N], S_DTYPE, layout=s_layout)

        cnt, row_scale = _key_tile(0, DENSE, list_base, TILE_COUNTS, S, row_scale_q, ks_base, stride_kss, BLOCK_N,
                                   QK_8BIT)
        mbarrier.wait(k_bars.index(0), 0)
        s_tok = warpgroup_mma(q, k_bufs.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=[s_tok])
        p, m_i, l_i, alpha = _softmax_step(s, cnt, row_scale, m_i, l_i, offs_n, BLOCK_N)
        p_op = _p_operand(p, p_bufs.index(p_base), v_desc.dtype, p_layout)
        for j in range(0, num - 1):
            if not PRODUCER_WARP:
                ahead = j + STAGES - 1
                if ahead < num:
                    _issue_tile_copy(k_desc, v_desc, k_bufs, v_bufs, k_bars, v_bars, ahead,
                                     _tile_at(ahead, DENSE, list_base), b, h, H, KV_ROWS, HEAD_DIM,
                                     BLOCK_N, STAGES)
            nxt = j + 1
            cnt, row_scale = _key_tile(nxt, DENSE, list_base, TILE_COUNTS, S, row_scale_q, ks_base, stride_kss,
                                       BLOCK_N, QK_8BIT)
            slot_n = nxt % STAGES
            mbarrier.wait(k_bars.index(slot_n), (nxt // STAGES) & 1)
            s_tok = warpgroup_mma(q, k_bufs.index(slot_n).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            slot = j % STAGES
            mbarrier.wait(v_bars.index(slot), (j // STAGES) & 1)
            o_tok = warpgroup_mma(p_op, _v_operand(v_bufs.index(slot), PV_FP8), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=[s_tok])
            p, m_i, l_i, alpha = _softmax_step(s, cnt, row_scale, m_i, l_i, offs_n, BLOCK_N)
            acc = _wait_pv(o_tok, p_op, PV_FP8)
            if PRODUCER_WARP:
                mbarrier.arrive(empty.index(slot), count=1)  # K_j and V_j are consumed
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            p_op = _p_operand(p, p_bufs.index(p_base + nxt % 2), v_desc.dtype, p_layout)
        last = num - 1
        mbarrier.wait(v_bars.index(last % STAGES), (last // STAGES) & 1)
        o_tok = warpgroup_mma(p_op, _v_operand(v_bufs.index(last % STAGES), PV_FP8), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[o_tok])
        if PRODUCER_WARP:
            mbarrier.arrive(empty.index(last % STAGES), count=1)
        return acc, l_i

    @gluon.jit
    def _store_rows(acc, l_i, rows, row_valid, O, V_SCALE, b, h, H, stride_ob, stride_os, stride_oh,
                    o_layout: gl.constexpr, PV_FP8: gl.constexpr):
        """Normalise (``acc / l``, times the per-channel V scale / 448 with FP8 P·V) and write the valid rows."""
        HEAD_DIM: gl.constexpr = acc.type.shape[1]
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        if PV_FP8:
            v_sc = gl.load(V_SCALE + (b * H + h) * HEAD_DIM + offs_d)
            acc = acc * gl.expand_dims(v_sc / 448.0, 0)
        out = acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1)
        rows_o = gl.convert_layout(rows, gl.SliceLayout(1, o_layout))
        valid_o = gl.convert_layout(row_valid, gl.SliceLayout(1, o_layout))
        ptrs = (O + b.to(gl.int64) * stride_ob + gl.expand_dims(rows_o * stride_os, 1) + h * stride_oh
                + gl.expand_dims(offs_d, 0))
        gl.store(ptrs, out.to(O.dtype.element_ty), mask=gl.expand_dims(valid_o, 1))

    @gluon.jit
    def _sparse_query_tile(t, offs_m_q, offs_m, SLOT_ROWS, TILE_COUNTS, KV_INDEX, KV_NUM, b, h, H, N_Q_TILES, stride_ib,
                           stride_ih, stride_it):
        """Query tile ``t`` of (batch, head): its packed rows in the q-operand and row layouts (``offs_m_q``,
        ``offs_m``: the tile's slots), which of them are valid, and its key-tile list (start, length)."""
        BLOCK: gl.constexpr = offs_m.shape[0]
        rows_q = gl.load(SLOT_ROWS + t * BLOCK + offs_m_q).to(gl.int64)
        rows = gl.load(SLOT_ROWS + t * BLOCK + offs_m).to(gl.int64)
        row_valid = offs_m < gl.load(TILE_COUNTS + t)
        list_base = KV_INDEX + b.to(gl.int64) * stride_ib + h * stride_ih + t.to(gl.int64) * stride_it
        num = gl.load(KV_NUM + (b * H + h) * N_Q_TILES + t)
        return rows_q, rows, row_valid, list_base, num

    @gluon.jit
    def _load_query(Q, Q_SCALE, rows_q, rows, b64, h, qk_scale, stride_qb, stride_qs, stride_qh, stride_qsb,
                    stride_qss, q_layout: gl.constexpr, row_layout: gl.constexpr, HEAD_DIM: gl.constexpr,
                    QK_8BIT: gl.constexpr):
        """``q`` of the given rows as the wgmma A operand (registers) and their per-row score scale
        (softmax scale * log2(e), times the FP8 Q scale)."""
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_layout))
        q = gl.load(Q + b64 * stride_qb + gl.expand_dims(rows_q * stride_qs, 1) + h * stride_qh
                    + gl.expand_dims(offs_d, 0))
        row_scale = gl.full(rows.shape, qk_scale, gl.float32, layout=row_layout)
        if QK_8BIT:
            row_scale = row_scale * gl.load(Q_SCALE + b64 * stride_qsb + rows * stride_qss + h)
        return q, row_scale

    @gluon.jit
    def _bsa_fwd_sm90_kernel(
        Q, k_desc, v_desc, O, Q_SCALE, K_SCALE, V_SCALE, SLOT_ROWS, TILE_COUNTS, KV_INDEX, KV_NUM,
        qk_scale, S, H, N_KV_BLOCKS, N_Q_TILES, KV_ROWS,
        stride_qb, stride_qs, stride_qh, stride_ob, stride_os, stride_oh, stride_qsb, stride_qss,
        stride_ksb, stride_kss, stride_ksh, stride_ib, stride_ih, stride_it,
        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        DENSE: gl.constexpr, QK_8BIT: gl.constexpr, num_warps: gl.constexpr,
    ):
        # Register layouts: one wgmma accumulator layout for S = Q K^T [M, N] and one for O [M, D]; q and p are
        # their A operands in registers; row statistics live in the slice of the S layout.
        q_bits: gl.constexpr = Q.dtype.element_ty.primitive_bitwidth
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_N, 256 // q_bits])
        v_bits: gl.constexpr = v_desc.dtype.primitive_bitwidth
        PV_FP8: gl.constexpr = v_desc.dtype == gl.float8e4nv
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, HEAD_DIM, 256 // v_bits])
        q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=32 // q_bits)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=32 // v_bits)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

        pid_m = gl.program_id(0)
        pid_bh = gl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        b64 = b.to(gl.int64)

        # 1. Query rows, the key-tile list, q (registers) and the per-row score scale.
        offs_m_q = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_layout))
        offs_m = gl.arange(0, BLOCK_M, layout=row_layout)
        if DENSE:
            rows_q = pid_m * BLOCK_M + offs_m_q
            rows_q = gl.where(rows_q < S, rows_q, 0).to(gl.int64)
            rows = pid_m * BLOCK_M + offs_m
            row_valid = rows < S
            rows = gl.where(row_valid, rows, 0).to(gl.int64)
            num = N_KV_BLOCKS
            list_base = KV_INDEX
        else:
            rows_q, rows, row_valid, list_base, num = _sparse_query_tile(
                pid_m, offs_m_q, offs_m, SLOT_ROWS, TILE_COUNTS, KV_INDEX, KV_NUM, b, h, H, N_Q_TILES, stride_ib,
                stride_ih, stride_it)
        q, row_scale_q = _load_query(Q, Q_SCALE, rows_q, rows, b64, h, qk_scale, stride_qb, stride_qs, stride_qh,
                                     stride_qsb, stride_qss, q_layout, row_layout, HEAD_DIM, QK_8BIT)
        ks_base = K_SCALE + b64 * stride_ksb + h * stride_ksh

        # 2. Shared-memory rings and their barriers; the first STAGES - 1 tiles are requested at once.
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        if PV_FP8:  # E4M3 P, double-buffered: P_{j+1} is written while P_j V_j runs
            p_bufs = gl.allocate_shared_memory(gl.float8e4nv, [2, BLOCK_M, BLOCK_N],
                                               gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.float8e4nv))
        else:
            p_bufs = v_bufs
        k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(k_bars.index(i), count=1)
            mbarrier.init(v_bars.index(i), count=1)
        fence_async_shared()
        for i in gl.static_range(STAGES - 1):
            if i < num:
                _issue_tile_copy(k_desc, v_desc, k_bufs, v_bufs, k_bars, v_bars, i,
                                 _tile_at(i, DENSE, list_base), b, h, H, KV_ROWS, HEAD_DIM, BLOCK_N,
                                 STAGES)

        # 3. The tiles (a tile with no keys cannot occur: non-video tiles are always listed).
        acc, l_i = _attend_tiles(q, row_scale_q, num, k_bufs, v_bufs, p_bufs, k_bars, v_bars, k_bars, 0, k_desc,
                                 v_desc, list_base, TILE_COUNTS, ks_base, stride_kss, S, b, h, H, KV_ROWS, s_layout,
                                 o_layout, p_layout, DENSE, QK_8BIT, PV_FP8, False)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(k_bars.index(i))
            mbarrier.invalidate(v_bars.index(i))

        # 4. Normalise and write the valid rows.
        _store_rows(acc, l_i, rows, row_valid, O, V_SCALE, b, h, H, stride_ob, stride_os, stride_oh, o_layout, PV_FP8)

    @gluon.jit
    def _ws_load_partition(Q, O, Q_SCALE, K_SCALE, V_SCALE, k_desc, v_desc, k_bufs, v_bufs, p_bufs, k_ready,
                           v_ready, empty, pid_m, b, h, S, H, N_KV_BLOCKS, KV_ROWS, qk_scale, stride_qb, stride_qs,
                           stride_qh, stride_ob, stride_os, stride_oh, stride_qsb, stride_qss, stride_ksb, stride_kss,
                           stride_ksh):
        """Producer warp: streams every key block into the ring once both consumers released the slot."""
        STAGES: gl.constexpr = k_bufs.type.shape[0]
        BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
        HEAD_DIM: gl.constexpr = k_bufs.type.shape[2]
        for j in range(0, N_KV_BLOCKS):
            slot = j % STAGES
            mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1
            _copy_kv(k_desc, v_desc, k_bufs.index(slot), v_bufs.index(slot), k_ready.index(slot),
                     v_ready.index(slot), j, b, h, H, KV_ROWS, HEAD_DIM, BLOCK_N)

    @gluon.jit
    def _ws_consumer(Q, O, Q_SCALE, K_SCALE, V_SCALE, k_desc, v_desc, k_bufs, v_bufs, p_bufs, k_ready, v_ready, empty,
                     pid_m, b, h, S, H, N_KV_BLOCKS, KV_ROWS, qk_scale, stride_qb, stride_qs, stride_qh,
                     stride_ob, stride_os, stride_oh, stride_qsb, stride_qss, stride_ksb, stride_kss, stride_ksh,
                     WG: gl.constexpr):
        """One consumer warpgroup: rows ``[WG * 64, WG * 64 + 64)`` of the program's 128 query rows, every key
        block (:func:`_attend_tiles` with the producer warp's ring)."""
        # (constexprs do not cross gl.warp_specialize: they are read back from the buffer and pointer types)
        WG_ROWS: gl.constexpr = 64
        BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
        HEAD_DIM: gl.constexpr = k_bufs.type.shape[2]
        QK_8BIT: gl.constexpr = Q.dtype.element_ty.primitive_bitwidth == 8
        PV_FP8: gl.constexpr = v_bufs.dtype == gl.float8e4nv
        v_bits: gl.constexpr = v_bufs.dtype.primitive_bitwidth
        q_bits: gl.constexpr = Q.dtype.element_ty.primitive_bitwidth
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 256 // q_bits])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 256 // v_bits])
        q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=32 // q_bits)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=32 // v_bits)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        b64 = b.to(gl.int64)
        first_row = pid_m * (2 * WG_ROWS) + WG * WG_ROWS

        rows_q = first_row + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, q_layout))
        rows_q = gl.where(rows_q < S, rows_q, 0).to(gl.int64)
        rows = first_row + gl.arange(0, WG_ROWS, layout=row_layout)
        row_valid = rows < S
        rows = gl.where(row_valid, rows, 0).to(gl.int64)
        q, row_scale_q = _load_query(Q, Q_SCALE, rows_q, rows, b64, h, qk_scale, stride_qb, stride_qs, stride_qh,
                                     stride_qsb, stride_qss, q_layout, row_layout, HEAD_DIM, QK_8BIT)
        ks_base = K_SCALE + b64 * stride_ksb + h * stride_ksh
        acc, l_i = _attend_tiles(q, row_scale_q, N_KV_BLOCKS, k_bufs, v_bufs, p_bufs, k_ready, v_ready, empty, 2 * WG,
                                 k_desc, v_desc, Q, Q, ks_base, stride_kss, S, b, h, H, KV_ROWS, s_layout, o_layout,
                                 p_layout, True, QK_8BIT, PV_FP8, True)
        _store_rows(acc, l_i, rows, row_valid, O, V_SCALE, b, h, H, stride_ob, stride_os, stride_oh, o_layout, PV_FP8)

    # gl.warp_specialize takes one function per partition and no constexpr arguments: one thin entry per consumer.
    @gluon.jit
    def _ws_consumer_0(Q, O, Q_SCALE, K_SCALE, V_SCALE, k_desc, v_desc, k_bufs, v_bufs, p_bufs, k_ready, v_ready,
                       empty, pid_m, b, h, S, H, N_KV_BLOCKS, KV_ROWS, qk_scale, stride_qb, stride_qs, stride_qh,
                       stride_ob, stride_os, stride_oh, stride_qsb, stride_qss, stride_ksb, stride_kss, stride_ksh):
        _ws_consumer(Q, O, Q_SCALE, K_SCALE, V_SCALE, k_desc, v_desc, k_bufs, v_bufs, p_bufs, k_ready, v_ready, empty,
                     pid_m, b, h, S, H, N_KV_BLOCKS, KV_ROWS, qk_scale, stride_qb, stride_qs, stride_qh, stride_ob,
                     stride_os, stride_oh, stride_qsb, stride_qss, stride_ksb, stride_kss, stride_ksh, 0)

    @gluon.jit
    def _ws_consumer_1(Q, O, Q_SCALE, K_SCALE, V_SCALE, k_desc, v_desc, k_bufs, v_bufs, p_bufs, k_ready, v_ready,
                       empty, pid_m, b, h, S, H, N_KV_BLOCKS, KV_ROWS, qk_scale, stride_qb, stride_qs, stride_qh,
                       stride_ob, stride_os, stride_oh, stride_qsb, stride_qss, stride_ksb, stride_kss, stride_ksh):
        _ws_consumer(Q, O, Q_SCALE, K_SCALE, V_SCALE, k_desc, v_desc, k_bufs, v_bufs, p_bufs, k_ready, v_ready, empty,
                     pid_m, b, h, S, H, N_KV_BLOCKS, KV_ROWS, qk_scale, stride_qb, stride_qs, stride_qh, stride_ob,
                     stride_os, stride_oh, stride_qsb, stride_qss, stride_ksb, stride_kss, stride_ksh, 1)

    @gluon.jit
    def _dense_fwd_sm90_ws_kernel(
        Q, k_desc, v_desc, O, Q_SCALE, K_SCALE, V_SCALE, qk_scale, S, H, N_KV_BLOCKS, KV_ROWS,
        stride_qb, stride_qs, stride_qh, stride_ob, stride_os, stride_oh, stride_qsb, stride_qss,
        stride_ksb, stride_kss, stride_ksh,
        HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, QK_8BIT: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ):
        """Dense attention, FlashAttention-3 style: a 1-warp TMA producer and two independent consumer warpgroups
        (64 query rows each) sharing one K/V ring; the warp schedulers interleave one consumer's softmax with the
        other's wgmma."""
        pid_m = gl.program_id(0)
        pid_bh = gl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        if v_desc.dtype == gl.float8e4nv:  # E4M3 P: two buffers per consumer warpgroup
            p_bufs = gl.allocate_shared_memory(gl.float8e4nv, [4, 64, BLOCK_N],
                                               gl.NVMMASharedLayout.get_default_for([64, BLOCK_N], gl.float8e4nv))
        else:
            p_bufs = v_bufs
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # released by both consumers
        fence_async_shared()
        args = (Q, O, Q_SCALE, K_SCALE, V_SCALE, k_desc, v_desc, k_bufs, v_bufs, p_bufs, k_ready, v_ready, empty,
                pid_m, b, h, S, H, N_KV_BLOCKS, KV_ROWS, qk_scale, stride_qb, stride_qs, stride_qh, stride_ob,
                stride_os, stride_oh, stride_qsb, stride_qss, stride_ksb, stride_kss, stride_ksh)
        gl.warp_specialize([
            (_ws_consumer_0, args),
            (_ws_consumer_1, args),
            (_ws_load_partition, args),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

    @gluon.jit
    def _ws_sparse_load_partition(Q, O, Q_SCALE, K_SCALE, V_SCALE, SLOT_ROWS, TILE_COUNTS, KV_INDEX, KV_NUM, k_desc,
                                  v_desc, k0, v0, kr0, vr0, em0, k1, v1, kr1, vr1, em1, p_bufs, pid_m, b, h, S, H,
                                  N_Q_TILES, KV_ROWS, qk_scale, stride_qb, stride_qs, stride_qh, stride_ob, stride_os,
                                  stride_oh, stride_qsb, stride_qss, stride_ksb, stride_kss, stride_ksh, stride_ib,
                                  stride_ih, stride_it):
        """Producer warp of the sparse two-tile program: streams each consumer's key tiles into that consumer's ring."""
        STAGES: gl.constexpr = k0.type.shape[0]
        BLOCK_N: gl.constexpr = k0.type.shape[1]
        HEAD_DIM: gl.constexpr = k0.type.shape[2]
        t0 = pid_m * 2
        n0 = gl.load(KV_NUM + (b * H + h) * N_Q_TILES + t0)
        n1 = n0 * 0
        if t0 + 1 < N_Q_TILES:
            n1 = gl.load(KV_NUM + (b * H + h) * N_Q_TILES + t0 + 1)
        base0 = KV_INDEX + b.to(gl.int64) * stride_ib + h * stride_ih + t0.to(gl.int64) * stride_it
        for j in range(0, gl.maximum(n0, n1)):
            slot = j % STAGES
            phase = ((j // STAGES) & 1) ^ 1  # a fresh barrier passes phase 1
            if j < n0:
                mbarrier.wait(em0.index(slot), phase)
                _copy_kv(k_desc, v_desc, k0.index(slot), v0.index(slot), kr0.index(slot), vr0.index(slot),
                         gl.load(base0 + j), b, h, H, KV_ROWS, HEAD_DIM, BLOCK_N)
            if j < n1:
                mbarrier.wait(em1.index(slot), phase)
                _copy_kv(k_desc, v_desc, k1.index(slot), v1.index(slot), kr1.index(slot), vr1.index(slot),
                         gl.load(base0 + stride_it + j), b, h, H, KV_ROWS, HEAD_DIM, BLOCK_N)

    @gluon.jit
    def _ws_sparse_consumer(Q, O, Q_SCALE, K_SCALE, V_SCALE, SLOT_ROWS, TILE_COUNTS, KV_INDEX, KV_NUM, k_desc, v_desc,
                            k0, v0, kr0, vr0, em0, k1, v1, kr1, vr1, em1, p_bufs, pid_m, b, h, S, H, N_Q_TILES,
                            KV_ROWS, qk_scale, stride_qb, stride_qs, stride_qh, stride_ob, stride_os, stride_oh,
                            stride_qsb, stride_qss, stride_ksb, stride_kss, stride_ksh, stride_ib, stride_ih,
                            stride_it, WG: gl.constexpr):
        """One consumer warpgroup of the sparse two-tile program: query tile ``2 * pid_m + WG`` over its own list and
        ring."""
        if WG == 0:
            k_bufs, v_bufs, k_ready, v_ready, empty = k0, v0, kr0, vr0, em0
        else:
            k_bufs, v_bufs, k_ready, v_ready, empty = k1, v1, kr1, vr1, em1
        BLOCK_N: gl.constexpr = k0.type.shape[1]
        HEAD_DIM: gl.constexpr = k0.type.shape[2]
        QK_8BIT: gl.constexpr = Q.dtype.element_ty.primitive_bitwidth == 8
        PV_FP8: gl.constexpr = v0.dtype == gl.float8e4nv
        v_bits: gl.constexpr = v0.dtype.primitive_bitwidth
        q_bits: gl.constexpr = Q.dtype.element_ty.primitive_bitwidth
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 256 // q_bits])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 256 // v_bits])
        q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=32 // q_bits)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=32 // v_bits)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        t = pid_m * 2 + WG
        if t < N_Q_TILES:
            b64 = b.to(gl.int64)
            rows_q, rows, row_valid, list_base, num = _sparse_query_tile(
                t, gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, q_layout)), gl.arange(0, BLOCK_N, layout=row_layout),
                SLOT_ROWS, TILE_COUNTS, KV_INDEX, KV_NUM, b, h, H, N_Q_TILES, stride_ib, stride_ih, stride_it)
            q, row_scale_q = _load_query(Q, Q_SCALE, rows_q, rows, b64, h, qk_scale, stride_qb, stride_qs, stride_qh,
                                         stride_qsb, stride_qss, q_layout, row_layout, HEAD_DIM, QK_8BIT)
            ks_base = K_SCALE + b64 * stride_ksb + h * stride_ksh
            acc, l_i = _attend_tiles(q, row_scale_q, num, k_bufs, v_bufs, p_bufs, k_ready, v_ready, empty, 2 * WG,
                                     k_desc, v_desc, list_base, TILE_COUNTS, ks_base, stride_kss, S, b, h, H, KV_ROWS,
                                     s_layout, o_layout, p_layout, False, QK_8BIT, PV_FP8, True)
            _store_rows(acc, l_i, rows, row_valid, O, V_SCALE, b, h, H, stride_ob, stride_os, stride_oh, o_layout,
                        PV_FP8)

    @gluon.jit
    def _ws_sparse_consumer_0(Q, O, Q_SCALE, K_SCALE, V_SCALE, SLOT_ROWS, TILE_COUNTS, KV_INDEX, KV_NUM, k_desc,
                              v_desc, k0, v0, kr0, vr0, em0, k1, v1, kr1, vr1, em1, p_bufs, pid_m, b, h, S, H,
                              N_Q_TILES, KV_ROWS, qk_scale, stride_qb, stride_qs, stride_qh, stride_ob, stride_os,
                              stride_oh, stride_qsb, stride_qss, stride_ksb, stride_kss, stride_ksh, stride_ib,
                              stride_ih, stride_it):
        _ws_sparse_consumer(Q, O, Q_SCALE, K_SCALE, V_SCALE, SLOT_ROWS, TILE_COUNTS, KV_INDEX, KV_NUM, k_desc, v_desc,
                            k0, v0, kr0, vr0, em0, k1, v1, kr1, vr1, em1, p_bufs, pid_m, b, h, S, H, N_Q_TILES,
                            KV_ROWS, qk_scale, stride_qb, stride_qs, stride_qh, stride_ob, stride_os, stride_oh,
                            stride_qsb, stride_qss, stride_ksb, stride_kss, stride_ksh, stride_ib, stride_ih,
                            stride_it, 0)

    @gluon.jit
    def _ws_sparse_consumer_1(Q, O, Q_SCALE, K_SCALE, V_SCALE, SLOT_ROWS, TILE_COUNTS, KV_INDEX, KV_NUM, k_desc,
                              v_desc, k0, v0, kr0, vr0, em0, k1, v1, kr1, vr1, em1, p_bufs, pid_m, b, h, S, H,
                              N_Q_TILES, KV_ROWS, qk_scale, stride_qb, stride_qs, stride_qh, stride_ob, stride_os,
                              stride_oh, stride_qsb, stride_qss, stride_ksb, stride_kss, stride_ksh, stride_ib,
                              stride_ih, stride_it):
        _ws_sparse_consumer(Q, O, Q_SCALE, K_SCALE, V_SCALE, SLOT_ROWS, TILE_COUNTS, KV_INDEX, KV_NUM, k_desc, v_desc,
                            k0, v0, kr0, vr0, em0, k1, v1, kr1, vr1, em1, p_bufs, pid_m, b, h, S, H, N_Q_TILES,
                            KV_ROWS, qk_scale, stride_qb, stride_qs, stride_qh, stride_ob, stride_os, stride_oh,
                            stride_qsb, stride_qss, stride_ksb, stride_kss, stride_ksh, stride_ib, stride_ih,
                            stride_it, 1)

    @gluon.jit
    def _sparse_fwd_sm90_ws_kernel(
        Q, k_desc, v_desc, O, Q_SCALE, K_SCALE, V_SCALE, SLOT_ROWS, TILE_COUNTS, KV_INDEX, KV_NUM,
        qk_scale, S, H, N_Q_TILES, KV_ROWS,
        stride_qb, stride_qs, stride_qh, stride_ob, stride_os, stride_oh, stride_qsb, stride_qss,
        stride_ksb, stride_kss, stride_ksh, stride_ib, stride_ih, stride_it,
        HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ):
        """Block-sparse attention, two query tiles per program: a 1-warp TMA producer feeding one ring per consumer
        warpgroup (each warpgroup one query tile and its own key-tile list)."""
        pid_m = gl.program_id(0)
        pid_bh = gl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        k0 = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        k1 = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v0 = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        v1 = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        if v_desc.dtype == gl.float8e4nv:  # E4M3 P: two buffers per consumer warpgroup
            p_bufs = gl.allocate_shared_memory(gl.float8e4nv, [4, 64, BLOCK_N],
                                               gl.NVMMASharedLayout.get_default_for([64, BLOCK_N], gl.float8e4nv))
        else:
            p_bufs = v0
        kr0 = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        vr0 = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        em0 = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kr1 = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        vr1 = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        em1 = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(kr0.index(i), count=1)
            mbarrier.init(vr0.index(i), count=1)
            mbarrier.init(em0.index(i), count=1)
            mbarrier.init(kr1.index(i), count=1)
            mbarrier.init(vr1.index(i), count=1)
            mbarrier.init(em1.index(i), count=1)
        fence_async_shared()
        args = (Q, O, Q_SCALE, K_SCALE, V_SCALE, SLOT_ROWS, TILE_COUNTS, KV_INDEX, KV_NUM, k_desc, v_desc, k0, v0,
                kr0, vr0, em0, k1, v1, kr1, vr1, em1, p_bufs, pid_m, b, h, S, H, N_Q_TILES, KV_ROWS,
                qk_scale, stride_qb, stride_qs, stride_qh, stride_ob, stride_os, stride_oh,
                stride_qsb, stride_qss, stride_ksb, stride_kss, stride_ksh, stride_ib, stride_ih,
                stride_it)
        gl.warp_specialize([
            (_ws_sparse_consumer_0, args),
            (_ws_sparse_consumer_1, args),
            (_ws_sparse_load_partition, args),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def two_rings_fit(stages: int, block: int, head_dim: int, k_bytes: int, v_bytes: int) -> bool:
    """Whether two rings of ``stages`` K/V slots (the two-tile sparse kernel) fit the multiprocessor's shared memory
    (227 KB on Hopper, with room left for barriers and the FP8 P buffers)."""
    return 2 * stages * block * head_dim * (k_bytes + v_bytes) <= 200 * 1024


def channel_major_rows(v: torch.Tensor) -> Optional[torch.Tensor]:
    """``v [B, N, H, D]`` viewed as ``[B*H*D, N]`` rows when its storage is channel-major with 16-byte aligned
    rows (the layout FP8 P·V reads by TMA), else ``None``."""
    b, n, h, d = v.shape
    sb, ss, sh, sd = v.stride()
    if ss != 1 or sh != d * sd or sb != h * sh or (sd * v.element_size()) % 16 or v.data_ptr() % 16:
        return None
    return v.as_strided((b * h * d, n), (sd, 1))


def block_sparse_attention_sm90(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_rows: Optional[torch.Tensor],
    tile_counts: Optional[torch.Tensor],
    kv_index: Optional[torch.Tensor],
    kv_num: Optional[torch.Tensor],
    out: torch.Tensor,
    *,
    block: int,
    scale: float,
    q_scale: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    dense: bool = False,
    tuning: TuningOptions = DEFAULT_TUNING,
    two_tiles: bool = False,
) -> torch.Tensor:
    """Launch the Gluon kernel on inputs that :func:`~.router.block_sparse_attention` validated and routed here, TMA
    layouts included (``sm90_kernel_supports``: contiguous packed ``k``/``v``, FP8 V channel-major).

    The dense mode with ``block_m=128`` (its default) runs :func:`_dense_fwd_sm90_ws_kernel`: two independent consumer
    warpgroups of 64 query rows and a TMA producer warp; ``block_m=64`` runs one warpgroup per program. The sparse mode
    with ``two_tiles`` runs :func:`_sparse_fwd_sm90_ws_kernel`: two query tiles per program, one consumer warpgroup and
    one ring each, fed by a TMA producer warp (bitwise the same result; the router decides, see
    :func:`two_rings_fit`). ``tuning`` (:class:`~.tuning.TuningOptions`) carries the knobs this kernel reads:
    ``block_m`` and ``num_stages`` (the K/V ring depth, default :data:`DEFAULT_STAGES`); ``two_tiles`` is the variant
    the router chose."""
    block_m, stages = tuning.block_m, tuning.num_stages or DEFAULT_STAGES
    if two_tiles and dense:
        raise ValueError("two_tiles applies to the sparse mode; the dense kernel takes block_m 64 or 128")
    if two_tiles and not two_rings_fit(stages, block, q.shape[-1], k.element_size(), v.element_size()):
        raise ValueError(f"two_tiles needs two rings of {stages} K/V slots, more than the shared memory holds; pass "
                         "fewer num_stages or two_tiles=False")
    if not HAS_GLUON:
        raise RuntimeError("the SM90 attention kernel needs Triton >= 3.6 (Gluon); pass TuningOptions(kernel='triton')")
    b, s, h, d = q.shape
    n = k.shape[1]
    k_gl = _GL_DTYPES[k.dtype]
    k_desc = TensorDescriptor.from_tensor(k.view(b * n, h * d), [block, d],
                                          gl.NVMMASharedLayout.get_default_for([block, d], k_gl))
    if v.dtype == torch.float8_e4m3fn:  # channel-major rows (batch, head, channel) x keys
        v_desc = TensorDescriptor.from_tensor(channel_major_rows(v), [d, block],
                                              gl.NVMMASharedLayout.get_default_for([d, block], gl.float8e4nv))
    else:
        v_desc = TensorDescriptor.from_tensor(v.view(b * n, h * d), [block, d],
                                              gl.NVMMASharedLayout.get_default_for([block, d], _GL_DTYPES[v.dtype]))
    dummy_i = torch.zeros(1, device=q.device, dtype=torch.int32)
    if dense:
        block_m = block_m or 128
        if block_m not in (64, 128):
            raise ValueError(f"the SM90 dense kernel takes block_m 64 or 128, got {block_m}")
        grid = (math.ceil(s / block_m), b * h)
        slot_rows = tile_counts = kv_index = kv_num = dummy_i
        index_strides = (0, 0, 0)
        n_kv_blocks, n_q_tiles = math.ceil(n / block), 0
    else:
        block_m = block
        grid = (tile_counts.numel(), b * h)
        kv_index, kv_num, index_strides = index_args(kv_index, kv_num)
        n_kv_blocks, n_q_tiles = 0, tile_counts.numel()
    (qs, ks, vs), scale_strides = scale_args(q_scale, k_scale, v_scale, q.device)
    if dense and block_m == 128:
        # 4 + 4 + 1 warps round up to 12 (three warpgroups): 168 registers each on average; the consumers get 232.
        _dense_fwd_sm90_ws_kernel[grid](
            q, k_desc, v_desc, out, qs, ks, vs, scale * LOG2E, s, h, n_kv_blocks, n,
            q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2),
            *scale_strides,
            HEAD_DIM=d, BLOCK_N=block, STAGES=stages, QK_8BIT=q_scale is not None,
            CONSUMER_REGS=232, PRODUCER_REGS=40, num_warps=4, maxnreg=168,
        )
        return out
    if two_tiles and not dense:
        _sparse_fwd_sm90_ws_kernel[(triton.cdiv(n_q_tiles, 2), b * h)](
            q, k_desc, v_desc, out, qs, ks, vs, slot_rows, tile_counts, kv_index, kv_num,
            scale * LOG2E, s, h, n_q_tiles, n,
            q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2),
            *scale_strides, *index_strides,
            HEAD_DIM=d, BLOCK_N=block, STAGES=stages, CONSUMER_REGS=232, PRODUCER_REGS=40, num_warps=4,
            maxnreg=168,
        )
        return out
    _bsa_fwd_sm90_kernel[grid](
        q, k_desc, v_desc, out, qs, ks, vs, slot_rows, tile_counts, kv_index, kv_num,
        scale * LOG2E, s, h, n_kv_blocks, n_q_tiles, n,
        q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2),
        *scale_strides, *index_strides,
        HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block, STAGES=stages, DENSE=dense,
        QK_8BIT=q_scale is not None, num_warps=block_m // 16,
    )
    return out
