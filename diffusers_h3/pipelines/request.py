# Copyright 2026 The diffusers-h3 authors. Licensed under the Apache License, Version 2.0.
"""`H3Request`: one checked `MiniMaxH3Pipeline.__call__`, built from configs and call arguments alone (no weights).

`__call__` builds the request (every check that needs no model runs here), then generates one clip of it after
another. The CLI builds the same request from the configs in a model folder before loading anything, so both check a
request with the same code.

`RequestConfig` holds what building a request reads from the pipeline: its own config (canvas rule, duration
limits), the VAE's and transformer's geometry, and which components are loaded. `RequestConfig.from_pipeline(pipe)`
reads it from a pipeline, `RequestConfig.from_folder(path, task)` from a checkpoint folder's JSON configs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import os
import types
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Tuple, Union

import torch
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
    MINIMAX_H3_FPS,
    MINIMAX_H3_MAX_ASPECT_RATIO,
    MINIMAX_H3_MIN_ASPECT_RATIO,
    MINIMAX_H3_TEXT_TAG,
    MINIMAX_H3_VIDEO_TAG,
    align_num_frames,
    audio_latent_num_frames,
    video_latent_num_frames,
)
from diffusers.utils import logging

from ..tasks import PARTITIONS, LatentGeometry, TaskSpec, get_task, select_task


logger = logging.get_logger(__name__)

OUTPUT_TYPES = ("np", "pil", "pt", "latent")
CALLBACK_TENSOR_INPUTS = ("latents", "audio_latents", "prompt_embeds")
TEXT_ENCODER_COMPONENTS = ("text_encoder", "tokenizer", "processor")
# The clip lengths the released checkpoint was trained for (seconds at 24 fps, after 17n+5 alignment): the pipeline's
# config (`min_duration_s`, `max_duration_s`) holds the recommended range; outside it a request warns (or, with
# `strict_duration`, is refused).
DEFAULT_MIN_DURATION_S, DEFAULT_MAX_DURATION_S = 5.0, 15.0
# The default canvas rule (the released checkpoint's training canvas), the pipeline's config defaults.
DEFAULT_CANVAS_SHORT_EDGE, DEFAULT_CANVAS_MAX_PIXELS = 768, 768 * 1344
# The largest canvas a request may ask for (the pipeline config's `max_canvas_pixels`): 1080p, 1920x1088 in multiples of
# 32 (either orientation), the largest resolution MiniMax-H3 is trained at. The sequence, and with it attention's
# cost, grows with the pixels: a larger canvas is untested ground for the model and hours or an out-of-memory error
# for the machine. Raise it with `from_pretrained(..., max_canvas_pixels=N)`.
DEFAULT_MAX_CANVAS_PIXELS = 1920 * 1088
DEFAULT_NUM_INFERENCE_STEPS = 50
# `num_inference_steps` / the length of `sigmas`: the model is distilled for 50 steps; 1000 (999 forwards, hours per
# clip) is far beyond any use, so a larger count is a typo. The CLI's `--steps` has the same bound (`cli.MAX_STEPS`).
MAX_INFERENCE_STEPS = 1000
# The most prompt tokens a request may encode (the pipeline config's `max_prompt_tokens`): the text rows join the DiT's
# packed sequence and the text encoder's cost grows with them, so a runaway prompt (a pasted file) would run for hours.
# Long descriptive prompts take a few hundred tokens; raise it with `from_pretrained(..., max_prompt_tokens=N)`.
DEFAULT_MAX_PROMPT_TOKENS = 2048


@dataclasses.dataclass(frozen=True)
class RequestConfig:
    r"""
    What checking and building a request reads from a pipeline, none of it weights.

    Args:
        vae_spatial_compression_ratio (`int`), vae_frames_per_chunk (`int`), vae_latents_per_chunk (`int`): The video
            VAE's geometry (16, 17 and 5 for the released model).
        patch_size (`tuple[int, int, int]`): The transformer's patch size.
        canvas_short_edge (`int`), canvas_max_pixels (`int`): The pipeline's default canvas rule.
        max_canvas_pixels (`int`): The largest canvas (height x width) a request may ask for.
        min_duration_s (`float`), max_duration_s (`float`): The recommended clip lengths, after alignment (what the
            model was trained for): outside them a request warns once and runs, from one VAE chunk up.
        strict_duration (`bool`): Refuse clips outside `min_duration_s`–`max_duration_s` instead of warning.
        max_prompt_tokens (`int`): The most tokens a prompt may have: the pipeline's `max_prompt_tokens`, lowered to
            the text encoder's `max_position_embeddings` where that is smaller.
        count_prompt_tokens (`Callable[[str], int]`, *optional*): Counts a prompt's tokens (the pipeline's tokenizer,
            as the prompt is presented); without it only prompts whose UTF-8 bytes fit are known to fit (the tokenizer
            is byte-level: a token holds at least one byte) and longer ones are left to the caller.
        text_dims (`Mapping[str, int]`): The loaded DiT partitions and the prompt-embedding width each reads.
        missing_text_components (`tuple[str]`): Text-encoder components not loaded (then prompts cannot be encoded).
        callback_tensor_inputs (`tuple[str]`): What `callback_on_step_end` may read and replace.
    """

    vae_spatial_compression_ratio: int
    vae_frames_per_chunk: int
    vae_latents_per_chunk: int
    patch_size: Tuple[int, int, int]
    canvas_short_edge: int
    canvas_max_pixels: int
    min_duration_s: float
    max_duration_s: float
    text_dims: Mapping[str, int]
    missing_text_components: Tuple[str, ...] = ()
    callback_tensor_inputs: Tuple[str, ...] = CALLBACK_TENSOR_INPUTS
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS
    strict_duration: bool = False
    max_canvas_pixels: int = DEFAULT_MAX_CANVAS_PIXELS
    count_prompt_tokens: Optional[Callable[[str], int]] = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "text_dims", types.MappingProxyType(dict(self.text_dims)))
        if not 0 < self.min_duration_s <= self.max_duration_s:
            raise ValueError(
                f"`min_duration_s`={self.min_duration_s:g} and `max_duration_s`={self.max_duration_s:g} must satisfy "
                "0 < min_duration_s <= max_duration_s."
            )

    @property
    def canvas_multiple(self) -> int:
        return self.vae_spatial_compression_ratio * self.patch_size[2]

    @property
    def canvas_rule(self) -> Tuple[int, int]:
        return int(self.canvas_short_edge), int(self.canvas_max_pixels)

    @classmethod
    def from_pipeline(cls, pipe) -> "RequestConfig":
        """The request config of a loaded `MiniMaxH3Pipeline` (its configs and which components it holds)."""
        config = pipe.config
        # A pipeline loaded without its VAE (e.g. only to encode prompts) checks frames on the class defaults' geometry,
        # the released model's, as it does the canvas.
        geometry = _vae_geometry({}) if pipe.vae is None else (
            pipe.vae_spatial_compression_ratio, pipe.vae_frames_per_chunk, pipe.vae_latents_per_chunk
        )  # fmt: skip
        return cls(
            vae_spatial_compression_ratio=geometry[0],
            vae_frames_per_chunk=geometry[1],
            vae_latents_per_chunk=geometry[2],
            patch_size=tuple(pipe.patch_size),
            canvas_short_edge=int(config.canvas_short_edge),
            canvas_max_pixels=int(config.canvas_max_pixels),
            min_duration_s=float(config.get("min_duration_s", DEFAULT_MIN_DURATION_S)),
            max_duration_s=float(config.get("max_duration_s", DEFAULT_MAX_DURATION_S)),
            text_dims={name: int(model.config.text_dim) for name, model in pipe._partitions()},
            missing_text_components=tuple(n for n in TEXT_ENCODER_COMPONENTS if getattr(pipe, n, None) is None),
            callback_tensor_inputs=tuple(pipe._callback_tensor_inputs),
            max_prompt_tokens=prompt_token_limit(
                config.get("max_prompt_tokens", DEFAULT_MAX_PROMPT_TOKENS),
                None if pipe.text_encoder is None else pipe.text_encoder.config.to_dict(),
            ),
            strict_duration=bool(config.get("strict_duration", False)),
            count_prompt_tokens=None if pipe.tokenizer is None else functools.partial(count_tokens, pipe.tokenizer),
            max_canvas_pixels=int(config.get("max_canvas_pixels", DEFAULT_MAX_CANVAS_PIXELS)),
        )

    @classmethod
    def from_configs(
        cls,
        vae_config: Mapping[str, Any],
        partition_configs: Mapping[str, Mapping[str, Any]],
        pipeline_config: Optional[Mapping[str, Any]] = None,
        text_encoder_config: Optional[Mapping[str, Any]] = None,
    ) -> "RequestConfig":
        """The request config of a checkpoint from its configs alone: the video VAE's `config.json`, the DiT
        partitions' (`{"transformer": {...}}`; keys left out take the class defaults, the released model's), the
        pipeline's own (`model_index.json`: canvas rule, duration limits, prompt bound; defaults where absent) and
        the text encoder's (its `max_position_embeddings` bounds the prompt too). The VAE is built on the meta device
        to read its derived geometry: no weights load. The text encoder counts as loaded."""
        from diffusers import MiniMaxH3Transformer3DModel

        spatial, frames_per_chunk, latents_per_chunk = _vae_geometry(vae_config)
        defaults = _init_defaults(MiniMaxH3Transformer3DModel)
        partitions = {name: {**defaults, **dict(config)} for name, config in partition_configs.items()}
        first = next((partitions[name] for name in PARTITIONS if name in partitions), defaults)
        pipeline_config = dict(pipeline_config or {})
        return cls(
            vae_spatial_compression_ratio=spatial,
            vae_frames_per_chunk=frames_per_chunk,
            vae_latents_per_chunk=latents_per_chunk,
            patch_size=tuple(first["patch_size"]),
            canvas_short_edge=int(pipeline_config.get("canvas_short_edge", DEFAULT_CANVAS_SHORT_EDGE)),
            canvas_max_pixels=int(pipeline_config.get("canvas_max_pixels", DEFAULT_CANVAS_MAX_PIXELS)),
            min_duration_s=float(pipeline_config.get("min_duration_s", DEFAULT_MIN_DURATION_S)),
            max_duration_s=float(pipeline_config.get("max_duration_s", DEFAULT_MAX_DURATION_S)),
            text_dims={name: int(config["text_dim"]) for name, config in partitions.items()},
            max_prompt_tokens=prompt_token_limit(
                pipeline_config.get("max_prompt_tokens", DEFAULT_MAX_PROMPT_TOKENS), text_encoder_config
            ),
            strict_duration=bool(pipeline_config.get("strict_duration", False)),
            max_canvas_pixels=int(pipeline_config.get("max_canvas_pixels", DEFAULT_MAX_CANVAS_PIXELS)),
        )

    @classmethod
    def from_folder(
        cls, folder: Union[str, os.PathLike], partitions: Optional[Sequence[str]] = None
    ) -> "RequestConfig":
        """The request config of a checkpoint folder (this pipeline's `save_pretrained` or the hub layout), from its
        JSON configs: `vae/config.json`, `<partition>/config.json` and the pipeline config in `model_index.json` (the
        hub layout has none: the defaults). `partitions`: the DiT partitions to count as loaded (default: those
        with a folder); a config file that is missing gives the class defaults, the released model's."""
        folder = Path(folder)
        index = _read_json(folder / "model_index.json")
        pipeline_config = {k: v for k, v in index.items() if not k.startswith("_") and not isinstance(v, (list, tuple))}
        if partitions is None:
            partitions = [name for name in PARTITIONS if (folder / name).is_dir()]
        partition_configs = {name: _read_json(folder / name / "config.json") for name in partitions}
        return cls.from_configs(_read_json(folder / "vae" / "config.json"), partition_configs, pipeline_config,
                                _read_json(folder / "text_encoder" / "config.json"))  # fmt: skip


def _vae_geometry(vae_config: Mapping[str, Any]) -> Tuple[int, int, int]:
    """`(spatial compression, frames per chunk, latents per chunk)` of the video VAE `vae_config` describes (keys
    left out take the class defaults), built on the meta device: no weights."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKLMiniMaxH3

    with init_empty_weights():
        vae = AutoencoderKLMiniMaxH3.from_config(dict(vae_config))
    return vae.spatial_compression_ratio, vae.config.clip_length, vae.tokens_chunk_size


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _init_defaults(model_cls) -> dict:
    import inspect

    parameters = inspect.signature(model_cls.__init__).parameters.values()
    return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}


def prompt_token_limit(max_prompt_tokens, text_encoder_config: Optional[Mapping[str, Any]] = None) -> int:
    """The pipeline's `max_prompt_tokens`, lowered to the text encoder's `max_position_embeddings` (from its config
    dict, the text config of a Qwen3-VL one) where that is smaller."""
    limit = int(max_prompt_tokens)
    if limit < 1:
        raise ValueError(f"`max_prompt_tokens` must be a positive int, got {max_prompt_tokens!r}.")
    config = dict(text_encoder_config or {})
    positions = (config.get("text_config") or {}).get("max_position_embeddings") or config.get("max_position_embeddings")
    return min(limit, int(positions)) if positions else limit


def count_tokens(tokenizer, text: str) -> int:
    """The tokens of `text` as the tasks present a prompt (no special tokens, no chat template)."""
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def check_prompt_tokens(config: RequestConfig, prompt) -> None:
    """Every prompt of `prompt` has at most `config.max_prompt_tokens` tokens (counted only when its UTF-8 bytes
    exceed the bound; without `config.count_prompt_tokens` such a prompt is left to the caller)."""
    limit = config.max_prompt_tokens
    for i, text in enumerate(prompt if isinstance(prompt, (list, tuple)) else [prompt]):
        if len(text.encode("utf-8", "surrogatepass")) <= limit or config.count_prompt_tokens is None:
            continue
        num_tokens = config.count_prompt_tokens(text)
        if num_tokens > limit:
            where = f"`prompt[{i}]`" if isinstance(prompt, (list, tuple)) else "`prompt`"
            raise ValueError(
                f"{where} has {num_tokens} tokens, more than this pipeline encodes ({limit}, its `max_prompt_tokens` "
                f"or the text encoder's `max_position_embeddings`): shorten it, or load the pipeline with "
                f"`max_prompt_tokens={num_tokens}` (a longer prompt costs text-encoder and attention time)."
            )


def check_prompt(prompt) -> None:
    if prompt is None:
        raise ValueError(
            "`prompt` must be a string (or a list of strings), got None: pass a prompt, or `prompt_embeds` and "
            "`text_token_tags` from `encode_prompt`."
        )
    prompts = prompt if isinstance(prompt, (list, tuple)) else [prompt]
    if not prompts:
        raise ValueError("`prompt` is an empty list: pass a non-empty string or a list of them.")
    for i, text in enumerate(prompts):
        where = f"`prompt[{i}]`" if isinstance(prompt, (list, tuple)) else "`prompt`"
        if isinstance(text, (bytes, bytearray)):
            raise ValueError(f"{where} must be a string, got {type(text).__name__}: decode it, e.g. `.decode('utf-8')`.")
        if not isinstance(text, str):
            raise ValueError(f"{where} must be a string (or `prompt` a list of strings), got {type(text).__name__}.")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:  # undecodable bytes reach Python as lone surrogates (PEP 383)
            raise ValueError(
                f"{where} is not valid UTF-8 text (the lone surrogate {text[error.start]!a} at character {error.start}, "
                "left by bytes that were not UTF-8): decode the text as UTF-8."
            ) from None
        if not text.strip():
            raise ValueError(
                f"{where} is empty: MiniMax-H3 needs a text description of the clip (any language), e.g. "
                "'A red fox runs through fresh snow'."
            )


def check_text_encoder_loaded(config: RequestConfig, alternative: str) -> None:
    missing = config.missing_text_components
    if missing:
        raise ValueError(
            f"This pipeline was loaded without {', '.join(f'`{name}`' for name in missing)}, so it cannot encode "
            f"a prompt: {alternative}."
        )


def check_prompt_embeds(config: RequestConfig, spec: TaskSpec, prompt_embeds, text_token_tags) -> None:
    """`prompt_embeds` `(batch, num_tokens, text_dim)` and its `text_token_tags` `(num_tokens,)` as `encode_prompt`
    returns them (a batch stacks prompts encoded to the same length), encoded for this request's task."""
    if not isinstance(prompt_embeds, torch.Tensor) or prompt_embeds.ndim != 3 or 0 in prompt_embeds.shape[:2]:
        is_tensor = isinstance(prompt_embeds, torch.Tensor)
        got = tuple(prompt_embeds.shape) if is_tensor else type(prompt_embeds).__name__
        raise ValueError(
            f"`prompt_embeds` must be a (batch, num_tokens, text_dim) tensor as `encode_prompt` returns it, got {got}."
        )
    text_dim = config.text_dims.get(spec.partition, prompt_embeds.shape[2])
    if prompt_embeds.shape[2] != text_dim:
        raise ValueError(
            f"`prompt_embeds` has width {prompt_embeds.shape[2]} but the `{spec.partition}` reads {text_dim}: "
            "encode the prompt with this checkpoint's text encoder (`encode_prompt`)."
        )
    num_tokens = prompt_embeds.shape[1]
    if (
        not isinstance(text_token_tags, torch.Tensor)
        or text_token_tags.shape != (num_tokens,)
        or text_token_tags.is_floating_point()
    ):
        got = tuple(text_token_tags.shape) if isinstance(text_token_tags, torch.Tensor) else text_token_tags
        raise ValueError(
            f"`prompt_embeds` needs its `text_token_tags`: an integer tensor of shape ({num_tokens},) as "
            f"`encode_prompt` returns with it, got {got}."
        )
    tags = set(text_token_tags.tolist())
    if not tags <= {MINIMAX_H3_TEXT_TAG, MINIMAX_H3_VIDEO_TAG}:
        raise ValueError(
            f"`text_token_tags` holds {sorted(tags)}; a prompt's rows are tagged text ({MINIMAX_H3_TEXT_TAG}) or "
            f"vision ({MINIMAX_H3_VIDEO_TAG}): pass the tags `encode_prompt` returned."
        )
    has_vision = MINIMAX_H3_VIDEO_TAG in tags
    if has_vision != bool(spec.conditioning_inputs):
        encoded_for = "a conditioned task (fl2va / ref2va)" if has_vision else "t2va (no conditioning)"
        raise ValueError(
            f"`prompt_embeds` were encoded for {encoded_for} but this request is {spec.name}: encode them with "
            "the same `image` / `last_image` / `references` (and canvas) you pass to the pipeline."
        )


def check_canvas(config: RequestConfig, height, width) -> None:
    if (height is None) != (width is None):
        raise ValueError("`height` and `width` have to be passed together, or neither of them.")
    if height is None:
        return
    for name, value in (("height", height), ("width", width)):
        if not _is_int(value):
            raise ValueError(f"`{name}` must be an int (pixels), got {value!r}.")
    multiple = config.canvas_multiple
    if height <= 0 or width <= 0 or height % multiple or width % multiple:
        raise ValueError(
            f"`height` and `width` must be positive multiples of {multiple}, got height={height}, "
            f"width={width}; for example height={max(multiple, round(height / multiple) * multiple)}, "
            f"width={max(multiple, round(width / multiple) * multiple)}."
        )
    ratio = width / height
    if not MINIMAX_H3_MIN_ASPECT_RATIO <= ratio <= MINIMAX_H3_MAX_ASPECT_RATIO:
        raise ValueError(
            f"MiniMax-H3 supports aspect ratios from 1:4 to 4:1 (width:height), got height={height}, "
            f"width={width} ({ratio:.3g}:1)."
        )
    limit = config.max_canvas_pixels
    if height * width > limit:
        raise ValueError(
            f"The canvas height={height}, width={width} has {height * width:,} pixels, more than this pipeline "
            f"generates ({limit:,}, its `max_canvas_pixels`; the released model is trained up to 1080p, 1920x1088): "
            f"pass a smaller canvas, e.g. height=768, width=1344, or load the pipeline with `max_canvas_pixels=N`."
        )


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_finite_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _check_sigmas(name: str, sigmas) -> None:
    """`sigmas` as the scheduler uses it verbatim: 2 to `MAX_INFERENCE_STEPS` finite values in [0, 1], strictly
    decreasing in float32 (the scheduler's precision), ending at 0. A NaN or inf would run and return NaN frames."""
    if isinstance(sigmas, torch.Tensor):
        values = sigmas.detach().flatten().cpu().tolist() if sigmas.ndim == 1 and sigmas.is_floating_point() else None
    else:
        if hasattr(sigmas, "tolist") and getattr(sigmas, "ndim", None) == 1:  # a 1-D NumPy array
            sigmas = sigmas.tolist()
        is_sequence = isinstance(sigmas, Sequence) and not isinstance(sigmas, (str, bytes))
        numbers_only = is_sequence and all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in sigmas)
        values = [float(v) for v in sigmas] if numbers_only else None
    if values is None:
        got = repr(sigmas) if len(repr(sigmas)) <= 80 else f"a {type(sigmas).__name__}"
        raise ValueError(f"`{name}` must be a list of numbers (or a 1-D float tensor or array), got {got}.")
    bad = [v for v in values if not (math.isfinite(v) and 0.0 <= v <= 1.0)]
    if bad:
        raise ValueError(f"`{name}` must hold finite values in [0, 1] (rectified-flow noise levels), got {bad[0]!r}.")
    as_float32 = torch.tensor(values, dtype=torch.float32)
    decreasing = bool((as_float32[1:] < as_float32[:-1]).all())
    if not 2 <= len(values) <= MAX_INFERENCE_STEPS or not decreasing or values[-1] != 0.0:
        raise ValueError(
            f"`{name}` must hold 2 to {MAX_INFERENCE_STEPS} strictly decreasing values (in float32) ending at 0.0, "
            f"got {values if len(values) <= 8 else f'{len(values)} values'}."
        )


