"""Tensor parallelism (Megatron-style head and FFN-column split) for the MiniMax-H3 DiT.

diffusers' own tensor parallelism needs a `_tp_plan` (H3 has none) and refuses quantized weights and LoRA layers, so
the plan lives here and the split is done in place on whatever layer type sits at each position:

* column parallel (no communication): `to_q` / `to_k` / `to_v` (or the fused `to_qkv`, each third split), VSA's
  `to_gate_compress`, and the FFN up projection, whose packed `[up | gate]` halves are split consistently. Each rank
  keeps `heads / tp_degree` heads (`attn.heads` becomes the local count; the per-head `norm_q` / `norm_k` are shared
  by all heads and stay replicated);
* row parallel: `to_out[0]` and the FFN down projection take their input columns; the partial outputs are reduced
  ONCE per attention and once per FFN, by a hook (`H3_TENSOR_PARALLEL_REDUCE_HOOK`, in its diffusers `HookRegistry`)
  on the attention / FFN module (so that loading or unloading a LoRA, which replaces the linears, keeps the
  reduction); the transformer's own `H3_TENSOR_PARALLEL_HOOK` holds the `TensorParallelRecord`;
* everything else (embedders, AdaLN modulation, norms, output heads) is replicated. Audio and text rows share the
  block stack, so the same split serves every modality. The token refiner is split the same way as the blocks: its
  weights are a block's worth each, and it is the only other place with heads.

Layers: `nn.Linear` (any dtype, or a diffusers-h3 quantized weight, whose slices keep the codes with their scales;
scale groups never straddle a shard), and PEFT LoRA layers over either (column parallel
splits `lora_B`'s rows, row parallel `lora_A`'s columns). LoRA is loaded BEFORE `enable_tensor_parallel`; loading one
afterwards is refused with one error line.

Reduction (deterministic): every rank all-gathers the partial outputs and adds them in rank order,
`((p0 + p1) + p2) + ...`, in `reduce_dtype` (default: the partials' dtype), then casts back. The same inputs give
bitwise the same output run to run and on every rank, unlike a ring/tree all-reduce whose summation order depends
on the backend. The cost is `tp_degree` partial-sized buffers per reduction instead of one.
"""

import dataclasses
import hashlib
import json
import os
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .._hooks import (
    H3_TENSOR_PARALLEL_HOOK,
    H3_TENSOR_PARALLEL_REDUCE_HOOK,
    H3Hook,
    h3_record,
    register_h3_hook,
    transformers_of,
)
from ..quantizers import FP8Tensor, quantized_weight, tensor_nbytes
from .context_parallel import context_parallel_state


@dataclasses.dataclass
class TensorParallelRecord:
    """What `enable_tensor_parallel` set up on a transformer (`tensor_parallel_state` returns it as a dict)."""

    tp_degree: int
    rank: int
    reduction: str
    reduce_dtype: str
    heads_per_rank: int
    token_refiner: str
    split_layers: int
    parameter_bytes_per_rank: int
    split_bytes_per_rank: int
    replicated_bytes: int
    unsplit_model_bytes: int  # before the split (dense layers: exactly `replicated + tp_degree * split`)
    loaded_from: Optional[str] = None  # the folder `load_transformer_tensor_parallel` read this rank's slices from

    def as_dict(self) -> Dict[str, Any]:
        state = dataclasses.asdict(self)
        if state["loaded_from"] is None:
            del state["loaded_from"]
        return state


# ----------------------------------------------------------------------------------------------------------------------
# The plan: which linear is split how
# ----------------------------------------------------------------------------------------------------------------------
def _packed_halves(feed_forward: nn.Module) -> int:
    """2 when the up projection packs `[up | gate]` (SwiGLU / GEGLU: `chunk(2, dim=-1)` in the activation), else 1."""
    from diffusers.models.activations import GEGLU, SwiGLU

    return 2 if isinstance(feed_forward.net[0], (SwiGLU, GEGLU)) else 1


