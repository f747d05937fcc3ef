"""Video sparse attention (VSA) for ``MiniMaxH3Attention``, with bf16, FP8, INT8 and emulated FP4 numerics.

Semantics follow FastH3 (FastVideo's H3 VSA backend):

* rows are grouped into tiles read from the published :class:`~diffusers_h3.PackedLayout`: target-video rows into
  ``tile`` cubes (default 4×4×4 latent tokens, (t, h, w) order, partial edge cubes), every other row (text, keyframe /
  reference video, audio) into segment-pure chunks of ``prod(tile)`` rows (see :mod:`.tiling`);
* coarse stage: Q and K are mean-pooled per tile in float32, tile scores are ``q̄ k̄ᵀ / sqrt(d)``, and every video query
  tile keeps the top ``ceil((1 - sparsity) * n_video_tiles)`` video key tiles plus every non-video key tile; non-video
  query rows stay dense;
* fine stage: block-sparse flash attention over the selected tiles, on the Hopper Gluon or the Triton kernel as
  planned for the call (:class:`VSAPlan`: route, tile plan, top-k and the fine stage's
  :class:`~diffusers_h3.kernels.attention.KernelChoice`, made once per transformer call by the call-plan hook;
  ``describe_path`` reports it);
* when the attention module has a ``to_gate_compress`` linear (VSA-distilled FastH3 checkpoints; see
  :func:`add_gate_compress`), the coarse output ``softmax(scores) v̄`` of each row's tile is added through it:
  ``out = out_fine + to_gate_compress(x) * out_coarse``. Base checkpoints have no gate and run pure sparse.

Dense calls (``sparsity=0``, ``dense_layers``, the first ``dense_first_steps`` steps) run plain dense attention without
the coarse branch: bf16 through diffusers' ``dispatch_attention_fn`` (so ``sparsity=0`` reproduces the default
processor exactly), FP8 / INT8 / FP4 through :class:`~.low_precision.MiniMaxH3LowPrecisionAttnProcessor`'s core.
Refiner calls (``rotary_emb=None``) and context parallelism are handled by :class:`~.base.MiniMaxH3AttnProcessorBase`;
under Ulysses the core sees the whole sequence (the global :class:`~diffusers_h3.PackedLayout`) with a slice of the
heads. Timings and accuracy are in docs/attention.md.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn

from .._hooks import H3_VSA_HEAD_GROUPS_HOOK, H3Hook, h3_record, register_h3_hook, remove_h3_hook
from .._utils import warn_once
from ..kernels._triton_utils import kernel_op
from ..kernels.attention.router import (
    AttentionOperands,
    KernelChoice,
    TuningOptions,
    block_sparse_attention_op,
    launch_options,
    plan_kernel,
)
from ..kernels.attention.v_fp8 import quantize_v_fp8_channel_major
from ..kernels.attention.vsa_pool import tile_pool, tile_quantize_fp8, valid_slots
from ..kernels.attention.vsa_select import select_tiles, topk_for_sparsity
from ..kernels.numerics import (
    dequantize_fp8_per_block,
    fake_quant_fp4,
    fake_quant_fp8_per_token,
    quantize_fp8_per_block,
    quantize_fp8_per_channel,
)
from ..layout import PackedLayout, current_call_plan, current_packed_layout, require_packed_layout
from .base import CallInputs, MiniMaxH3AttnProcessorBase, made_for
from .install import (
    enable_attention_processor,
    processor_entry_points,
    register_attention_processor,
    transformer_blocks,
    transformer_models,
)
from .low_precision import (
    QK_8BIT,
    MiniMaxH3LowPrecisionAttnProcessor,
    check_low_precision_options,
    precision_label,
    triton_kernels_run_on,
)
from .tiling import TilePlan, TilePlanCache


PRECISIONS = ("bf16", "fp8", "int8", "fp4")


@dataclass(frozen=True)
class VSAConfig:
    r"""
    The options of video sparse attention, validated once (for :class:`MiniMaxH3VSAProcessor` and :func:`enable_vsa`).

    Args:
        sparsity (`float`, defaults to `0.8`): fraction of *video* key tiles dropped per video query tile
            (``0`` = dense attention).
        tile (`tuple[int, int, int]`, defaults to `(4, 4, 4)`): video cube in latent tokens (t, h, w); its volume
            (a power of two ≥ 16) is also the chunk length of non-video rows.
        precision (`str`, defaults to `"bf16"`): ``"bf16"`` (the activations' dtype), ``"fp8"`` (E4M3 Q with
            per-token scales, K with one scale per key tile; FP8 tensor cores, SM89+), ``"int8"`` (the same with
            symmetric INT8 Q/K, SageAttention's choice: same speed on Ampere/Hopper tensor cores, less error than
            E4M3, docs/attention.md) or ``"fp4"`` (NVFP4-style E2M1 with 16-element E4M3 scales; emulated everywhere, native FP4
            attention is not implemented and not run on hardware).
        dense_layers (`tuple[int, ...]`): block indices that stay dense.
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
        kernel (`str`, defaults to `"auto"`): the flash kernel of the fine stage and of 8-bit dense layers: ``"sm90"``
            (Hopper Gluon kernel), ``"triton"`` (portable Triton kernel) or ``"auto"`` (the Hopper kernel where it runs
            these inputs, else Triton).
        head_groups (`int`, *optional*): run the sparse core over this many groups of heads in turn, so that its
            temporary copies (packed K/V, 8-bit Q/K/V, tile means) take that fraction of the memory; the result is
            the same bit for bit (every scale, mean and tile selection is per head). ``None``: the transformer's
            memory setting (:func:`set_vsa_head_groups`, which the PC memory recipes set), else one group.
    """

    sparsity: float = 0.8
    tile: Tuple[int, int, int] = (4, 4, 4)
    precision: str = "bf16"
    dense_layers: Tuple[int, ...] = ()
    dense_first_steps: int = 0
    smooth_k: bool = True
    pv_precision: str = "bf16"
    fp4_p: Optional[str] = "two_level"
    strict: bool = False
    backend: str = "auto"
    kernel: str = "auto"
    head_groups: Optional[int] = None

    def __post_init__(self):
        sparsity = self.sparsity
        if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0.0 <= float(sparsity) < 1.0:
            raise ValueError(f"sparsity must be a float in [0, 1), got {sparsity!r} (0 = dense attention)")
        check_low_precision_options(self.precision, pv_precision=self.pv_precision, fp4_p=self.fp4_p,
                                    strict=self.strict, backend=self.backend, kernel=self.kernel, allowed=PRECISIONS)
        tile = tuple(int(t) for t in self.tile)
        volume = math.prod(tile)
        if len(tile) != 3 or volume < 16 or volume & (volume - 1):
            raise ValueError(f"tile must be (t, h, w) with a power-of-two volume >= 16, e.g. (4, 4, 4); got {tile}")
        if self.pv_precision == "fp8" and volume < 32:
            raise ValueError(f"pv_precision='fp8' needs tiles of at least 32 tokens (FP8 MMA K dimension), got {tile}")
        if int(self.dense_first_steps) < 0:
            raise ValueError(f"dense_first_steps must be >= 0, got {self.dense_first_steps}")
        check_head_groups(self.head_groups)
        object.__setattr__(self, "sparsity", float(sparsity))
        object.__setattr__(self, "tile", tile)
        object.__setattr__(self, "dense_layers", tuple(sorted({int(i) for i in self.dense_layers})))
        object.__setattr__(self, "dense_first_steps", int(self.dense_first_steps))
        object.__setattr__(self, "smooth_k", bool(self.smooth_k))
        object.__setattr__(self, "strict", bool(self.strict))

    @classmethod
    def from_options(cls, config: Optional["VSAConfig"] = None, **options) -> "VSAConfig":
        """``config`` (default: ``VSAConfig()``) with ``options`` replaced; one clear error for an unknown option."""
        if config is not None and not isinstance(config, VSAConfig):
            raise TypeError(f"config must be a VSAConfig, got {type(config).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - fields)
        if unknown:
            raise TypeError(f"unknown VSA option(s) {unknown}; VSAConfig fields are {sorted(fields)}")
        if config is not None and not options:
            return config  # one object for every block of an enable_vsa (the call plan files their plan under it)
        return dataclasses.replace(config or cls(), **options)

    @property
    def block(self) -> int:
        return math.prod(self.tile)

    def low_precision_processor(self) -> Optional[MiniMaxH3LowPrecisionAttnProcessor]:
        """The dense core of this precision (``None`` for bf16, which dense calls run through diffusers' dispatch)."""
        if self.precision == "bf16":
            return None
        return MiniMaxH3LowPrecisionAttnProcessor(
            self.precision, smooth_k=self.smooth_k, pv_precision=self.pv_precision, fp4_p=self.fp4_p,
            strict=self.strict, backend=self.backend, kernel=self.kernel,
        )


def plan_vsa_kernel(head_dim: int, dtype: torch.dtype, device: torch.device, *, block: int, precision: str = "bf16",
                    pv_precision: str = "bf16", emulate: bool = False, fp4_p: Optional[str] = "two_level",
                    backend: str = "auto", tuning: Optional[TuningOptions] = None) -> Tuple[KernelChoice, AttentionOperands]:
    """The fine stage's kernel of a :func:`vsa_attention` call, decided before the call from its options (what the
    VSA processor plans once per transformer call), and the operands it is chosen for: the ones
    :func:`vsa_attention` builds (16-bit rows packed in tile order; 8-bit Q/K with scales and, with FP8 P·V,
    channel-major E4M3 V; FP4-rounded 16-bit rows with the FP4 P emulation)."""
    qk_dtype = QK_8BIT.get(precision)
    if qk_dtype is not None and not emulate:
        pv_fp8 = pv_precision == "fp8"
        v_dtype, v_layout = (torch.float8_e4m3fn, "channel-major") if pv_fp8 else (dtype, "contiguous")
        operands = AttentionOperands(head_dim, qk_dtype, v_dtype, v_layout=v_layout, q_scaled=True, v_scaled=pv_fp8)
    elif precision == "fp4":  # V rounded over the sequence comes back channel-major (numerics.fake_quant_fp4)
        operands = AttentionOperands(head_dim, dtype, dtype, v_layout="channel-major", p_fp4=fp4_p)
    else:
        operands = AttentionOperands(head_dim, dtype, dtype)
    choice = plan_kernel(operands, device, block=block, backend=backend, tuning=tuning)
    return choice, operands


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
    fp4_p: Optional[str] = "two_level",
    tuning: Optional[TuningOptions] = None,
    choice: Optional[KernelChoice] = None,
    return_choice: bool = False,
) -> Union[Tuple[torch.Tensor, Optional[torch.Tensor]], Tuple[torch.Tensor, Optional[torch.Tensor], KernelChoice]]:
    """The VSA core on ``[B, S, H, D]`` rows (after QK-norm and rotary): returns ``(out_fine, out_coarse)``.

    ``out_fine`` is ``[B, S, H, D]``; ``out_coarse`` is the per-tile coarse attention ``[B, H, T, D]`` when
    ``compress`` (else ``None``). ``emulate`` replaces FP8 tensor-core products by quantize-dequantize + bf16
    kernels (for GPUs without FP8 MMA). ``precision="fp4"`` is always emulated. ``tuning`` (benchmarks) is passed to
    the fine kernel, see :class:`~diffusers_h3.kernels.attention.TuningOptions`. ``fp4_p`` (``"two_level"``,
    ``"single_level"`` or ``None`` = bf16 P) selects the FP4 emulation of P. ``choice``: the fine stage's kernel as
    planned (:func:`plan_vsa_kernel`; by default planned here); with ``return_choice`` it comes third. The work runs
    in the custom op ``diffusers_h3::vsa_attention`` over the plan's tensors and sizes (one node under
    ``torch.compile``).
    """
    if query.shape[1] != plan.seq_len:
        raise ValueError(f"the tile plan covers {plan.seq_len} rows but the query has {query.shape[1]}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if choice is None:
        choice, _ = plan_vsa_kernel(query.shape[-1], query.dtype, query.device, block=plan.block, precision=precision,
                                    pv_precision=pv_precision, emulate=emulate, fp4_p=fp4_p, backend=backend,
                                    tuning=tuning)  # fmt: skip
    topk = topk_for_sparsity(float(sparsity), plan.num_video_tiles)
    flags = [int(smooth_k), int(pv_precision == "fp8"), int(emulate), int(compress)]
    p_fp4 = fp4_p if precision == "fp4" else None
    out, out_coarse = vsa_attention_op(query, key, value, [plan.slot_rows, plan.tile_counts],
                                       [plan.block, plan.num_prefix_tiles, topk], precision, flags, choice.launch,
                                       launch_options(tuning, p_fp4))  # fmt: skip
    out_coarse = out_coarse if compress else None
    return (out, out_coarse, choice) if return_choice else (out, out_coarse)


def _vsa_attention_fake(query, key, value, tiles, sizes, precision, flags, launch, options):
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    b, _, h, d = query.shape
    compress = bool(flags[3])
    n_tiles = tiles[1].shape[0]
    coarse = query.new_empty((b, h, n_tiles, d), dtype=torch.float32) if compress else query.new_empty(0)
    return out, coarse


@kernel_op("vsa_attention", _vsa_attention_fake)
def vsa_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    tiles: List[torch.Tensor],
    sizes: List[int],
    precision: str,
    flags: List[int],
    launch: str,
    options: List[int],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`vsa_attention` over the plan's tensors and sizes: ``tiles`` = ``[slot_rows, tile_counts]``, ``sizes`` =
    ``[block, num_prefix_tiles, topk]``, ``flags`` = ``[smooth_k, pv_fp8, emulate, compress]`` (0 / 1), ``launch`` and
    ``options`` the fine stage's planned kernel (:attr:`KernelChoice.launch`, :func:`launch_options`). Returns
    ``(out_fine, out_coarse)`` (an empty tensor without ``compress``); records nothing."""
    slot_rows, tile_counts = tiles
    block, num_prefix_tiles, topk = sizes
    smooth_k, pv_fp8, emulate, compress = (bool(f) for f in flags)
    out, out_coarse = _run_vsa_attention(
        query, key, value, slot_rows, tile_counts, block, num_prefix_tiles, topk, precision=precision,
        smooth_k=smooth_k, pv_fp8=pv_fp8, compress=compress, emulate=emulate, launch=launch, options=options,
    )
    return out, (out_coarse.contiguous() if out_coarse is not None else query.new_empty(0))


def _run_vsa_attention(query, key, value, slot_rows, tile_counts, block, num_prefix_tiles, topk, *, precision,
                       smooth_k, pv_fp8, compress, emulate, launch, options):
    scale = 1.0 / math.sqrt(query.shape[-1])
    # The pooling / selection kernels run where the planned fine kernel runs (its torch reference: theirs).
    backend = "torch" if launch.startswith("torch-reference:") else "triton"
    rows = (slot_rows, tile_counts, block)
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
    kv_index, kv_num = select_tiles(scores, num_prefix_tiles, topk, backend=backend)
    out_coarse = torch.matmul(torch.softmax(scores, dim=-1), pooled_v) if compress else None
    tiles = [slot_rows, tile_counts, kv_index, kv_num]

    def fine(q, k, v, q_scale=None, k_scale=None, v_scale=None):
        out = block_sparse_attention_op(q, k, v, tiles, [q_scale, k_scale, v_scale], block, scale, query.dtype, launch,
                                        options)  # fmt: skip
        return out, out_coarse

    if precision == "bf16":
        return fine(query, k_packed, v_packed)

    k_mean = None
    if smooth_k:
        # Per-head key mean over the valid rows, from the tile means (softmax is invariant to this shift).
        counts = tile_counts.to(torch.float32)
        k_mean = (pooled_k * counts[:, None]).sum(2) / counts.sum()  # [B, H, D]
    if native_8bit:
        _, k8, k_scale = tile_quantize_fp8(key, *rows, packed=True, subtract=k_mean, per_tile=True, dtype=qk_dtype,
                                           backend=backend)
        v_arg, v_scale = v_packed, None
        if pv_fp8:  # channel-major E4M3 for the FP8 P.V MMA
            v_arg, v_scale = quantize_v_fp8_channel_major(v_packed, backend=backend)
        return fine(q8, k8, v_arg, q_scale, k_scale, v_scale)

    if k_mean is not None:  # pad slots stay zero (they must not count in the FP8 per-tile K scales)
        valid = valid_slots(tile_counts, block).reshape(1, -1, 1, 1)
        k_packed = torch.where(valid, k_packed.float() - k_mean.unsqueeze(1), 0.0).to(key.dtype)
    if precision == "fp4":
        q_e = fake_quant_fp4(query, dim=-1)
        k_e = fake_quant_fp4(k_packed, dim=-1)
        v_e = fake_quant_fp4(v_packed, dim=1)  # 16 consecutive (tile-ordered) tokens per channel
        return fine(q_e, k_e, v_e)
    # 8-bit emulation (no FP8 / INT8 tensor cores): quantize-dequantize as the native path does, then the bf16 kernel.
    k8, k_scale = quantize_fp8_per_block(k_packed, block, dtype=qk_dtype)
    q_e = fake_quant_fp8_per_token(query, dtype=qk_dtype)
    k_e = dequantize_fp8_per_block(k8, k_scale, block).to(key.dtype)
    v_e = v_packed
    if pv_fp8:
        v8, vs = quantize_fp8_per_channel(v_packed, seq_dim=1)
        v_e = (v8.float() * vs.unsqueeze(1)).to(value.dtype)
    return fine(q_e, k_e, v_e)


@dataclass(frozen=True)
class VSAPlan:
    """The VSA processor's plan of one transformer call (made by the call-plan hook, read by every VSA block).

    Attributes:
        route: ``"sparse"`` or ``"dense"`` (a dense first step, or no target-video tiles) for the blocks that are not
            dense layers; ``None`` without a published layout (only dense layers can run).
        tiles: the :class:`TilePlan` of a sparse route.
        topk: video key tiles each video query tile keeps.
        sparse_kernel: the fine stage's :class:`KernelChoice`, the operands it is chosen for and its launch options
            (the FP4 P mode and the kernel knobs, :func:`~diffusers_h3.kernels.attention.tuning.launch_options`).
        dense: the dense core's plan (the low-precision processor's plan, or the diffusers dispatch choice for bf16).
        emulated: whether FP8 / INT8 run as quantize-dequantize emulation on this device.
    """

    route: Optional[str]
    tiles: Optional[TilePlan]
    topk: int
    sparse_kernel: Optional[KernelChoice]
    sparse_operands: Optional[AttentionOperands]
    launch_options: Tuple[int, ...]
    dense: Any
    emulated: bool
    device: torch.device
    dtype: torch.dtype
    head_dim: int

    def fits(self, query: torch.Tensor) -> bool:
        return (self.tiles is None or self.tiles.seq_len == query.shape[1]) and made_for(self, query)

    @property
    def kernel(self) -> Optional[KernelChoice]:
        return self.sparse_kernel if self.route == "sparse" else getattr(self.dense, "kernel", None)

    def describe(self) -> str:
        if self.route == "sparse":
            return f"VSA sparse ({self.tiles.describe()}, top {self.topk}): {self.sparse_kernel.describe()}"
        dense = self.dense.kernel.describe() if self.dense is not None else "-"
        return f"VSA dense ({'no layout' if self.route is None else 'this step'}): {dense}"


@dataclass(frozen=True)
class DispatchPlan:
    """The plan of a bf16 VSA processor's dense calls: diffusers' ``dispatch_attention_fn`` on the processor's
    attention backend."""

    kernel: KernelChoice

    def describe(self) -> str:
        return self.kernel.describe()


@register_attention_processor("vsa", VSAConfig)
class MiniMaxH3VSAProcessor(MiniMaxH3AttnProcessorBase):
    r"""
    Video sparse attention processor for ``MiniMaxH3Attention`` (install one per transformer block with
    :func:`enable_vsa`, or on its own with ``transformer.set_attn_processor``).

    Args:
        config (`VSAConfig`, *optional*): the VSA options (default ``VSAConfig()``); keyword ``options`` (the fields
            of :class:`VSAConfig`: ``sparsity``, ``tile``, ``precision``, ...) replace single fields of it.
        layer_index (`int`, *optional*): index of the transformer block (for ``dense_layers``).
    """

    def __init__(self, config: Optional[VSAConfig] = None, *, layer_index: Optional[int] = None, **options):
        self._last_sparse_kernel: Optional[KernelChoice] = None  # the fine stage of the last sparse call (report)
        super().__init__()
        self.config = VSAConfig.from_options(config, **options)
        self.layer_index = layer_index
        # A plain attribute (not derived from layer_index at call time), so that torch.compile traces one version of
        # __call__ for every sparse block instead of specializing on each block's index.
        self.layer_dense = self.config.sparsity == 0.0 or (
            layer_index is not None and layer_index in self.config.dense_layers
        )
        self._plans = TilePlanCache()
        # A plain attribute for torch.compile (one traced version for all blocks); `prepare` may set the model's.
        self.head_groups = int(self.config.head_groups or 1)
        self._low_precision = self.config.low_precision_processor()
        if self._low_precision is not None:
            self._low_precision._who = type(self).__name__

    # -- installation (enable_vsa) ------------------------------------------------------------------------------------
    @classmethod
    def prepare(cls, config: VSAConfig, model, blocks) -> Tuple[TilePlanCache, int]:
        """``dense_layers`` must name blocks of ``model``; one plan cache per model (one plan object per layout for
        every block: one compiled version serves them all) and the model's head groups (``config.head_groups``,
        else :func:`set_vsa_head_groups`'s setting, else 1)."""
        bad = [i for i in config.dense_layers if not 0 <= i < len(blocks)]
        if bad:
            raise ValueError(f"dense_layers {bad} are out of range for a transformer with {len(blocks)} blocks")
        groups = config.head_groups if config.head_groups is not None else vsa_head_groups_of(model)
        return TilePlanCache(), int(groups or 1)

    @classmethod
    def for_block(cls, config: VSAConfig, prepared: Tuple[TilePlanCache, int], index: int,
                  block) -> "MiniMaxH3VSAProcessor":
        tiles, groups = prepared
        processor = cls(config, layer_index=index)
        processor._plans = tiles
        processor.head_groups = groups
        if config.strict:
            processor._emulate(next(block.parameters()).device)  # raise now rather than mid-denoising
        return processor

    @classmethod
    def state(cls, found) -> Dict[str, Any]:
        """``blocks`` (with a VSA processor), ``sparse_blocks``, ``dense_layers``, ``dense_first_steps``,
        ``gated_blocks`` (with a ``to_gate_compress``), ``precision``, ``sparsity``, ``tile`` and ``path`` (the first
        processor's ``describe_path()``: after a call, the kernels it ran)."""
        processors = [p for _, p in found]
        config = processors[0].config
        return {
            "blocks": len(processors),
            "sparse_blocks": sum(not p.layer_dense for p in processors),
            "dense_layers": list(config.dense_layers),
            "dense_first_steps": config.dense_first_steps,
            "gated_blocks": sum(getattr(block.attn, "to_gate_compress", None) is not None for block, _ in found),
            "precision": config.precision,
            "sparsity": config.sparsity,
            "tile": tuple(config.tile),
            "head_groups": processors[0].head_groups,
            "path": processors[0].describe_path(),
        }

    # The options, read through the config (one source of truth).
    sparsity = property(lambda self: self.config.sparsity)
    tile = property(lambda self: self.config.tile)
    precision = property(lambda self: self.config.precision)
    dense_first_steps = property(lambda self: self.config.dense_first_steps)

    # -- the plan of a call (made once per transformer call, outside the compiled blocks) -----------------------------
    def route_for(self, layout: Optional[PackedLayout], device: torch.device) -> Tuple[Optional[str], Optional[TilePlan]]:
        """``("dense", None)``, ``("sparse", plan)`` or, without a layout, ``(None, None)`` for the sparse blocks of a
        call under ``layout`` on ``device`` (dense layers are always dense)."""
        if self.config.sparsity == 0.0:
            return "dense", None
        if layout is None:
            return None, None
        if layout.step_index is not None and layout.step_index < self.dense_first_steps:
            return "dense", None
        plan = self._plans.get(layout, self.tile, device)
        if plan.num_video_tiles == 0:
            return "dense", None
        return "sparse", plan

    def plan_call(self, call: CallInputs) -> VSAPlan:
        """The route of the call (from the layout: dense first steps, the tile plan), the fine stage's kernel, the
        dense core's plan and the emulation decision, for Q/K/V of ``call.dtype`` on ``call.device``."""
        route, tiles = self.route_for(call.layout, call.device)
        emulated = self._emulate(call.device)
        dense = self._plan_dense(call)
        sparse_kernel = operands = None
        options = ()
        backend = self.config.backend
        topk = 0
        if route == "sparse":
            if backend == "auto" and not triton_kernels_run_on(call.device):
                warn_once("vsa-torch-kernels", f"{type(self).__name__}: no CUDA device (or triton): the VSA kernels "
                          "run their pure-torch references (exact, slow)")  # fmt: skip
                backend = "torch"
            kernel = self.config.kernel
            tuning = TuningOptions(kernel=kernel) if kernel != "auto" and backend != "torch" else None
            sparse_kernel, operands = plan_vsa_kernel(
                call.head_dim, call.dtype, call.device, block=tiles.block, precision=self.precision,
                pv_precision=self.config.pv_precision, emulate=emulated, fp4_p=self.config.fp4_p, backend=backend,
                tuning=tuning,
            )
            topk = topk_for_sparsity(self.sparsity, tiles.num_video_tiles)
            options = tuple(launch_options(tuning, self.config.fp4_p if self.precision == "fp4" else None))
        return VSAPlan(route, tiles, topk, sparse_kernel, operands, options, dense, emulated, call.device, call.dtype,
                       call.head_dim)  # fmt: skip

    def _plan_dense(self, call: CallInputs):
        if self._low_precision is not None:
            return self._low_precision.plan_call(call)
        backend = self._attention_backend or "active backend"
        return DispatchPlan(KernelChoice("diffusers-dispatch", str(getattr(backend, "value", backend)),
                                         "dense call of a bf16 VSA processor"))

    def _emulate(self, device: torch.device) -> bool:
        """Whether FP8 / INT8 runs as quantize-dequantize emulation on ``device`` (warns once, or raises when strict)."""
        return self._low_precision.emulated(device) if self._low_precision is not None else False

    # -- the core ----------------------------------------------------------------------------------------------------
    def extras(self, attn, hidden_states: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The trained coarse gate ``to_gate_compress(x)`` per row and head, on sparse calls of gated blocks."""
        gate = getattr(attn, "to_gate_compress", None)
        if gate is None or self.layer_dense:
            return {}
        call_plan = current_call_plan()
        plan = call_plan.plan_for(self.plan_key) if call_plan is not None else None
        route = plan.route if plan is not None else self._published_route()
        if route != "sparse":
            return {}
        return {"gate": gate(hidden_states).unflatten(-1, (attn.heads, -1))}

    @torch.compiler.disable  # without a call plan (a processor set by hand): the published layout, read eagerly
    def _published_route(self) -> Optional[str]:
        layout = current_packed_layout()
        if layout is None:
            return "sparse"  # the core raises the error that says how to publish a layout
        return "dense" if layout.step_index is not None and layout.step_index < self.dense_first_steps else "sparse"

    def core(self, query, key, value, attention_mask=None, gate: Optional[torch.Tensor] = None):
        plan = self.current_plan(query)
        if self.layer_dense or plan.route == "dense":
            return self._dense_core(plan, query, key, value, attention_mask)
        if plan.route is None or plan.tiles.seq_len != query.shape[1]:
            require_packed_layout(type(self).__name__, query.shape[1])  # raises: says how to publish a matching one
        if attention_mask is not None:
            raise ValueError(
                f"{type(self).__name__} got an attention_mask; VSA attends over one packed document and takes none"
            )
        heads = query.shape[2]
        groups = min(self.head_groups, heads)
        if groups <= 1:
            return self._sparse_core(plan, query, key, value.contiguous(), gate)
        # One group of heads at a time: the op's temporaries shrink by the group count; every head's numbers are
        # computed as in one call (scales, means and tile selection are per head).
        out = torch.empty(query.shape, device=query.device, dtype=query.dtype)
        bounds = [heads * g // groups for g in range(groups + 1)]
        for start, stop in zip(bounds[:-1], bounds[1:]):
            heads_slice = slice(start, stop)
            out[:, :, heads_slice] = self._sparse_core(
                plan, query[:, :, heads_slice].contiguous(), key[:, :, heads_slice].contiguous(),
                value[:, :, heads_slice].contiguous(), gate[:, :, heads_slice] if gate is not None else None)
        return out

    def _sparse_core(self, plan: VSAPlan, query, key, value, gate):
        tiles = plan.tiles
        flags = [int(self.config.smooth_k), int(self.config.pv_precision == "fp8"), int(plan.emulated),
                 int(gate is not None)]  # fmt: skip
        out, out_coarse = vsa_attention_op(query, key, value, [tiles.slot_rows, tiles.tile_counts],
                                           [tiles.block, tiles.num_prefix_tiles, plan.topk], self.precision, flags,
                                           plan.sparse_kernel.launch, list(plan.launch_options))  # fmt: skip
        if gate is not None:
            coarse_rows = out_coarse.index_select(2, tiles.row_tile).permute(0, 2, 1, 3)  # [B, S, H, D]
            out = torch.addcmul(out.float(), gate.float(), coarse_rows).to(out.dtype)
        return out

    def _dense_core(self, plan: VSAPlan, query, key, value, attention_mask):
        if self._low_precision is not None:
            return self._low_precision.attend_planned(plan.dense, query, key, value, attention_mask)
        # exactly what diffusers' MiniMaxH3AttnProcessor runs
        return dispatch_attention_fn(query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
                                     backend=self._attention_backend)

    # -- report ------------------------------------------------------------------------------------------------------
    @property
    def last_choice(self) -> Optional[KernelChoice]:
        plan = self.last_plan
        if plan is None:
            return None
        if self.layer_dense:
            return getattr(plan.dense, "kernel", None)
        return plan.kernel

    def describe_path(self) -> str:
        config, plan = self.config, self.last_plan
        emulated = plan.emulated if plan is not None and self._low_precision is not None else None
        prec = precision_label(config.precision, smooth_k=config.smooth_k, pv_precision=config.pv_precision,
                               fp4_p=config.fp4_p, emulated=emulated)
        if self.layer_dense:
            why = "sparsity=0" if config.sparsity == 0.0 else "dense layer"
            dense_choice = getattr(plan.dense, "kernel", None) if plan is not None else None
            ran = f" via {dense_choice.describe()}" if dense_choice is not None else ""
            dense = "diffusers SDPA dispatch" if config.precision == "bf16" else prec
            return f"dense attention ({dense}; {why}){ran}"
        choice = self._last_sparse_kernel
        if choice is None:
            kernel = "kernels chosen on the first sparse call"
        elif choice.kernel == "torch-reference":
            kernel = f"torch reference kernels ({choice.reason})"
        else:
            kernel = f"Triton pooling/selection + {choice.describe()}"
        extra = f", dense for the first {config.dense_first_steps} steps" if config.dense_first_steps else ""
        extra += f", {self.head_groups} head groups in turn" if self.head_groups > 1 else ""
        return (f"VSA sparsity={config.sparsity} tile={config.tile} {prec} via {kernel}{extra}; coarse gate when "
                "to_gate_compress exists")

    @property
    def last_plan(self) -> Optional[VSAPlan]:
        return self._last_plan

    @last_plan.setter
    def last_plan(self, plan: Optional[VSAPlan]) -> None:
        self._last_plan = plan
        if plan is not None and plan.route == "sparse":
            self._last_sparse_kernel = plan.sparse_kernel  # the sparse path keeps its report through dense steps


def check_head_groups(groups) -> None:
    if groups is not None and (isinstance(groups, bool) or not isinstance(groups, int) or groups < 1):
        raise ValueError(f"head_groups must be a positive int (or None), got {groups!r}")


@dataclass(frozen=True)
class VSAHeadGroups:
    """The record of :func:`set_vsa_head_groups` on a transformer."""

    groups: int


def set_vsa_head_groups(pipe_or_transformer, groups: Optional[int]) -> None:
    """The head groups that VSA processors installed later on these transformer partition(s) run in, unless their
    :class:`VSAConfig` names its own (``None``: one group, the setting removed). A memory recipe sets it so that a
    user's ``enable_vsa`` fits the card the recipe is for. Kept as the record of a registry hook that does nothing at
    run time (``diffusers_h3._hooks``)."""
    check_head_groups(groups)
    for _, model in transformer_models(pipe_or_transformer, "set_vsa_head_groups"):
        remove_h3_hook(model, H3_VSA_HEAD_GROUPS_HOOK, recurse=False)
        if groups is not None:
            register_h3_hook(model, H3Hook(VSAHeadGroups(groups)), H3_VSA_HEAD_GROUPS_HOOK)


def vsa_head_groups_of(model) -> Optional[int]:
    """The head groups :func:`set_vsa_head_groups` set on ``model`` (a transformer), or ``None``."""
    record = h3_record(model, H3_VSA_HEAD_GROUPS_HOOK)
    return record.groups if record is not None else None


def enable_vsa(pipe_or_transformer, config: Optional[VSAConfig] = None, **options):
    """Install one :class:`MiniMaxH3VSAProcessor` per transformer block of a pipeline's transformer partition(s) or of
    one transformer (the token refiner keeps its processor), and the call-plan hook.

    ``config`` is a :class:`VSAConfig`; keyword ``options`` (its fields: ``sparsity=``, ``precision=``, ...) replace
    single fields. Dense low-precision attention alone is :func:`~.low_precision.enable_low_precision_attention`.
    ``dense_layers`` is checked against every model before any processor changes. Returns the argument;
    what was installed (number of blocks, which are dense, the precision, one ``describe_path`` line) is read from the
    processors with :func:`vsa_state`. Undo with :func:`disable_vsa`.
    """
    return enable_attention_processor(pipe_or_transformer, VSAConfig.from_options(config, **options), who="enable_vsa")


_, disable_vsa, vsa_state = processor_entry_points(MiniMaxH3VSAProcessor)


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
    blocks = transformer_blocks(transformer, "add_gate_compress")
    if state_dict_or_keys is None:
        entries = {i: {"weight": None} for i in range(len(blocks))}
    else:
        entries = _gate_entries(state_dict_or_keys)
    added = []
    for i, tensors in sorted(entries.items()):
        if not 0 <= i < len(blocks):
            raise ValueError(f"checkpoint has to_gate_compress for block {i} but the transformer has {len(blocks)}")
        attn = blocks[i].attn
        ref = attn.to_q.weight  # a quantized weight has the compute dtype as its dtype
        dtype = ref.dtype
        gate = torch.nn.Linear(attn.to_q.in_features, attn.heads * attn.head_dim, bias="bias" in tensors,
                               device=ref.device, dtype=dtype)
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
