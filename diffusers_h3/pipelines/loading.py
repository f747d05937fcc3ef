"""Loading MiniMax-H3 checkpoints: our own `save_pretrained` layout and the official hub layout.

The official repository (`MiniMaxAI/MiniMax-H3`) stores the diffusers components at its root with a
`modular_model_index.json` whose entries name the hub repo id; a local snapshot must resolve every subfolder relative
to the directory it was given, offline, and must load only the DiT partition the task needs (each a full 33 B DiT).
It also holds native `FL2VA/` and `Ref2VA/` folders (original weight names) that diffusers cannot read.

`classify_checkpoint` tells the folder kinds apart by their files (`classify_index` by the index files alone);
`diffusers_h3._integration` uses them to route `DiffusionPipeline.from_pretrained(<H3 folder or repo id>)` here.

A hub repo id resolves through `huggingface_hub` to a local snapshot first (`resolve_repo`): its index file is read
from the cache when it is there (downloaded otherwise), and `snapshot_download` fetches only the index files, the
repo's card (`README.md`), the shared components and the DiT partition the task needs; `cache_dir`, `revision`,
`token`, `local_files_only` and `HF_HUB_OFFLINE` are honoured. The snapshot then loads exactly as a local folder does,
and the pipeline remembers the repo id as its `_name_or_path` (for the model cards of what is saved from it).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from diffusers import DiffusionPipeline
from diffusers.utils import logging
from diffusers.utils.distributed_utils import is_torch_dist_rank_zero

from .._checkpoint_files import looks_like_local_path, safetensors_problem
from ..loaders.fasth3 import CONTRACT_FILE
from ..loaders.fasth3_text_encoder import is_fasth3_nvfp4_text_encoder, load_nvfp4_text_encoder
from ..tasks import PARTITIONS, partitions_for_task
from .fasth3 import apply_fasth3_stack, check_fasth3_stack, load_gates_without_contract


# The pipeline's own config values (its `__init__` arguments that are not components), passed through on loading.
PIPELINE_CONFIG_KEYS = (
    "text_encoder_layer", "canvas_short_edge", "canvas_max_pixels", "reference_image_short_edge", "min_duration_s",
    "max_duration_s", "max_prompt_tokens", "strict_duration", "max_canvas_pixels",
)  # fmt: skip


logger = logging.get_logger(__name__)

OUR_CLASS = "MiniMaxH3Pipeline"
MODULAR_CLASS = "MiniMaxH3ModularPipeline"
MODULAR_BLOCKS_CLASS = "MiniMaxH3Blocks"
NATIVE_FOLDERS = ("FL2VA", "Ref2VA")
CHECKPOINT_KINDS = ("ours", "hub", "native", "foreign")
# diffusers' own loader, kept before `diffusers_h3._integration` routes H3 folders away from it.
_DIFFUSERS_FROM_PRETRAINED = DiffusionPipeline.from_pretrained.__func__


class NotAnH3CheckpointError(ValueError):
    """A directory that is not a MiniMax-H3 checkpoint this package can load."""


def _read_json(path: Path) -> Optional[Dict[str, Any]]:
    if not path.is_file():
        return None
    with open(path) as handle:
        return json.load(handle)


def classify_index(modular: Optional[Dict[str, Any]], root: Optional[Dict[str, Any]], has_native_folders=False) -> str:
    """What kind of checkpoint a folder or repo holds, read from its `modular_model_index.json` (`modular`) and
    `model_index.json` (`root`) contents (`None` where absent); see :func:`classify_checkpoint`."""
    if root is not None and "_minimax_h3" in root:
        return "native"
    if modular is not None:
        is_h3 = modular.get("_class_name") == MODULAR_CLASS or modular.get("_blocks_class_name") == MODULAR_BLOCKS_CLASS
        return "hub" if is_h3 else "foreign"
    if root is None:
        return "native" if has_native_folders else "foreign"
    return {OUR_CLASS: "ours", MODULAR_CLASS: "hub"}.get(root.get("_class_name"), "foreign")


def classify_checkpoint(directory) -> str:
    """What kind of checkpoint `directory` holds, read from its files.

    - `"ours"`: a `MiniMaxH3Pipeline.save_pretrained` folder (`model_index.json` naming `MiniMaxH3Pipeline`);
    - `"hub"`: the official hub layout (`modular_model_index.json` of `MiniMaxH3Blocks`, or a root index naming the
      modular H3 pipeline);
    - `"native"`: MiniMax-H3 weights diffusers cannot read (`FL2VA/` / `Ref2VA/` folders with original weight
      names, or a folder holding them without a diffusers index);
    - `"foreign"`: anything else (another pipeline, or no diffusers index at all).
    """
    directory = Path(directory)
    modular = _read_json(directory / "modular_model_index.json")
    root = _read_json(directory / "model_index.json")
    return classify_index(modular, root, any((directory / name).is_dir() for name in NATIVE_FOLDERS))


def _refusal(directory: Path, kind: str) -> NotAnH3CheckpointError:
    """The one error that says what a folder we cannot load is and what to pass instead."""
    modular = _read_json(directory / "modular_model_index.json")
    root = _read_json(directory / "model_index.json")
    if kind == "native" and root is not None:
        return NotAnH3CheckpointError(
            f"{directory} is a native MiniMax-H3 folder (FL2VA/ or Ref2VA/ with original `blocks.*` weight names), "
            "which diffusers cannot read yet. Point at the repository root instead (its `transformer/` and "
            "`transformer_ref/` folders are the diffusers layout), or convert the native weights with diffusers' "
            "`scripts/convert_minimax_h3_to_diffusers.py`."
        )
    if modular is not None:
        return NotAnH3CheckpointError(
            f"{directory}/modular_model_index.json describes a {modular.get('_class_name')!r} pipeline, not "
            "MiniMax-H3; load it with diffusers' ModularPipeline instead."
        )
    if root is None:
        hint = " It holds native FL2VA/ / Ref2VA/ folders but no diffusers index at its root." if kind == "native" else ""
        return NotAnH3CheckpointError(
            f"{directory} has no model_index.json or modular_model_index.json, so it is not a diffusers checkpoint."
            f"{hint} Pass the folder `MiniMaxH3Pipeline.save_pretrained` wrote, or a snapshot of MiniMaxAI/MiniMax-H3."
        )
    return NotAnH3CheckpointError(
        f"{directory} is a {root.get('_class_name')!r} checkpoint, not MiniMax-H3; load it with "
        "`DiffusionPipeline.from_pretrained` without diffusers_h3 or with its own pipeline class."
    )


def _read_index(directory: Path, kind: str) -> Dict[str, Any]:
    """The component index of a loadable folder: `[library, class, spec]` per component for the hub layout."""
    if kind == "ours":
        return _read_json(directory / "model_index.json")
    modular = _read_json(directory / "modular_model_index.json")
    if modular is not None:
        return modular
    # A root index of the hub layout without its modular index: entries are [library, class] per subfolder.
    root = _read_json(directory / "model_index.json")
    return {k: (v if k.startswith("_") else [v[0], v[1], {"subfolder": k}]) for k, v in root.items()}


# Keyword arguments of `from_pretrained` that select where a hub repo id resolves (`huggingface_hub` names).
HUB_KWARGS = ("cache_dir", "revision", "token", "local_files_only", "proxies", "force_download")
INDEX_FILES = ("modular_model_index.json", "model_index.json")


def _offline(hub_kwargs: Dict[str, Any]) -> bool:
    """`local_files_only`, or hub offline mode (`HF_HUB_OFFLINE`, also when set after `huggingface_hub` imported)."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    return bool(hub_kwargs.get("local_files_only")) or constants.HF_HUB_OFFLINE or env