def check_schedule(num_inference_steps, sigmas, audio_sigmas, flow_shift, audio_flow_shift) -> None:
    """The schedule settings of a call (`None`: unset), before any model runs."""
    if num_inference_steps is not None and not (
        _is_int(num_inference_steps) and 2 <= num_inference_steps <= MAX_INFERENCE_STEPS
    ):
        raise ValueError(
            f"`num_inference_steps` must be an int from 2 to {MAX_INFERENCE_STEPS} (sigma grid points, the final 0 "
            f"included; the model is distilled for 50), got {num_inference_steps!r}."
        )
    for name, value in (("sigmas", sigmas), ("audio_sigmas", audio_sigmas)):
        if value is not None:
            _check_sigmas(name, value)
    if audio_sigmas is not None and sigmas is None:
        raise ValueError("`audio_sigmas` needs `sigmas` too (both schedules must have the same number of steps).")
    if sigmas is not None and audio_sigmas is not None and len(sigmas) != len(audio_sigmas):
        raise ValueError(
            f"`sigmas` ({len(sigmas)} points) and `audio_sigmas` ({len(audio_sigmas)} points) must be the same length."
        )
    for name, value in (("flow_shift", flow_shift), ("audio_flow_shift", audio_flow_shift)):
        if value is not None and not (_is_finite_number(value) and value > 0):
            raise ValueError(
                f"`{name}` must be a finite number above 0 (the sigma shift; the schedulers' defaults are 12 for video "
                f"and 3 for audio), got {value!r}."
            )


