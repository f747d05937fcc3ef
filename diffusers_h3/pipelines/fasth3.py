"""FastH3 stacks on a ``MiniMaxH3Pipeline``: the stack's preset (trained schedule + VSA), its adapters, its light VAE.

* :func:`enable_fasth3_preset` puts a :class:`~diffusers_h3.loaders.fasth3.FastH3Preset` on the pipeline: VSA at the
  trained sparsity on 64-token (4x4x4) tiles with bf16 attention (the numerics the students were trained with, the
  trained ``to_gate_compress`` gates required), and the trained schedule, which every call then runs unless it asks
  for another one (``num_inference_steps``, shifts or ``sigmas``: kept, with one warning naming the difference).
* ``MiniMaxH3Pipeline.from_pretrained(<stack folder>)`` does it from the files: a folder with a
  ``fastvideo_inference.json`` gets its DiT's gates, its preset and, when the folder holds one, its exported NVFP4
  decoder (``vae/decoder.pt``) applied (:func:`apply_fasth3_stack`).
* :func:`load_fasth3_adapter` loads a FastH3 adapter file onto a base pipeline: its ``.diff`` / ``.set_weight``
  payload folded into the DiT, its LoRA factors through PEFT, and its preset.

``diffusers_h3.describe(pipe)["fasth3"]`` reports what was applied.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import torch
from diffusers.utils import logging

from ..attention_processors import disable_vsa, enable_vsa, vsa_state
from ..loaders.fasth3 import (
    CONTRACT_FILE,
    CONTRACT_SCHEMA,
    VSA_BACKEND,
    VSA_TILE_SIZE,
    FastH3Preset,
    apply_fasth3_payload,
    check_fasth3_payload,
    check_tasks,
    get_fasth3_preset,
    has_contract,
    load_stack_gates,
    preset_for_adapter,
    read_adapter_alpha,
    read_contract,
    schedule_differences,
    split_fasth3_state_dict,
    strip_key_prefix,
)
from ..loaders.fasth3_vae import light_vae_record, load_nvfp4_decoder
from .request import ScheduleSettings


logger = logging.get_logger(__name__)

# The attention precision of the preset: the students were trained (and FastVideo serves them) with bf16 VSA.
FASTH3_ATTENTION_PRECISION = "bf16"
# Where a stack's exported NVFP4 decoder is looked for, relative to the stack folder (our convention: FastVideo
# selects the file by path).
DECODER_FILES = ("vae/decoder.pt", "decoder.pt")
_RECORD_ATTRIBUTE = "_h3_fasth3"


@dataclasses.dataclass
class FastH3Record:
    """What was applied to a pipeline, for ``describe``."""

    preset: FastH3Preset
    attention: str
    gates: str
    payload: Optional[str] = None
    source: Optional[str] = None
    scheduler_shifts: Dict[str, float] = dataclasses.field(default_factory=dict)  # the pipeline's before the preset

    def describe(self, pipe=None) -> Dict[str, Any]:
        report = {"preset": self.preset.describe(), "attention": self.attention, "gates": self.gates}
        transformer = getattr(pipe, "transformer", None)
        state = vsa_state(transformer) if transformer is not None else None
        if state is not None and (state["sparsity"], state["precision"]) != (self.preset.vsa_sparsity,
                                                                            FASTH3_ATTENTION_PRECISION):
            # changed since (a speed preset, enable_vsa): what runs now
            report["attention"] = (f"VSA sparsity={state['sparsity']:g} {state['precision']} (changed after the "
                                   f"preset, which set {self.attention})")  # fmt: skip
        if self.payload:
            report["payload"] = self.payload
        if self.source:
            report["source"] = self.source
        light = light_vae_record(getattr(pipe, "vae", None))
        if light is not None:
            report["light_vae"] = light.describe()
        return report


def fasth3_record(pipe) -> Optional[FastH3Record]:
    return getattr(pipe, _RECORD_ATTRIBUTE, None)


def fasth3_report(pipe) -> Optional[Dict[str, Any]]:
    """``describe(pipe)["fasth3"]``: the applied FastH3 preset, gates, payload and light VAE (``None``: none)."""
    record = fasth3_record(pipe)
    return None if record is None else record.describe(pipe)


def _transformer(pipe, who: str) -> torch.nn.Module:
    transformer = getattr(pipe, "transformer", None)
    if transformer is None:
        raise ValueError(f"{who}: the pipeline has no `transformer` partition (FastH3 students are t2va DiTs); load "
                         "it with task='t2va' or 'fl2va'")  # fmt: skip
    return transformer


def _check_one_step_recipe(pipe, new: str, allow: bool) -> None:
    """The pipeline's one-step-recipe rule (``MiniMaxH3LoraMixin._check_one_step_recipe``); a FastH3 preset replaces
    an earlier one rather than stacking on it."""
    check = getattr(pipe, "_check_one_step_recipe", None)
    if check is not None:
        check(new, allow, "transformer", exclude=("fasth3",))


def _gated_blocks(transformer) -> int:
    return sum(getattr(block.attn, "to_gate_compress", None) is not None for block in transformer.transformer_blocks)


def enable_fasth3_preset(pipe, preset: Union[str, FastH3Preset], *, payload: Optional[str] = None,
                         source: Optional[str] = None, allow_step_recipe_stacking: bool = False):  # fmt: skip
    """Put a FastH3 preset (a known name or a :class:`FastH3Preset`) on ``pipe``: VSA at its trained sparsity with
    bf16 attention on the ``transformer`` partition (refused without the trained gates on every block; a dense
    preset refuses a gated DiT) and its trained schedule for every later call. Another step recipe on the pipeline (a
    distillation or PDD LoRA) is refused unless ``allow_step_recipe_stacking``. Returns the pipeline."""
    preset = get_fasth3_preset(preset)
    transformer = _transformer(pipe, "enable_fasth3_preset")
    _check_one_step_recipe(pipe, f"FastH3 preset {preset.name}", allow_step_recipe_stacking)
    blocks, gated = len(transformer.transformer_blocks), _gated_blocks(transformer)
    if preset.vsa_sparsity is not None:
        if gated != blocks:
            raise ValueError(
                f"FastH3 preset {preset.name} runs VSA with the trained to_gate_compress gates, but {gated} of {blocks} "
                "blocks have one: load the stack's DiT (from_pretrained on the stack folder) or its adapter "
                "(load_fasth3_adapter) first"
            )
        enable_vsa(transformer, sparsity=preset.vsa_sparsity, precision=FASTH3_ATTENTION_PRECISION)
        attention = (f"VSA sparsity={preset.vsa_sparsity:g} tile=(4, 4, 4) {FASTH3_ATTENTION_PRECISION}, coarse "
                     "branch through the trained gates (enable_vsa)")  # fmt: skip
    else:
        if gated:
            raise ValueError(f"FastH3 preset {preset.name} is a dense student's, but {gated} blocks carry VSA gates: "
                             "use the VSA preset of this DiT (its fastvideo_inference.json)")  # fmt: skip
        if vsa_state(transformer) is not None:
            disable_vsa(transformer)
        attention = "dense (the student was distilled without VSA)"
    gates = f"{gated} of {blocks} blocks" + (" (trained to_gate_compress)" if gated else "")
    # The schedulers' shifts become the trained ones: calls that ask for another grid keep them, and a saved pipeline
    # writes them next to its contract (save_fasth3_contract).
    previous = fasth3_record(pipe)
    shifts = previous.scheduler_shifts if previous is not None else {}
    for name, shift in (("scheduler", preset.flow_shift), ("audio_scheduler", preset.audio_flow_shift)):
        scheduler = getattr(pipe, name, None)
        if scheduler is not None:
            shifts.setdefault(name, scheduler.config.shift)  # the pipeline's own, restored by disable_fasth3_preset
            scheduler.register_to_config(shift=shift)
    setattr(pipe, _RECORD_ATTRIBUTE, FastH3Record(preset, attention, gates, payload, source, shifts))
    logger.info(f"FastH3 preset on the pipeline: {preset.describe()}; attention {attention}")
    return pipe


def disable_fasth3_preset(pipe):
    """Remove the FastH3 schedule from ``pipe`` and give the schedulers their shifts back (the DiT's weights, gates
    and VSA processors stay as they are)."""
    record = fasth3_record(pipe)
    if record is not None:
        for name, shift in record.scheduler_shifts.items():
            getattr(pipe, name).register_to_config(shift=shift)
        delattr(pipe, _RECORD_ATTRIBUTE)
    return pipe


def resolve_fasth3_schedule(pipe, schedule: ScheduleSettings, task: str) -> ScheduleSettings:
    """The schedule a call runs with under the pipeline's FastH3 preset (``schedule`` unchanged without one): the
    trained sigmas when the call sets none of ``num_inference_steps`` / ``sigmas`` / the shifts (or sets them to the
    trained values); otherwise the call's own, with unset values taken from the preset and one warning naming what
    differs."""
    record = fasth3_record(pipe)
    if record is None:
        return schedule
    preset = record.preset
    check_tasks(preset, task)
    num_inference_steps, sigmas, flow_shift = schedule.num_inference_steps, schedule.sigmas, schedule.flow_shift
    audio_flow_shift = schedule.audio_flow_shift
    differences = schedule_differences(preset, num_inference_steps, sigmas, flow_shift, audio_flow_shift)
    if differences:
        logger.warning(f"FastH3 preset {preset.name} was trained for {preset.sigma_points} sigma points at rungs "
                       f"{list(preset.rungs)}, but this call uses {'; '.join(differences)}: expect degraded output; "
                       "leave them unset to run the trained schedule")  # fmt: skip
    if sigmas is not None or differences:
        steps = num_inference_steps if num_inference_steps is not None or sigmas is not None else preset.sigma_points
        shift = preset.flow_shift if flow_shift is None else flow_shift
        audio_shift = preset.audio_flow_shift if audio_flow_shift is None else audio_flow_shift
        return ScheduleSettings(steps, sigmas, schedule.audio_sigmas, shift, audio_shift)
    video, audio = preset.sigmas()
    return ScheduleSettings(preset.sigma_points, video, audio, flow_shift, audio_flow_shift)


def find_nvfp4_decoder(directory: Union[str, Path]) -> Optional[Path]:
    for relative in DECODER_FILES:
        path = Path(directory) / relative
        if path.is_file():
            return path
    return None


def check_fasth3_stack(directory: Union[str, Path]) -> Optional[FastH3Preset]:
    """The preset of the FastH3 stack in ``directory`` (validated before anything loads), ``None`` for a folder
    without a contract."""
    return read_contract(directory) if has_contract(directory) else None


def apply_fasth3_stack(pipe, directory: Union[str, Path], preset: Optional[FastH3Preset] = None,
                       nvfp4_decoder: Union[str, Path, bool, None] = None):  # fmt: skip
    """Finish loading the FastH3 stack in ``directory`` onto ``pipe`` (loaded from it): the DiT's trained gates (which
    diffusers' loader skips), the exported NVFP4 decoder (``nvfp4_decoder``: a path, ``None`` to take the folder's
    ``vae/decoder.pt`` when present, ``False`` to keep the VAE dense), and the stack's preset."""
    directory = Path(directory)
    preset = preset or read_contract(directory)
    transformer = getattr(pipe, "transformer", None)
    if transformer is not None and _gated_blocks(transformer) == 0:
        load_stack_gates(transformer, directory / "transformer", required=preset.vsa_sparsity is not None)
    if nvfp4_decoder is None:
        nvfp4_decoder = find_nvfp4_decoder(directory)
    if nvfp4_decoder and getattr(pipe, "vae", None) is not None and light_vae_record(pipe.vae) is None:
        load_nvfp4_decoder(pipe.vae, nvfp4_decoder)
    if transformer is not None:
        enable_fasth3_preset(pipe, preset, source=str(directory))
    return pipe


