"""One hook system: every behaviour diffusers_h3 attaches to a model is a diffusers ``ModelHook`` in that module's
``diffusers.hooks.HookRegistry``, under one of the names below, holding a small dataclass record of what was enabled.

* enable: ``register_h3_hook(module, hook, NAME)`` (the registry refuses a second hook of the same name);
* disable: ``remove_h3_hook(module, NAME)`` (also from every submodule: per-layer hooks share their behaviour's name);
* report: ``h3_record(module, NAME)`` / ``h3_records(module)`` read the records back (``diffusers_h3.describe``);
* per-request state (the step-cache counter, the refiner's cached output) lives in hooks marked stateful, so that
  ``HookRegistry.reset_stateful_hooks`` — what ``transformer._reset_stateful_cache()`` runs before each request —
  resets it through ``reset_state``.

No torch ``register_forward_(pre_)hook`` handles, no ``forward`` swaps and no ``_h3_*`` attributes stamped on modules:
``tests/hooks/test_registry.py`` enforces it. This module is the bottom layer (no H3 imports), so that hooks,
parallel, loaders, pipelines and the attention processors can all use it; it also holds the partition lookup ("which
transformer(s) does this pipeline hold") that all of them share.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from diffusers.hooks import HookRegistry, ModelHook


# -- hook names (one per behaviour; per-layer hooks of a behaviour share its name in their own modules' registries) --
H3_FAST_VAE_DECODE_HOOK = "diffusers_h3.fast_vae_decode"  # on the video VAE: batched tile decode
H3_CACHE_STATS_HOOK = "diffusers_h3.cache_stats"  # on the transformer: which steps diffusers' step cache skipped
H3_REFINE_TEXT_ONCE_HOOK = "diffusers_h3.refine_text_once"  # on transformer.token_refiner, during a request
H3_V100_MODE_HOOK = "diffusers_h3.v100_mode"  # transformer (record, inf/NaN check), its linears and watched modules
H3_CONTEXT_PARALLEL_HOOK = "diffusers_h3.context_parallel"  # on the transformer: CP record, processor config sync
H3_TENSOR_PARALLEL_HOOK = "diffusers_h3.tensor_parallel"  # on the transformer: TP record, the TP-and-CP refusal
H3_TENSOR_PARALLEL_REDUCE_HOOK = "diffusers_h3.tensor_parallel_reduce"  # on each attention / FFN module
H3_CHECKPOINT_STREAM_HOOK = "diffusers_h3.checkpoint_stream"  # on each group streamed from its checkpoint files
H3_CHECKPOINT_STREAM_MODEL_HOOK = "diffusers_h3.checkpoint_stream_model"  # on a streamed model: record and reader
H3_FEED_FORWARD_CHUNKS_HOOK = "diffusers_h3.feed_forward_chunks"  # on each DiT block's feed-forward: rows in chunks
H3_STREAM_FROM_DISK_HOOK = "diffusers_h3.stream_from_disk"  # on a text encoder streamed from disk: where from
H3_CALL_PLAN_HOOK = "diffusers_h3.call_plan"  # on the transformer: plans every call of its attention processors
H3_SINGLE_FILE_HOOK = "diffusers_h3.single_file"  # on a transformer loaded from one file: which file and format
H3_PDD_HEAD_BANK_HOOK = "diffusers_h3.pdd_head_bank"  # on proj_out / audio_proj_out holding a PDD head bank
H3_LIGHT_VAE_HOOK = "diffusers_h3.light_vae"  # on a video VAE given FastH3's NVFP4 decoder: what was loaded
H3_VSA_HEAD_GROUPS_HOOK = "diffusers_h3.vsa_head_groups"  # on the transformer: head groups VSA defaults to (record)

H3_HOOK_NAMES = (
    H3_FAST_VAE_DECODE_HOOK,
    H3_CACHE_STATS_HOOK,
    H3_REFINE_TEXT_ONCE_HOOK,
    H3_V100_MODE_HOOK,
    H3_CONTEXT_PARALLEL_HOOK,
    H3_TENSOR_PARALLEL_HOOK,
    H3_TENSOR_PARALLEL_REDUCE_HOOK,
    H3_CHECKPOINT_STREAM_HOOK,
    H3_CHECKPOINT_STREAM_MODEL_HOOK,
    H3_FEED_FORWARD_CHUNKS_HOOK,
    H3_STREAM_FROM_DISK_HOOK,
    H3_CALL_PLAN_HOOK,
    H3_SINGLE_FILE_HOOK,
    H3_PDD_HEAD_BANK_HOOK,
    H3_LIGHT_VAE_HOOK,
    H3_VSA_HEAD_GROUPS_HOOK,
)


class H3Hook(ModelHook):
    """A diffusers ``ModelHook`` that holds ``record``: a dataclass of what its ``enable_*`` set up (options, the path
    chosen), read back by ``describe``. Subclasses add ``pre_forward`` / ``post_forward`` / ``new_forward``."""

    def __init__(self, record: Any = None):
        super().__init__()
        self.record = record

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.record!r})"


def get_h3_hook(module: torch.nn.Module, name: str) -> Optional[ModelHook]:
    """The hook registered under ``name`` in ``module``'s own registry (no registry is created), or ``None``."""
    registry = getattr(module, "_diffusers_hook", None)
    return None if registry is None else registry.get_hook(name)


