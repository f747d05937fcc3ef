"""``MiniMaxH3FAV100Processor``: MiniMax-H3 attention with the FA-V100 CUDA kernel as its core.

Projections, per-head QK RMSNorm and the partial 3-axis rotary embedding are diffusers' own (``attn.to_q/k/v``,
``attn.norm_q/k``, ``_apply_rotary_emb`` from ``transformer_minimax_h3``, in the order of ``MiniMaxH3AttnProcessor``);
only ``softmax(Q K^T / sqrt(d)) V`` is replaced (:meth:`MiniMaxH3FAV100Processor.core`; refiner calls and context
parallelism follow :class:`~.base.MiniMaxH3AttnProcessorBase`). The processor computes attention in **fp16** on CUDA (V100 has no
bf16 tensor cores): inputs of other dtypes are cast, with ``V`` scaled by a power of two when its magnitude would not
fit fp16 (attention is linear in ``V``, so the scale is undone exactly on the output).

Path choice, planned once per transformer call from the device and the head_dim (:class:`FAV100Plan`;
``describe_path()`` reads the plan: which path ran and why):

* **kernel** on SM70-class GPUs (compute capability 7.x: V100, Turing), head_dim 64 / 128;
* **kernel** on sm_80+ only with ``allow_non_volta=True`` (the kernel is valid there but slower than SDPA's
  flash / cuDNN kernels; a correctness proxy on newer GPUs);
* otherwise **SDPA memory-efficient** (``SDPBackend.EFFICIENT_ATTENTION``, fp16) with a one-time warning: GPU not
  SM70-class, unsupported head_dim, or the extension could not be built (no nvcc / ninja, CUDA 13 toolkit on sm_70,
  ...). Inputs on CPU use plain SDPA in their own dtype (tests, debugging).

An attention mask is a per-call input that no plan sees (H3 passes none): the kernel is mask-free, so a call with a
mask falls back to SDPA with the mask, decided in the core (:meth:`FAV100Plan.with_attention_mask`).

Hardware honesty: the kernel targets V100 but has been run on a Hopper GPU only; it is **not run on V100 hardware**.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .._utils import cuda_capability, warn_once
from ..kernels.attention.fa_v100 import (
    SUPPORTED_HEAD_DIMS,
    SUPPORTED_QUERY_TILES,
    FAV100BuildError,
    fa_v100_attention,
    load_extension,
)
from ..kernels.attention.router import KernelChoice
from .base import CallInputs, MiniMaxH3AttnProcessorBase, made_for


# |V| is brought under this bound (by a power of two) before the cast to fp16; the attention output is a convex
# combination of V rows, so it stays under the bound too.
FP16_VALUE_LIMIT = 2.0**14

PATH_KERNEL = "kernel"
PATH_SDPA_EFFICIENT = "sdpa_efficient"
PATH_SDPA_CPU = "sdpa_cpu"


def to_fp16_with_value_scale(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, limit: float = FP16_VALUE_LIMIT
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Cast Q/K/V to fp16; V is first divided by a power of two (a 0-dim tensor, no host sync) if ``max|V| > limit``.

    Returns ``(q16, k16, v16, value_scale)`` where ``value_scale`` is ``None`` for fp16 inputs (nothing to do) and
    otherwise the factor the attention output must be multiplied by. Q and K come out of the per-head RMSNorm and
    the rotary embedding, so they are bounded by the norm weights; they are cast as they are.
    """
    if value.dtype == torch.float16:
        return query.to(torch.float16), key.to(torch.float16), value, None
    amax = value.detach().abs().amax().float()
    exponent = torch.clamp(torch.ceil(torch.log2(amax.clamp_min(1e-30) / limit)), min=0.0)
    value_scale = torch.exp2(exponent)
    value16 = (value / value_scale.to(value.dtype)).to(torch.float16)
    return query.to(torch.float16), key.to(torch.float16), value16, value_scale


def _path_choice(path: str, reason: str, query_tile: int) -> KernelChoice:
    variant = {PATH_KERNEL: f"q-tile {query_tile}", PATH_SDPA_EFFICIENT: "fp16"}.get(path, "input dtype")
    return KernelChoice(path, variant, reason)


