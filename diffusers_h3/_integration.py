"""Import-time integration with diffusers: `import diffusers_h3` runs :func:`_register_with_diffusers` once.

It makes `diffusers.MiniMaxH3Pipeline` resolve to ours, routes `DiffusionPipeline.from_pretrained(<H3 folder or hub
repo id>)` to `MiniMaxH3Pipeline.from_pretrained`, and registers the diffusers-h3 quantizers with diffusers' quantizer
registry and H3's transformer block with diffusers' cache hooks.

diffusers resolves a folder's `_class_name` with `getattr(diffusers, name)`, which names the *modular* class for the
official hub layout and has no plugin discovery; so the dispatch classifies the folder by its files
(`classify_checkpoint`) and sends every MiniMax-H3 folder ("ours", "hub", and "native", which gets our explanation
of why it cannot load) to our loader, and every other folder to diffusers unchanged. A hub repo id goes to our loader
when the caller passes `task=`, or when its index describes MiniMax-H3: the index in the hub cache when there is one,
else the `model_index.json` diffusers' own loader fetches (read by `_IndexWatchingPipeline`, before diffusers downloads
any weights). So loading any other model by repo id makes no hub call beyond diffusers' own; a repo whose index cannot
be fetched gets diffusers' own error.

The dispatch is the one attribute of another library's class this package replaces (`DiffusionPipeline.from_pretrained`,
with the reason in docs/diffusers_compat.md; `tests/test_import_side_effects.py` checks that nothing else changes).
"""

from __future__ import annotations

import os

import diffusers
from diffusers import DiffusionPipeline
from diffusers.utils import logging

from .hooks.cache import register_cache_blocks
from .pipelines.loading import (
    _DIFFUSERS_FROM_PRETRAINED,
    HUB_KWARGS,
    classify_cached_repo,
    classify_checkpoint,
    classify_index,
)
from .pipelines.pipeline_minimax_h3 import MiniMaxH3Pipeline
from .quantizers import register_quantizers


logger = logging.get_logger(__name__)

# Folder kinds `DiffusionPipeline.from_pretrained` hands to `MiniMaxH3Pipeline.from_pretrained`.
H3_KINDS = ("ours", "hub", "native")


def _is_h3_folder(path) -> bool:
    """Whether `path` is a local folder of MiniMax-H3 files (loadable or not); decided by its files."""
    return os.path.isdir(str(path)) and classify_checkpoint(path) in H3_KINDS


# Folder kinds a hub repo id is routed to our loader for ("native" repo ids keep diffusers' own error).
H3_REPO_KINDS = ("ours", "hub")


class _H3RepoIndex(Exception):
    """Raised from inside diffusers' download, right after it fetched a `model_index.json` describing MiniMax-H3 and
    before it downloads any weights, to hand the repo to our loader."""


class _IndexWatchingPipeline(DiffusionPipeline):
    """diffusers' own loader, run for a repo id the hub cache could not classify: `DiffusionPipeline.download` reads
    the index it fetched with `cls._dict_from_json_file` before it chooses and downloads any weights, so a repo of
    any other model costs no hub call beyond diffusers' own, and an index describing MiniMax-H3 stops the download
    there (`_H3RepoIndex`) for our loader, which fetches only the partitions the task needs."""

    @classmethod
    def _dict_from_json_file(cls, json_file):
        config = super()._dict_from_json_file(json_file)
        is_index = os.path.basename(str(json_file)) == DiffusionPipeline.config_name
        if is_index and classify_index(None, config) in H3_REPO_KINDS:
            raise _H3RepoIndex(json_file)
        return config


# diffusers resolves a folder's `_class_name` (`_get_pipeline_class`) and reports the loading class (user agent) only
# for a class named `DiffusionPipeline` of the diffusers package: the watcher loads exactly as diffusers' class does.
_IndexWatchingPipeline.__name__ = _IndexWatchingPipeline.__qualname__ = DiffusionPipeline.__name__
_IndexWatchingPipeline.__module__ = DiffusionPipeline.__module__


def _could_be_repo_id(path) -> bool:
    return isinstance(path, str) and not os.path.exists(path) and path.count("/") <= 1


def _cached_repo_is_h3(repo_id: str, kwargs) -> bool:
    """Whether the hub cache already holds an index of `repo_id` describing MiniMax-H3 (no network call)."""
    hub_kwargs = {k: kwargs[k] for k in HUB_KWARGS if k in kwargs}
    try:
        return classify_cached_repo(repo_id, hub_kwargs) in H3_REPO_KINDS
    except Exception:  # noqa: BLE001 - a bad id or an unreadable cache entry: diffusers' loader reports it
        return False


def install_diffusion_pipeline_dispatch() -> None:
    """Route `DiffusionPipeline.from_pretrained(<H3 folder or repo id>)` to `MiniMaxH3Pipeline.from_pretrained`
    (idempotent).

    A repo id goes to our loader when the caller asks for it (`task=`), or when its index, read from the hub cache or
    as diffusers fetches it, describes MiniMax-H3; any other repo id loads through diffusers with no extra hub call.
    """
    if getattr(DiffusionPipeline.from_pretrained, "_diffusers_h3_dispatch", False):
        return

    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        path = pretrained_model_name_or_path
        if cls is not DiffusionPipeline:
            return _DIFFUSERS_FROM_PRETRAINED(cls, path, **kwargs)
        if _is_h3_folder(path):
            return MiniMaxH3Pipeline.from_pretrained(path, **kwargs)
        if not _could_be_repo_id(path):
            return _DIFFUSERS_FROM_PRETRAINED(cls, path, **kwargs)
        if "task" in kwargs or _cached_repo_is_h3(path, kwargs):
            return MiniMaxH3Pipeline.from_pretrained(path, **kwargs)
        try:
            return _DIFFUSERS_FROM_PRETRAINED(_IndexWatchingPipeline, path, **kwargs)
        except _H3RepoIndex:
            pass
        return MiniMaxH3Pipeline.from_pretrained(path, **kwargs)

    from_pretrained.__doc__ = _DIFFUSERS_FROM_PRETRAINED.__doc__
    from_pretrained._diffusers_h3_dispatch = True
    DiffusionPipeline.from_pretrained = classmethod(from_pretrained)


def _register_with_diffusers() -> None:
    """Expose `MiniMaxH3Pipeline` as `diffusers.MiniMaxH3Pipeline` and install the dispatch, unless diffusers ships a
    class of that name (then diffusers' class keeps the name and `DiffusionPipeline.from_pretrained`, and one warning
    says so); register the quantizers and cache hooks in every case, so saved checkpoints still load."""
    existing = getattr(diffusers, "MiniMaxH3Pipeline", None)
    if existing is None or existing is MiniMaxH3Pipeline:
        diffusers.MiniMaxH3Pipeline = MiniMaxH3Pipeline
        install_diffusion_pipeline_dispatch()
    else:
        logger.warning(
            f"diffusers {diffusers.__version__} ships its own MiniMaxH3Pipeline ({existing.__module__}); it keeps "
            "`diffusers.MiniMaxH3Pipeline` and `DiffusionPipeline.from_pretrained`. Use "
            "`diffusers_h3.MiniMaxH3Pipeline.from_pretrained` for this plugin's pipeline; its quantizers and cache "
            "hooks are registered either way."
        )
    register_quantizers()
    register_cache_blocks()
