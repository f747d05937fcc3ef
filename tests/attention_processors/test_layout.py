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


def test_compiled_code_reads_the_published_plan_without_recompiling_per_step():
    # torch.compile(fullgraph=True) code reads the published plan on every supported torch (dynamo traces
    # ContextVar.get only in recent releases), and guards only on what it reads: a new step's layout and a new CallPlan
    # object for each call do not recompile.
    import torch
    import torch._dynamo

    key = object()

    @torch.compile(fullgraph=True, backend="eager")
    def read(x):
        plan = current_call_plan()
        return x + plan.plan_for(key).text.count("o") + current_packed_layout().seq_len

    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            for step in range(3):
                layout = _layout().at_step(step, 3, (1.0 - step / 3, 1.0 - (step + 1) / 3))
                with use_call_plan(CallPlan(layout=layout, attention=((key, _Plan("two o")),))):
                    assert read(torch.zeros(())).item() == 2 + 40
    finally:
        torch._dynamo.reset()
    assert current_call_plan() is None


def test_compiled_code_in_each_thread_reads_its_own_plan():
    # Two threads inside their own transformer call at once: the compiled reader returns each thread's plan.
    import threading

    import torch
    import torch._dynamo

    key = object()

    @torch.compile(fullgraph=True, backend="eager")
    def read(x):
        return x + current_call_plan().plan_for(key).text.count("o")

    both_published = threading.Barrier(2)
    got = {}

    def call(text):
        with use_call_plan(CallPlan(layout=_layout(), attention=((key, _Plan(text)),))):
            both_published.wait(timeout=60)
            got[text] = read(torch.zeros(())).item()
            both_published.wait(timeout=60)  # neither leaves its call before the other has read
        got[text, "after"] = current_call_plan()

    torch._dynamo.reset()
    try:
        threads = [threading.Thread(target=call, args=(text,)) for text in ("o", "ooo")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        torch._dynamo.reset()
    assert got == {"o": 1, "ooo": 3, ("o", "after"): None, ("ooo", "after"): None}