@dataclasses.dataclass(frozen=True)
class FAV100Plan:
    """The FA-V100 processor's plan of one transformer call: its ``path`` (``"kernel"``, ``"sdpa_efficient"`` or
    ``"sdpa_cpu"``), the ``kernel`` choice (path, variant, reason), the kernel's ``query_tile`` and the inputs it was
    made for: the ``device`` and ``head_dim`` (every path casts Q/K/V itself, so the dtype plays no part; in V100 mode
    the fp16 projections return fp32).

    Planned for a call without an attention mask (H3 passes none); ``for_attention_mask`` marks the fallback the core
    plans for a call with one (:meth:`with_attention_mask`), which holds for that call only."""

    path: str
    kernel: KernelChoice
    query_tile: int
    device: torch.device
    head_dim: int
    for_attention_mask: bool = False

    def fits(self, query: torch.Tensor) -> bool:
        return not self.for_attention_mask and made_for(self, query, dtype=False)

    def with_attention_mask(self) -> "FAV100Plan":
        """The plan of a call with an attention mask: the FA-V100 kernel is mask-free, so SDPA with the mask (in the
        inputs' dtype on the CPU, memory-efficient fp16 elsewhere)."""
        path = PATH_SDPA_CPU if self.path == PATH_SDPA_CPU else PATH_SDPA_EFFICIENT
        choice = _path_choice(path, "an attention mask was given; the FA-V100 kernel is mask-free", self.query_tile)
        return dataclasses.replace(self, path=path, kernel=choice, for_attention_mask=True)

    def describe(self) -> str:
        reason = self.kernel.reason
        if self.path == PATH_KERNEL:
            proxy = "" if reason.startswith("sm_7") else " as a proxy (allow_non_volta)"
            return (
                f"FA-V100 CUDA kernel (WMMA fp16 tensor cores, fp32 softmax/accumulation, q-tile {self.query_tile}) "
                f"on {reason}{proxy}; not run on V100 hardware"
            )
        if self.path == PATH_SDPA_CPU:
            return f"fallback: torch SDPA on CPU ({reason})"
        return f"fallback: SDPA memory-efficient fp16 ({reason})"