def _hub_file(repo_id: str, filename: str, hub_kwargs: Dict[str, Any]) -> Optional[str]:
    """Local path of `filename` in `repo_id`: from the cache when it is there, else downloaded; `None` if the repo
    has no such file (or, offline, the cache does not hold it)."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    if not hub_kwargs.get("force_download"):
        cached = try_to_load_from_cache(
            repo_id, filename, cache_dir=hub_kwargs.get("cache_dir"), revision=hub_kwargs.get("revision")
        )
        if isinstance(cached, str):
            return cached
    kwargs = {k: v for k, v in hub_kwargs.items() if k != "local_files_only"}
    try:
        return hf_hub_download(repo_id, filename, local_files_only=_offline(hub_kwargs), **kwargs)
    except (EntryNotFoundError, LocalEntryNotFoundError):
        return None


def fetch_repo_indexes(repo_id: str, hub_kwargs: Dict[str, Any]) -> Tuple[Optional[Dict], Optional[Dict]]:
    """The `(modular_model_index.json, model_index.json)` contents of a hub repo (`None` where absent)."""
    indexes = []
    for filename in INDEX_FILES:
        path = _hub_file(repo_id, filename, hub_kwargs)
        indexes.append(_read_json(Path(path)) if path is not None else None)
    return tuple(indexes)


def classify_repo(repo_id: str, hub_kwargs: Dict[str, Any]) -> str:
    """:func:`classify_checkpoint` for a hub repo id, decided by its index files."""
    return classify_index(*fetch_repo_indexes(repo_id, hub_kwargs))


def classify_cached_repo(repo_id: str, hub_kwargs: Dict[str, Any]) -> Optional[str]:
    """:func:`classify_repo` from the local hub cache only (no network call); `None` when no index file is cached."""
    from huggingface_hub import try_to_load_from_cache

    if hub_kwargs.get("force_download"):
        return None
    indexes = []
    for filename in INDEX_FILES:
        cached = try_to_load_from_cache(
            repo_id, filename, cache_dir=hub_kwargs.get("cache_dir"), revision=hub_kwargs.get("revision")
        )
        indexes.append(_read_json(Path(cached)) if isinstance(cached, str) else None)
    return classify_index(*indexes) if any(index is not None for index in indexes) else None


def _needed_subfolders(index: Dict[str, Any], task: Optional[str]) -> list:
    wanted = partitions_for_task(task)
    folders = []
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, (list, tuple)) or entry[0] is None:
            continue
        if name in PARTITIONS and name not in wanted:
            continue
        spec = entry[2] if len(entry) > 2 and isinstance(entry[2], dict) else {}
        folders.append(spec.get("subfolder") or name)
    return folders


def _hub_reachable(hub_kwargs: Dict[str, Any]) -> bool:
    """Whether the Hub's host name resolves (no request is made). Behind a proxy the proxy resolves it: assumed
    reachable. Without this, an unplugged network costs huggingface_hub's retries (close to a minute) and then an
    error that does not name the network."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    proxy_variables = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HTTP_PROXY", "http_proxy")
    if hub_kwargs.get("proxies") or any(os.environ.get(name) for name in proxy_variables):
        return True
    host = urlparse(constants.ENDPOINT).hostname
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        return False
    return True


