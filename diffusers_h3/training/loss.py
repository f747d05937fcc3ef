"""The flow-matching objective H3 was trained with, on its packed `[text | keyframes | audio | video]` sequence.

Conventions are the pipeline's (diffusers' `MiniMaxH3Scheduler`): a row at noise level `sigma` is
`x_t = (1 - sigma) * x_0 + sigma * noise`, the transformer reads the timestep `t = 1 - sigma` (1 = clean) and predicts
the *data-ward* velocity `v = x_0 - noise`. Video and audio share one draw `u` in [0, 1] that each modality's shift maps
to its own sigma, `sigma = s * u / (1 + (s - 1) * u)` (video shift 12, audio shift 3), exactly as a sampling step maps
its grid point. fl2va keyframe rows are noised to 0.999 and pinned at `max(t, 0.999)` as the pipeline does; the loss
counts only the generated rows.

Optional guidance-distillation target (H3 is CFG-distilled; plain flow matching drifts it back towards the
undistilled model): `target = uncond + s * (v - uncond)`, `uncond` the model's own prediction for the probe prompt
`" "`, without gradient.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep, patchify_video_latents
from diffusers.training_utils import compute_density_for_timestep_sampling

from ..layout import use_packed_layout
from ..tasks import LatentGeometry, TaskConditions, get_task


# The noise level of fl2va keyframe rows (the pipeline's KEYFRAME_NOISE_AUG).
KEYFRAME_NOISE_AUG = 0.999


def shift_sigma(u: torch.Tensor, shift: float) -> torch.Tensor:
    """The scheduler's exponential shift of a point `u` of the unshifted grid."""
    return shift * u / (1 + (shift - 1) * u)


@dataclasses.dataclass
class PackedSample:
    """One cached sample as the transformer takes it: clean rows, conditioning rows and the packed structure."""

    video_rows: torch.Tensor  # (rows, C * prod(patch)) clean target video
    audio_rows: torch.Tensor  # (rows, C) clean audio (left rows, then right rows)
    condition_rows: Optional[torch.Tensor]  # (rows, C * prod(patch)) clean keyframe rows, or None
    prompt_embeds: torch.Tensor
    structure: Dict[str, torch.Tensor]
    layout: object
    audio_weight: float  # 0 for an image (its audio rows are placeholders)
    uncond: Optional["PackedSample"] = None

    @property
    def n_cond_video(self) -> int:
        return 0 if self.condition_rows is None else self.condition_rows.shape[0]


def pack_sample(tensors: Dict[str, torch.Tensor], task: str, patch_size, prefix: str = "") -> PackedSample:
    """Pack a cached sample (`LatentCache.sample`) into the sequence `task` builds; `prefix="uncond_"` packs the
    probe prompt's sequence around the same latents."""
    video = tensors["latents"]
    _, _, frames, height, width = video.shape
    audio = tensors["audio_latents"]  # (2, C, n)
    is_image = bool(tensors["is_image"])
    keyframes = [tensors[k] for k in ("keyframe_first", "keyframe_last") if k in tensors and not is_image]
    anchors = ("first", "last")[: len(keyframes)] if keyframes else ()
    geometry = LatentGeometry(frames, height, width, audio.shape[-1], tuple(patch_size))
    tags = tensors[prefix + "text_token_tags"].long()
    spec = get_task("fl2va" if keyframes else "t2va")
    conditions = TaskConditions(height * 16, width * 16, [None] * len(keyframes), anchors)
    packed, layout = spec.build_layout(tags, conditions, keyframes, [], geometry)
    position_ids, token_tags, video_indices, audio_indices, text_indices, _, _ = packed
    structure = {"position_ids": position_ids, "token_tags": token_tags, "video_indices": video_indices,
                 "audio_indices": audio_indices, "text_indices": text_indices}  # fmt: skip
    condition_rows = torch.cat([patchify_video_latents(k.float(), patch_size) for k in keyframes]) if keyframes else None
    return PackedSample(
        video_rows=patchify_video_latents(video.float(), patch_size),
        audio_rows=audio.float().permute(0, 2, 1).reshape(-1, audio.shape[1]),
        condition_rows=condition_rows,
        prompt_embeds=tensors[prefix + "prompt_embeds"],
        structure=structure,
        layout=layout,
        audio_weight=0.0 if is_image else 1.0,
    )