def check_noise(latents, audio_latents) -> None:
    """Initial noise, when given: finite float tensors of the right rank (the row count is checked against the
    request's layout once it is built)."""
    for name, value, shape in (
        ("latents", latents, "(batch, channels, latent_frames, h, w)"),
        ("audio_latents", audio_latents, "(2 * batch, channels, num_latents)"),
    ):
        if value is None:
            continue
        rank = shape.count(",") + 1
        if not isinstance(value, torch.Tensor) or value.ndim != rank or not value.is_floating_point():
            got = f"a {value.ndim}-D {value.dtype} tensor" if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"`{name}` must be a float tensor {shape}, got {got}.")
        if not bool(torch.isfinite(value).all()):
            raise ValueError(f"`{name}` holds NaN or inf values: pass finite noise (e.g. from `torch.randn`).")


def check_attention_kwargs(attention_kwargs) -> None:
    if attention_kwargs is None:
        return
    if not isinstance(attention_kwargs, Mapping):
        raise ValueError(f"`attention_kwargs` must be a dict, got {type(attention_kwargs).__name__}.")
    scale = attention_kwargs.get("scale")
    if scale is not None and not _is_finite_number(scale):
        raise ValueError(f"`attention_kwargs['scale']` (the LoRA weight) must be a finite number, got {scale!r}.")


