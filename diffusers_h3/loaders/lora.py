"""LoRA for ``MiniMaxH3Pipeline``: every layout diffusers converts, on bf16 and quantized layers, with a key report,
strict key matching and step-distillation presets.

``MiniMaxH3LoraMixin`` extends diffusers' ``MiniMaxH3LoraLoaderMixin`` (which it keeps for layout conversion, the
two-partition routing rule, PEFT injection, ``set_adapters`` / ``fuse_lora`` / ``unfuse_lora`` /
``unload_lora_weights`` / hotswap) with:

- **Quantized layers.** Layers quantized by ``diffusers_h3.quantizers`` (W8A16, NVFP4, FP8) stay ``nn.Linear`` with
  a quantized weight tensor, so PEFT wraps them with its own ``lora.Linear``: the base product runs the quantized
  kernel, LoRA runs on the unquantized input, ``fuse_lora`` re-quantizes ``W + BA`` (the weight's ``add_``) and
  ``unfuse_lora`` restores the quantized tensors from before the first fuse exactly (the weight's last ``sub_``).
- **Key report.** ``load_lora_weights`` returns a :class:`LoraLoadReport` (also logged at INFO): detected layout,
  matched modules per partition (and how many are quantized), rank and alpha per adapter, where the alpha came from,
  unmatched keys, the distillation preset. Zero matched modules is an error; unmatched keys are an error unless
  ``allow_unmatched_keys=True``; a file without any alpha loads with ``alpha == rank`` (scale 1.0, diffusers'
  documented default) and a warning says so (pass ``network_alpha=`` to use the alpha it was trained with).
- **Offloaded and split models.** Loading keeps ``enable_low_memory_offload``'s hooks (rebuilding the target's
  offload groups) and a GPU device map; modules a device map offloads to the CPU or disk are refused (see
  ``_offload_toggle``).
- **Distillation presets.** A LoRA that is a known step-distillation adapter (LightX2V Turbo) or whose
  ``__metadata__`` records its schedule carries a :class:`~diffusers_h3.loaders.lora_presets.LoraDistillationPreset`;
  the pipeline calls :meth:`MiniMaxH3LoraMixin._resolve_lora_schedule` (which finds the active preset and applies the pure
  :func:`~diffusers_h3.loaders.lora_presets.resolve_schedule`) to fill unset ``num_inference_steps`` /
  ``flow_shift`` / ``audio_flow_shift`` from it and to warn when a call asks for something else.

Example::

    pipe = MiniMaxH3Pipeline.from_pretrained(path, quantization_config=...)  # bf16 or W8A16 / NVFP4 / FP8
    report = pipe.load_lora_weights(
        "lightx2v/Minimax-h3-Turbo", weight_name="minimax_h3_fl2v_turbo_4step_v1.2_768p.safetensors", adapter_name="turbo"
    )
    print(report)  # layout, matched modules, rank / alpha, unmatched keys, preset (5 sigma points, shifts 6 / 3)
    out = pipe(prompt)     # runs 4 steps at shift 6 / 3; passing num_inference_steps=50 would warn
    pipe.set_adapters(["turbo"], [1.0]); pipe.fuse_lora(); pipe.unfuse_lora(); pipe.unload_lora_weights()
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import math
import os
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from diffusers.loaders.lora_pipeline import MiniMaxH3LoraLoaderMixin
from diffusers.utils import logging
from torch import nn

from .._checkpoint_files import looks_like_local_path, safetensors_problem, torch_checkpoint_problem
from ..quantizers import quantized_weight
from ..tasks import partition_for_task, partition_for_tasks
from . import pdd as _pdd
from .lora_files import check_lora_file, read_fp8_lora
from .lora_presets import (
    LoraDistillationPreset,
    detect_preset,
    get_preset,
    preset_from_file_name,
    resolve_schedule,
    warn_schedule_differences,
)
from .single_file import check_fusable, transformer_file_record


logger = logging.get_logger(__name__)

_HUB_KWARGS = (
    "cache_dir",
    "force_download",
    "proxies",
    "local_files_only",
    "token",
    "revision",
    "subfolder",
    "weight_name",
    "use_safetensors",
)
_KEY_RE = re.compile(
    r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B|lora_magnitude_vector)(?:\.(?P<param>weight|bias))?$"
)
_PENDING_METADATA: contextvars.ContextVar = contextvars.ContextVar("diffusers_h3_pending_lora_metadata", default=None)
_DEFAULT_ALPHA_NOTE = "default alpha == rank (scale 1.0): the file records no alpha"
# Set while a PDD file loads its backbone: the file was already checked against the other step recipes as a whole.
_RECIPE_CHECKED: contextvars.ContextVar = contextvars.ContextVar("diffusers_h3_step_recipe_checked", default=False)


# ---------------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class LoraComponentReport:
    """What one adapter put into one partition (``transformer`` or ``transformer_ref``)."""

    component: str
    matched_modules: List[str]
    quantized_modules: Dict[str, int]  # quant_method -> number of LoRA-wrapped quantized layers
    ranks: Dict[int, int]  # rank -> number of modules
    alphas: Dict[float, int]  # alpha -> number of modules

    def summary(self) -> str:
        ranks = ", ".join(f"r={r}: {n}" for r, n in sorted(self.ranks.items()))
        alphas = ", ".join(f"alpha={a:g}: {n}" for a, n in sorted(self.alphas.items()))
        quant = ", ".join(f"{m}: {n}" for m, n in sorted(self.quantized_modules.items())) or "none"
        count = len(self.matched_modules)
        return f"{self.component}: {count} modules ({ranks}; {alphas}); quantized base layers: {quant}"


@dataclasses.dataclass
class LoraLoadReport:
    """Returned by ``MiniMaxH3LoraMixin.load_lora_weights``."""

    adapter_name: str
    layout: str
    components: Dict[str, LoraComponentReport]
    unmatched_keys: List[str]
    alpha_source: str
    preset: Optional[LoraDistillationPreset]
    hotswap: bool = False
    pdd: Optional[str] = None  # what a PDD Acc-LoRA put beside the backbone (head bank, schedule)

    @property
    def num_matched_modules(self) -> int:
        return sum(len(c.matched_modules) for c in self.components.values())

    def __str__(self) -> str:
        lines = [f"LoRA adapter {self.adapter_name!r} ({self.layout}){' [hotswapped]' if self.hotswap else ''}:"]
        lines += [f"  {c.summary()}" for c in self.components.values()]
        lines.append(f"  alpha: {self.alpha_source}")
        if self.unmatched_keys:
            shown = ", ".join(self.unmatched_keys[:8]) + (" ..." if len(self.unmatched_keys) > 8 else "")
            lines.append(f"  unmatched keys ({len(self.unmatched_keys)}, skipped): {shown}")
        else:
            lines.append("  unmatched keys: none")
        lines.append(f"  distillation preset: {self.preset.describe() if self.preset else 'none'}")
        if self.pdd:
            lines.append(f"  PDD: {self.pdd}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------------------
def detect_lora_layout(keys: Sequence[str]) -> str:
    """Name of the LoRA key layout (for the report; diffusers' converter does the actual conversion)."""
    keys = list(keys)
    kohya = any(".lora_down." in k or ".lora_up." in k for k in keys)
    suffix = " with kohya lora_down/lora_up + alpha" if kohya else ""
    if any(k.startswith("lora_unet_") for k in keys):
        return "musubi-tuner / kohya (flattened lora_unet_ names)" + ("" if kohya else suffix)
    if any(k.startswith("diffusion_model.") for k in keys):
        return "ai-toolkit / ComfyUI (diffusion_model. prefix, native module names)" + suffix
    native = any(k.startswith(("blocks.", "token_refiner.blocks.", "final_layer.")) for k in keys)
    peft_infix = any(".lora_A.default." in k or ".lora_B.default." in k for k in keys)
    if native:
        if peft_infix:
            return "DiffSynth-Studio (native names, peft .default. infix, per-head interleaved QKV)"
        return "reference / ComfyUI native module names" + suffix
    prefixed = any(k.startswith(("transformer.", "transformer_ref.")) for k in keys)
    if peft_infix and not prefixed:
        return "PEFT dump without component prefix (LightX2V Turbo)"
    if prefixed:
        return "diffusers / PEFT"
    return "unknown"


def _resolve_lora_file(path_or_dict: Any, hub_kwargs: Dict[str, Any]) -> Optional[str]:
    """Local path of the safetensors file diffusers would load, or ``None`` (dict input, pickle files)."""
    if isinstance(path_or_dict, dict):
        return None
    path = os.fspath(path_or_dict)
    if os.path.isfile(path):
        _check_local_lora_file(path)
        return path if path.endswith(".safetensors") else None
    if not os.path.exists(path) and looks_like_local_path(path):
        raise FileNotFoundError(
            f"{path}: no such LoRA file or folder ({os.path.abspath(os.path.expanduser(path))} does not exist): check "
            "the path, or pass a hub repo id."
        )
    from diffusers.loaders.lora_base import _best_guess_weight_name
    from diffusers.utils import _get_model_file

    weight_name = hub_kwargs.get("weight_name")
    if hub_kwargs.get("use_safetensors") is False:
        return None
    if weight_name is None:
        try:
            weight_name = _best_guess_weight_name(
                path, file_extension=".safetensors", local_files_only=hub_kwargs.get("local_files_only") or False
            )
        except (OSError, ValueError):
            return None
    if weight_name is None or not weight_name.endswith(".safetensors"):
        return None
    return _get_model_file(
        path,
        weights_name=weight_name,
        cache_dir=hub_kwargs.get("cache_dir"),
        force_download=hub_kwargs.get("force_download", False),
        proxies=hub_kwargs.get("proxies"),
        local_files_only=hub_kwargs.get("local_files_only"),
        token=hub_kwargs.get("token"),
        revision=hub_kwargs.get("revision"),
        subfolder=hub_kwargs.get("subfolder"),
        user_agent={"file_type": "attn_procs_weights", "framework": "pytorch"},
    )


def _check_local_lora_file(path: str) -> None:
    """A local LoRA file is a complete safetensors file or a torch.save checkpoint, named in one line when it is not
    (safetensors would say "header too small" / "too large", torch an unpickling error)."""
    from pathlib import Path

    is_torch = path.lower().endswith((".bin", ".pt", ".pth", ".ckpt"))
    problem = torch_checkpoint_problem(Path(path)) if is_torch else safetensors_problem(Path(path))
    if problem:
        kind = "a torch.save LoRA checkpoint" if is_torch else "a safetensors LoRA"
        raise ValueError(f"{path} is not {kind}: {problem}. Pass a LoRA .safetensors file.")


def _read_header(file: str) -> Tuple[List[str], Dict[str, str]]:
    from safetensors import safe_open

    with safe_open(file, framework="pt") as handle:
        return list(handle.keys()), dict(handle.metadata() or {})


def _lora_target(module: nn.Module) -> Optional[nn.Module]:
    """The linear (bf16 or quantized) a LoRA key may target, looking through an existing PEFT wrapper."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    if isinstance(module, BaseTunerLayer):
        module = module.get_base_layer()
    if isinstance(module, nn.Linear):
        return module
    return None


def _uniform_alpha_metadata(state_dict: Dict[str, torch.Tensor], alpha: float, prefixes: Sequence[str]) -> dict:
    """LoraConfig kwargs (component-prefixed, as diffusers passes them) for one network alpha over every module."""
    from diffusers.utils import get_peft_kwargs

    metadata = {}
    for prefix in prefixes:
        component = {k[len(prefix) + 1 :]: v for k, v in state_dict.items() if k.startswith(f"{prefix}.")}
        rank = {f"^{k}": v.shape[1] for k, v in component.items() if "lora_B" in k and v.ndim > 1}
        if not rank:
            continue
        kwargs = get_peft_kwargs(rank, network_alpha_dict=None, peft_state_dict=component, is_unet=False)
        kwargs["lora_alpha"] = float(alpha)
        kwargs["alpha_pattern"] = {}
        metadata.update({f"{prefix}.{k}": v for k, v in kwargs.items()})
    return metadata


def _file_alpha_metadata(state_dict, file_metadata, raw_keys, prefixes) -> Optional[dict]:
    """LoraConfig kwargs for the numeric ``alpha`` a file's ``__metadata__`` records (diffusers' rule for files), or
    ``None`` without one or with per-module ``.alpha`` tensors."""
    if "alpha" not in file_metadata or any(k.endswith(".alpha") for k in raw_keys):
        return None
    try:
        alpha = float(file_metadata["alpha"])
    except ValueError:
        return None
    present = sorted({k.split(".", 1)[0] for k in state_dict} & set(prefixes))
    return _uniform_alpha_metadata(state_dict, alpha, present) or None


@contextlib.contextmanager
def _pending_metadata(metadata: Optional[dict]):
    token = _PENDING_METADATA.set(metadata)
    try:
        yield
    finally:
        _PENDING_METADATA.reset(token)


def _adapter_layers(model: nn.Module, adapter: str):
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in model.named_modules():
        if isinstance(module, BaseTunerLayer) and adapter in getattr(module, "lora_A", {}):
            yield name, module


@dataclasses.dataclass
class _LoraSource:
    """Where `lora_state_dict` loads from, and what the file header says (keys, `__metadata__`, name)."""

    load_from: Any
    load_kwargs: Dict[str, Any]
    raw_keys: Optional[List[str]]
    file_metadata: Dict[str, str]
    file_name: Optional[str]


def _read_source(source: Any, hub_kwargs: Dict[str, Any]) -> _LoraSource:
    """Resolve the file once and read its header: keys for the layout, `__metadata__` for alpha and preset."""
    if isinstance(source, dict):
        source = dict(source)
        return _LoraSource(source, {}, list(source), {}, None)
    file = _resolve_lora_file(source, hub_kwargs)
    if file is not None:
        raw_keys, file_metadata = _read_header(file)
        return _LoraSource(file, {}, raw_keys, file_metadata, file)
    return _LoraSource(source, hub_kwargs, None, {}, hub_kwargs.get("weight_name") or os.fspath(source))


def _select_preset(choice, file_name, file_metadata) -> Optional[LoraDistillationPreset]:
    if isinstance(choice, str) and choice == "auto":
        return detect_preset(file_name, file_metadata)
    if isinstance(choice, str):
        return get_preset(choice).replace(source="argument")
    if choice is None or isinstance(choice, LoraDistillationPreset):
        return choice
    raise TypeError(
        "`distillation_preset` must be 'auto', a preset name, a `LoraDistillationPreset` or None, got "
        f"{type(choice).__name__}."
    )


# ---------------------------------------------------------------------------------------------------------------------
# Offload hooks around a LoRA load
# ---------------------------------------------------------------------------------------------------------------------
def _offload_toggle(model, pipeline):
    """``(pipeline, regroup)``: the pipeline diffusers may take offload hooks off and put back around a LoRA load
    (None: leave every hook alone), and whether to rebuild the model's offload groups after the load.

    diffusers 0.42.1 reads any Accelerate hook on a component as model or sequential CPU offload, takes them all off
    and puts back its own idea of them after loading:

    * a transformer split over devices by a device map would become sequential CPU offload (the map silently gone).
      Blocks kept on GPUs take PEFT's layers where they are; blocks Accelerate offloads to the CPU or disk hold no
      weights between calls, so an adapter cannot be added to them: one clear error, before anything is loaded;
    * a group-offloaded transformer beside model-offloaded components (``enable_low_memory_offload``) makes it call
      ``enable_model_cpu_offload``, which refuses group offload, after having removed the other components' hooks.
      Here the hooks stay, and the model's offload groups are rebuilt so that they hold the new LoRA weights (what
      diffusers does for group offload alone).
    """
    from diffusers.hooks.group_offloading import _is_group_offload_enabled

    device_map = getattr(model, "hf_device_map", None)
    if device_map:
        offloaded = sorted(name for name, where in device_map.items() if str(where) in ("cpu", "disk"))
        if offloaded:
            raise ValueError(
                f"A LoRA cannot be loaded into a {type(model).__name__} whose modules Accelerate offloads to the CPU "
                f"or disk through its device map ({len(offloaded)} of them, e.g. {offloaded[0]!r}): their weights are "
                "not in place between calls. Give the GPUs enough max_memory for every block, or fuse the LoRA first: "
                "load the transformer whole, load_lora_weights, fuse_lora, unload_lora_weights, save_pretrained, then "
                "split."
            )
        return None, False
    if _is_group_offload_enabled(model):
        return None, True
    return pipeline, False


def _rebuild_offload_groups(model) -> None:
    from diffusers.hooks.group_offloading import _maybe_remove_and_reapply_group_offloading

    _maybe_remove_and_reapply_group_offloading(model)


def _first_lora_layer(model: nn.Module, adapter: str) -> Optional[nn.Module]:
    """One PEFT layer holding ``adapter`` (its state says whether the adapter runs, and at which weight)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer) and adapter in getattr(module, "lora_A", {}):
            return module
    return None