def tensor_parallel_plan(model: nn.Module) -> Dict[str, Any]:
    """`{"column": {path: chunks}, "row": [paths], "attention": [paths], "feed_forward": [paths]}` for `model`."""
    from diffusers.models.attention import FeedForward
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Attention

    column, row, attention, feed_forward = {}, [], [], []
    for name, module in model.named_modules():
        if isinstance(module, MiniMaxH3Attention):
            attention.append(name)
            if getattr(module, "fused_projections", False) and getattr(module, "to_qkv", None) is not None:
                column[f"{name}.to_qkv"] = 3
            for projection in ("to_q", "to_k", "to_v", "to_gate_compress"):
                if getattr(module, projection, None) is not None:
                    column[f"{name}.{projection}"] = 1
            row.append(f"{name}.to_out.0")
        elif isinstance(module, FeedForward):
            feed_forward.append(name)
            column[f"{name}.net.0.proj"] = _packed_halves(module)
            row.append(f"{name}.net.2")
    return {"column": column, "row": row, "attention": attention, "feed_forward": feed_forward}


def _is_lora_layer(module: nn.Module) -> bool:
    return hasattr(module, "base_layer") and hasattr(module, "lora_A") and hasattr(module, "lora_B")


def _base_of(module: nn.Module) -> nn.Module:
    while _is_lora_layer(module):
        module = module.base_layer
    return module


def _features(layer: nn.Module, dim: int) -> int:
    return layer.out_features if dim == 0 else layer.in_features


def _ranges(features: int, rank: int, world: int, chunks: int) -> List[Tuple[int, int]]:
    part = features // chunks
    width = part // world
    return [(c * part + rank * width, c * part + (rank + 1) * width) for c in range(chunks)]


def _slice(tensor: torch.Tensor, dim: int, ranges) -> torch.Tensor:
    pieces = [tensor.narrow(dim, a, b - a) for a, b in ranges]
    return (torch.cat(pieces, dim) if len(pieces) > 1 else pieces[0]).contiguous()


def _check_layer(path: str, layer: nn.Module, dim: int, world: int, chunks: int) -> None:
    """Everything that could make the split wrong, checked before anything is changed."""
    if _is_lora_layer(layer):
        for adapter, magnitude in getattr(layer, "lora_magnitude_vector", {}).items():
            raise ValueError(f"`{path}` carries a DoRA adapter ({adapter!r}); DoRA is not supported under tensor "
                             "parallelism. Use a plain LoRA.")  # fmt: skip
        if dim == 1 and any(b.bias is not None for b in layer.lora_B.values()):
            raise ValueError(f"`{path}` has a LoRA with a `lora_B` bias; under row parallelism it would be added "
                             "tp_degree times. Load the LoRA without a bias.")  # fmt: skip
    base = _base_of(layer)
    if isinstance(base, nn.Linear):
        features = _features(base, dim)
        if features % (chunks * world):
            raise ValueError(f"`{path}`: {features} features do not split into {chunks} x {world} equal shards.")
        weight = quantized_weight(base)
        for rank in range(world) if weight is not None else ():
            for start, stop in _ranges(features, rank, world, chunks):
                problem = weight.slice_problem(dim, start, stop)
                if problem is not None:
                    raise ValueError(f"`{path}` ({weight.layer_label}) cannot be split {world} ways: {problem}.")
    else:
        raise TypeError(
            f"`{path}` is a {type(base).__name__}, which tensor parallelism cannot split; it handles nn.Linear "
            "(dense or with a diffusers-h3 quantized weight) and PEFT LoRA layers over it."
        )


