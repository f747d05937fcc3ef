"""PackedLayout / LayoutSegment: validation of the published packed-sequence layout and its side channel."""

import pytest

from diffusers_h3.layout import (
    CallPlan,
    LayoutSegment,
    PackedLayout,
    current_call_plan,
    current_packed_layout,
    require_packed_layout,
    use_call_plan,
    use_packed_layout,
)


def _layout(**kwargs):
    segs = (
        LayoutSegment("video", "target", 10, 10 + 2 * 3 * 4, grid=(2, 3, 4)),
        LayoutSegment("text", "prompt", 0, 10),
        LayoutSegment("audio", "target", 34, 40, channels=2),
    )
    return PackedLayout(segs, seq_len=40, **kwargs)


def test_segments_are_sorted_and_selectable():
    layout = _layout()
    assert [s.kind for s in layout.segments] == ["text", "video", "audio"]
    assert layout.select(kind="video")[0].grid == (2, 3, 4) and layout.select(role="prompt")[0].length == 10
    assert layout.at_step(3, 10).step_index == 3 and layout.step_index is None
    assert "target:video[10:34] grid=(2, 3, 4)" in layout.describe() and "channels=2" in layout.describe()


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: LayoutSegment("image", "target", 0, 4), "segment kind"),
        (lambda: LayoutSegment("text", "negative", 0, 4), "segment role"),
        (lambda: LayoutSegment("text", "prompt", 4, 4), "start < stop"),
        (lambda: LayoutSegment("video", "target", 0, 8), "grid=\\(T, H, W\\)"),
        (lambda: LayoutSegment("video", "target", 0, 8, grid=(1, 2, 3)), "has 6 tokens"),
        (lambda: LayoutSegment("audio", "target", 0, 8, grid=(1, 2, 4)), "only video segments"),
        (lambda: PackedLayout((LayoutSegment("text", "prompt", 1, 4),), seq_len=4), "expected a segment at row 0"),
        (lambda: PackedLayout((LayoutSegment("text", "prompt", 0, 4),), seq_len=5), "seq_len is 5"),
    ],
)
def test_bad_layouts_fail_with_one_clear_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_side_channel_publishes_for_one_call_only():
    assert current_packed_layout() is None
    with pytest.raises(RuntimeError, match="use_packed_layout"):
        require_packed_layout("test")
    layout = _layout()
    with use_packed_layout(layout):
        assert require_packed_layout("test", 40) is layout
        with pytest.raises(RuntimeError, match="40"):
            require_packed_layout("test", 39)
    assert current_packed_layout() is None


class _Plan:
    def __init__(self, text):
        self.text = text

    def describe(self):
        return self.text


def test_a_call_plan_is_published_for_one_call_and_found_by_its_key():
    key, other = object(), object()
    layout = _layout(step_index=1, num_steps=2)
    first = _Plan("first")
    with use_packed_layout(layout):
        published = current_call_plan()
        assert published.layout is layout and published.plan_for(key) is None  # the layout alone, no plans
        with use_call_plan(CallPlan(layout=layout, attention=((key, first),))) as call:  # what the hook publishes
            assert current_call_plan() is call and require_packed_layout("test", 40) is layout
            assert call.plan_for(key) is first and call.plan_for(other) is None
        assert current_call_plan() is published
    assert call.describe() == {"layout": layout.describe(), "attention": ["first"]}
    assert current_call_plan() is None and CallPlan().describe()["layout"] == "none published"
