"""Pass 1 of LoRA training: encode the data folder once, one model at a time, into a cache on disk.

The text encoder (Qwen3-VL, the largest component after the DiT), the video VAE and the audio VAE never co-reside
with each other or with the DiT: each is loaded, encodes every sample, and is freed before the next loads. Pass 2
(:mod:`~diffusers_h3.training.trainer`) then loads only the DiT and reads the cache.

Layout of the cache folder::

    cache.json              the settings it was encoded with and the samples it holds
    text/00000.safetensors  prompt_embeds (1, tokens, hidden), text_token_tags (tokens,)  — as encode_prompt returns
    video/00000.safetensors latents (1, C, frames, h, w), normalized; fl2va: keyframe_first / keyframe_last latents
    audio/00000.safetensors latents (2, C, n), normalized (left / right), as the pipeline's audio latents
    validation/<hash>.safetensors  a validation prompt's embeddings (fl2va: presented with the first clip's keyframes)
    uncond/00000.safetensors  the " " probe prompt's embeddings (guidance distillation), presented like the sample

Each file is written atomically (a temporary name, then a rename), and a pass whose files all exist is skipped, so an
interrupted encode resumes where it stopped, and a run with new validation prompts or with guidance distillation
encodes only what it adds. A cache built from other data or settings (model, task, canvas, frames) is refused in one
line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
from diffusers.training_utils import free_memory
from safetensors.torch import load_file, save_file

from .data import DataItem, decode_sample


logger = logging.getLogger(__name__)

CACHE_VERSION = 1
# The probe prompt of the guidance-distillation target's unconditional prediction: H3 is guidance-distilled and has no
# negative prompt, so the "unconditional" branch is the model's answer to an (almost) empty prompt.
UNCOND_PROMPT = " "


@dataclasses.dataclass(frozen=True)
class CacheSettings:
    """What the cached tensors depend on; a cache is reused only under the same settings."""

    model: str
    task: str
    height: int
    width: int
    num_frames: int
    validation_prompts: tuple = ()
    uncond: bool = False

    def as_dict(self) -> Dict:
        """What the cached sample tensors depend on (validation and probe prompts only add files)."""
        return {key: getattr(self, key) for key in ("model", "task", "height", "width", "num_frames")}


class CacheError(ValueError):
    """The cache folder holds tensors encoded with other settings."""


def _atomic_save(tensors: Dict[str, torch.Tensor], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(temporary))
    os.replace(temporary, path)


def _sample_file(cache_dir: Path, kind: str, index: int) -> Path:
    return cache_dir / kind / f"{index:05d}.safetensors"


def _keyframes(frames) -> Dict[str, object]:
    """An fl2va sample's conditioning: its first and last frames as PIL images (already on the canvas)."""
    from PIL import Image

    return {"image": Image.fromarray(frames[0]), "last_image": Image.fromarray(frames[-1])}


def _load_pipeline(model: str, keep: Sequence[str], task: str, dtype: Optional[torch.dtype], device, **kwargs):
    """The pipeline with only the components in `keep` (the others `None`), moved to `device`."""
    from ..pipelines.pipeline_minimax_h3 import MiniMaxH3Pipeline

    optional = ("text_encoder", "tokenizer", "processor", "vae", "audio_vae", "transformer", "transformer_ref")
    skipped = {name: None for name in optional if name not in keep}
    extra = {"dtype": dtype} if dtype is not None else {}
    pipe = MiniMaxH3Pipeline.from_pretrained(model, task=task, **skipped, **extra, **kwargs)
    for name in keep:
        component = getattr(pipe, name, None)
        if isinstance(component, torch.nn.Module):
            component.to(device)
    return pipe


