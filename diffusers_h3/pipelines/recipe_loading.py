"""Loading for a memory budget: the recipe decides how the weights are loaded, not only where they go.

``load_for_memory_budget(path, gpu_gib=16, host_gib=32, shape=RequestShape(...))`` selects the fastest recipe that
fits the request (before anything is read; see :mod:`diffusers_h3.parallel.memory_recipes`), then loads each model
straight into the recipe's weight format (quantized as each weight arrives from a dense checkpoint, or installed as
stored from a pre-quantized one) and places it. For ``low_ram`` the text encoder is loaded first, without its never-run decoder layers, and streamed from disk
leaf by leaf: from its own checkpoint files when they hold it in the recipe's format (a converted checkpoint), else
through diffusers' disk group offload, which writes it to ``offload_folder``; its host memory is released before the
DiT loads.
"""

from __future__ import annotations

import gc
import importlib
import inspect
import json
import os
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch
from diffusers.utils import logging

from ..parallel.memory_model import RequestShape
from ..parallel.memory_recipes import (
    GiB,
    MemoryBudgetConfig,
    MemoryBudgetError,
    MemoryRecipe,
    enable_memory_budget,
    hold_allocator_for_recipe,
    resolve_recipe,
    stream_text_encoder_from_disk,
    text_encoder_stream_placement,
    visible_host_gib,
)
from ..tasks import partition_for_task, partitions_for_task
from .loading import resolve_repo
from .pipeline_minimax_h3 import MiniMaxH3Pipeline


logger = logging.get_logger(__name__)


def _config_of(folder: Path) -> Dict[str, Any]:
    path = folder / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def stored_quant_method(folder: Path) -> Optional[str]:
    """The ``quant_method`` a component folder was saved with (None: dense weights)."""
    config = _config_of(folder).get("quantization_config")
    return None if config is None else str(config.get("quant_method"))


def _format_config(name: str):
    from ..quantizers import get_format

    return get_format(name).config_cls()


def _transformer_format(recipe: MemoryRecipe, device: torch.device) -> str:
    if recipe.spec.transformer_format == "fp8_or_w8a16":
        from .speed_presets import gemm_format

        return gemm_format(device)
    return recipe.spec.transformer_format


def _quantization_plan(directory: Path, recipe: MemoryRecipe, partitions, device) -> Dict[str, Any]:
    """Config per component to quantize while loading (none for a component saved in the recipe's format); refuses
    a component pre-quantized in another format, before loading."""
    from ..quantizers import get_format

    wanted = {p: _transformer_format(recipe, device) for p in partitions}
    wanted["text_encoder"] = recipe.spec.text_encoder_format
    plan = {}
    for component, fmt in wanted.items():
        stored = stored_quant_method(directory / component)
        if stored is None:
            plan[component] = _format_config(fmt)
        elif stored != get_format(fmt).method:
            raise MemoryBudgetError(
                f"{directory / component} is saved as {stored}, but memory recipe {recipe.name!r} needs "
                f"{get_format(fmt).method}",
                "convert the checkpoint for this recipe (docs/memory.md) or use the dense one",
            )
    return plan


def _load_text_encoder_alone(directory: Path, config, dtype, text_encoder_layer: int):
    """The text encoder without its never-run decoder layers (they are never read), quantized as it loads."""
    index = json.loads((directory / "model_index.json").read_text())
    library, class_name = index["text_encoder"][:2]
    cls = getattr(importlib.import_module(library), class_name)
    folder = directory / "text_encoder"
    model_config = cls.config_class.from_pretrained(folder)
    text_config = getattr(model_config, "text_config", model_config)
    keep = text_encoder_layer + 1
    if text_config.num_hidden_layers > keep:
        text_config.num_hidden_layers = keep
        if isinstance(getattr(text_config, "layer_types", None), list):
            text_config.layer_types = text_config.layer_types[:keep]
    # no Hub kernels: the load works offline and runs the layers the package was checked with
    kwargs = {"config": model_config, "dtype": dtype, "use_kernels": False}
    if config is not None:
        kwargs["quantization_config"] = config
    return cls.from_pretrained(str(folder), **kwargs).eval().requires_grad_(False)