def load_gates_without_contract(pipe, directory: Union[str, Path]):
    """A DiT folder with trained gates but no ``fastvideo_inference.json`` next to it: the gates are loaded (never
    dropped), and a warning says that no FastH3 preset was applied."""
    transformer = getattr(pipe, "transformer", None)
    folder = Path(directory) / "transformer"
    if transformer is None or _gated_blocks(transformer) or not folder.is_dir():
        return pipe
    added = load_stack_gates(transformer, folder, required=False)
    if added:
        logger.warning(f"{folder} carries FastH3 VSA gates (to_gate_compress) for {len(added)} blocks, loaded; the folder "
                       f"has no {CONTRACT_FILE}, so no FastH3 schedule or VSA is applied: call "
                       "diffusers_h3.enable_fasth3_preset(pipe, <preset>) with the preset it was distilled for")  # fmt: skip
    return pipe


def save_fasth3_contract(pipe, directory: Union[str, Path]) -> Optional[Path]:
    """Write the pipeline's FastH3 preset as ``fastvideo_inference.json`` into a folder it was saved to, so that it
    reloads as the same stack (``save_pretrained`` calls this)."""
    record = fasth3_record(pipe)
    if record is None:
        return None
    preset = record.preset
    contract = {
        "schema_version": CONTRACT_SCHEMA, "model_id": preset.name, "task": "t2av", "guidance_scale": 1.0,
        "transformer_forwards": preset.forwards, "num_inference_steps": preset.sigma_points,
        "dmd_denoising_steps": list(preset.rungs), "video_scheduler_shift": preset.flow_shift,
        "audio_scheduler_shift": preset.audio_flow_shift,
    }  # fmt: skip
    if preset.vsa_sparsity is None:
        contract["attention_backend"] = "FLASH_ATTN"
    else:
        contract.update(attention_backend=VSA_BACKEND, vsa_tile_size=VSA_TILE_SIZE, vsa_sparsity=preset.vsa_sparsity)
    path = Path(directory) / CONTRACT_FILE
    path.write_text(json.dumps(contract, indent=2) + "\n")
    return path


