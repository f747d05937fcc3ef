"""The task table: one :class:`TaskSpec` per MiniMax-H3 task, the single place that says what a task is.

H3 serves three tasks from one `__call__`, routed by the conditioning inputs of the request:

| task | conditioning inputs | DiT partition | LoRA family | packed layout |
|---|---|---|---|---|
| `t2va` | none | `transformer` | `fl2v` | `[text | target audio | target video]` |
| `fl2va` | `image` and/or `last_image` | `transformer` | `fl2v` | `[text | keyframes | target audio | target video]` |
| `ref2va` | `references` | `transformer_ref` | `ref2v` | `[text | references | target audio | target video]` |

The pipeline, the loader (which partition to load), the LoRA loader and presets (which partition and tasks an adapter
belongs to) and the CLI read this table. A new task is one `TaskSpec` here plus one layout builder in
`diffusers_h3/packing.py`.

The spec's steps take a `TaskComponents` as their first argument: the few components (tokenizer, processor, VAEs) and
settings they use, not the whole pipeline (`MiniMaxH3Pipeline.task_components()` builds it); this module never imports
the pipeline, so the loaders below the pipeline can read the table.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import PIL.Image
import torch
from diffusers.modular_pipelines.minimax_h3.before_denoise import (
    MiniMaxH3PrepareLayoutStep,
    MiniMaxH3Ref2VAPrepareLayoutStep,
)
from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep
from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VATextEncoderStep
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
    MINIMAX_H3_AUDIO_CHANNELS,
    MINIMAX_H3_AUDIO_TAG,
    MINIMAX_H3_FPS,
    MINIMAX_H3_TEXT_TAG,
    MINIMAX_H3_VIDEO_TAG,
    resolve_canvas_size,
)
from diffusers.modular_pipelines.minimax_h3.references import (
    MiniMaxH3AudioReference,
    MiniMaxH3ImageReference,
    MiniMaxH3Reference,
    MiniMaxH3VideoReference,
)
from PIL import Image

from ._hooks import PARTITIONS
from .layout import PackedLayout
from .packing import ref2va_layout, t2va_fl2va_layout


REFERENCE_LIMITS = {"image": 9, "video": 3, "audio": 3}
MAX_REFERENCES = 12
VIDEO_REFERENCE_SAMPLE_FPS = 2.0
# A canvas without keyframes gets the training aspect ratio (16:9 landscape) under the pipeline's canvas rule.
DEFAULT_ASPECT = (16, 9)


class LatentGeometry(NamedTuple):
    """The latent grid of one request, in the positional order diffusers' packed-sequence builders take it."""

    num_latent_frames: int
    latent_height: int
    latent_width: int
    num_audio_latents: int
    patch_size: Tuple[int, int, int]


