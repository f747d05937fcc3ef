"""fl2va and image data, the guidance-distillation target, the frozen training adapter and validation clips."""

import math

import torch
from safetensors.torch import load_file

from .conftest import TRAIN_CANVAS, clip_frames, train_config


def test_fl2va_trains_with_first_and_last_frame_conditions(tmp_path, two_clip_folder, demo_model):
    from diffusers_h3.training import train_lora

    result = train_lora(train_config(demo_model, two_clip_folder, tmp_path, task="fl2va", max_train_steps=2,
                                     checkpointing_steps=0))  # fmt: skip
    video = load_file(str(tmp_path / "cache" / "video" / "00000.safetensors"))
    assert video["keyframe_first"].shape[2] == 1 and video["keyframe_last"].shape[2] == 1
    text = load_file(str(tmp_path / "cache" / "text" / "00000.safetensors"))
    assert (text["text_token_tags"] == 0).any()  # the keyframes' vision rows are part of the prompt
    assert all(math.isfinite(loss) for loss in result.losses)


def test_fl2va_sample_packs_keyframe_rows_first_and_pins_them():
    from diffusers_h3.training.loss import KEYFRAME_NOISE_AUG, pack_sample

    tensors = {
        "latents": torch.randn(1, 4, 7, 4, 6), "audio_latents": torch.randn(2, 8, 37), "is_image": torch.tensor(False),
        "keyframe_first": torch.randn(1, 4, 1, 4, 6), "keyframe_last": torch.randn(1, 4, 1, 4, 6),
        "prompt_embeds": torch.randn(1, 5, 16), "text_token_tags": torch.ones(5, dtype=torch.long),
    }  # fmt: skip
    sample = pack_sample(tensors, "fl2va", (1, 2, 2))
    assert sample.n_cond_video == 2 * 6 and sample.video_rows.shape[0] == 7 * 6
    assert sample.structure["video_indices"].numel() == sample.n_cond_video + sample.video_rows.shape[0]
    assert KEYFRAME_NOISE_AUG == 0.999


def test_image_only_data_trains_video_rows_only(tmp_path, demo_model):
    from PIL import Image

    from diffusers_h3.training import train_lora, write_metadata

    data = tmp_path / "images"
    data.mkdir()
    for index in range(2):
        Image.fromarray(clip_frames(index)[0]).save(data / f"still{index}.png")
    write_metadata(data, [("still0.png", "a red still"), ("still1.png", "a blue still")])
    result = train_lora(train_config(demo_model, data, tmp_path / "out", max_train_steps=3, checkpointing_steps=0,
                                     quantize_text_encoder="w8a16"))  # pass 1 with a quantized text encoder
    video = load_file(str(tmp_path / "out" / "cache" / "video" / "00000.safetensors"))["latents"]
    assert video.shape[2] == 1  # one latent frame
    assert all(math.isfinite(loss) for loss in result.losses)
    log = (tmp_path / "out" / "logs" / "train_log.jsonl").read_text().splitlines()
    assert len(log) == 3


class _Recorder(torch.nn.Module):
    """A stand-in transformer: the prediction is a function of the prompt embeddings (conditional vs probe)."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(1.0))

    def forward(self, hidden_states, audio_hidden_states, encoder_hidden_states, **kwargs):
        level = encoder_hidden_states.mean()
        return (hidden_states * 0 + level * self.scale, audio_hidden_states * 0 + level * self.scale)


def test_guidance_distillation_target():
    """target = uncond + s * (v - uncond), uncond the model's own prediction for the probe prompt without gradient."""
    from diffusers_h3.training.loss import FlowMatchingConfig, draw_noise, flow_matching_loss, pack_sample

    base = {"latents": torch.randn(1, 4, 2, 2, 2), "audio_latents": torch.randn(2, 8, 3), "is_image": torch.tensor(False),
            "prompt_embeds": torch.full((1, 3, 16), 0.5), "text_token_tags": torch.ones(3, dtype=torch.long),
            "uncond_prompt_embeds": torch.full((1, 1, 16), -0.25), "uncond_text_token_tags": torch.ones(1, dtype=torch.long)}  # fmt: skip
    sample = pack_sample(base, "t2va", (1, 2, 2))
    sample.uncond = pack_sample(base, "t2va", (1, 2, 2), prefix="uncond_")
    config = FlowMatchingConfig(guidance_scale=3.0)
    model = _Recorder()
    loss, _ = flow_matching_loss(model, sample, config, torch.Generator().manual_seed(0), "cpu", torch.float32)
    _, noise, audio_noise, _ = draw_noise(sample, config, torch.Generator().manual_seed(0))
    uncond, cond = -0.25, 0.5
    video_target = uncond + 3.0 * (sample.video_rows - noise - uncond)
    audio_target = uncond + 3.0 * (sample.audio_rows - audio_noise - uncond)
    want = (cond - video_target).square().mean() + (cond - audio_target).square().mean()
    assert torch.allclose(loss, want)
    loss.backward()  # the uncond branch has no gradient: d loss / d scale is the conditional branch's alone
    expected = 2 * cond * ((cond - video_target).mean() + (cond - audio_target).mean())
    assert torch.allclose(model.scale.grad, expected)


def test_training_adapter_is_on_in_training_and_off_in_the_output(overfit_run, tmp_path, two_clip_folder, demo_model,
                                                                  shared_cache):  # fmt: skip
    """A frozen extra adapter changes the training loss, stays frozen, and is neither in the written LoRA nor active
    in the validation clips (written as MP4)."""
    import av

    from diffusers_h3.training import train_lora

    common = {"max_train_steps": 2, "checkpointing_steps": 0, "guidance_scale": 3.0, "validation_steps": 2,
              "validation_prompts": ["a red gradient"], "validation_num_inference_steps": 3}
    plain = train_lora(train_config(demo_model, two_clip_folder, tmp_path / "plain", shared_cache, **common))
    adapted = train_lora(train_config(demo_model, two_clip_folder, tmp_path / "adapted", shared_cache,
                                      training_adapter=str(overfit_run.files["diffusers"]), **common))  # fmt: skip
    assert adapted.losses[0] != plain.losses[0]
    written = load_file(str(adapted.files["diffusers"]))
    assert written and not any("training_adapter" in key for key in written)
    plain_lora = load_file(str(plain.files["diffusers"]))
    assert written.keys() == plain_lora.keys()
    assert len(adapted.validation_videos) == 1
    with av.open(str(adapted.validation_videos[0])) as container:
        assert container.streams.video and container.streams.audio
        assert sum(1 for _ in container.decode(video=0)) == TRAIN_CANVAS["num_frames"]
