"""Traced (not measured) activation peak of the DiT forward when Q/K/V are projected, normed, rotated and attended one
group of heads at a time (row slices of a bf16 DiT's weights), and when only the rotary embedding runs over row
chunks: the next memory levers after VSA head groups and feed-forward chunking. The numbers are in
docs/experiments/README.md.

    python docs/experiments/grouped_projections_trace_probe.py
"""

import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor, _apply_rotary_emb


ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
spec = importlib.util.spec_from_file_location("activation_trace", ROOT / "benchmarks" / "activation_trace.py")
trace = importlib.util.module_from_spec(spec)
spec.loader.exec_module(trace)

import diffusers_h3.attention_processors._projections as projections  # noqa: E402


ROWS, CHUNK, GROUPS = (40_000, 80_000, 120_000), 8192, 8


class GroupedProjections(MiniMaxH3AttnProcessor):
    """Q/K/V of one group of heads at a time, attended (a flash kernel's output) into one output tensor."""

    def __call__(self, attn, hidden_states, rotary_emb=None, attention_mask=None):
        if rotary_emb is None:
            return super().__call__(attn, hidden_states, rotary_emb, attention_mask)
        batch, seq, _ = hidden_states.shape
        heads = attn.heads
        dim = attn.to_q.out_features // heads
        out = hidden_states.new_empty(batch, seq, heads, dim)
        for group in range(GROUPS):
            first, stop = heads * group // GROUPS, heads * (group + 1) // GROUPS
            rows = slice(first * dim, stop * dim)
            query = F.linear(hidden_states, attn.to_q.weight[rows]).unflatten(-1, (stop - first, dim))
            key = F.linear(hidden_states, attn.to_k.weight[rows]).unflatten(-1, (stop - first, dim))
            value = F.linear(hidden_states, attn.to_v.weight[rows]).unflatten(-1, (stop - first, dim))
            query = _apply_rotary_emb(attn.norm_q(query), *rotary_emb)
            key = _apply_rotary_emb(attn.norm_k(key), *rotary_emb)
            out[:, :, first:stop] = torch.empty_like(query)
            del query, key, value
        return attn.to_out[0](out.flatten(2, 3))


def rotary_over_row_chunks(x, cos, sin, rows=4096):
    out = torch.empty_like(x)
    for start in range(0, x.shape[1], rows):
        out[:, start : start + rows] = _apply_rotary_emb(x[:, start : start + rows], cos[start : start + rows],
                                                         sin[start : start + rows])  # fmt: skip
    return out


def peaks(label):
    model = trace.build_meta_transformer(ffn_chunk_rows=CHUNK)
    found = []
    for rows in ROWS:
        counter = trace.trace_forward_peak(model, trace.forward_inputs(rows))
        found.append(f"{rows // 1000}k {counter.peak / 2**30:.2f} GiB ({counter.at_peak.split(' <- ')[1]})")
    print(f"{label}: " + ", ".join(found))


if __name__ == "__main__":
    peaks("package projections")
    projections._apply_rotary_emb = rotary_over_row_chunks
    peaks("rotary over row chunks")
    projections._apply_rotary_emb = _apply_rotary_emb
    trace._flash_like_processor = GroupedProjections
    peaks(f"{GROUPS} groups of heads")