# The pipeline's typed settings (its config), checked when a pipeline is built or loaded: a wrong type would otherwise
# surface as a bare TypeError in the middle of a call.
_POSITIVE_INT_SETTINGS = (
    "text_encoder_layer", "canvas_short_edge", "canvas_max_pixels", "reference_image_short_edge", "max_prompt_tokens",
    "max_canvas_pixels",
)  # fmt: skip
_POSITIVE_NUMBER_SETTINGS = ("min_duration_s", "max_duration_s")


def check_pipeline_settings(**settings) -> None:
    """The pipeline's config values (`text_encoder_layer=...`, ...): positive ints / finite positive numbers."""
    for name, value in settings.items():
        if name in _POSITIVE_INT_SETTINGS and not (_is_int(value) and value > 0):
            raise ValueError(f"`{name}` (a MiniMaxH3Pipeline setting) must be a positive int, got {value!r}.")
        if name in _POSITIVE_NUMBER_SETTINGS and not (_is_finite_number(value) and value > 0):
            raise ValueError(f"`{name}` (a MiniMaxH3Pipeline setting) must be a finite number above 0, got {value!r}.")
    canvas, limit = settings.get("canvas_max_pixels"), settings.get("max_canvas_pixels")
    if canvas is not None and limit is not None and canvas > limit:
        raise ValueError(
            f"`canvas_max_pixels`={canvas} (the default canvas) is above `max_canvas_pixels`={limit} (the largest "
            "canvas a request may ask for): raise `max_canvas_pixels` or lower the default canvas."
        )