def load_for_memory_budget(
    pretrained_model_name_or_path: Union[str, os.PathLike],
    task: Optional[str] = "t2va",
    gpu_gib: Optional[float] = None,
    host_gib: Optional[float] = None,
    *,
    device: Union[str, torch.device] = "cuda",
    recipe: Union[str, MemoryRecipe, None] = None,
    offload_folder: Union[str, os.PathLike, None] = None,
    dtype: torch.dtype = torch.bfloat16,
    cap_gpu: bool = True,
    request_sized_cap: Optional[bool] = None,
    pipeline_class=MiniMaxH3Pipeline,
    transformer_file: Union[str, os.PathLike, None] = None,
    shape: Optional[RequestShape] = None,
    **from_pretrained_kwargs,
):
    """Load and place MiniMax-H3 with the fastest recipe that fits ``gpu_gib`` / ``host_gib`` (None: read the
    visible GPU / host memory). Fails with one :class:`MemoryBudgetError` line before loading when nothing fits.

    Args:
        pretrained_model_name_or_path: the released checkpoint (dense: quantized while loading) or one converted for
            the recipe (pre-quantized: loaded as stored, the fastest to load).
        task: the task, which picks the DiT partition.
        device: where computation runs.
        recipe: force a recipe by name (``"resident"``, ``"offload"``, ``"low_ram"``) instead of selecting one.
        offload_folder: an empty folder on disk for the ``low_ram`` text encoder's offload files when it is quantized
            while loading (a converted checkpoint streams from its own files instead; default: a new
            temporary folder).
        cap_gpu: run PyTorch's allocator as the chosen recipe entry was measured: expandable segments, held to the
            entry's cap, no higher than ``gpu_gib`` (its measured figures hold under that cap), before anything loads.
        request_sized_cap: before each call, hold the allocator to that request's predicted allocations plus headroom
            (``MemoryBudgetConfig.request_sized_cap``); None: as the recipe entry was measured.
        transformer_file: a single-file DiT (bf16, fp8-scaled or GGUF: docs/checkpoints.md) for the task's partition
            instead of the checkpoint's. It loads in the file's own format and, under a streaming recipe, stays in
            host memory and is offloaded block by block (only a checkpoint converted for the recipe streams its DiT
            from disk): the recipe's host need grows by the file's size, which is refused before anything loads
            when the host budget is smaller.
        shape: the requests to fit (a :class:`~diffusers_h3.parallel.memory_model.RequestShape`: task, canvas,
            frames, text rows, references, LoRA rank): the recipe and its settings are chosen for what the memory
            model predicts that request needs (default: the measured 768x1344x124 requests). When nothing fits, the
            one error line names the longest clip at this canvas and the largest canvas at this length that fit.
        from_pretrained_kwargs: passed to ``from_pretrained`` (e.g. ``text_encoder_layer``).

    Returns:
        The placed pipeline; ``describe(pipe)["placement"]`` names the recipe and where each component streams from.
    """
    device = torch.device(device)
    recipe = resolve_recipe(recipe, gpu_gib, host_gib, device, shape)  # before anything is read
    if from_pretrained_kwargs.get("quantization_config") is not None:
        raise MemoryBudgetError("load_for_memory_budget picks the weight formats of its recipe: drop "
                                "quantization_config (or load with from_pretrained and place the pipeline yourself)")
    path = str(pretrained_model_name_or_path)
    if not os.path.isdir(path):
        path = resolve_repo(path, task, {})
    directory = Path(path)
    partitions = partitions_for_task(task)
    file_partition = None
    if transformer_file is not None:
        file_partition = partition_for_task(task)
        _check_host_for_transformer_file(recipe, transformer_file, host_gib)
        partitions = [name for name in partitions if name != file_partition]
    plan = _quantization_plan(directory, recipe, partitions, device)
    logger.info(recipe.line())
    allocator = hold_allocator_for_recipe(recipe, gpu_gib, device) if cap_gpu else None

    components = {}
    if recipe.spec.text_encoder_placement == "disk":
        default_layer = inspect.signature(pipeline_class.__init__).parameters["text_encoder_layer"].default
        layer = int(from_pretrained_kwargs.get("text_encoder_layer", default_layer))
        quantize_while_loading = plan.pop("text_encoder", None)
        text_encoder = _load_text_encoder_alone(directory, quantize_while_loading, dtype, layer)
        # Saved in the recipe's format: its own files are the stream's source. Quantized while loading: the files
        # hold other tensors, so diffusers' disk offload writes the quantized ones once.
        checkpoint_folder = None if quantize_while_loading is not None else directory / "text_encoder"
        where = stream_text_encoder_from_disk(text_encoder, device, offload_folder, checkpoint_folder)
        components["text_encoder"] = text_encoder
        gc.collect()  # the text encoder's host copy goes before the DiT arrives
    if file_partition is not None:
        from ..loaders.single_file import load_transformer_file, transformer_file_record

        components[file_partition] = load_transformer_file(transformer_file, directory / file_partition, dtype=dtype)
        logger.info(f"memory recipe {recipe.name!r}: {file_partition} from "
                    f"{transformer_file_record(components[file_partition]).summary()}")  # fmt: skip
    if plan:
        from diffusers.quantizers import PipelineQuantizationConfig

        from_pretrained_kwargs["quantization_config"] = PipelineQuantizationConfig(quant_mapping=plan)
    pipe = pipeline_class.from_pretrained(path, task=task, dtype=dtype, **components, **from_pretrained_kwargs)
    if "text_encoder" in components:
        from ..parallel.placement import _record_placement

        _record_placement(pipe, text_encoder=text_encoder_stream_placement(where, checkpoint_folder, text_encoder))
    if recipe.spec.transformer_placement == "offload" and recipe.spec.text_encoder_placement == "disk":
        # A converted checkpoint holds the DiT as it runs: read it from its files at every forward instead of
        # keeping it in host memory (and the VAEs once per stage), with the activations the recipe chunks.
        stored = {name for name in partitions if name not in plan}
        if len(stored) < len(partitions):
            logger.warning(
                f"memory recipe {recipe.name!r}: {directory} holds a dense DiT, quantized while loading, so it stays in "
                "host memory (about 17.5 GiB more than the measured need, which is for a converted checkpoint): "
                "convert the checkpoint once to stream it from disk (docs/memory.md)"
            )
        stream_components_from_checkpoint(pipe, directory, device, recipe_settings(recipe), stored)
    enable_memory_budget(pipe, MemoryBudgetConfig(gpu_gib, host_gib, device=device, recipe=recipe,
                                                  offload_folder=offload_folder, cap_gpu=False,
                                                  request_sized_cap=request_sized_cap))  # fmt: skip
    if allocator is not None:
        from ..parallel.placement import _record_placement

        _record_placement(pipe, allocator=allocator)
    return pipe


