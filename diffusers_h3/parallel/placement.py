"""Placement recipes: where the 33 B DiT, the 32 B text encoder and the VAEs live, per hardware class.

Each recipe is one call around diffusers / Accelerate machinery (quantization configs, group offloading, device maps):

| hardware | recipe |
|---|---|
| one 80 GB GPU, everything resident | `from_pretrained(..., **single_gpu_resident_kwargs())`, `drop_unused_text_encoder_layers(pipe)`, `pipe.to("cuda")` |
| one 24-48 GB GPU | `enable_low_memory_offload(pipe, "cuda")` (group offload: DiT by blocks, text encoder by leaves) |
| two or more GPUs, one component per GPU | `from_pretrained(..., **balanced_kwargs({0: "70GiB", 1: "70GiB"}))` |
| GPUs too small for one DiT replica | `MiniMaxH3Transformer3DModel.from_pretrained(..., **split_transformer_kwargs(...))` |

Peak memory of the single-GPU recipes is measured by `benchmarks/placement.py` (`placement_h200.json`).
"""

from typing import Any, Dict, Optional, Union

import torch

from .._hooks import (
    H3_CHECKPOINT_STREAM_MODEL_HOOK,
    H3_STREAM_FROM_DISK_HOOK,
    PARTITIONS,
    get_h3_hook,
)
from ..quantizers import tensor_nbytes


def single_gpu_resident_kwargs(transformer: str = "fp8", text_encoder: str = "w8a16") -> Dict[str, Any]:
    """`from_pretrained` kwargs for one 80 GB GPU: 8-bit DiT (`"fp8"`: FP8 GEMMs, SM89+; `"w8a16"`: any GPU) and a
    W8A16 text encoder, so that the whole pipeline stays resident (weights about half of bf16's; docs/multi_gpu.md)."""
    from diffusers.quantizers import PipelineQuantizationConfig

    from ..quantizers import FP8Config, W8A16Config

    configs = {"fp8": FP8Config, "w8a16": W8A16Config}
    for who, choice in (("transformer", transformer), ("text_encoder", text_encoder)):
        if choice not in configs:
            raise ValueError(f"{who}={choice!r}: choose one of {sorted(configs)}.")
    mapping = {"transformer": configs[transformer](), "text_encoder": configs[text_encoder]()}
    mapping["transformer_ref"] = configs[transformer]()
    return {"quantization_config": PipelineQuantizationConfig(quant_mapping=mapping)}


def drop_unused_text_encoder_layers(pipe) -> Dict[str, Any]:
    """Delete the Qwen3-VL decoder layers that H3 never runs (in place); returns what was kept and freed.

    The pipeline reads `hidden_states[text_encoder_layer]` (50 by default) and stops the text encoder there, so decoder
    layers `text_encoder_layer + 1 ..` (13 of Qwen3-VL-32B's 64, docs/multi_gpu.md) are dead
    weight. Layer `text_encoder_layer` itself is kept so the pipeline's layer check still holds. Outputs are unchanged
    (the removed layers never run); the text encoder can no longer be used for generation or saved as the full model.
    Call it before moving the pipeline to the GPU; `describe(pipe)` reports it.
    """
    text_encoder = getattr(pipe, "text_encoder", None)
    if text_encoder is None:
        raise ValueError("drop_unused_text_encoder_layers needs a pipeline with a text encoder (this one has none).")
    language_model = getattr(text_encoder.model, "language_model", text_encoder.model)
    layers = language_model.layers
    keep = int(pipe.config.text_encoder_layer) + 1
    removed = list(layers)[keep:]
    freed = sum(tensor_nbytes(t) for layer in removed for t in list(layer.parameters()) + list(layer.buffers()))
    if removed:
        language_model.layers = torch.nn.ModuleList(list(layers)[:keep])
        text_config = text_encoder.config.text_config
        text_config.num_hidden_layers = keep
        if isinstance(getattr(text_config, "layer_types", None), list):
            text_config.layer_types = text_config.layer_types[:keep]
    record = {"kept_layers": keep, "removed_layers": len(removed), "freed_gib": round(freed / 2**30, 2)}
    _record_placement(pipe, text_encoder_layers=(
        f"{keep} decoder layers kept, {len(removed)} never-run layers removed ({record['freed_gib']} GiB freed)"
    ))  # fmt: skip
    return record


# A pipeline is no module and has no hook registry: the recipes' record of where each component went is kept on the
# pipeline object under this attribute (read with `placement_of`).
_PLACEMENT_ATTRIBUTE = "_diffusers_h3_placement"


