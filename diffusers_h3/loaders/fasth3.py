"""FastVideo's FastH3 stacks: the trained schedule and VSA contract, the trained gates, and ``.diff`` / ``.set_weight``
payloads.

FastH3 students are DMD2 distillations of MiniMax-H3 trained with video sparse attention (VSA) on 64-token tiles. They
reach users in two forms (public layouts, read from FastVideo's and SGLang's code; docs/checkpoints.md has the
sources):

* a **full stack**: the official hub layout of MiniMax-H3 whose ``transformer/`` carries one trained
  ``transformer_blocks.{i}.attn.to_gate_compress.weight`` ``[heads * head_dim, hidden]`` per block, next to a
  ``fastvideo_inference.json`` contract (``schema_version: "fasth3-inference-contract-v1"``) that names the trained
  DMD rungs (``dmd_denoising_steps``), the forwards, the attention backend and the VSA sparsity and tile size; the
  video / audio scheduler shifts come from ``scheduler/`` and ``audio_scheduler/`` (or the contract's
  ``video_scheduler_shift`` / ``audio_scheduler_shift``, which must agree with them);
* an **adapter**: rank-64 LoRA ``lora_A`` / ``lora_B`` factors plus whole-parameter payloads in diffusers names:
  ``<param path>.diff`` (added to ``.weight``), ``<param path>.diff_b`` (added to ``.bias``) and
  ``<param path>.set_weight`` (replaces ``.weight``; the VSA variant ships its gates this way).

This module reads the contract into a :class:`FastH3Preset` (its sigmas are the rungs ``/ 1000`` pushed through each
modality's shift in float32, as FastVideo computes them), applies payloads to a loaded DiT (refusing, before anything
changes, a payload whose keys or shapes do not fit it: the format carries no base hash, so names and shapes are the
whole check), and loads a stack DiT's gates. The pipeline side (the preset on a pipeline, whole stacks) is
:mod:`diffusers_h3.pipelines.fasth3`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from diffusers.utils import logging

from ..attention_processors import add_gate_compress
from ..quantizers import is_quantized_linear
from ..quantizers.config import QuantizationConfigBase
from ..quantizers.layers import quantize_linear_
from ..quantizers.registry import weight_class_for


logger = logging.get_logger(__name__)

CONTRACT_FILE = "fastvideo_inference.json"
CONTRACT_SCHEMA = "fasth3-inference-contract-v1"
VSA_BACKEND = "VIDEO_SPARSE_ATTN_H3"
# The tile every released FastH3 DMD student was trained with: 4x4x4 latent tokens (our VSA default tile).
VSA_TILE_SIZE = 64
SCHEDULER_FILES = {"video": "scheduler/scheduler_config.json", "audio": "audio_scheduler/scheduler_config.json"}
TIME_SCALE = 1000.0


def _positive_finite(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a positive finite number, got {value!r}")
    return float(value)


def _check_rungs(rungs: Any, what: str) -> Tuple[int, ...]:
    if (
        not isinstance(rungs, (list, tuple))
        or not rungs
        or any(type(r) is not int or not 0 < r <= TIME_SCALE for r in rungs)
        or any(a <= b for a, b in zip(rungs, rungs[1:]))
    ):
        raise ValueError(f"{what}: dmd_denoising_steps must be strictly decreasing integers in (0, 1000], got {rungs!r}")
    return tuple(rungs)


@dataclasses.dataclass(frozen=True)
class FastH3Preset:
    """The sampling contract of a FastH3 student.

    ``rungs``: the DMD timesteps the student was trained at (``dmd_denoising_steps``, descending in ``(0, 1000]``);
    one forward per rung, so ``len(rungs) + 1`` sigma points. ``flow_shift`` / ``audio_flow_shift``: the video / audio
    scheduler shifts. ``vsa_sparsity``: the VSA sparsity it was trained at, ``None`` for a dense student.
    ``tasks``: what it was distilled for (FastH3 students: t2va).
    """

    name: str
    rungs: Tuple[int, ...]
    flow_shift: float
    audio_flow_shift: float
    vsa_sparsity: Optional[float] = None
    tasks: Tuple[str, ...] = ("t2va",)
    source: str = "table"

    def __post_init__(self):
        _check_rungs(list(self.rungs), self.name)
        for field in ("flow_shift", "audio_flow_shift"):
            _positive_finite(getattr(self, field), f"FastH3 preset {self.name!r} {field}")
        if self.vsa_sparsity is not None and not 0.0 <= float(self.vsa_sparsity) < 1.0:
            raise ValueError(f"FastH3 preset {self.name!r}: vsa_sparsity must be in [0, 1), got {self.vsa_sparsity}")

    @property
    def forwards(self) -> int:
        return len(self.rungs)

    @property
    def sigma_points(self) -> int:
        """``num_inference_steps`` in the pipeline's convention (terminal 0 included)."""
        return len(self.rungs) + 1

    def sigmas(self) -> Tuple[List[float], List[float]]:
        """``(video_sigmas, audio_sigmas)``: ``[r / 1000 for r in rungs] + [0]`` through each modality's exponential
        shift ``s * x / (1 + (s - 1) * x)``, in float32 on the CPU (FastVideo's rounding points)."""
        base = torch.tensor([r / TIME_SCALE for r in self.rungs] + [0.0], dtype=torch.float32)
        return tuple(
            (shift * base / (1.0 + (shift - 1.0) * base)).tolist() for shift in (self.flow_shift, self.audio_flow_shift)
        )

    def replace(self, **changes) -> "FastH3Preset":
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        vsa = f"VSA sparsity {self.vsa_sparsity:g} (tile {VSA_TILE_SIZE})" if self.vsa_sparsity is not None else "dense"
        return (f"{self.name}: {self.forwards} forwards at rungs {list(self.rungs)}, shifts {self.flow_shift:g} / "
                f"{self.audio_flow_shift:g}, {vsa}, tasks {'/'.join(self.tasks)} (from {self.source})")  # fmt: skip


