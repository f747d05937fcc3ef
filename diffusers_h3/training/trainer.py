"""Train a LoRA on the MiniMax-H3 DiT, in diffusers' training conventions.

`train_lora(TrainLoraConfig(...))` (also `diffusers-h3 train-lora` and `examples/train_lora.py` under
`accelerate launch`):

1. checks the options and the data folder (one line naming every problem, before any model loads);
2. pass 1 (:class:`~diffusers_h3.training.cache.LatentCache`): captions, video and audio latents encoded into a cache on
   disk, one model at a time;
3. pass 2: only the DiT is loaded (bf16, or quantized: W8A16 / NVFP4 / FP8 on load or pre-quantized, a single file or
   GGUF), frozen, with a PEFT `LoraConfig` adapter; Accelerate runs the loop (gradient accumulation, mixed precision,
   `save_state` / `load_state` checkpoints every N steps, written atomically, and resume), a tqdm bar and a JSON-lines
   log, validation clips written as MP4 every N steps; at the end the LoRA is written in diffusers', PEFT's and
   ComfyUI's layouts with a model card (:mod:`~diffusers_h3.training.lora_files`).

Randomness is a function of the step: the sample order (a permutation per epoch) and each step's noise come from
generators seeded with `seed` and the step's index, so a resumed run continues bitwise as if it had not stopped.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import shutil
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from .cache import CacheSettings, LatentCache
from .data import check_data_folder
from .loss import FlowMatchingConfig, flow_matching_loss, pack_sample


logger = logging.getLogger(__name__)

ADAPTER_NAME = "default"
TRAINING_ADAPTER_NAME = "training_adapter"
# The attention and feed-forward projections of the main blocks (the modules H3 LoRAs in the wild train).
DEFAULT_TARGET_MODULES = r"transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2))"
CHECKPOINT_PREFIX = "checkpoint-"
LORA_STATE_FILE = "lora_adapter.safetensors"
TASKS = ("t2va", "fl2va")
OPTIMIZERS = ("adamw", "adamw8bit")
MIXED_PRECISION = ("no", "bf16", "fp16")
LORA_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BASE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class TrainingConfigError(ValueError):
    """An option that cannot work; the message names it and the fix."""


@dataclasses.dataclass
class TrainLoraConfig:
    r"""
    Everything `train_lora` needs. Sizes are the training canvas: every clip is cover-resized and center-cropped to
    `height` x `width` and cut to its first `num_frames` frames at 24 fps.

    Args:
        model: Checkpoint folder or hub repo id of the pipeline (text encoder, VAEs, DiT).
        data_dir: The data folder (`metadata.jsonl` + clips / images; see `diffusers_h3.training.data`).
        output_dir: Where checkpoints, validation clips, logs and the final LoRA go.
        cache_dir: Pass 1's cache (default: `output_dir/cache`).
        task: `"t2va"` or `"fl2va"` (each clip's first and last frames become its keyframes).
        height, width, num_frames: The canvas (multiples of 32) and the clip length (17n+5 frames).
        rank, alpha, target_modules, lora_dtype, lora_dropout: The adapter: PEFT `LoraConfig(r=rank,
            lora_alpha=alpha or rank, target_modules=...)`, factors in `lora_dtype` (`"float32"` or `"bfloat16"`).
        dtype: The base weights' dtype (`"bfloat16"`); the base is frozen.
        quantize: Quantize the DiT while loading: `"w8a16"`, `"nvfp4"` or `"fp8"` (a pre-quantized checkpoint loads
            quantized without it).
        quantize_text_encoder: Quantize the text encoder while loading for pass 1 (same formats): the released
            Qwen3-VL-32B is 62 GiB in bf16, about 18 GiB in NVFP4.
        transformer_file: The DiT from one file (.safetensors: bf16 or ComfyUI fp8-scaled; .gguf).
        gradient_checkpointing: Recompute each block in the backward instead of keeping its activations.
        stream_base: Read the frozen base block by block from its checkpoint files (`stream_from_checkpoint`, the
            `low_ram` machinery) in the forward and in the recomputed forward of the backward; needs
            `gradient_checkpointing` and a checkpoint in the format it runs in (pre-quantized).
        learning_rate, lr_scheduler, lr_warmup_steps, optimizer, adam_beta1, adam_beta2, adam_weight_decay,
            adam_epsilon, max_grad_norm: The optimizer (`"adamw"`, or `"adamw8bit"` with bitsandbytes) over the LoRA
            factors only, diffusers' `get_scheduler`, gradient clipping.
        max_train_steps, gradient_accumulation_steps, mixed_precision, seed: The loop (`mixed_precision` is
            Accelerate's: `"no"`, `"bf16"`, `"fp16"`).
        checkpointing_steps, checkpoints_total_limit, resume_from_checkpoint: `save_state` every N optimizer steps
            (0: only at the end), keep the newest `checkpoints_total_limit`, resume from a checkpoint folder or
            `"latest"`.
        validation_prompts, validation_steps, validation_num_inference_steps, validation_seed: Clips generated with
            the adapter (the training adapter off) every `validation_steps` steps (0: off), written as MP4.
        weighting_scheme, logit_mean, logit_std, mode_scale, flow_shift, audio_flow_shift, audio_loss_weight: The
            flow-matching loss (`FlowMatchingConfig`); the shifts default to the checkpoint's schedulers'.
        guidance_scale: With a value `s`, the guidance-distillation target `uncond + s * (v - uncond)`.
        training_adapter, training_adapter_scale: A LoRA file loaded frozen and active during training only (a
            de-distillation adapter): validation and the written LoRA run without it.
        device: Where pass 1 encodes (default: Accelerate's device); pass 2 runs on Accelerate's device.
        lora_name: Name of the adapter in the written files and card.
        report_to: Accelerate tracker (`"tensorboard"`, `"wandb"`, ...); the JSON-lines log is always written.
    """

    model: str
    data_dir: str
    output_dir: str
    cache_dir: Optional[str] = None
    task: str = "t2va"
    height: int = 480
    width: int = 832
    num_frames: int = 124
    rank: int = 32
    alpha: Optional[float] = None
    target_modules: str = DEFAULT_TARGET_MODULES
    lora_dtype: str = "float32"
    lora_dropout: float = 0.0
    dtype: str = "bfloat16"
    quantize: Optional[str] = None
    quantize_text_encoder: Optional[str] = None
    transformer_file: Optional[str] = None
    gradient_checkpointing: bool = True
    stream_base: bool = False
    learning_rate: float = 1e-4
    lr_scheduler: str = "constant"
    lr_warmup_steps: int = 0
    optimizer: str = "adamw"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_weight_decay: float = 1e-4
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    max_train_steps: int = 1000
    gradient_accumulation_steps: int = 1
    mixed_precision: str = "no"
    seed: int = 0
    checkpointing_steps: int = 250
    checkpoints_total_limit: Optional[int] = None
    resume_from_checkpoint: Optional[str] = None
    validation_prompts: Sequence[str] = ()
    validation_steps: int = 0
    validation_num_inference_steps: int = 50
    validation_seed: int = 0
    weighting_scheme: str = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    flow_shift: Optional[float] = None
    audio_flow_shift: Optional[float] = None
    audio_loss_weight: float = 1.0
    guidance_scale: Optional[float] = None
    training_adapter: Optional[str] = None
    training_adapter_scale: float = 1.0
    device: Optional[str] = None
    lora_name: str = "lora"
    report_to: Optional[str] = None

    def check(self) -> None:
        """Raise :class:`TrainingConfigError` (one line) for an option that cannot work, before anything loads."""
        problems = []
        if self.task not in TASKS:
            problems.append(f"task={self.task!r} is not one of {TASKS} (ref2va training is not supported)")
        if self.num_frames < 5 or (self.num_frames - 5) % 17:
            problems.append(f"num_frames={self.num_frames} is not 17n+5 (e.g. 22, 124, 345): the VAE's chunks")
        if self.height <= 0 or self.width <= 0 or self.height % 32 or self.width % 32:
            problems.append(f"height={self.height}, width={self.width} must be positive multiples of 32")
        if self.rank < 1:
            problems.append(f"rank={self.rank} must be >= 1")
        if self.lora_dtype not in LORA_DTYPES:
            problems.append(f"lora_dtype={self.lora_dtype!r} is not one of {tuple(LORA_DTYPES)}")
        if self.dtype not in BASE_DTYPES:
            problems.append(f"dtype={self.dtype!r} is not one of {tuple(BASE_DTYPES)}")
        if self.optimizer not in OPTIMIZERS:
            problems.append(f"optimizer={self.optimizer!r} is not one of {OPTIMIZERS}")
        elif self.optimizer == "adamw8bit":
            from .._utils import is_package_available

            if not is_package_available("bitsandbytes"):
                problems.append("optimizer='adamw8bit' needs bitsandbytes: pip install bitsandbytes, or use 'adamw'")
        if self.mixed_precision not in MIXED_PRECISION:
            problems.append(f"mixed_precision={self.mixed_precision!r} is not one of {MIXED_PRECISION}")
        if self.max_train_steps < 1 or self.gradient_accumulation_steps < 1:
            problems.append("max_train_steps and gradient_accumulation_steps must be >= 1")
        if self.stream_base and not self.gradient_checkpointing:
            problems.append("stream_base needs gradient_checkpointing (the backward re-reads each block as it "
                            "recomputes it)")  # fmt: skip
        if self.stream_base and (self.quantize or self.transformer_file):
            problems.append("stream_base reads the base from its checkpoint folder in the format it runs in: save it "
                            "quantized first (save_pretrained) instead of quantize= / transformer_file=")  # fmt: skip
        if self.quantize and self.transformer_file and self.transformer_file.endswith(".gguf"):
            problems.append("a GGUF transformer_file is already quantized: drop quantize=")
        for option in ("quantize", "quantize_text_encoder"):
            if getattr(self, option) is not None:
                from ..quantizers.registry import get_format

                try:
                    get_format(getattr(self, option))
                except (KeyError, ValueError) as error:
                    problems.append(f"{option}={getattr(self, option)!r}: {error}")
        if self.validation_steps and not self.validation_prompts:
            problems.append("validation_steps needs validation_prompts")
        if self.transformer_file is not None and not os.path.isfile(self.transformer_file):
            problems.append(f"transformer_file {self.transformer_file}: no such file")
        if self.training_adapter is not None and not os.path.exists(self.training_adapter):
            problems.append(f"training_adapter {self.training_adapter}: no such file")
        if self.guidance_scale is not None and self.guidance_scale <= 0:
            problems.append(f"guidance_scale={self.guidance_scale} must be positive")
        if self.resume_from_checkpoint not in (None, "latest") and not Path(self.resume_from_checkpoint).is_dir():
            problems.append(f"resume_from_checkpoint {self.resume_from_checkpoint}: no such checkpoint folder")
        if problems:
            raise TrainingConfigError("train-lora: " + "; ".join(problems) + ".")

    def cache_folder(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else Path(self.output_dir) / "cache"

    def settings_for_card(self) -> Dict:
        keys = ("task", "height", "width", "num_frames", "rank", "alpha", "learning_rate", "max_train_steps",
                "gradient_accumulation_steps", "quantize", "guidance_scale", "flow_shift", "audio_flow_shift",
                "weighting_scheme", "seed")  # fmt: skip
        return {key: getattr(self, key) for key in keys}


@dataclasses.dataclass
class TrainResult:
    """What `train_lora` wrote and measured."""

    output_dir: Path
    files: Dict[str, Path]
    losses: List[float]
    global_step: int
    checkpoints: List[Path]
    validation_videos: List[Path]


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------------------------------
def list_checkpoints(output_dir) -> List[Path]:
    """Complete checkpoints (`checkpoint-<step>`) in step order; half-written ones (`.tmp`) are not listed."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and re.fullmatch(CHECKPOINT_PREFIX + r"\d+", p.name)]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX) :]))


def _save_checkpoint(accelerator, output_dir: Path, step: int, total_limit: Optional[int]) -> Path:
    """`accelerator.save_state` into a temporary folder renamed into place once complete: an interruption leaves the
    previous checkpoints as they were. Old checkpoints beyond `total_limit` go after the new one is in place."""
    final = output_dir / f"{CHECKPOINT_PREFIX}{step}"
    temporary = output_dir / f"{final.name}.tmp"
    if temporary.exists():
        shutil.rmtree(temporary)
    accelerator.save_state(str(temporary))
    if final.exists():
        shutil.rmtree(final)
    os.replace(temporary, final)
    if total_limit is not None:
        for old in list_checkpoints(output_dir)[:-total_limit]:
            shutil.rmtree(old)
    return final


def _resolve_resume(config: TrainLoraConfig) -> Optional[Path]:
    if config.resume_from_checkpoint is None:
        return None
    if config.resume_from_checkpoint == "latest":
        found = list_checkpoints(config.output_dir)
        return found[-1] if found else None
    return Path(config.resume_from_checkpoint)


# ---------------------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------------------


def allocator_for_streaming(config: TrainLoraConfig, device: torch.device) -> Optional[str]:
    """A base streamed on a CUDA device trains with the allocator's expandable segments, as the streamed recipes were
    measured (``use_recipe_allocator_settings``: the environment's own setting stands); returns what it runs with."""
    if not config.stream_base or torch.device(device).type != "cuda":
        return None
    from ..parallel.memory_recipes import use_recipe_allocator_settings

    return use_recipe_allocator_settings()


def load_base_transformer(config: TrainLoraConfig, device):
    """The frozen DiT of `config` (bf16, quantized on load, pre-quantized, a single file or GGUF) and its pipeline's
    schedulers' shifts."""
    from ..quantizers.registry import get_format
    from ..tasks import partition_for_task
    from .cache import _load_pipeline

    dtype = BASE_DTYPES[config.dtype]
    partition = partition_for_task(config.task)
    kwargs = {}
    if config.transformer_file is not None:
        from ..loaders.single_file import load_transformer_file

        quantization = get_format(config.quantize).config_cls() if config.quantize else None
        pipe = _load_pipeline(config.model, (), config.task, dtype, "cpu")
        transformer = load_transformer_file(config.transformer_file, os.path.join(config.model, partition)
                                            if os.path.isdir(config.model) else config.model, dtype=dtype,
                                            quantization_config=quantization)  # fmt: skip
    else:
        if config.quantize:
            from diffusers.quantizers import PipelineQuantizationConfig

            mapping = {partition: get_format(config.quantize).config_cls()}
            kwargs["quantization_config"] = PipelineQuantizationConfig(quant_mapping=mapping)
        pipe = _load_pipeline(config.model, (partition,), config.task, dtype, "cpu", **kwargs)
        transformer = getattr(pipe, partition)
    shifts = (float(pipe.scheduler.config.shift), float(pipe.audio_scheduler.config.shift))
    transformer.requires_grad_(False)
    transformer.train()
    return transformer, shifts


def add_lora(transformer, config: TrainLoraConfig):
    """Add the trained adapter (and the frozen training adapter, if any); returns the `LoraConfig`."""
    from diffusers.training_utils import cast_training_params
    from peft import LoraConfig

    lora_config = LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha if config.alpha is not None else config.rank,
        lora_dropout=config.lora_dropout,
        init_lora_weights="gaussian",
        target_modules=config.target_modules,
    )
    transformer.add_adapter(lora_config, adapter_name=ADAPTER_NAME)
    if config.training_adapter is not None:
        from ..pipelines.pipeline_minimax_h3 import MiniMaxH3Pipeline

        state_dict = MiniMaxH3Pipeline.lora_state_dict(config.training_adapter)
        state_dict = state_dict[0] if isinstance(state_dict, tuple) else state_dict
        transformer.load_lora_adapter(state_dict, prefix="transformer", adapter_name=TRAINING_ADAPTER_NAME)
        transformer.set_adapters([ADAPTER_NAME, TRAINING_ADAPTER_NAME], [1.0, config.training_adapter_scale])
    for name, param in transformer.named_parameters():
        param.requires_grad_(f".{ADAPTER_NAME}." in name and "lora_" in name)
    cast_training_params(transformer, dtype=LORA_DTYPES[config.lora_dtype])
    return lora_config


def trainable_parameters(transformer) -> List[torch.nn.Parameter]:
    return [p for p in transformer.parameters() if p.requires_grad]


def _optimizer(config: TrainLoraConfig, params):
    if config.optimizer == "adamw8bit":
        import bitsandbytes as bnb

        cls = bnb.optim.AdamW8bit
    else:
        cls = torch.optim.AdamW
    return cls(params, lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2),
               weight_decay=config.adam_weight_decay, eps=config.adam_epsilon)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------------------------
def _step_generator(seed: int, micro_step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + micro_step)


def sample_index(seed: int, micro_step: int, num_samples: int) -> int:
    """Which sample micro-step `micro_step` trains on: a fresh permutation of the samples every epoch."""
    epoch, position = divmod(micro_step, num_samples)
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + 7919 * epoch))
    return int(order[position])


