"""The curve-form AdaLN of "pruned" MiniMax-H3 DiTs (ComfyUI's ~20 B files).

A released DiT computes each AdaLN modulation as ``W silu(e(t)) + b`` with ``e`` the time embedder (an MLP over a
sinusoidal embedding) and ``W`` a ``[6 * 3 * hidden, 2688]`` projection per block (plus the final layer's). The pruned
files replace that function of ``t`` by a low-rank curve: ``c(t)`` interpolated linearly between the rows of a table
``adaln_t_table`` ``[grid, rank]`` sampled at ``t = i / (grid - 1)``, and projections ``[.., rank]`` applied to
``c(t)`` directly (no SiLU): ``W_r c(t) + b``. These modules put that form into a ``MiniMaxH3Transformer3DModel``
(module instances replaced, diffusers' classes untouched), keeping the state-dict names of the released layout
(``adaln_proj.linear``, ``norm_out.linear``; the table as ``time_embedder.table``).
"""

from __future__ import annotations

import torch
from diffusers.models.modeling_utils import get_parameter_dtype
from diffusers.models.transformers.transformer_minimax_h3 import (
    MiniMaxH3AdaLayerNormModulation,
    MiniMaxH3AdaLayerNormOut,
)
from torch import nn


CURVE_TABLE_KEY = "time_embedder.table"


class RawTimesteps(nn.Module):
    """Stands in for ``time_proj``: the curve table reads the timesteps themselves (in [0, 1]), not a sinusoid."""

    def forward(self, timestep: torch.Tensor) -> torch.Tensor:
        return timestep.reshape(-1)


class AdaLNCurveTable(nn.Module):
    """Stands in for ``time_embedder``: ``c(t)`` = the table rows around ``t * (grid - 1)``, linearly interpolated
    (``t`` clamped to [0, 1]; the last cell includes ``t = 1``)."""

    def __init__(self, grid: int, rank: int):
        super().__init__()
        if grid < 2:
            raise ValueError(f"an AdaLN curve table needs at least 2 rows, got {grid}.")
        self.table = nn.Parameter(torch.zeros(grid, rank), requires_grad=False)

    def forward(self, timestep: torch.Tensor) -> torch.Tensor:
        table = self.table
        position = timestep.reshape(-1).to(table.dtype).clamp(0.0, 1.0) * (table.shape[0] - 1)
        lower = position.floor().long().clamp(max=table.shape[0] - 2)
        return torch.lerp(table[lower], table[lower + 1], (position - lower).unsqueeze(1))


class CurveAdaLNModulation(MiniMaxH3AdaLayerNormModulation):
    """A block's AdaLN projection of the curve coordinate (no SiLU: the curve is the activated embedding's image)."""

    def forward(self, temb: torch.Tensor):
        temb = self.linear(temb.to(get_parameter_dtype(self.linear)))
        return temb.view(-1, 6 * self.hidden_size).chunk(6, dim=-1)


class CurveAdaLNOut(MiniMaxH3AdaLayerNormOut):
    """The final norm with the curve-form projection (no SiLU)."""

    def forward(self, hidden_states: torch.Tensor, temb: torch.Tensor, timestep_indices: torch.Tensor) -> torch.Tensor:
        shift, scale = self.linear(temb.to(get_parameter_dtype(self.linear))).chunk(2, dim=-1)
        hidden_states = self.norm(hidden_states)
        return hidden_states * (1.0 + scale.index_select(0, timestep_indices)) + shift.index_select(
            0, timestep_indices
        )


def to_curve_form(model, grid: int, rank: int) -> None:
    """Replace ``model``'s time path and AdaLN modules by the curve form (``model`` built with
    ``time_embed_dim=rank``; its parameters may be on the meta device: the new modules are made on the same one)."""
    config = model.config
    device = model.proj_in.weight.device
    with torch.device(device):
        model.time_proj = RawTimesteps()
        model.time_embedder = AdaLNCurveTable(grid, rank)
        for block in model.transformer_blocks:
            block.adaln_proj = CurveAdaLNModulation(time_embed_dim=rank, hidden_size=config.hidden_size)
        model.norm_out = CurveAdaLNOut(hidden_size=config.hidden_size, time_embed_dim=rank, eps=config.final_norm_eps)


def is_curve_form(model) -> bool:
    return isinstance(getattr(model, "time_embedder", None), AdaLNCurveTable)
