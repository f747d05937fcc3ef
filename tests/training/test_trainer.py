"""LoRA training end to end on the tiny demo checkpoint (CPU): overfit, load, resume, interrupted checkpoints."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .conftest import CAPTIONS, OVERFIT_STEPS, TRAIN_CANVAS, train_config


def _fixed_draw_loss(transformer, cache_dir, demo_model, draws=16):
    """The mean flow-matching loss over fixed noise draws on both cached clips."""
    from diffusers_h3.training import DataItem, LatentCache
    from diffusers_h3.training.cache import CacheSettings
    from diffusers_h3.training.loss import FlowMatchingConfig, flow_matching_loss, pack_sample

    record = json.loads((Path(cache_dir) / "cache.json").read_text())
    items = [DataItem(Path(s["file_name"]), s["text"], s["kind"]) for s in record["samples"]]
    cache = LatentCache(cache_dir, CacheSettings(**record["settings"]), items)
    samples = [pack_sample(cache.sample(i), "t2va", (1, 2, 2)) for i in range(len(cache))]
    config = FlowMatchingConfig()
    total = 0.0
    with torch.no_grad():
        for j in range(draws):
            generator = torch.Generator().manual_seed(10_000 + j)
            total += flow_matching_loss(transformer, samples[j % len(samples)], config, generator, "cpu", torch.float32)[0].item()
    return total / draws


def _pipeline_with_lora(demo_model, lora_file, components=("transformer",)):
    from diffusers_h3.training.cache import _load_pipeline

    pipe = _load_pipeline(demo_model, components, "t2va", torch.float32, "cpu")
    report = pipe.load_lora_weights(str(lora_file), adapter_name="trained")
    return pipe, report


def test_overfit_two_clips_halves_the_loss(overfit_run, shared_cache, demo_model):
    """The written LoRA, loaded with load_lora_weights, at least halves the loss on the training clips (same noise
    draws with the adapter on and off)."""
    assert overfit_run.global_step == OVERFIT_STEPS
    assert len(overfit_run.losses) == OVERFIT_STEPS
    pipe, report = _pipeline_with_lora(demo_model, overfit_run.files["diffusers"])
    assert report.num_matched_modules > 0 and not report.unmatched_keys
    trained = _fixed_draw_loss(pipe.transformer, shared_cache, demo_model)
    pipe.transformer.disable_adapters()
    base = _fixed_draw_loss(pipe.transformer, shared_cache, demo_model)
    assert trained <= 0.5 * base, (base, trained)


def test_written_lora_moves_generation_towards_the_training_clip(overfit_run, shared_cache, demo_model):
    """Generating a training caption with the LoRA lands closer to that clip's latents than without it."""
    pipe, _ = _pipeline_with_lora(demo_model, overfit_run.files["diffusers"],
                                  ("transformer", "text_encoder", "tokenizer", "processor", "vae", "audio_vae"))
    for index, caption in enumerate(CAPTIONS):
        target = load_file(os.path.join(shared_cache, "video", f"{index:05d}.safetensors"))["latents"]

        def distance():
            out = pipe(caption, **TRAIN_CANVAS, num_inference_steps=10, output_type="latent",
                       generator=torch.Generator().manual_seed(index))
            return (out.frames - target).square().mean().item()

        pipe.transformer.enable_adapters()
        with_lora = distance()
        pipe.transformer.disable_adapters()
        without = distance()
        assert with_lora < 0.7 * without, (caption, with_lora, without)