def _hub_kwargs_for_network(repo_id: str, hub_kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """`hub_kwargs`, offline when the Hub cannot be reached but the cache holds the repo (with a warning that says
    so); one error naming the network when it cannot be reached and the cache does not hold the repo."""
    if _offline(hub_kwargs) or _hub_reachable(hub_kwargs):
        return hub_kwargs
    from urllib.parse import urlparse

    from huggingface_hub import constants

    host = urlparse(constants.ENDPOINT).hostname
    if classify_cached_repo(repo_id, hub_kwargs) is None:
        raise OSError(
            f"{repo_id!r}: cannot reach the Hugging Face Hub (the network cannot resolve {host}) and the local cache "
            f"({hub_kwargs.get('cache_dir') or constants.HF_HUB_CACHE}) does not hold the repo: check the network, "
            "or pass a local folder."
        )
    logger.warning(f"Cannot reach the Hugging Face Hub (the network cannot resolve {host}): loading {repo_id!r} from "
                   "the local cache, without checking for updates (set HF_HUB_OFFLINE=1 to do so without asking).")
    return {**hub_kwargs, "local_files_only": True}


def check_local_source(source: str) -> None:
    """A `from_pretrained` source that is not a folder: a file, or a path that does not exist, is refused in one line
    (a hub repo id passes; the Hub answers for it)."""
    if os.path.isdir(source):
        return
    if os.path.exists(source):
        raise NotADirectoryError(
            f"{source} is a file, not a checkpoint folder: pass the folder that holds model_index.json."
        )
    if looks_like_local_path(source):
        raise FileNotFoundError(
            f"{source}: no such folder ({os.path.abspath(os.path.expanduser(source))} does not exist): check the "
            "path, or pass a hub repo id such as 'MiniMaxAI/MiniMax-H3'."
        )


def resolve_repo(repo_id: str, task: Optional[str], hub_kwargs: Dict[str, Any]) -> str:
    """A local snapshot of hub repo `repo_id` holding the index files, the shared components and the DiT
    partition(s) `task` needs (nothing else is downloaded)."""
    from huggingface_hub import snapshot_download

    hub_kwargs = _hub_kwargs_for_network(repo_id, hub_kwargs)
    modular, root = fetch_repo_indexes(repo_id, hub_kwargs)
    kind = classify_index(modular, root)
    if modular is None and root is None:
        where = "in the local cache (offline mode)" if _offline(hub_kwargs) else "on the Hub"
        raise NotAnH3CheckpointError(
            f"{repo_id!r} is neither a local folder nor a hub repo with a model_index.json or "
            f"modular_model_index.json {where}. Pass an existing folder, or a repo id such as 'MiniMaxAI/MiniMax-H3' "
            "(download it first with `hf download` to use it offline)."
        )
    if kind not in ("ours", "hub"):
        raise NotAnH3CheckpointError(
            f"{repo_id!r} is a {(modular or root).get('_class_name')!r} checkpoint, not MiniMax-H3; load it with "
            "diffusers' own pipeline class."
        )
    index = modular if modular is not None else root
    # The repo's card comes along: the model cards of what is saved from it take its license.
    # A FastH3 stack's contract too (its trained schedule and VSA settings, pipelines/fasth3.py).
    allow = list(INDEX_FILES) + ["README.md", CONTRACT_FILE]
    allow += [f"{folder}/*" for folder in _needed_subfolders(index, task)]
    kwargs = {k: v for k, v in hub_kwargs.items() if k != "local_files_only"}
    return snapshot_download(repo_id, allow_patterns=allow, local_files_only=_offline(hub_kwargs), **kwargs)


def pop_dtype(kwargs: Dict[str, Any]):
    """`dtype` from `kwargs` (one `torch.dtype`, or a dict of component name → dtype with an optional `"default"`),
    accepting diffusers' deprecated `torch_dtype` alias as diffusers does (with its deprecation warning)."""
    from diffusers.utils.deprecation_utils import _resolve_dtype

    return _resolve_dtype(kwargs.pop("dtype", None), kwargs.pop("torch_dtype", None))


def check_dtype(kwargs: Dict[str, Any]) -> None:
    """`dtype` / `torch_dtype` of `from_pretrained`, before anything loads: a `torch.dtype` or a dict of component
    name → `torch.dtype` (diffusers' loader would load float32 in place of anything else, without a word)."""
    import torch

    for name in ("dtype", "torch_dtype"):
        value = kwargs.get(name)
        values = value.values() if isinstance(value, dict) else [value]
        bad = next((v for v in values if v is not None and not isinstance(v, torch.dtype)), None)
        if bad is not None:
            raise ValueError(
                f"`{name}` must be a torch.dtype (e.g. torch.bfloat16) or a dict of component name to torch.dtype, "
                f"got {bad!r}."
            )


def component_dtype(dtype, name: str):
    """The dtype component `name` loads in: diffusers' rule for dtype dicts (missing names take `"default"`, else
    float32)."""
    if isinstance(dtype, dict):
        import torch

        return dtype.get(name, dtype.get("default", torch.float32))
    return dtype


def _component_kwargs(library: str, name: str, dtype, quantization_config, extra: Dict[str, Any]) -> Dict[str, Any]:
    kwargs = dict(extra)
    dtype = component_dtype(dtype, name)
    if dtype is not None:
        kwargs["dtype"] = dtype  # diffusers models and transformers >= 4.56 both take `dtype`
    if quantization_config is not None:
        resolve = getattr(quantization_config, "_resolve_quant_config", None)
        config = resolve(is_diffusers=library == "diffusers", module_name=name) if resolve else quantization_config
        if config is not None:
            kwargs["quantization_config"] = config
    return kwargs


def _check_device_map(device_map) -> None:
    """The `device_map` values diffusers' `DiffusionPipeline.from_pretrained` takes, refused with its exception types
    (`ValueError` for a non-string, `NotImplementedError` for an unknown strategy)."""
    from diffusers.pipelines.pipeline_utils import SUPPORTED_DEVICE_MAP

    if device_map is not None and not isinstance(device_map, str):
        raise ValueError(f"`device_map` must be a string (one of {', '.join(SUPPORTED_DEVICE_MAP)}), got "
                         f"{device_map!r}: load and place components yourself for a per-module map.")  # fmt: skip
    if device_map is not None and device_map not in SUPPORTED_DEVICE_MAP:
        raise NotImplementedError(
            f"`device_map`={device_map!r} is not supported; pass one of {', '.join(SUPPORTED_DEVICE_MAP)} (as "
            "diffusers' DiffusionPipeline.from_pretrained), or load and place components yourself."
        )


# `from_pretrained` options that diffusers' `load_sub_model` forwards to every diffusers and transformers model, and
# those it forwards to diffusers models only; the hub layout forwards them by the same rule.
MODEL_LOADING_KWARGS = ("low_cpu_mem_usage", "max_memory", "offload_folder", "offload_state_dict", "use_safetensors")
DIFFUSERS_MODEL_LOADING_KWARGS = ("disable_mmap", "use_flashpack")


def _model_loading_kwargs(component_class, model_kwargs: Dict[str, Any], variant: Optional[str]) -> Dict[str, Any]:
    """The loading options one model component receives, as diffusers' `load_sub_model` chooses them."""
    from diffusers import ModelMixin

    if issubclass(component_class, ModelMixin):
        kwargs = dict(model_kwargs)
    else:  # transformers >= 4.57 (we require 5.x) no longer takes `offload_state_dict`; diffusers drops it too
        skip = DIFFUSERS_MODEL_LOADING_KWARGS + ("offload_state_dict",)
        kwargs = {k: v for k, v in model_kwargs.items() if k not in skip}
    if variant is not None:
        kwargs["variant"] = variant
    return kwargs


def _component_variants(directory: Path, index: Dict[str, Any], variant: Optional[str]) -> Dict[str, str]:
    """Components holding files of `variant` (the others load their default files); diffusers' rule and error when
    no component has them."""
    from diffusers.pipelines.pipeline_loading_utils import _identify_model_variants

    model_variants = _identify_model_variants(folder=str(directory), variant=variant, config=index)
    if variant is not None and not model_variants:
        raise ValueError(
            f"You are trying to load the model files of the `variant={variant}`, but no such modeling files are "
            "available."
        )
    return model_variants


def _load_hub_layout(cls, directory: Path, index: Dict[str, Any], task: Optional[str], kwargs: Dict[str, Any]):
    dtype = pop_dtype(kwargs)
    quantization_config = kwargs.pop("quantization_config", None)
    model_loading_names = MODEL_LOADING_KWARGS + DIFFUSERS_MODEL_LOADING_KWARGS
    model_kwargs = {k: kwargs.pop(k) for k in model_loading_names if k in kwargs}
    model_variants = _component_variants(directory, index, kwargs.pop("variant", None))
    device_map = kwargs.pop("device_map", None)
    _check_device_map(device_map)
    passed = {k: kwargs.pop(k) for k in list(kwargs) if k in index or k in PARTITIONS}
    init_extra = {k: kwargs.pop(k) for k in list(kwargs) if k in PIPELINE_CONFIG_KEYS}
    if kwargs:
        raise TypeError(f"unexpected keyword arguments for MiniMaxH3Pipeline.from_pretrained: {sorted(kwargs)}")
    wanted = partitions_for_task(task)

    entries = [(name, entry) for name, entry in index.items() if not name.startswith("_")]
    to_load = {}
    components: Dict[str, Any] = dict(passed)
    for name, entry in entries:
        if name in components:
            continue
        if name in PARTITIONS and name not in wanted:
            components[name] = None
            continue
        library, class_name = entry[0], entry[1]
        spec = entry[2] if len(entry) > 2 and isinstance(entry[2], dict) else {}
        folder = directory / (spec.get("subfolder") or name)
        if library is None or class_name is None:
            components[name] = None
            continue
        if not folder.is_dir():
            if name in PARTITIONS and task is None:
                components[name] = None
                continue
            raise ValueError(f"{directory} lists component {name!r} but has no `{folder.name}/` folder.")
        to_load[name] = (library, class_name, folder)

    final_device_map = _final_device_map(cls, device_map, to_load, components, dtype, directory, model_kwargs)
    # diffusers' loading bar: off under `diffusers.utils.logging.disable_progress_bar()` and on ranks other than 0
    bar = logging.tqdm(to_load.items(), desc="Loading MiniMax-H3 components", disable=not is_torch_dist_rank_zero())
    for name, (library, class_name, folder) in bar:
        component_class = getattr(importlib.import_module(library), class_name)
        if not hasattr(component_class, "dtype") and not issubclass(component_class, _torch_module()):
            load_kwargs = {}  # tokenizers, processors and schedulers take no dtype / quantization / placement
        else:
            component_kwargs = _model_loading_kwargs(component_class, model_kwargs, model_variants.get(name))
            load_kwargs = _component_kwargs(library, name, dtype, quantization_config, component_kwargs)
            if isinstance(final_device_map, dict):
                load_kwargs["device_map"] = {"": final_device_map[name]} if name in final_device_map else None
            elif final_device_map is not None:
                load_kwargs["device_map"] = final_device_map
        components[name] = component_class.from_pretrained(str(folder), **load_kwargs)
    pipe = cls(**{k: v for k, v in components.items() if k in _init_names(cls)}, **init_extra)
    if device_map is not None:
        pipe.hf_device_map = final_device_map
    return pipe


def _final_device_map(cls, device_map, to_load, passed, dtype, directory: Path, model_kwargs):
    """Per-component placement as diffusers derives it (`"balanced"` spreads components over the GPUs)."""
    if device_map is None or device_map != "balanced":
        return device_map
    import diffusers
    from diffusers.pipelines.pipeline_loading_utils import _get_final_device_map

    return _get_final_device_map(
        device_map=device_map,
        pipeline_class=cls,
        passed_class_obj={k: v for k, v in passed.items() if v is not None},
        init_dict={name: (library, class_name) for name, (library, class_name, _) in to_load.items()},
        library=diffusers,
        max_memory=model_kwargs.get("max_memory"),
        dtype=dtype,
        cached_folder=str(directory),
    )


def _torch_module():
    import torch

    return torch.nn.Module


def _init_names(cls):
    import inspect

    return set(inspect.signature(cls.__init__).parameters) - {"self"}


def _check_partitions_present(directory: Path, index: Dict[str, Any], task: Optional[str], kwargs) -> None:
    """Fail early, before gigabytes load, when the folder lacks the partition the task needs."""
    if task is None:
        present = [p for p in PARTITIONS if _has_component(directory, index, p) or kwargs.get(p) is not None]
        if not present:
            raise ValueError(f"{directory} holds neither a `transformer/` nor a `transformer_ref/` partition.")
        return
    (partition,) = partitions_for_task(task)
    if kwargs.get(partition) is None and not _has_component(directory, index, partition):
        raise ValueError(
            f"Task {task!r} needs the `{partition}` partition, but {directory} does not hold it. Download it "
            f"(e.g. `hf download MiniMaxAI/MiniMax-H3 --include '{partition}/*'`) or choose a task it supports."
        )


def _has_component(directory: Path, index: Dict[str, Any], name: str) -> bool:
    entry = index.get(name)
    if not entry or entry[0] is None:
        return False
    spec = entry[2] if len(entry) > 2 and isinstance(entry[2], dict) else {}
    return (directory / (spec.get("subfolder") or name)).is_dir()


# Components loaded by transformers, whose weight files are checked here before loading.
TRANSFORMERS_MODEL_COMPONENTS = ("text_encoder",)


def _check_transformers_weights(directory: Path, index: Dict[str, Any], kwargs: Dict[str, Any]) -> None:
    """A truncated or corrupt safetensors file of a transformers component, named before it loads: transformers
    raises `SafetensorError` without the file's name (diffusers' loader names it for the DiT and the VAEs)."""
    for name in TRANSFORMERS_MODEL_COMPONENTS:
        entry = index.get(name)
        if name in kwargs or not isinstance(entry, (list, tuple)) or entry[0] is None:
            continue
        spec = entry[2] if len(entry) > 2 and isinstance(entry[2], dict) else {}
        for file in sorted((directory / (spec.get("subfolder") or name)).glob("*.safetensors")):
            problem = safetensors_problem(file)
            if problem:
                raise OSError(f"Unable to load weights from checkpoint file {file}: {problem}.")


def check_component_files(directory: Path, index: Dict[str, Any], task: Optional[str], kwargs: Dict[str, Any]) -> None:
    """Before anything loads: every component the index lists (and the call does not pass) has its folder, and the
    JSON files of those folders parse. The loaders would otherwise say "no file named config.json found in directory
    <checkpoint>" for a missing `vae/`, or raise a JSONDecodeError that names no file."""
    wanted = partitions_for_task(task)
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, (list, tuple)) or entry[0] is None or name in kwargs:
            continue
        if name in PARTITIONS:  # a missing partition is `_check_partitions_present`'s to explain
            if name not in wanted or not _has_component(directory, index, name):
                continue
        spec = entry[2] if len(entry) > 2 and isinstance(entry[2], dict) else {}
        folder = directory / (spec.get("subfolder") or name)
        if not folder.is_dir():
            raise OSError(
                f"{directory}: {folder.name}/ is missing (the index lists the `{name}` component): copy or download "
                f"it again, or pass `{name}=...` to from_pretrained."
            )
        for file in sorted(folder.glob("*.json")):
            try:
                json.loads(file.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, ValueError) as error:
                raise OSError(f"{file} is not valid JSON ({error}): restore it from the original checkpoint.") from None