def frame_range(config: RequestConfig) -> Tuple[int, int]:
    """The smallest and largest aligned (17n+5) frame counts within the config's duration range (the recommended
    range: what the model was trained for)."""
    per_chunk, kept = config.vae_frames_per_chunk, config.vae_latents_per_chunk
    low = align_num_frames(max(1, math.ceil(config.min_duration_s * MINIMAX_H3_FPS)), per_chunk, kept)
    high = kept + (int(config.max_duration_s * MINIMAX_H3_FPS) - kept) // per_chunk * per_chunk
    return low, high


def shortest_clip(config: RequestConfig) -> int:
    """The fewest frames any request may ask for: one whole VAE chunk (17 + 5 frames for the released model)."""
    return config.vae_frames_per_chunk + config.vae_latents_per_chunk


# Durations already warned about in this process (the CLI checks a request before the pipeline builds it again).
_WARNED_DURATIONS = set()


def _duration_refusal(config: RequestConfig, num_frames: int, aligned: int, why: str) -> ValueError:
    first, last = frame_range(config)
    # Counts above the aligned count below `first` round up to `first` or more.
    lowest = max(1, first - config.vae_frames_per_chunk + 1)
    return ValueError(
        f"MiniMax-H3 generates {config.min_duration_s:g}–{config.max_duration_s:g} s at {MINIMAX_H3_FPS} fps{why}; "
        f"`num_frames`={num_frames} rounds up to {aligned} frames (17n+5) = {aligned / MINIMAX_H3_FPS:.2f} s. Pass "
        f"{lowest} to {last} frames (they round up to {first}–{last}: {first / MINIMAX_H3_FPS:.1f}–"
        f"{last / MINIMAX_H3_FPS:.1f} s), e.g. {first} ({first / MINIMAX_H3_FPS:.1f} s) or {last} "
        f"({last / MINIMAX_H3_FPS:.1f} s)."
    )


