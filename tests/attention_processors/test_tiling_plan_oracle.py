"""Tile plans checked against plans written out by hand: grids whose axes divide the tile exactly, grids that leave
partial edge tiles, and mixed grids (the real 768x1344 latent grid has 24 rows, which 4 divides, and 42 columns,
which it does not). Counts, edge sizes, tile membership, top-k counts and the tiles the selection keeps."""

import math
import os

import torch


if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from diffusers_h3.attention_processors.tiling import build_tile_plan  # noqa: E402
from diffusers_h3.kernels.attention.vsa_select import select_tiles, topk_for_sparsity  # noqa: E402
from diffusers_h3.layout import LayoutSegment, PackedLayout  # noqa: E402


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _layout(grid, text=23, audio=130, keyframe=(1, 4, 4)):
    """text | keyframe video | target audio | target video (the t2va / fl2va order)."""
    segs, row = [], 0
    segs.append(LayoutSegment("text", "prompt", row, row + text))
    row += text
    if keyframe is not None:
        n = math.prod(keyframe)
        segs.append(LayoutSegment("video", "keyframe", row, row + n, grid=keyframe))
        row += n
    segs.append(LayoutSegment("audio", "target", row, row + audio, channels=2))
    row += audio
    n = math.prod(grid)
    segs.append(LayoutSegment("video", "target", row, row + n, grid=grid))
    return PackedLayout(tuple(segs), seq_len=row + n), row


def _expected_video_tiles(start, grid, tile):
    """Cubes visited t-outer, then h, then w; inside a cube rows in (t, h, w) row-major order. Written with plain
    loops over cube origins (no ceil / reshape tricks) so that it shares nothing with tiling.py."""
    t_, h_, w_ = grid
    tt, th, tw = tile
    tiles = []
    for t0 in range(0, t_, tt):
        for h0 in range(0, h_, th):
            for w0 in range(0, w_, tw):
                tiles.append([
                    start + t * h_ * w_ + h * w_ + w
                    for t in range(t0, min(t0 + tt, t_))
                    for h in range(h0, min(h0 + th, h_))
                    for w in range(w0, min(w0 + tw, w_))
                ])
    return tiles


def _plan_tiles(plan):
    slots = plan.slot_rows.view(-1, plan.block).cpu()
    counts = plan.tile_counts.cpu()
    return [slots[t, : int(counts[t])].tolist() for t in range(plan.num_tiles)]


# (grid, tile, tiles per axis, edge (last-tile) size per axis): tiles per axis and edges written by hand.
CASES = [
    ((8, 4, 12), (4, 4, 4), (2, 1, 3), (4, 4, 4)),  # every axis divides: no partial tile at all
    ((5, 8, 6), (4, 4, 4), (2, 2, 2), (1, 4, 2)),  # mixed: h divides, t and w do not
    ((4, 7, 8), (4, 4, 4), (1, 2, 2), (4, 3, 4)),  # mixed: t and w divide, h does not
    ((3, 24, 42), (4, 4, 4), (1, 6, 11), (3, 4, 2)),  # the 768x1344 grid's rows (24) and columns (42), 3 frames
    ((6, 8, 8), (2, 4, 4), (3, 2, 2), (2, 4, 4)),  # non-cubic tile, all divisible
    ((5, 5, 5), (4, 4, 4), (2, 2, 2), (1, 1, 1)),  # nothing divides
]