def _record_placement(pipe, **entries: str) -> None:
    """Add to what the recipes applied to `pipe` (`describe(pipe)["placement"]`)."""
    setattr(pipe, _PLACEMENT_ATTRIBUTE, {**placement_of(pipe), **entries})


def placement_of(pipe) -> Dict[str, str]:
    """`{component: placement}` the placement recipes applied to `pipe` (empty when none ran)."""
    return dict(getattr(pipe, _PLACEMENT_ATTRIBUTE, None) or {})


def balanced_kwargs(max_memory: Dict[Union[int, str], str]) -> Dict[str, Any]:
    """`from_pretrained` kwargs placing whole components over several GPUs (diffusers' `device_map="balanced"`);
    `max_memory` caps each device, e.g. `{0: "75GiB", 1: "75GiB"}`. Tensors follow each component's device."""
    if not max_memory:
        raise ValueError("balanced_kwargs needs max_memory, e.g. {0: '75GiB', 1: '75GiB'}.")
    return {"device_map": "balanced", "max_memory": dict(max_memory)}


def split_transformer_kwargs(
    max_memory: Dict[Union[int, str], str], offload_folder: Optional[str] = None
) -> Dict[str, Any]:
    """`MiniMaxH3Transformer3DModel.from_pretrained` kwargs splitting the DiT by blocks over the devices in
    `max_memory` (Accelerate's `device_map="auto"`; whole `MiniMaxH3TransformerBlock`s, per the class's
    `_no_split_modules`). `"cpu"` and `"disk"` entries (with `offload_folder`) take what the GPUs cannot hold."""
    if not max_memory:
        raise ValueError("split_transformer_kwargs needs max_memory, e.g. {0: '30GiB', 1: '30GiB'}.")
    kwargs: Dict[str, Any] = {"device_map": "auto", "max_memory": dict(max_memory)}
    if offload_folder is not None:
        kwargs["offload_folder"] = offload_folder
    return kwargs


def _has_weight_norm(module: torch.nn.Module) -> bool:
    # Weight norm recomputes `weight` from `weight_g`/`weight_v` in a forward pre-hook (or a parametrization): group
    # offloading moves parameters around that hook and breaks it, so such modules move as a whole instead.
    for sub in module.modules():
        if hasattr(sub, "weight_g") or getattr(sub, "parametrizations", None) is not None:
            return True
    return False


def _offload_leaf_level(component: torch.nn.Module, options: Dict[str, Any]) -> None:
    from diffusers.hooks import HookRegistry, apply_group_offloading

    apply_group_offloading(component, offload_type="leaf_level", **options)
    # Without streams no hook sits on the top module; the pipeline looks for one there to send the encoder's inputs
    # to the execution device rather than to where the offloaded weights rest.
    HookRegistry.check_if_exists_or_initialize(component)


