"""Tiny random MiniMax-H3 components, built offline, for tests and the offline demo.

Every component is the real class (Qwen3-VL text encoder, byte-level Qwen2 tokenizer, Qwen3-VL processor, the H3
video/audio VAEs, transformer and schedulers) with a tiny config. Random weights make noise, not video; the point is
that every code path runs in about a second on a CPU.

The geometry is kept where the pipeline relies on it: the video VAE compresses 16x spatially and 4x temporally
(17n+5 pixel frames -> 5n+2 latent frames), the audio VAE hops 800 samples at 32 kHz (40 latents/s), and the text
encoder has more than 50 decoder layers by default so that `hidden_states[50]` exists, as in the released model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, Optional, Union

import torch


HUB_REPO_ID = "MiniMaxAI/MiniMax-H3"
# The embedded demo checkpoint holds the t2va / fl2va partition only.
DEMO_PARTITIONS = ("transformer",)
# The demo checkpoint's pipeline config: its default canvas is 64x96 (height x width), which the tiny model runs in
# seconds on a CPU (the released rule, 768x1344, takes minutes and GBs of RAM here). Saved into the checkpoint, so
# `MiniMaxH3Pipeline.from_pretrained(demo_checkpoint_dir())` defaults to it as `diffusers-h3 generate` does.
DEMO_PIPELINE_CONFIG = {"canvas_short_edge": 64, "canvas_max_pixels": 64 * 96}
# Part of the demo's cache folder name: a checkpoint built by an older version is rebuilt, not reused.
DEMO_CHECKPOINT_VERSION = 2

TINY_TRANSFORMER_CONFIG = {
    "num_attention_heads": 2,
    "attention_head_dim": 32,
    "hidden_size": 32,
    "num_layers": 2,
    "num_refiner_layers": 1,
    "ffn_dim": 64,
    "in_channels": 4,
    "audio_in_channels": 8,
    "text_dim": 16,
    "freq_dim": 32,
    "time_embed_hidden_dim": 32,
    "time_embed_dim": 16,
    "rope_freq_dim": 4,
}

TINY_VAE_CONFIG = {
    "latent_channels": 4,
    "block_out_channels": (8, 8, 8, 8, 8, 8),
    "layers_per_block": 1,
    "norm_num_groups": 4,
    "decoder_num_layers": 1,
    "decoder_num_attention_heads": 2,
    "decoder_attention_head_dim": 16,
    "decoder_num_register_tokens": 1,
}

# The tiny pipeline's clip lengths (its config's `min_duration_s` / `max_duration_s`): from one VAE chunk (22 frames,
# 0.9 s at 24 fps) so that end-to-end tests run short clips; the released model's are 5-15 s.
TINY_DURATION_LIMITS = {"min_duration_s": 0.5, "max_duration_s": 15.0}
# The shortest clip the tiny pipeline generates: one VAE chunk (17 + 5 frames).
TINY_NUM_FRAMES = 22

TINY_AUDIO_VAE_CONFIG = {"encoder_dim": 4, "latent_dim": 16, "latent_channels": 8, "num_attention_heads": 2, "decoder_dim": 128}

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def tiny_tokenizer():
    """Byte-level Qwen2 tokenizer: the 256 GPT-2 byte symbols, end-of-text and the four vision tokens (ids 257-260)."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {symbol: index for index, symbol in enumerate(bytes_to_unicode().values())}
    vocab["<|endoftext|>"] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    return tokenizer


def tiny_processor(tokenizer=None):
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    kwargs = {
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "size": {"shortest_edge": 32 * 32, "longest_edge": 64 * 64},
    }
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(**kwargs),
        tokenizer=tokenizer if tokenizer is not None else tiny_tokenizer(),
        video_processor=Qwen3VLVideoProcessor(**kwargs),
    )