def test_outputs_and_logs(overfit_run):
    out = overfit_run.output_dir
    for name in ("pytorch_lora_weights.safetensors", "adapter_config.json", "lora_comfyui.safetensors", "README.md"):
        assert (out / name).is_file(), name
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 16 and config["peft_type"] == "LORA"
    lines = (out / "logs" / "train_log.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, OVERFIT_STEPS + 1))
    card = (out / "README.md").read_text()
    assert "load_lora_weights" in card and CAPTIONS[0] in card
    # checkpoints every 100 steps and at the end, the LoRA factors only (no frozen base weights)
    assert [p.name for p in overfit_run.checkpoints] == ["checkpoint-100", "checkpoint-200", "checkpoint-300"]
    saved = load_file(str(out / "checkpoint-100" / "lora_adapter.safetensors"))
    assert saved and all("lora_" in key for key in saved)
    assert not any(name.startswith("model") for name in os.listdir(out / "checkpoint-100"))


def test_resume_continues_bitwise(tmp_path, two_clip_folder, demo_model, shared_cache):
    """Four steps in one go equal two steps, a checkpoint, and two more steps after resuming from it."""
    from diffusers_h3.training import train_lora

    straight = train_lora(train_config(demo_model, two_clip_folder, tmp_path / "straight", shared_cache,
                                       max_train_steps=4, checkpointing_steps=0))  # fmt: skip
    first = train_config(demo_model, two_clip_folder, tmp_path / "resumed", shared_cache, max_train_steps=2,
                         checkpointing_steps=0)  # fmt: skip
    train_lora(first)
    second = train_config(demo_model, two_clip_folder, tmp_path / "resumed", shared_cache, max_train_steps=4,
                          checkpointing_steps=0, resume_from_checkpoint="latest")  # fmt: skip
    resumed = train_lora(second)
    assert resumed.losses == straight.losses[2:]
    a, b = load_file(str(straight.files["diffusers"])), load_file(str(resumed.files["diffusers"]))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_interrupted_checkpoint_keeps_the_last_one(tmp_path, two_clip_folder, demo_model, shared_cache, monkeypatch):
    """A run killed while writing checkpoint-4 leaves checkpoint-2 complete; the next run resumes from it."""
    from accelerate import Accelerator

    from diffusers_h3.training import list_checkpoints, train_lora

    original = Accelerator.save_state

    def dies_half_way(self, output_dir=None, **kwargs):
        result = original(self, output_dir, **kwargs)
        if output_dir.endswith("checkpoint-4.tmp"):
            raise KeyboardInterrupt  # after the files are written, before the rename: the worst moment
        return result

    monkeypatch.setattr(Accelerator, "save_state", dies_half_way)
    config = train_config(demo_model, two_clip_folder, tmp_path / "run", shared_cache, max_train_steps=6,
                          checkpointing_steps=2)  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        train_lora(config)
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["checkpoint-2"]
    assert load_file(str(tmp_path / "run" / "checkpoint-2" / "lora_adapter.safetensors"))
    monkeypatch.setattr(Accelerator, "save_state", original)
    config.resume_from_checkpoint = "latest"
    result = train_lora(config)
    assert result.global_step == 6 and len(result.losses) == 4  # steps 3-6
    assert not list((tmp_path / "run").glob("*.tmp"))


def test_bad_options_fail_in_one_line_before_loading(tmp_path, two_clip_folder, demo_model, monkeypatch):
    from diffusers_h3.training import TrainingConfigError, train_lora
    from diffusers_h3.training import cache as cache_module

    monkeypatch.setattr(cache_module, "_load_pipeline", lambda *a, **k: pytest.fail("a model was loaded"))
    config = train_config(demo_model, two_clip_folder, tmp_path, num_frames=24, height=60, optimizer="adamw8bit",
                          stream_base=True, gradient_checkpointing=False)  # fmt: skip
    with pytest.raises(TrainingConfigError) as error:
        train_lora(config)
    message = str(error.value)
    assert "\n" not in message
    assert "num_frames=24 is not 17n+5" in message and "multiples of 32" in message
    assert "stream_base needs gradient_checkpointing" in message
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        assert "pip install bitsandbytes" in message


def test_a_streamed_base_trains_with_the_recipes_allocator_settings(monkeypatch, tmp_path):
    """On CUDA a streamed base gets expandable segments (what the 24 GB recipe was measured with); nothing else
    touches the allocator."""
    from types import SimpleNamespace

    import diffusers_h3.parallel.memory_recipes as recipes
    from diffusers_h3.training.trainer import allocator_for_streaming

    asked = []
    monkeypatch.setattr(recipes, "use_recipe_allocator_settings", lambda: asked.append(1) or "expandable segments")
    assert allocator_for_streaming(SimpleNamespace(stream_base=True), torch.device("cuda", 0)) == "expandable segments"
    assert allocator_for_streaming(SimpleNamespace(stream_base=False), torch.device("cuda", 0)) is None
    assert allocator_for_streaming(SimpleNamespace(stream_base=True), torch.device("cpu")) is None
    assert asked == [1]
