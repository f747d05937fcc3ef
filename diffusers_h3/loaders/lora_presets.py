"""Sampling schedules that step-distillation LoRAs for MiniMax-H3 were trained for.

A distillation LoRA (LightX2V "Turbo" and the like) only works with the sigma-point count and video / audio flow
shifts it was distilled at. :class:`LoraDistillationPreset` records them; ``MiniMaxH3LoraMixin.load_lora_weights``
attaches one to an adapter (detected from the file name and ``__metadata__``, or passed explicitly), and the pipeline
fills unset ``num_inference_steps`` / ``flow_shift`` / ``audio_flow_shift`` from it and warns when a call overrides
them.

``num_inference_steps`` counts **sigma points** (terminal 0 included), as diffusers' ``MiniMaxH3Scheduler`` does: a
"4-step" LoRA runs 4 transformer evaluations, i.e. ``num_inference_steps=5``.

Known adapters (``lightx2v/Minimax-h3-Turbo``; file names ``minimax_h3_{fl2v,ref2v}_turbo_{4,8}step_vX.Y[_768p]
[_bf16].safetensors``): 4-step = 5 sigma points, 8-step = 9; audio shift 3; video shift 6 for the ``_768p`` files and
12 otherwise (the per-file contract 1Cat-vLLM validates against all eight official artifacts; the LightX2V README
gives 6/3 for the 768p 4-step file and 12 for the 8-step file). ``fl2v`` adapters belong to the ``transformer``
partition (t2va / fl2va), ``ref2v`` adapters to ``transformer_ref`` (ref2va).

File ``__metadata__`` overrides the table entry per field. Recognised keys (values are strings, as safetensors stores
them): ``num_inference_steps`` or ``sigma_points`` (sigma points), ``num_denoising_steps`` (evaluations, i.e. sigma
points - 1), ``flow_shift`` / ``video_flow_shift`` / ``video_shift``, ``audio_flow_shift`` / ``audio_shift``,
``distillation_preset`` (a name from :data:`KNOWN_PRESETS`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from diffusers.utils import logging

from ..tasks import tasks_of_family


logger = logging.get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class LoraDistillationPreset:
    """The schedule a step-distillation LoRA was trained for. ``None`` fields are not constrained."""

    name: str
    num_inference_steps: Optional[int] = None  # sigma points, terminal 0 included (= evaluations + 1)
    flow_shift: Optional[float] = None  # video scheduler shift
    audio_flow_shift: Optional[float] = None  # audio scheduler shift
    tasks: Tuple[str, ...] = ()  # tasks it was trained for, e.g. ("t2va", "fl2va"); empty = any
    source: str = "table"  # where the values came from: "table", "file name", "metadata", "argument"

    def __post_init__(self):
        if self.num_inference_steps is not None and int(self.num_inference_steps) < 2:
            raise ValueError(
                f"Preset {self.name!r}: `num_inference_steps` counts sigma points (evaluations + 1) and must be >= 2, "
                f"got {self.num_inference_steps}."
            )
        for field in ("flow_shift", "audio_flow_shift"):
            value = getattr(self, field)
            if value is not None and float(value) <= 0:
                raise ValueError(f"Preset {self.name!r}: `{field}` must be positive, got {value}.")

    def replace(self, **changes) -> "LoraDistillationPreset":
        """A copy with some fields changed (``preset.replace(flow_shift=5.0)``)."""
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        parts = []
        if self.num_inference_steps is not None:
            parts.append(
                f"num_inference_steps={self.num_inference_steps} ({self.num_inference_steps - 1} denoising steps)"
            )
        if self.flow_shift is not None:
            parts.append(f"flow_shift={self.flow_shift:g}")
        if self.audio_flow_shift is not None:
            parts.append(f"audio_flow_shift={self.audio_flow_shift:g}")
        if self.tasks:
            parts.append(f"tasks={'/'.join(self.tasks)}")
        return f"{self.name} [{', '.join(parts) or 'no constraints'}] (from {self.source})"


def _lightx2v(family: str, steps: int, is_768p: bool) -> LoraDistillationPreset:
    return LoraDistillationPreset(
        name=f"lightx2v-{family}-turbo-{steps}step" + ("-768p" if is_768p else ""),
        num_inference_steps=steps + 1,
        flow_shift=6.0 if is_768p else 12.0,
        audio_flow_shift=3.0,
        tasks=tasks_of_family(family),
    )


KNOWN_PRESETS: Dict[str, LoraDistillationPreset] = {
    preset.name: preset
    for preset in (
        _lightx2v(family, steps, is_768p)
        for family in ("fl2v", "ref2v")
        for steps in (4, 8)
        for is_768p in (False, True)
    )
}

_LIGHTX2V_FILE = re.compile(r"minimax[-_]?h3[-_](fl2v|ref2v)[-_]turbo[-_](4|8)[-_]?steps?", re.IGNORECASE)


def get_preset(name: str) -> LoraDistillationPreset:
    """A known preset by name (see :data:`KNOWN_PRESETS`)."""
    try:
        return KNOWN_PRESETS[name]
    except KeyError:
        raise ValueError(
            f"Unknown LoRA distillation preset {name!r}. Known presets: {sorted(KNOWN_PRESETS)}; or pass a "
            "`LoraDistillationPreset(name=..., num_inference_steps=..., flow_shift=..., audio_flow_shift=...)`."
        ) from None


def preset_from_file_name(file_name: Optional[str]) -> Optional[LoraDistillationPreset]:
    """The LightX2V Turbo preset a file name identifies, or ``None``."""
    if not file_name:
        return None
    base = re.split(r"[/\\]", str(file_name))[-1]
    match = _LIGHTX2V_FILE.search(base)
    if match is None:
        return None
    preset = _lightx2v(match.group(1).lower(), int(match.group(2)), "768p" in base.lower())
    return preset.replace(source=f"file name {base!r}")


_STEP_KEYS = ("num_inference_steps", "sigma_points")
_DENOISING_STEP_KEYS = ("num_denoising_steps",)
_VIDEO_SHIFT_KEYS = ("flow_shift", "video_flow_shift", "video_shift")
_AUDIO_SHIFT_KEYS = ("audio_flow_shift", "audio_shift")


def _metadata_number(metadata: Mapping[str, str], keys, cast):
    for key in keys:
        if key in metadata:
            try:
                return key, cast(float(metadata[key]))
            except (TypeError, ValueError):
                raise ValueError(
                    f"This LoRA file's `__metadata__` has {key}={metadata[key]!r}, which is not a number. Fix the "
                    "file, or pass `distillation_preset=` explicitly to `load_lora_weights`."
                ) from None
    return None, None


def preset_from_metadata(
    metadata: Optional[Mapping[str, str]], base: Optional[LoraDistillationPreset] = None
) -> Optional[LoraDistillationPreset]:
    """Apply the schedule fields a file's ``__metadata__`` records on top of ``base`` (or make a preset of them)."""
    if not metadata:
        return base
    if "distillation_preset" in metadata:
        base = get_preset(str(metadata["distillation_preset"])).replace(source="metadata")
    changes = {}
    _, steps = _metadata_number(metadata, _STEP_KEYS, int)
    if steps is None:
        _, denoising = _metadata_number(metadata, _DENOISING_STEP_KEYS, int)
        steps = None if denoising is None else denoising + 1
    if steps is not None:
        changes["num_inference_steps"] = steps
    _, shift = _metadata_number(metadata, _VIDEO_SHIFT_KEYS, float)
    if shift is not None:
        changes["flow_shift"] = shift
    _, audio_shift = _metadata_number(metadata, _AUDIO_SHIFT_KEYS, float)
    if audio_shift is not None:
        changes["audio_flow_shift"] = audio_shift
    if not changes:
        return base
    if base is None:
        return LoraDistillationPreset(name="metadata", source="metadata", **changes)
    return base.replace(source=f"{base.source} + metadata", **changes)


