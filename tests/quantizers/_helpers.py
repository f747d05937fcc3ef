"""Shared by the quantizer tests: the built-in formats, a tiny transformer's inputs and a relative error."""

import torch

from diffusers_h3.quantizers import FP8Config, FP8Tensor, NVFP4Config, NVFP4Tensor, W8A16Config, W8A16Tensor


CONFIGS = {"w8a16": W8A16Config, "nvfp4": NVFP4Config, "fp8": FP8Config}
WEIGHTS = {"w8a16": W8A16Tensor, "nvfp4": NVFP4Tensor, "fp8": FP8Tensor}
# rel-L2 of a tiny transformer's output vs its dense twin (random weights; NVFP4 and FP8-with-activations are coarse)
MODEL_TOL = {"w8a16": 0.03, "nvfp4": 0.35, "fp8": 0.12}


def transformer_inputs(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    n_video, n_audio, n_text = 8, 3, 5
    s = n_text + n_audio + n_video
    return {
        "hidden_states": torch.randn(1, n_video, cfg.in_channels * 4, generator=g),
        "audio_hidden_states": torch.randn(1, n_audio, cfg.audio_in_channels, generator=g),
        "encoder_hidden_states": torch.randn(1, n_text, cfg.text_dim, generator=g),
        "timestep": torch.tensor([0.7, 0.3]),
        "timestep_indices": torch.cat([torch.zeros(n_text + n_audio), torch.ones(n_video)]).long(),
        "token_tags": torch.tensor([1] * n_text + [2] * n_audio + [0] * n_video),
        "position_ids": torch.randint(0, 4, (s, 3), generator=g),
        "video_indices": torch.arange(n_text + n_audio, s),
        "audio_indices": torch.arange(n_text, n_text + n_audio),
        "text_indices": torch.arange(n_text),
    }


def run_transformer(model, seed=0):
    with torch.no_grad():
        out = model(**transformer_inputs(model, seed), return_dict=False)
    return torch.cat([out[0].flatten(), out[1].flatten()])


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()