def align_frames(config: RequestConfig, num_frames, strict_duration: Optional[bool] = None) -> int:
    """`num_frames` rounded up to the VAE's 17n+5, checked against the duration rule.

    The config's `min_duration_s`–`max_duration_s` is the recommended range (what the model was trained for). A clip
    outside it, from one VAE chunk (:func:`shortest_clip`) up, is generated after one warning (once per duration per
    process); with `strict_duration` (default: `config.strict_duration`) it is refused instead. Fewer frames than
    one chunk are always refused. How long a clip memory allows is the memory recipe's question, not this one's.
    """
    if not isinstance(num_frames, int) or isinstance(num_frames, bool) or num_frames < 1:
        raise ValueError(f"`num_frames` must be a positive int, got {num_frames!r}.")
    strict = config.strict_duration if strict_duration is None else bool(strict_duration)
    aligned = align_num_frames(num_frames, config.vae_frames_per_chunk, config.vae_latents_per_chunk)
    duration = aligned / MINIMAX_H3_FPS
    low_s, high_s = config.min_duration_s, config.max_duration_s
    if aligned < shortest_clip(config):
        first, last = frame_range(config)
        raise ValueError(
            f"`num_frames`={num_frames} rounds up to {aligned} frames (17n+5) = {duration:.2f} s, less than one VAE "
            f"chunk: MiniMax-H3 generates at least {shortest_clip(config)} frames "
            f"({shortest_clip(config) / MINIMAX_H3_FPS:.1f} s) at {MINIMAX_H3_FPS} fps and recommends {low_s:g}–"
            f"{high_s:g} s ({first}–{last} frames). Pass {shortest_clip(config)} frames or more, e.g. {first} "
            f"({first / MINIMAX_H3_FPS:.1f} s)."
        )
    if not low_s <= duration <= high_s:
        if strict:
            raise _duration_refusal(config, num_frames, aligned, " (`strict_duration=True`)")
        key = (aligned, low_s, high_s)
        if key not in _WARNED_DURATIONS:
            _WARNED_DURATIONS.add(key)
            first, last = frame_range(config)
            logger.warning(
                f"`num_frames`={num_frames} gives {aligned} frames = {duration:.2f} s, outside the {low_s:g}–{high_s:g} "
                f"s ({first}–{last} frames) MiniMax-H3 was trained for: generating anyway; motion, audio sync and "
                "prompt following may degrade. Pass `strict_duration=True` (command line: --strict-duration) to refuse such "
                "requests instead."
            )
    if aligned != num_frames:
        logger.warning(f"`num_frames` has to be of the form 17n+5 for the video VAE; rounding {num_frames} up to {aligned}.")
    return aligned


def check_inputs(
    config: RequestConfig,
    task,
    *,
    prompt,
    height,
    width,
    num_frames,
    conditioning,
    output_type="np",
    callback_on_step_end=None,
    callback_on_step_end_tensor_inputs=None,
    num_inference_steps=None,
    sigmas=None,
    audio_sigmas=None,
    flow_shift=None,
    audio_flow_shift=None,
    latents=None,
    audio_latents=None,
    prompt_embeds=None,
    text_token_tags=None,
    attention_kwargs=None,
    strict_duration: Optional[bool] = None,
) -> int:
    """Validate a request of `MiniMaxH3Pipeline.__call__` (its arguments, by keyword) against `config` before any
    model runs; returns the aligned frame count. `task` is a task name or `TaskSpec`; `conditioning` maps the
    conditioning inputs (`image`, `last_image`, `references`) to their values, which the task's spec checks;
    `strict_duration` (default: the config's): :func:`align_frames`.

    The one check of a request: `H3Request.build` runs it, for `__call__` and for the CLI (on the configs of a
    checkpoint folder, before loading)."""
    spec = get_task(task) if isinstance(task, str) else task
    if prompt is not None and prompt_embeds is not None:
        raise ValueError(
            "Pass either `prompt` or `prompt_embeds` (with `text_token_tags`), not both: the embeddings already "
            "hold the encoded prompt."
        )
    if prompt_embeds is None and text_token_tags is not None:
        raise ValueError("`text_token_tags` belongs to `prompt_embeds`: pass both, as `encode_prompt` returns.")
    if prompt_embeds is not None:
        check_prompt_embeds(config, spec, prompt_embeds, text_token_tags)
    else:
        check_prompt(prompt)
        check_text_encoder_loaded(config, "pass `prompt_embeds` and `text_token_tags` from `encode_prompt` instead")
        check_prompt_tokens(config, prompt)
    if output_type not in OUTPUT_TYPES:
        raise ValueError(f"`output_type` must be one of {OUTPUT_TYPES}, got {output_type!r}.")
    partition = spec.partition
    if partition not in config.text_dims:
        loaded = list(config.text_dims) or ["none"]
        raise ValueError(
            f"Task {spec.name!r} runs on the `{partition}` partition, but this pipeline holds {', '.join(loaded)}. "
            f"Load it with `MiniMaxH3Pipeline.from_pretrained(..., task={spec.name!r})` or pass `{partition}=...`."
        )
    check_canvas(config, height, width)
    aligned = align_frames(config, num_frames, strict_duration)
    spec.check_conditions(conditioning)
    if callback_on_step_end is not None and not callable(callback_on_step_end):
        raise ValueError(f"`callback_on_step_end` must be callable, got {type(callback_on_step_end).__name__}.")
    if callback_on_step_end_tensor_inputs is not None:
        unknown = [k for k in callback_on_step_end_tensor_inputs if k not in config.callback_tensor_inputs]
        if unknown:
            raise ValueError(
                f"`callback_on_step_end_tensor_inputs` has {unknown}; allowed: {list(config.callback_tensor_inputs)}."
            )
    check_schedule(num_inference_steps, sigmas, audio_sigmas, flow_shift, audio_flow_shift)
    check_noise(latents, audio_latents)
    check_attention_kwargs(attention_kwargs)
    return aligned


