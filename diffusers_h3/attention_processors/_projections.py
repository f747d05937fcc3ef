"""The parts of diffusers' `MiniMaxH3AttnProcessor` that our processors keep: projections, QK-norm, rotary, output.

Our processors replace only the attention core; sharing these keeps every one of them numerically identical to the
default processor outside that core.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from diffusers.models.transformers.transformer_minimax_h3 import _apply_rotary_emb


def project_qkv(
    attn, hidden_states: torch.Tensor, rotary_emb: Optional[Tuple[torch.Tensor, torch.Tensor]]
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K, V of a ``MiniMaxH3Attention`` as ``(batch, seq, heads, head_dim)``: projection (fused or not), per-head
    QK RMSNorm, rotary on Q and K (refiner calls pass ``rotary_emb=None``)."""
    if getattr(attn, "fused_projections", False):
        query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
    else:
        query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
    query = attn.norm_q(query.unflatten(-1, (attn.heads, -1)))
    key = attn.norm_k(key.unflatten(-1, (attn.heads, -1)))
    value = value.unflatten(-1, (attn.heads, -1))
    if rotary_emb is not None:
        query = _apply_rotary_emb(query, *rotary_emb)
        key = _apply_rotary_emb(key, *rotary_emb)
    return query, key, value


def project_output(attn, out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(batch, seq, heads, head_dim)`` attention output → ``to_out`` (linear + dropout) in ``dtype``."""
    out = out.flatten(2, 3).to(dtype)
    out = attn.to_out[0](out)
    return attn.to_out[1](out)