def load_pipeline(cls, pretrained_model_name_or_path, task: Optional[str] = None, **kwargs):
    """`MiniMaxH3Pipeline.from_pretrained`: see the module docstring.

    A `quantization_config` (one config, or diffusers' `PipelineQuantizationConfig`) reaches each component's own
    `from_pretrained`, diffusers' or transformers' alike: our formats are registered with both libraries, so the text
    encoder is quantized as it loads and a saved quantized text encoder reloads from its `config.json`.
    """
    return _load_pipeline(cls, pretrained_model_name_or_path, task, kwargs)


def _check_quantized_components(directory: Path, index: Dict[str, Any], task: Optional[str], kwargs) -> None:
    """Before anything loads: refuse a component folder whose quantized tensors its config.json does not explain
    (both loaders would read them as float weights)."""
    from ..quantizers.checkpoint import check_checkpoint_quantization

    wanted = partitions_for_task(task)
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, (list, tuple)) or entry[0] is None or kwargs.get(name) is not None:
            continue
        if name in PARTITIONS and task is not None and name not in wanted:
            continue
        spec = entry[2] if len(entry) > 2 and isinstance(entry[2], dict) else {}
        folder = directory / (spec.get("subfolder") or name)
        if folder.is_dir():
            check_checkpoint_quantization(folder)


