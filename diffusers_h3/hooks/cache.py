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
skipped, read from the hooks' own state right after each forward (what ran, not a re-derivation) by a stateful
:data:`~diffusers_h3._hooks.H3_CACHE_STATS_HOOK` on the transformer, whose :class:`CacheStats` record
:func:`start_cache_request` renews (``reset_state``) at the start of each request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch
from diffusers.hooks import HookRegistry
from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock

from .._hooks import H3_CACHE_STATS_HOOK, H3Hook, get_h3_hook, h3_record, register_h3_hook, remove_h3_hook


CACHE_METHODS = ("first-block", "mag", "taylorseer", "taylorseer-lite")
# TaylorSeer's lite form for H3: the blocks are skipped on predicted steps and both outputs are extrapolated. Diffusers'
# own `use_lite_mode` extrapolates `proj_out` only, and H3 also returns audio through `audio_proj_out`.
TAYLORSEER_LITE_OUTPUTS = ("^proj_out$", "^audio_proj_out$")
TAYLORSEER_LITE_SKIPPED = (r"^transformer_blocks\.\d+$",)


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
    """A diffusers cache config for ``method`` ("first-block", "mag", "taylorseer" or "taylorseer-lite") with
    diffusers' defaults. "taylorseer" extrapolates every block's attention output (its factors take memory in
    proportion to the request's rows: :func:`taylorseer_factor_bytes`); "taylorseer-lite" skips the blocks on
    predicted steps and extrapolates the two outputs (video and audio), on the same step schedule.

    ``num_inference_steps`` is the pipeline's argument (sigma grid points, the terminal 0 included), so the transformer
    runs ``num_inference_steps - 1`` times; MagCache counts those forwards. MagCache skips steps by magnitude ratios
    calibrated for the model (one per forward). Without ``mag_ratios`` it runs in diffusers' calibration mode: every
    step is computed and the ratios are logged at the end, to be passed on later requests.
    """
    from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

    if threshold is not None and not (isinstance(threshold, (int, float)) and math.isfinite(threshold) and threshold >= 0):
        raise ValueError(f"the cache threshold must be a finite number >= 0, got {threshold!r}: pass e.g. 0.05.")
    if method == "first-block":
        return FirstBlockCacheConfig(threshold=0.05 if threshold is None else threshold)
    if method == "mag":
        if num_inference_steps is None:
            raise ValueError("MagCache needs num_inference_steps: pass the number of steps the requests will use.")
        if num_inference_steps < 2:
            raise ValueError(
                f"MagCache needs num_inference_steps >= 2 (got {num_inference_steps}): pass the pipeline's."
            )
        return MagCacheConfig(
            threshold=0.06 if threshold is None else threshold,
            num_inference_steps=num_inference_steps - 1,
            mag_ratios=None if mag_ratios is None else list(mag_ratios),
            calibrate=mag_ratios is None,
        )
    if method in ("taylorseer", "taylorseer-lite"):
        if threshold is not None:
            raise ValueError("TaylorSeer caches on a fixed interval and takes no threshold; drop the threshold.")
        if method == "taylorseer-lite":
            return TaylorSeerCacheConfig(cache_interval=5, disable_cache_before_step=3, max_order=1,
                                         cache_identifiers=list(TAYLORSEER_LITE_OUTPUTS),
                                         skip_predict_identifiers=list(TAYLORSEER_LITE_SKIPPED))  # fmt: skip
        return TaylorSeerCacheConfig(cache_interval=5, disable_cache_before_step=3, max_order=1)
    raise ValueError(f"unknown cache method {method!r}; choose one of {', '.join(CACHE_METHODS)}.")


# ---------------------------------------------------------------------------------------------------------------------
# Per-request state and the skip counter


@dataclass
class CacheStats:
    """Transformer forwards of the current (or last) request and the steps at which the cache skipped computing."""

    forwards: int = 0
    skipped_steps: List[int] = field(default_factory=list)

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
    elif isinstance(config, TaylorSeerCacheConfig):  # the lite form: the video output is the hooked module
        kind, name = "taylorseer", _TAYLORSEER_CACHE_HOOK
        module = getattr(blocks[-1], "attn", None)
        if module is None or name not in getattr(getattr(module, "_diffusers_hook", None), "hooks", {}):
            module = getattr(transformer, "proj_out", None)
    else:
        return None, None
    registry = getattr(module, "_diffusers_hook", None)
    hook = None if registry is None else registry.hooks.get(name)
    if hook is None:
        return None, None
    return kind, hook.state_manager


class CacheStatsHook(H3Hook):
    """After each transformer forward, reads from diffusers' cache hooks whether the step was computed or skipped.
    ``reset_state`` starts a new request's record: :func:`start_cache_request` calls it before the first forward. Not
    marked stateful, because diffusers resets stateful hooks after each call (``maybe_free_model_hooks``) and the
    record must outlive the request for ``describe``."""

    def __init__(self) -> None:
        super().__init__(CacheStats())

    def post_forward(self, module, output):
        kind, state_manager = _tail_hook_state(module)
        if state_manager is None or state_manager._context is None:
            return output
        stats: CacheStats = self.record
        step = stats.forwards
        stats.forwards += 1
        state = state_manager.get_state()
        computed = state.should_compute if kind == "block" else state.last_update_step == state.current_step
        if not computed:
            stats.skipped_steps.append(step)
        return output

    def reset_state(self, module):
        self.record = CacheStats()
        return module


def cache_stats(transformer: torch.nn.Module) -> Optional[CacheStats]:
    """The skips of ``transformer``'s current (or last) request, or ``None`` when no cached request has run."""
    return h3_record(transformer, H3_CACHE_STATS_HOOK)