def _check_host_for_transformer_file(recipe: MemoryRecipe, transformer_file, host_gib: Optional[float]) -> None:
    """Refuse (one line, before loading) a single-file DiT that the host budget cannot hold beside the recipe: the
    file's DiT stays in host memory under a streaming recipe, on top of the recipe's measured host need."""
    from ..loaders.single_file import check_transformer_file_path

    path = check_transformer_file_path(transformer_file)
    if recipe.spec.transformer_placement == "resident":
        return  # the DiT moves to the GPU: the recipe's GPU need already counts it
    file_gib = path.stat().st_size / GiB
    if host_gib is not None:
        budget, source = host_gib, "the budget given"
    else:
        budget, source = visible_host_gib()[0], "the host memory visible"
    need = recipe.host_gib + file_gib
    if need > budget:
        raise MemoryBudgetError(
            f"memory recipe {recipe.name!r} with the DiT from {path.name} needs about {need:.2f} GiB of host memory "
            f"({recipe.host_gib:.2f} measured + {file_gib:.2f} for the file's DiT, which stays in host memory), "
            f"{source} is {budget:.2f} GiB",
            "convert the checkpoint for the recipe so the DiT streams from disk (docs/memory.md), or use a smaller "
            "file (e.g. GGUF Q4_K)",
        )