def enable_low_memory_offload(
    pipe,
    device: Union[str, torch.device] = "cuda",
    *,
    num_blocks_per_group: int = 1,
    use_stream: Optional[bool] = None,
    low_cpu_mem_usage: bool = False,
) -> Dict[str, str]:
    """One 24-48 GB GPU: diffusers' group offloading for the DiT partitions (block level) and the text encoder (leaf
    level), model offload for the rest (the VAEs; the audio VAE's weight norm cannot be group-offloaded, so it always
    moves as a whole).

    The text encoder is offloaded leaf by leaf because the pipeline runs `text_encoder.model` only up to the layer it
    reads (early exit), never the top-level forward, and Qwen3-VL has no top-level block list: block-level offloading
    would make the whole encoder one group hooked on a forward that never runs (its weights would stay on the CPU).
    Each leaf (Linear, quantized Linear, norm, embedding) onloads itself when it runs, whatever calls it.

    Args:
        pipe: a `MiniMaxH3Pipeline` on the CPU.
        device: where computation runs.
        num_blocks_per_group: transformer blocks onloaded together (diffusers uses 1 when streams are on).
        use_stream: prefetch the next group on a CUDA stream (default: on when `device` is CUDA).
        low_cpu_mem_usage: with streams, pin each group's weights on the fly at every transfer instead of keeping a
            pinned copy of all of them (diffusers' `low_cpu_mem_usage`). False (diffusers' default) transfers
            faster, but the pinned copies of all the DiT's groups are made before its weights are released, and
            pinned sizes round up to powers of two: well over the DiT's weights in host memory during this call.
            True keeps host memory at the weights once, at the cost of a host copy per transfer.

    Returns:
        `{component: placement}`, what each component got.
    """
    from accelerate import cpu_offload_with_hook
    from diffusers.hooks import apply_group_offloading

    device = torch.device(device)
    if use_stream is None:
        use_stream = device.type == "cuda"
    if use_stream and device.type != "cuda":
        raise ValueError(f"use_stream=True needs a CUDA device, got {device}.")
    block_level = PARTITIONS
    leaf_level = ("text_encoder",)
    placements: Dict[str, str] = {}
    previous_hook = None
    common = {"onload_device": device, "offload_device": torch.device("cpu"), "use_stream": use_stream,
              "low_cpu_mem_usage": low_cpu_mem_usage}  # fmt: skip
    settings = f"stream={use_stream}, low_cpu_mem_usage={low_cpu_mem_usage}"
    from diffusers.hooks.group_offloading import _is_group_offload_enabled

    already = placement_of(pipe)
    for name, component in pipe.components.items():
        if not isinstance(component, torch.nn.Module):
            continue
        streamed = get_h3_hook(component, H3_STREAM_FROM_DISK_HOOK) or get_h3_hook(component, H3_CHECKPOINT_STREAM_MODEL_HOOK)
        if _is_group_offload_enabled(component) or streamed is not None:
            # placed before: a component streamed from disk (offload files or its own checkpoint files)
            placements[name] = already.get(name, "group offload (applied before)")
            continue
        group_offloaded = name in block_level or name in leaf_level
        if group_offloaded and not _has_weight_norm(component):
            if name in block_level:
                apply_group_offloading(
                    component, offload_type="block_level", num_blocks_per_group=num_blocks_per_group, **common
                )
                placements[name] = f"group offload (block level, {num_blocks_per_group} block(s), {settings})"
            else:
                _offload_leaf_level(component, common)
                placements[name] = f"group offload (leaf level, {settings})"
        else:
            _, previous_hook = cpu_offload_with_hook(component, device, prev_module_hook=previous_hook)
            reason = " (weight norm: no group offload)" if group_offloaded else ""
            placements[name] = f"model offload{reason}"
    _record_placement(pipe, **placements)
    return placements


TEXT_ENCODER_PLACEMENTS = ("resident", "offload")


def place_for_context_parallel(
    pipe, device: Union[str, torch.device, None] = None, *, text_encoder: str = "resident"
) -> Dict[str, str]:
    """Context-parallel placement, called in every rank instead of `pipe.to(device)`.

    Under context parallelism only rank 0 runs the text encoder (its output is broadcast), so the other ranks need
    it nowhere near their GPU: every rank puts the DiT partitions and the VAEs on its device; rank 0 also the text
    encoder, `"resident"` (whole, on the GPU) or `"offload"` (leaf-level group offload with CUDA-stream prefetch:
    a few layers on the GPU at a time, for a GPU that cannot hold a DiT replica and the encoder together, e.g. a bf16
    DiT on 80 GB); the other ranks leave it on the CPU, never run. Creates the process group through Accelerate if
    none exists (as `enable_context_parallel` does).

    Args:
        pipe: a `MiniMaxH3Pipeline`, on the CPU.
        device: this rank's device (default: `cuda:<LOCAL_RANK>` when CUDA is available, else `cpu`).
        text_encoder: `"resident"` or `"offload"`, rank 0's text encoder.

    Returns:
        `{component: placement}` for this rank (also in `describe(pipe)["placement"]`).
    """
    import os

    import torch.distributed as dist

    from .context_parallel import _ensure_process_group

    if text_encoder not in TEXT_ENCODER_PLACEMENTS:
        raise ValueError(f"text_encoder must be one of {TEXT_ENCODER_PLACEMENTS}, got {text_encoder!r}.")
    _ensure_process_group()
    rank = dist.get_rank()
    if device is None:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    placements: Dict[str, str] = {}
    for name, component in pipe.components.items():
        if not isinstance(component, torch.nn.Module):
            continue
        if name != "text_encoder" or (rank == 0 and text_encoder == "resident"):
            component.to(device)
            placements[name] = str(device)
        elif rank != 0:
            component.to("cpu")
            placements[name] = "cpu (rank 0 encodes the prompt; never run here)"
        else:
            use_stream = device.type == "cuda"
            options = {"onload_device": device, "offload_device": torch.device("cpu"), "use_stream": use_stream,
                       "low_cpu_mem_usage": True}  # fmt: skip
            component.to("cpu")
            _offload_leaf_level(component, options)
            placements[name] = f"group offload (leaf level, stream={use_stream}, low_cpu_mem_usage=True), rank 0"
    _record_placement(pipe, **placements)
    return placements
