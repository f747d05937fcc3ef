"""Context parallelism (Ulysses; ring with an LSE-capable diffusers backend) for the MiniMax-H3 DiT.

Built on diffusers' own machinery: `ContextParallelConfig`, `ModelMixin.enable_parallelism` and the transformer's
`_cp_plan`, which shards the packed sequence at block 0 and gathers the two output heads. This module adds what that
machinery lacks for H3:

* any packed length: the `*_anything` sharding (uneven shards) is switched on, and the output gather is replaced by a
  padded one because gloo's all-gather rejects uneven sizes;
* processors installed after `enable_parallelism` (VSA, low-precision attention) receive the config at the next
  forward (the `H3_CONTEXT_PARALLEL_HOOK` on the transformer, which also holds the `ContextParallelRecord`, re-checks
  the processors only when one was replaced since), and a processor that cannot run under context parallelism is
  refused instead of silently attending over its own shard only;
* the token refiner's text rows are not sharded, so its attention runs without the config (same result, no duplicated
  all-to-all work);
* one-line errors, raised identically on every rank, for head counts, world sizes, ring degrees and configs that
  differ across ranks.
"""

import copy
import dataclasses
import hashlib
import json
import os
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers import ContextParallelConfig
from diffusers.hooks.context_parallel import ContextParallelGatherHook

from .._hooks import H3_CONTEXT_PARALLEL_HOOK, H3Hook, h3_record, register_h3_hook, transformers_of
from .._utils import config_from_call
from ..attention_processors._ulysses import check_ulysses_heads


# diffusers backends whose forward op returns the log-sum-exp that ring attention merges partial results with.
_RING_CAPABLE_BACKENDS = {
    "flash",
    "flash_hub",
    "flash_varlen_hub",
    "_flash_3_hub",
    "_flash_3_varlen_hub",
    "_native_cudnn",
    "_native_flash",
    "_native_npu",
    "sage",
    "sage_hub",
}
_REFINER_PREFIX = "token_refiner."


@dataclasses.dataclass
class ContextParallelRecord:
    """What `enable_context_parallel` set up on a transformer (`context_parallel_state` returns it as a dict)."""

    ulysses_degree: int
    ring_degree: int
    world_size: int
    uneven_shards: bool
    backend: str

    def as_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class _Degrees:
    """The two degrees `enable_context_parallel` took as separate arguments before it took a `ContextParallelConfig`
    (kept for one release)."""

    ulysses_degree: int = 1
    ring_degree: int = 1


class ContextParallelHook(H3Hook):
    """On the transformer: holds the `ContextParallelRecord`; before a forward, gives the CP config to block processors
    installed since the last forward (and keeps it off the refiner's). Nothing is rewritten while the processors stay
    the ones it last synced."""

    def __init__(self, record: ContextParallelRecord):
        super().__init__(record)
        self._synced: Optional[Tuple[int, ...]] = None

    def pre_forward(self, module, *args, **kwargs):
        current = _processor_ids(module)
        if current != self._synced:
            _sync_processors(module, self.record.ring_degree)
            self._synced = _processor_ids(module)
        return args, kwargs


def _processor_ids(model: torch.nn.Module) -> Tuple[int, ...]:
    return tuple(id(m.processor) for _, m in _attention_modules(model))


def _ensure_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        return
    if not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # CPU ranks: Accelerate would create a plain "gloo" group, and diffusers' uneven-shard size exchange picks its
        # device from the backend name ("cpu" in it, else the build's accelerator), so a CUDA build of torch on a
        # host without GPUs would send it to CUDA. "cpu:gloo" keeps it on the CPU.
        dist.init_process_group(backend="cpu:gloo")
    else:
        # Accelerate reads torchrun / `accelerate launch` / notebook_launcher environment variables; on GPUs it
        # creates "cuda:nccl,cpu:gloo" (the size exchange stays on the CPU).
        from accelerate import PartialState

        PartialState()
    if not dist.is_initialized():
        raise RuntimeError(
            "enable_context_parallel needs one process per rank: launch with `torchrun --nproc-per-node N`, "
            "`accelerate launch --multi_gpu --num_processes N` (on a host without GPUs too: without --multi_gpu "
            "Accelerate starts one process there) or `accelerate.notebook_launcher(..., num_processes=N)`."
        )


