"""Attention processors for ``MiniMaxH3Attention`` (all built on :class:`MiniMaxH3AttnProcessorBase`); the
packed-layout side channel they read is ``diffusers_h3.layout``. A processor is one module here, registered with
:func:`register_attention_processor` (``install.py``), and imported below."""

from .base import MiniMaxH3AttnProcessorBase, PlanForInputs
from .call_plan import install_call_plan_hook
from .fa_v100 import MiniMaxH3FAV100Processor
from .flashinfer import (
    FlashInferAttentionConfig,
    MiniMaxH3FlashInferProcessor,
    disable_flashinfer_attention,
    enable_flashinfer_attention,
    flashinfer_attention_state,
)
from .install import (
    AttentionProcessorRegistry,
    attention_processor_state,
    disable_attention_processor,
    enable_attention_processor,
    register_attention_processor,
)
from .low_precision import (
    LowPrecisionAttentionConfig,
    MiniMaxH3LowPrecisionAttnProcessor,
    disable_low_precision_attention,
    enable_low_precision_attention,
    low_precision_attention_state,
)
from .tiling import TilePlan, build_tile_plan
from .vsa import (
    MiniMaxH3VSAProcessor,
    VSAConfig,
    add_gate_compress,
    disable_vsa,
    enable_vsa,
    set_vsa_head_groups,
    vsa_attention,
    vsa_state,
)


__all__ = [
    "AttentionProcessorRegistry",
    "attention_processor_state",
    "disable_attention_processor",
    "enable_attention_processor",
    "register_attention_processor",
    "MiniMaxH3AttnProcessorBase",
    "PlanForInputs",
    "install_call_plan_hook",
    "MiniMaxH3FAV100Processor",
    "MiniMaxH3FlashInferProcessor",
    "MiniMaxH3LowPrecisionAttnProcessor",
    "MiniMaxH3VSAProcessor",
    "VSAConfig",
    "FlashInferAttentionConfig",
    "LowPrecisionAttentionConfig",
    "TilePlan",
    "build_tile_plan",
    "add_gate_compress",
    "disable_flashinfer_attention",
    "disable_low_precision_attention",
    "disable_vsa",
    "enable_flashinfer_attention",
    "enable_low_precision_attention",
    "enable_vsa",
    "flashinfer_attention_state",
    "low_precision_attention_state",
    "vsa_attention",
    "vsa_state",
    "set_vsa_head_groups",
]
