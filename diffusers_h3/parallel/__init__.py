"""Multi-GPU: context parallelism for the DiT, parallel VAE decode, placement recipes, and a rank launcher."""

from .context_parallel import context_parallel_state, enable_context_parallel


__all__ = ["context_parallel_state", "enable_context_parallel"]