def _attention_modules(model: torch.nn.Module):
    from diffusers.models.attention import AttentionModuleMixin

    for name, module in model.named_modules():
        if isinstance(module, AttentionModuleMixin) and getattr(module, "processor", None) is not None:
            yield name, module


def _backend_name(processor) -> str:
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    backend = processor._attention_backend or _AttentionBackendRegistry.get_active_backend()[0]
    return str(getattr(backend, "value", backend))


def _uses_diffusers_dispatch(processor) -> bool:
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor

    return type(processor) is MiniMaxH3AttnProcessor


def _check_processor(name: str, processor, ring_degree: int) -> None:
    if not hasattr(processor, "_parallel_config"):
        raise ValueError(
            f"Attention processor {type(processor).__name__} at `{name}` does not take part in context parallelism "
            "(no `_parallel_config` attribute); use diffusers' MiniMaxH3AttnProcessor or a diffusers_h3 processor."
        )
    if _uses_diffusers_dispatch(processor):
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry

        backend = _backend_name(processor)
        if backend not in _AttentionBackendRegistry._supports_context_parallel:
            raise ValueError(
                f"`{name}` uses attention backend '{backend}', which has no context-parallel path; call "
                f"transformer.set_attention_backend(...) with one of "
                f"{sorted(_AttentionBackendRegistry._supports_context_parallel)} first."
            )
    if ring_degree > 1:
        if not _uses_diffusers_dispatch(processor):
            raise ValueError(
                f"ring_degree={ring_degree} needs attention that returns a log-sum-exp; {type(processor).__name__} at "
                f"`{name}` runs Ulysses only. Use ring_degree=1 and ulysses_degree=<world size>."
            )
        backend = _backend_name(processor)
        if backend not in _RING_CAPABLE_BACKENDS:
            raise ValueError(
                f"ring_degree={ring_degree} needs an attention backend with log-sum-exp, but `{name}` uses "
                f"'{backend}'; call transformer.set_attention_backend(...) with one of "
                f"{sorted(_RING_CAPABLE_BACKENDS)} first, or use ring_degree=1."
            )


def _sync_processors(model: torch.nn.Module, ring_degree: int) -> None:
    """Give the CP config to block processors installed after `enable_parallelism`; keep it off the refiner."""
    config = model._parallel_config
    modules = list(_attention_modules(model))
    block_processors = {id(m.processor) for name, m in modules if not name.startswith(_REFINER_PREFIX)}
    for name, module in modules:
        processor = module.processor
        if name.startswith(_REFINER_PREFIX):
            if id(processor) in block_processors:
                # One instance installed everywhere (`set_attn_processor(p)`): the refiner gets its own copy.
                processor = copy.copy(processor)
                module.processor = processor
            if getattr(processor, "_parallel_config", None) is not None:
                processor._parallel_config = None
            continue
        _check_processor(name, processor, ring_degree)
        if processor._parallel_config is not config:
            processor._parallel_config = config


class PaddedContextParallelGatherHook(ContextParallelGatherHook):
    """diffusers' output gather, but on shards padded to one length: gloo's all-gather rejects uneven sizes."""

    def post_forward(self, module, output):
        is_tensor = isinstance(output, torch.Tensor)
        outputs = [output] if is_tensor else list(output)
        if len(outputs) != len(self.metadata):
            raise ValueError(f"Expected {len(self.metadata)} outputs to gather, got {len(outputs)}.")
        group = self.parallel_config._flattened_mesh.get_group()
        for i, cpm in enumerate(self.metadata):
            if cpm is not None:
                outputs[i] = padded_all_gather(outputs[i], cpm.gather_dim, group)
        return outputs[0] if is_tensor else tuple(outputs)


