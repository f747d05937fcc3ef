# Copyright 2026 The diffusers-h3 authors. Licensed under the Apache License, Version 2.0.
"""`MiniMaxH3Pipeline`: the classic Diffusers pipeline for MiniMax-H3 (joint video + 32 kHz stereo audio).

diffusers 0.42.1 ships H3 as a *modular* pipeline only. This class re-expresses its blocks as one `__call__` in
numbered steps and reuses their module-level helpers (packing, rotary grid, presentation, conditioning), so that on
the same components, inputs and generator it produces bitwise the same frames and audio as
`MiniMaxH3Blocks().get_workflow(task).init_pipeline()` (tested on CPU in fp32 for t2va, fl2va and ref2va).

Differences from the modular pipeline, none of which change the numbers:
- the text encoder stops after the decoder layer whose output H3 reads (layer 50 of 64 in the released model): no
  later decoder layers and no LM head run;
- the packed layout is published to attention processors for every transformer call (`PackedLayout`);
- `callback_on_step_end`, `interrupt`, `sigmas` / `audio_sigmas`, `flow_shift` / `audio_flow_shift` and
  `output_type="latent"` are supported; a scheduler shift set for one call does not leak into the next.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import PIL.Image
import torch
from diffusers import (
    AutoencoderKLMiniMaxH3,
    AutoencoderKLMiniMaxH3Audio,
    DiffusionPipeline,
    MiniMaxH3Scheduler,
    MiniMaxH3Transformer3DModel,
)
from diffusers.image_processor import VaeImageProcessor
from diffusers.modular_pipelines.minimax_h3.before_denoise import (
    MiniMaxH3PrepareLayoutStep,
    MiniMaxH3Ref2VAPrepareLayoutStep,
    MiniMaxH3SetTimestepsStep,
    patchify_video_latents,
)
from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep
from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VATextEncoderStep, encode_vae_condition
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
    MINIMAX_H3_AUDIO_CHANNELS,
    MINIMAX_H3_AUDIO_TAG,
    MINIMAX_H3_FPS,
    MINIMAX_H3_MAX_ASPECT_RATIO,
    MINIMAX_H3_MIN_ASPECT_RATIO,
    MINIMAX_H3_TEXT_TAG,
    MINIMAX_H3_VIDEO_TAG,
    align_num_frames,
    audio_latent_num_frames,
    resolve_canvas_size,
    video_latent_num_frames,
)
from diffusers.modular_pipelines.minimax_h3.references import (
    MiniMaxH3AudioReference,
    MiniMaxH3ImageReference,
    MiniMaxH3Reference,
    MiniMaxH3VideoReference,
)
from diffusers.utils import BaseOutput, logging
from diffusers.utils.torch_utils import randn_tensor
from diffusers.video_processor import VideoProcessor
from PIL import Image
from transformers import Qwen2TokenizerFast, Qwen3VLForConditionalGeneration, Qwen3VLProcessor

from ..attention_processors.layout import PackedLayout, use_packed_layout
from ..loaders.lora import MiniMaxH3LoraMixin
from .packing import check_layout_matches_indices, ref2va_layout, t2va_fl2va_layout

logger = logging.get_logger(__name__)

TASKS = ("t2va", "fl2va", "ref2va")
OUTPUT_TYPES = ("np", "pil", "pt", "latent")
MIN_DURATION_S, MAX_DURATION_S = 5.0, 15.0
KEYFRAME_ENCODE_SEED = 42
KEYFRAME_NOISE_AUG = 0.999
PIXEL_MEAN, PIXEL_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
REFERENCE_LIMITS = {"image": 9, "video": 3, "audio": 3}
MAX_REFERENCES = 12
VIDEO_REFERENCE_SAMPLE_FPS = 2.0


@dataclass
class MiniMaxH3PipelineOutput(BaseOutput):
    r"""
    Output of [`MiniMaxH3Pipeline`].

    Args:
        frames: The video — `np.ndarray` `(batch, num_frames, height, width, 3)` for `"np"`, a list of lists of PIL
            images for `"pil"`, a `torch.Tensor` `(batch, num_frames, 3, height, width)` for `"pt"`; for `"latent"`
            the normalized video latents `(1, channels, latent_frames, latent_height, latent_width)`.
        audio: The stereo soundtrack `(batch, 2, num_samples)` at `sampling_rate` (a `np.ndarray` for `"np"`, a
            `torch.Tensor` otherwise); for `"latent"` the normalized audio latents `(2, channels, num_latents)`.
        sampling_rate: Sample rate of `audio` in Hz (32 000).
    """

    frames: Union[np.ndarray, torch.Tensor, List[List[PIL.Image.Image]]]
    audio: Union[np.ndarray, torch.Tensor]
    sampling_rate: int


class _StopAfterLayer(Exception):
    """Raised by a forward hook once the hidden state H3 reads exists, so later decoder layers never run."""


def select_task(image=None, last_image=None, references=None) -> str:
    """Route a request like diffusers' `MiniMaxH3Blocks` does: references → ref2va, keyframes → fl2va, else t2va."""
    if references is not None:
        if image is not None or last_image is not None:
            raise ValueError(
                "`references` (ref2va) cannot be combined with `image`/`last_image` (fl2va): pass either the "
                "keyframes or the references."
            )
        return "ref2va"
    if image is not None or last_image is not None:
        return "fl2va"
    return "t2va"


def partition_for_task(task: str) -> str:
    return "transformer_ref" if task == "ref2va" else "transformer"