def h3_record(module: torch.nn.Module, name: str) -> Any:
    """The record held by ``module``'s hook ``name``, or ``None`` when that behaviour is not enabled on it."""
    return getattr(get_h3_hook(module, name), "record", None)


def h3_records(module: torch.nn.Module) -> Dict[str, Any]:
    """``{hook name: record}`` of the H3 hooks in ``module``'s own registry, in registration order."""
    registry = getattr(module, "_diffusers_hook", None)
    if registry is None:
        return {}
    return {n: getattr(registry.hooks[n], "record", None) for n in registry._hook_order if n in H3_HOOK_NAMES}


def _invalidate(module: torch.nn.Module) -> None:
    # Registries cache the list of their descendants' registries (diffusers' cache-context walk); adding or removing
    # hooks below a module that has one makes that list stale.
    registry = getattr(module, "_diffusers_hook", None)
    if registry is not None:
        registry.invalidate_child_registries_cache()


def register_h3_hook(module: torch.nn.Module, hook: ModelHook, name: str, root: Optional[torch.nn.Module] = None):
    """Register ``hook`` as ``name`` in ``module``'s registry (created if needed); returns the hook. ``root``: the model
    ``module`` belongs to, whose cached list of descendant registries is refreshed."""
    if name not in H3_HOOK_NAMES:
        raise ValueError(f"{name!r} is not one of diffusers_h3's hook names {H3_HOOK_NAMES}")
    HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, name)
    _invalidate(root if root is not None else module)
    return hook


def remove_h3_hook(
    module: torch.nn.Module, name: str, recurse: bool = True, root: Optional[torch.nn.Module] = None
) -> bool:
    """Remove hook ``name`` from ``module`` (and, with ``recurse``, from every submodule); True if one was there.
    ``root`` as for :func:`register_h3_hook`."""
    found = [m for m in (module.modules() if recurse else [module]) if get_h3_hook(m, name) is not None]
    for owner in found:
        owner._diffusers_hook.remove_hook(name, recurse=False)
    if found:
        _invalidate(root if root is not None else module)
    return bool(found)


def hooked_modules(module: torch.nn.Module, name: str) -> List[Tuple[str, torch.nn.Module]]:
    """``[(path, submodule)]`` of ``module`` (itself included, path ``""``) that hold hook ``name``."""
    return [(path, m) for path, m in module.named_modules() if get_h3_hook(m, name) is not None]


# -- partitions -----------------------------------------------------------------------------------------------------
PARTITIONS = ("transformer", "transformer_ref")


def partitions_of(pipe_or_transformer: Any) -> List[Tuple[str, torch.nn.Module]]:
    """``[(name, transformer)]``: a pipeline's loaded DiT partitions (``transformer``, ``transformer_ref``, in that
    order), or ``[("transformer", model)]`` for a model passed alone. Empty for a pipeline holding neither; callers
    that need one raise their own error."""
    if isinstance(pipe_or_transformer, torch.nn.Module):
        return [("transformer", pipe_or_transformer)]
    found = []
    for name in PARTITIONS:
        model = getattr(pipe_or_transformer, name, None)
        if isinstance(model, torch.nn.Module):
            found.append((name, model))
    return found


def transformers_of(pipe_or_transformer: Any, who: str) -> List[torch.nn.Module]:
    """The transformer(s) ``who`` (an ``enable_*`` name) applies to: a ``MiniMaxH3Transformer3DModel`` itself, or a
    pipeline's loaded partitions; a ``TypeError`` naming ``who`` for anything else."""
    from diffusers import MiniMaxH3Transformer3DModel

    if isinstance(pipe_or_transformer, MiniMaxH3Transformer3DModel):
        return [pipe_or_transformer]
    models = [] if isinstance(pipe_or_transformer, torch.nn.Module) else partitions_of(pipe_or_transformer)
    if not models:
        raise TypeError(
            f"{who} expects a MiniMaxH3Transformer3DModel or a pipeline with a `transformer`, got "
            f"{type(pipe_or_transformer).__name__}."
        )
    return [model for _, model in models]


# Hooks of ours that move weights (the others only compute differently or record what ran).
_PLACEMENT_HOOKS = (
    H3_CHECKPOINT_STREAM_HOOK,
    H3_CHECKPOINT_STREAM_MODEL_HOOK,
    H3_STREAM_FROM_DISK_HOOK,
)


def moves_weights(module: torch.nn.Module) -> bool:
    """Whether ``module``'s registry may move its weights at forward time: it holds a hook that is not one of ours
    (group offload, context-parallel splits, diffusers' caches) or one of our placement hooks, or it is empty (the
    marker group offload and checkpoint streaming leave on a component's top module). Our compute and reporting hooks
    leave the weights where they are, so they do not change where a pipeline sends a component's inputs."""
    registry = getattr(module, "_diffusers_hook", None)
    if registry is None:
        return False
    if not registry.hooks:
        return True
    return any(name not in H3_HOOK_NAMES or name in _PLACEMENT_HOOKS for name in registry.hooks)