def latent_geometry(config: RequestConfig, num_frames: int, height: int, width: int) -> LatentGeometry:
    """The latent grid of an aligned `num_frames` clip on a `height` x `width` canvas."""
    ratio = config.vae_spatial_compression_ratio
    return LatentGeometry(
        num_latent_frames=video_latent_num_frames(num_frames, config.vae_frames_per_chunk, config.vae_latents_per_chunk),
        latent_height=height // ratio,
        latent_width=width // ratio,
        num_audio_latents=audio_latent_num_frames(num_frames),
        patch_size=tuple(config.patch_size),
    )


def split_batch(batch_size: int, generator, latents, audio_latents):
    """`(generator, latents, audio_latents)` per clip; one shared generator advances from clip to clip."""
    for i, item in enumerate(generator if isinstance(generator, (list, tuple)) else [generator]):
        if item is not None and not isinstance(item, torch.Generator):
            where = f"`generator[{i}]`" if isinstance(generator, (list, tuple)) else "`generator`"
            raise ValueError(
                f"{where} must be a torch.Generator (or `generator` a list of them, one per clip), got "
                f"{type(item).__name__}: pass e.g. torch.Generator().manual_seed(0)."
            )
    if isinstance(generator, (list, tuple)):
        if len(generator) != batch_size:
            raise ValueError(
                f"`generator` is a list of {len(generator)} generators but the batch has {batch_size} clips "
                "(prompts x num_videos_per_prompt): pass one generator per clip, or a single generator."
            )
        generators = list(generator)
    else:
        generators = [generator] * batch_size
    if batch_size == 1:
        return [(generators[0], latents, audio_latents)]
    if latents is not None and latents.shape[0] != batch_size:
        raise ValueError(
            f"`latents` has batch {latents.shape[0]} but the batch has {batch_size} clips: pass "
            f"({batch_size}, C, latent_frames, h, w)."
        )
    if audio_latents is not None and audio_latents.shape[0] != 2 * batch_size:
        raise ValueError(
            f"`audio_latents` has {audio_latents.shape[0]} items but {batch_size} stereo clips need "
            f"{2 * batch_size} (a left/right pair per clip): pass ({2 * batch_size}, C, num_latents)."
        )
    return [
        (
            generators[i],
            latents[i : i + 1] if latents is not None else None,
            audio_latents[2 * i : 2 * i + 2] if audio_latents is not None else None,
        )
        for i in range(batch_size)
    ]


