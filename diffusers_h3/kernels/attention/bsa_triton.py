"""Block-sparse flash attention forward over variable-size tiles (the fine stage of video sparse attention): the
portable Triton kernel, its launcher :func:`block_sparse_attention_triton` and the torch reference
:func:`block_sparse_attention_reference`. The public entry point that picks a kernel is
:func:`diffusers_h3.kernels.attention.router.block_sparse_attention`.

Contract (shared by every kernel and :func:`block_sparse_attention_reference`):

* ``q [B, S, H, D]``: packed query rows. Query tile ``t`` owns rows ``slot_rows[t*block : t*block + tile_counts[t]]``.
* ``k, v [B, T*block, H, D]``: keys and values packed in tile order (:func:`~diffusers_h3.kernels.attention.vsa_pool.tile_pool`
  with ``packed=True``); slot ``i`` of key tile ``j`` is valid when ``i < tile_counts[j]``.
* ``kv_index [B, H, T, >=n] / kv_num [B, H, T]``: query tile ``t`` of head ``h`` attends to the valid rows of key tiles
  ``kv_index[b, h, t, :kv_num[b, h, t]]`` (:func:`~diffusers_h3.kernels.attention.vsa_select.mask_to_index`).
* ``out[b, row, h] = softmax(scale * q k^T) v`` over the selected rows, written for every packed row.

Numerics: scores and the softmax run in float32 (online softmax in base 2, with the running max); ``P`` is cast to
``v``'s dtype for the PV product, accumulation in float32. Precision variants (all with the same contract):

* **FP8 Q/K** (``q_scale``/``k_scale`` given): ``q``/``k`` are ``float8_e4m3fn``; ``q_scale [B, S, H]`` has one float32
  scale per query row and head (:func:`~diffusers_h3.kernels.numerics.quantize_fp8_per_token`), ``k_scale [B, T, H]``
  one per key tile and head (:func:`~diffusers_h3.kernels.numerics.quantize_fp8_per_block` with ``block`` rows;
  keys are usually mean-centred first, which softmax does not see). Scores are ``(q8 . k8) * q_scale * k_scale``, and
  a tile's K scale is one number folded into the per-row softmax scale. **INT8 Q/K** is the same with ``int8``
  ``q``/``k`` (``dtype=torch.int8`` in those quantizers: ``amax / 127``; exact int32 products): the same bytes and
  tensor-core rate, less rounding error than E4M3 (docs/attention.md).
* **FP8 PV** (``v_scale`` given): ``v`` is ``float8_e4m3fn`` with one scale per (batch, head, channel), and ``P`` is
  quantized as ``e4m3(448 * p)`` before the product; ``l`` (the softmax denominator) uses the unquantized ``p``.

``dense=True`` runs plain (non-sparse) attention through the same kernel: ``k``/``v`` are unpacked ``[B, S, H, D]``
rows, query programs own ``block_m`` consecutive rows and every key block is visited (the dense FP8 mode).

``p_fp4`` (``"two_level"`` / ``"single_level"``) emulates SageAttention3's FP4 P before the P·V product (the caller
fake-quantizes Q, K and V); it runs on this kernel only.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .._triton_utils import HAS_TRITON, triton_interpreter_active
from ..numerics import E2M1_MAX, E4M3_MAX, LOG2E, QK_8BIT_DTYPES, dequantize_fp8_per_block, round_to_e2m1
from ._launch import check_attention_args, index_args, scale_args
from .tuning import DEFAULT_TUNING, TuningOptions
from .vsa_pool import valid_slots


if HAS_TRITON:
    import triton
    import triton.language as tl

    from .._numerics_triton import E2M1_MAX as E2M1_MAX_TL
    from .._numerics_triton import E4M3_MAX as E4M3_MAX_TL
    from .._numerics_triton import round_to_e2m1 as round_e2m1_value
    from .._numerics_triton import round_to_e4m3 as round_e4m3_value

    @triton.jit
    def _kv_tile(j, DENSE: tl.constexpr, list_base, TILE_COUNTS, S, BLOCK_N: tl.constexpr):
        """Key tile ``j`` of this query tile's list and its valid row count."""
        if DENSE:
            kv = j
            cnt = tl.minimum(S - j * BLOCK_N, BLOCK_N)
        else:
            kv = tl.load(list_base + j)
            cnt = tl.load(TILE_COUNTS + kv)
        return kv, cnt

    @triton.jit
    def _raw_scores(q, kv, cnt, b, h, k_base, K_DESC, offs_n, offs_d, stride_ks, KV_ROWS, HEAD_DIM: tl.constexpr,
                    BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """``q . k`` of one key tile, before the per-row scale and the pad mask."""
        if USE_TMA:  # the tile is a contiguous 2D box: one TMA load (pad rows are zeros, masked later)
            k = K_DESC.load([(b * KV_ROWS + kv * BLOCK_N).to(tl.int32), h * HEAD_DIM]).T
        else:
            slots = kv.to(tl.int64) * BLOCK_N + offs_n
            k = tl.load(k_base + slots[None, :] * stride_ks + offs_d[:, None], mask=(offs_n < cnt)[None, :], other=0.0)
        # INT8 Q/K: exact int32 sums (|q . k| <= D * 127^2 < 2^24), then float32 (a no-op for float scores); one
        # return statement, as Triton type-checks every return even under a constexpr condition.
        return tl.dot(q, k, input_precision=DOT_PRECISION).to(tl.float32)

    @triton.jit
    def _row_scale(scale_rows, kv, ks_base, stride_kst, QK_8BIT: tl.constexpr):
        """Per-row score scale of key tile ``kv``: with 8-bit keys, times the tile's one K scale."""
        if QK_8BIT:
            return scale_rows * tl.load(ks_base + kv * stride_kst)
        return scale_rows

    @triton.jit
    def _online_softmax(qk, cnt, scale_rows, m_i, l_i, acc, offs_n, BLOCK_N: tl.constexpr):
        """One online-softmax step (base 2) on raw scores: returns ``p`` and the updated ``m``, ``l``, ``acc``.

        The per-row scale is folded into the exponent (one FMA per score) and only partial key tiles pay for the pad
        mask (``-inf`` on columns ``>= cnt``).
        """
        if cnt < BLOCK_N:
            qk = tl.where((offs_n < cnt)[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_rows)
        p = tl.math.exp2(qk * scale_rows[:, None] - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        return p, m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None]

    @triton.jit
    def _load_v(kv, valid, b, h, H, v_base, V_DESC, offs_n, offs_d, stride_vs, stride_vd, KV_ROWS,
                HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr, V_CHANNEL_MAJOR: tl.constexpr):
        if USE_TMA:
            if V_CHANNEL_MAJOR:
                v = V_DESC.load([((b * H + h) * HEAD_DIM).to(tl.int32), (kv * BLOCK_N).to(tl.int32)]).T
            else:
                v = V_DESC.load([(b * KV_ROWS + kv * BLOCK_N).to(tl.int32), h * HEAD_DIM])
        else:
            slots = kv.to(tl.int64) * BLOCK_N + offs_n
            v = tl.load(v_base + slots[:, None] * stride_vs + offs_d[None, :] * stride_vd, mask=valid[:, None],
                        other=0.0)
        return v

    @triton.jit
    def _fake_quant_p_fp4(p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TWO_LEVEL: tl.constexpr,
                          SOFT_ROUND: tl.constexpr):
        """SageAttention3-style FP4 P (emulated): 16-column groups, E4M3 group scales ``max / 6``, E2M1 values.

        ``TWO_LEVEL`` first stretches each row by ``448 * 6 / rowmax`` so that the group scales use the E4M3 range.
        """
        if TWO_LEVEL:
            s1 = tl.maximum(tl.max(p, 1), 1e-30) * (1.0 / (E4M3_MAX_TL * E2M1_MAX_TL))
            ps = tl.math.div_rn(p, s1[:, None])
        else:
            ps = p
        g = tl.reshape(ps, (BLOCK_M, BLOCK_N // 16, 16))
        gs = tl.minimum(tl.max(g, 2) * (1.0 / E2M1_MAX_TL), E4M3_MAX_TL)
        if SOFT_ROUND:
            gs = round_e4m3_value(gs)
        else:
            gs = gs.to(tl.float8e4nv).to(tl.float32)
        safe = tl.where(gs > 0, gs, 1.0)
        qg = tl.where(gs[:, :, None] > 0, round_e2m1_value(tl.math.div_rn(g, safe[:, :, None])), 0.0) * gs[:, :, None]
        q = tl.reshape(qg, (BLOCK_M, BLOCK_N))
        if TWO_LEVEL:
            q = q * s1[:, None]
        return q

    @triton.jit
    def _pv(acc, p, v, PV_FP8: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFT_ROUND: tl.constexpr):
        if PV_FP8:
            p8 = p * E4M3_MAX_TL
            if SOFT_ROUND:  # the interpreter's float8 cast truncates: round to nearest even first
                p8 = round_e4m3_value(p8)
            return tl.dot(p8.to(v.dtype), v, acc)
        return tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)

    @triton.jit
    def _query_tile(t, n_tiles, b, h, H, S, N_KV_BLOCKS, Q, Q_SCALE, SLOT_ROWS, TILE_COUNTS, KV_INDEX, KV_NUM,
                    qk_scale, stride_qb, stride_qs, stride_qh, stride_qsb, stride_qss, stride_ib, stride_ih, stride_it,
                    offs_m, offs_d, BLOCK_M: tl.constexpr, QK_8BIT: tl.constexpr, DENSE: tl.constexpr):
        """Rows, tile list, ``q`` and per-row score scale of query tile ``t`` (dense: rows ``t * BLOCK_M + i``,
        every key block)."""
        if DENSE:
            rows = t * BLOCK_M + offs_m
            row_valid = rows < S
            rows = tl.where(row_valid, rows, 0).to(tl.int64)
            num = N_KV_BLOCKS
            list_base = KV_INDEX
        else:
            row_valid = offs_m < tl.load(TILE_COUNTS + t)
            rows = tl.load(SLOT_ROWS + t * BLOCK_M + offs_m).to(tl.int64)
            list_base = KV_INDEX + b * stride_ib + h * stride_ih + t.to(tl.int64) * stride_it
            num = tl.load(KV_NUM + (b * H + h) * n_tiles + t)
        q = tl.load(Q + b * stride_qb + rows[:, None] * stride_qs + h * stride_qh + offs_d[None, :])
        scale_rows = tl.full([BLOCK_M], qk_scale, tl.float32)  # softmax scale * log2(e) (* FP8 q scale) per row
        if QK_8BIT:
            scale_rows = scale_rows * tl.load(Q_SCALE + b * stride_qsb + rows * stride_qss + h)
        return rows, row_valid, list_base, num, q, scale_rows

    @triton.jit
    def _store_rows(acc, l_i, rows, row_valid, b, h, H, O, V_SCALE, stride_ob, stride_os, stride_oh, offs_d,
                    HEAD_DIM: tl.constexpr, PV_FP8: tl.constexpr):
        if PV_FP8:
            v_sc = tl.load(V_SCALE + (b * H + h) * HEAD_DIM + offs_d)
            acc = acc * (v_sc[None, :] / E4M3_MAX_TL)
        out = acc / l_i[:, None]
        dst = O + b * stride_ob + rows[:, None] * stride_os + h * stride_oh + offs_d[None, :]
        tl.store(dst, out.to(O.dtype.element_ty), mask=row_valid[:, None])

    @triton.jit
    def _bsa_fwd_kernel(
        Q,
        K,
        V,
        K_DESC,
        V_DESC,
        O,
        Q_SCALE,
        K_SCALE,
        V_SCALE,
        SLOT_ROWS,
        TILE_COUNTS,
        KV_INDEX,
        KV_NUM,
        qk_scale,
        S,
        H,
        N_KV_BLOCKS,
        stride_qb,
        stride_qs,
        stride_qh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_vd,
        stride_ob,
        stride_os,
        stride_oh,
        stride_qsb,
        stride_qss,
        stride_ksb,
        stride_kss,
        stride_ksh,
        stride_ib,
        stride_ih,
        stride_it,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DENSE: tl.constexpr,
        QK_8BIT: tl.constexpr,
        PV_FP8: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        USE_TMA: tl.constexpr,
        V_CHANNEL_MAJOR: tl.constexpr,
        KV_ROWS,
        N_Q_TILES,
        ROTATE: tl.constexpr,
        P_FP4: tl.constexpr = False,
        P_FP4_TWO_LEVEL: tl.constexpr = True,
        SOFT_ROUND: tl.constexpr = False,
    ):
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = (pid_bh // H).to(tl.int64)
        h = pid_bh % H
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        k_base = K + b * stride_kb + h * stride_kh
        v_base = V + b * stride_vb + h * stride_vh
        ks_base = K_SCALE + b * stride_ksb + h * stride_ksh

        rows, row_valid, list_base, num, q, scale_rows = _query_tile(
            pid_m, N_Q_TILES, b, h, H, S, N_KV_BLOCKS, Q, Q_SCALE, SLOT_ROWS, TILE_COUNTS, KV_INDEX, KV_NUM, qk_scale,
            stride_qb, stride_qs, stride_qh, stride_qsb, stride_qss, stride_ib, stride_ih, stride_it, offs_m, offs_d,
            BLOCK_M, QK_8BIT, DENSE)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        if ROTATE:
            # Software pipelining: the QK product of the next key tile is issued before the softmax of the current
            # one, so that the tensor cores work while the softmax runs (the last iteration recomputes its own tile).
            kv, cnt = _kv_tile(0, DENSE, list_base, TILE_COUNTS, S, BLOCK_N)
            kv = tl.where(num > 0, kv, 0)
            cnt = tl.where(num > 0, cnt, 0)
            qk = _raw_scores(q, kv, cnt, b, h, k_base, K_DESC, offs_n, offs_d, stride_ks, KV_ROWS, HEAD_DIM,
                             BLOCK_N, USE_TMA, DOT_PRECISION)
            for j in range(0, num):
                kv_next, cnt_next = _kv_tile(tl.minimum(j + 1, num - 1), DENSE, list_base, TILE_COUNTS, S,
                                             BLOCK_N)
                qk_next = _raw_scores(q, kv_next, cnt_next, b, h, k_base, K_DESC, offs_n, offs_d, stride_ks,
                                      KV_ROWS, HEAD_DIM, BLOCK_N, USE_TMA, DOT_PRECISION)
                row_scale = _row_scale(scale_rows, kv, ks_base, stride_kss, QK_8BIT)
                p, m_i, l_i, acc = _online_softmax(qk, cnt, row_scale, m_i, l_i, acc, offs_n, BLOCK_N)
                v = _load_v(kv, offs_n < cnt, b, h, H, v_base, V_DESC, offs_n, offs_d, stride_vs, stride_vd,
                            KV_ROWS, HEAD_DIM, BLOCK_N, USE_TMA, V_CHANNEL_MAJOR)
                if P_FP4:
                    p = _fake_quant_p_fp4(p, BLOCK_M, BLOCK_N, P_FP4_TWO_LEVEL, SOFT_ROUND)
                acc = _pv(acc, p, v, PV_FP8, DOT_PRECISION, SOFT_ROUND)
                qk, kv, cnt = qk_next, kv_next, cnt_next
        else:
            for j in range(0, num):
                kv, cnt = _kv_tile(j, DENSE, list_base, TILE_COUNTS, S, BLOCK_N)
                qk = _raw_scores(q, kv, cnt, b, h, k_base, K_DESC, offs_n, offs_d, stride_ks, KV_ROWS, HEAD_DIM,
                                 BLOCK_N, USE_TMA, DOT_PRECISION)
                row_scale = _row_scale(scale_rows, kv, ks_base, stride_kss, QK_8BIT)
                p, m_i, l_i, acc = _online_softmax(qk, cnt, row_scale, m_i, l_i, acc, offs_n, BLOCK_N)
                v = _load_v(kv, offs_n < cnt, b, h, H, v_base, V_DESC, offs_n, offs_d, stride_vs, stride_vd,
                            KV_ROWS, HEAD_DIM, BLOCK_N, USE_TMA, V_CHANNEL_MAJOR)
                if P_FP4:
                    p = _fake_quant_p_fp4(p, BLOCK_M, BLOCK_N, P_FP4_TWO_LEVEL, SOFT_ROUND)
                acc = _pv(acc, p, v, PV_FP8, DOT_PRECISION, SOFT_ROUND)

        _store_rows(acc, l_i, rows, row_valid, b, h, H, O, V_SCALE, stride_ob, stride_os, stride_oh, offs_d,
                    HEAD_DIM, PV_FP8)

    _SPARSE_CONFIGS = [
        triton.Config({}, num_warps=w, num_stages=s) for w, s in ((4, 2), (4, 3), (4, 4), (8, 2))
    ]
    _DENSE_CONFIGS = [
        triton.Config({}, num_warps=w, num_stages=s) for w, s in ((8, 2), (8, 3), (4, 2))
    ]
    _AUTOTUNE_KEY = ["HEAD_DIM", "BLOCK_M", "BLOCK_N", "DENSE", "QK_8BIT", "PV_FP8", "USE_TMA", "ROTATE"]
    # Autotuned variants for GPUs (the interpreter runs the plain kernel with one explicit config).
    _bsa_fwd_sparse_tuned = triton.autotune(_SPARSE_CONFIGS, key=_AUTOTUNE_KEY)(_bsa_fwd_kernel)
    _bsa_fwd_dense_tuned = triton.autotune(_DENSE_CONFIGS, key=_AUTOTUNE_KEY)(_bsa_fwd_kernel)


def _tma_default(q: torch.Tensor) -> bool:
    """TMA descriptor loads on Hopper and newer GPUs."""
    return q.is_cuda and not triton_interpreter_active() and torch.cuda.get_device_capability(q.device)[0] >= 9


def _descriptors(k: torch.Tensor, v: torch.Tensor, block: int, tma: bool):
    """Host TMA descriptors for K and V when their layout allows it, else ``(None, None, False)``."""
    if not tma or not HAS_TRITON:
        return None, None, False
    from triton.tools.tensor_descriptor import TensorDescriptor

    b, n, h, d = k.shape
    if not k.is_contiguous():
        return None, None, False
    k_desc = TensorDescriptor(k.view(b * n, h * d), [b * n, h * d], [h * d, 1], [block, d])
    if v.is_contiguous():
        return k_desc, TensorDescriptor(v.view(b * n, h * d), [b * n, h * d], [h * d, 1], [block, d]), False
    sb, ss, sh, sd = v.stride()
    if ss == 1 and sh == d * sd and sb == h * sh and (sd * v.element_size()) % 16 == 0:
        flat = v.as_strided((b * h * d, n), (sd, 1))  # channel-major: rows are (batch, head, channel)
        return k_desc, TensorDescriptor(flat, [b * h * d, n], [sd, 1], [d, block]), True
    return None, None, False


def _dequantized_qk(q, k, q_scale, k_scale, block):
    """float32 ``q``, ``k`` with their FP8 scales applied (``k_scale`` is per key tile of ``block`` rows)."""
    if q_scale is None:
        return q.float(), k.float()
    return q.float() * q_scale.float().unsqueeze(-1), dequantize_fp8_per_block(k, k_scale, block)


def _reference_scores(q, k, q_scale, k_scale, scale, block):
    qf, kf = _dequantized_qk(q, k, q_scale, k_scale, block)
    return torch.einsum("bshd,bthd->bhst", qf, kf) * scale


def _reference_pv(p, v, v_scale):
    """``p [B,H,S,N]`` (unnormalised) times ``v [B,N,H,D]``, with the FP8 P rounding when ``v_scale`` is given."""
    if v_scale is None:
        return torch.einsum("bhsn,bnhd->bshd", p.to(v.dtype).float(), v.float())
    p8 = (p * E4M3_MAX).to(torch.float8_e4m3fn).float()
    out = torch.einsum("bhsn,bnhd->bshd", p8, v.float())
    return out * (v_scale.float().unsqueeze(1) / E4M3_MAX)  # v_scale [B, H, D] -> [B, 1, H, D]


def block_sparse_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_rows: Optional[torch.Tensor],
    tile_counts: Optional[torch.Tensor],
    kv_index: Optional[torch.Tensor],
    kv_num: Optional[torch.Tensor],
    *,
    block: int,
    scale: Optional[float] = None,
    q_scale: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    dense: bool = False,
    out_dtype: Optional[torch.dtype] = None,
    p_fp4: Optional[str] = None,
) -> torch.Tensor:
    """Pure-torch reference of :func:`block_sparse_attention` (materialises the token mask: small inputs only).

    When ``P`` is quantized (FP8 P·V or FP4 P) the result depends on the online softmax (``P`` is rounded against the
    running row max of each key tile), so the reference then walks the key tiles in list order like the kernel.
    """
    check_attention_args(q, k, v, slot_rows, tile_counts, kv_index, kv_num, block, q_scale, k_scale, v_scale, dense)
    b, s, h, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out_dtype = out_dtype or (torch.bfloat16 if q.dtype in QK_8BIT_DTYPES else q.dtype)
    if v_scale is not None or p_fp4 is not None:
        return _online_reference(q, k, v, slot_rows, tile_counts, kv_index, kv_num, block, scale, q_scale, k_scale,
                                 v_scale, dense, p_fp4).to(out_dtype)
    scores = _reference_scores(q, k, q_scale, k_scale, scale, block)  # [B, H, S, N]
    if dense:
        allowed = torch.ones(1, 1, s, k.shape[1], dtype=torch.bool, device=q.device)
    else:
        n_tiles = tile_counts.numel()
        tile_mask = torch.zeros(b, h, n_tiles, n_tiles + 1, dtype=torch.bool, device=q.device)
        width = torch.arange(kv_index.shape[-1], device=q.device)
        listed = width < kv_num.long().unsqueeze(-1)
        tile_mask.scatter_(-1, torch.where(listed, kv_index.long(), n_tiles), True)  # unlisted -> spare column
        tile_mask = tile_mask[..., :n_tiles]
        slot_valid = valid_slots(tile_counts, block)
        row_tile = torch.empty(s, dtype=torch.long, device=q.device)
        slot_tile = torch.arange(n_tiles, device=q.device).repeat_interleave(block)
        row_tile[slot_rows.long()[slot_valid]] = slot_tile[slot_valid]
        allowed = tile_mask[:, :, row_tile][..., slot_tile] & slot_valid  # [B, H, S, N]
    scores = scores.masked_fill(~allowed, float("-inf"))
    m = scores.amax(-1, keepdim=True)
    p = torch.exp(scores - m)
    l = p.sum(-1)  # [B, H, S]
    out = _reference_pv(p, v, v_scale) / l.permute(0, 2, 1).unsqueeze(-1)
    return out.to(out_dtype)


def fake_quant_p_fp4_reference(p: torch.Tensor, two_level: bool = True) -> torch.Tensor:
    """Torch mirror of the kernel's FP4 P emulation on ``p [rows, block]`` (non-negative, groups of 16 columns)."""
    if two_level:
        s1 = p.amax(1, keepdim=True).clamp_min(1e-30) * (1.0 / (E4M3_MAX * E2M1_MAX))
        ps = p / s1
    else:
        ps = p
    g = ps.view(p.shape[0], -1, 16)
    gs = (g.amax(2, keepdim=True) * (1.0 / E2M1_MAX)).clamp_max(E4M3_MAX).to(torch.float8_e4m3fn).float()
    q = torch.where(gs > 0, round_to_e2m1(g / torch.where(gs > 0, gs, 1.0)), 0.0) * gs
    q = q.view(p.shape)
    return q * s1 if two_level else q


def _online_reference(q, k, v, slot_rows, tile_counts, kv_index, kv_num, block, scale, q_scale, k_scale, v_scale,
                      dense, p_fp4):
    """Tile-by-tile online softmax in torch, in the kernel's order (small inputs only): float32 ``[B, S, H, D]``."""
    b, s, h, d = q.shape
    qf, kf = _dequantized_qk(q, k, q_scale, k_scale, block)
    vf = v.float()
    if dense:
        n_kv = -(-k.shape[1] // block)
        q_tiles = [torch.arange(i, min(i + block, s), device=q.device) for i in range(0, s, block)]
        kv_rows = [torch.arange(j * block, min((j + 1) * block, k.shape[1]), device=q.device) for j in range(n_kv)]
    else:
        counts = tile_counts.long().tolist()
        q_tiles = [slot_rows.long()[t * block:t * block + c] for t, c in enumerate(counts)]
        kv_rows = [torch.arange(t * block, t * block + c, device=q.device) for t, c in enumerate(counts)]
    out = torch.empty(b, s, h, d, device=q.device, dtype=torch.float32)
    for bi in range(b):
        for hi in range(h):
            for t, rows in enumerate(q_tiles):
                tiles = range(len(kv_rows)) if dense else kv_index[bi, hi, t, : int(kv_num[bi, hi, t])].tolist()
                m = torch.full((len(rows),), float("-inf"), device=q.device)
                l = torch.zeros(len(rows), device=q.device)
                acc = torch.zeros(len(rows), d, device=q.device)
                for j in tiles:
                    cols = kv_rows[j]
                    sc = torch.full((len(rows), block), float("-inf"), device=q.device)
                    sc[:, : len(cols)] = (qf[bi, rows, hi] @ kf[bi, cols, hi].T) * (scale * LOG2E)
                    m_new = torch.maximum(m, sc.amax(1))
                    p = torch.exp2(sc - m_new[:, None])
                    alpha = torch.exp2(m - m_new)
                    l = l * alpha + p.sum(1)
                    acc = acc * alpha[:, None]
                    vv = torch.zeros(block, d, device=q.device)
                    vv[: len(cols)] = vf[bi, cols, hi]
                    if v_scale is not None:
                        p = (p * E4M3_MAX).to(torch.float8_e4m3fn).float()
                    else:
                        if p_fp4 is not None:
                            p = fake_quant_p_fp4_reference(p, two_level=p_fp4 == "two_level")
                        p = p.to(v.dtype).float()
                    acc = acc + p @ vv
                    m = m_new
                if v_scale is not None:
                    acc = acc * (v_scale[bi, hi].float() / E4M3_MAX)
                out[bi, rows, hi] = acc / l[:, None]
    return out


def block_sparse_attention_triton(
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
    p_fp4: Optional[str] = None,
    tuning: TuningOptions = DEFAULT_TUNING,
) -> torch.Tensor:
    """Launch the Triton kernel on inputs that :func:`~.router.block_sparse_attention` validated; writes ``out``.

    ``tuning`` (:class:`~.tuning.TuningOptions`) carries the knobs this kernel reads: ``block_m``, ``num_warps``,
    ``num_stages``, ``tma`` and ``rotate``. On GPUs without explicit ``num_warps`` / ``num_stages`` the autotuned variant
    runs. ``rotate`` (software pipelining: the next key tile's QK product is issued before the current tile's softmax)
    defaults to on for sparse attention on GPUs and off for the dense mode; it does not change the result.
    """
    block_m, num_warps, num_stages, tma, rotate = (tuning.block_m, tuning.num_warps, tuning.num_stages, tuning.tma,
                                                   tuning.rotate)  # fmt: skip
    b, s, h, d = q.shape
    on_gpu = q.is_cuda and not triton_interpreter_active()
    if dense:
        block_m = block_m or (128 if on_gpu else block)
        grid = (triton.cdiv(s, block_m), b * h)
        n_kv_blocks = triton.cdiv(k.shape[1], block)
        dummy_i = torch.zeros(1, device=q.device, dtype=torch.int32)
        slot_rows = tile_counts = kv_index = kv_num = dummy_i
        index_strides = (0, 0, 0)
    else:
        block_m = block
        grid = (tile_counts.numel(), b * h)
        n_kv_blocks = 0
        kv_index, kv_num, index_strides = index_args(kv_index, kv_num)
    (qs, ks, vs), scale_strides = scale_args(q_scale, k_scale, v_scale, q.device)
    k_desc, v_desc, v_channel_major = _descriptors(k, v, block, tma if tma is not None else _tma_default(q))
    launch_config = {}
    if on_gpu and num_warps is None and num_stages is None:
        kernel = _bsa_fwd_dense_tuned if dense else _bsa_fwd_sparse_tuned
    else:
        kernel = _bsa_fwd_kernel
        launch_config = {"num_warps": num_warps or (8 if (dense and block_m >= 128) else 4),
                             "num_stages": num_stages or (3 if on_gpu else 1)}
    kernel[grid](
        q, k, v, k_desc if k_desc is not None else k, v_desc if v_desc is not None else v, out, qs, ks, vs,
        slot_rows, tile_counts, kv_index, kv_num,
        scale * LOG2E,
        s, h, n_kv_blocks,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), v.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
        *scale_strides, *index_strides,
        HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block, DENSE=dense, QK_8BIT=q_scale is not None,
        PV_FP8=v_scale is not None, DOT_PRECISION="ieee" if torch.float32 in (q.dtype, v.dtype) else "tf32",
        USE_TMA=k_desc is not None, V_CHANNEL_MAJOR=v_channel_major, KV_ROWS=k.shape[1],
        N_Q_TILES=0 if dense else tile_counts.numel(), ROTATE=(on_gpu and not dense) if rotate is None else rotate,
        P_FP4=p_fp4 is not None, P_FP4_TWO_LEVEL=p_fp4 == "two_level", SOFT_ROUND=triton_interpreter_active(),
        **launch_config,
    )
    return out