def _fasth3(name, rungs, shifts, sparsity):
    return FastH3Preset(name=name, rungs=rungs, flow_shift=shifts[0], audio_flow_shift=shifts[1], vsa_sparsity=sparsity)


FOUR_STEP_RUNGS = (999, 749, 500, 250)
EIGHT_STEP_RUNGS = (999, 874, 749, 624, 500, 375, 250, 125)
# The published students' contracts (their fastvideo_inference.json and scheduler configs), for adapters and DiTs
# that arrive without the contract file.
KNOWN_FASTH3_PRESETS: Dict[str, FastH3Preset] = {
    p.name: p
    for p in (
        _fasth3("fasth3-4step-preview-vsa", FOUR_STEP_RUNGS, (12.0, 3.0), 0.9),
        _fasth3("fasth3-4step-preview-dense", FOUR_STEP_RUNGS, (12.0, 3.0), None),
        _fasth3("fasth3-8step-v2", EIGHT_STEP_RUNGS, (10.0, 3.0), 0.8),
    )
}


def get_fasth3_preset(preset: Union[str, FastH3Preset]) -> FastH3Preset:
    """A :class:`FastH3Preset` itself, or the known preset of that name."""
    if isinstance(preset, FastH3Preset):
        return preset
    if preset not in KNOWN_FASTH3_PRESETS:
        raise ValueError(f"unknown FastH3 preset {preset!r}: choose one of {sorted(KNOWN_FASTH3_PRESETS)}, or pass a "
                         "FastH3Preset(name=..., rungs=..., flow_shift=..., audio_flow_shift=..., vsa_sparsity=...)")
    return KNOWN_FASTH3_PRESETS[preset]


# ---------------------------------------------------------------------------------------------------------------------
# The contract file


