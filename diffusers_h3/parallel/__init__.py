"""Multi-GPU: context and tensor parallelism for the DiT, parallel VAE decode, placement recipes, and a rank launcher."""

from .context_parallel import context_parallel_state, enable_context_parallel
from .placement import (
    balanced_kwargs,
    drop_unused_text_encoder_layers,
    enable_low_memory_offload,
    place_for_context_parallel,
    single_gpu_resident_kwargs,
    split_transformer_kwargs,
)
from .ranks import is_main_rank
from .tensor_parallel import (
    enable_tensor_parallel,
    load_transformer_tensor_parallel,
    ordered_sum_reduce,
    tensor_parallel_state,
)
from .vae import parallel_vae_decode


__all__ = [
    "balanced_kwargs",
    "context_parallel_state",
    "drop_unused_text_encoder_layers",
    "enable_context_parallel",
    "enable_low_memory_offload",
    "enable_tensor_parallel",
    "is_main_rank",
    "load_transformer_tensor_parallel",
    "ordered_sum_reduce",
    "parallel_vae_decode",
    "place_for_context_parallel",
    "single_gpu_resident_kwargs",
    "split_transformer_kwargs",
    "tensor_parallel_state",
]
