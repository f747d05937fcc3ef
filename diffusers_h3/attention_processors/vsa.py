"""Video sparse attention (VSA) for ``MiniMaxH3Attention``, with bf16, FP8 and emulated FP4 numerics.

Semantics follow FastH3 (FastVideo's H3 VSA backend):

* rows are grouped into tiles read from the published :class:`~diffusers_h3.PackedLayout`: target-video rows into
  ``tile`` cubes (default 4×4×4 latent tokens, (t, h, w) order, partial edge cubes), every other row (text, keyframe /
  reference video, audio) into segment-pure chunks of ``prod(tile)`` rows (see :mod:`.tiling`);
* coarse stage: Q and K are mean-pooled per tile in float32, tile scores are ``q̄ k̄ᵀ / sqrt(d)``, and every video query
  tile keeps the top ``ceil((1 - sparsity) * n_video_tiles)`` video key tiles plus every non-video key tile; non-video
  query rows stay dense;
* fine stage: block-sparse flash attention over the selected tiles (on Hopper the Gluon kernel of
  :mod:`diffusers_h3.kernels.attention.bsa_sm90`, elsewhere the Triton kernel; ``kernel=`` picks);
* when the attention module has a ``to_gate_compress`` linear (VSA-distilled FastH3 checkpoints; see
  :func:`add_gate_compress`), the coarse output ``softmax(scores) v̄`` of each row's tile is added through it:
  ``out = out_fine + to_gate_compress(x) * out_coarse``. Base checkpoints have no gate and run pure sparse.

Dense calls (``sparsity=0``, ``dense_layers``, the first ``dense_first_steps`` steps, refiner calls with
``rotary_emb=None``) run plain dense attention without the coarse branch: bf16 through diffusers' own
``MiniMaxH3AttnProcessor`` code path (so ``sparsity=0`` reproduces the default processor exactly), FP8 through our
dense FP8 kernel, FP4 through emulation.

Measured on one H200 at the H3 shape (38,222 rows, 56 heads; ``benchmarks/results/attention_h200.json``): cuDNN dense
73.5 ms; VSA bf16 28.3 ms at sparsity 0.8 and 17.7 ms at 0.9; VSA FP8 23.2 / 15.1 ms; dense FP8 59.8 ms (1.23x cuDNN
bf16). The 64-row fine stage is bound by L2 bandwidth (docs/attention.md). FP8 Q/K costs ~3.8e-2 relative L2 on
Gaussian inputs (bf16: 2.3e-3).
"""

from __future__ import annotations

import math
import re
from typing import Any, Dict, Iterable, Mapping, Optional, Sequence, Tuple, Union

import torch
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor

from .._utils import cuda_capability, has_fp4_tensor_cores, has_fp8_tensor_cores, warn_once
from ..kernels._triton_utils import HAS_TRITON, opaque_to_compile, triton_interpreter_active
from ..kernels.attention.bsa_triton import block_sparse_attention
from ..kernels.attention.bsa_sm90 import sm90_kernel_available
from ..kernels.attention.v_fp8 import quantize_v_fp8_channel_major
from ..kernels.attention.dense_quantized import fp8_attention
from ..kernels.numerics import (
    dequantize_fp8_per_block,
    fake_quant_fp4,
    fake_quant_fp8_per_token,
    quantize_fp8_per_block,
    quantize_fp8_per_channel,
)
from ..kernels.attention.vsa_pool import tile_pool, tile_quantize_fp8
from ..kernels.attention.vsa_select import select_tiles, topk_for_sparsity
from ._projections import project_output, project_qkv
from .layout import require_packed_layout
from .tiling import TilePlan, TilePlanCache

PRECISIONS = ("bf16", "fp8", "int8", "fp4")
PV_PRECISIONS = ("bf16", "fp8")
# The 8-bit Q/K precisions and their operand dtype (same kernels; INT8 has ~4x less rounding error than E4M3).
QK_8BIT = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}