def _regroup_if_group_offloaded(model: nn.Module) -> None:
    from diffusers.hooks.group_offloading import _is_group_offload_enabled

    if _is_group_offload_enabled(model):
        _rebuild_offload_groups(model)


def _check_finite_weights(weights, where: str = "adapter_weights") -> None:
    """Every number in an adapter weight spec (a float, a list, or diffusers' per-component / per-block dicts) is
    finite."""
    if isinstance(weights, dict):
        for key, value in weights.items():
            _check_finite_weights(value, f"{where}[{key!r}]")
    elif isinstance(weights, (list, tuple)):
        for index, value in enumerate(weights):
            _check_finite_weights(value, f"{where}[{index}]")
    elif isinstance(weights, (int, float)) and not math.isfinite(weights):
        raise ValueError(f"`{where}` is {weights}: an adapter weight must be a finite number (1.0 = as trained).")


def merged_distillation_preset(pipe, task: Optional[str] = None, partition: Optional[str] = None):
    """``(label, preset)`` for a DiT loaded from a single file whose name is a known step-distillation merge (e.g.
    LightX2V's ``minimax_h3_fl2v_turbo_4step_v1.1_768p_fp8.safetensors``, the Turbo LoRA merged into an fp8 DiT), or
    ``None``: such a DiT runs the schedule it was distilled for, as the LoRA would."""
    wanted = partition_for_task(task) if task is not None else partition
    for component in (pipe.transformer_name, pipe.transformer_ref_name):
        model = getattr(pipe, component, None)
        record = transformer_file_record(model) if isinstance(model, nn.Module) else None
        if record is None or (wanted is not None and component != wanted):
            continue
        preset = preset_from_file_name(record.path)
        if preset is not None:
            return f"transformer file {os.path.basename(record.path)}", preset
    return None