@dataclasses.dataclass
class TaskConditions:
    """A request's conditioning media on H3's rates and resolutions, and the canvas it fixed.

    `media` holds the fitted keyframes (fl2va) or the normalized references (ref2va) in packed order; `anchors` names
    where each keyframe sits (`"first"`, `"last"`).
    """

    height: int
    width: int
    media: List[Any] = dataclasses.field(default_factory=list)
    anchors: Tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class TaskComponents:
    r"""
    What a task's steps use of a pipeline, and nothing else.

    Args:
        tokenizer, processor: The text encoder's tokenizer and Qwen3-VL processor (`None` without a text encoder).
        vae, audio_vae: The video and audio VAEs.
        image_processor: The pipeline's `VaeImageProcessor` (resizing, PIL/numpy conversion).
        canvas_multiple (`int`), canvas_rule (`tuple[int, int]`): What canvases are multiples of, and the default
            canvas rule `(short_edge, max_pixels)`.
        reference_image_short_edge (`int`): Short edge image references are encoded at.
        vae_frames_per_chunk (`int`), vae_latents_per_chunk (`int`): The video VAE's temporal chunking.
        audio_sampling_rate (`int`): The audio VAE's sample rate.
        device_of (`Callable[[nn.Module], torch.device]`): Where a component computes.
        encode_visual_condition (`Callable[[torch.Tensor], torch.Tensor]`): Pixels → normalized VAE latents of a
            keyframe or visual reference.
    """

    tokenizer: Any
    processor: Any
    vae: Any
    audio_vae: Any
    image_processor: Any
    canvas_multiple: int
    canvas_rule: Tuple[int, int]
    reference_image_short_edge: int
    vae_frames_per_chunk: Optional[int]
    vae_latents_per_chunk: Optional[int]
    audio_sampling_rate: Optional[int]
    device_of: Callable[[torch.nn.Module], torch.device]
    encode_visual_condition: Callable[[torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    r"""
    What one task is: where it runs, which adapters belong to it and how its conditioning enters the model.

    Args:
        name (`str`): `"t2va"`, `"fl2va"` or `"ref2va"`.
        partition (`str`): The DiT partition the task runs on (`"transformer"` or `"transformer_ref"`).
        lora_family (`str`): The family name step-distillation LoRAs of this partition carry (`"fl2v"`, `"ref2v"`).
        conditioning_inputs (`tuple[str]`): The `__call__` arguments that carry its conditioning; a request passing
            any of them (and no other task's) is routed to this task.
        check_conditions (`Callable[[dict], None]`): Validates those arguments before any model runs.
        prepare_conditions (`Callable`): `(components, inputs, height, width, num_frames) -> TaskConditions`: resolves the
            canvas and puts the conditioning media on H3's rates and resolutions.
        present (`Callable`): `(components, prompt, conditions) -> (token_ids, token_tags, vision_inputs)`: how the
            conditions and the prompt are presented to the text encoder.
        encode_conditions (`Callable`): `(components, conditions) -> (condition_latents, audio_condition_latents)`: VAE
            latents of the conditioning media, in packed order.
        build_layout (`Callable`): `(text_token_tags, conditions, condition_latents, audio_condition_latents,
            geometry: LatentGeometry) -> (packed, layout)`: diffusers' packed-sequence tensors and the matching `PackedLayout`
            (a builder of `diffusers_h3/packing.py`).
        canvas_aspect (`Callable[[dict], tuple[int, int]]`, *optional*): The `(width, height)` aspect a request
            without `height`/`width` gets its canvas from (default: the training aspect, 16:9).
    """

    name: str
    partition: str
    lora_family: str
    conditioning_inputs: Tuple[str, ...]
    check_conditions: Callable[[Mapping[str, Any]], None]
    prepare_conditions: Callable[..., TaskConditions]
    present: Callable[..., Tuple[List[int], List[int], Dict[str, torch.Tensor]]]
    encode_conditions: Callable[..., Tuple[List[torch.Tensor], List[torch.Tensor]]]
    build_layout: Callable[..., Tuple[tuple, PackedLayout]]
    canvas_aspect: Optional[Callable[[Mapping[str, Any]], Tuple[int, int]]] = None

    def __post_init__(self):
        if self.partition not in PARTITIONS:
            raise ValueError(f"Task {self.name!r}: `partition` must be one of {PARTITIONS}, got {self.partition!r}.")

    def resolve_canvas(
        self, inputs: Mapping[str, Any], height: Optional[int], width: Optional[int], multiple: int,
        canvas_rule: Tuple[int, int],
    ) -> Tuple[int, int]:  # fmt: skip
        """The request's canvas: `height` x `width` when given, else the canvas rule applied to the task's aspect
        (`canvas_aspect(inputs)`, e.g. the first keyframe's; the training aspect 16:9 without one)."""
        if height is not None:
            return height, width
        aspect = self.canvas_aspect(inputs) if self.canvas_aspect is not None else DEFAULT_ASPECT
        return resolve_canvas_size(*aspect, multiple, *canvas_rule)


# ---------------------------------------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------------------------------------
def _default_canvas(components, height: Optional[int], width: Optional[int]) -> Tuple[int, int]:
    if height is None:
        height, width = resolve_canvas_size(*DEFAULT_ASPECT, components.canvas_multiple, *components.canvas_rule)
    return height, width


def _tokens(tokenizer, text: str) -> List[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _vision_block(tokenizer, pad_token: str, num_tokens: int) -> List[int]:
    convert = tokenizer.convert_tokens_to_ids
    return [convert("<|vision_start|>")] + [convert(pad_token)] * num_tokens + [convert("<|vision_end|>")]


def _present_prompt_only(components, prompt: str, conditions: TaskConditions):
    prompt_ids = _tokens(components.tokenizer, prompt)
    return prompt_ids, [MINIMAX_H3_TEXT_TAG] * len(prompt_ids), {}


def _no_condition_latents(components, conditions: TaskConditions):
    return [], []


def _check_nothing(inputs: Mapping[str, Any]) -> None:
    return None


def _text_and_keyframes_layout(text_token_tags, conditions, condition_latents, audio_condition_latents, geometry):
    packed = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        text_token_tags, *geometry, MINIMAX_H3_AUDIO_CHANNELS, MINIMAX_H3_AUDIO_TAG, MINIMAX_H3_VIDEO_TAG,
        conditions.anchors,
    )  # fmt: skip
    layout = t2va_fl2va_layout(len(text_token_tags), len(conditions.anchors), *geometry, MINIMAX_H3_AUDIO_CHANNELS)
    return packed, layout


# ---------------------------------------------------------------------------------------------------------------------
# t2va
# ---------------------------------------------------------------------------------------------------------------------
def _prepare_text_only(components, inputs, height, width, num_frames) -> TaskConditions:
    return TaskConditions(*_default_canvas(components, height, width))


# ---------------------------------------------------------------------------------------------------------------------
# fl2va: first and/or last keyframe
# ---------------------------------------------------------------------------------------------------------------------
def _check_keyframes(inputs: Mapping[str, Any]) -> None:
    for name in ("image", "last_image"):
        frame = inputs.get(name)
        if frame is not None and not isinstance(frame, PIL.Image.Image):
            raise ValueError(f"`image` / `last_image` must be PIL images, got {type(frame).__name__}.")


def _keyframe_aspect(inputs: Mapping[str, Any]) -> Tuple[int, int]:
    """The first keyframe's `(width, height)`: an fl2va canvas takes its aspect."""
    return next(frame for frame in (inputs.get("image"), inputs.get("last_image")) if frame is not None).size


def _prepare_keyframes(components, inputs, height, width, num_frames) -> TaskConditions:
    """Put keyframes on the canvas: the first is stretched (LANCZOS), a follower cover-cropped with H3's rounding."""
    image, last_image = inputs.get("image"), inputs.get("last_image")
    keyframes = [frame for frame in (image, last_image) if frame is not None]
    anchors = tuple(a for a, frame in (("first", image), ("last", last_image)) if frame is not None)
    if height is None:
        height, width = resolve_canvas_size(*_keyframe_aspect(inputs), components.canvas_multiple, *components.canvas_rule)
    fitted = []
    for index, frame in enumerate(keyframes):
        if frame.size == (width, height):
            fitted.append(frame)
        elif index == 0:
            fitted.append(components.image_processor.resize(frame, height=height, width=width))
        else:
            scale = max(width / frame.size[0], height / frame.size[1])
            size = (max(width, round(frame.size[0] * scale)), max(height, round(frame.size[1] * scale)))
            left, top = max(0, (size[0] - width) // 2), max(0, (size[1] - height) // 2)
            fitted.append(frame.resize(size, Image.Resampling.LANCZOS).crop((left, top, left + width, top + height)))
    return TaskConditions(height, width, fitted, anchors)


def _present_keyframes(components, prompt: str, conditions: TaskConditions):
    """`"<Picture i>: "` + vision block per keyframe, then the prompt; vision rows tagged video."""
    tokenizer, keyframes = components.tokenizer, conditions.media
    vision_inputs, token_ids, token_tags = {}, [], []
    if keyframes:
        vision = components.processor.image_processor(images=keyframes, return_tensors="pt")
        vision_inputs = {"pixel_values": vision["pixel_values"], "image_grid_thw": vision["image_grid_thw"]}
        merge = components.processor.image_processor.merge_size**2
        for index, grid in enumerate(vision["image_grid_thw"]):
            label = _tokens(tokenizer, f"<Picture {index + 1}>: ")
            block = _vision_block(tokenizer, "<|image_pad|>", int(grid.prod()) // merge)
            token_ids += label + block
            token_tags += [MINIMAX_H3_TEXT_TAG] * len(label) + [MINIMAX_H3_VIDEO_TAG] * len(block)
    prompt_ids = _tokens(tokenizer, prompt)
    return token_ids + prompt_ids, token_tags + [MINIMAX_H3_TEXT_TAG] * len(prompt_ids), vision_inputs


def _encode_keyframes(components, conditions: TaskConditions):
    vae_device = components.device_of(components.vae)
    condition_latents = [
        components.encode_visual_condition(torch.from_numpy(np.array(frame)).to(vae_device).permute(2, 0, 1)[None, :, None])
        for frame in conditions.media
    ]
    return condition_latents, []


# ---------------------------------------------------------------------------------------------------------------------
# ref2va: image / video / audio references
# ---------------------------------------------------------------------------------------------------------------------
def _check_references(inputs: Mapping[str, Any]) -> None:
    references = inputs.get("references")
    if not isinstance(references, (list, tuple)) or not references:
        raise ValueError(
            "`references` must be a non-empty list of MiniMaxH3ImageReference / MiniMaxH3VideoReference / "
            "MiniMaxH3AudioReference (use no `references` for text-only t2va)."
        )
    for index, entry in enumerate(references):
        if not isinstance(entry, MiniMaxH3Reference):
            raise ValueError(
                f"`references[{index}]` must be a MiniMaxH3ImageReference, MiniMaxH3VideoReference or "
                f"MiniMaxH3AudioReference, got {type(entry).__name__}; decode files with each class's `from_file`."
            )
    kinds = [entry.kind for entry in references]
    for kind, limit in REFERENCE_LIMITS.items():
        if kinds.count(kind) > limit:
            raise ValueError(f"MiniMax-H3 accepts at most {limit} {kind} references, got {kinds.count(kind)}.")
    if len(kinds) > MAX_REFERENCES:
        raise ValueError(f"MiniMax-H3 accepts at most {MAX_REFERENCES} references in total, got {len(kinds)}.")
    if set(kinds) == {"audio"}:
        raise ValueError("Audio references cannot be used on their own: add at least one image or video reference.")


def reference_image_size(width: int, height: int, short_edge: int, multiple: int) -> Tuple[int, int]:
    """The `(width, height)` an image reference of `width` x `height` is encoded at: its short edge at `short_edge`
    (the pipeline's `reference_image_short_edge`), both axes on the canvas multiple (as diffusers does)."""
    scale = short_edge / min(width, height)
    return (
        max(multiple, round(width * scale / multiple) * multiple),
        max(multiple, round(height * scale / multiple) * multiple),
    )


def _normalize_image_reference(components, image) -> MiniMaxH3ImageReference:
    """An image reference as RGB PIL at the reference short edge, on the canvas multiple (as diffusers does)."""
    multiple = components.canvas_multiple
    if isinstance(image, torch.Tensor):
        if image.dtype == torch.uint8:
            image = image.float() / 255.0
        image = components.image_processor.pt_to_numpy(image[None])[0]
    if isinstance(image, np.ndarray):
        if image.ndim != 3 or image.shape[2] != 3:
            raise ValueError(f"A reference image must be (height, width, 3) RGB, got {tuple(image.shape)}.")
        if image.dtype == np.uint8:
            image = image.astype(np.float32) / 255.0
        image = components.image_processor.numpy_to_pil(image)[0]
    width, height = image.size
    if width <= 0 or height <= 0 or width > 4 * height or height > 4 * width:
        raise ValueError(f"A reference image must be within 1:4 and 4:1, got {width}x{height}.")
    target = reference_image_size(width, height, components.reference_image_short_edge, multiple)
    if image.size != target:
        image = components.image_processor.resize(image, height=target[1], width=target[0])
    return MiniMaxH3ImageReference(image=image)


def _prepare_references(components, inputs, height, width, num_frames) -> TaskConditions:
    """Images to a 2048 short edge, videos to 24 fps on their own canvas, soundtracks to 32 kHz (as diffusers)."""
    height, width = _default_canvas(components, height, width)
    sampling_rate = components.audio_sampling_rate
    normalized = []
    for entry in inputs["references"]:
        waveform = None
        if entry.has_audio:
            rate = entry.sample_rate if entry.sample_rate is not None else sampling_rate
            waveform = MiniMaxH3Ref2VASetupStep._normalize_audio_condition(
                entry.audio, rate, sampling_rate, max_duration=num_frames / MINIMAX_H3_FPS
            )
        if entry.kind == "image":
            normalized.append(_normalize_image_reference(components, entry.image))
        elif entry.kind == "video":
            frames = MiniMaxH3Ref2VASetupStep._normalize_video_condition(
                entry.frames, float(entry.fps), num_frames, components.canvas_multiple, *components.canvas_rule,
                float(MINIMAX_H3_FPS),
            )  # fmt: skip
            normalized.append(
                MiniMaxH3VideoReference(
                    frames=frames,
                    fps=float(MINIMAX_H3_FPS),
                    audio=waveform,
                    sample_rate=None if waveform is None else sampling_rate,
                )
            )
        else:
            normalized.append(MiniMaxH3AudioReference(audio=waveform, sample_rate=sampling_rate))
    return TaskConditions(height, width, normalized)


def _present_references(components, prompt: str, conditions: TaskConditions):
    """Labels + vision blocks per reference in request order (diffusers' ref2va presentation), then the prompt."""
    presenter = MiniMaxH3Ref2VATextEncoderStep(video_sample_fps=VIDEO_REFERENCE_SAMPLE_FPS)
    vision_inputs, image_counts, video_counts, video_timestamps = presenter._gather_vision_features(
        components.processor, conditions.media, MINIMAX_H3_FPS
    )
    token_ids, token_tags = presenter._build_presentation(
        components.tokenizer,
        prompt,
        conditions.media,
        image_counts,
        video_counts,
        video_timestamps,
        text_tag=MINIMAX_H3_TEXT_TAG,
        video_tag=MINIMAX_H3_VIDEO_TAG,
    )
    return token_ids, token_tags, vision_inputs


def _encode_references(components, conditions: TaskConditions):
    """VAE-encode image/video references (sampled posterior) and soundtracks (posterior mean), in packed order."""
    vae, audio_vae = components.vae, components.audio_vae
    device, audio_device = components.device_of(vae), components.device_of(audio_vae)
    audio_mean = torch.tensor(audio_vae.config.latents_mean).view(1, 1, -1)
    audio_std = torch.tensor(audio_vae.config.latents_std).view(1, 1, -1)
    channels = audio_vae.config.latent_channels
    condition_latents, audio_condition_latents = [], []
    for reference in conditions.media:
        if reference.kind == "image":
            pixels = torch.from_numpy(np.array(reference.image)).to(device).permute(2, 0, 1)[None, :, None]
            condition_latents.append(components.encode_visual_condition(pixels))
        elif reference.kind == "video":
            # Snap *down* to 17n+5 so the VAE encodes without padding.
            per_chunk, kept = components.vae_frames_per_chunk, components.vae_latents_per_chunk
            count = max(1, (reference.frames.shape[0] - kept) // per_chunk) * per_chunk + kept
            pixels = torch.from_numpy(reference.frames[:count].copy()).to(device).permute(3, 0, 1, 2)[None]
            condition_latents.append(components.encode_visual_condition(pixels))
        if reference.has_audio:
            posterior = audio_vae.encode(reference.audio.to(audio_device)[:, None], return_dict=False)[0]
            latents = posterior.mode().float().cpu().transpose(1, 2)
            audio_condition_latents.append(((latents - audio_mean) / audio_std).reshape(-1, channels))
    return condition_latents, audio_condition_latents


def _references_layout(text_token_tags, conditions, condition_latents, audio_condition_latents, geometry):
    packed = MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence(
        text_token_tags, conditions.media, condition_latents, audio_condition_latents, *geometry,
        MINIMAX_H3_AUDIO_CHANNELS, MINIMAX_H3_AUDIO_TAG, MINIMAX_H3_VIDEO_TAG,
    )  # fmt: skip
    layout = ref2va_layout(
        len(text_token_tags), conditions.media, condition_latents, audio_condition_latents, *geometry,
        MINIMAX_H3_AUDIO_CHANNELS,
    )  # fmt: skip
    return packed, layout


# ---------------------------------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------------------------------
TASKS: Dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec(
            name="t2va",
            partition="transformer",
            lora_family="fl2v",
            conditioning_inputs=(),
            check_conditions=_check_nothing,
            prepare_conditions=_prepare_text_only,
            present=_present_prompt_only,
            encode_conditions=_no_condition_latents,
            build_layout=_text_and_keyframes_layout,
        ),
        TaskSpec(
            name="fl2va",
            partition="transformer",
            lora_family="fl2v",
            conditioning_inputs=("image", "last_image"),
            check_conditions=_check_keyframes,
            prepare_conditions=_prepare_keyframes,
            present=_present_keyframes,
            encode_conditions=_encode_keyframes,
            build_layout=_text_and_keyframes_layout,
            canvas_aspect=_keyframe_aspect,
        ),
        TaskSpec(
            name="ref2va",
            partition="transformer_ref",
            lora_family="ref2v",
            conditioning_inputs=("references",),
            check_conditions=_check_references,
            prepare_conditions=_prepare_references,
            present=_present_references,
            encode_conditions=_encode_references,
            build_layout=_references_layout,
        ),
    )
}


def get_task(name: str) -> TaskSpec:
    """The spec of task `name`; an unknown name is one clear error listing the known tasks."""
    try:
        return TASKS[name]
    except (KeyError, TypeError):
        raise ValueError(f"`task` must be one of {tuple(TASKS)}, got {name!r}.") from None


def select_task(image=None, last_image=None, references=None) -> str:
    """Route a request like diffusers' `MiniMaxH3Blocks` does: references → ref2va, keyframes → fl2va, else t2va.

    The task is the one whose conditioning inputs cover every conditioning input passed (none: the task that takes
    none); conditioning inputs of two tasks in one request are one clear error.
    """
    values = {"image": image, "last_image": last_image, "references": references}
    passed = {name for name, value in values.items() if value is not None}
    for spec in TASKS.values():
        if passed <= set(spec.conditioning_inputs) and bool(passed) == bool(spec.conditioning_inputs):
            return spec.name
    owners = [spec for spec in TASKS.values() if passed & set(spec.conditioning_inputs)]
    described = [f"{_describe_inputs(spec)} ({spec.name})" for spec in owners]
    raise ValueError(
        f"{' cannot be combined with '.join(described)}: pass the conditioning inputs of one task only."
    )


def _describe_inputs(spec: TaskSpec) -> str:
    return "/".join(f"`{name}`" for name in spec.conditioning_inputs) or "no conditioning"


def partition_for_task(task: str) -> str:
    """The DiT partition `task` runs on."""
    return get_task(task).partition


def partitions_for_task(task: Optional[str]) -> Tuple[str, ...]:
    """The partitions to load for `task`; every partition for `task=None`."""
    if task is None:
        return PARTITIONS
    return (partition_for_task(task),)


def tasks_of_family(family: str) -> Tuple[str, ...]:
    """The tasks whose LoRA family is `family` (e.g. `"fl2v"` → `("t2va", "fl2va")`)."""
    tasks = tuple(spec.name for spec in TASKS.values() if spec.lora_family == family)
    if not tasks:
        families = sorted({spec.lora_family for spec in TASKS.values()})
        raise ValueError(f"Unknown LoRA family {family!r}; known families: {families}.")
    return tasks


def partition_for_tasks(tasks: Sequence[str]) -> str:
    """The one partition a set of tasks runs on (e.g. the tasks a LoRA was trained for)."""
    partitions = {partition_for_task(task) for task in tasks}
    if len(partitions) != 1:
        raise ValueError(f"Tasks {tuple(tasks)} run on different partitions {sorted(partitions)}.")
    return partitions.pop()