def _kernel_available(device: torch.device) -> bool:
    return HAS_TRITON and (device.type == "cuda" or triton_interpreter_active())


def _fp8_native(device: torch.device) -> bool:
    """FP8 ``tl.dot`` runs on SM89+ GPUs (and in the interpreter, which emulates it)."""
    if device.type == "cuda":
        return HAS_TRITON and has_fp8_tensor_cores(device)
    return triton_interpreter_active()


def _qk_native(precision: str, device: torch.device) -> bool:
    """Whether the 8-bit Q/K ``precision`` has tensor cores on ``device``: FP8 on SM89+, INT8 ``tl.dot`` on SM80+."""
    if precision != "int8":
        return _fp8_native(device)
    if device.type != "cuda":
        return triton_interpreter_active()
    cap = cuda_capability(device)
    return HAS_TRITON and cap is not None and tuple(cap) >= (8, 0)


@opaque_to_compile
def vsa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: TilePlan,
    *,
    sparsity: float = 0.8,
    precision: str = "bf16",
    smooth_k: bool = True,
    pv_precision: str = "bf16",
    compress: bool = False,
    emulate: bool = False,
    backend: str = "auto",
    kernel_options: Optional[Dict[str, Any]] = None,
    fp4_p: Optional[str] = "two_level",
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The VSA core on ``[B, S, H, D]`` rows (after QK-norm and rotary): returns ``(out_fine, out_coarse)``.

    ``out_fine`` is ``[B, S, H, D]``; ``out_coarse`` is the per-tile coarse attention ``[B, H, T, D]`` when
    ``compress`` (else ``None``). ``emulate`` replaces FP8 tensor-core products by quantize-dequantize + bf16
    kernels (for GPUs without FP8 MMA). ``precision="fp4"`` is always emulated. ``kernel_options`` (``kernel``,
    ``tma``, ``rotate``, ``num_warps``, ``num_stages``) are passed to the fine kernel (benchmarks / tuning). ``fp4_p``
    (``"two_level"``, ``"single_level"`` or ``None`` = bf16 P) selects the FP4 emulation of P.
    """
    if query.shape[1] != plan.seq_len:
        raise ValueError(f"the tile plan covers {plan.seq_len} rows but the query has {query.shape[1]}")
    block = plan.block
    scale = 1.0 / math.sqrt(query.shape[-1])
    rows = (plan.slot_rows, plan.tile_counts, block)
    qk_dtype = QK_8BIT.get(precision)
    native_8bit = qk_dtype is not None and not emulate
    if native_8bit:  # Q is pooled and quantized in one pass; K is pooled first (its mean is needed to smooth it)
        pooled_q, q8, q_scale = tile_quantize_fp8(query, *rows, pooled=True, dtype=qk_dtype, backend=backend)
        pooled_k, _ = tile_pool(key, *rows, backend=backend)
    else:
        pooled_q, _ = tile_pool(query, *rows, backend=backend)
        pooled_k, k_packed = tile_pool(key, *rows, packed=True, backend=backend)
    pooled_v, v_packed = tile_pool(value, *rows, pooled=compress, packed=True, backend=backend)
    scores = torch.matmul(pooled_q, pooled_k.transpose(-1, -2)) * scale  # [B, H, T, T] float32
    topk = topk_for_sparsity(sparsity, plan.num_video_tiles)
    kv_index, kv_num = select_tiles(scores, plan.num_prefix_tiles, topk, backend=backend)
    out_coarse = torch.matmul(torch.softmax(scores, dim=-1), pooled_v) if compress else None

    common = dict(block=block, scale=scale, out_dtype=query.dtype, backend=backend, **(kernel_options or {}))
    sparse_args = (plan.slot_rows, plan.tile_counts, kv_index, kv_num)
    if precision == "bf16":
        return block_sparse_attention(query, k_packed, v_packed, *sparse_args, **common), out_coarse
    if precision not in ("fp8", "int8", "fp4"):
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")

    k_mean = None
    if smooth_k:
        # Per-head key mean over the valid rows, from the tile means (softmax is invariant to this shift).
        counts = plan.tile_counts.to(torch.float32)
        k_mean = (pooled_k * counts[:, None]).sum(2) / counts.sum()  # [B, H, D]
    if native_8bit:
        _, k8, k_scale = tile_quantize_fp8(key, *rows, packed=True, subtract=k_mean, per_tile=True, dtype=qk_dtype,
                                           backend=backend)
        v_arg, v_scale = v_packed, None
        if pv_precision == "fp8":  # channel-major E4M3 for the FP8 P.V MMA
            v_arg, v_scale = quantize_v_fp8_channel_major(v_packed, backend=backend)
        out = block_sparse_attention(q8, k8, v_arg, *sparse_args, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
                                     **common)
        return out, out_coarse

    if k_mean is not None:  # pad slots stay zero (they must not count in the FP8 per-tile K scales)
        valid = plan.valid_slots.reshape(1, -1, 1, 1)
        k_packed = torch.where(valid, k_packed.float() - k_mean.unsqueeze(1), 0.0).to(key.dtype)
    if precision == "fp4":
        q_e = fake_quant_fp4(query, dim=-1)
        k_e = fake_quant_fp4(k_packed, dim=-1)
        v_e = fake_quant_fp4(v_packed, dim=1)  # 16 consecutive (tile-ordered) tokens per channel
        return block_sparse_attention(q_e, k_e, v_e, *sparse_args, p_fp4=fp4_p, **common), out_coarse
    # 8-bit emulation (no FP8 / INT8 tensor cores): quantize-dequantize as the native path does, then the bf16 kernel.
    k8, k_scale = quantize_fp8_per_block(k_packed, block, dtype=qk_dtype)
    q_e = fake_quant_fp8_per_token(query, dtype=qk_dtype)
    k_e = dequantize_fp8_per_block(k8, k_scale, block).to(key.dtype)
    v_e = v_packed
    if pv_precision == "fp8":
        v8, vs = quantize_fp8_per_channel(v_packed, seq_dim=1)
        v_e = (v8.float() * vs.unsqueeze(1)).to(value.dtype)
    return block_sparse_attention(q_e, k_e, v_e, *sparse_args, **common), out_coarse


class MiniMaxH3VSAProcessor:
    r"""
    Video sparse attention processor for ``MiniMaxH3Attention`` (install one per transformer block with
    :func:`enable_vsa`, or on its own with ``transformer.set_attn_processor``).

    Args:
        sparsity (`float`, defaults to `0.8`): fraction of *video* key tiles dropped per video query tile
            (``0`` = dense attention).
        tile (`tuple[int, int, int]`, defaults to `(4, 4, 4)`): video cube in latent tokens (t, h, w); its volume
            (a power of two ≥ 16) is also the chunk length of non-video rows.
        precision (`str`, defaults to `"bf16"`): ``"bf16"`` (the activations' dtype), ``"fp8"`` (E4M3 Q with
            per-token scales, K with one scale per key tile; FP8 tensor cores, SM89+), ``"int8"`` (the same with
            symmetric INT8 Q/K, SageAttention's choice: same speed on Ampere/Hopper tensor cores, ~4x less error than
            E4M3) or ``"fp4"`` (NVFP4-style E2M1 with 16-element E4M3 scales; emulated everywhere, native FP4
            attention is not implemented and not run on hardware).
        layer_index (`int`, *optional*): index of the transformer block (for ``dense_layers``).
        dense_layers (`Sequence[int]`): block indices that stay dense.
        dense_first_steps (`int`): the first denoising steps (``PackedLayout.step_index``) that stay dense.
        smooth_k (`bool`, defaults to `True`): subtract the per-head key mean before FP8/FP4 quantization (exact
            under softmax; only reduces quantization error).
        pv_precision (`str`, defaults to `"bf16"`): ``"fp8"`` also runs P·V in E4M3 (per-channel V scales), faster but
            less accurate (FastVideo found FP8 PV too lossy on real H3 inputs; measure before using it).
        fp4_p (`str`, defaults to `"two_level"`): with ``precision="fp4"``, how P is emulated before P·V:
            ``"two_level"`` (rows stretched by ``448·6 / rowmax``, then 16-column E4M3-scaled E2M1, as SageAttention3),
            ``"single_level"`` or ``None`` (P stays bf16).
        strict (`bool`, defaults to `False`): when the GPU cannot run ``precision`` natively, raise instead of running
            the emulated path with a one-time warning.
        backend (`str`, defaults to `"auto"`): ``"triton"`` / ``"torch"`` (reference kernels) / ``"auto"``.
        kernel (`str`, defaults to `"auto"`): the flash kernel of the fine stage and of FP8 dense layers: ``"sm90"``
            (Hopper Gluon kernel: TMA ring, asynchronous wgmma, warp-specialized dense mode), ``"triton"`` (portable
            Triton kernel) or ``"auto"`` (the Hopper kernel on compute capability 9.x GPUs, else Triton).
    """

    _attention_backend = None
    _parallel_config = None

    def __init__(
        self,
        sparsity: float = 0.8,
        tile: Tuple[int, int, int] = (4, 4, 4),
        precision: str = "bf16",
        *,
        layer_index: Optional[int] = None,
        dense_layers: Sequence[int] = (),
        dense_first_steps: int = 0,
        smooth_k: bool = True,
        pv_precision: str = "bf16",
        fp4_p: Optional[str] = "two_level",
        strict: bool = False,
        backend: str = "auto",
        kernel: str = "auto",
    ):
        if kernel not in ("auto", "sm90", "triton"):
            raise ValueError(f"kernel must be 'auto', 'sm90' or 'triton', got {kernel!r}")
        if fp4_p not in (None, "two_level", "single_level"):
            raise ValueError(f"fp4_p must be 'two_level', 'single_level' or None (bf16 P), got {fp4_p!r}")
        if not isinstance(sparsity, (int, float)) or not 0.0 <= float(sparsity) < 1.0:
            raise ValueError(f"sparsity must be a float in [0, 1), got {sparsity!r} (0 = dense attention)")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        if pv_precision not in PV_PRECISIONS:
            raise ValueError(f"pv_precision must be one of {PV_PRECISIONS}, got {pv_precision!r}")
        if pv_precision == "fp8" and precision not in QK_8BIT:
            raise ValueError("pv_precision='fp8' needs precision='fp8' or 'int8'")
        if backend not in ("auto", "triton", "torch"):
            raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
        tile = tuple(int(t) for t in tile)
        volume = math.prod(tile)
        if len(tile) != 3 or volume < 16 or volume & (volume - 1):
            raise ValueError(f"tile must be (t, h, w) with a power-of-two volume >= 16, e.g. (4, 4, 4); got {tile}")
        if pv_precision == "fp8" and volume < 32:
            raise ValueError(f"pv_precision='fp8' needs tiles of at least 32 tokens (FP8 MMA K dimension), got {tile}")
        if int(dense_first_steps) < 0:
            raise ValueError(f"dense_first_steps must be >= 0, got {dense_first_steps}")
        self.sparsity = float(sparsity)
        self.tile = tile
        self.precision = precision
        self.layer_index = layer_index
        self.dense_layers = frozenset(int(i) for i in dense_layers)
        # A plain attribute (not derived from layer_index at call time), so that torch.compile traces one version of
        # __call__ for every sparse block instead of specializing on each block's index.
        self.layer_dense = self.sparsity == 0.0 or (layer_index is not None and layer_index in self.dense_layers)
        self.dense_first_steps = int(dense_first_steps)
        self.smooth_k = bool(smooth_k)
        self.pv_precision = pv_precision
        self.fp4_p = fp4_p
        self.strict = bool(strict)
        self.backend = backend
        self.kernel = kernel
        self._plans = TilePlanCache()
        self._dense = MiniMaxH3AttnProcessor()
        self._emulated: Optional[bool] = None
        if precision == "fp4" and strict:
            raise NotImplementedError(
                "precision='fp4' with strict=True: native FP4 attention is not implemented (FP4 numerics are "
                "emulated with quantize-dequantize and bf16 kernels); pass strict=False to run the emulation"
            )

    # -- which path -------------------------------------------------------------------------------------------------
    @opaque_to_compile
    def _route(self, seq_len: int, device: torch.device) -> Tuple[str, Optional[TilePlan]]:
        """``("dense", None)`` or ``("sparse", plan)`` for this call (reads the published layout and the plan cache;
        opaque to torch.compile, which would otherwise specialize on every layout / denoising step)."""
        if self.layer_dense:
            return "dense", None
        layout = require_packed_layout("MiniMaxH3VSAProcessor", seq_len)
        if layout.step_index is not None and layout.step_index < self.dense_first_steps:
            return "dense", None
        plan = self._plans.get(layout, self.tile, device)
        if plan.num_video_tiles == 0:
            return "dense", None
        return "sparse", plan

    def _emulate(self, device: torch.device) -> bool:
        """Whether FP8 / INT8 runs as quantize-dequantize emulation on ``device`` (warns once, or raises when strict)."""
        if self.precision not in QK_8BIT or _qk_native(self.precision, device):
            self._emulated = self.precision == "fp4"
            return self._emulated
        self._emulated = True
        cap = cuda_capability(device)
        where = f"sm_{cap[0]}{cap[1]}" if cap else device.type
        name, needs = ("FP8", "SM89+") if self.precision == "fp8" else ("INT8", "SM80+")
        if self.strict:
            raise RuntimeError(
                f"precision={self.precision!r} needs {name} tensor cores ({needs}) and Triton; {where} has none. Pass "
                f"strict=False to run the {name} numerics as emulation (quantize-dequantize + bf16 kernels), or use "
                "precision='bf16'"
            )
        warn_once(f"vsa-{self.precision}-emulated-{where}", f"MiniMaxH3VSAProcessor: no {name} tensor cores on "
                  f"{where}; {name} attention runs as emulation (quantize-dequantize + bf16 kernels)")
        return True

    def describe_path(self) -> str:
        layer = ""  # no layer index: describe() aggregates identical lines over the 50 blocks
        if self.backend == "torch" or not (HAS_TRITON and (torch.cuda.is_available() or triton_interpreter_active())):
            kernel = "torch reference kernels (no CUDA / triton)" if self.backend != "torch" else "torch reference kernels"
        else:
            kernel = self._kernel_label()
        if self.precision in QK_8BIT:
            name = "FP8 E4M3" if self.precision == "fp8" else "INT8"
            prec = (f"{name} Q per token, K per tile{' (mean-centred)' if self.smooth_k else ''}, "
                    f"{self.pv_precision} PV")
            if self._emulated is not None:  # what the last call ran
                native = not self._emulated
            elif torch.cuda.is_available():
                native = _qk_native(self.precision, torch.device("cuda"))
            else:
                native = triton_interpreter_active()
            if not native:
                prec += f" [emulated here: no {name.split()[0]} tensor cores]"
        elif self.precision == "fp4":
            p_part = f"{self.fp4_p.replace('_', '-')} FP4 P" if self.fp4_p else "bf16 P"
            prec = (f"FP4 E2M1/E4M3-16 Q/K/V + {p_part} emulated (quantize-dequantize + bf16 kernels; native FP4 "
                    "attention not implemented, not run on hardware)")
            if torch.cuda.is_available() and has_fp4_tensor_cores(torch.device("cuda")):
                prec += " [this GPU has FP4 tensor cores, unused]"
        else:
            prec = "bf16"
        if self.layer_dense:
            why = "sparsity=0" if self.sparsity == 0.0 else "dense layer"
            dense = "diffusers SDPA dispatch" if self.precision == "bf16" else prec
            return f"{layer}dense attention ({dense}; {why})"
        extra = f", dense for the first {self.dense_first_steps} steps" if self.dense_first_steps else ""
        return (f"{layer}VSA sparsity={self.sparsity} tile={self.tile} {prec} via {kernel}"
                f"{extra}; coarse gate when to_gate_compress exists")

    def _kernel_label(self) -> str:
        """Which flash kernel the GPU paths run (pooling, selection and quantization are Triton either way)."""
        hopper = torch.cuda.is_available() and sm90_kernel_available(torch.device("cuda"))
        fp4 = self.precision == "fp4" and self.fp4_p is not None
        if self.kernel == "triton" or not hopper or fp4 or self.backend == "torch":
            return "Triton kernels"
        two = "; bf16: two query tiles per program, TMA producer warp" if self.precision == "bf16" else ""
        return f"Triton pooling/selection + Hopper Gluon flash kernel (TMA ring, async wgmma{two})"

    # -- attention ----------------------------------------------------------------------------------------------------
    def _dense_attention(self, attn, hidden_states, query, key, value, rotary_emb, attention_mask):
        if self.precision == "bf16":
            return self._dense(attn, hidden_states, rotary_emb, attention_mask)
        if attention_mask is not None:
            raise ValueError("MiniMaxH3VSAProcessor: FP8/FP4 dense attention takes no attention_mask (H3 passes none)")
        if query is None:
            query, key, value = project_qkv(attn, hidden_states, rotary_emb)
            value = value.contiguous()
        if self.precision in QK_8BIT and not self._emulate(query.device) and _kernel_available(query.device):
            out = fp8_attention(query, key, value, smooth_k=self.smooth_k, pv_fp8=self.pv_precision == "fp8",
                                qk_dtype=QK_8BIT[self.precision], backend=self.backend, kernel=self.kernel)
        else:
            if self.precision == "fp4":
                if self.smooth_k:
                    key = key - key.float().mean(1, keepdim=True).to(key.dtype)
                query, key, value = fake_quant_fp4(query), fake_quant_fp4(key), _fake_quant_fp4_seq(value)
                if self.fp4_p is not None and _kernel_available(query.device) and self.backend != "torch":
                    out = block_sparse_attention(query, key, value, None, None, None, None, block=64, dense=True,
                                                 p_fp4=self.fp4_p, backend="triton")
                    return project_output(attn, out, hidden_states.dtype)
            else:
                qk_dtype = QK_8BIT[self.precision]
                query = fake_quant_fp8_per_token(query, dtype=qk_dtype)
                key = fake_quant_fp8_per_token(key, dtype=qk_dtype)
            out = torch.nn.functional.scaled_dot_product_attention(
                query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
            ).transpose(1, 2)
        return project_output(attn, out, query.dtype if query.dtype != torch.float8_e4m3fn else hidden_states.dtype)

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        rotary_emb: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
        attention_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if rotary_emb is None:  # token refiner: text only, always dense
            return self._dense(attn, hidden_states, rotary_emb, attention_mask)
        if self._parallel_config is not None and getattr(self._parallel_config, "context_parallel_config", None):
            raise NotImplementedError(
                "MiniMaxH3VSAProcessor does not support context/sequence parallelism yet (it needs the whole packed "
                "sequence to tile it); disable VSA (diffusers_h3.disable_vsa) or the parallel config"
            )
        mode, plan = self._route(hidden_states.shape[1], hidden_states.device)
        if mode == "dense":
            return self._dense_attention(attn, hidden_states, None, None, None, rotary_emb, attention_mask)
        if attention_mask is not None:
            raise ValueError(
                "MiniMaxH3VSAProcessor got an attention_mask; VSA attends over one packed document and takes none"
            )
        query, key, value = project_qkv(attn, hidden_states, rotary_emb)
        value = value.contiguous()
        gate = getattr(attn, "to_gate_compress", None)
        emulate = self._emulate(query.device)
        backend = self.backend
        if backend == "auto" and not _kernel_available(query.device):
            warn_once("vsa-torch-kernels", "MiniMaxH3VSAProcessor: no CUDA device (or triton): the VSA kernels run "
                      "their pure-torch references (exact, slow)")
            backend = "torch"
        out, out_coarse = vsa_attention(
            query, key, value, plan, sparsity=self.sparsity, precision=self.precision, smooth_k=self.smooth_k,
            pv_precision=self.pv_precision, compress=gate is not None, emulate=emulate, backend=backend,
            fp4_p=self.fp4_p, kernel_options={"kernel": self.kernel},
        )
        if gate is not None:
            g = gate(hidden_states).unflatten(-1, (attn.heads, -1))  # [B, S, H, D]
            coarse_rows = out_coarse.index_select(2, plan.row_tile).permute(0, 2, 1, 3)  # [B, S, H, D]
            out = torch.addcmul(out.float(), g.float(), coarse_rows).to(out.dtype)
        return project_output(attn, out, hidden_states.dtype)




def _fake_quant_fp4_seq(value: torch.Tensor) -> torch.Tensor:
    """FP4 emulation of V along the sequence (groups of 16 tokens per channel), padding the tail group with zeros."""
    s = value.shape[1]
    pad = (-s) % 16
    if pad:
        value = torch.cat([value, value.new_zeros(value.shape[0], pad, *value.shape[2:])], dim=1)
    return fake_quant_fp4(value, dim=1)[:, :s]


# -- installation helpers --------------------------------------------------------------------------------------------


def _blocks(transformer) -> Sequence[torch.nn.Module]:
    blocks = getattr(transformer, "transformer_blocks", None)
    if blocks is None:
        raise TypeError(
            f"enable_vsa expects a MiniMaxH3Transformer3DModel (with .transformer_blocks), got {type(transformer)}"
        )
    return blocks


def enable_vsa(
    transformer,
    *,
    sparsity: float = 0.8,
    tile: Tuple[int, int, int] = (4, 4, 4),
    precision: str = "bf16",
    dense_layers: Iterable[int] = (),
    dense_first_steps: int = 0,
    smooth_k: bool = True,
    pv_precision: str = "bf16",
    fp4_p: Optional[str] = "two_level",
    strict: bool = False,
    backend: str = "auto",
    kernel: str = "auto",
) -> Dict[str, Any]:
    """Install one :class:`MiniMaxH3VSAProcessor` per transformer block (the token refiner keeps its processor).

    Returns a summary: number of blocks, which are dense, the precision and one ``describe_path`` line.
    """
    blocks = _blocks(transformer)
    dense_layers = tuple(int(i) for i in dense_layers)
    bad = [i for i in dense_layers if not 0 <= i < len(blocks)]
    if bad:
        raise ValueError(f"dense_layers {bad} are out of range for a transformer with {len(blocks)} blocks")
    config = getattr(transformer, "_parallel_config", None)
    if config is not None and getattr(config, "context_parallel_config", None) is not None:
        raise NotImplementedError(
            "enable_vsa: this transformer runs context parallelism, which VSA does not support yet; run VSA on one "
            "GPU (or without enable_parallelism)"
        )
    processors = []
    for i, block in enumerate(blocks):
        processor = MiniMaxH3VSAProcessor(
            sparsity=sparsity, tile=tile, precision=precision, layer_index=i, dense_layers=dense_layers,
            dense_first_steps=dense_first_steps, smooth_k=smooth_k, pv_precision=pv_precision, fp4_p=fp4_p,
            strict=strict, backend=backend, kernel=kernel,
        )
        if strict:
            device = next(block.parameters()).device
            processor._emulate(device)  # raise now rather than mid-denoising
        block.attn.set_processor(processor)
        processors.append(processor)
    gated = sum(getattr(b.attn, "to_gate_compress", None) is not None for b in blocks)
    return {
        "blocks": len(blocks),
        "sparse_blocks": sum(not p.layer_dense for p in processors),
        "dense_layers": sorted(set(dense_layers)),
        "dense_first_steps": int(dense_first_steps),
        "gated_blocks": gated,
        "precision": precision,
        "path": processors[0].describe_path() if processors else "no blocks",
    }


def disable_vsa(transformer) -> None:
    """Put diffusers' default ``MiniMaxH3AttnProcessor`` back on every transformer block."""
    for block in _blocks(transformer):
        block.attn.set_processor(MiniMaxH3AttnProcessor())


