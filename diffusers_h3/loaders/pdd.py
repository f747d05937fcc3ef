"""PDD Acc-LoRAs for MiniMax-H3: a backbone LoRA plus a bank of interval output heads.

Parallel Decoding Distillation (NVIDIA) trains a student whose one forward covers a block of a fine teacher grid:
``num_heads`` intervals (32 for alibaba-pai's ``MiniMax-H3-Acc-LoRAs``) of ``linspace(1, 0, num_heads + 1)`` pushed
through the shift (12 for video, 3 for audio), each interval with its own output projection. A sampling step from
``sigma`` to ``next sigma`` uses the Δσ-weighted mean of the heads of the fine intervals it spans (Δσ = the part of
the fine interval inside the step): with the trained schedule (``pdd_num_steps / pdd_block_size`` forwards, i.e. 9
sigma points for 32 / 4, on the same shifts) every step spans exactly ``block_size`` whole intervals. The backbone
LoRA loads through PEFT like any LoRA; the bank replaces the weight and bias of ``proj_out`` / ``audio_proj_out``
(shape ``[num_heads * out, in]`` / ``[num_heads * out]``, a patch that changes their shape), and a hook on each head
mixes the bank per step, reading the step's sigma interval from the :class:`~diffusers_h3.layout.PackedLayout` the
pipeline publishes for every transformer call. The base head is kept aside and put back bit for bit on unload (the
bank's head 0 is itself distilled, so it is not the base).

File layouts read (both carry ``pdd_num_steps`` / ``pdd_block_size`` in ``__metadata__``):

* alibaba-pai's release: ``<module>.lora_down`` / ``.lora_up`` in diffusers module names (``transformer_blocks.N...``,
  ``token_refiner.refiner_blocks.N...``), alpha in ``lora_alpha`` metadata, and the bank as ``proj_out.weight``
  ``[N, 96, in]``, ``proj_out.bias`` ``[N, 96]``, ``audio_proj_out.weight`` / ``.bias`` likewise;
* the ComfyUI conversion: the backbone in ComfyUI names (``diffusion_model.blocks.N.attn.qkv_proj...`` with
  ``.alpha``), the bank as ``diffusion_model.final_layer.{video,audio}_out.set_weight`` ``[N * out, in]`` and
  ``.set_bias`` ``[N * out]``, the rows of head k at ``[k * out, (k + 1) * out)``.

The schedule is read from the file: forwards ``= pdd_num_steps / pdd_block_size``; shifts from ``pdd_shift_video`` /
``pdd_shift_audio`` when the file records them, else the published 12 / 3.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .._hooks import H3_PDD_HEAD_BANK_HOOK, H3Hook, get_h3_hook, hooked_modules, register_h3_hook, remove_h3_hook
from ..layout import current_packed_layout
from ..tasks import tasks_of_family
from .lora_presets import LoraDistillationPreset


PDD_VIDEO_SHIFT = 12.0  # the published shifts the head grids were trained on
PDD_AUDIO_SHIFT = 3.0
# A step boundary this close to a grid point is that grid point (the scheduler computes its sigmas in float32).
GRID_SNAP_TOLERANCE = 1e-5

HEAD_MODULES = ("proj_out", "audio_proj_out")  # the diffusers heads the bank replaces
_MODALITY = {"proj_out": "video", "audio_proj_out": "audio"}
_ALIBABA_BANK = {"proj_out": "proj_out", "audio_proj_out": "audio_proj_out"}
_COMFY_BANK = {
    "proj_out": "diffusion_model.final_layer.video_out",
    "audio_proj_out": "diffusion_model.final_layer.audio_out",
}
_DOWN_UP = re.compile(r"^(?P<module>.+)\.lora_(?P<kind>down|up)(?:\.weight)?$")
_STEP_METADATA = ("pdd_num_steps", "pdd_block_size")


# ---------------------------------------------------------------------------------------------------------------------
# Schedule and head mixing (pure)
# ---------------------------------------------------------------------------------------------------------------------
def shifted_grid(num_heads: int, shift: float) -> torch.Tensor:
    """The ``num_heads + 1`` fine sigmas, descending from 1 to 0: ``linspace(1, 0, num_heads + 1)`` through the shift
    ``shift * t / (1 + (shift - 1) * t)`` (the scheduler's), in float64."""
    t = torch.linspace(1.0, 0.0, num_heads + 1, dtype=torch.float64)
    return shift * t / (1 + (shift - 1) * t)


def head_weights(sigma: float, next_sigma: float, num_heads: int, shift: float) -> torch.Tensor:
    """The weight of each head for a step from ``sigma`` down to ``next_sigma``: the length (in sigma) of the part of
    each fine interval the step spans, divided by the step's length. Step ends within ``GRID_SNAP_TOLERANCE`` of a
    grid point are taken as that point. Returns ``num_heads`` float64 weights summing to 1."""
    if not 0.0 <= next_sigma < sigma <= 1.0:
        raise ValueError(
            f"a PDD step must go down within [0, 1], got sigma {sigma!r} -> {next_sigma!r}: pass a strictly "
            "decreasing schedule that ends at 0"
        )
    grid = shifted_grid(num_heads, shift)

    def snap(value: float) -> float:
        nearest = int(torch.argmin((grid - value).abs()))
        return float(grid[nearest]) if abs(float(grid[nearest]) - value) <= GRID_SNAP_TOLERANCE else value

    top, bottom = snap(sigma), snap(next_sigma)
    covered = (torch.minimum(grid[:-1], torch.tensor(top, dtype=torch.float64))
               - torch.maximum(grid[1:], torch.tensor(bottom, dtype=torch.float64))).clamp_(min=0)  # fmt: skip
    return covered / covered.sum()


@dataclasses.dataclass(frozen=True)
class PDDSchedule:
    """The grid a head bank was trained on and the sampling schedule it implies."""

    num_heads: int  # fine intervals, one head each (pdd_num_steps)
    block_size: int  # fine intervals one trained step spans (pdd_block_size)
    flow_shift: float = PDD_VIDEO_SHIFT
    audio_flow_shift: float = PDD_AUDIO_SHIFT
    shift_source: str = "published"  # "metadata" when the file records its shifts

    @property
    def forwards(self) -> int:
        return self.num_heads // self.block_size

    @property
    def sigma_points(self) -> int:
        return self.forwards + 1

    def shift_of(self, modality: str) -> float:
        return self.flow_shift if modality == "video" else self.audio_flow_shift

    def describe(self) -> str:
        return (
            f"{self.num_heads} interval heads, {self.forwards} forwards of {self.block_size} heads "
            f"({self.sigma_points} sigma points), shifts {self.flow_shift:g} / {self.audio_flow_shift:g} "
            f"({self.shift_source})"
        )


# ---------------------------------------------------------------------------------------------------------------------
# Reading a file
# ---------------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class PDDFile:
    """A checked PDD file: what ``load_lora_weights`` loads through PEFT and the head bank it installs."""

    layout: str
    backbone: Dict[str, torch.Tensor]  # LoRA factors in a layout ``load_lora_weights`` converts
    heads: Dict[str, Tuple[torch.Tensor, torch.Tensor]]  # head module -> (weight [N, out, in], bias [N, out])
    schedule: PDDSchedule
    rank: int
    alpha: Optional[float]  # from the file's `lora_alpha` metadata (None: the file records none)
    tasks: Tuple[str, ...]  # from the file name (FL2VA / Ref2VA); empty when it does not say

    def preset(self) -> LoraDistillationPreset:
        s = self.schedule
        family = {("t2va", "fl2va"): "fl2va", ("ref2va",): "ref2va"}.get(tuple(self.tasks), "")
        return LoraDistillationPreset(
            name=f"pdd-acc-{s.forwards}step" + (f"-{family}" if family else ""),
            num_inference_steps=s.sigma_points,
            flow_shift=s.flow_shift,
            audio_flow_shift=s.audio_flow_shift,
            tasks=self.tasks,
            source="PDD metadata" + ("" if s.shift_source == "metadata" else " + published shifts"),
        )


def is_pdd_file(keys: Sequence[str], metadata: Optional[Mapping[str, str]]) -> bool:
    """Whether a LoRA file is a PDD Acc-LoRA: its metadata records a PDD grid, or it carries a head bank."""
    if metadata and any(key in metadata for key in _STEP_METADATA):
        return True
    keys = set(keys)
    return any(f"{name}.weight" in keys for name in _ALIBABA_BANK.values()) or any(
        f"{name}.set_weight" in keys for name in _COMFY_BANK.values()
    )


def _metadata_int(metadata: Mapping[str, str], key: str, where: str) -> int:
    if key not in metadata:
        raise ValueError(f"{where} records no `{key}` in its __metadata__: a PDD file needs pdd_num_steps and "
                         "pdd_block_size (alibaba-pai's files have 32 and 4)")  # fmt: skip
    try:
        value = float(metadata[key])
    except (TypeError, ValueError):
        value = float("nan")
    if not value.is_integer() or value < 1:
        raise ValueError(f"{where}: __metadata__ {key}={metadata[key]!r} is not a positive integer")
    return int(value)


def _metadata_float(metadata: Mapping[str, str], key: str, where: str) -> Optional[float]:
    if key not in metadata:
        return None
    try:
        value = float(metadata[key])
    except (TypeError, ValueError):
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{where}: __metadata__ {key}={metadata[key]!r} is not a positive number")
    return value


def read_schedule(metadata: Mapping[str, str], where: str) -> PDDSchedule:
    num_heads = _metadata_int(metadata, "pdd_num_steps", where)
    block_size = _metadata_int(metadata, "pdd_block_size", where)
    if num_heads % block_size:
        raise ValueError(f"{where}: pdd_num_steps={num_heads} is not a whole number of pdd_block_size={block_size} "
                         "blocks, so no sampling schedule lands on its grid")  # fmt: skip
    video = _metadata_float(metadata, "pdd_shift_video", where)
    audio = _metadata_float(metadata, "pdd_shift_audio", where)
    recorded = video is not None or audio is not None
    return PDDSchedule(
        num_heads, block_size,
        PDD_VIDEO_SHIFT if video is None else video, PDD_AUDIO_SHIFT if audio is None else audio,
        "metadata" if recorded else "published",
    )  # fmt: skip


def _tasks_from_name(file_name: Optional[str]) -> Tuple[str, ...]:
    base = re.split(r"[/\\]", str(file_name or ""))[-1].lower()
    if "ref2va" in base or "ref2v" in base:
        return tasks_of_family("ref2v")
    if "fl2va" in base or "fl2v" in base:
        return tasks_of_family("fl2v")
    return ()


def _bank(state_dict, weight_key, bias_key, num_heads, where) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(weight [N, out, in], bias [N, out])`` from the stored tensors (``[N, out, in]`` or ``[N * out, in]``)."""
    missing = [k for k in (weight_key, bias_key) if k not in state_dict]
    if missing:
        raise ValueError(f"{where} is a partial PDD file: {missing[0]!r} is missing (a PDD head bank has a weight and "
                         "a bias for both heads); download the whole file again")  # fmt: skip
    weight, bias = state_dict[weight_key], state_dict[bias_key]
    if weight.ndim == 2 and bias.ndim == 1 and weight.shape[0] % num_heads == 0 and bias.numel() % num_heads == 0:
        weight = weight.reshape(num_heads, weight.shape[0] // num_heads, weight.shape[1])
        bias = bias.reshape(num_heads, bias.numel() // num_heads)
    if weight.ndim != 3 or bias.ndim != 2 or weight.shape[0] != num_heads or tuple(bias.shape) != tuple(weight.shape[:2]):
        raise ValueError(
            f"{where}: the head bank {weight_key} {tuple(weight.shape)} / {bias_key} {tuple(bias.shape)} is not "
            f"{num_heads} heads (pdd_num_steps) of one weight and bias each"
        )
    return weight, bias


def read_pdd_file(
    state_dict: Mapping[str, torch.Tensor], metadata: Optional[Mapping[str, str]], file_name: Optional[str] = None
) -> PDDFile:
    """Split and check a PDD Acc-LoRA (either layout of the module docstring); one line names the first problem."""
    where = f"PDD file {file_name}" if file_name else "PDD state dict"
    metadata = dict(metadata or {})
    schedule = read_schedule(metadata, where)
    comfy = any(f"{name}.set_weight" in state_dict for name in _COMFY_BANK.values())
    names = _COMFY_BANK if comfy else _ALIBABA_BANK
    heads = {}
    for module, stored in names.items():
        suffixes = (".set_weight", ".set_bias") if comfy else (".weight", ".bias")
        heads[module] = _bank(state_dict, stored + suffixes[0], stored + suffixes[1], schedule.num_heads, where)
    bank_keys = {names[m] + s for m in names for s in ((".set_weight", ".set_bias") if comfy else (".weight", ".bias"))}
    rest = {k: v for k, v in state_dict.items() if k not in bank_keys}
    if comfy:
        backbone = rest  # ComfyUI names with `.alpha`: diffusers' converter reads them
        ranks = [v.shape[0] for k, v in rest.items() if k.endswith(".lora_A.weight") and v.ndim == 2]
        layout = "PDD Acc-LoRA, ComfyUI conversion (set_weight / set_bias head bank)"
    else:
        backbone, ranks = _alibaba_backbone(rest, where)
        layout = "PDD Acc-LoRA, alibaba-pai release (diffusers names, lora_down / lora_up, head bank)"
    if not backbone:
        raise ValueError(f"{where} has a head bank but no backbone LoRA: the heads were trained together with it; "
                         "download the whole file again")  # fmt: skip
    alpha = _metadata_float(metadata, "lora_alpha", where)
    rank = max(ranks) if ranks else 0
    return PDDFile(layout, backbone, heads, schedule, rank, alpha, _tasks_from_name(file_name))


def _alibaba_backbone(rest: Mapping[str, torch.Tensor], where: str) -> Tuple[Dict[str, torch.Tensor], List[int]]:
    """``<module>.lora_down`` / ``.lora_up`` (diffusers names) -> ``transformer.<module>.lora_A/B.weight``."""
    pairs: Dict[str, Dict[str, torch.Tensor]] = {}
    unknown = []
    for key, value in rest.items():
        match = _DOWN_UP.match(key)
        if match is None:
            unknown.append(key)
            continue
        pairs.setdefault(match["module"], {})[match["kind"]] = value
    if unknown:
        raise ValueError(f"{where} has {len(unknown)} keys that are neither backbone LoRA factors (lora_down / "
                         f"lora_up) nor the head bank, e.g. {sorted(unknown)[:3]}: not a PDD Acc-LoRA layout this "
                         "loader knows")  # fmt: skip
    half = sorted(m for m, p in pairs.items() if len(p) != 2)
    if half:
        raise ValueError(f"{where} is a partial PDD file: {half[0]!r} has lora_down or lora_up but not both "
                         f"({len(half)} such modules); download the whole file again")  # fmt: skip
    backbone, ranks = {}, []
    for module, pair in pairs.items():
        backbone[f"transformer.{module}.lora_A.weight"] = pair["down"]
        backbone[f"transformer.{module}.lora_B.weight"] = pair["up"]
        ranks.append(pair["down"].shape[0])
    return backbone, ranks


# ---------------------------------------------------------------------------------------------------------------------
# The head bank on a transformer
# ---------------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class PDDHeadBankRecord:
    """What a head hook runs, and the base head it keeps aside for unloading."""

    adapter: str
    modality: str  # "video" or "audio"
    schedule: PDDSchedule
    out_features: int
    base_weight: torch.Tensor  # the head's parameters before the bank replaced them, restored as they were
    base_bias: Optional[torch.Tensor]
    probe: Optional[nn.Module] = None  # a PEFT layer of the backbone: its adapter state gates the bank
    backbone_rank: int = 0

    def describe(self) -> str:
        return (
            f"PDD head bank of adapter {self.adapter!r} (backbone rank {self.backbone_rank}): "
            f"{self.schedule.num_heads} {self.modality} heads of {self.out_features} outputs; "
            f"{self.schedule.describe()}"
        )


def _adapter_weight(probe: Optional[nn.Module], adapter: str) -> float:
    """The weight the backbone adapter runs at (0 when it is inactive or gone), from one of its PEFT layers."""
    if probe is None or adapter not in getattr(probe, "lora_A", {}):
        return 0.0
    if probe.disable_adapters or adapter not in probe.active_adapters:
        return 0.0
    nominal = probe.lora_alpha[adapter] / probe.r[adapter]
    if getattr(probe, "use_rslora", {}).get(adapter):
        nominal = probe.lora_alpha[adapter] / probe.r[adapter] ** 0.5
    return probe.scaling[adapter] / nominal


class PDDHeadBankHook(H3Hook):
    """On ``proj_out`` / ``audio_proj_out`` holding a bank: the head of each call is the Δσ-weighted mean of the bank's
    heads over the step's sigma interval. At adapter weight ``w`` the output is ``base + w * (bank - base)``; with the
    adapter inactive, the base head's."""

    def new_forward(self, module: nn.Module, hidden_states: torch.Tensor, *args, **kwargs):
        record: PDDHeadBankRecord = self.record
        weight = _adapter_weight(record.probe, record.adapter)
        if weight == 0.0:
            return self._base(hidden_states)
        sigma, next_sigma = self.step_interval()
        n, out = record.schedule.num_heads, record.out_features
        mix = head_weights(sigma, next_sigma, n, record.schedule.shift_of(record.modality))
        used = torch.nonzero(mix).flatten()
        mix = mix[used].to(device=module.weight.device, dtype=torch.float32)
        bank = module.weight.view(n, out, -1).index_select(0, used.to(module.weight.device)).float()
        head = torch.einsum("k,koi->oi", mix, bank).to(hidden_states.dtype)
        bias = None
        if module.bias is not None:
            biases = module.bias.view(n, out).index_select(0, used.to(module.bias.device)).float()
            bias = torch.einsum("k,ko->o", mix, biases).to(hidden_states.dtype)
        output = F.linear(hidden_states, head, bias)
        if weight != 1.0:
            base = self._base(hidden_states)
            output = base + weight * (output - base)
        return output

    def step_interval(self) -> Tuple[float, float]:
        record: PDDHeadBankRecord = self.record
        layout = current_packed_layout()
        interval = None
        if layout is not None:
            interval = layout.sigma_interval if record.modality == "video" else layout.audio_sigma_interval
        if interval is None:
            raise RuntimeError(
                f"The PDD head bank of adapter {record.adapter!r} mixes its heads by the step's sigma interval, but "
                "none is published: run the transformer through MiniMaxH3Pipeline, or wrap your call in "
                "`with diffusers_h3.use_packed_layout(layout.at_step(i, n, (sigma, next_sigma), (audio_sigma, "
                "next_audio_sigma))):`"
            )
        return float(interval[0]), float(interval[1])

    def _base(self, hidden_states: torch.Tensor) -> torch.Tensor:
        record: PDDHeadBankRecord = self.record
        device = hidden_states.device
        bias = None if record.base_bias is None else record.base_bias.to(device)
        return F.linear(hidden_states, record.base_weight.to(device), bias)


def head_bank_records(model: nn.Module) -> List[PDDHeadBankRecord]:
    return [get_h3_hook(m, H3_PDD_HEAD_BANK_HOOK).record for _, m in hooked_modules(model, H3_PDD_HEAD_BANK_HOOK)]


def check_head_bank_fits(model: nn.Module, pdd: PDDFile, component: str, where: str) -> None:
    """Refuse, before anything loads, a bank that does not fit ``model``'s heads or a second bank on it."""
    for record in head_bank_records(model):
        raise ValueError(f"`{component}` already holds the PDD head bank of adapter {record.adapter!r}: one bank per "
                         "partition; unload_lora_weights() or delete_adapters() first")  # fmt: skip
    from diffusers.hooks.group_offloading import _is_group_offload_enabled

    regrouped = _is_group_offload_enabled(model)  # its hooks are put back around the bank's after loading
    for name, (weight, _) in pdd.heads.items():
        head = getattr(model, name, None)
        if not isinstance(head, nn.Linear):
            raise ValueError(f"{where}: `{component}` has no {name} linear for the head bank")
        registry = getattr(head, "_diffusers_hook", None)
        foreign = [] if registry is None or regrouped else list(registry._hook_order)
        if getattr(head, "_hf_hook", None) is not None or foreign:
            hooks = foreign or ["an Accelerate hook (sequential CPU offload or a device map)"]
            raise ValueError(
                f"{where}: `{component}.{name}` carries {hooks}, which the head bank's forward would bypass: load "
                "the PDD file before enabling context parallelism, and on a transformer without sequential offload "
                "or a device map (model offload and enable_low_memory_offload are fine)"
            )
        if tuple(weight.shape[1:]) != (head.out_features, head.in_features):
            raise ValueError(
                f"{where}: the {name} bank holds heads of shape {tuple(weight.shape[1:])} but `{component}.{name}` "
                f"is ({head.out_features}, {head.in_features}): the file was trained for another model"
            )


def install_head_bank(model: nn.Module, pdd: PDDFile, adapter: str, probe: Optional[nn.Module]) -> None:
    """Replace each head's weight / bias with the bank (a shape-changing patch) and hook the head to mix it."""
    for name, (weight, bias) in pdd.heads.items():
        head: nn.Linear = getattr(model, name)
        base_weight, base_bias = head.weight, head.bias
        dtype = base_weight.dtype if base_weight.is_floating_point() else torch.float32
        device = base_weight.device
        bank_weight = weight.to(device=device, dtype=dtype).reshape(-1, weight.shape[-1])
        record = PDDHeadBankRecord(adapter, _MODALITY[name], pdd.schedule, head.out_features, base_weight, base_bias,
                                   probe, pdd.rank)  # fmt: skip
        head.weight = nn.Parameter(bank_weight, requires_grad=False)
        head.bias = nn.Parameter(bias.to(device=device, dtype=dtype).reshape(-1), requires_grad=False)
        register_h3_hook(head, PDDHeadBankHook(record), H3_PDD_HEAD_BANK_HOOK, root=model)


def remove_head_banks(model: nn.Module, adapters: Optional[Sequence[str]] = None) -> List[str]:
    """Put the base heads back (bit for bit, on the bank's current device) where a bank of ``adapters`` (all: None) is
    installed; returns the adapters removed."""
    removed = []
    for _, head in hooked_modules(model, H3_PDD_HEAD_BANK_HOOK):
        record: PDDHeadBankRecord = get_h3_hook(head, H3_PDD_HEAD_BANK_HOOK).record
        if adapters is not None and record.adapter not in adapters:
            continue
        device = head.weight.device
        head.weight = _restored(record.base_weight, device)
        head.bias = None if record.base_bias is None else _restored(record.base_bias, device)
        remove_h3_hook(head, H3_PDD_HEAD_BANK_HOOK, recurse=False, root=model)
        removed.append(record.adapter)
    return sorted(set(removed))


def _restored(saved: torch.Tensor, device: torch.device) -> nn.Parameter:
    if saved.device == device:
        return saved if isinstance(saved, nn.Parameter) else nn.Parameter(saved, requires_grad=False)
    return nn.Parameter(saved.to(device), requires_grad=saved.requires_grad)


def check_no_head_bank(pipe_or_model) -> None:
    """Refuse, in one line, to save a partition whose heads hold a PDD bank (the saved heads would be the bank)."""
    from .._hooks import partitions_of

    for name, model in partitions_of(pipe_or_model):
        for record in head_bank_records(model):
            raise ValueError(f"`{name}` holds the PDD head bank of adapter {record.adapter!r} in place of its heads, "
                             "which a saved checkpoint cannot describe: unload_lora_weights() before saving")  # fmt: skip