def preset_from_contract(
    contract: Mapping[str, Any], scheduler_shifts: Mapping[str, float], source: str = CONTRACT_FILE
) -> FastH3Preset:
    """Validate a ``fastvideo_inference.json`` (already parsed) against the checkpoint's scheduler shifts and return
    its preset; one line names the first field that is wrong."""
    where = f"FastH3 contract {source}"
    if not isinstance(contract, Mapping) or contract.get("schema_version") != CONTRACT_SCHEMA:
        found = contract.get("schema_version") if isinstance(contract, Mapping) else type(contract).__name__
        raise ValueError(f"{where}: schema_version must be {CONTRACT_SCHEMA!r}, got {found!r}")
    if "pdd_steps" in contract or contract.get("model_type") == "ref2va":
        raise ValueError(f"{where} is a Ref2VA PDD student (pdd_steps, 128-token tiles): not supported yet; only the "
                         "t2va DMD stacks (dmd_denoising_steps) load")  # fmt: skip
    if "schema" in contract and contract["schema"] != CONTRACT_SCHEMA:
        raise ValueError(f"{where}: schema={contract['schema']!r} disagrees with schema_version {CONTRACT_SCHEMA!r}")
    if contract.get("transformer_component", "transformer") != "transformer":
        raise ValueError(f"{where}: transformer_component={contract['transformer_component']!r}; the t2va DMD "
                         "students run on `transformer`")  # fmt: skip
    if contract.get("task", "t2av") != "t2av":
        raise ValueError(f"{where}: task must be 't2av' (the FastH3 DMD students), got {contract.get('task')!r}")
    if contract.get("guidance_scale", 1.0) != 1.0:
        raise ValueError(f"{where}: guidance_scale={contract['guidance_scale']!r}; H3 runs the guidance-distilled "
                         "branch only (1.0)")  # fmt: skip
    rungs = _check_rungs(contract.get("dmd_denoising_steps"), where)
    for key in ("transformer_forwards", "num_inference_steps"):
        if key in contract and type(contract[key]) is not int:
            raise ValueError(f"{where}: {key} must be an integer, got {contract[key]!r}")
    if contract.get("transformer_forwards") != len(rungs) or contract.get("num_inference_steps") != len(rungs) + 1:
        raise ValueError(
            f"{where}: {len(rungs)} rungs need transformer_forwards={len(rungs)} and num_inference_steps="
            f"{len(rungs) + 1}, got {contract.get('transformer_forwards')!r} and {contract.get('num_inference_steps')!r}"
        )
    shifts = {}
    for modality in ("video", "audio"):
        key = f"{modality}_scheduler_shift"
        from_scheduler = scheduler_shifts.get(modality)
        declared = _positive_finite(contract[key], f"{where} {key}") if key in contract else None
        if declared is not None and from_scheduler is not None and declared != from_scheduler:
            raise ValueError(f"{where}: {key}={declared:g} disagrees with {SCHEDULER_FILES[modality]} "
                             f"shift={from_scheduler:g}")  # fmt: skip
        shift = declared if declared is not None else from_scheduler
        if shift is None:
            raise ValueError(f"{where}: no {modality} shift (neither {key} nor {SCHEDULER_FILES[modality]})")
        shifts[modality] = shift
    sparsity = None
    backend = contract.get("attention_backend")
    if backend == VSA_BACKEND:
        if contract.get("vsa_tile_size") != VSA_TILE_SIZE:
            raise ValueError(f"{where}: vsa_tile_size={contract.get('vsa_tile_size')!r}; the DMD students were trained "
                             f"on {VSA_TILE_SIZE}-token (4x4x4) tiles, the only size supported")  # fmt: skip
        sparsity = contract.get("vsa_sparsity")
        if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0.0 <= sparsity < 1.0:
            raise ValueError(f"{where}: vsa_sparsity must be in [0, 1), got {sparsity!r}")
        sparsity = float(sparsity)
    else:
        stray = [k for k in ("vsa_sparsity", "vsa_tile_size") if k in contract]
        if stray:
            raise ValueError(f"{where}: {stray[0]} is set but attention_backend is {backend!r}, not {VSA_BACKEND!r}; "
                             "a VSA student names its backend, a dense one carries no VSA fields")  # fmt: skip
    name = str(contract.get("model_id") or "fasth3").rsplit("/", 1)[-1]
    return FastH3Preset(name=name, rungs=rungs, flow_shift=shifts["video"], audio_flow_shift=shifts["audio"],
                        vsa_sparsity=sparsity, source=source)  # fmt: skip


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{what} {path} is not readable JSON: {error}") from None