def _load_sample(cache: LatentCache, index: int, task: str, patch_size, with_uncond: bool):
    tensors = cache.sample(index)
    sample = pack_sample(tensors, task, patch_size)
    if with_uncond:
        sample.uncond = pack_sample(tensors, task, patch_size, prefix="uncond_")
    return sample


def _run_validation(config, cache: LatentCache, transformer, step: int, device, accelerator) -> List[Path]:
    """Generate the validation prompts with the trained adapter (training adapter off) and write them as MP4."""
    from diffusers.training_utils import free_memory

    from .cache import _load_pipeline

    unwrapped = accelerator.unwrap_model(transformer)
    pipe = _load_pipeline(config.model, ("vae", "audio_vae"), config.task, BASE_DTYPES[config.dtype], device)
    pipe.register_modules(transformer=unwrapped)
    if config.training_adapter is not None:
        unwrapped.set_adapters([ADAPTER_NAME], [1.0])
    conditioning = cache.validation_conditioning()
    folder = Path(config.output_dir) / "validation"
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    was_training = unwrapped.training
    unwrapped.eval()
    try:
        for j in range(len(config.validation_prompts)):
            tensors = cache.validation(j)
            generator = torch.Generator().manual_seed(config.validation_seed)
            with torch.no_grad():
                out = pipe(prompt_embeds=tensors["prompt_embeds"], text_token_tags=tensors["text_token_tags"],
                           **conditioning, height=config.height, width=config.width, num_frames=config.num_frames,
                           num_inference_steps=config.validation_num_inference_steps, generator=generator,
                           output_type="latent")  # fmt: skip
            path = folder / f"step-{step:06d}-prompt-{j:02d}.mp4"
            pipe.decode_to_video(out.frames, out.audio, path)
            written.append(path)
            accelerator.print(f"validation clip: {path}")
    finally:
        if was_training:
            unwrapped.train()
        if config.training_adapter is not None:
            unwrapped.set_adapters([ADAPTER_NAME, TRAINING_ADAPTER_NAME], [1.0, config.training_adapter_scale])
            for name, param in unwrapped.named_parameters():
                if TRAINING_ADAPTER_NAME in name:
                    param.requires_grad_(False)
        pipe.register_modules(transformer=None)
        del pipe
        free_memory()
    return written


