"""Hub model cards for what diffusers-h3 saves: a whole pipeline, and each of its DiT partitions in its subfolder.

The card is a ``README.md`` with Hub metadata (``library_name: diffusers``, ``pipeline_tag``, ``base_model`` when the
checkpoint came from a hub repo, the source card's ``license`` when it has one, ``tags``) and a usage snippet that
loads exactly the saved checkpoint, so a folder written by ``save_pretrained`` can be pushed as is.
"""

from __future__ import annotations

import os
import re
from typing import Dict, List, Optional

import torch
from huggingface_hub import ModelCard, ModelCardData

from ._hooks import partitions_of


PIPELINE_TAG = "text-to-video"
BASE_TAGS = ("diffusers", "diffusers-h3", "minimax-h3", "text-to-video", "text-to-audio")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
LICENSE_FIELDS = ("license", "license_name", "license_link")


def quantization_method(model: torch.nn.Module) -> Optional[str]:
    """The quantization method recorded in a diffusers model's config (``None`` when it is not quantized)."""
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    if config is None:
        return None
    method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
    return getattr(method, "value", method)


def fused_lora_names(model: torch.nn.Module) -> List[str]:
    """Adapters merged into the weights (the only LoRA state that ``save_pretrained`` keeps)."""
    names = set()
    for module in model.modules():
        names.update(getattr(module, "merged_adapters", None) or ())
    return sorted(names)


def _base_model(name_or_path: Optional[str]) -> Optional[str]:
    if not name_or_path or os.path.isdir(name_or_path) or not _REPO_ID.match(name_or_path):
        return None
    return name_or_path


def _source_card_path(name_or_path: Optional[str]) -> Optional[str]:
    """The card of the checkpoint a model was loaded from: a folder's ``README.md`` (or its parent's, for a component
    subfolder), or a hub repo's ``README.md`` in the local hub cache (the loader downloads it; no network call here)."""
    if not name_or_path:
        return None
    if os.path.isdir(name_or_path):
        for folder in (name_or_path, os.path.dirname(os.path.normpath(name_or_path))):
            if os.path.isfile(os.path.join(folder, "README.md")):
                return os.path.join(folder, "README.md")
        return None
    if _base_model(name_or_path) is None:
        return None
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(name_or_path, "README.md")
    return cached if isinstance(cached, str) else None


def source_license(name_or_path: Optional[str]) -> Dict[str, str]:
    """``license`` (with ``license_name`` / ``license_link`` for a custom license) from the card of the checkpoint a
    model was loaded from; empty when that card is missing or names no license."""
    data = _source_card_data(name_or_path)
    return {key: data[key] for key in LICENSE_FIELDS if data.get(key)} if data.get("license") else {}


def source_base_model(name_or_path: Optional[str]) -> Optional[str]:
    """The hub repo a checkpoint derives from: the repo id it was loaded by, else the ``base_model`` its source card
    names (a folder saved from a pipeline loaded by repo id keeps it)."""
    base = _base_model(name_or_path) or _source_card_data(name_or_path).get("base_model")
    return base if isinstance(base, str) else None


def _source_card_data(name_or_path: Optional[str]) -> Dict:
    path = _source_card_path(name_or_path)
    return ModelCard.load(path).data.to_dict() if path is not None else {}


def _card(data: ModelCardData, title: str, body: str) -> ModelCard:
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n# {title}\n\n{body}\n")


def pipeline_model_card(pipe, repo_id: Optional[str] = None) -> ModelCard:
    """The card for a saved ``MiniMaxH3Pipeline``; ``repo_id`` is where it will live (a path or a hub id)."""
    transformers = [model for _, model in partitions_of(pipe)]
    methods = sorted({m for m in map(quantization_method, transformers) if m})
    loras = sorted({name for m in transformers for name in fused_lora_names(m)})
    source = getattr(pipe.config, "_name_or_path", None)
    base = source_base_model(source)
    tags = list(BASE_TAGS) + [f"quantized-{m}" for m in methods] + [f"lora-{n}" for n in loras]
    data = ModelCardData(
        library_name="diffusers", pipeline_tag=PIPELINE_TAG, base_model=base, tags=tags, **source_license(source)
    )
    target = repo_id or "path/to/this/folder"
    notes = []
    if methods:
        notes.append(f"- DiT weights quantized with diffusers-h3 ({', '.join(methods)}); `import diffusers_h3` "
                     "registers the quantizer that reads them.")
    if loras:
        notes.append(f"- LoRA adapters fused into the weights: {', '.join(loras)}.")
    if base:
        notes.append(f"- Derived from [{base}](https://huggingface.co/{base}).")
    body = (
        "MiniMax-H3 (video with native 32 kHz stereo audio) saved with "
        "diffusers-h3.\n\n"
        + ("\n".join(notes) + "\n\n" if notes else "")
        + "```python\nimport torch\nimport diffusers_h3  # registers MiniMaxH3Pipeline and its quantizers\n"
        "from diffusers_h3 import MiniMaxH3Pipeline, export_to_video\n\n"
        f'pipe = MiniMaxH3Pipeline.from_pretrained("{target}", dtype=torch.bfloat16)\n'
        'result = pipe(prompt="A street drummer plays under neon lights")\n'
        'export_to_video(result.frames[0], "clip.mp4", audio=result.audio[0], sampling_rate=result.sampling_rate)\n'
        "```"
    )
    return _card(data, "MiniMax-H3 pipeline (diffusers-h3)", body)