def has_contract(directory: Union[str, Path]) -> bool:
    """Whether ``directory`` holds a FastH3 contract (``fastvideo_inference.json``)."""
    return (Path(directory) / CONTRACT_FILE).is_file()


def read_contract(directory: Union[str, Path]) -> FastH3Preset:
    """The preset of the FastH3 stack in ``directory`` (its ``fastvideo_inference.json`` and scheduler configs)."""
    directory = Path(directory)
    contract = _read_json(directory / CONTRACT_FILE, "FastH3 contract")
    shifts = {}
    for modality, relative in SCHEDULER_FILES.items():
        path = directory / relative
        if path.is_file():
            shifts[modality] = _positive_finite(_read_json(path, "scheduler config").get("shift"), f"{path} shift")
    return preset_from_contract(contract, shifts, source=str(directory / CONTRACT_FILE))


# ---------------------------------------------------------------------------------------------------------------------
# Payloads: `.diff` / `.diff_b` / `.set_weight`

PAYLOAD_SUFFIXES = {".diff_b": ("bias", "add"), ".diff": ("weight", "add"), ".set_weight": ("weight", "set")}
# Prefixes exporters put before the diffusers module path (PEFT's, ComfyUI's, a pipeline's component name).
_KEY_PREFIXES = ("base_model.model.", "diffusion_model.", "transformer.")
_LOW_RANK = re.compile(r"\.(lora_A|lora_B|lora_up|lora_down|lora_magnitude_vector)(\.|$)|\.alpha$")
_GATE_WEIGHT = re.compile(r"^transformer_blocks\.(\d+)\.attn\.to_gate_compress\.weight$")


def strip_key_prefix(key: str) -> str:
    """``key`` without the PEFT / ComfyUI / component prefix exporters put before the diffusers module path."""
    for prefix in _KEY_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def payload_target(key: str) -> Optional[Tuple[str, str]]:
    """``(parameter path, "add" | "set")`` a payload key addresses, or ``None`` for any other key."""
    if _LOW_RANK.search(key):
        return None
    for suffix, (param, kind) in PAYLOAD_SUFFIXES.items():
        if key.endswith(suffix):
            return f"{strip_key_prefix(key[: -len(suffix)])}.{param}", kind
    return None


@dataclasses.dataclass
class FastH3Payload:
    """The whole-parameter part of a FastH3 file: ``{parameter path: (source key, kind, tensor)}``."""

    entries: Dict[str, Tuple[str, str, torch.Tensor]]

    @property
    def additive(self) -> int:
        return sum(kind == "add" for _, kind, _ in self.entries.values())

    @property
    def replacements(self) -> int:
        return sum(kind == "set" for _, kind, _ in self.entries.values())

    def gate_blocks(self) -> List[int]:
        return sorted(int(m.group(1)) for m in map(_GATE_WEIGHT.match, self.entries) if m)


def split_fasth3_state_dict(state_dict: Mapping[str, torch.Tensor]) -> Tuple[FastH3Payload, Dict[str, torch.Tensor]]:
    """``(payload, the rest)``: the ``.diff`` / ``.diff_b`` / ``.set_weight`` entries and every other key (LoRA
    factors, alphas). Two keys addressing one parameter are an error."""
    entries: Dict[str, Tuple[str, str, torch.Tensor]] = {}
    rest: Dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        target = payload_target(key)
        if target is None:
            rest[key] = tensor
            continue
        param, kind = target
        if param in entries:
            raise ValueError(f"FastH3 payload: {entries[param][0]!r} and {key!r} both address {param}; the file is "
                             "malformed")  # fmt: skip
        entries[param] = (key, kind, tensor)
    return FastH3Payload(entries), rest


