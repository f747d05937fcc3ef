"""VSA with trained gates (``to_gate_compress``): the whole attention output against a plain-torch reference written
from the definition, on a layout with several segments (text, target audio, keyframe video, target video) and
partial tiles, with gates that differ across rows and heads. Each row must receive the coarse output of its own tile.
"""

import math
import os

import torch


if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from diffusers import MiniMaxH3Transformer3DModel  # noqa: E402

from diffusers_h3.attention_processors import vsa as vsa_module  # noqa: E402
from diffusers_h3.layout import LayoutSegment, PackedLayout, use_packed_layout  # noqa: E402
from diffusers_h3.testing.tiny import TINY_TRANSFORMER_CONFIG  # noqa: E402


TILE = (2, 2, 4)  # 16 rows per tile
GRID = (3, 5, 6)  # target video: partial tiles on every axis (t: 2+1, h: 2+2+1, w: 4+2)
KEYFRAME = (1, 3, 3)  # keyframe video: a prefix segment (chunked, not cubed)
SEGMENTS = [("text", "prompt", 11, None), ("video", "keyframe", 9, KEYFRAME), ("audio", "target", 2 * 13, None),
            ("video", "target", math.prod(GRID), GRID)]
SPARSITY = 0.5


def _layout():
    segs, row = [], 0
    for kind, role, n, grid in SEGMENTS:
        segs.append(LayoutSegment(kind, role, row, row + n, grid=grid, channels=2 if kind == "audio" else 1))
        row += n
    return PackedLayout(tuple(segs), seq_len=row)