def transformer_model_card(model, repo_id: Optional[str] = None) -> ModelCard:
    """The card of a DiT partition, in its own subfolder of a saved pipeline (typically a quantized DiT)."""
    method = quantization_method(model)
    loras = fused_lora_names(model)
    source = getattr(model.config, "_name_or_path", None)
    base = source_base_model(source)
    tags = list(BASE_TAGS) + ([f"quantized-{method}"] if method else []) + [f"lora-{n}" for n in loras]
    data = ModelCardData(
        library_name="diffusers", pipeline_tag=PIPELINE_TAG, base_model=base, tags=tags, **source_license(source)
    )
    target = repo_id or "path/to/this/folder"
    cls = type(model).__name__
    body = (
        f"The `{cls}` of MiniMax-H3"
        + (f", quantized with diffusers-h3 ({method})" if method else "")
        + (f", with LoRA fused: {', '.join(loras)}" if loras else "")
        + ".\n\n```python\nimport torch\nimport diffusers_h3  # registers the quantizers that read these weights\n"
        f"from diffusers import {cls}\n\n"
        f'transformer = {cls}.from_pretrained("{target}", dtype=torch.bfloat16)\n'
        "```"
    )
    return _card(data, f"MiniMax-H3 {cls} (diffusers-h3)", body)


HUB_KWARGS = ("repo_id", "token", "private", "commit_message", "create_pr")


def save_with_card(save, obj, save_directory, card_for, push_to_hub: bool = False, **kwargs):
    """Run diffusers' ``save(obj, save_directory, ...)`` without its push, write our card, then push the folder.

    diffusers writes an empty card right before uploading; saving first and uploading after the card is written keeps
    one upload with our metadata in it.
    """
    hub = {key: kwargs.pop(key) for key in HUB_KWARGS if key in kwargs}
    result = save(obj, save_directory, push_to_hub=False, **kwargs)
    if kwargs.get("is_main_process", True):
        repo_id = hub.get("repo_id")
        if push_to_hub:
            from huggingface_hub import create_repo

            name = repo_id or os.path.basename(os.path.normpath(str(save_directory)))
            repo_id = create_repo(name, exist_ok=True, private=hub.get("private"), token=hub.get("token")).repo_id
        write_model_card(str(save_directory), card_for(obj, repo_id=repo_id or str(save_directory)))
        if push_to_hub:  # huggingface_hub's upload, with the commit message diffusers' own push would write
            from huggingface_hub import upload_folder

            upload_folder(
                repo_id=repo_id,
                folder_path=str(save_directory),
                token=hub.get("token"),
                commit_message=hub.get("commit_message") or f"Upload {type(obj).__name__}",
                create_pr=hub.get("create_pr", False),
            )
    return result


def write_transformer_cards(pipe, save_directory) -> None:
    """Write the card of each DiT partition `pipe` saved into its subfolder (quantization and fused-LoRA tags, a
    snippet that loads that subfolder), unless the subfolder already has a `README.md`."""
    for name, model in partitions_of(pipe):
        folder = os.path.join(save_directory, name)
        write_model_card(folder, transformer_model_card(model, repo_id=folder))


def write_model_card(save_directory: str, card: ModelCard) -> str:
    """Write ``README.md`` into ``save_directory`` unless the folder already has one (a user's card wins)."""
    path = os.path.join(save_directory, "README.md")
    if not os.path.exists(path):
        card.save(path)
    return path
