"""The DiT's feed-forward over row chunks, so that its hidden activations fit a small GPU.

A MiniMax-H3 block's SwiGLU feed-forward widens each of its rows from 5,376 to 28,672 features and back: at the
released 768x1344 size (38,222 rows) the widened rows alone take 2.1 GiB in bf16, the largest activation of the
forward. The feed-forward acts on each row independently, so :func:`enable_feed_forward_chunking` runs it over
``rows`` rows at a time and writes each chunk's output into one output tensor: the widened activations shrink by
``total rows / rows``, for one more launch per chunk. The values are those of the unchunked call up to the GEMM's
own blocking: a GEMM over fewer rows may sum in another order (float32 rounding apart in the tests; the streamed
tiny pipeline's request was bitwise the unchunked one), as cuBLAS may pick another kernel for fewer rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from .._hooks import H3_FEED_FORWARD_CHUNKS_HOOK, H3Hook, h3_record, register_h3_hook, remove_h3_hook, transformers_of


@dataclass(frozen=True)
class FeedForwardChunking:
    """Rows of the packed sequence each feed-forward call takes at a time."""

    rows: int = 8192

    def __post_init__(self):
        if not isinstance(self.rows, int) or isinstance(self.rows, bool) or self.rows < 1:
            raise ValueError(f"FeedForwardChunking.rows={self.rows!r}: give a positive integer number of rows")


class FeedForwardChunksHook(H3Hook):
    """Runs the feed-forward over row chunks of its input (the second-to-last dimension)."""

    def new_forward(self, module, hidden_states, *args, **kwargs):
        rows = self.record.rows
        total = hidden_states.shape[-2]
        if total <= rows:
            return self.fn_ref.original_forward(hidden_states, *args, **kwargs)
        output: Optional[torch.Tensor] = None
        for start in range(0, total, rows):
            part = self.fn_ref.original_forward(hidden_states[..., start : start + rows, :], *args, **kwargs)
            if output is None:
                output = part.new_empty(*hidden_states.shape[:-1], part.shape[-1])
            output[..., start : start + rows, :] = part
            del part
        return output


def _feed_forwards(transformer: torch.nn.Module) -> List[torch.nn.Module]:
    blocks = getattr(transformer, "transformer_blocks", None)
    if blocks is None:
        raise TypeError(f"{type(transformer).__name__} has no transformer_blocks to chunk the feed-forward of")
    return [block.ff for block in blocks]


def enable_feed_forward_chunking(pipe_or_transformer, config: Optional[FeedForwardChunking] = None) -> None:
    """Run each DiT block's feed-forward over ``config.rows`` rows at a time (a pipeline's partitions, or one
    transformer). Enabling it again replaces the previous setting."""
    config = config or FeedForwardChunking()
    for transformer in transformers_of(pipe_or_transformer, "enable_feed_forward_chunking"):
        for ff in _feed_forwards(transformer):
            remove_h3_hook(ff, H3_FEED_FORWARD_CHUNKS_HOOK, recurse=False, root=transformer)
            register_h3_hook(ff, FeedForwardChunksHook(config), H3_FEED_FORWARD_CHUNKS_HOOK, root=transformer)


def disable_feed_forward_chunking(pipe_or_transformer) -> None:
    """Run each feed-forward over all its rows again."""
    for transformer in transformers_of(pipe_or_transformer, "disable_feed_forward_chunking"):
        for ff in _feed_forwards(transformer):
            remove_h3_hook(ff, H3_FEED_FORWARD_CHUNKS_HOOK, recurse=False, root=transformer)


def feed_forward_chunking_of(transformer: torch.nn.Module) -> Optional[FeedForwardChunking]:
    """The chunking the first block's feed-forward runs with (``None`` when off)."""
    blocks = getattr(transformer, "transformer_blocks", None)
    return h3_record(blocks[0].ff, H3_FEED_FORWARD_CHUNKS_HOOK) if blocks else None