class MiniMaxH3FAV100Processor(MiniMaxH3AttnProcessorBase):
    r"""
    Attention processor for [`MiniMaxH3Attention`] running the FA-V100 CUDA kernel (FlashAttention-2-style forward,
    WMMA fp16 tensor cores, fp32 softmax and accumulation) on SM70-class GPUs.

    Args:
        query_tile (`int`, defaults to 128): query rows per thread block, 64 or 128. Results are bitwise identical;
            128 is the default (the faster one, docs/v100.md).
        allow_non_volta (`bool`, defaults to `False`): run the kernel on sm_80 and newer too. There it is valid but
            slower than SDPA's flash / cuDNN kernels; use it to check numerics on newer GPUs.
        build_dir (`str`, *optional*): where the extension is built and cached (default
            `~/.cache/diffusers_h3/torch_extensions`).

    Not run on V100 hardware: validated on a Hopper GPU with `allow_non_volta=True`.
    """

    def __init__(
        self,
        query_tile: int = 128,
        allow_non_volta: bool = False,
        build_dir: Optional[Union[str, os.PathLike]] = None,
    ):
        if query_tile not in SUPPORTED_QUERY_TILES:
            raise ValueError(f"query_tile must be one of {SUPPORTED_QUERY_TILES}, got {query_tile}.")
        super().__init__()
        self.query_tile = int(query_tile)
        self.allow_non_volta = bool(allow_non_volta)
        self.build_dir = build_dir
        self._device_paths: Dict[Tuple[str, Optional[int]], Tuple[str, str]] = {}

    # ------------------------------------------------------------------------------------------------ path choice
    def _device_path(self, device: torch.device) -> Tuple[str, str]:
        """(path, reason) for inputs on ``device`` with a supported head_dim and no mask; builds the kernel once."""
        key = (device.type, device.index)
        if key in self._device_paths:
            return self._device_paths[key]
        if device.type != "cuda":
            choice = (PATH_SDPA_CPU, f"inputs on {device.type}: FA-V100 is a CUDA kernel")
        else:
            capability = cuda_capability(device)
            arch = f"sm_{capability[0]}{capability[1]}"
            if capability < (7, 0):
                choice = (PATH_SDPA_EFFICIENT, f"{arch} has no fp16 tensor cores (FA-V100 needs sm_70+)")
            elif capability[0] != 7 and not self.allow_non_volta:
                choice = (
                    PATH_SDPA_EFFICIENT,
                    f"{arch} is not SM70-class (7.x); SDPA's kernels are faster there. Pass allow_non_volta=True "
                    "to run FA-V100 anyway",
                )
            else:
                try:
                    load_extension(device, build_dir=self.build_dir)
                    choice = (PATH_KERNEL, arch)
                except FAV100BuildError as error:
                    choice = (PATH_SDPA_EFFICIENT, f"the FA-V100 extension could not be built: {error}")
        self._device_paths[key] = choice
        return choice

    # ------------------------------------------------------------------------------------------------ the plan
    plans_read_layout = False  # dense attention: the plan does not depend on the call's layout

    @property
    def plan_key(self):
        """The processor itself: ``enable_v100_mode`` sets one instance on every block, so a call plans it once."""
        return self

    def plan_call(self, call: CallInputs) -> FAV100Plan:
        """The path of a call without an attention mask (H3 passes none) with Q/K/V on ``call.device``; loads the
        extension once per device (building it on first use) to know whether the kernel runs there."""
        path, reason = self._device_path(call.device)
        if path != PATH_SDPA_CPU and call.head_dim not in SUPPORTED_HEAD_DIMS:
            path, reason = PATH_SDPA_EFFICIENT, f"head_dim {call.head_dim} is not one of {SUPPORTED_HEAD_DIMS}"
        kernel = _path_choice(path, reason, self.query_tile)
        return FAV100Plan(path, kernel, self.query_tile, call.device, call.head_dim)

    def select_path(
        self, query: torch.Tensor, attention_mask: Optional[torch.Tensor] = None
    ) -> Tuple[str, str]:
        """Which path a call with this (batch, seq, heads, head_dim) query (and mask) takes, and why."""
        plan = self.plan_call(CallInputs(None, query.device, query.dtype, query.shape[-1]))
        if attention_mask is not None:
            plan = plan.with_attention_mask()
        return plan.path, plan.kernel.reason

    @torch.compiler.disable  # one eager island, as when a processor set by hand plans its call
    def _plan_masked_call(self, plan: FAV100Plan) -> FAV100Plan:
        """The mask fallback of ``plan`` for a call with an attention mask; it becomes the last plan (for that call
        only: it does not fit the next one), so that ``describe_path()`` reports it."""
        masked = plan.with_attention_mask()
        self.last_plan = masked
        return masked

    def describe_path(self) -> str:
        """One line: the path of the last call and why (from its plan)."""
        if self.last_plan is None:
            return (
                "FA-V100 processor, not called yet (SDPA fallback unless on an SM70-class GPU); "
                "not run on V100 hardware"
            )
        return self.last_plan.describe()

    # ------------------------------------------------------------------------------------------------ forward
    def core(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """The attention core on ``(batch, seq, heads, head_dim)`` tensors; returns the same layout.

        The path is the call's plan; a call with an attention mask takes its SDPA fallback instead (the mask is a
        per-call input no plan sees). The result is float32 when the inputs were float32 (the V scale is undone in
        fp32), else the input dtype.
        """
        plan = self.current_plan(query)
        if attention_mask is not None:
            plan = self._plan_masked_call(plan)
        path, reason = plan.path, plan.kernel.reason
        if path != PATH_KERNEL:
            warn_once(f"fa_v100_fallback:{path}:{reason}", f"MiniMaxH3FAV100Processor falls back to {path}: {reason}.")
        if path == PATH_SDPA_CPU:
            out = F.scaled_dot_product_attention(
                query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=attention_mask
            )
            return out.transpose(1, 2)

        out_dtype = query.dtype
        q16, k16, v16, value_scale = to_fp16_with_value_scale(query, key, value)
        if path == PATH_KERNEL:
            out = fa_v100_attention(q16, k16, v16, query_tile=plan.query_tile, backend="cuda", build_dir=self.build_dir)
        else:
            mask = attention_mask
            if mask is not None and mask.dtype != torch.bool:
                mask = mask.to(torch.float16)
            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
                out = F.scaled_dot_product_attention(
                    q16.transpose(1, 2), k16.transpose(1, 2), v16.transpose(1, 2), attn_mask=mask
                ).transpose(1, 2)
        if value_scale is None:
            return out.to(out_dtype)
        return (out.float() * value_scale).to(out_dtype)
