"""Shared tiny setup for the context-parallel tests: a 4-head transformer (so degrees 2 and 4 split the heads)."""

import torch

from diffusers_h3.testing.tiny import TINY_TRANSFORMER_CONFIG, tiny_transformer_inputs


# The rope rotates 2 * 3 * rope_freq_dim = 24 channels, so heads stay 32 wide; 4 heads divide by 2 and 4.
CP_TRANSFORMER_CONFIG = {**TINY_TRANSFORMER_CONFIG, "num_attention_heads": 4, "attention_head_dim": 32}


def cp_transformer(seed: int = 0, **overrides):
    from diffusers import MiniMaxH3Transformer3DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MiniMaxH3Transformer3DModel(**{**CP_TRANSFORMER_CONFIG, **overrides}).eval()


def cp_inputs(seq_text: int, batch: int = 1, seed: int = 0):
    inputs = tiny_transformer_inputs(seed=seed, seq_text=seq_text)
    for name in ("hidden_states", "audio_hidden_states", "encoder_hidden_states"):
        inputs[name] = inputs[name].repeat(batch, 1, 1) * torch.linspace(1.0, 0.5, batch).view(-1, 1, 1)
    return inputs


def forward(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out.sample.clone(), out.audio_sample.clone()


VSA_GRID = (3, 5, 6)  # 2x2x4 tiles: partial in every axis, 12 video tiles so that sparsity 0.8 drops some


def vsa_inputs(seq_text: int = 5, seq_audio: int = 4, grid=VSA_GRID, seed: int = 1):
    """Forward kwargs on a larger video grid plus the matching `PackedLayout` ([text | audio | video])."""
    from diffusers_h3.layout import LayoutSegment, PackedLayout

    inputs = tiny_transformer_inputs(seed=seed, seq_text=seq_text, seq_audio=seq_audio, grid=grid)
    n_video = grid[0] * grid[1] * grid[2]
    seq = seq_text + seq_audio + n_video
    layout = PackedLayout(
        (
            LayoutSegment("text", "prompt", 0, seq_text),
            LayoutSegment("audio", "target", seq_text, seq_text + seq_audio),
            LayoutSegment("video", "target", seq_text + seq_audio, seq, grid=grid),
        ),
        seq_len=seq,
    )
    return inputs, layout


def add_random_gates(model, seed: int = 0):
    """VSA's `to_gate_compress` on every block, with random (not zero) weights so that the gate changes the output."""
    from diffusers_h3.attention_processors import add_gate_compress

    add_gate_compress(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in model.transformer_blocks:
            weight = block.attn.to_gate_compress.weight
            weight.copy_(torch.randn(weight.shape, generator=gen) * 0.3)
    return model


def forward_with_layout(model, inputs, layout):
    from diffusers_h3.layout import use_packed_layout

    with use_packed_layout(layout):
        return forward(model, inputs)