def _remember_source(pipe, source: str, passed) -> Any:
    """Record where the pipeline came from as diffusers records it for a model loaded by name (`_name_or_path`): the
    repo id when loaded by repo id, not the cache folder it resolved to (also on the models it loaded, not on those
    passed in). The model cards read it (`base_model`, and the source card's license)."""
    pipe.register_to_config(_name_or_path=source)
    if not os.path.isdir(source):
        from diffusers import ModelMixin

        for name, component in pipe.components.items():
            if isinstance(component, ModelMixin) and name not in passed:
                component.register_to_config(_name_or_path=source)
    return pipe


def _load_nvfp4_text_encoder(directory: Path, index: Dict[str, Any], kwargs: Dict[str, Any]) -> None:
    """Load a text encoder saved in FastVideo's serialized NVFP4 layout (FastH3 consumer stacks) into `kwargs`, as if
    passed in: transformers' own `"nvfp4"` method reads another layout."""
    entry = index.get("text_encoder")
    if "text_encoder" in kwargs or not isinstance(entry, (list, tuple)) or entry[0] is None:
        return
    spec = entry[2] if len(entry) > 2 and isinstance(entry[2], dict) else {}
    folder = directory / (spec.get("subfolder") or "text_encoder")
    if is_fasth3_nvfp4_text_encoder(folder):
        import torch

        dtype = component_dtype(kwargs.get("dtype", kwargs.get("torch_dtype")), "text_encoder")
        kwargs["text_encoder"] = load_nvfp4_text_encoder(folder, dtype=dtype if isinstance(dtype, torch.dtype) else
                                                         torch.float32)  # fmt: skip