class LatentCache:
    """The encoded samples of a data folder (see the module docstring for the layout)."""

    def __init__(self, cache_dir, settings: CacheSettings, items: Sequence[DataItem]):
        self.cache_dir = Path(cache_dir)
        self.settings = settings
        self.items = list(items)

    # -- reading -----------------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.items)

    def sample(self, index: int) -> Dict[str, torch.Tensor]:
        """Everything cached for sample `index`: text, video and audio tensors (and the probe prompt's embeddings)."""
        tensors = {}
        for kind in ("text", "video", "audio"):
            for name, value in load_file(str(_sample_file(self.cache_dir, kind, index))).items():
                tensors[name if kind != "audio" else "audio_latents"] = value
        if self.settings.uncond:
            uncond = load_file(str(_sample_file(self.cache_dir, "uncond", index)))
            tensors["uncond_prompt_embeds"] = uncond["prompt_embeds"]
            tensors["uncond_text_token_tags"] = uncond["text_token_tags"]
        tensors["is_image"] = torch.tensor(self.items[index].kind == "image")
        return tensors

    def _validation_file(self, prompt: str) -> Path:
        return self.cache_dir / "validation" / f"{hashlib.sha1(prompt.encode()).hexdigest()[:16]}.safetensors"

    def validation(self, index: int) -> Dict[str, torch.Tensor]:
        return load_file(str(self._validation_file(self.settings.validation_prompts[index])))

    def validation_conditioning(self) -> Dict[str, object]:
        """The keyframes fl2va validation clips start and end on: the first training clip's (none for t2va)."""
        video = next((item for item in self.items if item.kind == "video"), None)
        return self._conditioning(video) if video is not None else {}

    # -- writing -----------------------------------------------------------------------------------------------------
    def check_or_write_settings(self) -> None:
        """Write `cache.json`, or refuse a folder encoded with other settings."""
        index = self.cache_dir / "cache.json"
        record = {"version": CACHE_VERSION, "settings": self.settings.as_dict(),
                  "samples": [{"file_name": item.name, "text": item.caption, "kind": item.kind} for item in self.items]}  # fmt: skip
        if index.is_file():
            stored = json.loads(index.read_text())
            if stored != record:
                raise CacheError(
                    f"cache folder {self.cache_dir} holds tensors encoded from other settings or data "
                    f"({_difference(stored, record)}) — pass an empty --cache-dir or delete that folder."
                )
            return
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        temporary = index.with_name("cache.json.tmp")
        temporary.write_text(json.dumps(record, indent=2))
        os.replace(temporary, index)

    def _missing(self, kind: str) -> List[int]:
        return [i for i in range(len(self.items)) if not _sample_file(self.cache_dir, kind, i).is_file()]

    def encode(self, device="cpu", dtype: Optional[torch.dtype] = None, text_encoder_quantization=None) -> None:
        """Encode whatever is missing: captions (and validation / probe prompts) with the text encoder, then video
        latents with the video VAE, then audio latents with the audio VAE, each model freed before the next loads."""
        self.check_or_write_settings()
        settings = self.settings
        missing_validation = [
            j for j, prompt in enumerate(settings.validation_prompts) if not self._validation_file(prompt).is_file()
        ]
        missing_uncond = self._missing("uncond") if settings.uncond else []
        if self._missing("text") or missing_validation or missing_uncond:
            kwargs = {}
            if text_encoder_quantization is not None:
                from diffusers.quantizers import PipelineQuantizationConfig

                kwargs["quantization_config"] = PipelineQuantizationConfig(
                    quant_mapping={"text_encoder": text_encoder_quantization}
                )
            pipe = _load_pipeline(settings.model, ("text_encoder", "tokenizer", "processor"), settings.task, dtype,
                                  device, **kwargs)  # fmt: skip
            self._encode_text(pipe, self._missing("text"), missing_validation, missing_uncond)
            del pipe
            free_memory()
        for kind, component, encode in (("video", "vae", self._encode_video), ("audio", "audio_vae", self._encode_audio)):
            missing = self._missing(kind)
            if missing:
                pipe = _load_pipeline(settings.model, (component,), settings.task, dtype, device)
                encode(pipe, missing)
                del pipe
                free_memory()

    def _decode(self, item: DataItem, sampling_rate: int = 32000):
        s = self.settings
        return decode_sample(item, s.num_frames if item.kind == "video" else 1, s.height, s.width, sampling_rate)

    def _conditioning(self, item: DataItem) -> Dict[str, object]:
        if self.settings.task != "fl2va" or item.kind == "image":  # an image trains as a one-frame t2va sample
            return {}
        return _keyframes(self._decode(item).frames)

    def _encode_text(self, pipe, indices, validation_indices, uncond_indices) -> None:
        s = self.settings
        geometry = {"height": s.height, "width": s.width, "num_frames": s.num_frames}
        for index in indices:
            item = self.items[index]
            embeds, tags = pipe.encode_prompt(item.caption, **self._conditioning(item), **geometry)
            _atomic_save({"prompt_embeds": embeds, "text_token_tags": tags}, _sample_file(self.cache_dir, "text", index))
            logger.info("encoded caption %d/%d (%s)", index + 1, len(self.items), item.name)
        for index in uncond_indices:
            embeds, tags = _encode_probe(pipe, self._conditioning(self.items[index]), geometry)
            _atomic_save({"prompt_embeds": embeds, "text_token_tags": tags}, _sample_file(self.cache_dir, "uncond", index))
        conditioning = self.validation_conditioning() if validation_indices else {}
        for j in validation_indices:
            embeds, tags = pipe.encode_prompt(s.validation_prompts[j], **conditioning, **geometry)
            _atomic_save({"prompt_embeds": embeds, "text_token_tags": tags},
                         self._validation_file(s.validation_prompts[j]))  # fmt: skip

    def _encode_video(self, pipe, indices) -> None:
        from ..tasks import get_task

        spec = get_task(self.settings.task)
        for index in indices:
            item = self.items[index]
            frames = self._decode(item).frames
            device = pipe._device_of(pipe.vae)
            pixels = torch.from_numpy(frames).to(device).permute(3, 0, 1, 2)[None]
            with torch.no_grad():
                tensors = {"latents": pipe._encode_visual_condition(pixels)}
                if self.settings.task == "fl2va" and item.kind == "video":
                    components = pipe.task_components()
                    s = self.settings
                    conditions = spec.prepare_conditions(components, _keyframes(frames), s.height, s.width, s.num_frames)
                    first, last = spec.encode_conditions(components, conditions)[0]
                    tensors.update(keyframe_first=first, keyframe_last=last)
            _atomic_save(tensors, _sample_file(self.cache_dir, "video", index))
            logger.info("encoded video %d/%d (%s)", index + 1, len(self.items), item.name)

    def _encode_audio(self, pipe, indices) -> None:
        from diffusers.modular_pipelines.minimax_h3.modular_pipeline import audio_latent_num_frames

        audio_vae = pipe.audio_vae
        rate = audio_vae.config.sampling_rate
        mean = torch.tensor(audio_vae.config.latents_mean).view(1, -1, 1)
        std = torch.tensor(audio_vae.config.latents_std).view(1, -1, 1)
        channels = audio_vae.config.latent_channels
        for index in indices:
            item = self.items[index]
            if item.kind == "image":
                # An image has no soundtrack: its audio rows are placeholders the loss does not count.
                latents = torch.zeros(2, channels, max(1, audio_latent_num_frames(1)))
            else:
                audio = self._decode(item, rate).audio
                device = pipe._device_of(audio_vae)
                with torch.no_grad():
                    posterior = audio_vae.encode(audio.to(device, audio_vae.dtype)[:, None], return_dict=False)[0]
                latents = (posterior.mode().float().cpu() - mean) / std
            _atomic_save({"latents": latents}, _sample_file(self.cache_dir, "audio", index))
            logger.info("encoded audio %d/%d (%s)", index + 1, len(self.items), item.name)


def _encode_probe(pipe, conditioning, geometry):
    """The probe prompt presented like a sample (with its keyframes for fl2va), bypassing the non-empty prompt check."""
    from ..tasks import get_task, select_task

    spec = get_task(select_task(**conditioning))
    components = pipe.task_components()
    conditions = spec.prepare_conditions(components, conditioning, geometry["height"], geometry["width"],
                                         geometry["num_frames"])  # fmt: skip
    token_ids, token_tags, vision_inputs = spec.present(components, UNCOND_PROMPT, conditions)
    embeds = pipe.encode_presentation(token_ids, vision_inputs)
    return embeds, torch.tensor(token_tags, dtype=torch.long)


def _difference(stored: Dict, record: Dict) -> str:
    for key in ("version", "settings", "samples"):
        if stored.get(key) != record.get(key):
            if key == "settings":
                changed = [k for k in record["settings"] if stored["settings"].get(k) != record["settings"][k]]
                return "settings differ: " + ", ".join(changed)
            return f"{key} differ"
    return "differs"