@torch.no_grad()
def _shard_linear(layer: nn.Module, dim: int, rank: int, world: int, chunks: int) -> Optional[torch.Tensor]:
    """Split `layer` in place; returns the bias a row-parallel layer must add once after the reduction."""
    moved_bias = None
    if _is_lora_layer(layer):
        moved_bias = _shard_linear(layer.base_layer, dim, rank, world, chunks)
        features = layer.out_features if dim == 0 else layer.in_features
        ranges = _ranges(features, rank, world, chunks)
        factors = layer.lora_B if dim == 0 else layer.lora_A
        for factor in factors.values():
            factor.weight = nn.Parameter(_slice(factor.weight, dim, ranges), requires_grad=factor.weight.requires_grad)
            if dim == 0:
                if factor.bias is not None:
                    factor.bias = nn.Parameter(_slice(factor.bias, 0, ranges), requires_grad=False)
                factor.out_features = factor.weight.shape[0]
            else:
                factor.in_features = factor.weight.shape[1]
        if dim == 0:
            layer.out_features = sum(b - a for a, b in ranges)
        else:
            layer.in_features = sum(b - a for a, b in ranges)
        return moved_bias
    if isinstance(layer, nn.Linear):
        ranges = _ranges(_features(layer, dim), rank, world, chunks)
        layer.weight = nn.Parameter(_slice(layer.weight, dim, ranges), requires_grad=layer.weight.requires_grad)
        if dim == 0:
            if layer.bias is not None:
                layer.bias = nn.Parameter(_slice(layer.bias, 0, ranges), requires_grad=layer.bias.requires_grad)
            layer.out_features = layer.weight.shape[0]
        else:
            layer.in_features = layer.weight.shape[1]
    if dim == 1 and layer.bias is not None:
        moved_bias = layer.bias.detach()
        layer.bias = None
    return moved_bias


# ----------------------------------------------------------------------------------------------------------------------
# The reduction
# ----------------------------------------------------------------------------------------------------------------------
def _resolve_group(group):
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "This transformer is tensor parallel but no process group exists: launch one process per rank "
            "(`torchrun --nproc-per-node N`) and call torch.distributed.init_process_group before the forward."
        )
    return group if group is not None else dist.group.WORLD