def train_lora(config: TrainLoraConfig, accelerator=None) -> TrainResult:
    """Run both passes of LoRA training (see the module docstring); returns what was written."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed
    from diffusers.optimization import get_scheduler
    from diffusers.training_utils import free_memory
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file, save_file
    from tqdm.auto import tqdm

    from ..parallel.checkpoint_streaming import stream_from_checkpoint

    config.check()
    items = check_data_folder(config.data_dir, config.num_frames)
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    for stale in output_dir.glob(f"{CHECKPOINT_PREFIX}*.tmp"):  # a save interrupted by an earlier run
        shutil.rmtree(stale)
    if accelerator is None:
        accelerator = Accelerator(
            gradient_accumulation_steps=config.gradient_accumulation_steps,
            mixed_precision=config.mixed_precision,
            log_with=config.report_to,
            project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / "logs")),
            cpu=config.device == "cpu",
        )
    set_seed(config.seed)
    device = accelerator.device

    # Pass 1: the cache, one model at a time, on the main process.
    settings = CacheSettings(str(config.model), config.task, config.height, config.width, config.num_frames,
                             tuple(config.validation_prompts), config.guidance_scale is not None)  # fmt: skip
    cache = LatentCache(config.cache_folder(), settings, items)
    if accelerator.is_main_process:
        started = time.perf_counter()
        text_quantization = None
        if config.quantize_text_encoder:
            from ..quantizers.registry import get_format

            text_quantization = get_format(config.quantize_text_encoder).config_cls()
        cache.encode(device=config.device or device, dtype=BASE_DTYPES[config.dtype],
                     text_encoder_quantization=text_quantization)  # fmt: skip
        accelerator.print(f"pass 1: {len(items)} samples cached in {config.cache_folder()} "
                          f"({time.perf_counter() - started:.1f} s)")  # fmt: skip
    accelerator.wait_for_everyone()
    free_memory()

    # Pass 2: only the DiT.
    allocator = allocator_for_streaming(config, device)
    if allocator is not None:
        accelerator.print(f"pass 2: {allocator}")
    transformer, (video_shift, audio_shift) = load_base_transformer(config, device)
    lora_config = add_lora(transformer, config)
    if config.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    if config.stream_base:
        from ..tasks import partition_for_task

        folder = Path(config.model) / partition_for_task(config.task)
        stream_from_checkpoint(transformer, folder, device)
    else:
        transformer.to(device)
    compute_dtype = BASE_DTYPES[config.dtype]
    patch_size = tuple(transformer.config.patch_size)
    loss_config = FlowMatchingConfig(
        config.weighting_scheme, config.logit_mean, config.logit_std, config.mode_scale,
        config.flow_shift if config.flow_shift is not None else video_shift,
        config.audio_flow_shift if config.audio_flow_shift is not None else audio_shift,
        config.audio_loss_weight, config.guidance_scale,
    )  # fmt: skip

    params = trainable_parameters(transformer)
    optimizer = _optimizer(config, params)
    lr_scheduler = get_scheduler(config.lr_scheduler, optimizer=optimizer,
                                 num_warmup_steps=config.lr_warmup_steps * accelerator.num_processes,
                                 num_training_steps=config.max_train_steps * accelerator.num_processes)  # fmt: skip
    transformer, optimizer, lr_scheduler = accelerator.prepare(transformer, optimizer, lr_scheduler)

    # save_state / load_state carry the LoRA factors only, not the frozen base.
    def save_model_hook(models, weights, folder):
        if accelerator.is_main_process:
            from .lora_files import adapter_state_dict

            for model in models:
                save_file(adapter_state_dict(accelerator.unwrap_model(model), ADAPTER_NAME),
                          os.path.join(folder, LORA_STATE_FILE))  # fmt: skip
                if weights:
                    weights.pop()

    def load_model_hook(models, folder):
        state = load_file(os.path.join(folder, LORA_STATE_FILE))
        while models:
            model = accelerator.unwrap_model(models.pop())
            result = set_peft_model_state_dict(model, state, adapter_name=ADAPTER_NAME)
            unexpected = getattr(result, "unexpected_keys", None)
            if unexpected:
                raise ValueError(f"checkpoint {folder}: LoRA keys that match no module, e.g. {unexpected[0]}")

    accelerator.register_save_state_pre_hook(save_model_hook)
    accelerator.register_load_state_pre_hook(load_model_hook)

    global_step = 0
    resume = _resolve_resume(config)
    if resume is not None:
        accelerator.load_state(str(resume))
        global_step = int(resume.name[len(CHECKPOINT_PREFIX) :])
        accelerator.print(f"resumed from {resume} at step {global_step}")
    if accelerator.is_main_process:
        accelerator.init_trackers("diffusers-h3-train-lora", config=dict(config.settings_for_card()))

    log_path = output_dir / "logs" / "train_log.jsonl"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    losses: List[float] = []
    videos: List[Path] = []
    checkpoints: List[Path] = []
    accumulation = config.gradient_accumulation_steps
    progress = tqdm(range(config.max_train_steps), initial=global_step, desc="train-lora",
                    disable=not accelerator.is_local_main_process)  # fmt: skip
    with_uncond = config.guidance_scale is not None
    while global_step < config.max_train_steps:
        step_loss, step_logs = 0.0, {}
        for k in range(accumulation):
            micro_step = (global_step * accumulation + k) * accelerator.num_processes + accelerator.process_index
            sample = _load_sample(cache, sample_index(config.seed, micro_step, len(cache)), config.task, patch_size,
                                  with_uncond)  # fmt: skip
            with accelerator.accumulate(transformer):
                loss, logs = flow_matching_loss(transformer, sample, loss_config, _step_generator(config.seed, micro_step),
                                                device, compute_dtype)  # fmt: skip
                accelerator.backward(loss)
                if accelerator.sync_gradients and config.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(params, config.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            step_loss += loss.item() / accumulation
            step_logs = logs
        if not math.isfinite(step_loss):
            raise FloatingPointError(
                f"train-lora: the loss is {step_loss} at step {global_step + 1} — lower learning_rate, or use "
                "lora_dtype='float32' and mixed_precision='bf16' instead of fp16."
            )
        global_step += 1
        losses.append(step_loss)
        record = {"step": global_step, "loss": step_loss, "lr": lr_scheduler.get_last_lr()[0], **step_logs}
        progress.update(1)
        progress.set_postfix(loss=f"{step_loss:.4f}")
        accelerator.log(record, step=global_step)
        if accelerator.is_main_process:
            with open(log_path, "a") as log:
                log.write(json.dumps(record) + "\n")
        if config.checkpointing_steps and global_step % config.checkpointing_steps == 0 and global_step < config.max_train_steps:
            if accelerator.is_main_process:
                checkpoints.append(_save_checkpoint(accelerator, output_dir, global_step, config.checkpoints_total_limit))
            accelerator.wait_for_everyone()
        if config.validation_steps and global_step % config.validation_steps == 0 and accelerator.is_main_process:
            videos += _run_validation(config, cache, transformer, global_step, device, accelerator)
    progress.close()

    accelerator.wait_for_everyone()
    files: Dict[str, Path] = {}
    if accelerator.is_main_process:
        checkpoints.append(_save_checkpoint(accelerator, output_dir, global_step, config.checkpoints_total_limit))
        from .lora_files import save_trained_lora

        files = save_trained_lora(output_dir, accelerator.unwrap_model(transformer), ADAPTER_NAME, lora_config,
                                  name=config.lora_name, base_model=str(config.model),
                                  settings=config.settings_for_card(), captions=[item.caption for item in items])  # fmt: skip
        accelerator.print(f"LoRA written: {files['diffusers']} (diffusers / PEFT), {files['comfyui']} (ComfyUI)")
    accelerator.end_training()
    return TrainResult(output_dir, files, losses, global_step, checkpoints, videos)
