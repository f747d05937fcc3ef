"""Diffusers' step-caching hooks on MiniMax-H3.

Diffusers 0.42.1 ships FirstBlockCache, MagCache and TaylorSeer, but its block registry does not know H3's
``MiniMaxH3TransformerBlock``, so ``transformer.enable_cache(FirstBlockCacheConfig(...))`` fails with "not
registered". An H3 block takes ``hidden_states`` first and returns the new hidden states as one tensor (the packed
sequence carries text, audio and video rows together, so there is no separate encoder stream): that is the metadata
registered here.

The hooks also need every denoiser call wrapped in ``transformer.cache_context(...)``; ``MiniMaxH3Pipeline`` does that
for each step, and calls :func:`start_cache_request` before the first one so that no cache state (cached residuals,
step counters) carries over from an earlier request, including the previous clip of the same batched call. Whether a
cache keeps quality can only be judged with trained weights.

:func:`describe_cache` reports the enabled config and how many transformer forwards of the last request the cache
skipped, read from the hooks' own state right after each forward (what ran, not a re-derivation).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
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

    ``num_inference_steps`` is the pipeline's argument (sigma grid points, the terminal 0 included), so the transformer
    runs ``num_inference_steps - 1`` times; MagCache counts those forwards. MagCache skips steps by magnitude ratios
    calibrated for the model (one per forward). Without ``mag_ratios`` it runs in diffusers' calibration mode: every
    step is computed and the ratios are logged at the end, to be passed on later requests.
    """
    from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

    if method == "first-block":
        return FirstBlockCacheConfig(threshold=0.05 if threshold is None else threshold)
    if method == "mag":
        if num_inference_steps is None:
            raise ValueError("MagCache needs num_inference_steps: pass the number of steps the requests will use.")
        if num_inference_steps < 2:
            raise ValueError(f"MagCache needs num_inference_steps >= 2 (got {num_inference_steps}): pass the pipeline's.")
        return MagCacheConfig(
            threshold=0.06 if threshold is None else threshold,
            num_inference_steps=num_inference_steps - 1,
            mag_ratios=None if mag_ratios is None else list(mag_ratios),
            calibrate=mag_ratios is None,
        )
    if method == "taylorseer":
        if threshold is not None:
            raise ValueError("TaylorSeer caches on a fixed interval and takes no threshold; drop the threshold.")
        return TaylorSeerCacheConfig(cache_interval=5, disable_cache_before_step=3, max_order=1)
    raise ValueError(f"unknown cache method {method!r}; choose one of {', '.join(CACHE_METHODS)}.")


# ---------------------------------------------------------------------------------------------------------------------
# Per-request state and the skip counter


class CacheStats:
    """Transformer forwards of the current (or last) request and the steps at which the cache skipped computing."""

    def __init__(self) -> None:
        self.forwards = 0
        self.skipped_steps: List[int] = []

    def describe_path(self) -> str:
        if self.forwards == 0:
            return "no request run yet"
        steps = ", ".join(str(step) for step in self.skipped_steps) or "none"
        return f"skipped {len(self.skipped_steps)} of {self.forwards} steps (steps {steps})"


def _tail_hook_state(transformer: torch.nn.Module):
    """The cache kind and the hook state from which it can be read whether the current forward was computed."""
    from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig
    from diffusers.hooks.first_block_cache import _FBC_BLOCK_HOOK
    from diffusers.hooks.mag_cache import _MAG_CACHE_BLOCK_HOOK
    from diffusers.hooks.taylorseer_cache import _TAYLORSEER_CACHE_HOOK

    config = getattr(transformer, "_cache_config", None)
    blocks = getattr(transformer, "transformer_blocks", None)
    if config is None or not blocks:
        return None, None
    # The last block is computed only on a step the cache did not skip (TaylorSeer: its attention is the hooked module).
    if isinstance(config, (FirstBlockCacheConfig, MagCacheConfig)):
        kind, module = "block", blocks[-1]
        name = _FBC_BLOCK_HOOK if isinstance(config, FirstBlockCacheConfig) else _MAG_CACHE_BLOCK_HOOK
    elif isinstance(config, TaylorSeerCacheConfig):
        kind, module, name = "taylorseer", getattr(blocks[-1], "attn", None), _TAYLORSEER_CACHE_HOOK
    else:
        return None, None
    registry = getattr(module, "_diffusers_hook", None)
    hook = None if registry is None else registry.hooks.get(name)
    if hook is None:
        return None, None
    return kind, hook.state_manager


def _count_forward(transformer, args, output) -> None:
    stats: Optional[CacheStats] = getattr(transformer, "_h3_cache_stats", None)
    if stats is None:
        return
    kind, state_manager = _tail_hook_state(transformer)
    if state_manager is None or state_manager._context is None:
        return
    step = stats.forwards
    stats.forwards += 1
    state = state_manager.get_state()
    computed = state.should_compute if kind == "block" else state.last_update_step == state.current_step
    if not computed:
        stats.skipped_steps.append(step)


def start_cache_request(transformer: torch.nn.Module, num_forwards: int) -> None:
    """Called by the pipeline before a request's first transformer forward when a cache may be enabled.

    Resets every stateful cache hook (no residual or step counter leaks from an earlier request), checks that a
    MagCache config was built for this request's number of forwards, and restarts the skip counter.
    """
    if not getattr(transformer, "is_cache_enabled", False):
        return
    from diffusers.hooks import MagCacheConfig

    config = transformer._cache_config
    if isinstance(config, MagCacheConfig) and config.num_inference_steps != num_forwards:
        raise ValueError(
            f"MagCache was configured for {config.num_inference_steps} transformer forwards but this request runs "
            f"{num_forwards} (num_inference_steps={num_forwards + 1}): build it with "
            f"cache_config('mag', num_inference_steps={num_forwards + 1}, ...)."
        )
    transformer._reset_stateful_cache()
    transformer._h3_cache_stats = CacheStats()
    if not getattr(transformer, "_h3_cache_counter_installed", False):
        transformer.register_forward_hook(_count_forward)
        transformer._h3_cache_counter_installed = True


def describe_cache(model: torch.nn.Module) -> Optional[Dict[str, Any]]:
    """The enabled cache config of ``model`` and the skips of its last request; None when no cache is enabled."""
    config = getattr(model, "_cache_config", None)
    if config is None:
        return None
    report: Dict[str, Any] = {"config": repr(config)}
    stats = getattr(model, "_h3_cache_stats", None)
    report["last_request"] = stats.describe_path() if stats is not None else "no request run yet"
    return report
