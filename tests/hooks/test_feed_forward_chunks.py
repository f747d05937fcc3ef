"""The DiT's feed-forward over row chunks: the same outputs as the whole call, for chunk sizes that do and do not
divide the rows, and the setting reported, replaced and removed."""

import pytest
import torch

from diffusers_h3.hooks.feed_forward_chunks import (
    FeedForwardChunking,
    disable_feed_forward_chunking,
    enable_feed_forward_chunking,
    feed_forward_chunking_of,
)
from diffusers_h3.testing import tiny


def _forward(model):
    with torch.no_grad():
        return model(**tiny.tiny_transformer_inputs(seed=3, grid=(3, 2, 3)), return_dict=False)[0]


@pytest.mark.parametrize("rows", [1, 5, 7, 27, 10_000])
def test_chunked_feed_forward_gives_the_unchunked_outputs(rows):
    torch.manual_seed(0)
    model = tiny.tiny_transformer()
    expected = _forward(model)
    calls = []
    model.transformer_blocks[0].ff.net[2].register_forward_hook(lambda m, a, o: calls.append(a[0].shape[-2]))
    enable_feed_forward_chunking(model, FeedForwardChunking(rows=rows))
    assert feed_forward_chunking_of(model) == FeedForwardChunking(rows=rows)
    got = _forward(model)
    # a GEMM over fewer rows may block its sums differently: equal up to float32 rounding (bitwise when not split)
    assert torch.equal(got, expected) if rows >= 27 else torch.allclose(got, expected, rtol=1e-5, atol=1e-6)
    total = 5 + 4 + 18  # text, audio and video rows of the inputs
    assert calls == [min(rows, total - start) for start in range(0, total, rows)]  # no call sees more than `rows`


def test_enabling_again_replaces_and_disable_removes():
    model = tiny.tiny_transformer()
    enable_feed_forward_chunking(model, FeedForwardChunking(rows=3))
    enable_feed_forward_chunking(model, FeedForwardChunking(rows=4))
    assert feed_forward_chunking_of(model).rows == 4
    disable_feed_forward_chunking(model)
    assert feed_forward_chunking_of(model) is None


@pytest.mark.parametrize("rows", [0, -2, 2.5, True])
def test_a_bad_chunk_size_is_refused(rows):
    with pytest.raises(ValueError, match="FeedForwardChunking.rows"):
        FeedForwardChunking(rows=rows)