_GATE_KEY = re.compile(r"(?:^|\.)(?:transformer_blocks|blocks)\.(\d+)\.(?:attn|self_attn|attn1)\.to_gate_compress\.(weight|bias)$")


def _gate_entries(state_dict_or_keys: Union[Mapping[str, Any], Iterable[str]]) -> Dict[int, Dict[str, Any]]:
    items = state_dict_or_keys.items() if isinstance(state_dict_or_keys, Mapping) else ((k, None) for k in state_dict_or_keys)
    found: Dict[int, Dict[str, Any]] = {}
    for key, tensor in items:
        match = _GATE_KEY.search(key)
        if match:
            found.setdefault(int(match.group(1)), {})[match.group(2)] = tensor
    return found


def add_gate_compress(
    transformer, state_dict_or_keys: Union[Mapping[str, Any], Iterable[str], None] = None, *, load: bool = True
) -> Tuple[int, ...]:
    """Add the ``to_gate_compress`` linears of VSA-distilled (FastH3) checkpoints to ``transformer``'s blocks.

    With a state dict (or its keys), a zero-initialised ``nn.Linear(hidden_size, heads * head_dim)`` is added to every
    block whose ``transformer_blocks.{i}.attn.to_gate_compress.weight`` key is present (with a bias when the checkpoint
    has one), and, when ``load`` and tensors are given, the checkpoint's weights are copied in. With ``None`` every
    block gets a zero gate (pure sparse until trained). Returns the indices of the blocks that got a gate; call it
    before ``load_state_dict`` so that strict loading finds the keys.
    """
    blocks = _blocks(transformer)
    if state_dict_or_keys is None:
        entries = {i: {"weight": None} for i in range(len(blocks))}
    else:
        entries = _gate_entries(state_dict_or_keys)
    added = []
    for i, tensors in sorted(entries.items()):
        if not 0 <= i < len(blocks):
            raise ValueError(f"checkpoint has to_gate_compress for block {i} but the transformer has {len(blocks)}")
        attn = blocks[i].attn
        ref = attn.to_q.weight
        gate = torch.nn.Linear(ref.shape[1], attn.heads * attn.head_dim, bias="bias" in tensors,
                               device=ref.device, dtype=ref.dtype)
        torch.nn.init.zeros_(gate.weight)
        if gate.bias is not None:
            torch.nn.init.zeros_(gate.bias)
        if load:
            with torch.no_grad():
                for name, tensor in tensors.items():
                    if isinstance(tensor, torch.Tensor):
                        param = getattr(gate, name)
                        if tensor.shape != param.shape:
                            raise ValueError(f"to_gate_compress.{name} of block {i} has shape {tuple(tensor.shape)}, "
                                             f"expected {tuple(param.shape)}")
                        param.copy_(tensor)
        attn.to_gate_compress = gate
        added.append(i)
    return tuple(added)