@pytest.mark.parametrize("grid, tile, per_axis, edges", CASES)
def test_tile_plan_matches_hand_plan(grid, tile, per_axis, edges):
    layout, video_start = _layout(grid)
    plan = build_tile_plan(layout, tile=tile, device=DEVICE)
    block = math.prod(tile)
    assert plan.block == block

    # Prefix: text 23 rows -> 1 chunk; keyframe 16 rows -> 1 chunk (a keyframe is not a target cube); audio 130 rows
    # -> ceil(130 / block) chunks; all before the video tiles.
    audio_chunks = -(-130 // block)
    assert plan.num_prefix_tiles == 1 + 1 + audio_chunks
    assert plan.num_video_tiles == math.prod(per_axis)
    assert plan.num_tiles == plan.num_prefix_tiles + plan.num_video_tiles
    assert plan.padded_rows == plan.num_tiles * block

    tiles = _plan_tiles(plan)
    expected_prefix = [list(range(0, 23)), list(range(23, 39))]
    expected_prefix += [list(range(a, min(a + block, 169))) for a in range(39, 169, block)]
    assert tiles[: plan.num_prefix_tiles] == expected_prefix
    expected_video = _expected_video_tiles(video_start, grid, tile)
    assert len(expected_video) == math.prod(per_axis)
    assert tiles[plan.num_prefix_tiles:] == expected_video

    # Counts per tile from the hand-written edge sizes: full tiles have prod(tile) rows, edge tiles the edge size.
    counts = plan.tile_counts.cpu().tolist()
    expected_counts = []
    for ct in range(per_axis[0]):
        for ch in range(per_axis[1]):
            for cw in range(per_axis[2]):
                size = [e if c == n - 1 else full for c, n, e, full in zip((ct, ch, cw), per_axis, edges, tile)]
                expected_counts.append(math.prod(size))
    assert counts[plan.num_prefix_tiles:] == expected_counts
    assert all(1 <= c <= block for c in counts)  # no empty tile (an off-by-one tile count on a divisible axis)
    assert sum(counts) == layout.seq_len

    # row_tile agrees with membership; pad slots point at the tile's first row; valid_slots marks the counts.
    row_tile = plan.row_tile.cpu()
    for t, members in enumerate(tiles):
        assert (row_tile[members] == t).all()
    slots = plan.slot_rows.view(-1, block).cpu()
    for t, members in enumerate(tiles):
        assert (slots[t, len(members):] == members[0]).all()
    valid = plan.valid_slots.view(-1, block).cpu()
    assert valid.sum(1).tolist() == counts and valid[:, 0].all()


@pytest.mark.parametrize(
    "sparsity, n_video, topk",
    [
        (0.8, 6, 2),  # ceil(1.2)
        (0.8, 8, 2),  # ceil(1.6)
        (0.8, 10, 2),  # exactly 2 (float 0.19999... * 10 must not become 1 or 3)
        (0.7, 10, 3),  # exactly 3 (0.30000000000000004 * 10 must not become 4)
        (0.75, 8, 2),  # exactly 2
        (0.8, 66, 14),  # ceil(13.2): the 3x24x42 grid
        (0.5, 6, 3),
        (0.9, 10, 1),
        (0.99, 6, 1),  # at least one tile
        (0.0, 6, 6),
        (0.8, 0, 0),  # no video tiles
        (0.8, 1, 1),
    ],
)
def test_topk_for_sparsity_hand_values(sparsity, n_video, topk):
    assert topk_for_sparsity(sparsity, n_video) == topk


@pytest.mark.parametrize("grid, tile, per_axis, edges", CASES[:4])
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton_interpreter)])
def test_selection_keeps_prefix_plus_topk_highest_video_tiles(grid, tile, per_axis, edges, backend):
    """Given the plan's tile counts, every video query tile keeps all prefix tiles and exactly its top-k video key
    tiles (by score; distinct scores so there are no ties); prefix query tiles keep everything."""
    layout, _ = _layout(grid)
    plan = build_tile_plan(layout, tile=tile, device=DEVICE)
    n, p = plan.num_tiles, plan.num_prefix_tiles
    topk = topk_for_sparsity(0.8, plan.num_video_tiles)
    assert topk == min(max(math.ceil(0.2 * math.prod(per_axis) - 1e-9), 1), math.prod(per_axis))
    g = torch.Generator().manual_seed(0)
    scores = torch.randperm(2 * n * n, generator=g)[: 2 * n * n].view(1, 2, n, n).float().to(DEVICE)
    index, num = select_tiles(scores, p, topk, backend=backend)
    index, num, scores = index.cpu(), num.cpu(), scores.cpu()
    for h in range(2):
        for q in range(n):
            k = int(num[0, h, q])
            chosen = sorted(index[0, h, q, :k].tolist())
            if q < p:
                assert chosen == list(range(n))
            else:
                row = scores[0, h, q].tolist()
                best = sorted(range(p, n), key=lambda j: -row[j])[:topk]
                assert chosen == sorted(list(range(p)) + best)