def detect_preset(
    file_name: Optional[str], metadata: Optional[Mapping[str, str]]
) -> Optional[LoraDistillationPreset]:
    """The preset a LoRA file declares: the table entry its name matches, overridden by its ``__metadata__``."""
    return preset_from_metadata(metadata, preset_from_file_name(file_name))


def resolve_schedule(
    preset: Optional[LoraDistillationPreset],
    num_inference_steps: Optional[int],
    sigmas: Optional[Sequence[float]],
    flow_shift: Optional[float],
    audio_sigmas: Optional[Sequence[float]] = None,
    audio_flow_shift: Optional[float] = None,
) -> Tuple[Optional[int], Optional[float], Optional[float], List[str]]:
    """The schedule a call runs with under a distillation `preset`: a pure function of its arguments.

    Unset (`None`) values are filled from the preset. Explicit values the preset was not trained for are kept and
    listed as differences (e.g. `"num_inference_steps=50 (trained: 9)"`). `num_inference_steps` counts sigma points;
    with explicit `sigmas` / `audio_sigmas` their length is what is compared, and an explicit shift of that modality
    is not compared (the sigmas are used verbatim). Without a preset everything comes back unchanged.

    Returns `(num_inference_steps, flow_shift, audio_flow_shift, differences)`.
    """
    if preset is None:
        return num_inference_steps, flow_shift, audio_flow_shift, []
    trained_steps = preset.num_inference_steps
    differences = []
    if sigmas is not None:
        if trained_steps is not None and len(sigmas) != trained_steps:
            differences.append(f"{len(sigmas)} video sigmas (trained: {trained_steps} sigma points)")
    elif num_inference_steps is None:
        num_inference_steps = trained_steps
    elif trained_steps is not None and num_inference_steps != trained_steps:
        differences.append(f"num_inference_steps={num_inference_steps} (trained: {trained_steps})")
    if audio_sigmas is not None and trained_steps is not None and len(audio_sigmas) != trained_steps:
        differences.append(f"{len(audio_sigmas)} audio sigmas (trained: {trained_steps} sigma points)")
    if flow_shift is None:
        flow_shift = preset.flow_shift
    elif sigmas is None and preset.flow_shift is not None and float(flow_shift) != preset.flow_shift:
        differences.append(f"flow_shift={flow_shift:g} (trained: {preset.flow_shift:g})")
    if audio_flow_shift is None:
        audio_flow_shift = preset.audio_flow_shift
    elif (
        audio_sigmas is None
        and preset.audio_flow_shift is not None
        and float(audio_flow_shift) != preset.audio_flow_shift
    ):
        differences.append(f"audio_flow_shift={audio_flow_shift:g} (trained: {preset.audio_flow_shift:g})")
    return num_inference_steps, flow_shift, audio_flow_shift, differences


def warn_schedule_differences(adapter: str, preset: LoraDistillationPreset, differences: Sequence[str]) -> None:
    """One warning naming every setting of a call the active distillation LoRA was not trained for."""
    if differences:
        logger.warning(
            f"The active distillation LoRA {adapter!r} was trained for {preset.describe()}, but this call uses "
            f"{'; '.join(differences)}. Expect degraded output; leave these arguments unset to use the adapter's "
            "schedule."
        )