def _groups(layout):
    """(is_target_video, rows) per tile, found from coordinates and the definition (independent of tiling.py)."""
    block = math.prod(TILE)
    prefix, video = [], []
    for seg in layout.segments:
        if seg.kind == "video" and seg.role == "target":
            t_, h_, w_ = seg.grid
            cubes = {}
            for r in range(seg.start, seg.stop):
                i = r - seg.start
                t, h, w = i // (h_ * w_), (i // w_) % h_, i % w_
                cubes.setdefault((t // TILE[0], h // TILE[1], w // TILE[2]), []).append(r)
            video += [(True, cubes[c]) for c in sorted(cubes)]
        else:
            prefix += [(False, list(range(a, min(a + block, seg.stop)))) for a in range(seg.start, seg.stop, block)]
    return prefix + video


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _reference(attn, x, layout, coarse_tile_of_row=None):
    """Gated VSA from its definition, in float64: fine = per-tile sparse attention over every prefix tile plus the
    top-k video tiles by pooled score; coarse[tile] = softmax(q̄ k̄ᵀ / sqrt(d)) v̄ over all tiles; each row adds
    ``gate(x) * coarse[its tile]``; then the output projection. ``coarse_tile_of_row`` overrides which tile's coarse
    output a row takes (to show that a wrong pairing is detectable)."""
    heads, d = attn.heads, attn.head_dim
    xd = x[0].double()
    q = _rms((xd @ attn.to_q.weight.double().T).unflatten(-1, (heads, d)), attn.norm_q.weight.double(), attn.norm_q.eps)
    k = _rms((xd @ attn.to_k.weight.double().T).unflatten(-1, (heads, d)), attn.norm_k.weight.double(), attn.norm_k.eps)
    v = (xd @ attn.to_v.weight.double().T).unflatten(-1, (heads, d))
    gate = attn.to_gate_compress
    g = (xd @ gate.weight.double().T + (gate.bias.double() if gate.bias is not None else 0)).unflatten(-1, (heads, d))
    groups = _groups(layout)
    n_tiles = len(groups)
    video = [i for i, (is_v, _) in enumerate(groups) if is_v]
    prefix = [i for i, (is_v, _) in enumerate(groups) if not is_v]
    keep = min(max(math.ceil(round((1 - SPARSITY) * len(video), 6)), 1), len(video))
    tile_of_row = torch.empty(layout.seq_len, dtype=torch.long)
    for i, (_, rows) in enumerate(groups):
        tile_of_row[rows] = i
    if coarse_tile_of_row is None:
        coarse_tile_of_row = tile_of_row
    out = torch.zeros(layout.seq_len, heads, d, dtype=torch.float64)
    for head in range(heads):
        qp = torch.stack([q[rows, head].mean(0) for _, rows in groups])
        kp = torch.stack([k[rows, head].mean(0) for _, rows in groups])
        vp = torch.stack([v[rows, head].mean(0) for _, rows in groups])
        scores = qp @ kp.T / math.sqrt(d)
        coarse = torch.softmax(scores, -1) @ vp  # [n_tiles, d]
        assert coarse.shape[0] == n_tiles
        for i, (is_v, rows) in enumerate(groups):
            if is_v:
                vids = torch.tensor(video)
                chosen = prefix + vids[scores[i, vids].topk(keep).indices].tolist()
            else:
                chosen = list(range(n_tiles))
            cols = sorted(r for j in chosen for r in groups[j][1])
            att = torch.softmax(q[rows, head] @ k[cols, head].T / math.sqrt(d), -1)
            out[rows, head] = att @ v[cols, head]
        out[:, head] += g[:, head] * coarse[coarse_tile_of_row]
    return (out.flatten(1) @ attn.to_out[0].weight.double().T)[None], tile_of_row


@pytest.fixture(scope="module")
def gated_attention():
    torch.manual_seed(0)
    model = MiniMaxH3Transformer3DModel(**TINY_TRANSFORMER_CONFIG).eval()
    heads, d, hidden = model.transformer_blocks[0].attn.heads, 32, TINY_TRANSFORMER_CONFIG["hidden_size"]
    g = torch.Generator().manual_seed(1)
    state = {
        "transformer_blocks.0.attn.to_gate_compress.weight": torch.randn(heads * d, hidden, generator=g),
        "transformer_blocks.0.attn.to_gate_compress.bias": torch.randn(heads * d, generator=g),
    }
    assert vsa_module.add_gate_compress(model, state) == (0,)
    vsa_module.enable_vsa(model, sparsity=SPARSITY, tile=TILE, backend="torch")
    assert vsa_module.vsa_state(model)["gated_blocks"] == 1
    attn = model.transformer_blocks[0].attn
    with torch.no_grad():
        attn.norm_q.weight.copy_(torch.rand(d, generator=g) * 4 + 1)  # peaky tile scores: coarse rows differ
        attn.norm_k.weight.copy_(torch.rand(d, generator=g) * 2 + 0.5)
    return attn


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gated_vsa_output_matches_definition(gated_attention, backend):
    attn = gated_attention
    attn.processor.backend = backend
    layout = _layout()
    x = torch.randn(1, layout.seq_len, TINY_TRANSFORMER_CONFIG["hidden_size"], generator=torch.Generator().manual_seed(2))
    identity_rotary = (torch.ones(layout.seq_len, 2), torch.zeros(layout.seq_len, 2))
    with torch.no_grad(), use_packed_layout(layout):
        out = attn(x, identity_rotary, None)
    expected, tile_of_row = _reference(attn, x, layout)
    err = ((out.double() - expected).norm() / expected.norm()).item()
    assert err < 1e-4, err

    # The test can tell a wrong pairing apart: rows taking the coarse output of the next tile, or of the tile at the
    # same position in a reversed order, are far outside the bound.
    n_tiles = int(tile_of_row.max()) + 1
    shifted, _ = _reference(attn, x, layout, (tile_of_row + 1) % n_tiles)
    reversed_, _ = _reference(attn, x, layout, n_tiles - 1 - tile_of_row)
    for wrong in (shifted, reversed_):
        assert ((wrong - expected).norm() / expected.norm()).item() > 100 * max(err, 1e-6)
    # And the gate matters at all (pure sparse is far from the gated output).
    attn_gate = attn.to_gate_compress
    del attn.to_gate_compress
    try:
        with torch.no_grad(), use_packed_layout(layout):
            pure = attn(x, identity_rotary, None)
    finally:
        attn.to_gate_compress = attn_gate
    assert ((pure.double() - expected).norm() / expected.norm()).item() > 0.05


def test_gates_vary_across_rows_and_heads(gated_attention):
    attn = gated_attention
    x = torch.randn(1, 20, TINY_TRANSFORMER_CONFIG["hidden_size"])
    g = attn.to_gate_compress(x).unflatten(-1, (attn.heads, -1))
    assert g.std(dim=1).min() > 0.1 and (g[:, :, 0] - g[:, :, 1]).abs().mean() > 0.1