class MiniMaxH3Pipeline(DiffusionPipeline, MiniMaxH3LoraMixin):
    r"""
    Joint video + stereo-audio generation with MiniMax-H3: text-to-video+audio (`t2va`), first/last-keyframe
    (`fl2va`) and omni-reference (`ref2va`), routed by the inputs of one `__call__`.

    The checkpoint is guidance-distilled: no negative prompt, no guidance scale, one transformer forward per step.
    `num_inference_steps` counts sigma grid points (terminal 0 included), so 50 runs 49 forwards.

    Args:
        text_encoder ([`~transformers.Qwen3VLForConditionalGeneration`]): Qwen3-VL conditioner.
        tokenizer ([`~transformers.Qwen2TokenizerFast`]): Its tokenizer.
        processor ([`~transformers.Qwen3VLProcessor`]): Its processor (vision features of keyframes/references).
        vae ([`AutoencoderKLMiniMaxH3`]): Video VAE (16× spatial, 4× temporal).
        audio_vae ([`AutoencoderKLMiniMaxH3Audio`]): Mono audio VAE, 32 kHz, 40 latents/s (stereo = 2 items).
        scheduler ([`MiniMaxH3Scheduler`]): Video schedule (shift 12).
        audio_scheduler ([`MiniMaxH3Scheduler`]): Audio schedule (shift 3).
        transformer ([`MiniMaxH3Transformer3DModel`], *optional*): The FL2VA partition (t2va and fl2va).
        transformer_ref ([`MiniMaxH3Transformer3DModel`], *optional*): The Ref2VA partition (ref2va).
        text_encoder_layer (`int`, defaults to 50): Which Qwen3-VL hidden state conditions the transformer.
        canvas_short_edge (`int`, defaults to 768), canvas_max_pixels (`int`, defaults to 768 * 1344): The default
            canvas rule (generated video and video references), as the released checkpoint was trained.
        reference_image_short_edge (`int`, defaults to 2048): Short edge image references are encoded at.
    """

    model_cpu_offload_seq = "text_encoder->transformer->transformer_ref->vae->audio_vae"
    _optional_components = ["transformer", "transformer_ref"]
    _callback_tensor_inputs = ["latents", "audio_latents", "prompt_embeds"]

    def __init__(
        self,
        text_encoder: Qwen3VLForConditionalGeneration,
        tokenizer: Qwen2TokenizerFast,
        processor: Qwen3VLProcessor,
        vae: AutoencoderKLMiniMaxH3,
        audio_vae: AutoencoderKLMiniMaxH3Audio,
        scheduler: MiniMaxH3Scheduler,
        audio_scheduler: MiniMaxH3Scheduler,
        transformer: Optional[MiniMaxH3Transformer3DModel] = None,
        transformer_ref: Optional[MiniMaxH3Transformer3DModel] = None,
        text_encoder_layer: int = 50,
        canvas_short_edge: int = 768,
        canvas_max_pixels: int = 768 * 1344,
        reference_image_short_edge: int = 2048,
    ):
        super().__init__()
        self.register_modules(
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            processor=processor,
            vae=vae,
            audio_vae=audio_vae,
            scheduler=scheduler,
            audio_scheduler=audio_scheduler,
            transformer=transformer,
            transformer_ref=transformer_ref,
        )
        self.register_to_config(
            text_encoder_layer=text_encoder_layer,
            canvas_short_edge=canvas_short_edge,
            canvas_max_pixels=canvas_max_pixels,
            reference_image_short_edge=reference_image_short_edge,
        )
        self.vae_spatial_compression_ratio = vae.spatial_compression_ratio if vae is not None else 16
        self.image_processor = VaeImageProcessor(vae_scale_factor=16)
        # The video VAE decodes ImageNet-normalized RGB which `__call__` reverts itself; no second denormalization.
        self.video_processor = VideoProcessor(vae_scale_factor=16, do_normalize=False)
        self._interrupt = False
        self._num_timesteps = 0

    # ------------------------------------------------------------------------------------------------------------
    # Loading
    # ------------------------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, task: Optional[str] = None, **kwargs):
        r"""
        Load from a `save_pretrained` folder of this pipeline or from (a local snapshot of) the official hub repo
        layout (`modular_model_index.json`), loading only the transformer partition `task` needs: `transformer` for
        `"t2va"`/`"fl2va"`, `transformer_ref` for `"ref2va"`, both (where present) for `task=None`.
        """
        from .loading import load_pipeline

        return load_pipeline(cls, pretrained_model_name_or_path, task=task, **kwargs)

    # ------------------------------------------------------------------------------------------------------------
    # Geometry and properties
    # ------------------------------------------------------------------------------------------------------------

    @property
    def patch_size(self) -> Tuple[int, int, int]:
        for name in ("transformer", "transformer_ref"):
            model = getattr(self, name, None)
            if model is not None:
                return tuple(model.config.patch_size)
        return (1, 2, 2)

    @property
    def canvas_multiple(self) -> int:
        return self.vae_spatial_compression_ratio * self.patch_size[2]

    @property
    def vae_frames_per_chunk(self) -> int:
        return self.vae.config.clip_length

    @property
    def vae_latents_per_chunk(self) -> int:
        return self.vae.tokens_chunk_size

    @property
    def audio_sampling_rate(self) -> int:
        return self.audio_vae.config.sampling_rate

    @property
    def _canvas_rule(self) -> Tuple[int, int]:
        return int(self.config.canvas_short_edge), int(self.config.canvas_max_pixels)

    @property
    def interrupt(self) -> bool:
        return self._interrupt

    @property
    def num_timesteps(self) -> int:
        return self._num_timesteps

    def enable_vsa(self, **options):
        """Install video sparse attention on the loaded transformer partition(s); see `diffusers_h3.enable_vsa`."""
        from ..attention_processors.vsa import enable_vsa

        return {name: enable_vsa(model, **options) for name, model in self._partitions()}

    def enable_v100_mode(self, **options):
        """Run a bf16-trained H3 in fp16 safely on Volta GPUs; see `diffusers_h3.enable_v100_mode`."""
        from ..hooks.v100_mode import enable_v100_mode

        return {name: enable_v100_mode(model, **options) for name, model in self._partitions()}

    def _device_of(self, module: torch.nn.Module) -> torch.device:
        """Where `module` computes: its weights' device, or the execution device under offload hooks. Components may
        sit on different GPUs (`device_map="balanced"`, or the text encoder on a second GPU); tensors follow them."""
        param = next(module.parameters(), None)
        offloaded = hasattr(module, "_hf_hook") or hasattr(module, "_diffusers_hook")
        if param is None or offloaded or param.device.type == "meta":
            return self._execution_device
        return param.device

    def _partitions(self):
        return [(n, getattr(self, n)) for n in ("transformer", "transformer_ref") if getattr(self, n, None) is not None]

    # ------------------------------------------------------------------------------------------------------------
    # Input checks
    # ------------------------------------------------------------------------------------------------------------

    def check_inputs(
        self,
        task,
        prompt,
        height,
        width,
        num_frames,
        references,
        output_type,
        callback_on_step_end_tensor_inputs,
        sigmas,
        audio_sigmas,
    ) -> int:
        """Validate a request before any model runs; returns the aligned frame count."""
        if not isinstance(prompt, str):
            raise ValueError(
                f"`prompt` must be a single string (H3 packs one request into one sequence), got {type(prompt).__name__}."
            )
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"`output_type` must be one of {OUTPUT_TYPES}, got {output_type!r}.")
        partition = partition_for_task(task)
        if getattr(self, partition, None) is None:
            loaded = [name for name, _ in self._partitions()] or ["none"]
            raise ValueError(
                f"Task {task!r} runs on the `{partition}` partition, but this pipeline holds {', '.join(loaded)}. "
                f"Load it with `MiniMaxH3Pipeline.from_pretrained(..., task={task!r})` or pass `{partition}=...`."
            )
        if (height is None) != (width is None):
            raise ValueError("`height` and `width` have to be passed together, or neither of them.")
        if height is not None:
            multiple = self.canvas_multiple
            if height <= 0 or width <= 0 or height % multiple or width % multiple:
                raise ValueError(
                    f"`height` and `width` must be positive multiples of {multiple}, got {height}x{width}; "
                    f"for example {max(multiple, round(height / multiple) * multiple)}x"
                    f"{max(multiple, round(width / multiple) * multiple)}."
                )
            ratio = width / height
            if not MINIMAX_H3_MIN_ASPECT_RATIO <= ratio <= MINIMAX_H3_MAX_ASPECT_RATIO:
                raise ValueError(
                    f"MiniMax-H3 supports aspect ratios from 1:4 to 4:1, got {width}x{height} ({ratio:.3g}:1)."
                )
        if not isinstance(num_frames, int) or isinstance(num_frames, bool) or num_frames < 1:
            raise ValueError(f"`num_frames` must be a positive int, got {num_frames!r}.")
        aligned = align_num_frames(num_frames, self.vae_frames_per_chunk, self.vae_latents_per_chunk)
        duration = aligned / MINIMAX_H3_FPS
        if not MIN_DURATION_S <= duration <= MAX_DURATION_S:
            low = math.ceil(MIN_DURATION_S * MINIMAX_H3_FPS)
            high = int(MAX_DURATION_S * MINIMAX_H3_FPS)
            raise ValueError(
                f"MiniMax-H3 generates {MIN_DURATION_S:g}–{MAX_DURATION_S:g} s at {MINIMAX_H3_FPS} fps; `num_frames`="
                f"{num_frames} rounds up to {aligned} frames (17n+5) = {duration:.2f} s. Pass a frame count between "
                f"{low} and {high} whose 17n+5 alignment stays within {high} frames, e.g. 124 (5.2 s) or 345 (14.4 s)."
            )
        if aligned != num_frames:
            logger.warning(f"`num_frames` has to be of the form 17n+5 for the video VAE; rounding {num_frames} up to {aligned}.")
        if task == "ref2va":
            self._check_references(references)
        if callback_on_step_end_tensor_inputs is not None:
            unknown = [k for k in callback_on_step_end_tensor_inputs if k not in self._callback_tensor_inputs]
            if unknown:
                raise ValueError(
                    f"`callback_on_step_end_tensor_inputs` has {unknown}; allowed: {self._callback_tensor_inputs}."
                )
        if audio_sigmas is not None and sigmas is None:
            raise ValueError("`audio_sigmas` needs `sigmas` too (both schedules must have the same number of steps).")
        if sigmas is not None and audio_sigmas is not None and len(sigmas) != len(audio_sigmas):
            raise ValueError(
                f"`sigmas` ({len(sigmas)} points) and `audio_sigmas` ({len(audio_sigmas)} points) must be the same length."
            )
        return aligned

    @staticmethod
    def _check_references(references):
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
            raise ValueError(
                "Audio references cannot be used on their own: add at least one image or video reference."
            )

    # ------------------------------------------------------------------------------------------------------------
    # Text encoder
    # ------------------------------------------------------------------------------------------------------------

    def _language_layers(self):
        model = self.text_encoder.model
        language_model = getattr(model, "language_model", model)
        return language_model.layers

    @torch.no_grad()
    def encode_presentation(
        self,
        token_ids: List[int],
        vision_inputs: Optional[Dict[str, torch.Tensor]] = None,
        device: Optional[torch.device] = None,
    ) -> torch.Tensor:
        r"""
        Run the Qwen3-VL conditioner on a tokenized presentation and return `hidden_states[text_encoder_layer]`
        `(1, num_tokens, hidden)` in the text encoder's dtype.

        Numerically identical to reading `output_hidden_states=True` of the full model, but a forward hook on the
        decoder layer that produces that state stops the forward there: no later decoder layers and no LM head run.
        Runs on the text encoder's device and returns the embeddings on `device` (default: the same).
        """
        text_encoder = self.text_encoder
        layer = int(self.config.text_encoder_layer)
        num_layers = text_encoder.config.text_config.num_hidden_layers
        if not 0 < layer < num_layers:
            raise ValueError(
                f"`text_encoder_layer`={layer} needs a text encoder with more than {layer} decoder layers (the last "
                f"hidden state is post-norm and is not what H3 reads), but it has {num_layers}."
            )
        encoder_device = self._device_of(text_encoder)
        device = device if device is not None else encoder_device
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=encoder_device)
        mm_token_type_ids = torch.tensor(
            self.processor.create_mm_token_type_ids([token_ids]), dtype=torch.long, device=encoder_device
        )
        vision_kwargs = {
            name: value.to(encoder_device, text_encoder.dtype) if name.startswith("pixel_") else value.to(encoder_device)
            for name, value in (vision_inputs or {}).items()
        }
        # A model-CPU-offload hook wraps only the top-level forward; we call `.model`, so fire it by hand.
        hook = getattr(text_encoder, "_hf_hook", None)
        if hook is not None and hasattr(hook, "pre_forward"):
            hook.pre_forward(text_encoder)

        captured = {}

        def stop_here(module, args, output):
            captured["hidden_states"] = output[0] if isinstance(output, tuple) else output
            raise _StopAfterLayer

        handle = self._language_layers()[layer - 1].register_forward_hook(stop_here)
        try:
            text_encoder.model(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                mm_token_type_ids=mm_token_type_ids,
                use_cache=False,
                **vision_kwargs,
            )
        except _StopAfterLayer:
            pass
        finally:
            handle.remove()
        if "hidden_states" not in captured:
            raise RuntimeError(f"the text encoder finished without running decoder layer {layer - 1}")
        return captured["hidden_states"].to(device=device, dtype=text_encoder.dtype)

    def _tokens(self, text: str) -> List[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _vision_block(self, pad_token: str, num_tokens: int) -> List[int]:
        convert = self.tokenizer.convert_tokens_to_ids
        return [convert("<|vision_start|>")] + [convert(pad_token)] * num_tokens + [convert("<|vision_end|>")]

    def _present_keyframes(self, prompt: str, keyframes: List[PIL.Image.Image]):
        """`"<Picture i>: "` + vision block per keyframe, then the prompt; vision rows tagged video."""
        vision_inputs, token_ids, token_tags = {}, [], []
        if keyframes:
            vision = self.processor.image_processor(images=keyframes, return_tensors="pt")
            vision_inputs = {"pixel_values": vision["pixel_values"], "image_grid_thw": vision["image_grid_thw"]}
            merge = self.processor.image_processor.merge_size**2
            for index, grid in enumerate(vision["image_grid_thw"]):
                label = self._tokens(f"<Picture {index + 1}>: ")
                block = self._vision_block("<|image_pad|>", int(grid.prod()) // merge)
                token_ids += label + block
                token_tags += [MINIMAX_H3_TEXT_TAG] * len(label) + [MINIMAX_H3_VIDEO_TAG] * len(block)
        prompt_ids = self._tokens(prompt)
        return token_ids + prompt_ids, token_tags + [MINIMAX_H3_TEXT_TAG] * len(prompt_ids), vision_inputs

    def _present_references(self, prompt: str, references: List[MiniMaxH3Reference]):
        """Labels + vision blocks per reference in request order (diffusers' ref2va presentation), then the prompt."""
        presenter = MiniMaxH3Ref2VATextEncoderStep(video_sample_fps=VIDEO_REFERENCE_SAMPLE_FPS)
        vision_inputs, image_counts, video_counts, video_timestamps = presenter._gather_vision_features(
            self.processor, references, MINIMAX_H3_FPS
        )
        token_ids, token_tags = presenter._build_presentation(
            self.tokenizer,
            prompt,
            references,
            image_counts,
            video_counts,
            video_timestamps,
            text_tag=MINIMAX_H3_TEXT_TAG,
            video_tag=MINIMAX_H3_VIDEO_TAG,
        )
        return token_ids, token_tags, vision_inputs

    # ------------------------------------------------------------------------------------------------------------
    # Conditioning media
    # ------------------------------------------------------------------------------------------------------------

    def _fit_keyframes(self, image, last_image, height, width):
        """Put keyframes on the canvas: the first is stretched (LANCZOS), a follower cover-cropped with H3's rounding."""
        keyframes = [frame for frame in (image, last_image) if frame is not None]
        anchors = tuple(a for a, frame in (("first", image), ("last", last_image)) if frame is not None)
        for frame in keyframes:
            if not isinstance(frame, PIL.Image.Image):
                raise ValueError(f"`image` / `last_image` must be PIL images, got {type(frame).__name__}.")
        if height is None:
            height, width = resolve_canvas_size(*keyframes[0].size, self.canvas_multiple, *self._canvas_rule)
        fitted = []
        for index, frame in enumerate(keyframes):
            if frame.size == (width, height):
                fitted.append(frame)
            elif index == 0:
                fitted.append(self.image_processor.resize(frame, height=height, width=width))
            else:
                scale = max(width / frame.size[0], height / frame.size[1])
                size = (max(width, round(frame.size[0] * scale)), max(height, round(frame.size[1] * scale)))
                left, top = max(0, (size[0] - width) // 2), max(0, (size[1] - height) // 2)
                fitted.append(frame.resize(size, Image.Resampling.LANCZOS).crop((left, top, left + width, top + height)))
        return fitted, anchors, height, width

    def _normalize_references(self, references, num_frames):
        """Images to a 2048 short edge, videos to 24 fps on their own canvas, soundtracks to 32 kHz (as diffusers)."""
        multiple = self.canvas_multiple
        normalized = []
        for entry in references:
            waveform = None
            if entry.has_audio:
                rate = entry.sample_rate if entry.sample_rate is not None else self.audio_sampling_rate
                waveform = MiniMaxH3Ref2VASetupStep._normalize_audio_condition(
                    entry.audio, rate, self.audio_sampling_rate, max_duration=num_frames / MINIMAX_H3_FPS
                )
            if entry.kind == "image":
                image = entry.image
                if isinstance(image, torch.Tensor):
                    if image.dtype == torch.uint8:
                        image = image.float() / 255.0
                    image = self.image_processor.pt_to_numpy(image[None])[0]
                if isinstance(image, np.ndarray):
                    if image.ndim != 3 or image.shape[2] != 3:
                        raise ValueError(f"A reference image must be (height, width, 3) RGB, got {tuple(image.shape)}.")
                    if image.dtype == np.uint8:
                        image = image.astype(np.float32) / 255.0
                    image = self.image_processor.numpy_to_pil(image)[0]
                width, height = image.size
                if width <= 0 or height <= 0 or width > 4 * height or height > 4 * width:
                    raise ValueError(f"A reference image must be within 1:4 and 4:1, got {width}x{height}.")
                scale = self.config.reference_image_short_edge / min(width, height)
                target = (
                    max(multiple, round(width * scale / multiple) * multiple),
                    max(multiple, round(height * scale / multiple) * multiple),
                )
                if image.size != target:
                    image = self.image_processor.resize(image, height=target[1], width=target[0])
                normalized.append(MiniMaxH3ImageReference(image=image))
            elif entry.kind == "video":
                frames = MiniMaxH3Ref2VASetupStep._normalize_video_condition(
                    entry.frames, float(entry.fps), num_frames, multiple, *self._canvas_rule, float(MINIMAX_H3_FPS)
                )
                normalized.append(
                    MiniMaxH3VideoReference(
                        frames=frames,
                        fps=float(MINIMAX_H3_FPS),
                        audio=waveform,
                        sample_rate=None if waveform is None else self.audio_sampling_rate,
                    )
                )
            else:
                normalized.append(MiniMaxH3AudioReference(audio=waveform, sample_rate=self.audio_sampling_rate))
        return normalized

    def _encode_visual_condition(self, pixels: torch.Tensor) -> torch.Tensor:
        return encode_vae_condition(self.vae, pixels, PIXEL_MEAN, PIXEL_STD, KEYFRAME_ENCODE_SEED)

    def _encode_references(self, references):
        """VAE-encode image/video references (sampled posterior) and soundtracks (posterior mean), in packed order."""
        device, audio_device = self._device_of(self.vae), self._device_of(self.audio_vae)
        audio_mean = torch.tensor(self.audio_vae.config.latents_mean).view(1, 1, -1)
        audio_std = torch.tensor(self.audio_vae.config.latents_std).view(1, 1, -1)
        channels = self.audio_vae.config.latent_channels
        condition_latents, audio_condition_latents = [], []
        for reference in references:
            if reference.kind == "image":
                pixels = torch.from_numpy(np.array(reference.image)).to(device).permute(2, 0, 1)[None, :, None]
                condition_latents.append(self._encode_visual_condition(pixels))
            elif reference.kind == "video":
                # Snap *down* to 17n+5 so the VAE encodes without padding.
                per_chunk, kept = self.vae_frames_per_chunk, self.vae_latents_per_chunk
                count = max(1, (reference.frames.shape[0] - kept) // per_chunk) * per_chunk + kept
                pixels = torch.from_numpy(reference.frames[:count].copy()).to(device).permute(3, 0, 1, 2)[None]
                condition_latents.append(self._encode_visual_condition(pixels))
            if reference.has_audio:
                posterior = self.audio_vae.encode(reference.audio.to(audio_device)[:, None], return_dict=False)[0]
                latents = posterior.mode().float().cpu().transpose(1, 2)
                audio_condition_latents.append(((latents - audio_mean) / audio_std).reshape(-1, channels))
        return condition_latents, audio_condition_latents

    # ------------------------------------------------------------------------------------------------------------
    # Schedules
    # ------------------------------------------------------------------------------------------------------------

    def _set_schedules(self, num_inference_steps, sigmas, audio_sigmas, flow_shift, audio_flow_shift, device):
        # Reset the shift every call so that one request's `flow_shift` never leaks into the next.
        self.scheduler.set_shift(flow_shift if flow_shift is not None else self.scheduler.config.shift)
        self.audio_scheduler.set_shift(
            audio_flow_shift if audio_flow_shift is not None else self.audio_scheduler.config.shift
        )
        if sigmas is not None:
            self.scheduler.set_timesteps(sigmas=sigmas, device=device)
            if audio_sigmas is not None:
                self.audio_scheduler.set_timesteps(sigmas=audio_sigmas, device=device)
            else:
                self.audio_scheduler.set_timesteps(len(sigmas), device=device)
        else:
            self.scheduler.set_timesteps(num_inference_steps, device=device)
            self.audio_scheduler.set_timesteps(num_inference_steps, device=device)
        timesteps, audio_timesteps = self.scheduler.timesteps, self.audio_scheduler.timesteps
        if len(timesteps) != len(audio_timesteps):
            raise ValueError(
                f"The video schedule has {len(timesteps)} steps but the audio schedule {len(audio_timesteps)} (the "
                "shifted grid collapsed duplicate sigmas); pass explicit `sigmas` and `audio_sigmas` of equal length."
            )
        return timesteps, audio_timesteps

    # ------------------------------------------------------------------------------------------------------------
    # __call__
    # ------------------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def __call__(
        self,
        prompt: str = None,
        image: Optional[PIL.Image.Image] = None,
        last_image: Optional[PIL.Image.Image] = None,
        references: Optional[Sequence[MiniMaxH3Reference]] = None,
        height: Optional[int] = None,
        width: Optional[int] = None,
        num_frames: int = 124,
        num_inference_steps: Optional[int] = None,
        sigmas: Optional[Sequence[float]] = None,
        audio_sigmas: Optional[Sequence[float]] = None,
        flow_shift: Optional[float] = None,
        audio_flow_shift: Optional[float] = None,
        generator: Optional[torch.Generator] = None,
        latents: Optional[torch.Tensor] = None,
        audio_latents: Optional[torch.Tensor] = None,
        output_type: str = "np",
        return_dict: bool = True,
        attention_kwargs: Optional[Dict[str, Any]] = None,
        callback_on_step_end: Optional[Callable[[Any, int, torch.Tensor, Dict], Dict]] = None,
        callback_on_step_end_tensor_inputs: Sequence[str] = ("latents",),
    ):
        r"""
        Generate a video with its stereo soundtrack.

        Args:
            prompt (`str`): The prompt, one string (used verbatim, no chat template).
            image (`PIL.Image.Image`, *optional*): First keyframe (fl2va); stretched onto the canvas, whose aspect
                ratio it sets unless `height`/`width` are given.
            last_image (`PIL.Image.Image`, *optional*): Last keyframe (fl2va); cover-cropped when `image` is given.
            references (`list[MiniMaxH3Reference]`, *optional*): ref2va references in the order the model reads
                them: ≤ 9 images, ≤ 3 videos, ≤ 3 audios, ≤ 12 in total, not audio only.
            height, width (`int`, *optional*): Canvas in pixels, multiples of 32, aspect 1:4…4:1. Defaults:
                768×1344 (t2va/ref2va), the first keyframe's aspect at a 768 short edge (fl2va).
            num_frames (`int`, defaults to 124): Frames at 24 fps, rounded up to 17n+5; 5–15 s after rounding.
            num_inference_steps (`int`, *optional*, defaults to 50): Sigma grid points (terminal 0 included), i.e.
                `num_inference_steps - 1` transformer forwards. A step-distillation LoRA may set its own default.
            sigmas, audio_sigmas (`list[float]`, *optional*): Explicit schedules (strictly decreasing, ending at 0),
                used verbatim. `audio_sigmas` defaults to the audio scheduler's grid with as many points as `sigmas`.
            flow_shift, audio_flow_shift (`float`, *optional*): Sigma shifts for this call (defaults: the
                schedulers' configs, 12 and 3).
            generator (`torch.Generator`, *optional*): One generator; draws conditioning noise, video noise, audio
                noise in that order (as diffusers' modular pipeline does).
            latents (`torch.Tensor`, *optional*): Initial video noise `(1, channels, latent_frames, h, w)`.
            audio_latents (`torch.Tensor`, *optional*): Initial audio noise `(2, channels, num_latents)`.
            output_type (`str`, defaults to `"np"`): `"np"`, `"pil"`, `"pt"` or `"latent"`.
            return_dict (`bool`, defaults to `True`): Return a [`MiniMaxH3PipelineOutput`] instead of a tuple.
            attention_kwargs (`dict`, *optional*): Passed to the transformer (e.g. `{"scale": s}` for LoRA).
            callback_on_step_end (`Callable`, *optional*): Called as `callback(pipe, step, timestep, tensors)`
                after every step; may return a dict replacing any of `callback_on_step_end_tensor_inputs`.
            callback_on_step_end_tensor_inputs (`list[str]`): Among `"latents"`, `"audio_latents"` (packed rows,
                conditioning rows first) and `"prompt_embeds"`.

        Returns:
            [`MiniMaxH3PipelineOutput`] or `(frames, audio, sampling_rate)`.
        """
        # 1. Route the task and check the request before any model runs.
        task = select_task(image, last_image, references)
        # A step-distillation LoRA fills unset schedule values and warns about settings it was not trained for.
        num_inference_steps, flow_shift, audio_flow_shift = self._resolve_lora_schedule(
            num_inference_steps, flow_shift, audio_flow_shift, sigmas, audio_sigmas, task=task
        )
        if num_inference_steps is None:
            num_inference_steps = 50
        num_frames = self.check_inputs(
            task, prompt, height, width, num_frames, references, output_type,
            callback_on_step_end_tensor_inputs, sigmas, audio_sigmas,
        )  # fmt: skip
        transformer = getattr(self, partition_for_task(task))
        self._interrupt = False
        device = self._device_of(transformer)  # where the denoising loop runs; other components may sit elsewhere

        # 2. Resolve the canvas and put the conditioning media on H3's rates and resolutions.
        keyframes, anchors, normalized_references = [], (), None
        if task == "fl2va":
            keyframes, anchors, height, width = self._fit_keyframes(image, last_image, height, width)
        elif height is None:
            height, width = resolve_canvas_size(16, 9, self.canvas_multiple, *self._canvas_rule)
        if task == "ref2va":
            normalized_references = self._normalize_references(references, num_frames)

        # 3. Encode the presentation (labels, vision blocks, prompt) with the text encoder.
        if task == "ref2va":
            token_ids, token_tags, vision_inputs = self._present_references(prompt, normalized_references)
        else:
            token_ids, token_tags, vision_inputs = self._present_keyframes(prompt, keyframes)
        prompt_embeds = self.encode_presentation(token_ids, vision_inputs, device=device)
        text_token_tags = torch.tensor(token_tags, dtype=torch.long)

        # 4. Encode the visual (and, for ref2va, audio) conditioning with the VAEs.
        audio_condition_latents = []
        if task == "ref2va":
            condition_latents, audio_condition_latents = self._encode_references(normalized_references)
        else:
            vae_device = self._device_of(self.vae)
            condition_latents = [
                self._encode_visual_condition(
                    torch.from_numpy(np.array(frame)).to(vae_device).permute(2, 0, 1)[None, :, None]
                )
                for frame in keyframes
            ]

        # 5. Build the packed layout: rows, rotary grid (fp64), tags, and the PackedLayout for processors.
        ratio = self.vae_spatial_compression_ratio
        num_latent_frames = video_latent_num_frames(num_frames, self.vae_frames_per_chunk, self.vae_latents_per_chunk)
        latent_height, latent_width = height // ratio, width // ratio
        num_audio_latents = audio_latent_num_frames(num_frames)
        geometry = (num_latent_frames, latent_height, latent_width, num_audio_latents, self.patch_size)
        if task == "ref2va":
            packed = MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence(
                text_token_tags, normalized_references, condition_latents, audio_condition_latents, *geometry,
                MINIMAX_H3_AUDIO_CHANNELS, MINIMAX_H3_AUDIO_TAG, MINIMAX_H3_VIDEO_TAG,
            )  # fmt: skip
            layout = ref2va_layout(
                len(token_ids), normalized_references, condition_latents, audio_condition_latents, *geometry,
                MINIMAX_H3_AUDIO_CHANNELS,
            )  # fmt: skip
        else:
            packed = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
                text_token_tags, *geometry, MINIMAX_H3_AUDIO_CHANNELS, MINIMAX_H3_AUDIO_TAG, MINIMAX_H3_VIDEO_TAG, anchors
            )
            layout = t2va_fl2va_layout(len(token_ids), len(anchors), *geometry, MINIMAX_H3_AUDIO_CHANNELS)
        position_ids, token_tags_t, video_indices, audio_indices, text_indices, n_cond_video, n_cond_audio = packed
        check_layout_matches_indices(layout, video_indices, audio_indices, text_indices)
        if device.type in ("mps", "npu"):
            position_ids = position_ids.float()  # no fp64 there; the rope casts to fp32 anyway
        structure = {
            "position_ids": position_ids.to(device),
            "token_tags": token_tags_t.to(device),
            "video_indices": video_indices.to(device),
            "audio_indices": audio_indices.to(device),
            "text_indices": text_indices.to(device),
        }

        # 6. Draw noise from the one generator: conditioning noise, video noise, audio noise — in that order.
        condition_rows = []
        for condition in condition_latents:
            noise = randn_tensor(condition.shape, generator=generator, device=device, dtype=torch.float32)
            noised = self.scheduler.scale_noise(condition.to(device), KEYFRAME_NOISE_AUG, noise)
            condition_rows.append(patchify_video_latents(noised, self.patch_size))
        if latents is None:
            latents = randn_tensor(
                (1, self.vae.config.latent_channels, num_latent_frames, latent_height, latent_width),
                generator=generator, device=device, dtype=torch.float32,
            )  # fmt: skip
        video_rows = patchify_video_latents(latents.to(device, torch.float32), self.patch_size)
        audio_channels = self.audio_vae.config.latent_channels
        if audio_latents is None:
            audio_rows = randn_tensor(
                (num_audio_latents * MINIMAX_H3_AUDIO_CHANNELS, audio_channels),
                generator=generator, device=device, dtype=torch.float32,
            )  # fmt: skip
        else:
            audio_rows = audio_latents.to(device, torch.float32).permute(0, 2, 1).reshape(-1, audio_channels)
        latents = torch.cat(condition_rows + [video_rows]) if condition_rows else video_rows
        audio_latents = torch.cat([rows.to(device) for rows in audio_condition_latents] + [audio_rows])
        if latents.shape[0] != video_indices.numel() or audio_latents.shape[0] != audio_indices.numel():
            raise ValueError(
                f"`latents`/`audio_latents` give {latents.shape[0]} video / {audio_latents.shape[0]} audio rows but the "
                f"request needs {video_indices.numel()} / {audio_indices.numel()}: pass noise shaped like "
                f"(1, C, {num_latent_frames}, {latent_height}, {latent_width}) and (2, C, {num_audio_latents})."
            )

        # 7. Schedules and the per-step row-timestep plan (conditioning rows pinned at 0.999, reference audio at 1).
        timesteps, audio_timesteps = self._set_schedules(
            num_inference_steps, sigmas, audio_sigmas, flow_shift, audio_flow_shift, device
        )
        self._num_timesteps = len(timesteps)
        row_plan = [
            tuple(
                tensor.to(device)
                for tensor in MiniMaxH3SetTimestepsStep.build_row_timesteps(
                    video_indices, audio_indices, n_cond_video, n_cond_audio, text_indices.numel(),
                    float(t), float(t_audio), max(float(t), KEYFRAME_NOISE_AUG), 1.0,
                )  # fmt: skip
            )
            for t, t_audio in zip(timesteps, audio_timesteps)
        ]

        # 8. Denoise: one transformer forward per step; only the generated rows are stepped.
        with self.progress_bar(total=len(timesteps)) as progress_bar:
            for i, t in enumerate(timesteps):
                if self.interrupt:
                    continue
                unique_timesteps, timestep_indices = row_plan[i]
                with use_packed_layout(layout.at_step(i, len(timesteps))):
                    noise_pred, audio_noise_pred = transformer(
                        hidden_states=latents[None],
                        audio_hidden_states=audio_latents[None],
                        encoder_hidden_states=prompt_embeds,
                        timestep=unique_timesteps,
                        timestep_indices=timestep_indices,
                        attention_kwargs=attention_kwargs,
                        return_dict=False,
                        **structure,
                    )
                latents[n_cond_video:] = self.scheduler.step(
                    noise_pred[0, n_cond_video:].float(), t, latents[n_cond_video:], return_dict=False
                )[0]
                audio_latents[n_cond_audio:] = self.audio_scheduler.step(
                    audio_noise_pred[0, n_cond_audio:].float(), audio_timesteps[i], audio_latents[n_cond_audio:],
                    return_dict=False,
                )[0]  # fmt: skip
                if callback_on_step_end is not None:
                    local = {"latents": latents, "audio_latents": audio_latents, "prompt_embeds": prompt_embeds}
                    tensors = {k: local[k] for k in callback_on_step_end_tensor_inputs}
                    outputs = callback_on_step_end(self, i, t, tensors) or {}
                    latents = outputs.get("latents", latents)
                    audio_latents = outputs.get("audio_latents", audio_latents)
                    prompt_embeds = outputs.get("prompt_embeds", prompt_embeds)
                progress_bar.update()

        # 9. Unpack the generated rows into latents.
        patch_t, patch_h, patch_w = self.patch_size
        channels = self.vae.config.latent_channels
        rows = latents[n_cond_video:].reshape(
            -1, num_latent_frames // patch_t, latent_height // patch_h, latent_width // patch_w,
            channels, patch_t, patch_h, patch_w,
        )  # fmt: skip
        video_latents = rows.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(
            -1, channels, num_latent_frames, latent_height, latent_width
        ).contiguous()
        audio_rows = audio_latents[n_cond_audio:].reshape(MINIMAX_H3_AUDIO_CHANNELS, num_audio_latents, -1)
        audio_latents_out = audio_rows.permute(0, 2, 1).contiguous()

        # 10. Decode video (ImageNet-normalized RGB → [0, 1]) and audio (stereo = 2 mono items).
        if output_type == "latent":
            frames, audio = video_latents, audio_latents_out
        else:
            frames = self._decode_video(video_latents, output_type, self._device_of(self.vae))
            audio = self._decode_audio(audio_latents_out, self._device_of(self.audio_vae))
            if output_type == "np":
                audio = audio.cpu().numpy()
        self.maybe_free_model_hooks()

        if not return_dict:
            return (frames, audio, self.audio_sampling_rate)
        return MiniMaxH3PipelineOutput(frames=frames, audio=audio, sampling_rate=self.audio_sampling_rate)

    def _decode_video(self, video_latents, output_type, device):
        mean = torch.tensor(self.vae.config.latents_mean, device=device).view(1, -1, 1, 1, 1)
        std = torch.tensor(self.vae.config.latents_std, device=device).view(1, -1, 1, 1, 1)
        video = self.vae.decode(video_latents.to(device) * std + mean, return_dict=False)[0]
        pixel_mean = torch.tensor(PIXEL_MEAN, device=device).view(1, -1, 1, 1, 1)
        pixel_std = torch.tensor(PIXEL_STD, device=device).view(1, -1, 1, 1, 1)
        video = (video.float() * pixel_std + pixel_mean).clamp(0, 1)
        return self.video_processor.postprocess_video(video, output_type=output_type)

    def _decode_audio(self, audio_latents, device):
        mean = torch.tensor(self.audio_vae.config.latents_mean, device=device).view(1, -1, 1)
        std = torch.tensor(self.audio_vae.config.latents_std, device=device).view(1, -1, 1)
        audio = self.audio_vae.decode(audio_latents.to(device) * std + mean, return_dict=False)[0]
        return audio.float().permute(1, 0, 2)

    def describe_paths(self) -> Dict[str, Any]:
        """Pipeline-level facts for `diffusers_h3._report(pipe)`."""
        report = {
            "partitions": [name for name, _ in self._partitions()] or ["none"],
            "text_encoder_layer": int(self.config.text_encoder_layer),
            "text_encoder_early_exit": f"stops after decoder layer {int(self.config.text_encoder_layer) - 1}; no LM head",
        }
        lora = self.lora_summary()
        if lora:
            report["lora"] = lora
        for name, model in self._partitions():
            mode = getattr(model, "_h3_v100_mode", None)
            if mode is not None:
                report[f"{name}_v100_mode"] = mode.describe_path()
        return report