def ordered_sum_reduce(partial: torch.Tensor, group=None, reduce_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Sum of every rank's `partial`, added in rank order (`((p0 + p1) + p2) + ...`) in `reduce_dtype` (default:
    `partial.dtype`); bitwise the same on every rank and on every run."""
    group = _resolve_group(group)
    world = dist.get_world_size(group)
    backend = str(dist.get_backend(group))
    on_cpu = "gloo" in backend and partial.device.type != "cpu"  # gloo moves host tensors
    send = (partial.cpu() if on_cpu else partial).contiguous()
    parts = [torch.empty_like(send) for _ in range(world)]
    dist.all_gather(parts, send, group=group)
    dtype = reduce_dtype or partial.dtype
    total = parts[0].to(dtype)
    for part in parts[1:]:
        total = total + part.to(dtype)
    return total.to(device=partial.device, dtype=partial.dtype)


class _RowParallelReduce(H3Hook):
    """Hook of an attention / FFN module: reduce the row-parallel partial output, then add the bias once."""

    def __init__(self, group, reduce_dtype: Optional[torch.dtype], bias: Optional[torch.Tensor]):
        super().__init__()
        self.group = group
        self.reduce_dtype = reduce_dtype
        self.bias = bias

    def post_forward(self, module, output):
        output = ordered_sum_reduce(output, self.group, self.reduce_dtype)
        if self.bias is not None:
            output = output + self.bias.to(device=output.device, dtype=output.dtype)
        return output


def _refuse_lora_after_tensor_parallel(*args, **kwargs):
    raise RuntimeError(
        "This transformer is already tensor parallel: load LoRA adapters before enable_tensor_parallel (their "
        "factors are split with the layers), not after."
    )


class _TensorParallelHook(H3Hook):
    """On the transformer: holds the `TensorParallelRecord` and refuses a forward once context parallelism is also on.
    While registered, LoRA loading on the model is refused (its factors must be split with the layers)."""

    def initialize_hook(self, module):
        module.load_lora_adapter = _refuse_lora_after_tensor_parallel
        module.add_adapter = _refuse_lora_after_tensor_parallel
        return module

    def deinitalize_hook(self, module):
        for name in ("load_lora_adapter", "add_adapter"):
            module.__dict__.pop(name, None)
        return module

    def pre_forward(self, module, *args, **kwargs):
        _check_not_context_parallel(module)
        return args, kwargs


def _check_not_context_parallel(model):
    if context_parallel_state(model) is not None:
        raise RuntimeError(
            "Tensor and context parallelism are both enabled on this transformer; combining them (TP inside a node, "
            "CP across, world = tp * cp) is not supported yet. Use one of them."
        )


# ----------------------------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------------------------
def _bytes_of(module: nn.Module) -> int:
    tensors = {id(t): t for t in list(module.parameters()) + list(module.buffers())}
    return sum(tensor_nbytes(t) for t in tensors.values())


def _check_degree(model: nn.Module, tp_degree: int) -> None:
    heads = model.config.num_attention_heads
    if heads % tp_degree:
        divisors = [d for d in range(2, heads + 1) if heads % d == 0]
        raise ValueError(f"tp_degree={tp_degree} does not divide the head count ({heads}); use one of {divisors}.")
    if model.config.ffn_dim % tp_degree:
        raise ValueError(f"tp_degree={tp_degree} does not divide ffn_dim ({model.config.ffn_dim}).")


def _check_same_on_every_rank(description: Dict[str, Any], group) -> None:
    digest = hashlib.sha256(json.dumps(description, sort_keys=True, default=str).encode()).hexdigest()
    digests: List[Optional[str]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, digest, group=group)
    if len(set(digests)) != 1:
        differing = [rank for rank, d in enumerate(digests) if d != digests[0]]
        raise ValueError(
            f"Tensor parallel setup differs across ranks (ranks {differing} differ from rank 0: model config, "
            "quantization, LoRA or arguments); every rank must build the same model and call enable_tensor_parallel "
            "with the same arguments."
        )


def _model_description(model: nn.Module, tp_degree: int, reduce_dtype) -> Dict[str, Any]:
    layers = {name: f"{type(m).__name__}{tuple(getattr(m, 'weight', torch.empty(0)).shape)}"
              for name, m in model.named_modules() if hasattr(m, "in_features")}  # fmt: skip
    config = {k: v for k, v in model.config.items() if not k.startswith("_")}
    return {"tp_degree": tp_degree, "reduce_dtype": str(reduce_dtype), "config": config, "layers": layers}


def _apply_tensor_parallel(model, rank: int, tp_degree: int, group, reduce_dtype, split: bool = True) -> None:
    """Split `model` in place as rank `rank` of `tp_degree` (unless `split=False`: the loader read the slices) and
    install the reductions. The caller has checked everything."""
    plan = tensor_parallel_plan(model)
    split_paths = [*plan["column"], *plan["row"]]
    unsplit_bytes = _bytes_of(model)
    row_biases = dict.fromkeys(plan["row"])
    if split:
        for path, chunks in plan["column"].items():
            _shard_linear(model.get_submodule(path), 0, rank, tp_degree, chunks)
        row_biases = {path: _shard_linear(model.get_submodule(path), 1, rank, tp_degree, 1) for path in plan["row"]}
    for path in plan["row"]:
        weight = quantized_weight(_base_of(model.get_submodule(path)))
        if isinstance(weight, FP8Tensor):  # FP8: per-token activation scales from the whole row
            weight.input_shard_group = group if group is not None else dist.group.WORLD
    for path in plan["attention"]:
        attn = model.get_submodule(path)
        attn.heads //= tp_degree
        attn.inner_dim //= tp_degree
    owners = [(p, f"{p}.to_out.0") for p in plan["attention"]] + [(p, f"{p}.net.2") for p in plan["feed_forward"]]
    for owner, row in owners:
        reduce = _RowParallelReduce(group, reduce_dtype, row_biases[row])
        register_h3_hook(model.get_submodule(owner), reduce, H3_TENSOR_PARALLEL_REDUCE_HOOK, root=model)
    per_rank = _bytes_of(model)
    sharded = sum(_bytes_of(model.get_submodule(p)) for p in split_paths)
    record = TensorParallelRecord(
        tp_degree=tp_degree,
        rank=rank,
        reduction="all-gather of the partial outputs, added in rank order 0, 1, ..., tp_degree - 1",
        reduce_dtype=str(reduce_dtype or "partial dtype").replace("torch.", ""),
        heads_per_rank=model.config.num_attention_heads // tp_degree,
        token_refiner="split like the blocks",
        split_layers=len(split_paths),
        parameter_bytes_per_rank=per_rank,
        split_bytes_per_rank=sharded,
        replicated_bytes=per_rank - sharded,
        unsplit_model_bytes=unsplit_bytes if split else per_rank + (tp_degree - 1) * sharded,
    )
    register_h3_hook(model, _TensorParallelHook(record), H3_TENSOR_PARALLEL_HOOK)


def enable_tensor_parallel(
    pipe_or_transformer,
    tp_degree: int,
    process_group=None,
    reduce_dtype: Optional[torch.dtype] = None,
):
    """Split the DiT's attention heads and FFN columns over `tp_degree` ranks, in place.

    Call it in every rank, after the process group exists, after quantizing and after loading LoRA adapters.

    Args:
        pipe_or_transformer: a `MiniMaxH3Pipeline` (its `transformer` and `transformer_ref` are both split) or a
            `MiniMaxH3Transformer3DModel`.
        tp_degree: ranks sharing each layer; must divide the head count (56 for H3: 2, 4, 7, 8, ...) and equal the
            size of `process_group`.
        process_group: the ranks that share the model (default: the whole default group).
        reduce_dtype: dtype the partial outputs are added in (e.g. `torch.float32` for fp16 / bf16 models); default:
            their own dtype.

    Returns:
        The argument, for chaining.
    """
    if not isinstance(tp_degree, int) or tp_degree < 2:
        raise ValueError(f"tp_degree must be an integer >= 2, got {tp_degree!r}.")
    models = transformers_of(pipe_or_transformer, "enable_tensor_parallel")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "enable_tensor_parallel needs one process per rank and a process group: launch with `torchrun "
            "--nproc-per-node N` and call torch.distributed.init_process_group first."
        )
    group = process_group if process_group is not None else dist.group.WORLD
    group_size = dist.get_world_size(group)
    if tp_degree != group_size:
        hint = (
            f"pass process_group= a group of {tp_degree} ranks (combining TP inside a group with context parallelism "
            "across groups, world = tp * cp, is not supported yet)"
            if process_group is None and tp_degree < group_size
            else f"use tp_degree={group_size}"
        )
        raise ValueError(
            f"tp_degree={tp_degree} must equal the world size of the process group ({group_size}); {hint}."
        )
    for model in models:
        _check_degree(model, tp_degree)
        if h3_record(model, H3_TENSOR_PARALLEL_HOOK) is not None:
            raise RuntimeError(f"{type(model).__name__} is already tensor parallel; enable it once per model.")
        _check_not_context_parallel(model)
        plan = tensor_parallel_plan(model)
        for path, chunks in plan["column"].items():
            _check_layer(path, model.get_submodule(path), 0, tp_degree, chunks)
        for path in plan["row"]:
            _check_layer(path, model.get_submodule(path), 1, tp_degree, 1)
    _check_same_on_every_rank([_model_description(m, tp_degree, reduce_dtype) for m in models], group)
    rank = dist.get_rank(group)
    for model in models:
        _apply_tensor_parallel(model, rank, tp_degree, process_group, reduce_dtype)
    return pipe_or_transformer


def tensor_parallel_state(model: nn.Module) -> Optional[Dict[str, Any]]:
    """What `enable_tensor_parallel` set up on `model` (degree, rank, reduction, parameter bytes of this rank), or
    `None`."""
    record = h3_record(model, H3_TENSOR_PARALLEL_HOOK)
    return None if record is None else record.as_dict()


# ----------------------------------------------------------------------------------------------------------------------
# Loading this rank's shard only
# ----------------------------------------------------------------------------------------------------------------------
def _local_folder(path_or_repo: str, subfolder: Optional[str], hub_kwargs: Dict[str, Any]) -> str:
    if os.path.isdir(path_or_repo):
        return os.path.join(path_or_repo, subfolder) if subfolder else path_or_repo
    from huggingface_hub import snapshot_download

    pattern = f"{subfolder}/*" if subfolder else "*"
    snapshot = snapshot_download(path_or_repo, allow_patterns=[pattern], **hub_kwargs)
    return os.path.join(snapshot, subfolder) if subfolder else snapshot


def _weight_files(folder: str) -> List[str]:
    index = [f for f in os.listdir(folder) if f.endswith(".safetensors.index.json")]
    if index:
        with open(os.path.join(folder, index[0])) as f:
            return sorted({os.path.join(folder, name) for name in json.load(f)["weight_map"].values()})
    files = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(
            f"No .safetensors weights in {folder}; tensor-parallel loading reads safetensors only."
        )
    return files


def _read_slice(handle, key: str, dim: int, ranges) -> torch.Tensor:
    view = handle.get_slice(key)
    if dim == 0:
        pieces = [view[a:b] for a, b in ranges]
    else:
        pieces = [view[:, a:b] for a, b in ranges]
    return torch.cat(pieces, dim)


def load_transformer_tensor_parallel(
    pretrained_model_name_or_path: str,
    tp_degree: int,
    rank: int,
    *,
    subfolder: Optional[str] = None,
    dtype: Optional[torch.dtype] = None,
    process_group=None,
    reduce_dtype: Optional[torch.dtype] = None,
    **hub_kwargs,
):
    """Build the transformer on the meta device and read only rank `rank`'s slices of the split layers (plus the
    replicated ones) from the safetensors files: no rank ever holds the whole model.

    Dense checkpoints only (quantized checkpoints: load with `from_pretrained` and call `enable_tensor_parallel`).
    The returned model is already tensor parallel over `process_group` (default: the default group, resolved at the
    first forward); `tp_degree` must match its size.
    """
    from accelerate import init_empty_weights
    from diffusers import MiniMaxH3Transformer3DModel
    from safetensors import safe_open

    if not isinstance(tp_degree, int) or tp_degree < 2 or not 0 <= rank < tp_degree:
        raise ValueError(f"Need tp_degree >= 2 and 0 <= rank < tp_degree, got tp_degree={tp_degree}, rank={rank}.")
    if dist.is_available() and dist.is_initialized():
        group = process_group if process_group is not None else dist.group.WORLD
        if dist.get_world_size(group) != tp_degree or dist.get_rank(group) != rank:
            raise ValueError(
                f"tp_degree={tp_degree}, rank={rank} do not match the process group (size "
                f"{dist.get_world_size(group)}, this rank {dist.get_rank(group)})."
            )
    folder = _local_folder(pretrained_model_name_or_path, subfolder, hub_kwargs)
    config = MiniMaxH3Transformer3DModel.load_config(folder)
    if config.get("quantization_config"):
        raise ValueError(
            "load_transformer_tensor_parallel reads dense checkpoints only; for a quantized one use "
            "MiniMaxH3Transformer3DModel.from_pretrained(...) followed by enable_tensor_parallel(...)."
        )
    with init_empty_weights():  # parameters on meta; buffers (the rope frequencies) are computed normally
        model = MiniMaxH3Transformer3DModel.from_config(config)
    _check_degree(model, tp_degree)
    plan = tensor_parallel_plan(model)
    splits = {f"{path}.weight": (0, chunks) for path, chunks in plan["column"].items()}
    splits.update({f"{path}.bias": (0, chunks) for path, chunks in plan["column"].items()})
    splits.update({f"{path}.weight": (1, 1) for path in plan["row"]})
    keep_fp32 = tuple(model._keep_in_fp32_modules or ())
    state_dict = {}
    for file in _weight_files(folder):
        with safe_open(file, framework="pt") as handle:
            for key in handle.keys():
                if key in splits:
                    dim, chunks = splits[key]
                    size = handle.get_slice(key).get_shape()[dim]
                    tensor = _read_slice(handle, key, dim, _ranges(size, rank, tp_degree, chunks))
                else:
                    tensor = handle.get_tensor(key)
                if dtype is not None and tensor.is_floating_point() and not any(m in key for m in keep_fp32):
                    tensor = tensor.to(dtype)
                state_dict[key] = tensor
    # Shapes of the split layers on meta first, so that `load_state_dict(assign=True)` accepts the slices.
    for path, chunks in plan["column"].items():
        _shard_linear(model.get_submodule(path), 0, rank, tp_degree, chunks)
    for path in plan["row"]:
        layer = model.get_submodule(path)
        if layer.bias is not None:
            raise NotImplementedError(f"`{path}` has a bias: row-parallel layers with a bias are not in H3's layout.")
        _shard_linear(layer, 1, rank, tp_degree, 1)
    model.load_state_dict(state_dict, strict=True, assign=True)
    model.eval().requires_grad_(False)
    _apply_tensor_parallel(model, rank, tp_degree, process_group, reduce_dtype, split=False)
    h3_record(model, H3_TENSOR_PARALLEL_HOOK).loaded_from = folder
    return model
