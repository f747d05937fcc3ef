"""NaN or inf in a clip (a diverged generation) is refused before export with one `ValueError` that names the likely
cause, never a codec traceback or a noise clip; nothing is written and an existing file keeps its bytes."""

import os

import numpy as np
import pytest
import torch

from diffusers_h3 import export_to_video
from diffusers_h3.testing.tiny import TINY_NUM_FRAMES, tiny_pipeline


av = pytest.importorskip("av")

FRAMES = np.random.default_rng(0).random((6, 32, 32, 3)).astype(np.float32)
AUDIO = (0.1 * torch.randn(2, 3200, generator=torch.Generator().manual_seed(0))).numpy()
CAUSE = "the generation diverged; likely causes: a non-finite or very large LoRA scale"


def _poisoned(array, value):
    array = array.copy()
    array.flat[7] = value
    return array


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("what", ["frames", "audio"])
def test_non_finite_frames_or_audio_are_refused_before_writing(tmp_path, what, value):
    target = tmp_path / "clip.mp4"
    export_to_video(FRAMES, target, audio=AUDIO)
    good = target.read_bytes()
    frames, audio = (_poisoned(FRAMES, value), AUDIO) if what == "frames" else (FRAMES, _poisoned(AUDIO, value))
    with pytest.raises(ValueError, match=f"the {what} hold 1 NaN/inf values of {frames.size if what == 'frames' else audio.size}: {CAUSE}"):
        export_to_video(frames, target, audio=audio)
    assert target.read_bytes() == good and sorted(os.listdir(tmp_path)) == ["clip.mp4"]


def test_non_finite_latents_are_refused_before_decoding(tmp_path):
    """A step callback that returns NaN latents (one of the causes the error names): decode_to_video refuses them
    before the VAE decodes or the writer opens."""
    pipe = tiny_pipeline(with_transformer_ref=False)

    def poison(pipe, step, timestep, tensors):
        return {"latents": torch.full_like(tensors["latents"], float("nan"))}

    out = pipe(prompt="a cat", height=32, width=32, num_frames=TINY_NUM_FRAMES, num_inference_steps=2,
               output_type="latent", callback_on_step_end=poison, generator=torch.Generator().manual_seed(0))  # fmt: skip
    pipe.vae.decode = lambda *a, **k: pytest.fail("the VAE decoded NaN latents")
    with pytest.raises(ValueError, match=f"the video latents hold {out.frames.numel()} NaN/inf values .*step callback"):
        pipe.decode_to_video(out.frames, out.audio, tmp_path / "clip.mp4")
    audio = out.audio.clone()
    audio[0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="the audio latents hold 1 NaN/inf values"):
        pipe.decode_to_video(torch.zeros_like(out.frames), audio, tmp_path / "clip.mp4")
    assert os.listdir(tmp_path) == []
