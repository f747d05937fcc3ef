"""LoRA training for MiniMax-H3 (docs/training.md): a data folder of clips or images with captions, a two-pass
trainer (encode everything into a cache one model at a time, then train the DiT's LoRA from the cache with only the
DiT loaded) over any base the plugin loads, and LoRA files in diffusers', PEFT's and ComfyUI's layouts."""

from .cache import CacheError, CacheSettings, LatentCache
from .data import (
    DataFolderError,
    DataItem,
    check_data_folder,
    decode_sample,
    read_metadata,
    write_clip,
    write_metadata,
)
from .lora_files import save_trained_lora, to_comfyui_layout
from .loss import FlowMatchingConfig, flow_matching_loss, pack_sample, shift_sigma
from .trainer import (
    DEFAULT_TARGET_MODULES,
    TrainingConfigError,
    TrainLoraConfig,
    TrainResult,
    list_checkpoints,
    train_lora,
)


__all__ = [
    "CacheError",
    "CacheSettings",
    "DEFAULT_TARGET_MODULES",
    "DataFolderError",
    "DataItem",
    "FlowMatchingConfig",
    "LatentCache",
    "TrainLoraConfig",
    "TrainResult",
    "TrainingConfigError",
    "check_data_folder",
    "decode_sample",
    "flow_matching_loss",
    "list_checkpoints",
    "pack_sample",
    "read_metadata",
    "save_trained_lora",
    "shift_sigma",
    "to_comfyui_layout",
    "train_lora",
    "write_clip",
    "write_metadata",
]