def _load_pipeline(cls, pretrained_model_name_or_path, task: Optional[str], kwargs: Dict[str, Any]):
    source, passed = str(pretrained_model_name_or_path), set(kwargs)
    use_kernels = kwargs.pop("use_kernels", False)
    if not isinstance(use_kernels, bool):
        raise TypeError(f"use_kernels must be True or False, got {use_kernels!r}")
    with _transformers_hub_kernels(use_kernels):
        pipe = _load_from_source(cls, source, task, kwargs)
    return _remember_source(pipe, source, passed)


@contextlib.contextmanager
def _transformers_hub_kernels(enabled: bool):
    """Whether the transformers components loaded inside kernelize themselves with kernels fetched from the Hub
    (transformers >= 5.25 does by default when `kernels` is installed, and a load onto CUDA then fails offline). Off
    unless asked for: the load must work offline and run the layers the package was checked with. diffusers' loader
    forwards no `use_kernels` to its transformers components, and transformers reads `USE_HUB_KERNELS` at each
    `from_pretrained`, so the variable is set for the duration of the load and restored after."""
    if enabled:
        yield
        return
    previous = os.environ.get("USE_HUB_KERNELS")
    os.environ["USE_HUB_KERNELS"] = "0"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("USE_HUB_KERNELS", None)
        else:
            os.environ["USE_HUB_KERNELS"] = previous