@dataclasses.dataclass(frozen=True)
class PayloadReport:
    """What :func:`apply_fasth3_payload` changed."""

    added: int  # `.diff` / `.diff_b` deltas added
    replaced: int  # `.set_weight` tensors written
    gates_created: Tuple[int, ...]  # blocks that got a `to_gate_compress` for the payload
    strength: float

    def describe(self) -> str:
        gates = f", {len(self.gates_created)} gates created" if self.gates_created else ""
        return (f"FastH3 payload folded into the weights: {self.added} deltas added, {self.replaced} tensors set"
                f"{gates}, strength {self.strength:g}")  # fmt: skip


def _parameter(model: torch.nn.Module, path: str) -> Tuple[Optional[torch.nn.Module], Optional[torch.Tensor], str]:
    """``(module, parameter, problem)`` of ``path`` (also through a PEFT ``base_layer``)."""
    module_path, _, name = path.rpartition(".")
    for candidate in (module_path, f"{module_path}.base_layer"):
        try:
            module = model.get_submodule(candidate)
        except AttributeError:
            continue
        if is_quantized_linear(module) and name == "weight":
            return module, None, "is a quantized layer's packed weight (apply payloads to the 16-bit DiT, then quantize)"
        param = module._parameters.get(name)
        if param is not None:
            return module, param, ""
    return None, None, "names no parameter of this DiT"


@dataclasses.dataclass(frozen=True)
class PayloadPlan:
    """A payload checked against one DiT (:func:`check_fasth3_payload`): what :func:`apply_fasth3_payload` writes."""

    targets: Tuple[Tuple[str, str, torch.Tensor], ...]  # (parameter path, "add" | "set", tensor)
    missing_gates: Tuple[int, ...]  # blocks whose gate the payload sets but the DiT lacks
    additive: int
    replacements: int


def check_fasth3_payload(transformer: torch.nn.Module, payload: FastH3Payload) -> PayloadPlan:
    """Check every key of ``payload`` against ``transformer`` without changing it; one line for what does not fit:
    a key that names no parameter, a shape that differs, a quantized target, a non-finite value, a ``.set_weight`` on
    a weight a loaded LoRA adapts."""
    blocks = getattr(transformer, "transformer_blocks", None)
    if blocks is None:
        raise TypeError(f"a FastH3 payload applies to a MiniMaxH3Transformer3DModel, got {type(transformer).__name__}")
    missing_gates = [i for i in payload.gate_blocks()
                     if 0 <= i < len(blocks) and getattr(blocks[i].attn, "to_gate_compress", None) is None]  # fmt: skip
    gate_shape = {i: (blocks[i].attn.heads * blocks[i].attn.head_dim, blocks[i].attn.to_q.in_features)
                  for i in missing_gates}  # fmt: skip
    wrapped = {name for name, _ in transformer.named_parameters() if ".base_layer." in name}
    problems: List[str] = []
    targets = []
    for path, (key, kind, tensor) in payload.entries.items():
        gate = _GATE_WEIGHT.match(path)
        if gate and int(gate.group(1)) in gate_shape:
            expected, problem = gate_shape[int(gate.group(1))], ""
        else:
            _, param, problem = _parameter(transformer, path)
            expected = None if param is None else tuple(param.shape)
        module_path, _, name = path.rpartition(".")
        if problem:
            problems.append(f"{key} {problem}")
        elif tuple(tensor.shape) != tuple(expected):
            problems.append(f"{key} has shape {tuple(tensor.shape)}, {path} is {tuple(expected)}")
        elif not torch.isfinite(tensor).all():
            problems.append(f"{key} holds NaN or Inf")
        elif kind == "set" and f"{module_path}.base_layer.{name}" in wrapped:
            problems.append(f"{key} replaces a weight a loaded LoRA adapts (unload it first)")
        else:
            targets.append((path, kind, tensor))
    if problems:
        raise ValueError(
            f"FastH3 payload does not fit this DiT: {len(problems)} of {len(payload.entries)} keys are wrong "
            f"({problems[0]}{'; ...' if len(problems) > 1 else ''}); it was made for another base (blocks, widths or "
            "a quantized DiT): load the bf16 MiniMax-H3 DiT it was distilled from"
        )
    return PayloadPlan(tuple(targets), tuple(missing_gates), payload.additive, payload.replacements)