def tiny_text_encoder(num_hidden_layers: int = 51, hidden_size: int = 16):
    """A Qwen3-VL conditioner whose `hidden_states[50]` exists (51 decoder layers by default)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tokenizer_ids = {token: 257 + i for i, token in enumerate(VISION_TOKENS)}
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": 261,
            "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": num_hidden_layers,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5e5,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
        },
        vision_config={
            "depth": 2,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": hidden_size,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [1],
        },
        image_token_id=tokenizer_ids["<|image_pad|>"],
        video_token_id=tokenizer_ids["<|video_pad|>"],
        vision_start_token_id=tokenizer_ids["<|vision_start|>"],
        vision_end_token_id=tokenizer_ids["<|vision_end|>"],
    )
    return Qwen3VLForConditionalGeneration(config).eval()


def tiny_transformer(**overrides):
    from diffusers import MiniMaxH3Transformer3DModel

    return MiniMaxH3Transformer3DModel(**{**TINY_TRANSFORMER_CONFIG, **overrides}).eval()


def tiny_transformer_inputs(
    seed: int = 0,
    seq_text: int = 5,
    seq_audio: int = 4,
    grid=(2, 2, 3),
    video_scale: float = 1.0,
    text_scale: float = 1.0,
    video_dim: int = 16,
    audio_dim: int = 8,
    text_dim: int = 16,
):
    """Forward kwargs for a transformer with :data:`TINY_TRANSFORMER_CONFIG`'s input widths: a packed
    ``[text | audio | video]`` sequence, video rows on an integer (t, h, w) grid, one timestep for every row."""
    gen = torch.Generator().manual_seed(seed)
    n_video = grid[0] * grid[1] * grid[2]
    seq = seq_text + seq_audio + n_video
    pos = torch.zeros(seq, 3, dtype=torch.long)
    pos[seq_text + seq_audio :] = torch.stack(
        torch.meshgrid(*(torch.arange(g) for g in grid), indexing="ij"), -1
    ).reshape(-1, 3)
    return {
        "hidden_states": torch.randn(1, n_video, video_dim, generator=gen) * video_scale,
        "audio_hidden_states": torch.randn(1, seq_audio, audio_dim, generator=gen),
        "encoder_hidden_states": torch.randn(1, seq_text, text_dim, generator=gen) * text_scale,
        "timestep": torch.tensor([0.7]),
        "timestep_indices": torch.zeros(seq, dtype=torch.long),
        "token_tags": torch.tensor([1] * seq_text + [2] * seq_audio + [0] * n_video),
        "position_ids": pos,
        "video_indices": torch.arange(seq_text + seq_audio, seq),
        "audio_indices": torch.arange(seq_text, seq_text + seq_audio),
        "text_indices": torch.arange(seq_text),
    }


def tiny_vae():
    from diffusers import AutoencoderKLMiniMaxH3

    channels = TINY_VAE_CONFIG["latent_channels"]
    mean = [0.1 * (i - channels / 2) for i in range(channels)]
    std = [0.5 + 0.25 * i for i in range(channels)]
    return AutoencoderKLMiniMaxH3(**TINY_VAE_CONFIG, latents_mean=mean, latents_std=std).eval()


def tiny_audio_vae():
    from diffusers import AutoencoderKLMiniMaxH3Audio

    channels = TINY_AUDIO_VAE_CONFIG["latent_channels"]
    mean = [0.05 * (i - channels / 2) for i in range(channels)]
    std = [0.75 + 0.1 * i for i in range(channels)]
    return AutoencoderKLMiniMaxH3Audio(**TINY_AUDIO_VAE_CONFIG, latents_mean=mean, latents_std=std).eval()


def tiny_components(
    seed: int = 0,
    text_encoder_layers: int = 51,
    with_transformer: bool = True,
    with_transformer_ref: bool = True,
) -> Dict[str, object]:
    """All pipeline components, random but reproducible for a given `seed` (the global RNG is left untouched)."""
    from diffusers import MiniMaxH3Scheduler

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tokenizer = tiny_tokenizer()
        components = {
            "text_encoder": tiny_text_encoder(num_hidden_layers=text_encoder_layers),
            "tokenizer": tokenizer,
            "processor": tiny_processor(tokenizer),
            "vae": tiny_vae(),
            "audio_vae": tiny_audio_vae(),
            "scheduler": MiniMaxH3Scheduler(shift=12.0),
            "audio_scheduler": MiniMaxH3Scheduler(shift=3.0),
            "transformer": tiny_transformer() if with_transformer else None,
            "transformer_ref": tiny_transformer() if with_transformer_ref else None,
        }
    return components


def tiny_pipeline(seed: int = 0, text_encoder_layers: int = 51, **kwargs):
    """A `MiniMaxH3Pipeline` over :func:`tiny_components`, allowing short clips (:data:`TINY_DURATION_LIMITS`, e.g.
    `num_frames=22`) unless `min_duration_s` / `max_duration_s` are passed; other pipeline config values (e.g.
    `canvas_short_edge`) are passed on to the pipeline, the rest to :func:`tiny_components`."""
    from ..pipelines.loading import PIPELINE_CONFIG_KEYS
    from ..pipelines.pipeline_minimax_h3 import MiniMaxH3Pipeline

    text_encoder_layer = kwargs.pop("text_encoder_layer", min(50, text_encoder_layers - 1))
    config = {**TINY_DURATION_LIMITS, **{name: kwargs.pop(name) for name in PIPELINE_CONFIG_KEYS if name in kwargs}}
    components = tiny_components(seed=seed, text_encoder_layers=text_encoder_layers, **kwargs)
    return MiniMaxH3Pipeline(**components, text_encoder_layer=text_encoder_layer, **config)


def save_hub_layout(components: Dict[str, object], directory: Union[str, os.PathLike], repo_id: str = HUB_REPO_ID) -> Path:
    """Write `components` in the layout of the official hub repository.

    That is: one subfolder per component, a `modular_model_index.json` whose entries name the hub repo id (a local
    snapshot must resolve them relative to its own directory) and a root `model_index.json` naming the modular class.
    """
    import diffusers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    index = {
        "_class_name": "MiniMaxH3ModularPipeline",
        "_blocks_class_name": "MiniMaxH3Blocks",
        "_diffusers_version": diffusers.__version__,
    }
    for name, component in components.items():
        if component is None:
            continue
        component.save_pretrained(directory / name)
        library = "transformers" if type(component).__module__.startswith("transformers") else "diffusers"
        index[name] = [
            library,
            type(component).__name__,
            {
                "type_hint": [library, type(component).__name__],
                "pretrained_model_name_or_path": repo_id,
                "subfolder": name,
                "variant": None,
                "revision": None,
            },
        ]
    (directory / "modular_model_index.json").write_text(json.dumps(index, indent=2))
    root_index = {"_class_name": "MiniMaxH3ModularPipeline", "_diffusers_version": diffusers.__version__}
    for name, entry in index.items():
        if not name.startswith("_"):
            root_index[name] = entry[:2]
    (directory / "model_index.json").write_text(json.dumps(root_index, indent=2))
    return directory


def save_to_hub_cache(
    components: Dict[str, object],
    cache_dir: Union[str, os.PathLike],
    repo_id: str = HUB_REPO_ID,
    revision: str = "0123456789abcdef0123456789abcdef01234567",
    layout: str = "hub",
) -> Path:
    """Write `components` into a `huggingface_hub` cache as the snapshot `revision` of `repo_id` (and point the
    `main` ref at it), so that loading by repo id works offline: `cache_dir/models--org--name/snapshots/<rev>/...`.

    `layout` is `"hub"` (the official layout, :func:`save_hub_layout`) or `"ours"` (`MiniMaxH3Pipeline.save_pretrained`).
    Returns the snapshot folder.
    """
    repo_folder = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo_folder / "snapshots" / revision
    if layout == "hub":
        save_hub_layout(components, snapshot, repo_id=repo_id)
    elif layout == "ours":
        from ..pipelines.pipeline_minimax_h3 import MiniMaxH3Pipeline

        MiniMaxH3Pipeline(**components).save_pretrained(snapshot)
    else:
        raise ValueError(f"`layout` must be 'hub' or 'ours', got {layout!r}.")
    (repo_folder / "refs").mkdir(parents=True, exist_ok=True)
    (repo_folder / "refs" / "main").write_text(revision)
    return snapshot


def demo_pipeline_config() -> Dict[str, object]:
    """The pipeline config the demo checkpoint is saved with (its canvas rule and :data:`TINY_DURATION_LIMITS`): what
    the CLI checks a request against before building the checkpoint."""
    return {**TINY_DURATION_LIMITS, **DEMO_PIPELINE_CONFIG}


def demo_checkpoint_dir(cache_dir: Optional[Union[str, os.PathLike]] = None) -> Path:
    """The embedded tiny demo checkpoint, built offline into a cache folder on first use (our own save layout): a
    folder that `MiniMaxH3Pipeline.from_pretrained` loads, whose default canvas is the demo's 64x96
    (:data:`DEMO_PIPELINE_CONFIG`). Default folder: `$XDG_CACHE_HOME/diffusers_h3/tiny-demo-v<N>` (`~/.cache/...`)."""
    if cache_dir is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        cache_dir = Path(base) / "diffusers_h3" / f"tiny-demo-v{DEMO_CHECKPOINT_VERSION}"
    cache_dir = Path(cache_dir)
    if (cache_dir / "model_index.json").exists():
        return cache_dir
    pipe = tiny_pipeline(seed=0, with_transformer_ref="transformer_ref" in DEMO_PARTITIONS, **demo_pipeline_config())
    tmp = cache_dir.with_name(cache_dir.name + ".tmp")
    pipe.save_pretrained(tmp)
    tmp.replace(cache_dir) if not cache_dir.exists() else None
    return cache_dir
