"""Bitwise parity with diffusers' own modular reference pipeline (CPU, fp32), for every task.

The oracle is `MiniMaxH3Blocks().get_workflow(task).init_pipeline()` with the very same component objects, inputs
and generator seed — never an earlier output of our own.
"""

import numpy as np
import pytest
import torch
from diffusers import MiniMaxH3Blocks, MiniMaxH3ModularPipeline
from PIL import Image

from diffusers_h3 import (
    MiniMaxH3AudioReference,
    MiniMaxH3ImageReference,
    MiniMaxH3Pipeline,
    MiniMaxH3VideoReference,
)
from diffusers_h3.testing.tiny import TINY_DURATION_LIMITS, TINY_NUM_FRAMES, tiny_components

from ..conftest import SMALL_CANVAS


COMMON = {"num_frames": TINY_NUM_FRAMES, "num_inference_steps": 3, "output_type": "np"}


@pytest.fixture(autouse=True)
def short_clips(monkeypatch):
    """Both pipelines allow the tiny pipeline's short clips: ours through its config, the reference (whose limits
    are fixed properties) for the duration of the test."""
    for name, value in (("min_duration", TINY_DURATION_LIMITS["min_duration_s"]),
                        ("max_duration", TINY_DURATION_LIMITS["max_duration_s"])):  # fmt: skip
        monkeypatch.setattr(MiniMaxH3ModularPipeline, name, property(lambda self, value=value: value))


def _random_image(width, height, seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8))


def _run_both(task, seed, **inputs):
    components = tiny_components(seed=seed)
    reference = MiniMaxH3Blocks().get_workflow(task).init_pipeline()
    reference.update_components(**{k: v for k, v in components.items() if k in reference.component_names})
    reference.register_to_config(**SMALL_CANVAS)
    expected = reference(**inputs, **COMMON, generator=torch.Generator().manual_seed(seed), output=["videos", "audio"])

    pipe = MiniMaxH3Pipeline(**components, **SMALL_CANVAS, **TINY_DURATION_LIMITS)
    ours = pipe(**inputs, **COMMON, generator=torch.Generator().manual_seed(seed))
    return expected, ours


def _assert_bitwise(expected, ours):
    assert ours.frames.shape == expected["videos"].shape
    assert ours.audio.shape == tuple(expected["audio"].shape)
    assert ours.sampling_rate == 32000
    assert np.array_equal(ours.frames, expected["videos"]), "video frames differ from diffusers' modular pipeline"
    assert torch.equal(torch.from_numpy(ours.audio), expected["audio"]), "audio differs from diffusers' modular pipeline"
    # Guard against a vacuous comparison (e.g. both all-zero): the output must actually vary.
    assert ours.frames.std() > 0 and np.abs(ours.audio).max() > 0


def test_t2va_bitwise():
    expected, ours = _run_both("t2va", seed=1, prompt="a red fox runs through snow", height=32, width=64)
    _assert_bitwise(expected, ours)


@pytest.mark.parametrize("which", ["first", "last", "both"])
def test_fl2va_bitwise(which):
    inputs = {"prompt": "the keyframe comes alive", "height": 32, "width": 32}
    if which in ("first", "both"):
        inputs["image"] = _random_image(40, 36, seed=3)
    if which in ("last", "both"):
        inputs["last_image"] = _random_image(52, 30, seed=4)
    expected, ours = _run_both("fl2va", seed=2, **inputs)
    _assert_bitwise(expected, ours)


def test_fl2va_canvas_from_keyframe_bitwise():
    # No height/width: the canvas follows the first keyframe's aspect at the configured short edge.
    expected, ours = _run_both("fl2va", seed=5, prompt="wide shot", image=_random_image(64, 32, seed=6))
    _assert_bitwise(expected, ours)
    assert ours.frames.shape[2:4] == (32, 64)


def test_ref2va_bitwise_image_video_audio():
    rng = np.random.default_rng(7)
    video = rng.integers(0, 256, size=(22, 32, 32, 3), dtype=np.uint8)
    soundtrack = torch.from_numpy(rng.uniform(-0.5, 0.5, size=(2, 32000)).astype(np.float32))
    voice = torch.from_numpy(rng.uniform(-0.5, 0.5, size=(1, 16000)).astype(np.float32))
    references = [
        MiniMaxH3ImageReference(image=_random_image(48, 40, seed=8)),
        MiniMaxH3VideoReference(frames=video, fps=24.0, audio=soundtrack, sample_rate=32000),
        MiniMaxH3AudioReference(audio=voice, sample_rate=32000),
    ]
    expected, ours = _run_both(
        "ref2va", seed=9, prompt="<Picture 1> walks while <Audio 2> speaks", references=references, height=32, width=32
    )
    _assert_bitwise(expected, ours)