@torch.no_grad()
def apply_fasth3_payload(
    transformer: torch.nn.Module, payload: Union[FastH3Payload, PayloadPlan], strength: float = 1.0
) -> PayloadReport:
    """Fold a FastH3 payload into ``transformer``'s weights, in place: ``.diff`` / ``.diff_b`` add ``strength *
    delta`` (in float32, rounded once to the parameter's dtype), ``.set_weight`` writes ``base + strength * (w -
    base)`` (``w`` at strength 1; gates the DiT lacks are created at zero first, so they get ``strength * w``).

    Every key is checked first (:func:`check_fasth3_payload`): what does not fit is refused in one line and nothing
    changes. Like FastVideo and SGLang, this changes the weights themselves: reload the DiT to remove it.
    """
    if not math.isfinite(strength):
        raise ValueError(f"FastH3 payload strength must be finite, got {strength}")
    plan = payload if isinstance(payload, PayloadPlan) else check_fasth3_payload(transformer, payload)
    keys = [f"transformer_blocks.{i}.attn.to_gate_compress.weight" for i in plan.missing_gates]
    created = add_gate_compress(transformer, keys, load=False) if keys else ()
    for path, kind, tensor in plan.targets:
        _, param, _ = _parameter(transformer, path)
        delta = tensor.to(device=param.device, dtype=torch.float32)
        base = param.detach().float()
        if kind == "add":
            updated = base + delta * strength
        else:
            updated = delta if strength == 1.0 else base + (delta - base) * strength
        param.data.copy_(updated.to(param.dtype))
    report = PayloadReport(plan.additive, plan.replacements, tuple(created), float(strength))
    logger.info(report.describe())
    return report


# ---------------------------------------------------------------------------------------------------------------------
# A stack DiT's trained gates