def _load_from_source(cls, pretrained_model_name_or_path, task: Optional[str], kwargs: Dict[str, Any]):
    wanted = partitions_for_task(task)  # validates `task` before anything is downloaded
    check_dtype(kwargs)
    path = str(pretrained_model_name_or_path)
    check_local_source(path)
    if not os.path.isdir(path):
        hub_kwargs = {k: kwargs.pop(k) for k in HUB_KWARGS if k in kwargs}
        path = resolve_repo(path, task, hub_kwargs)
    directory = Path(path)
    for name in INDEX_FILES:
        try:
            _read_json(directory / name)
        except (UnicodeDecodeError, ValueError) as error:
            raise OSError(f"{directory / name} is not valid JSON ({error}): restore it from the original checkpoint.") from None
    kind = classify_checkpoint(directory)
    if kind not in ("ours", "hub"):
        raise _refusal(directory, kind)
    index = _read_index(directory, kind)
    _check_partitions_present(directory, index, task, kwargs)
    check_component_files(directory, index, task, kwargs)
    _load_nvfp4_text_encoder(directory, index, kwargs)  # FastVideo's serialized NVFP4 layout (transformers cannot)
    _check_transformers_weights(directory, index, kwargs)  # a truncated file first: the next check reads headers
    _check_quantized_components(directory, index, task, kwargs)
    # A FastH3 stack (fastvideo_inference.json): its contract is checked now, its gates / decoder / preset after loading.
    nvfp4_decoder = kwargs.pop("nvfp4_decoder", None)
    fasth3 = check_fasth3_stack(directory)
    if fasth3 is None and nvfp4_decoder is not None:
        raise ValueError(f"nvfp4_decoder= is for FastH3 stacks, but {directory} has no fastvideo_inference.json; "
                         "load the decoder with diffusers_h3.load_nvfp4_decoder(pipe.vae, path)")  # fmt: skip
    if kind == "hub":
        pipe = _load_hub_layout(cls, directory, index, task, kwargs)
    else:
        for partition in PARTITIONS:
            if partition not in wanted:
                kwargs.setdefault(partition, None)
        if "torch_dtype" in kwargs or "dtype" in kwargs:
            kwargs["dtype"] = pop_dtype(kwargs)
        pipe = _DIFFUSERS_FROM_PRETRAINED(cls, path, **kwargs)
    if fasth3 is None:
        return load_gates_without_contract(pipe, directory)
    return apply_fasth3_stack(pipe, directory, fasth3, nvfp4_decoder)