def padded_all_gather(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    """All-gather shards of different lengths along `dim` (pads to the longest, gathers, strips)."""
    world_size = dist.get_world_size(group)
    backend = str(dist.get_backend(group))
    size_device = torch.device("cpu") if tensor.device.type == "cpu" or "cpu" in backend else tensor.device
    sizes = [torch.empty(1, dtype=torch.int64, device=size_device) for _ in range(world_size)]
    dist.all_gather(sizes, torch.tensor([tensor.shape[dim]], dtype=torch.int64, device=size_device), group=group)
    sizes = [int(s.item()) for s in sizes]
    longest = max(sizes)
    moved = tensor.movedim(dim, -1)
    padded = F.pad(moved, (0, longest - moved.shape[-1])).contiguous()
    gathered = [torch.empty_like(padded) for _ in range(world_size)]
    if torch.is_grad_enabled() and tensor.requires_grad:
        from torch.distributed.nn.functional import all_gather

        gathered = list(all_gather(padded, group=group))
    else:
        dist.all_gather(gathered, padded, group=group)
    return torch.cat([g[..., :n] for g, n in zip(gathered, sizes)], dim=-1).movedim(-1, dim)


def _replace_gather_hooks(model: torch.nn.Module, cp_config, cp_plan: Dict[str, Any]) -> None:
    from diffusers.hooks import HookRegistry
    from diffusers.hooks.context_parallel import _CONTEXT_PARALLEL_OUTPUT_HOOK_TEMPLATE, ContextParallelOutput

    for module_id, plan in cp_plan.items():
        if isinstance(plan, dict):
            continue
        metadata = [plan] if isinstance(plan, ContextParallelOutput) else list(plan)
        registry = HookRegistry.check_if_exists_or_initialize(model.get_submodule(module_id))
        name = _CONTEXT_PARALLEL_OUTPUT_HOOK_TEMPLATE.format(module_id)
        registry.remove_hook(name, recurse=False)
        registry.register_hook(PaddedContextParallelGatherHook(metadata, cp_config), name)


def parallel_on_cpu() -> bool:
    """Whether context parallelism runs on CPU meshes: on a host without an accelerator, and on one with GPUs when the
    default process group has no CUDA backend (``"cpu:gloo"``: CPU ranks, e.g. tests or debugging on a GPU host), where
    diffusers would build its mesh on the GPUs the group cannot reach."""
    if torch.accelerator.device_count() == 0:
        return True
    return "cuda" not in dist.get_backend_config() and dist.get_backend() != "nccl"


def _enable_parallelism_on_cpu(model: torch.nn.Module, cp_config) -> None:
    """`ModelMixin.enable_parallelism` for hosts without an accelerator (gloo on CPU).

    diffusers 0.42.1 picks the device as `rank % torch.accelerator.device_count()`, which divides by zero on a
    CPU-only host; the same steps run here with a CPU mesh. Processors are validated and configured by
    `_sync_processors` (all of them, not only the first one).
    """
    from diffusers import ParallelConfig
    from diffusers.hooks.context_parallel import apply_context_parallel
    from torch.distributed.device_mesh import init_device_mesh

    config = ParallelConfig(context_parallel_config=cp_config)
    mesh = cp_config.mesh
    if mesh is None:
        override = cpu_group_backend_override(cp_config.mesh_dim_names)
        own_groups = override is not None  # init_device_mesh empties the dict it is given
        mesh = init_device_mesh("cpu", cp_config.mesh_shape, mesh_dim_names=cp_config.mesh_dim_names,
                                backend_override=override)  # fmt: skip
        if own_groups:  # `setup` flattens the mesh without an override: flatten it here first (the result is cached)
            mesh[cp_config.mesh_dim_names]._flatten(backend_override=CPU_GLOO)
    config.setup(dist.get_rank(), dist.get_world_size(), torch.device("cpu"), mesh=mesh)
    model._parallel_config = config
    apply_context_parallel(model, cp_config, model._cp_plan)


CPU_GLOO = "cpu:gloo"


def cpu_group_backend_override(mesh_dim_names) -> Optional[Dict[str, str]]:
    """The mesh groups' backend on a host without an accelerator: `None` (the default group's) when its backend string
    names "cpu", else `"cpu:gloo"` for every dimension.

    diffusers' uneven-shard size exchange (`gather_size_by_comm`) puts its tensors on the CPU only when the group's
    backend string contains "cpu", else on `torch.accelerator.current_accelerator()`: with the common
    `init_process_group("gloo")` (or a group created without a backend, "undefined", as Accelerate's `PartialState`
    creates under torchrun) and a CUDA build of torch on a CPU host, that is CUDA, and the first forward fails with
    "Found no NVIDIA driver". Groups of our own, created as "cpu:gloo", keep the exchange on the CPU.
    """
    backend = str(dist.get_backend())
    if "cpu" in backend:
        return None
    # "undefined": created without a backend (Accelerate's PartialState under torchrun does), gloo serves the CPU.
    if "gloo" not in backend and backend != "undefined":
        raise ValueError(
            f"Context parallelism on a host without GPUs needs a gloo process group, but the default group uses "
            f"'{backend}': call torch.distributed.init_process_group('cpu:gloo') instead."
        )
    return dict.fromkeys(mesh_dim_names, CPU_GLOO)


def _check_same_on_every_rank(description: Dict[str, Any]) -> None:
    digest = hashlib.sha256(json.dumps(description, sort_keys=True, default=str).encode()).hexdigest()
    digests: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if len(set(digests)) != 1:
        differing = [rank for rank, d in enumerate(digests) if d != digests[0]]
        raise ValueError(
            f"Context parallel setup differs across ranks (ranks {differing} differ from rank 0: model config or "
            "degrees); every rank must load the same model and call enable_context_parallel with the same arguments."
        )


def enable_context_parallel(pipe_or_transformer, config: Optional[ContextParallelConfig] = None, *args, **legacy):
    """Shard the DiT's packed sequence over the ranks of the default process group.

    Call it in every rank after the model is on its device (and, ideally, after `enable_vsa` or other processor
    changes — later ones are picked up at the next forward). If no process group exists, Accelerate's
    `PartialState` creates one from the launcher's environment (`torchrun`, `accelerate launch`,
    `notebook_launcher`).

    Args:
        pipe_or_transformer: a `MiniMaxH3Pipeline` (its `transformer` and `transformer_ref` are both configured) or a
            `MiniMaxH3Transformer3DModel`.
        config: diffusers' `ContextParallelConfig` (default: Ulysses over every rank, `ulysses_degree=<world size>`).
            `ulysses_degree`: ranks exchanging heads by all-to-all; must divide the head count (56 for H3: 2, 4, 7,
            8, ...). `ring_degree`: ranks passing key/value blocks around a ring; needs a diffusers backend returning
            the log-sum-exp (not `native`) and diffusers' own processor. `ulysses_degree * ring_degree` must equal the
            world size. Its `mesh` and `convert_to_fp32` are used as given; `ulysses_anything` / `ring_anything` are
            set here (uneven shards: any packed length). `ulysses_degree=` / `ring_degree=` as separate arguments
            still work for one release, with a `FutureWarning`.

    Returns:
        The argument, for chaining.
    """
    if isinstance(config, ContextParallelConfig) and (legacy or args):
        raise TypeError("enable_context_parallel() takes the degrees in its ContextParallelConfig, not beside it")
    if legacy or args or (config is not None and not isinstance(config, ContextParallelConfig)):
        degrees = config_from_call(_Degrees, config, legacy, call="enable_context_parallel", legacy_args=args,
                                   legacy_positional=("ulysses_degree", "ring_degree"),
                                   config_name="ContextParallelConfig")  # fmt: skip
        ulysses_degree, ring_degree = degrees.ulysses_degree, degrees.ring_degree
        config = None
    elif config is not None:
        ulysses_degree, ring_degree = config.ulysses_degree, config.ring_degree
    else:
        ulysses_degree = ring_degree = None  # Ulysses over the world size, once the process group exists
    if ulysses_degree is not None and (ulysses_degree < 1 or ring_degree < 1 or ulysses_degree * ring_degree == 1):
        raise ValueError(
            f"ulysses_degree={ulysses_degree}, ring_degree={ring_degree}: both must be >= 1 and their product > 1."
        )
    models = transformers_of(pipe_or_transformer, "enable_context_parallel")
    _ensure_process_group()
    world_size = dist.get_world_size()
    if ulysses_degree is None:
        ulysses_degree, ring_degree = world_size, 1
    if ulysses_degree * ring_degree != world_size:
        raise ValueError(
            f"ulysses_degree * ring_degree = {ulysses_degree} * {ring_degree} = {ulysses_degree * ring_degree} must "
            f"equal the world size ({world_size}); e.g. ulysses_degree={world_size}, ring_degree=1."
        )
    for model in models:
        check_ulysses_heads(model.config.num_attention_heads, ulysses_degree)
        if getattr(model, "_parallel_config", None) is not None:
            raise RuntimeError(f"{type(model).__name__} already has a parallel config; enable it once per model.")
        for name, module in _attention_modules(model):
            if not name.startswith(_REFINER_PREFIX):
                _check_processor(name, module.processor, ring_degree)
    _check_same_on_every_rank(
        {
            "degrees": (ulysses_degree, ring_degree),
            # Private keys such as `_use_default_values` come from sets: their order differs between processes.
            "configs": [{k: v for k, v in model.config.items() if not k.startswith("_")} for model in models],
        }
    )

    for model in models:
        # `*_anything` shards with `tensor_split`, so any packed length works (unified Ulysses x ring needs a length
        # divisible by the world size: diffusers has no uneven mode for it). Each model sets up its own copy.
        cp_config = ContextParallelConfig(
            ulysses_degree=ulysses_degree,
            ring_degree=ring_degree,
            ulysses_anything=ulysses_degree > 1 and ring_degree == 1,
            ring_anything=ring_degree > 1 and ulysses_degree == 1,
            **({} if config is None else {"convert_to_fp32": config.convert_to_fp32, "mesh": config.mesh}),
        )
        if parallel_on_cpu():
            _enable_parallelism_on_cpu(model, cp_config)
        else:
            model.enable_parallelism(config=cp_config)
        if cp_config.ulysses_anything or cp_config.ring_anything:
            _replace_gather_hooks(model, model._parallel_config.context_parallel_config, model._cp_plan)
        record = ContextParallelRecord(
            ulysses_degree=ulysses_degree,
            ring_degree=ring_degree,
            world_size=world_size,
            uneven_shards=cp_config.ulysses_anything or cp_config.ring_anything,
            backend=str(dist.get_backend()),
        )
        hook = register_h3_hook(model, ContextParallelHook(record), H3_CONTEXT_PARALLEL_HOOK)
        _sync_processors(model, ring_degree)
        hook._synced = _processor_ids(model)
    return pipe_or_transformer


def context_parallel_state(model: torch.nn.Module) -> Optional[Dict[str, Any]]:
    """What `enable_context_parallel` set up on `model` (degrees, world size, backend), or `None`."""
    record = h3_record(model, H3_CONTEXT_PARALLEL_HOOK)
    return None if record is None else record.as_dict()
