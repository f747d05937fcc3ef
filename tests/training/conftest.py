"""Shared data and runs of the training tests: a two-clip data folder, its cache (pass 1 once per session) and one
overfit run on the tiny demo checkpoint that several tests read."""

import contextlib

import numpy as np
import pytest
import torch

import diffusers_h3  # noqa: F401  (imported at collection, before any test changes TRITON_INTERPRET)


TRAIN_CANVAS = {"height": 64, "width": 96, "num_frames": 22}  # the demo checkpoint's canvas, one VAE chunk
CAPTIONS = ("a red gradient hums low", "a blue stripe whistles high")
# Wide targets for the tiny model (2 blocks): the overfit needs the capacity; the ComfyUI export covers every name.
WIDE_TARGETS = r".*(to_q|to_k|to_v|to_out\.0|net\.0\.proj|net\.2|proj_out|audio_proj_out)"
OVERFIT_STEPS = 300


@contextlib.contextmanager
def one_thread():
    """The tiny model's ops are microseconds of work: on a CPU shared with other jobs, one thread avoids the thread
    pool's contention (measured: 20x faster here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def clip_frames(index: int, num_frames: int = 22) -> np.ndarray:
    """A clip that is easy to tell apart from the other: a moving colour gradient, red-ish or blue-ish."""
    height, width = TRAIN_CANVAS["height"], TRAIN_CANVAS["width"]
    ramp = np.linspace(0, 1, width)[None, None, :]
    time = np.arange(num_frames)[:, None, None] / num_frames
    frames = np.zeros((num_frames, height, width, 3))
    channel = 0 if index == 0 else 2
    frames[..., channel] = 200 * ((ramp + time) % 1.0)
    frames[..., 1] = 40 + 30 * index
    return frames.astype(np.uint8)


def clip_audio(index: int, num_frames: int = 22, rate: int = 32000) -> torch.Tensor:
    t = np.arange(int(round(num_frames / 24 * rate))) / rate
    tone = 0.3 * np.sin(2 * np.pi * (220 + 440 * index) * t)
    return torch.tensor(np.stack([tone, tone]), dtype=torch.float32)


def write_two_clips(folder, num_frames: int = 22):
    from diffusers_h3.training import write_clip, write_metadata

    folder.mkdir(parents=True, exist_ok=True)
    for index in range(2):
        write_clip(folder / f"clip{index}.mp4", clip_frames(index, num_frames), clip_audio(index, num_frames), 32000)
    write_metadata(folder, [(f"clip{i}.mp4", CAPTIONS[i]) for i in range(2)])
    return folder


@pytest.fixture(scope="session")
def demo_model():
    from diffusers_h3.testing.tiny import demo_checkpoint_dir

    return str(demo_checkpoint_dir())


@pytest.fixture(scope="session")
def two_clip_folder(tmp_path_factory):
    return write_two_clips(tmp_path_factory.mktemp("two_clips"))


def train_config(demo_model, data_dir, output_dir, cache_dir=None, **overrides):
    from diffusers_h3.training import TrainLoraConfig

    options = dict(model=demo_model, data_dir=str(data_dir), output_dir=str(output_dir), cache_dir=cache_dir,
                   **TRAIN_CANVAS, rank=16, target_modules=WIDE_TARGETS, learning_rate=2e-2, dtype="float32",
                   device="cpu", max_train_steps=OVERFIT_STEPS, checkpointing_steps=100, seed=0)  # fmt: skip
    options.update(overrides)
    return TrainLoraConfig(**options)


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory, two_clip_folder, demo_model):
    """Pass 1 over the two clips, once: runs that share it skip encoding."""
    from diffusers_h3.training import LatentCache, check_data_folder
    from diffusers_h3.training.cache import CacheSettings

    folder = tmp_path_factory.mktemp("cache")
    items = check_data_folder(two_clip_folder, TRAIN_CANVAS["num_frames"])
    settings = CacheSettings(demo_model, "t2va", TRAIN_CANVAS["height"], TRAIN_CANVAS["width"], TRAIN_CANVAS["num_frames"])
    with one_thread():
        LatentCache(folder, settings, items).encode(device="cpu", dtype=torch.float32)
    return str(folder)


@pytest.fixture(scope="session")
def overfit_run(tmp_path_factory, two_clip_folder, demo_model, shared_cache):
    """300 steps on the two clips (the overfit, LoRA-loading and export tests read it)."""
    from diffusers_h3.training import train_lora

    output = tmp_path_factory.mktemp("overfit")
    with one_thread():
        return train_lora(train_config(demo_model, two_clip_folder, output, shared_cache))
