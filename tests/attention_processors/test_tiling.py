"""Layout -> tile plan: video cubes in (t, h, w) order with partial edges, segment-pure prefix chunks, any order."""

import itertools
import math

import pytest
import torch

from diffusers_h3.attention_processors.tiling import TilePlanCache, build_tile_plan
from diffusers_h3.layout import LayoutSegment, PackedLayout


def _ref2va_layout():
    # Reference video and audio interleaved, target video in the middle, text last: no order may be assumed.
    segs = [
        LayoutSegment("audio", "reference", 0, 70, channels=2),
        LayoutSegment("video", "reference", 70, 70 + 2 * 4 * 4, grid=(2, 4, 4)),
        LayoutSegment("audio", "target", 102, 200, channels=2),
        LayoutSegment("video", "target", 200, 200 + 5 * 6 * 7, grid=(5, 6, 7)),
        LayoutSegment("text", "prompt", 410, 433),
    ]
    return PackedLayout(tuple(segs), seq_len=433)


def _tiles(plan):
    slots = plan.slot_rows.view(-1, plan.block)
    return [slots[t, : int(plan.tile_counts[t])].tolist() for t in range(plan.num_tiles)]


def test_every_row_in_exactly_one_tile_and_row_tile_agrees():
    plan = build_tile_plan(_ref2va_layout())
    tiles = _tiles(plan)
    rows = sorted(itertools.chain(*tiles))
    assert rows == list(range(433))
    for t, members in enumerate(tiles):
        assert all(int(plan.row_tile[r]) == t for r in members)


def test_prefix_chunks_are_segment_pure_and_come_first():
    layout = _ref2va_layout()
    plan = build_tile_plan(layout)
    tiles = _tiles(plan)
    prefix_segments = [s for s in layout.segments if not (s.kind == "video" and s.role == "target")]
    expected = sum(math.ceil(s.length / 64) for s in prefix_segments)
    assert plan.num_prefix_tiles == expected == 2 + 1 + 2 + 1
    for members in tiles[: plan.num_prefix_tiles]:
        owners = {next(i for i, s in enumerate(layout.segments) if s.start <= r < s.stop) for r in members}
        assert len(owners) == 1
        assert members == list(range(members[0], members[0] + len(members)))
    # Reference video is a prefix (non-video) segment even though it is video.
    assert any(members[0] == 70 and len(members) == 32 for members in tiles[: plan.num_prefix_tiles])


def test_video_cubes_partial_edges_and_order():
    plan = build_tile_plan(_ref2va_layout(), tile=(4, 4, 4))
    t_, h_, w_ = 5, 6, 7
    assert plan.num_video_tiles == 2 * 2 * 2
    video_tiles = _tiles(plan)[plan.num_prefix_tiles:]
    cube_ids = []
    for members in video_tiles:
        coords = [((r - 200) // (h_ * w_), ((r - 200) // w_) % h_, (r - 200) % w_) for r in members]
        cubes = {(t // 4, h // 4, w // 4) for t, h, w in coords}
        assert len(cubes) == 1  # a tile is one cube
        cube = cubes.pop()
        cube_ids.append(cube)
        size = [min(4, dim - 4 * c) for dim, c in zip((t_, h_, w_), cube)]
        assert len(members) == math.prod(size)  # partial edge cubes
        assert members == sorted(members)  # (t, h, w) row-major inside the cube
    assert cube_ids == sorted(cube_ids)  # t-outer, then h, then w


def test_bad_tile_and_cache():
    with pytest.raises(ValueError, match="power of two"):
        build_tile_plan(_ref2va_layout(), tile=(3, 4, 4))
    cache = TilePlanCache()
    layout = _ref2va_layout()
    a = cache.get(layout, (4, 4, 4), "cpu")
    assert cache.get(layout.at_step(3, 10), (4, 4, 4), "cpu") is a  # the step does not change the geometry
    assert cache.get(layout, (2, 2, 4), "cpu") is not a
    assert torch.equal(a.tile_counts, build_tile_plan(layout).tile_counts)