@dataclasses.dataclass(frozen=True)
class FlowMatchingConfig:
    """How noise levels are drawn and what the loss counts.

    Args:
        weighting_scheme: diffusers' `compute_density_for_timestep_sampling` scheme for the unshifted draw `u`
            (`"logit_normal"`, `"mode"`, `"uniform"` — `"none"` means uniform).
        logit_mean, logit_std, mode_scale: its parameters.
        flow_shift, audio_flow_shift: the video and audio sigma shifts (the pipeline's 12 and 3).
        audio_loss_weight: weight of the audio rows' mean squared error next to the video rows'.
        guidance_scale: with a value, the guidance-distillation target `uncond + s * (v - uncond)`.
    """

    weighting_scheme: str = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    flow_shift: float = 12.0
    audio_flow_shift: float = 3.0
    audio_loss_weight: float = 1.0
    guidance_scale: Optional[float] = None


def draw_noise(sample: PackedSample, config: FlowMatchingConfig, generator: torch.Generator):
    """`(u, video noise, audio noise, keyframe noise)` for one step, all from `generator` (CPU) in a fixed order."""
    u = compute_density_for_timestep_sampling(
        config.weighting_scheme, batch_size=1, logit_mean=config.logit_mean, logit_std=config.logit_std,
        mode_scale=config.mode_scale, device=torch.device("cpu"), generator=generator,
    )  # fmt: skip
    u = u.clamp(1e-4, 1.0).float()
    noise = torch.randn(sample.video_rows.shape, generator=generator)
    audio_noise = torch.randn(sample.audio_rows.shape, generator=generator)
    cond_noise = torch.randn(sample.condition_rows.shape, generator=generator) if sample.n_cond_video else None
    return u, noise, audio_noise, cond_noise


def _forward(transformer, sample: PackedSample, video_in, audio_in, t_video, t_audio, device, dtype):
    text_rows = sample.structure["text_indices"].numel()
    plan = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        sample.structure["video_indices"], sample.structure["audio_indices"], sample.n_cond_video, 0, text_rows,
        t_video, t_audio, max(t_video, KEYFRAME_NOISE_AUG), 1.0,
    )  # fmt: skip
    timestep, timestep_indices = (tensor.to(device) for tensor in plan)
    structure = {name: value.to(device) for name, value in sample.structure.items()}
    # Recomputation runs each checkpointed block to its end: a block streamed from its checkpoint releases its weights
    # when its forward returns, which an early-stopped recomputation never does (they would stay on the device).
    with use_packed_layout(sample.layout), torch.utils.checkpoint.set_checkpoint_early_stop(False):
        video_pred, audio_pred = transformer(
            hidden_states=video_in[None].to(device, dtype),
            audio_hidden_states=audio_in[None].to(device, dtype),
            encoder_hidden_states=sample.prompt_embeds.to(device, dtype),
            timestep=timestep,
            timestep_indices=timestep_indices,
            return_dict=False,
            **structure,
        )
    return video_pred[0].float(), audio_pred[0].float()


def flow_matching_loss(
    transformer, sample: PackedSample, config: FlowMatchingConfig, generator: torch.Generator, device, dtype
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """The loss of one sample at one draw of noise level and noise; returns `(loss, logs)`."""
    u, noise, audio_noise, cond_noise = draw_noise(sample, config, generator)
    sigma = shift_sigma(u, config.flow_shift).item()
    audio_sigma = shift_sigma(u, config.audio_flow_shift).item()
    video_target = (sample.video_rows - noise).to(device)
    audio_target = (sample.audio_rows - audio_noise).to(device)
    noisy = (1 - sigma) * sample.video_rows + sigma * noise
    noisy_audio = (1 - audio_sigma) * sample.audio_rows + audio_sigma * audio_noise
    if sample.n_cond_video:
        cond = KEYFRAME_NOISE_AUG * sample.condition_rows + (1 - KEYFRAME_NOISE_AUG) * cond_noise
        noisy = torch.cat([cond, noisy])
    t_video, t_audio = 1.0 - sigma, 1.0 - audio_sigma
    if config.guidance_scale is not None:
        if sample.uncond is None:
            raise ValueError("guidance distillation needs the probe prompt's embeddings in the cache (uncond=True).")
        with torch.no_grad():
            uncond_video, uncond_audio = _forward(transformer, sample.uncond, noisy, noisy_audio, t_video, t_audio,
                                                  device, dtype)  # fmt: skip
        s, uncond_video = config.guidance_scale, uncond_video[sample.n_cond_video :]
        video_target = uncond_video + s * (video_target - uncond_video)
        audio_target = uncond_audio + s * (audio_target - uncond_audio)
    video_pred, audio_pred = _forward(transformer, sample, noisy, noisy_audio, t_video, t_audio, device, dtype)
    video_loss = F.mse_loss(video_pred[sample.n_cond_video :], video_target)
    audio_loss = F.mse_loss(audio_pred, audio_target)
    weight = config.audio_loss_weight * sample.audio_weight
    loss = video_loss + weight * audio_loss
    return loss, {"video_loss": video_loss.item(), "audio_loss": audio_loss.item(), "sigma": sigma}
