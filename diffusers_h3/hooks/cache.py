"""Diffusers' step-caching hooks on MiniMax-H3.

Diffusers 0.42.1 ships FirstBlockCache, MagCache and TaylorSeer, but its block registry does not know H3's
``MiniMaxH3TransformerBlock``, so ``transformer.enable_cache(FirstBlockCacheConfig(...))`` fails with "not
registered". An H3 block takes ``hidden_states`` first and returns the new hidden states as one tensor (the packed
sequence carries text, audio and video rows together, so there is no separate encoder stream): that is the metadata
registered here.

The hooks also need every denoiser call wrapped in ``transformer.cache_context(...)``; ``MiniMaxH3Pipeline`` does that
for each step. Whether a cache keeps quality can only be judged with trained weights.
"""

from __future__ import annotations

from typing import Optional, Sequence

from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock

CACHE_METHODS = ("first-block", "mag", "taylorseer")


def register_cache_blocks() -> None:
    """Make H3's transformer block known to diffusers' cache hooks (idempotent)."""
    TransformerBlockRegistry.register(
        model_class=MiniMaxH3TransformerBlock,
        metadata=TransformerBlockMetadata(return_hidden_states_index=0, return_encoder_hidden_states_index=None),
    )


def cache_config(
    method: str,
    num_inference_steps: Optional[int] = None,
    threshold: Optional[float] = None,
    mag_ratios: Optional[Sequence[float]] = None,
):
    """A diffusers cache config for ``method`` ("first-block", "mag" or "taylorseer") with diffusers' defaults.

    MagCache skips steps by magnitude ratios calibrated for the model. Without ``mag_ratios`` it runs in diffusers'
    calibration mode: every step is computed and the ratios are logged at the end, to be passed on later requests.
    """
    from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

    if method == "first-block":
        return FirstBlockCacheConfig(threshold=0.05 if threshold is None else threshold)
    if method == "mag":
        if num_inference_steps is None:
            raise ValueError("MagCache needs num_inference_steps: pass the number of steps the requests will use.")
        return MagCacheConfig(
            threshold=0.06 if threshold is None else threshold,
            num_inference_steps=num_inference_steps,
            mag_ratios=None if mag_ratios is None else list(mag_ratios),
            calibrate=mag_ratios is None,
        )
    if method == "taylorseer":
        if threshold is not None:
            raise ValueError("TaylorSeer caches on a fixed interval and takes no threshold; drop the threshold.")
        return TaylorSeerCacheConfig(cache_interval=5, disable_cache_before_step=3, max_order=1)
    raise ValueError(f"unknown cache method {method!r}; choose one of {', '.join(CACHE_METHODS)}.")