# What a recipe's measured case ran with (``settings`` of its table entry); what is absent takes these defaults.
DEFAULT_RECIPE_SETTINGS = {"read_ahead": 2, "ffn_chunk_rows": None, "stream_vae": True, "attention_head_groups": None}


def recipe_settings(recipe: MemoryRecipe) -> Dict[str, Any]:
    """The streaming and activation settings of ``recipe`` (its table entry's ``settings`` over the defaults)."""
    settings = dict(DEFAULT_RECIPE_SETTINGS)
    settings.update(getattr(recipe, "settings", None) or {})
    unknown = sorted(set(settings) - set(DEFAULT_RECIPE_SETTINGS))
    if unknown:
        raise MemoryBudgetError(f"memory recipe {recipe.name!r} has unknown settings {unknown}: this version knows "
                                f"{sorted(DEFAULT_RECIPE_SETTINGS)}")  # fmt: skip
    return settings


def stream_components_from_checkpoint(pipe, directory, device, settings: Dict[str, Any], partitions=()) -> Dict[str, str]:
    """Stream ``partitions`` (DiT partitions stored in the format they run in) and, with ``settings["stream_vae"]``,
    the VAEs from their files in ``directory`` (:func:`~diffusers_h3.parallel.checkpoint_streaming.
    stream_from_checkpoint`; the VAE's groups stay on the device while a stage encodes or decodes); chunk the DiT's
    feed-forward over ``settings["ffn_chunk_rows"]`` rows; make video sparse attention enabled later run over
    ``settings["attention_head_groups"]`` groups of heads. Returns (and records) each component's placement."""
    from ..hooks.feed_forward_chunks import FeedForwardChunking, enable_feed_forward_chunking
    from ..parallel.checkpoint_streaming import StreamingConfig, stream_from_checkpoint, streaming_of
    from ..parallel.placement import _record_placement

    device = torch.device(device)
    directory = Path(directory)
    placements: Dict[str, str] = {}
    names = [(name, False) for name in partitions]
    names += [("vae", True), ("audio_vae", True)] if settings["stream_vae"] else []
    for name, hold in names:
        component = getattr(pipe, name, None)
        if not isinstance(component, torch.nn.Module) or streaming_of(component) is not None:
            continue
        # held groups (a VAE's encoder, its decoder) are read when their stage starts: nothing to read ahead
        config = StreamingConfig(read_ahead=0 if hold else int(settings["read_ahead"]), hold=hold)
        stream_from_checkpoint(component, directory / name, device, config)
        placements[name] = streaming_of(component).describe()
    rows = settings["ffn_chunk_rows"]
    if rows:
        enable_feed_forward_chunking(pipe, FeedForwardChunking(rows=int(rows)))
        placements["feed_forward"] = f"chunked over {int(rows)} rows"
    groups = settings["attention_head_groups"]
    if groups:
        from ..attention_processors.vsa import set_vsa_head_groups

        set_vsa_head_groups(pipe, int(groups))
        placements["attention"] = f"video sparse attention, when enabled, over {int(groups)} head groups in turn"
    _record_placement(pipe, **placements)
    return placements