# ---------------------------------------------------------------------------------------------------------------------
# Mixin
# ---------------------------------------------------------------------------------------------------------------------
class MiniMaxH3LoraMixin(MiniMaxH3LoraLoaderMixin):
    """LoRA loading for ``MiniMaxH3Pipeline``; see the module docstring."""

    # ---- loading ----------------------------------------------------------------------------------------------------
    def load_lora_weights(
        self,
        pretrained_model_name_or_path_or_dict: Union[str, os.PathLike, Dict[str, torch.Tensor]],
        adapter_name: Optional[str] = None,
        hotswap: bool = False,
        load_into_transformer_ref: bool = False,
        *,
        allow_unmatched_keys: bool = False,
        network_alpha: Optional[float] = None,
        distillation_preset: Union[str, LoraDistillationPreset, None] = "auto",
        allow_step_recipe_stacking: bool = False,
        **kwargs,
    ) -> LoraLoadReport:
        """Load a LoRA into ``transformer`` (or ``transformer_ref``) and return a :class:`LoraLoadReport`.

        Accepts every layout diffusers' ``MiniMaxH3LoraLoaderMixin`` converts (diffusers/PEFT, unprefixed PEFT dumps
        such as LightX2V Turbo, ai-toolkit, ComfyUI / reference native names, musubi-tuner, kohya, DiffSynth-Studio),
        onto bf16 and diffusers-h3 quantized layers of either partition. Partition routing is diffusers' rule:
        ``transformer.`` keys go to ``transformer`` unless ``load_into_transformer_ref=True`` or the pipeline holds
        only ``transformer_ref``; ``transformer_ref.`` keys go to ``transformer_ref``.

        Args:
            allow_unmatched_keys (`bool`, defaults to `False`):
                Keys that name no LoRA-able module of the target partition are an error by default; with `True` they
                are skipped and listed in the report.
            network_alpha (`float`, *optional*):
                The alpha every module was trained with, overriding what the file records. Files that record none
                load at `alpha == rank` (scale 1.0) and a warning says so. Not allowed with per-module `.alpha`
                tensors (kohya), which are already folded into the weights.
            distillation_preset (`str`, `LoraDistillationPreset` or `None`, defaults to `"auto"`):
                The sampling schedule this adapter was distilled for. `"auto"` detects LightX2V Turbo files by name
                and reads schedule fields from the file's `__metadata__`; a name from
                `diffusers_h3.loaders.lora_presets.KNOWN_PRESETS` or a `LoraDistillationPreset` sets it
                explicitly; `None` marks the adapter as an ordinary (non-distillation) LoRA. A PDD Acc-LoRA's
                schedule is read from its `__metadata__` (`pdd_num_steps` / `pdd_block_size`).
            allow_step_recipe_stacking (`bool`, defaults to `False`):
                A step-reduction recipe (a distillation LoRA such as LightX2V Turbo, a PDD Acc-LoRA, a FastH3 stack)
                loaded while another one is on the pipeline is refused, in one line naming both: they are
                alternatives, each distilled for its own schedule. `True` loads it anyway (with a warning).
        """
        hub_kwargs = {k: kwargs.pop(k) for k in _HUB_KWARGS if k in kwargs}
        low_cpu_mem_usage = kwargs.pop("low_cpu_mem_usage", None)
        if kwargs:
            raise TypeError(f"load_lora_weights() got unexpected keyword arguments {sorted(kwargs)}.")

        transformer = getattr(self, self.transformer_name, None)
        transformer_ref = getattr(self, self.transformer_ref_name, None)
        if transformer is None and transformer_ref is None:
            raise ValueError(
                "This pipeline holds neither `transformer` nor `transformer_ref`, so there is nothing to load a LoRA "
                "into. Load the pipeline with the partition the LoRA was trained for."
            )

        source = _read_source(pretrained_model_name_or_path_or_dict, hub_kwargs)
        check_lora_file(source.file_name, source.raw_keys, source.file_metadata)
        if source.raw_keys is not None and _pdd.is_pdd_file(source.raw_keys, source.file_metadata):
            return self._load_pdd(
                source, adapter_name, hotswap, load_into_transformer_ref, allow_unmatched_keys, network_alpha,
                distillation_preset, allow_step_recipe_stacking, low_cpu_mem_usage,
            )  # fmt: skip
        from_file = isinstance(source.load_from, str) and source.raw_keys is not None
        fp8 = read_fp8_lora(source.load_from) if from_file else None
        load_from = fp8.state_dict if fp8 is not None else source.load_from
        # diffusers converts every layout (and folds kohya `.alpha` tensors / reads `__metadata__` alpha).
        state_dict, metadata = self.lora_state_dict(load_from, return_lora_metadata=True, **source.load_kwargs)
        raw_keys = list(fp8.state_dict) if fp8 is not None else source.raw_keys
        raw_keys = raw_keys if raw_keys is not None else list(state_dict)
        layout = detect_lora_layout(raw_keys) + (f"; {fp8.describe()}" if fp8 is not None else "")
        state_dict = {
            k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v
            for k, v in state_dict.items()
        }
        if fp8 is not None and metadata is None:  # the file's `__metadata__` alpha, which diffusers reads from files only
            metadata = _file_alpha_metadata(state_dict, source.file_metadata, raw_keys,
                                            (self.transformer_name, self.transformer_ref_name))  # fmt: skip
        metadata, alpha_source = self._alpha_provenance(state_dict, metadata, raw_keys, source.file_metadata, network_alpha)
        kept, matched, unmatched = self._checked_match(
            state_dict, raw_keys, layout, load_into_transformer_ref, allow_unmatched_keys
        )
        preset = _select_preset(distillation_preset, source.file_name, source.file_metadata)
        if preset is not None and not hotswap and not _RECIPE_CHECKED.get():
            label = f"distillation LoRA {source.file_name or adapter_name or 'state dict'} ({preset.name})"
            for component in matched:
                self._check_one_step_recipe(label, allow_step_recipe_stacking, component)
        name = self._load_with_peft(kept, metadata, adapter_name, hotswap, load_into_transformer_ref, low_cpu_mem_usage)
        report = self._report_loaded(name, layout, matched, unmatched, alpha_source, preset, hotswap)
        logger.info(str(report))
        return report

    def _load_pdd(self, source, adapter_name, hotswap, load_into_transformer_ref, allow_unmatched_keys, network_alpha,
                  distillation_preset, allow_step_recipe_stacking, low_cpu_mem_usage) -> LoraLoadReport:  # fmt: skip
        """A PDD Acc-LoRA (:mod:`~diffusers_h3.loaders.pdd`): everything checked first, then the backbone through the
        ordinary path and the head bank onto the heads of the partition it went to."""
        where = f"PDD file {source.file_name}" if source.file_name else "PDD state dict"
        if hotswap:
            raise ValueError(f"{where}: hotswap cannot swap a PDD head bank; unload_lora_weights() and load it again")
        if isinstance(source.load_from, dict):
            state_dict = source.load_from
        else:
            from safetensors.torch import load_file

            state_dict = load_file(source.load_from)
        pdd = _pdd.read_pdd_file(state_dict, source.file_metadata, source.file_name)
        transformer = getattr(self, self.transformer_name, None)
        into_ref = load_into_transformer_ref or transformer is None
        component = self.transformer_ref_name if into_ref else self.transformer_name
        model = getattr(self, component)
        _pdd.check_head_bank_fits(model, pdd, component, where)
        preset = pdd.preset() if isinstance(distillation_preset, str) and distillation_preset == "auto" else (
            _select_preset(distillation_preset, source.file_name, {}))  # fmt: skip
        self._check_one_step_recipe(f"PDD Acc-LoRA {source.file_name or 'state dict'}", allow_step_recipe_stacking,
                                    component)  # fmt: skip
        alpha_from_metadata = network_alpha is None and pdd.alpha is not None and not any(
            k.endswith(".alpha") for k in pdd.backbone
        )  # per-module `.alpha` tensors (the ComfyUI conversion) are folded in by diffusers' converter
        if alpha_from_metadata:
            network_alpha = pdd.alpha
        load_args = {} if low_cpu_mem_usage is None else {"low_cpu_mem_usage": low_cpu_mem_usage}
        token = _RECIPE_CHECKED.set(True)
        try:
            report = self.load_lora_weights(
                pdd.backbone, adapter_name=adapter_name, load_into_transformer_ref=load_into_transformer_ref,
                allow_unmatched_keys=allow_unmatched_keys, network_alpha=network_alpha, distillation_preset=preset,
                **load_args,
            )  # fmt: skip
        finally:
            _RECIPE_CHECKED.reset(token)
        if set(report.components) != {component}:
            self.delete_adapters(report.adapter_name)
            raise ValueError(f"{where}: its backbone loaded into {sorted(report.components)}, not `{component}` "
                             "where its head bank goes")  # fmt: skip
        _pdd.install_head_bank(model, pdd, report.adapter_name, _first_lora_layer(model, report.adapter_name))
        _regroup_if_group_offloaded(model)  # the offload groups hold the heads' old tensors
        report.layout = pdd.layout
        if alpha_from_metadata:
            report.alpha_source = f"file __metadata__ lora_alpha={pdd.alpha:g}: scale alpha / rank per module"
        report.pdd = f"backbone rank {pdd.rank}; {pdd.schedule.describe()} on `{component}`"
        logger.info(f"PDD head bank of {report.adapter_name!r} on `{component}`: {pdd.schedule.describe()}")
        return report

    def _active_step_recipes(self) -> List[Tuple[str, str, str]]:
        """``[(kind, label, partition)]`` of the step-reduction recipes on the pipeline: ``"pdd"`` and ``"lora"``
        (distillation LoRAs) here; the pipeline adds its own (FastH3 stacks)."""
        registry = self._lora_preset_registry()
        adapters = self.get_list_adapters()
        recipes = []
        for component, model in self._lora_partitions().items():
            banks = {r.adapter for r in _pdd.head_bank_records(model)}
            for adapter in sorted(set(adapters.get(component, [])) | banks):
                preset = registry.get(adapter)
                if adapter in banks:
                    label = f"PDD Acc-LoRA {adapter!r}" + (f" ({preset.name})" if preset else "")
                    recipes.append(("pdd", label, component))
                elif preset is not None:
                    recipes.append(("lora", f"distillation LoRA {adapter!r} ({preset.name})", component))
            merged = merged_distillation_preset(self, None, component)
            if merged is not None:  # a Turbo LoRA merged into the DiT file this partition was loaded from
                recipes.append(("merged", f"{merged[0]} ({merged[1].name})", component))
        return recipes

    def _check_one_step_recipe(self, new: str, allow: bool, partition: str, exclude: Sequence[str] = ()) -> None:
        """Refuse ``new`` (a step-reduction recipe about to load onto ``partition``) while another one is on that
        partition (each partition runs its own tasks), unless ``allow`` (then warn). ``exclude``: recipe kinds
        ``new`` replaces rather than stacks on."""
        present = [
            f"{label} on `{where}`" for kind, label, where in self._active_step_recipes()
            if where == partition and kind not in exclude
        ]  # fmt: skip
        if not present:
            return
        if not allow:
            raise ValueError(
                f"{new} is a step-reduction recipe and {present[0]} is already loaded: step recipes (LightX2V "
                "Turbo, PDD, FastH3, VDN) are alternatives, each distilled for its own schedule, not a stack. Unload "
                "the first (unload_lora_weights(), delete_adapters(), disable_fasth3_preset(pipe)), or pass "
                "`allow_step_recipe_stacking=True` to load both."
            )
        logger.warning(f"Stacking step recipes: {new} on top of {', '.join(present)} (allow_step_recipe_stacking=True); "
                       "the schedule of one of them runs, which the other was not distilled for.")  # fmt: skip

    def _alpha_provenance(self, state_dict, metadata, raw_keys, file_metadata, network_alpha):
        """The adapter metadata to load with and where its alpha comes from (for the report).

        diffusers folds per-module `.alpha` tensors into the weights for the layouts that carry them (kohya /
        musubi); any left over were not applied and are reported as unmatched keys.
        """
        has_alpha_tensors = any(k.endswith(".alpha") for k in raw_keys) and not any(
            k.endswith(".alpha") for k in state_dict
        )
        if network_alpha is not None:
            if has_alpha_tensors:
                raise ValueError(
                    "`network_alpha` was passed, but this file has per-module `.alpha` tensors, which are already "
                    "folded into its weights; the alpha would apply twice. Drop `network_alpha`."
                )
            partitions = {self.transformer_name, self.transformer_ref_name}
            prefixes = sorted({k.split(".", 1)[0] for k in state_dict} & partitions)
            metadata = _uniform_alpha_metadata(state_dict, network_alpha, prefixes) or None
            return metadata, f"network_alpha={network_alpha:g} (argument): scale alpha / rank per module"
        if has_alpha_tensors:
            return metadata, "per-module .alpha tensors (kohya), folded into the weights"
        if metadata is not None and "lora_adapter_metadata" in file_metadata:
            return metadata, "LoRA adapter config saved with the file (diffusers save_lora_weights)"
        if metadata is not None and "alpha" in file_metadata:
            return metadata, f"file __metadata__ alpha={file_metadata['alpha']}: scale alpha / rank per module"
        if metadata is not None:
            return metadata, "LoRA adapter config passed with the weights"
        logger.warning(
            "This LoRA file records no alpha (no `.alpha` tensors, no `alpha` in its `__metadata__`, no saved "
            "adapter config), so it loads with the documented default alpha == rank (scale 1.0). If it was "
            "trained with another alpha, pass `network_alpha=` to `load_lora_weights`."
        )
        return metadata, _DEFAULT_ALPHA_NOTE

    def _checked_match(self, state_dict, raw_keys, layout, load_into_transformer_ref, allow_unmatched_keys):
        """Match keys against the partition each prefix routes to; zero matches or unmatched keys are errors."""
        kept, matched, unmatched, deferred = self._match_lora_keys(state_dict, load_into_transformer_ref)
        if not any(matched.values()) and not deferred:
            raise ValueError(
                f"This LoRA matched no module of the pipeline ({layout} layout; first keys {sorted(raw_keys)[:4]}, "
                f"first converted keys {sorted(state_dict)[:4]}). It is not a MiniMax-H3 LoRA, or it targets modules "
                "this checkpoint does not have."
            )
        if unmatched:
            message = (
                f"{len(unmatched)} LoRA keys match no LoRA-able module of the target partition: "
                f"{', '.join(sorted(unmatched)[:8])}{' ...' if len(unmatched) > 8 else ''}."
            )
            if not allow_unmatched_keys:
                raise ValueError(
                    f"{message} Pass `allow_unmatched_keys=True` to load the {sum(map(len, matched.values()))} "
                    "matched modules and skip these keys."
                )
            logger.warning(f"{message} They are skipped (allow_unmatched_keys=True).")
        return kept, matched, unmatched

    def _load_with_peft(self, state_dict, metadata, adapter_name, hotswap, load_into_transformer_ref,
                        low_cpu_mem_usage) -> str:  # fmt: skip
        """Load through diffusers / PEFT; returns the name of the adapter PEFT built."""
        before = {name: set(getattr(m, "peft_config", {}) or {}) for name, m in self._lora_partitions().items()}
        load_args = {} if low_cpu_mem_usage is None else {"low_cpu_mem_usage": low_cpu_mem_usage}
        with _pending_metadata(metadata):
            super().load_lora_weights(
                state_dict,
                adapter_name=adapter_name,
                hotswap=hotswap,
                load_into_transformer_ref=load_into_transformer_ref,
                **load_args,
            )
        if hotswap:
            return adapter_name
        new = set()
        for component, model in self._lora_partitions().items():
            new |= set(getattr(model, "peft_config", {}) or {}) - before.get(component, set())
        if len(new) != 1:
            raise RuntimeError(f"Expected one new adapter after loading, found {sorted(new)}.")
        return new.pop()

    def _report_loaded(self, name, layout, matched, unmatched, alpha_source, preset, hotswap) -> LoraLoadReport:
        """The report, from what PEFT actually built; records the adapter's distillation preset."""
        components = {}
        for component in matched:
            report = self._component_report(component, name)
            missing = matched[component] - set(report.matched_modules)
            if missing:
                logger.warning(
                    f"PEFT did not attach adapter {name!r} to {len(missing)} matched modules of `{component}`: "
                    f"{sorted(missing)[:8]}."
                )
            components[component] = report
        report = LoraLoadReport(
            adapter_name=name,
            layout=layout,
            components=components,
            unmatched_keys=sorted(unmatched),
            alpha_source=alpha_source,
            preset=preset,
            hotswap=hotswap,
        )
        presets = self._lora_preset_registry()
        if preset is None:
            presets.pop(name, None)
        else:
            presets[name] = preset
            trained_on = partition_for_tasks(preset.tasks) if preset.tasks else None
            wrong = [c for c in components if trained_on is not None and c != trained_on]
            if wrong:
                logger.warning(
                    f"Distillation LoRA {name!r} ({preset.name}) was trained for {'/'.join(preset.tasks)}, which "
                    f"runs on `{trained_on}`, but it was loaded into `{wrong[0]}`."
                )
        return report

    @classmethod
    def load_lora_into_transformer(cls, state_dict, transformer, adapter_name=None, _pipeline=None,
                                   low_cpu_mem_usage=False, hotswap: bool = False, metadata=None):
        """diffusers' loader, keeping the offload hooks."""
        if metadata is None:
            metadata = _PENDING_METADATA.get()
        _pipeline, regroup = _offload_toggle(transformer, _pipeline)
        super().load_lora_into_transformer(
            state_dict, transformer, adapter_name=adapter_name, _pipeline=_pipeline,
            low_cpu_mem_usage=low_cpu_mem_usage, hotswap=hotswap, metadata=metadata,
        )
        if regroup:
            _rebuild_offload_groups(transformer)

    @classmethod
    def load_lora_into_transformer_ref(cls, state_dict, transformer_ref, prefix, adapter_name=None, _pipeline=None,
                                       low_cpu_mem_usage=False, hotswap: bool = False, metadata=None):
        """diffusers' loader, keeping the offload hooks."""
        if metadata is None:
            metadata = _PENDING_METADATA.get()
        _pipeline, regroup = _offload_toggle(transformer_ref, _pipeline)
        super().load_lora_into_transformer_ref(
            state_dict, transformer_ref, prefix, adapter_name=adapter_name, _pipeline=_pipeline,
            low_cpu_mem_usage=low_cpu_mem_usage, hotswap=hotswap, metadata=metadata,
        )
        if regroup:
            _rebuild_offload_groups(transformer_ref)

    def fuse_lora(self, *args, **kwargs):
        """diffusers' ``fuse_lora``; LoRA layers around GGUF layers (a .gguf DiT) are refused first, in one line."""
        check_fusable(self)
        return super().fuse_lora(*args, **kwargs)

    # ---- adapter bookkeeping ----------------------------------------------------------------------------------------
    def unload_lora_weights(self, *args, **kwargs):
        super().unload_lora_weights(*args, **kwargs)
        for model in self._lora_partitions().values():
            if _pdd.remove_head_banks(model):  # the base heads back, bit for bit
                _regroup_if_group_offloaded(model)
        self._lora_preset_registry().clear()

    def set_adapters(
        self,
        adapter_names: Union[List[str], str],
        adapter_weights: Union[float, Dict, List[float], List[Dict], None] = None,
    ):
        """diffusers' `set_adapters`; a NaN or infinite weight (anywhere in `adapter_weights`, per-block dicts
        included) is refused here, before a generation would run on it and end in NaN latents."""
        _check_finite_weights(adapter_weights)
        return super().set_adapters(adapter_names, adapter_weights)

    def delete_adapters(self, adapter_names: Union[List[str], str]):
        super().delete_adapters(adapter_names)
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        for model in self._lora_partitions().values():
            if _pdd.remove_head_banks(model, names):
                _regroup_if_group_offloaded(model)
        for name in names:
            self._lora_preset_registry().pop(name, None)

    def set_lora_distillation_preset(
        self, adapter_name: str, preset: Union[str, LoraDistillationPreset, None]
    ) -> None:
        """Attach (or with ``None`` remove) the distillation schedule of a loaded adapter."""
        loaded = {a for adapters in self.get_list_adapters().values() for a in adapters}
        if adapter_name not in loaded:
            raise ValueError(f"No adapter {adapter_name!r} is loaded; loaded adapters: {sorted(loaded)}.")
        if isinstance(preset, str):
            preset = get_preset(preset).replace(source="argument")
        if preset is None:
            self._lora_preset_registry().pop(adapter_name, None)
        else:
            self._lora_preset_registry()[adapter_name] = preset

    def get_lora_distillation_presets(self) -> Dict[str, LoraDistillationPreset]:
        """Distillation presets of the loaded adapters, by adapter name."""
        loaded = {a for adapters in self.get_list_adapters().values() for a in adapters}
        return {a: p for a, p in self._lora_preset_registry().items() if a in loaded}

    def lora_summary(self) -> List[str]:
        """One line per loaded adapter: partitions, weight, preset (for ``describe_paths``)."""
        lines = []
        for component, model in self._lora_partitions().items():
            for adapter, weight, active in self._adapter_states(model):
                preset = self._lora_preset_registry().get(adapter)
                lines.append(
                    f"{component}: LoRA {adapter!r} weight={weight:g} {'active' if active else 'inactive'}"
                    + (f"; distillation preset {preset.describe()}" if preset else "")
                )
            lines += [f"{component}: {record.describe()}" for record in _pdd.head_bank_records(model)]
        return lines

    # ---- schedule hook ----------------------------------------------------------------------------------------------
    def _active_distillation_preset(self, task: Optional[str] = None):
        """`(adapter, preset)` of the active distillation LoRA on the partition `task` runs on (any partition for
        `None`), or `None`; warns about what breaks a distillation (several schedules, stacking, weight != 1, a
        task the adapter was not trained for)."""
        partitions = self._lora_partitions()
        if task is not None:
            wanted = partition_for_task(task)
            partitions = {k: v for k, v in partitions.items() if k == wanted}
        registry = self._lora_preset_registry()
        distill, others = [], []
        for model in partitions.values():
            for adapter, weight, active in self._adapter_states(model):
                if not active:
                    continue
                if adapter in registry:
                    distill.append((adapter, weight, registry[adapter]))
                elif weight != 0:
                    others.append(adapter)
        if not distill:
            return None

        adapter, weight, preset = distill[0]
        distinct = {(p.num_inference_steps, p.flow_shift, p.audio_flow_shift) for _, _, p in distill}
        if len(distinct) > 1:
            logger.warning(
                f"Several distillation LoRAs with different schedules are active ({[a for a, _, _ in distill]}); "
                f"using the schedule of {adapter!r}. Activate one with `set_adapters`."
            )
        if others:
            logger.warning(
                f"Distillation LoRA {adapter!r} is active together with {sorted(set(others))}; stacking LoRAs on a "
                "step-distillation adapter usually breaks the distillation."
            )
        if abs(weight - 1.0) > 1e-6:
            logger.warning(
                f"Distillation LoRA {adapter!r} is active at weight {weight:g}; it was trained at weight 1.0."
            )
        if task is not None and preset.tasks and task not in preset.tasks:
            logger.warning(
                f"Distillation LoRA {adapter!r} ({preset.name}) was trained for {'/'.join(preset.tasks)}, not {task}."
            )
        return adapter, preset

    def _resolve_lora_schedule(
        self,
        num_inference_steps: Optional[int],
        flow_shift: Optional[float],
        audio_flow_shift: Optional[float],
        sigmas: Optional[Sequence[float]] = None,
        audio_sigmas: Optional[Sequence[float]] = None,
        task: Optional[str] = None,
    ) -> Tuple[Optional[int], Optional[float], Optional[float]]:
        """Fill ``None`` settings from the active distillation LoRA's preset and warn about explicit ones it was not
        trained for (:func:`~diffusers_h3.loaders.lora_presets.resolve_schedule`). Without an active distillation
        LoRA the values come back unchanged."""
        active = self._active_distillation_preset(task) or merged_distillation_preset(self, task)
        if active is None:
            return num_inference_steps, flow_shift, audio_flow_shift
        adapter, preset = active
        num_inference_steps, flow_shift, audio_flow_shift, differences = resolve_schedule(
            preset, num_inference_steps, sigmas, flow_shift, audio_sigmas, audio_flow_shift
        )
        warn_schedule_differences(adapter, preset, differences)
        return num_inference_steps, flow_shift, audio_flow_shift

    # ---- internals --------------------------------------------------------------------------------------------------
    def _match_lora_keys(self, state_dict: Dict[str, torch.Tensor], load_into_transformer_ref: bool):
        """Split converted keys into those naming a LoRA-able module of the partition they route to and the rest.

        Returns ``(kept, matched, unmatched, deferred)``: the state dict to load, matched module names per partition,
        unmatched keys, and whether some keys route to a partition the pipeline lacks (diffusers raises for those).
        Raises for tensors whose shape does not fit the module they name.
        """
        transformer = getattr(self, self.transformer_name, None)
        transformer_ref = getattr(self, self.transformer_ref_name, None)
        into_ref = load_into_transformer_ref or transformer is None
        ref_target = (self.transformer_ref_name, transformer_ref)
        fl2v_target = ref_target if into_ref else (self.transformer_name, transformer)
        targets = {self.transformer_name: fl2v_target, self.transformer_ref_name: ref_target}

        module_maps: Dict[str, Dict[str, nn.Module]] = {}
        matched: Dict[str, set] = collections.defaultdict(set)
        unmatched: List[str] = []
        mismatched: List[str] = []
        kept: Dict[str, torch.Tensor] = {}
        deferred = False
        for key, value in state_dict.items():
            prefix, _, rest = key.partition(".")
            parsed = _KEY_RE.match(rest) if prefix in targets else None
            if parsed is None:
                unmatched.append(key)
                continue
            component, model = targets[prefix]
            if model is None:
                kept[key], deferred = value, True
                continue
            if component not in module_maps:
                module_maps[component] = dict(model.named_modules())
            name = parsed["module"]
            module = module_maps[component].get(name)
            inside_peft = any(part == "base_layer" or part.startswith("lora_") for part in name.split("."))
            target = _lora_target(module) if module is not None and not inside_peft else None
            if target is None:
                unmatched.append(key)
                continue
            if parsed["kind"] == "lora_A" and value.ndim == 2 and value.shape[1] != target.in_features:
                mismatched.append(f"{key}: {tuple(value.shape)} vs in_features={target.in_features}")
            if parsed["kind"] == "lora_B" and value.shape[0] != target.out_features:
                mismatched.append(f"{key}: {tuple(value.shape)} vs out_features={target.out_features}")
            matched[component].add(name)
            kept[key] = value
        if mismatched:
            raise ValueError(
                f"{len(mismatched)} LoRA tensors do not fit the modules they name (first: {mismatched[:3]}). The LoRA "
                "was trained for another checkpoint (e.g. a pruned AdaLN-table H3 checkpoint) or another model."
            )
        return kept, matched, unmatched, deferred

    def _lora_preset_registry(self) -> Dict[str, LoraDistillationPreset]:
        registry = self.__dict__.get("_h3_lora_presets")
        if registry is None:
            registry = {}
            self.__dict__["_h3_lora_presets"] = registry
        return registry

    def _lora_partitions(self) -> Dict[str, nn.Module]:
        out = {}
        for name in (self.transformer_name, self.transformer_ref_name):
            model = getattr(self, name, None)
            if isinstance(model, nn.Module):
                out[name] = model
        return out

    @staticmethod
    def _adapter_states(model: nn.Module) -> List[Tuple[str, float, bool]]:
        """(adapter, weight, active) per adapter loaded in ``model``; weight = scaling / (alpha / r)."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        states: Dict[str, Tuple[float, bool]] = {}
        for module in model.modules():
            if not isinstance(module, BaseTunerLayer) or not hasattr(module, "scaling"):
                continue
            active = set(module.active_adapters) if not module.disable_adapters else set()
            for adapter in module.lora_A:
                if adapter in states:
                    continue
                nominal = module.lora_alpha[adapter] / module.r[adapter]
                if getattr(module, "use_rslora", {}).get(adapter):
                    nominal = module.lora_alpha[adapter] / module.r[adapter] ** 0.5
                states[adapter] = (module.scaling[adapter] / nominal, adapter in active)
        return [(a, w, act) for a, (w, act) in states.items()]

    def _component_report(self, component: str, adapter: str) -> LoraComponentReport:
        model = getattr(self, component)
        modules, quantized = [], collections.Counter()
        ranks, alphas = collections.Counter(), collections.Counter()
        for name, layer in _adapter_layers(model, adapter):
            modules.append(name)
            ranks[layer.r[adapter]] += 1
            alphas[float(layer.lora_alpha[adapter])] += 1
            weight = quantized_weight(layer.get_base_layer())
            if weight is not None:
                quantized[str(weight.quant_method)] += 1
        return LoraComponentReport(component, sorted(modules), dict(quantized), dict(ranks), dict(alphas))
