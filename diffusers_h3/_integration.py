"""Import-time integration with diffusers: `import diffusers_h3` runs :func:`integrate_with_diffusers` once.

It makes `diffusers.MiniMaxH3Pipeline` resolve to ours, routes `DiffusionPipeline.from_pretrained(<H3 folder or hub
repo id>)` to `MiniMaxH3Pipeline.from_pretrained`, registers the diffusers-h3 quantizers with diffusers' quantizer registry and
H3's transformer block with diffusers' cache hooks, and makes a saved H3 transformer carry a Hub model card.

diffusers resolves a folder's `_class_name` with `getattr(diffusers, name)`, which names the *modular* class for the
official hub layout and has no plugin discovery; so the dispatch classifies the folder by its files
(`classify_checkpoint`) and sends every MiniMax-H3 folder ("ours", "hub", and "native", which gets our explanation
of why it cannot load) to our loader, and every other folder to diffusers unchanged. A hub repo id is classified the
same way by its index file (`modular_model_index.json` / `model_index.json`, read from the hub cache when it is
there); a repo whose index cannot be fetched goes to diffusers unchanged, which reports its own error.
"""

from __future__ import annotations

import os

import diffusers
from diffusers import DiffusionPipeline, MiniMaxH3Transformer3DModel
from diffusers.utils import logging

from ._model_card import save_with_card, transformer_model_card
from .hooks.cache import register_cache_blocks
from .pipelines.loading import _DIFFUSERS_FROM_PRETRAINED, HUB_KWARGS, classify_checkpoint, classify_repo
from .pipelines.pipeline_minimax_h3 import MiniMaxH3Pipeline
from .quantizers import register_quantizers


logger = logging.get_logger(__name__)

# Folder kinds `DiffusionPipeline.from_pretrained` hands to `MiniMaxH3Pipeline.from_pretrained`.
H3_KINDS = ("ours", "hub", "native")


def _is_h3_folder(path) -> bool:
    """Whether `path` is a local folder of MiniMax-H3 files (loadable or not); decided by its files."""
    return os.path.isdir(str(path)) and classify_checkpoint(path) in H3_KINDS


def _is_h3_repo(repo_id, kwargs) -> bool:
    """Whether `repo_id` (not a local folder) names a hub repo whose index file describes MiniMax-H3."""
    if not isinstance(repo_id, str) or os.path.exists(repo_id) or repo_id.count("/") > 1:
        return False
    hub_kwargs = {k: kwargs[k] for k in HUB_KWARGS if k in kwargs}
    try:
        return classify_repo(repo_id, hub_kwargs) in ("ours", "hub")
    except Exception:  # noqa: BLE001 - unreachable hub, bad id, gated repo: diffusers' loader reports it
        return False


def install_diffusion_pipeline_dispatch() -> None:
    """Route `DiffusionPipeline.from_pretrained(<H3 folder or repo id>)` to `MiniMaxH3Pipeline.from_pretrained`
    (idempotent)."""
    if getattr(DiffusionPipeline.from_pretrained, "_diffusers_h3_dispatch", False):
        return

    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        if cls is DiffusionPipeline and (
            _is_h3_folder(pretrained_model_name_or_path) or _is_h3_repo(pretrained_model_name_or_path, kwargs)
        ):
            return MiniMaxH3Pipeline.from_pretrained(pretrained_model_name_or_path, **kwargs)
        return _DIFFUSERS_FROM_PRETRAINED(cls, pretrained_model_name_or_path, **kwargs)

    from_pretrained.__doc__ = _DIFFUSERS_FROM_PRETRAINED.__doc__
    from_pretrained._diffusers_h3_dispatch = True
    DiffusionPipeline.from_pretrained = classmethod(from_pretrained)


def install_transformer_model_card() -> None:
    """`MiniMaxH3Transformer3DModel.save_pretrained` also writes a model card (quantization, fused LoRA) (idempotent)."""
    save = MiniMaxH3Transformer3DModel.save_pretrained
    if getattr(save, "_diffusers_h3_card", False):
        return

    def save_pretrained(self, save_directory, **kwargs):
        return save_with_card(save, self, save_directory, transformer_model_card, **kwargs)

    save_pretrained.__doc__ = save.__doc__
    save_pretrained._diffusers_h3_card = True
    MiniMaxH3Transformer3DModel.save_pretrained = save_pretrained


def _register_with_diffusers() -> None:
    """Expose `MiniMaxH3Pipeline` as `diffusers.MiniMaxH3Pipeline`, install the dispatch, register the quantizers."""
    existing = getattr(diffusers, "MiniMaxH3Pipeline", None)
    if existing is not None and existing is not MiniMaxH3Pipeline:
        logger.warning(
            "diffusers already defines MiniMaxH3Pipeline; diffusers_h3 leaves it in place. Use "
            "diffusers_h3.MiniMaxH3Pipeline explicitly."
        )
        return
    diffusers.MiniMaxH3Pipeline = MiniMaxH3Pipeline
    install_diffusion_pipeline_dispatch()
    register_quantizers()
    register_cache_blocks()
    install_transformer_model_card()