def gate_tensors(transformer_dir: Union[str, Path]) -> Dict[str, torch.Tensor]:
    """The ``to_gate_compress`` tensors stored in a DiT folder's safetensors files (``{key: tensor}``)."""
    from safetensors import safe_open

    found: Dict[str, torch.Tensor] = {}
    for file in sorted(Path(transformer_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                if ".to_gate_compress." in key:
                    found[key] = handle.get_tensor(key)
    return found


def _index_ranges(indices: List[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"`` (a stack of 60 blocks missing most gates stays one line)."""
    spans: List[List[int]] = []
    for i in indices:
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def load_stack_gates(transformer: torch.nn.Module, transformer_dir: Union[str, Path], required: bool) -> Tuple[int, ...]:
    """Add the trained gates of the DiT stored in ``transformer_dir`` to the loaded ``transformer`` (diffusers' loader
    skips them as keys its class lacks). ``required``: a VSA-distilled stack must carry one per block."""
    tensors = gate_tensors(transformer_dir)
    blocks = len(transformer.transformer_blocks)
    gated = {int(m.group(1)) for m in map(_GATE_WEIGHT.match, tensors) if m}
    without = [i for i in range(blocks) if i not in gated]
    if required and without:
        raise ValueError(
            f"{transformer_dir} has trained gates (to_gate_compress.weight) for {blocks - len(without)} of {blocks} "
            f"blocks, none for block{'s' if len(without) > 1 else ''} {_index_ranges(without)}: a VSA-distilled "
            "FastH3 DiT carries one per block (the dense student has none: use its own contract)"
        )
    if not tensors:
        return ()
    to_q = transformer.transformer_blocks[0].attn.to_q  # a quantized DiT's gates take its compute dtype
    dtype = getattr(to_q, "compute_dtype", to_q.weight.dtype)
    config = dit_quantization_config(transformer)
    by_block: Dict[int, Dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        by_block.setdefault(int(re.search(r"transformer_blocks\.(\d+)\.", key).group(1)), {})[key] = value
    added = []
    for index, block_tensors in sorted(by_block.items()):  # one gate at a time on the device
        block_tensors = {k: v.to(device=to_q.weight.device, dtype=dtype) for k, v in block_tensors.items()}
        added += add_gate_compress(transformer, block_tensors)
        if config is not None:  # a DiT quantized while loading: its gates take the same format
            name = f"transformer_blocks.{index}.attn.to_gate_compress"
            keep = getattr(transformer, "_keep_in_fp32_modules", None) or []
            gate = transformer.get_submodule(name)
            if config.should_quantize(name, gate, keep):
                quantize_linear_(gate, weight_class_for(config), config.compute_dtype, **config.layer_kwargs())
        del block_tensors
    return tuple(added)


def dit_quantization_config(transformer: torch.nn.Module):
    """The diffusers-h3 quantization config a DiT was loaded (or quantized) with, or ``None`` for a dense DiT."""
    if not is_quantized_linear(transformer.transformer_blocks[0].attn.to_q):
        return None
    quantizer = getattr(transformer, "hf_quantizer", None)
    config = getattr(quantizer, "quantization_config", None)
    return config if isinstance(config, QuantizationConfigBase) else None


def read_adapter_alpha(path: Union[str, Path], metadata: Optional[Mapping[str, str]]) -> Optional[float]:
    """The LoRA alpha of a FastH3 adapter: its ``__metadata__`` ``alpha`` or the ``lora_alpha`` of the PEFT
    ``adapter_config.json`` saved next to it."""
    if metadata and "alpha" in metadata:
        return float(metadata["alpha"])
    config = Path(path).with_name("adapter_config.json")
    if config.is_file():
        alpha = _read_json(config, "PEFT adapter config").get("lora_alpha")
        return None if alpha is None else float(alpha)
    return None


def preset_for_adapter(path: Union[str, Path]) -> Optional[FastH3Preset]:
    """The preset of a FastH3 adapter file from where it sits: a contract in its folder or one above it, else the
    published repository's variant folder name (``vsa-datafree`` / ``dense-datafree`` of the 4-step preview)."""
    path = Path(path)
    for folder in (path.parent, path.parent.parent):
        if has_contract(folder):
            return read_contract(folder)
    variant = path.parent.name.lower()
    if variant.startswith("vsa"):
        return KNOWN_FASTH3_PRESETS["fasth3-4step-preview-vsa"].replace(source=f"adapter folder {variant!r}")
    if variant.startswith("dense"):
        return KNOWN_FASTH3_PRESETS["fasth3-4step-preview-dense"].replace(source=f"adapter folder {variant!r}")
    return None


def check_tasks(preset: FastH3Preset, task: str) -> None:
    if preset.tasks and task not in preset.tasks:
        logger.warning(f"FastH3 preset {preset.name} was distilled for {'/'.join(preset.tasks)}, not {task}: expect "
                       "degraded output")  # fmt: skip


def schedule_differences(
    preset: FastH3Preset,
    num_inference_steps: Optional[int],
    sigmas: Optional[Sequence[float]],
    flow_shift: Optional[float],
    audio_flow_shift: Optional[float],
) -> List[str]:
    """The settings of a call that differ from what ``preset`` was trained for (empty: run the trained sigmas)."""
    differences = []
    if sigmas is not None:
        if len(sigmas) != preset.sigma_points:
            differences.append(f"{len(sigmas)} sigmas (trained: {preset.sigma_points} sigma points)")
        return differences
    if num_inference_steps is not None and num_inference_steps != preset.sigma_points:
        differences.append(f"num_inference_steps={num_inference_steps} (trained: {preset.sigma_points})")
    if flow_shift is not None and float(flow_shift) != preset.flow_shift:
        differences.append(f"flow_shift={flow_shift:g} (trained: {preset.flow_shift:g})")
    if audio_flow_shift is not None and float(audio_flow_shift) != preset.audio_flow_shift:
        differences.append(f"audio_flow_shift={audio_flow_shift:g} (trained: {preset.audio_flow_shift:g})")
    return differences