def _read_adapter(path_or_dict) -> Tuple[Dict[str, torch.Tensor], Mapping[str, str], Optional[Path]]:
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict), {}, None
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path_or_dict)
    if not path.is_file():
        raise FileNotFoundError(f"FastH3 adapter {path} does not exist")
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    return load_file(str(path)), metadata, path


def load_fasth3_adapter(
    pipe,
    path_or_state_dict: Union[str, Path, Mapping[str, torch.Tensor]],
    adapter_name: str = "fasth3",
    strength: float = 1.0,
    preset: Union[str, FastH3Preset, None] = "auto",
    network_alpha: Optional[float] = None,
    allow_step_recipe_stacking: bool = False,
):
    """Load a FastH3 adapter (``adapter_model.safetensors`` of ``FastVideo/FastVideo-FastH3-4-step-Preview-v1-LoRA``
    and alike) onto ``pipe``'s base DiT: the ``.diff`` / ``.diff_b`` / ``.set_weight`` payload folded into the weights
    (the VSA variant's gates created), the LoRA factors through PEFT (``pipe.load_lora_weights``, at weight
    ``strength``), and the preset (``"auto"``: a contract next to the file, else the published variant folder's name;
    a name or :class:`FastH3Preset`; ``None``: none). The payload is checked against the DiT before anything changes.
    Another step recipe on the pipeline is refused before anything loads, unless ``allow_step_recipe_stacking``.
    Returns the LoRA load report (``None`` for a payload-only file).
    """
    transformer = _transformer(pipe, "load_fasth3_adapter")
    label = path_or_state_dict if isinstance(path_or_state_dict, (str, Path)) else "state dict"
    _check_one_step_recipe(pipe, f"FastH3 adapter {label}", allow_step_recipe_stacking)
    state_dict, metadata, path = _read_adapter(path_or_state_dict)
    payload, low_rank = split_fasth3_state_dict(state_dict)
    if preset == "auto":
        preset = preset_for_adapter(path) if path is not None else None
    preset = None if preset is None else get_fasth3_preset(preset)
    plan = check_fasth3_payload(transformer, payload)  # nothing loads if the payload does not fit
    report = None
    if low_rank:
        alpha = network_alpha if network_alpha is not None else (read_adapter_alpha(path, metadata) if path else None)
        # The factors in diffusers module names under the partition's prefix (PEFT / ComfyUI prefixes removed).
        low_rank = {f"transformer.{strip_key_prefix(k)}": v for k, v in low_rank.items()}
        report = pipe.load_lora_weights(low_rank, adapter_name=adapter_name, network_alpha=alpha,
                                        distillation_preset=None)  # fmt: skip
        if strength != 1.0:
            pipe.set_adapters([adapter_name], [strength])
    applied = apply_fasth3_payload(transformer, plan, strength=strength)
    if preset is not None:
        enable_fasth3_preset(pipe, preset, payload=applied.describe(), source=str(path or "state dict"),
                             allow_step_recipe_stacking=allow_step_recipe_stacking)  # fmt: skip
    return report