def start_cache_request(transformer: torch.nn.Module, num_forwards: int) -> None:
    """Called by the pipeline before a request's first transformer forward when a cache may be enabled.

    Resets every stateful cache hook (no residual or step counter leaks from an earlier request), checks that a
    MagCache config was built for this request's number of forwards, and restarts the skip counter.
    """
    if not getattr(transformer, "is_cache_enabled", False):
        remove_h3_hook(transformer, H3_CACHE_STATS_HOOK, recurse=False)  # a cache disabled since the last request
        return
    from diffusers.hooks import MagCacheConfig

    config = transformer._cache_config
    if getattr(config, "use_lite_mode", False):
        raise ValueError(
            "TaylorSeerCacheConfig(use_lite_mode=True) extrapolates proj_out only, but H3 also returns audio through "
            "audio_proj_out, which would be computed from skipped blocks: use cache_config('taylorseer-lite') "
            "(--cache taylorseer-lite), which extrapolates both."
        )
    if isinstance(config, MagCacheConfig) and config.num_inference_steps != num_forwards:
        raise ValueError(
            f"MagCache was configured for {config.num_inference_steps} transformer forwards but this request runs "
            f"{num_forwards} (num_inference_steps={num_forwards + 1}): build it with "
            f"cache_config('mag', num_inference_steps={num_forwards + 1}, ...)."
        )
    # What `CacheMixin._reset_stateful_cache` runs, through the public registry.
    HookRegistry.check_if_exists_or_initialize(transformer).reset_stateful_hooks(recurse=True)
    hook = get_h3_hook(transformer, H3_CACHE_STATS_HOOK)
    if hook is None:
        hook = register_h3_hook(transformer, CacheStatsHook(), H3_CACHE_STATS_HOOK)
    hook.reset_state(transformer)


def _output_features(module: torch.nn.Module) -> Optional[int]:
    """The last dimension of a hooked module's output: a linear layer's, or an attention's output projection's."""
    if isinstance(module, torch.nn.Linear):
        return module.out_features
    to_out = getattr(module, "to_out", None)
    first = to_out[0] if isinstance(to_out, (torch.nn.Sequential, torch.nn.ModuleList)) else to_out
    return first.out_features if isinstance(first, torch.nn.Linear) else None


def taylorseer_factor_bytes(transformer: torch.nn.Module, rows: int) -> Optional[int]:
    """The bytes diffusers' TaylorSeer hooks on ``transformer`` keep through a request of ``rows`` packed rows: for
    each module it caches, ``max_order + 1`` Taylor factors of its output ``(1, rows, features)`` in
    ``taylor_factors_dtype``; ``None`` without TaylorSeer or when a cached module's output size is unknown. They stay
    on the GPU for the whole request (on H3's released shape: 50 attention outputs, 2 factors each, 38,222 rows x
    5,376 in bf16, 38.3 GiB)."""
    import re

    from diffusers.hooks import TaylorSeerCacheConfig
    from diffusers.hooks.taylorseer_cache import _TAYLORSEER_CACHE_HOOK

    config = getattr(transformer, "_cache_config", None)
    if not isinstance(config, TaylorSeerCacheConfig):
        return None
    itemsize = torch.empty((), dtype=config.taylor_factors_dtype or torch.bfloat16).element_size()
    skipped = list(config.skip_predict_identifiers or [])  # "inactive" modules keep a shape, not a tensor
    total = 0
    for name, module in transformer.named_modules():
        registry = getattr(module, "_diffusers_hook", None)
        if registry is None or _TAYLORSEER_CACHE_HOOK not in registry.hooks:
            continue
        if (config.use_lite_mode and name != "proj_out") or any(re.fullmatch(p, name) for p in skipped):
            continue
        features = _output_features(module)
        if features is None:
            return None
        total += (config.max_order + 1) * rows * features * itemsize
    return total


class CacheMemoryError(RuntimeError):
    """A step cache would keep more on the GPU than the GPU has free for it (raised before the first forward)."""


def free_device_bytes(device: torch.device) -> Optional[int]:
    """What a CUDA ``device`` can still give this process: its free memory plus the allocator's reserved but unused
    memory; ``None`` for any other device."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def check_cache_memory(transformer: torch.nn.Module, rows: int, free_bytes: Optional[int]) -> Optional[int]:
    """Refuse a TaylorSeer request whose Taylor factors alone exceed ``free_bytes`` (what the device can still
    give: free memory plus the allocator's unused reserve; ``None``: not a GPU, nothing checked), before the first
    forward, in one line with the ways out. Returns the factors' bytes (``None`` without TaylorSeer)."""
    needed = taylorseer_factor_bytes(transformer, rows)
    if needed is None or free_bytes is None or needed <= free_bytes:
        return needed

    def size(n: int) -> str:
        return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"

    raise CacheMemoryError(
        f"TaylorSeer would keep {size(needed)} of Taylor factors on the GPU for this request "
        f"({transformer._cache_config.max_order + 1} per cached output of {rows:,} rows), more than the "
        f"{size(free_bytes)} it has free: use a shorter clip or a smaller canvas, the first-block cache, "
        "the 'taylorseer-lite' cache (it extrapolates only the outputs), or a GPU with more memory."
    )


def describe_cache(model: torch.nn.Module) -> Optional[Dict[str, Any]]:
    """The enabled cache config of ``model`` and the skips of its last request; None when no cache is enabled."""
    config = getattr(model, "_cache_config", None)
    if config is None:
        return None
    report: Dict[str, Any] = {"config": repr(config)}
    stats = cache_stats(model)
    report["last_request"] = stats.describe_path() if stats is not None else "no request run yet"
    return report
