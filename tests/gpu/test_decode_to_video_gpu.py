"""GPU checks of the chunk-by-chunk decode into the MP4 writer (`python -m pytest -m gpu tests/gpu`): in bf16 with the
fast presets' batched decode the chunks equal the whole-clip decode bitwise when the batches hold one chunk's tiles
each (as at 768x1344: 28 tiles per chunk, balanced batches of 28; compiled: within one 8-bit level, deterministic),
and `decode_to_video` moves an offloaded VAE onto the GPU as `vae.decode` does."""

import numpy as np
import pytest
import torch

from diffusers_h3 import FastVAEDecodeConfig, enable_fast_vae_decode
from diffusers_h3.pipelines.export import _frames_to_uint8
from diffusers_h3.testing.tiny import tiny_pipeline


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CALL = {"prompt": "a cat", "height": 64, "width": 96, "num_frames": 124, "num_inference_steps": 3}


def _pipe(dtype=torch.float32):
    pipe = tiny_pipeline(seed=5, with_transformer_ref=False)
    with torch.no_grad():
        for param in pipe.vae.decoder.parameters():
            param.normal_(0.0, 0.3)
    pipe.vae.enable_tiling(32, 32, 16, 16)  # 6 tiles per temporal chunk
    return pipe.to("cuda", dtype)


@pytest.mark.parametrize("compile", [False, True])
def test_bf16_batched_chunks_equal_the_whole_batched_decode(compile):
    pipe = _pipe(torch.bfloat16)
    # one chunk's tiles per call, whole or streamed
    enable_fast_vae_decode(pipe, FastVAEDecodeConfig(batch_tiles=6, compile=compile))
    out = pipe(**CALL, output_type="latent", generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # as inside the pipeline's calls
        whole = pipe._decode_video(out.frames, "np", torch.device("cuda"))
        chunks = list(pipe._decode_video_chunks(out.frames, torch.device("cuda")))
    streamed, reference = np.concatenate(chunks), _frames_to_uint8(whole[0])
    if not compile:
        assert np.array_equal(streamed, reference)
        return
    # Compiled, the chunk calls and the whole decode's calls may run differently specialised kernels (bf16 rounding):
    # equal within one 8-bit level, and the streamed decode is deterministic.
    assert np.abs(streamed.astype(np.int16) - reference.astype(np.int16)).max() <= 1
    with torch.no_grad():
        again = np.concatenate(list(pipe._decode_video_chunks(out.frames, torch.device("cuda"))))
    assert np.array_equal(again, streamed)


def _decoded(path):
    import av

    with av.open(str(path)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def test_decode_to_video_under_model_cpu_offload(tmp_path):
    reference = _pipe()
    out = reference(**CALL, output_type="latent", generator=torch.Generator().manual_seed(0))
    expected = reference.decode_to_video(out.frames, out.audio, tmp_path / "resident.mp4")
    offloaded = tiny_pipeline(seed=5, with_transformer_ref=False)
    offloaded.vae.load_state_dict(reference.vae.state_dict())
    offloaded.vae.enable_tiling(32, 32, 16, 16)
    offloaded.enable_model_cpu_offload(device="cuda")
    path = offloaded.decode_to_video(out.frames.cpu(), out.audio.cpu(), tmp_path / "offloaded.mp4")
    assert offloaded._h3_last_export["decode"].startswith("streamed")
    assert np.array_equal(_decoded(path), _decoded(expected))  # the same frames went into the same encoder
    assert next(offloaded.vae.parameters()).device.type == "cpu"  # offloaded again after the decode
