"""``MiniMaxH3FlashInferProcessor``: H3 attention with FlashInfer's dense prefill kernel as its core.

The same math as diffusers' ``MiniMaxH3AttnProcessor`` (projections, QK RMSNorm, rotary and output are the base's);
only ``softmax(Q K^T / sqrt(d)) V`` runs in FlashInfer: FlashAttention-3 on Hopper, FlashAttention-2 on SM80+
(``backend="auto"``); at the H3 shape FlashInfer's FA3 bf16 kernel is faster than cuDNN (measured in
``docs/attention.md``). FlashInfer is optional (``pip install flashinfer-python``) and builds its kernels on first use.

Install it with :func:`enable_flashinfer_attention`, which checks the package and the GPU once, before anything
changes. Refiner calls and context parallelism (Ulysses) follow :class:`~.base.MiniMaxH3AttnProcessorBase`.
"""

from __future__ import annotations

import itertools
from typing import Any, Dict

import torch

from .._utils import cuda_capability
from ..kernels.attention.flashinfer_dense import (
    check_flashinfer_kernels,
    flashinfer_dense_attention,
    import_flashinfer,
    resolve_backend,
)
from .base import MiniMaxH3AttnProcessorBase
from .low_precision import _models, transformer_blocks


class MiniMaxH3FlashInferProcessor(MiniMaxH3AttnProcessorBase):
    """Dense bf16 / fp16 attention through FlashInfer. ``backend``: ``"fa3"`` or ``"fa2"`` (resolved from the GPU by
    :func:`enable_flashinfer_attention` when asked for ``"auto"``)."""

    def __init__(self, backend: str = "fa3"):
        super().__init__()
        if backend not in ("fa2", "fa3"):
            raise ValueError(f"MiniMaxH3FlashInferProcessor backend must be 'fa2' or 'fa3', got {backend!r}")
        self.backend = backend

    def core(self, query, key, value, attention_mask=None, **extras):
        if extras:
            raise TypeError(f"{type(self).__name__} takes no extras, got {sorted(extras)}")
        if attention_mask is not None:
            raise ValueError(f"{type(self).__name__}: FlashInfer dense attention takes no attention_mask (H3 passes none)")
        out, choice = flashinfer_dense_attention(query, key, value, self.backend)
        self.record_choice(choice)
        return out


def enable_flashinfer_attention(pipe_or_transformer, backend: str = "auto") -> Dict[str, Dict[str, Any]]:
    """Install one :class:`MiniMaxH3FlashInferProcessor` per transformer block of a pipeline's transformer
    partition(s) or of one transformer (the token refiner keeps its processor).

    Checks first, with one clear error and nothing changed: flashinfer-python is importable, its kernels can be built
    (a CUDA compiler) or loaded (``flashinfer-jit-cache``), and every model is on a CUDA GPU of SM80+ (``"fa3"`` needs
    SM90). Q/K/V must be bf16 or fp16 at call time (checked per call). Returns per
    partition the block count, the resolved backend and the processor's ``describe_path`` line.
    """
    import_flashinfer()
    kernels = check_flashinfer_kernels()
    plans = []
    for name, model in _models(pipe_or_transformer, "enable_flashinfer_attention"):
        blocks = transformer_blocks(model, "enable_flashinfer_attention")
        tensors = itertools.chain(blocks[0].parameters(), blocks[0].buffers()) if len(blocks) else iter(())
        device = next(tensors, torch.empty(0)).device  # quantized layers keep their weights in buffers
        resolved = resolve_backend(backend, cuda_capability(device))
        plans.append((name, blocks, resolved))
    summary = {}
    for name, blocks, resolved in plans:
        processors = [MiniMaxH3FlashInferProcessor(resolved) for _ in blocks]
        for block, processor in zip(blocks, processors):
            block.attn.set_processor(processor)
        summary[name] = {"blocks": len(blocks), "backend": resolved, "kernels": kernels,
                         "path": processors[0].describe_path() if processors else "no blocks"}  # fmt: skip
    return summary
