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
- `prompt_embeds` from `encode_prompt` (encode once, generate many times; a pipeline without text encoder),
  `callback_on_step_end`, `interrupt`, `sigmas` / `audio_sigmas`, `flow_shift` / `audio_flow_shift` and
  `output_type="latent"` are supported; a scheduler shift set for one call does not leak into the next;
- a list of prompts and `num_videos_per_prompt` run as one request after another (H3 packs one request into one
  sequence), stacked like diffusers' video pipelines stack a batch.

Threads may call one pipeline concurrently (a web server's shape) and get exactly the outputs of sequential calls:
per-call state lives in the call (the text encoder's early exit and the packed layout are context variables), and
the denoising loop, which steps the shared schedulers, takes turns under the pipeline's `denoise_lock`.
"""

from __future__ import annotations

import contextvars
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

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
from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep, patchify_video_latents
from diffusers.modular_pipelines.minimax_h3.encoders import encode_vae_condition
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
    MINIMAX_H3_AUDIO_CHANNELS,
    MINIMAX_H3_FPS,
)
from diffusers.modular_pipelines.minimax_h3.references import MiniMaxH3Reference
from diffusers.utils import BaseOutput, logging
from diffusers.utils.torch_utils import randn_tensor
from diffusers.video_processor import VideoProcessor
from transformers import Qwen2TokenizerFast, Qwen3VLForConditionalGeneration, Qwen3VLProcessor

from .._hooks import moves_weights, partitions_of
from .._model_card import pipeline_model_card, save_with_card, write_transformer_cards
from ..hooks.cache import check_cache_memory, free_device_bytes, start_cache_request
from ..hooks.fast_vae_decode import note_parallel_decode, vae_decode
from ..hooks.refine_once import refine_text_once
from ..hooks.v100_mode import v100_mode_of
from ..layout import use_packed_layout
from ..loaders.lora import MiniMaxH3LoraMixin
from ..loaders.pdd import check_no_head_bank
from ..loaders.single_file import check_saveable
from ..packing import check_layout_matches_indices
from ..parallel.checkpoint_streaming import release_streamed_weights, streaming_of
from ..parallel.ranks import check_same_generator, context_parallel_group, run_on_main_rank
from ..parallel.vae import parallel_vae_decode
from ..tasks import PARTITIONS, LatentGeometry, TaskComponents, TaskConditions, get_task, select_task
from .fasth3 import fasth3_record, resolve_fasth3_schedule, save_fasth3_contract
from .loading import load_pipeline
from .request import (
    DEFAULT_CANVAS_MAX_PIXELS,
    DEFAULT_CANVAS_SHORT_EDGE,
    DEFAULT_MAX_CANVAS_PIXELS,
    DEFAULT_MAX_DURATION_S,
    DEFAULT_MAX_PROMPT_TOKENS,
    DEFAULT_MIN_DURATION_S,
    H3Clip,
    H3Request,
    RequestConfig,
    ScheduleSettings,
    align_frames,
    check_canvas,
    check_pipeline_settings,
    check_prompt,
    check_prompt_tokens,
    check_schedule,
    check_text_encoder_loaded,
    latent_geometry,
    memory_shape,
)


logger = logging.get_logger(__name__)

KEYFRAME_ENCODE_SEED = 42
# A presentation of at least this many tokens shows a progress bar over the text encoder's decoder layers: a long prompt
# or many vision tokens make the encode take long enough to look stalled.
LONG_TEXT_ENCODE_TOKENS = 1024
KEYFRAME_NOISE_AUG = 0.999
PIXEL_MEAN, PIXEL_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


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


@dataclass
class DenoiseState:
    """One clip's packed sequence and latent rows, as `_generate` hands them to the denoising loop."""

    transformer: MiniMaxH3Transformer3DModel
    device: torch.device
    structure: Dict[str, torch.Tensor]
    layout: Any
    n_cond_video: int
    n_cond_audio: int
    latents: torch.Tensor
    audio_latents: torch.Tensor
    prompt_embeds: torch.Tensor


def _stack_outputs(outputs, output_type):
    """Per-request `(frames, audio)` stacked along the batch axis as diffusers' video pipelines return a batch."""
    if len(outputs) == 1:
        return outputs[0]
    frames, audio = zip(*outputs)
    if output_type == "pil":
        return [clip for batch in frames for clip in batch], _concat(audio)
    return _concat(frames), _concat(audio)


def _concat(parts):
    return np.concatenate(parts) if isinstance(parts[0], np.ndarray) else torch.cat(parts)


class _StopAfterLayer(Exception):
    """Raised by a forward hook once the hidden state H3 reads exists, so later decoder layers never run."""


# The capture dict of the text-encoder forward running in this thread / task. A hook only acts for its own call, so
# concurrent calls on one text encoder (each with its own hook) never take each other's hidden states.
_TEXT_ENCODER_CAPTURE: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar(
    "diffusers_h3_text_encoder_capture", default=None
)


class MiniMaxH3Pipeline(DiffusionPipeline, MiniMaxH3LoraMixin):
    r"""
    Joint video + stereo-audio generation with MiniMax-H3: text-to-video+audio (`t2va`), first/last-keyframe
    (`fl2va`) and omni-reference (`ref2va`), routed by the inputs of one `__call__`.

    The checkpoint is guidance-distilled: no negative prompt, no guidance scale, one transformer forward per step.
    `num_inference_steps` counts sigma grid points (terminal 0 included), so 50 runs 49 forwards.

    Args:
        text_encoder ([`~transformers.Qwen3VLForConditionalGeneration`], *optional*): Qwen3-VL conditioner. Without
            it (and its tokenizer and processor) the pipeline generates from `prompt_embeds` (see `encode_prompt`).
        tokenizer ([`~transformers.Qwen2TokenizerFast`], *optional*): Its tokenizer.
        processor ([`~transformers.Qwen3VLProcessor`], *optional*): Its processor (vision features of
            keyframes/references).
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
        min_duration_s (`float`, defaults to 5.0), max_duration_s (`float`, defaults to 15.0): The recommended clip
            lengths (after 17n+5 alignment, at 24 fps): what the released checkpoint was trained for. A request
            outside them, from one VAE chunk (22 frames) up, warns once and runs. Small test pipelines recommend
            shorter clips.
        strict_duration (`bool`, defaults to `False`): Refuse requests outside `min_duration_s`–`max_duration_s`
            instead of warning (a call's `strict_duration` overrides it).
        max_prompt_tokens (`int`, defaults to 2048): The most tokens a prompt may have (also bounded by the text
            encoder's `max_position_embeddings`); a longer one is refused before any model runs. The text rows join
            the DiT's packed sequence, so this bounds what a prompt costs; override it with
            `from_pretrained(..., max_prompt_tokens=N)`.
        max_canvas_pixels (`int`, defaults to 1920 * 1088): The largest canvas (height x width) a request may ask
            for: 1080p, the largest resolution the released model is trained at; a larger one is refused before any
            model runs. Override it with `from_pretrained(..., max_canvas_pixels=N)`.

    Every setting is checked when the pipeline is built (a wrong type is refused in one line naming it).
    """

    model_cpu_offload_seq = "text_encoder->transformer->transformer_ref->vae->audio_vae"
    # Without the text encoder (and its tokenizer / processor) the pipeline generates from `prompt_embeds`.
    _optional_components = ["transformer", "transformer_ref", "text_encoder", "tokenizer", "processor"]
    _callback_tensor_inputs = ["latents", "audio_latents", "prompt_embeds"]

    def __init__(
        self,
        text_encoder: Optional[Qwen3VLForConditionalGeneration],
        tokenizer: Optional[Qwen2TokenizerFast],
        processor: Optional[Qwen3VLProcessor],
        vae: AutoencoderKLMiniMaxH3,
        audio_vae: AutoencoderKLMiniMaxH3Audio,
        scheduler: MiniMaxH3Scheduler,
        audio_scheduler: MiniMaxH3Scheduler,
        transformer: Optional[MiniMaxH3Transformer3DModel] = None,
        transformer_ref: Optional[MiniMaxH3Transformer3DModel] = None,
        text_encoder_layer: int = 50,
        canvas_short_edge: int = DEFAULT_CANVAS_SHORT_EDGE,
        canvas_max_pixels: int = DEFAULT_CANVAS_MAX_PIXELS,
        reference_image_short_edge: int = 2048,
        min_duration_s: float = DEFAULT_MIN_DURATION_S,
        max_duration_s: float = DEFAULT_MAX_DURATION_S,
        max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
        strict_duration: bool = False,
        max_canvas_pixels: int = DEFAULT_MAX_CANVAS_PIXELS,
    ):
        check_pipeline_settings(
            text_encoder_layer=text_encoder_layer, canvas_short_edge=canvas_short_edge,
            canvas_max_pixels=canvas_max_pixels, reference_image_short_edge=reference_image_short_edge,
            min_duration_s=min_duration_s, max_duration_s=max_duration_s, max_prompt_tokens=max_prompt_tokens,
            max_canvas_pixels=max_canvas_pixels,
        )  # fmt: skip
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
            min_duration_s=min_duration_s,
            max_duration_s=max_duration_s,
            max_prompt_tokens=max_prompt_tokens,
            strict_duration=strict_duration,
            max_canvas_pixels=max_canvas_pixels,
        )
        self.vae_spatial_compression_ratio = vae.spatial_compression_ratio if vae is not None else 16
        self.image_processor = VaeImageProcessor(vae_scale_factor=16)
        # The video VAE decodes ImageNet-normalized RGB which `__call__` reverts itself; no second denormalization.
        self.video_processor = VideoProcessor(vae_scale_factor=16, do_normalize=False)
        self._interrupt = False
        self._num_timesteps = 0
        self._current_timestep = None
        # The schedulers' state (timesteps, step index, shift) and `interrupt` belong to the running denoising loop:
        # concurrent calls take turns in the loop (text encoding, conditioning and decoding still overlap).
        self.denoise_lock = threading.Lock()

    # ------------------------------------------------------------------------------------------------------------
    # Loading
    # ------------------------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, task: Optional[str] = None, **kwargs):
        r"""
        Load from a `save_pretrained` folder of this pipeline or from (a local snapshot of) the official hub repo
        layout (`modular_model_index.json`), loading only the transformer partition `task` needs: `transformer` for
        `"t2va"`/`"fl2va"`, `transformer_ref` for `"ref2va"`, both (where present) for `task=None`.

        `use_kernels=True` lets transformers replace the text encoder's layers with kernels fetched from the Hub (its
        default when the `kernels` package is installed); the default `False` loads offline and runs the layers this
        package is tested with.
        """
        return load_pipeline(cls, pretrained_model_name_or_path, task=task, **kwargs)

    def save_pretrained(
        self,
        save_directory: Union[str, os.PathLike],
        safe_serialization: bool = True,
        variant: Optional[str] = None,
        max_shard_size: Optional[Union[int, str]] = None,
        push_to_hub: bool = False,
        use_flashpack: bool = False,
        **kwargs,
    ):
        """diffusers' `save_pretrained` (and `push_to_hub=True`), with its parameters, plus a Hub model card
        (`README.md`) for the saved checkpoint when the folder has none: metadata (library, pipeline tag, base model,
        quantization and fused-LoRA tags) and a usage snippet that loads exactly this checkpoint. A partition holding
        GGUF layers (loaded from a .gguf file) or a PDD head bank is refused in one line before anything is written."""
        check_saveable(self)
        check_no_head_bank(self)

        def save(pipe, directory, **options):  # a FastH3 preset is saved as its contract, so that it reloads
            result = DiffusionPipeline.save_pretrained(pipe, directory, **options)
            if options.get("is_main_process", True):
                save_fasth3_contract(pipe, directory)
                write_transformer_cards(pipe, directory)
            return result

        return save_with_card(save, self, save_directory, pipeline_model_card,
                              safe_serialization=safe_serialization, variant=variant, max_shard_size=max_shard_size,
                              push_to_hub=push_to_hub, use_flashpack=use_flashpack, **kwargs)  # fmt: skip

    # ------------------------------------------------------------------------------------------------------------
    # Geometry and properties
    # ------------------------------------------------------------------------------------------------------------

    @property
    def patch_size(self) -> Tuple[int, int, int]:
        for name in PARTITIONS:
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

    @property
    def current_timestep(self):
        """The running denoising step's noise level on the scale of diffusers' flow-matching pipelines, `1000 * sigma`
        (1000 at pure noise, towards 0 as the clip clears), and `None` outside the loop. Pyramid attention broadcast
        and FasterCache (`current_timestep_callback=lambda: pipe.current_timestep`) read it, so their default skip
        ranges mean here what they mean for Wan or LTX. (The scheduler's own timesteps are `t = 1 - sigma`.)"""
        return self._current_timestep

    def enable_vsa(self, config=None, **options):
        """Install video sparse attention on the loaded transformer partition(s); see `diffusers_h3.enable_vsa`
        (`config` is a `diffusers_h3.VSAConfig`, `options` its fields). Returns the pipeline
        (`diffusers_h3.vsa_state(pipe.transformer)`: what was installed)."""
        from ..attention_processors.vsa import enable_vsa

        return enable_vsa(self, config, **options)

    def enable_fast_vae_decode(self, config=None, **legacy):
        """Decode the video VAE's tiles in batches (optionally compiled); see `diffusers_h3.enable_fast_vae_decode`
        (`config` is a `diffusers_h3.FastVAEDecodeConfig`). Returns the pipeline."""
        from ..hooks.fast_vae_decode import enable_fast_vae_decode

        return enable_fast_vae_decode(self, config, **legacy)

    def enable_v100_mode(self, config=None, **legacy):
        """Run a bf16-trained H3 in fp16 safely on Volta GPUs, on every loaded partition; see
        `diffusers_h3.enable_v100_mode` (`config` is a `diffusers_h3.V100ModeConfig`). Returns the pipeline
        (`v100_mode_of(pipe.transformer)`: the record)."""
        from ..hooks.v100_mode import enable_v100_mode

        return enable_v100_mode(self, config, **legacy)

    def enable_speed_preset(self, config=None, *args, **legacy):
        """Turn on the fast paths of a speed preset (`"exact"`, `"fast"` or `"fastest"`, or a
        `diffusers_h3.SpeedPresetConfig` with its options) on the loaded transformer partition(s) and the text
        encoder; see `diffusers_h3.enable_speed_preset` and docs/speed.md. Returns the pipeline
        (`diffusers_h3.speed_preset_record(pipe)`: what was turned on)."""
        from .speed_presets import enable_speed_preset

        return enable_speed_preset(self, config, *args, **legacy)

    def enable_memory_budget(self, config=None, *args, **legacy):
        """Place this pipeline (loaded on the CPU in the recipe's weight formats) with the fastest measured recipe
        that fits `config` (a `diffusers_h3.MemoryBudgetConfig`; default: the visible GPU / host memory); one
        `MemoryBudgetError` line when nothing fits. Returns the recipe; `describe(pipe)["placement"]` says where each
        component lives.

        To load the weights the way the recipe needs (quantized as they arrive, the text encoder streamed from disk
        before the DiT loads), use `diffusers_h3.load_for_memory_budget(path, gpu_gib=..., host_gib=...)` instead:
        docs/memory.md."""
        from ..parallel.memory_recipes import enable_memory_budget

        return enable_memory_budget(self, config, *args, **legacy)

    @property
    def _execution_device(self) -> torch.device:
        # A component streamed from its checkpoint files computes on the device its record names; diffusers' own
        # lookup knows only group offload and Accelerate hooks.
        for component in self.components.values():
            record = streaming_of(component) if isinstance(component, torch.nn.Module) else None
            if record is not None:
                return torch.device(record.device)
        return super()._execution_device

    def _device_of(self, module: torch.nn.Module) -> torch.device:
        """Where `module` computes: its weights' device, or the execution device under offload hooks. Components may
        sit on different GPUs (`device_map="balanced"`, or the text encoder on a second GPU); tensors follow them."""
        param = next(module.parameters(), None)
        offloaded = hasattr(module, "_hf_hook") or moves_weights(module)
        if param is None or offloaded or param.device.type == "meta":
            return self._execution_device
        return param.device

    def task_components(self) -> TaskComponents:
        """What the task steps (`TaskSpec.prepare_conditions` / `present` / `encode_conditions`) use of this
        pipeline."""
        vae, audio_vae = self.vae, self.audio_vae
        return TaskComponents(
            tokenizer=self.tokenizer,
            processor=self.processor,
            vae=vae,
            audio_vae=audio_vae,
            image_processor=self.image_processor,
            canvas_multiple=self.canvas_multiple,
            canvas_rule=self._canvas_rule,
            reference_image_short_edge=int(self.config.reference_image_short_edge),
            vae_frames_per_chunk=self.vae_frames_per_chunk if vae is not None else None,
            vae_latents_per_chunk=self.vae_latents_per_chunk if vae is not None else None,
            audio_sampling_rate=self.audio_sampling_rate if audio_vae is not None else None,
            device_of=self._device_of,
            encode_visual_condition=self._encode_visual_condition,
        )

    def _partitions(self):
        return partitions_of(self)

    def _active_step_recipes(self) -> List[Tuple[str, str, str]]:
        """The LoRA mixin's step recipes (distillation LoRAs, PDD) plus a FastH3 stack's preset (on `transformer`)."""
        recipes = super()._active_step_recipes()
        record = fasth3_record(self)
        if record is not None:
            recipes.append(("fasth3", f"FastH3 stack ({record.preset.name})", "transformer"))
        return recipes

    # ------------------------------------------------------------------------------------------------------------
    # Input checks
    # ------------------------------------------------------------------------------------------------------------

    def request_config(self) -> RequestConfig:
        """What checking and building a request reads from this pipeline: its configs and loaded components.
        `__call__` checks its arguments with `request.check_inputs` against it (through `H3Request.build`), the one
        check the CLI also runs on a checkpoint folder's configs before loading."""
        return RequestConfig.from_pipeline(self)

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
        Runs on the text encoder's device and returns the embeddings on `device` (default: the same). A presentation
        of `LONG_TEXT_ENCODE_TOKENS` or more shows a progress bar over the decoder layers it runs.
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
            if _TEXT_ENCODER_CAPTURE.get() is not captured:
                return None  # another call's forward (another thread) runs through this layer: not ours
            captured["hidden_states"] = output[0] if isinstance(output, tuple) else output
            raise _StopAfterLayer

        token = _TEXT_ENCODER_CAPTURE.set(captured)
        layers = self._language_layers()
        progress, handles = None, []
        if len(token_ids) >= LONG_TEXT_ENCODE_TOKENS:
            progress = self.progress_bar(total=layer)
            progress.set_description(f"text encoder, {len(token_ids)} tokens")

            def advance(module, args, output):
                if _TEXT_ENCODER_CAPTURE.get() is captured:
                    progress.update()

            handles = [decoder_layer.register_forward_hook(advance) for decoder_layer in layers[:layer]]
        handle = layers[layer - 1].register_forward_hook(stop_here)  # after `advance`: that one counts the last layer
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
            for progress_handle in handles:
                progress_handle.remove()
            if progress is not None:
                progress.close()
            _TEXT_ENCODER_CAPTURE.reset(token)
        if "hidden_states" not in captured:
            raise RuntimeError(f"the text encoder finished without running decoder layer {layer - 1}")
        return captured["hidden_states"].to(device=device, dtype=text_encoder.dtype)

    @torch.no_grad()
    def encode_prompt(
        self,
        prompt: str,
        image: Optional[PIL.Image.Image] = None,
        last_image: Optional[PIL.Image.Image] = None,
        references: Optional[Sequence[MiniMaxH3Reference]] = None,
        height: Optional[int] = None,
        width: Optional[int] = None,
        num_frames: int = 124,
        device: Optional[torch.device] = None,
        conditions: Optional[TaskConditions] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        r"""
        Encode `prompt` as the request's task presents it to the text encoder: the prompt alone for t2va (verbatim,
        no chat template); for fl2va a `"<Picture i>: "` label and vision block per keyframe before the prompt; for
        ref2va diffusers' reference presentation. The conditioning inputs pick the task as in `__call__`.

        Encode once and generate many times, or encode where the text encoder is loaded and generate with a pipeline
        loaded without it (`text_encoder=None, tokenizer=None, processor=None`): pass both outputs unchanged to
        `__call__` as `prompt_embeds=..., text_token_tags=...`, with the same `image` / `last_image` / `references`.
        The presentation depends on those inputs, on the canvas (`height`, `width`: fl2va keyframes are fitted to it)
        and on `num_frames` (ref2va videos and soundtracks are cut to it): encode with the values you generate with.

        Args:
            prompt (`str`): One prompt (encode a list one by one; embeddings of the same length may be stacked).
            image, last_image, references, height, width, num_frames: As in `__call__`.
            device (`torch.device`, *optional*): Where to return the embeddings (default: the text encoder's device).
            conditions (`TaskConditions`, *optional*): The conditioning media already prepared by the task
                (`TaskSpec.prepare_conditions`); `__call__` passes them so that they are prepared once.

        Returns:
            `(prompt_embeds, text_token_tags)`: `hidden_states[text_encoder_layer]` `(1, num_tokens, hidden)` in the
            text encoder's dtype, and the modality tag of every row (text or vision) `(num_tokens,)`, which the packed
            sequence needs.
        """
        conditioning = {"image": image, "last_image": last_image, "references": references}
        spec = get_task(select_task(**conditioning))
        config = self.request_config()
        check_text_encoder_loaded(config, "load it (e.g. on another machine) to encode prompts")
        components = self.task_components()
        if conditions is None:
            if not isinstance(prompt, str):
                raise ValueError(
                    f"`encode_prompt` encodes one prompt, got {type(prompt).__name__}: call it once per prompt."
                )
            check_prompt(prompt)
            check_prompt_tokens(config, prompt)
            check_canvas(config, height, width)
            num_frames = align_frames(config, num_frames)
            spec.check_conditions(conditioning)
            conditions = spec.prepare_conditions(components, conditioning, height, width, num_frames)
        token_ids, token_tags, vision_inputs = spec.present(components, prompt, conditions)
        prompt_embeds = self.encode_presentation(token_ids, vision_inputs, device=device)
        return prompt_embeds, torch.tensor(token_tags, dtype=torch.long)

    def _encode_visual_condition(self, pixels: torch.Tensor) -> torch.Tensor:
        return encode_vae_condition(self.vae, pixels, PIXEL_MEAN, PIXEL_STD, KEYFRAME_ENCODE_SEED)

    # ------------------------------------------------------------------------------------------------------------
    # Schedules
    # ------------------------------------------------------------------------------------------------------------

    def _set_schedules(self, request: H3Request, device):
        num_inference_steps, sigmas, audio_sigmas = request.num_inference_steps, request.sigmas, request.audio_sigmas
        flow_shift, audio_flow_shift = request.flow_shift, request.audio_flow_shift
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
    # Latents
    # ------------------------------------------------------------------------------------------------------------

    def _latent_geometry(self, num_frames: int, height: int, width: int) -> LatentGeometry:
        return latent_geometry(self.request_config(), num_frames, height, width)

    def _prepare_packed_sequence(self, request: H3Request, text_token_tags, conditions, encoded_conditions, device):
        """The request's packed rows (rotary grid in fp64, tags, indices) on `device` and its `PackedLayout`;
        `encoded_conditions`: `(condition_latents, audio_condition_latents)` as the task encoded them."""
        packed, layout = request.spec.build_layout(text_token_tags, conditions, *encoded_conditions, request.geometry)
        position_ids, token_tags, video_indices, audio_indices, text_indices, n_cond_video, n_cond_audio = packed
        check_layout_matches_indices(layout, video_indices, audio_indices, text_indices)
        if device.type in ("mps", "npu"):
            position_ids = position_ids.float()  # no fp64 there; the rope casts to fp32 anyway
        structure = {
            "position_ids": position_ids.to(device),
            "token_tags": token_tags.to(device),
            "video_indices": video_indices.to(device),
            "audio_indices": audio_indices.to(device),
            "text_indices": text_indices.to(device),
        }
        return structure, layout, n_cond_video, n_cond_audio

    def prepare_latents(
        self,
        geometry: LatentGeometry,
        condition_latents: Sequence[torch.Tensor],
        audio_condition_latents: Sequence[torch.Tensor],
        generator: Optional[torch.Generator],
        device: torch.device,
        latents: Optional[torch.Tensor] = None,
        audio_latents: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        r"""
        The packed rows the loop denoises: noised conditioning rows first, then the video noise; reference audio
        rows first, then the audio noise. Draws from the one `generator` in diffusers' order: conditioning noise,
        video noise, audio noise. Returns `(video_rows, audio_rows)` in fp32 on `device`.
        """
        condition_rows = []
        for condition in condition_latents:
            noise = randn_tensor(condition.shape, generator=generator, device=device, dtype=torch.float32)
            noised = self.scheduler.scale_noise(condition.to(device), KEYFRAME_NOISE_AUG, noise)
            condition_rows.append(patchify_video_latents(noised, self.patch_size))
        num_latent_frames, latent_height, latent_width, num_audio_latents, _ = geometry
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
        video_rows = torch.cat(condition_rows + [video_rows]) if condition_rows else video_rows
        audio_rows = torch.cat([rows.to(device) for rows in audio_condition_latents] + [audio_rows])
        return video_rows, audio_rows

    def _unpack_latents(self, latents, audio_latents, n_cond_video: int, n_cond_audio: int, geometry: LatentGeometry):
        """Generated rows back to `(1, C, frames, h, w)` video and `(2, C, num_latents)` audio latents."""
        num_latent_frames, latent_height, latent_width, num_audio_latents, (patch_t, patch_h, patch_w) = geometry
        channels = self.vae.config.latent_channels
        rows = latents[n_cond_video:].reshape(
            -1, num_latent_frames // patch_t, latent_height // patch_h, latent_width // patch_w,
            channels, patch_t, patch_h, patch_w,
        )  # fmt: skip
        video_latents = rows.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(
            -1, channels, num_latent_frames, latent_height, latent_width
        ).contiguous()
        audio_rows = audio_latents[n_cond_audio:].reshape(MINIMAX_H3_AUDIO_CHANNELS, num_audio_latents, -1)
        return video_latents, audio_rows.permute(0, 2, 1).contiguous()

    # ------------------------------------------------------------------------------------------------------------
    # __call__
    # ------------------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def __call__(
        self,
        prompt: Union[str, List[str]] = None,
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
        num_videos_per_prompt: int = 1,
        generator: Optional[Union[torch.Generator, List[torch.Generator]]] = None,
        latents: Optional[torch.Tensor] = None,
        audio_latents: Optional[torch.Tensor] = None,
        prompt_embeds: Optional[torch.Tensor] = None,
        text_token_tags: Optional[torch.Tensor] = None,
        output_type: str = "np",
        return_dict: bool = True,
        attention_kwargs: Optional[Dict[str, Any]] = None,
        callback_on_step_end: Optional[Callable[[Any, int, torch.Tensor, Dict], Dict]] = None,
        callback_on_step_end_tensor_inputs: Sequence[str] = ("latents",),
        strict_duration: Optional[bool] = None,
    ):
        r"""
        Generate a video with its stereo soundtrack.

        Args:
            prompt (`str` or `list[str]`, *optional*): The prompt (used verbatim, no chat template). A list runs one
                request per prompt, one after another, with the same conditioning inputs. Pass `prompt` or
                `prompt_embeds`.
            image (`PIL.Image.Image`, *optional*): First keyframe (fl2va); stretched onto the canvas, whose aspect
                ratio it sets unless `height`/`width` are given.
            last_image (`PIL.Image.Image`, *optional*): Last keyframe (fl2va); cover-cropped when `image` is given.
            references (`list[MiniMaxH3Reference]`, *optional*): ref2va references in the order the model reads
                them: ≤ 9 images, ≤ 3 videos, ≤ 3 audios, ≤ 12 in total, not audio only.
            height, width (`int`, *optional*): Canvas in pixels, multiples of 32, aspect 1:4…4:1. Defaults:
                768×1344 (t2va/ref2va), the first keyframe's aspect at a 768 short edge (fl2va).
            num_frames (`int`, defaults to 124): Frames at 24 fps, rounded up to 17n+5, at least one VAE chunk
                (22). The config's `min_duration_s`–`max_duration_s` (5–15 s for the released model, what it was
                trained for) is the recommended range: outside it the call warns once and generates.
            num_inference_steps (`int`, *optional*, defaults to 50): Sigma grid points (terminal 0 included), i.e.
                `num_inference_steps - 1` transformer forwards. A step-distillation LoRA may set its own default.
            sigmas, audio_sigmas (`list[float]`, *optional*): Explicit schedules (strictly decreasing, ending at 0),
                used verbatim. `audio_sigmas` defaults to the audio scheduler's grid with as many points as `sigmas`.
            flow_shift, audio_flow_shift (`float`, *optional*): Sigma shifts for this call (defaults: the
                schedulers' configs, 12 and 3).
            num_videos_per_prompt (`int`, defaults to 1): Clips per prompt (consecutive in the output).
            generator (`torch.Generator` or `list[torch.Generator]`, *optional*): One generator, which every request
                draws from in turn (conditioning noise, video noise, audio noise, as diffusers' modular pipeline
                does), or one generator per output clip.
            latents (`torch.Tensor`, *optional*): Initial video noise `(batch, channels, latent_frames, h, w)`,
                `batch = len(prompt) * num_videos_per_prompt`.
            audio_latents (`torch.Tensor`, *optional*): Initial audio noise `(2 * batch, channels, num_latents)`
                (a left/right pair per clip).
            prompt_embeds (`torch.Tensor`, *optional*): Prompt embeddings from `encode_prompt`, instead of `prompt`:
                `(batch, num_tokens, hidden)`, one request per row (stack only prompts encoded to the same length).
                They must be encoded with this request's conditioning inputs, canvas and `num_frames`.
            text_token_tags (`torch.Tensor`, *optional*): The `(num_tokens,)` row tags `encode_prompt` returned with
                `prompt_embeds`; required with them.
            output_type (`str`, defaults to `"np"`): `"np"`, `"pil"`, `"pt"` or `"latent"`.
            return_dict (`bool`, defaults to `True`): Return a [`MiniMaxH3PipelineOutput`] instead of a tuple.
            attention_kwargs (`dict`, *optional*): Passed to the transformer (e.g. `{"scale": s}` for LoRA).
            callback_on_step_end (`Callable`, `PipelineCallback` or `MultiPipelineCallbacks`, *optional*): Called
                as `callback(pipe, step, timestep, tensors)` after every step; may return a dict replacing any of
                `callback_on_step_end_tensor_inputs`.
            callback_on_step_end_tensor_inputs (`list[str]`): Among `"latents"`, `"audio_latents"` (packed rows,
                conditioning rows first) and `"prompt_embeds"`. A `PipelineCallback` / `MultiPipelineCallbacks`
                brings its own `tensor_inputs`, which replace this argument (as in diffusers' pipelines).
            strict_duration (`bool`, *optional*): Refuse a clip outside the recommended durations instead of warning
                (default: the config's `strict_duration`, `False`).

        Returns:
            [`MiniMaxH3PipelineOutput`] or `(frames, audio, sampling_rate)`; a batch is stacked along the first axis
            (frames `(batch, ...)`, audio `(batch, 2, samples)`; for `"latent"`, audio `(2 * batch, C, n)`).
        """
        # 1. Route the task and check the request before any model runs (the schedule first: a LoRA's or FastH3
        # preset's defaults are resolved from it).
        check_schedule(num_inference_steps, sigmas, audio_sigmas, flow_shift, audio_flow_shift)
        conditioning = {"image": image, "last_image": last_image, "references": references}
        spec = get_task(select_task(**conditioning))
        # A step-distillation LoRA fills unset schedule values and warns about settings it was not trained for.
        num_inference_steps, flow_shift, audio_flow_shift = self._resolve_lora_schedule(
            num_inference_steps, flow_shift, audio_flow_shift, sigmas, audio_sigmas, task=spec.name
        )
        # A FastH3 stack's preset runs its trained sigmas unless the call asks for another schedule.
        schedule = resolve_fasth3_schedule(
            self, ScheduleSettings(num_inference_steps, sigmas, audio_sigmas, flow_shift, audio_flow_shift), spec.name
        )
        request = H3Request.build(
            self.request_config(), prompt=prompt, **conditioning, height=height, width=width, num_frames=num_frames,
            **schedule.as_kwargs(), num_videos_per_prompt=num_videos_per_prompt, generator=generator,
            latents=latents, audio_latents=audio_latents, prompt_embeds=prompt_embeds, text_token_tags=text_token_tags,
            output_type=output_type, attention_kwargs=attention_kwargs, callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs, task=spec,
            strict_duration=strict_duration,
        )  # fmt: skip
        self._check_memory_for_request(request)
        # H3 packs one request into one sequence: a batch runs one clip after another, stacked like diffusers.
        outputs = [self._generate(request, clip) for clip in request.clips]
        frames, audio = _stack_outputs(outputs, output_type)
        self.maybe_free_model_hooks()

        if not return_dict:
            return (frames, audio, self.audio_sampling_rate)
        return MiniMaxH3PipelineOutput(frames=frames, audio=audio, sampling_rate=self.audio_sampling_rate)

    def _check_memory_for_request(self, request: H3Request) -> None:
        """A pipeline placed by a memory recipe refuses, in one line before anything runs, a request the recipe is
        predicted not to fit in the budget it was chosen for (`check_request_fits`), and, placed with
        `request_sized_cap=True`, holds the allocator to the request's size (`apply_request_sized_cap`)."""
        recipe = getattr(self, "_h3_memory_recipe", None)
        if recipe is None:
            return
        from ..parallel.memory_recipes import apply_request_sized_cap, check_request_fits

        transformer = getattr(self, request.spec.partition)
        ranks = [getattr(config, "r", 0) for config in (getattr(transformer, "peft_config", None) or {}).values()]
        shape = memory_shape(request, max(ranks, default=0), self.request_config().max_prompt_tokens)
        check_request_fits(recipe, shape)
        apply_request_sized_cap(self, recipe, shape)

    def _generate(self, request: H3Request, clip: H3Clip):
        """One clip of a checked request: returns `(frames, audio)` with a batch axis of 1."""
        spec, conditioning = request.spec, request.conditioning
        transformer = getattr(self, spec.partition)
        device = self._device_of(transformer)  # where the denoising loop runs; other components may sit elsewhere
        # Under context parallelism every rank runs this call: same noise (checked), one prompt encode (rank 0).
        cp_group = self._context_parallel_group = context_parallel_group(transformer)
        if cp_group is not None:
            check_same_generator(clip.generator, cp_group)

        # 2. Put the conditioning media on H3's rates and resolutions, on the request's canvas.
        components = self.task_components()
        conditions = spec.prepare_conditions(components, conditioning, request.height, request.width, request.num_frames)

        # 3. Encode the prompt, presented with its conditioning (labels, vision blocks), with the text encoder.
        if clip.prompt_embeds is None:

            def encode():
                return self.encode_prompt(clip.prompt, **conditioning, device=device, conditions=conditions)

            prompt_embeds, text_token_tags = run_on_main_rank(encode, cp_group, device)
        else:
            prompt_embeds, text_token_tags = clip.prompt_embeds.to(device), clip.text_token_tags.long().cpu()

        release_streamed_weights(self.text_encoder)  # a streamed encoder's layers read ahead for the next prompt

        # 4. Encode the conditioning media with the VAEs.
        condition_latents, audio_condition_latents = spec.encode_conditions(components, conditions)
        for vae in (self.vae, self.audio_vae):  # VAEs streamed from their files hold their encoders only this long
            release_streamed_weights(vae)

        # 5. Build the packed layout: rows, rotary grid (fp64), tags, and the PackedLayout for processors.
        geometry = request.geometry
        structure, layout, n_cond_video, n_cond_audio = self._prepare_packed_sequence(
            request, text_token_tags, conditions, (condition_latents, audio_condition_latents), device
        )

        # 6. Prepare the latent rows: noised conditioning rows, then video noise; reference audio, then audio noise.
        latents, audio_latents = self.prepare_latents(
            geometry, condition_latents, audio_condition_latents, clip.generator, device, clip.latents,
            clip.audio_latents,
        )  # fmt: skip
        video_indices, audio_indices = structure["video_indices"], structure["audio_indices"]
        if latents.shape[0] != video_indices.numel() or audio_latents.shape[0] != audio_indices.numel():
            raise ValueError(
                f"`latents`/`audio_latents` give {latents.shape[0]} video / {audio_latents.shape[0]} audio rows but the "
                f"request needs {video_indices.numel()} / {audio_indices.numel()}: pass noise shaped like "
                f"(1, C, {geometry.num_latent_frames}, {geometry.latent_height}, {geometry.latent_width}) and "
                f"(2, C, {geometry.num_audio_latents})."
            )
        state = DenoiseState(transformer, device, structure, layout, n_cond_video, n_cond_audio, latents, audio_latents,
                             prompt_embeds)  # fmt: skip

        # 7-8 step the shared schedulers (and read `interrupt`): concurrent calls take turns here.
        with self.denoise_lock:
            latents, audio_latents = self._denoise(request, state)

        release_streamed_weights(transformer)  # a streamed DiT's blocks read ahead for the next request

        # 9. Unpack the generated rows into latents.
        video_latents, audio_latents = self._unpack_latents(latents, audio_latents, n_cond_video, n_cond_audio, geometry)

        # 10. Decode video (ImageNet-normalized RGB → [0, 1]) and audio (stereo = 2 mono items).
        output_type = request.output_type
        if output_type == "latent":
            return video_latents, audio_latents
        frames = self._decode_video(video_latents, output_type, self._device_of(self.vae))
        audio = self._decode_audio(audio_latents, self._device_of(self.audio_vae))
        if output_type == "np":
            audio = audio.cpu().numpy()
        return frames, audio

    def _denoise(self, request: H3Request, state: "DenoiseState"):
        """Steps 7-8 of `__call__` for one clip; the caller holds `denoise_lock`. Returns the denoised rows."""
        self._interrupt = False
        transformer, device, structure, layout = state.transformer, state.device, state.structure, state.layout
        n_cond_video, n_cond_audio = state.n_cond_video, state.n_cond_audio
        latents, audio_latents, prompt_embeds = state.latents, state.audio_latents, state.prompt_embeds
        attention_kwargs, callback_on_step_end = request.attention_kwargs, request.callback_on_step_end
        video_indices, audio_indices = structure["video_indices"], structure["audio_indices"]
        # 7. Schedules and the per-step row-timestep plan (conditioning rows pinned at 0.999, reference audio at 1).
        timesteps, audio_timesteps = self._set_schedules(request, device)
        self._num_timesteps = len(timesteps)
        start_cache_request(transformer, len(timesteps))  # no step-cache state carries over between requests
        # Before the first forward; a context-parallel rank caches its share of the rows.
        cp_group = getattr(self, "_context_parallel_group", None)
        ranks = 1 if cp_group is None else torch.distributed.get_world_size(cp_group)
        check_cache_memory(transformer, -(-layout.seq_len // ranks), free_device_bytes(device))
        rows = (video_indices.cpu(), audio_indices.cpu(), n_cond_video, n_cond_audio, structure["text_indices"].numel())
        row_plan = [
            tuple(
                tensor.to(device)
                for tensor in MiniMaxH3SetTimestepsStep.build_row_timesteps(
                    *rows, float(t), float(t_audio), max(float(t), KEYFRAME_NOISE_AUG), 1.0
                )
            )
            for t, t_audio in zip(timesteps, audio_timesteps)
        ]

        # The (sigma, next sigma) each step spans, published with the layout (a PDD head bank mixes its heads by it).
        video_sigmas, audio_sigmas = self.scheduler.sigmas.tolist(), self.audio_scheduler.sigmas.tolist()
        intervals = [((video_sigmas[i], video_sigmas[i + 1]), (audio_sigmas[i], audio_sigmas[i + 1]))
                     for i in range(len(timesteps))]  # fmt: skip

        # 8. Denoise: one transformer forward per step; only the generated rows are stepped.
        # The token refiner is timestep-free: it refines the prompt once per request, not once per step.
        with self.progress_bar(total=len(timesteps)) as progress_bar, refine_text_once(transformer):
            for i, t in enumerate(timesteps):
                if self.interrupt:
                    continue
                self._current_timestep = 1000.0 * float(self.scheduler.sigmas[i])  # diffusers' flow-matching scale
                unique_timesteps, timestep_indices = row_plan[i]
                # cache_context tells diffusers' step-caching hooks (FirstBlockCache, MagCache, TaylorSeer) the step.
                step = {"step_index": i, "sigma": video_sigmas[i], "num_inference_steps": len(timesteps)}
                step_layout = layout.at_step(i, len(timesteps), *intervals[i])
                with use_packed_layout(step_layout), transformer.cache_context("cond", **step):
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
                    tensors = {k: local[k] for k in request.callback_on_step_end_tensor_inputs}
                    outputs = callback_on_step_end(self, i, t, tensors) or {}
                    latents = outputs.get("latents", latents)
                    audio_latents = outputs.get("audio_latents", audio_latents)
                    prompt_embeds = outputs.get("prompt_embeds", prompt_embeds)
                progress_bar.update()
        self._current_timestep = None

        return latents, audio_latents

    def _denormalize_video_latents(self, video_latents, device):
        mean = torch.tensor(self.vae.config.latents_mean, device=device).view(1, -1, 1, 1, 1)
        std = torch.tensor(self.vae.config.latents_std, device=device).view(1, -1, 1, 1, 1)
        return video_latents.to(device) * std + mean

    @staticmethod
    def _to_unit_range(video, device):
        """The VAE's ImageNet-normalized RGB → [0, 1]."""
        pixel_mean = torch.tensor(PIXEL_MEAN, device=device).view(1, -1, 1, 1, 1)
        pixel_std = torch.tensor(PIXEL_STD, device=device).view(1, -1, 1, 1, 1)
        return (video.float() * pixel_std).add_(pixel_mean).clamp_(0, 1)

    def _decode_video(self, video_latents, output_type, device):
        video_latents = self._denormalize_video_latents(video_latents, device)
        cp_group = getattr(self, "_context_parallel_group", None)
        # Host outputs: each temporal chunk goes to the host as soon as it is final, so the device never holds the
        # whole float32 clip (the same values: elementwise operations on bitwise the same chunks).
        to_host = cp_group is None and output_type in ("np", "pil") and not self.video_processor.config.do_normalize
        if cp_group is not None:  # the VAE tiles are split over the context-parallel ranks
            video = parallel_vae_decode(self.vae, video_latents, cp_group)
            note_parallel_decode(self.vae)
        elif to_host:
            clips = [
                torch.cat([self._to_unit_range(c, device).cpu() for c in self._decoded_chunks(video_latents[i : i + 1])], 2)
                for i in range(video_latents.shape[0])
            ]
            video = torch.cat(clips, 0)
        else:
            video = vae_decode(self.vae, video_latents)  # the batched tiles of `enable_fast_vae_decode` when on
        release_streamed_weights(self.vae)
        if not to_host:
            video = self._to_unit_range(video, device)
        if output_type == "np" and not self.video_processor.config.do_normalize:
            # The values of postprocess_video(video, "np") (no denormalization), with the channels-last copy done on
            # the decode device: diffusers makes it on the host, a strided copy of the whole float32 clip.
            return video.permute(0, 2, 3, 4, 1).contiguous().cpu().numpy()
        return self.video_processor.postprocess_video(video, output_type=output_type)

    def _decoded_chunks(self, z: torch.Tensor) -> Iterator[torch.Tensor]:
        """`vae.decode(z)` of one clip's denormalized latents, one final temporal chunk at a time (`_vae_tiles`)."""
        from diffusers.models.modeling_utils import get_parameter_dtype

        from .._vae_tiles import iter_decoded_chunks
        from ..hooks.fast_vae_decode import chunk_decoder

        vae = self.vae
        if hasattr(vae, "_hf_hook") and hasattr(vae._hf_hook, "pre_forward"):
            vae._hf_hook.pre_forward(vae)  # as `vae.decode` does: model CPU offload moves the VAE onto its device
        z = z.to(get_parameter_dtype(vae.post_quant_conv))  # as `vae.decode` does
        yield from iter_decoded_chunks(vae, z, chunk_decoder(vae))

    def _decode_video_chunks(self, video_latents, device) -> Iterator[np.ndarray]:
        """The video of `video_latents` (one clip) as uint8 `(F, H, W, 3)` arrays, one temporal chunk of the VAE at a
        time: concatenated, bitwise `_decode_video(video_latents, "np")` converted to uint8 as `export_to_video`
        converts it (same decode per chunk, same cross-fade, same float32 operations)."""
        if self.video_processor.config.do_normalize:  # postprocess_video would map [-1, 1] to [0, 1] first
            raise ValueError("decode_to_video expects the pipeline's video processor with do_normalize=False.")
        z = self._denormalize_video_latents(video_latents, device)
        for chunk in self._decoded_chunks(z):
            # Rounded to uint8 before the channels-last copy (elementwise: the same values), a quarter of the bytes.
            video = self._to_unit_range(chunk, device)[0].mul_(255.0).round_().to(torch.uint8)
            yield video.permute(1, 2, 3, 0).contiguous().cpu().numpy()
        release_streamed_weights(self.vae)

    @torch.no_grad()
    def decode_to_video(
        self,
        latents: torch.Tensor,
        audio_latents: torch.Tensor,
        path: Union[str, os.PathLike],
        *,
        crf: Optional[int] = None,
        preset: Optional[str] = None,
        pix_fmt: Optional[str] = None,
    ) -> Optional[str]:
        r"""
        Decode the latents of `pipe(..., output_type="latent")` into an MP4 file (H.264 + AAC stereo at 24 fps),
        encoding each decoded temporal chunk of the video while the VAE decodes the next one.

        ```py
        out = pipe(prompt, output_type="latent", generator=torch.Generator().manual_seed(0))
        pipe.decode_to_video(out.frames, out.audio, "clip.mp4")
        ```

        The audio is decoded and encoded first, so the file is finished soon after the last video chunk
        decodes (`benchmarks/results/export_cpu.json`). The frames are those of `pipe(..., output_type="np")` exported
        with `export_to_video` and the same options, bitwise before encoding. Atomic: the file at `path` is either the
        complete clip or left as it was, also when the decode fails half way. Under context parallelism every rank
        calls it: the ranks decode the whole clip together (`parallel_vae_decode`) and rank 0 writes the file.

        Args:
            latents (`torch.Tensor`): The video latents of one clip, `(1, C, latent_frames, h, w)` (for a batch pass
                `frames[i : i + 1]`).
            audio_latents (`torch.Tensor`): Its audio latents, `(2, C, n)` (a batch: `audio[2 * i : 2 * i + 2]`).
            path (`str` or `os.PathLike`): The `.mp4` file to write.
            crf (`int`, *optional*), preset (`str`, *optional*), pix_fmt (`str`, *optional*): libx264's options
                (see `diffusers_h3.VideoWriter`); unset ones take the speed preset's choice
                (`describe(pipe)["speed_preset"]["export"]`), or the measured defaults without a preset.

        Returns:
            The path written, or `None` on the context-parallel ranks that do not write.
        """
        from ..parallel.ranks import is_main_rank
        from .export import VideoWriter, check_finite, check_output_path, export_settings, export_to_video

        settings = export_settings(self, crf=crf, preset=preset, pix_fmt=pix_fmt)
        path = check_output_path(path)
        if not isinstance(latents, torch.Tensor) or latents.ndim != 5 or latents.shape[0] != 1:
            raise ValueError(
                "decode_to_video writes one clip: `latents` must be (1, C, latent_frames, h, w) from "
                f"output_type='latent', got {tuple(getattr(latents, 'shape', ()))} — pass frames[i : i + 1]."
            )
        if not isinstance(audio_latents, torch.Tensor) or audio_latents.ndim != 3 or audio_latents.shape[0] != 2:
            raise ValueError(
                "decode_to_video writes one clip: `audio_latents` must be its (2, C, n) left/right pair from "
                f"output_type='latent', got {tuple(getattr(audio_latents, 'shape', ()))} — pass audio[2 * i : 2 * i + 2]."
            )
        check_finite(latents, "the video latents")
        check_finite(audio_latents, "the audio latents")
        audio = self._decode_audio(audio_latents, self._device_of(self.audio_vae))
        device = self._device_of(self.vae)
        if getattr(self, "_context_parallel_group", None) is not None:
            frames = self._decode_video(latents, "np", device)  # every rank takes part in the parallel decode
            self.maybe_free_model_hooks()
            if not is_main_rank():
                return None
            written = export_to_video(frames[0], path, fps=MINIMAX_H3_FPS, audio=audio,
                                      sampling_rate=self.audio_sampling_rate, **settings)  # fmt: skip
            num_frames, mode = frames.shape[1], "whole clip (context-parallel decode), then encoded by rank 0"
        else:
            with VideoWriter(path, MINIMAX_H3_FPS, self.audio_sampling_rate, **settings) as writer:
                writer.write_audio(audio)
                for frames in self._decode_video_chunks(latents, device):
                    writer.write_frames(frames)  # encoded in the writer's thread while the next chunk decodes
            self.maybe_free_model_hooks()
            written, num_frames = writer.path, writer.num_frames
            mode = "streamed: each decoded chunk encoded while the next decodes"
        self._h3_last_export = {"path": written, "num_frames": int(num_frames), "decode": mode, **settings}
        return written

    def _decode_audio(self, audio_latents, device):
        mean = torch.tensor(self.audio_vae.config.latents_mean, device=device).view(1, -1, 1)
        std = torch.tensor(self.audio_vae.config.latents_std, device=device).view(1, -1, 1)
        audio = self.audio_vae.decode(audio_latents.to(device) * std + mean, return_dict=False)[0]
        release_streamed_weights(self.audio_vae)
        return audio.float().permute(1, 0, 2)

    def describe_paths(self) -> Dict[str, Any]:
        """Pipeline-level facts for `diffusers_h3.describe(pipe)`."""
        report = {
            "partitions": [name for name, _ in self._partitions()] or ["none"],
            "text_encoder_layer": int(self.config.text_encoder_layer),
            "text_encoder_early_exit": f"stops after decoder layer {int(self.config.text_encoder_layer) - 1}; no LM head",
        }
        lora = self.lora_summary()
        if lora:
            report["lora"] = lora
        for name, model in self._partitions():
            mode = v100_mode_of(model)
            if mode is not None:
                report[f"{name}_v100_mode"] = mode.describe_path()
        return report