@dataclasses.dataclass(frozen=True)
class ScheduleSettings:
    """The schedule arguments of a call (`None`: unset), as `__call__` and `H3Request.build` take them."""

    num_inference_steps: Optional[int] = None
    sigmas: Optional[Sequence[float]] = None
    audio_sigmas: Optional[Sequence[float]] = None
    flow_shift: Optional[float] = None
    audio_flow_shift: Optional[float] = None

    def as_kwargs(self) -> dict:
        """The settings as keyword arguments of `H3Request.build` (the values themselves, not copies)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True, eq=False)
class H3Clip:
    r"""
    One clip of a request: H3 packs one clip into one sequence, so a batch runs clip after clip.

    Args:
        prompt (`str`, *optional*): The prompt to encode, or `None` when the clip brings `prompt_embeds`.
        prompt_embeds (`torch.Tensor`, *optional*): `(1, num_tokens, text_dim)`, one row of the call's embeddings.
        text_token_tags (`torch.Tensor`, *optional*): Their row tags.
        generator (`torch.Generator`, *optional*): The clip's generator (one shared generator is every clip's).
        latents (`torch.Tensor`, *optional*): The clip's video noise `(1, C, latent_frames, h, w)`.
        audio_latents (`torch.Tensor`, *optional*): The clip's audio noise, a left/right pair `(2, C, n)`.
    """

    prompt: Optional[str] = None
    prompt_embeds: Optional[torch.Tensor] = None
    text_token_tags: Optional[torch.Tensor] = None
    generator: Optional[torch.Generator] = None
    latents: Optional[torch.Tensor] = None
    audio_latents: Optional[torch.Tensor] = None


@dataclasses.dataclass(frozen=True, eq=False)
class H3Request:
    r"""
    One checked call of `MiniMaxH3Pipeline`: everything the generation reads besides the weights.

    Build it with `H3Request.build(config, prompt=..., ...)` (the arguments of `__call__`, by keyword); it is
    immutable, so one request can run on any pipeline with the same configs, from any thread.

    Args:
        spec (`TaskSpec`): The routed task.
        conditioning (`Mapping[str, Any]`): `image`, `last_image`, `references` as passed (read-only).
        height, width (`int`): The canvas, resolved (the default canvas rule, or the first keyframe's aspect).
        num_frames (`int`): The aligned (17n+5) frame count.
        geometry (`LatentGeometry`): The latent grid of every clip.
        num_inference_steps (`int`), sigmas, audio_sigmas, flow_shift, audio_flow_shift: The schedule settings.
        clips (`tuple[H3Clip]`): Prompt (or embeddings), generator and noise per clip, in output order.
        output_type (`str`), attention_kwargs, callback_on_step_end, callback_on_step_end_tensor_inputs: As passed
            (a `PipelineCallback`'s own `tensor_inputs` replace the last).
    """

    spec: TaskSpec
    conditioning: Mapping[str, Any]
    height: int
    width: int
    num_frames: int
    geometry: LatentGeometry
    num_inference_steps: int
    sigmas: Optional[Sequence[float]]
    audio_sigmas: Optional[Sequence[float]]
    flow_shift: Optional[float]
    audio_flow_shift: Optional[float]
    clips: Tuple[H3Clip, ...]
    output_type: str = "np"
    attention_kwargs: Optional[Mapping[str, Any]] = None
    callback_on_step_end: Optional[Callable] = None
    callback_on_step_end_tensor_inputs: Tuple[str, ...] = ("latents",)

    @property
    def task(self) -> str:
        return self.spec.name

    @classmethod
    def build(
        cls,
        config: RequestConfig,
        *,
        prompt: Union[str, Sequence[str], None] = None,
        image=None,
        last_image=None,
        references=None,
        height: Optional[int] = None,
        width: Optional[int] = None,
        num_frames: int = 124,
        num_inference_steps: Optional[int] = None,
        sigmas: Optional[Sequence[float]] = None,
        audio_sigmas: Optional[Sequence[float]] = None,
        flow_shift: Optional[float] = None,
        audio_flow_shift: Optional[float] = None,
        num_videos_per_prompt: int = 1,
        generator=None,
        latents: Optional[torch.Tensor] = None,
        audio_latents: Optional[torch.Tensor] = None,
        prompt_embeds: Optional[torch.Tensor] = None,
        text_token_tags: Optional[torch.Tensor] = None,
        output_type: str = "np",
        attention_kwargs: Optional[Mapping[str, Any]] = None,
        callback_on_step_end: Optional[Callable] = None,
        callback_on_step_end_tensor_inputs: Sequence[str] = ("latents",),
        task: Optional[Union[str, TaskSpec]] = None,
        strict_duration: Optional[bool] = None,
    ) -> "H3Request":
        """Check the arguments of `__call__` against `config` and build the request (no model runs). `task` (a name
        or spec) skips routing when the caller already routed the conditioning inputs; `strict_duration` (default:
        the config's) refuses a clip outside the recommended durations instead of warning (:func:`align_frames`)."""
        if isinstance(callback_on_step_end, (PipelineCallback, MultiPipelineCallbacks)):
            callback_on_step_end_tensor_inputs = callback_on_step_end.tensor_inputs
        conditioning = {"image": image, "last_image": last_image, "references": references}
        if task is None:
            task = select_task(**conditioning)
        spec = get_task(task) if isinstance(task, str) else task
        if num_inference_steps is None:
            num_inference_steps = DEFAULT_NUM_INFERENCE_STEPS
        num_frames = check_inputs(
            config, spec, prompt=prompt, height=height, width=width, num_frames=num_frames, conditioning=conditioning,
            output_type=output_type, callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            num_inference_steps=num_inference_steps, sigmas=sigmas, audio_sigmas=audio_sigmas, flow_shift=flow_shift,
            audio_flow_shift=audio_flow_shift, latents=latents, audio_latents=audio_latents,
            prompt_embeds=prompt_embeds, text_token_tags=text_token_tags, attention_kwargs=attention_kwargs,
            strict_duration=strict_duration,
        )  # fmt: skip
        count = num_videos_per_prompt
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ValueError(f"`num_videos_per_prompt` must be a positive int, got {num_videos_per_prompt!r}.")
        # Per clip: the prompt to encode, or the given embeddings (one row of `prompt_embeds`) and their tags.
        if prompt_embeds is None:
            encoded = [(text, None, None) for text in ([prompt] if isinstance(prompt, str) else prompt)]
        else:
            encoded = [(None, row[None], text_token_tags) for row in prompt_embeds]
        encoded = [entry for entry in encoded for _ in range(num_videos_per_prompt)]
        noise = split_batch(len(encoded), generator, latents, audio_latents)
        clips = tuple(H3Clip(*entry, *clip_noise) for entry, clip_noise in zip(encoded, noise))
        height, width = spec.resolve_canvas(conditioning, height, width, config.canvas_multiple, config.canvas_rule)
        return cls(
            spec=spec,
            conditioning=types.MappingProxyType(conditioning),
            height=height,
            width=width,
            num_frames=num_frames,
            geometry=latent_geometry(config, num_frames, height, width),
            num_inference_steps=num_inference_steps,
            sigmas=sigmas,
            audio_sigmas=audio_sigmas,
            flow_shift=flow_shift,
            audio_flow_shift=audio_flow_shift,
            clips=clips,
            output_type=output_type,
            attention_kwargs=attention_kwargs,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=tuple(callback_on_step_end_tensor_inputs or ()),
        )


def memory_shape(request: H3Request, lora_rank: int = 0, max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS):
    """The memory model's `RequestShape` of `request`: its task, canvas, frames, references and keyframes, `lora_rank`,
    and its text rows: the given embeddings' length, else the longest prompt's UTF-8 bytes (the tokenizer is
    byte-level: a token holds at least one byte), at most `max_prompt_tokens`."""
    from ..parallel.memory_model import RequestShape

    rows = [
        clip.prompt_embeds.shape[1] if clip.prompt_embeds is not None else len(clip.prompt.encode("utf-8"))
        for clip in request.clips
    ]
    kinds = [reference.kind for reference in (request.conditioning.get("references") or ())]
    keyframes = sum(request.conditioning.get(name) is not None for name in ("image", "last_image"))
    return RequestShape(task=request.task, height=request.height, width=request.width, num_frames=request.num_frames,
                        prompt_tokens=max(1, min(max(rows), int(max_prompt_tokens))),
                        reference_images=kinds.count("image"), reference_videos=kinds.count("video"),
                        lora_rank=int(lora_rank), keyframes=keyframes or None)  # fmt: skip

