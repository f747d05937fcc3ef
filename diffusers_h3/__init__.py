"""diffusers-h3: MiniMax-H3 (video + 32 kHz stereo audio) inside Hugging Face Diffusers.

`import diffusers_h3` registers `MiniMaxH3Pipeline` with diffusers, so that `DiffusionPipeline.from_pretrained(...)`
resolves it for both our own layout and the official hub layout, and registers the quantizers with diffusers.
"""

# First: a torch / torchvision pair that does not fit together is named in one line before diffusers imports it.
from . import _torch_install  # noqa: F401, I001

from diffusers.modular_pipelines.minimax_h3.references import (
    MiniMaxH3AudioReference,
    MiniMaxH3ImageReference,
    MiniMaxH3Reference,
    MiniMaxH3VideoReference,
)

from ._integration import _register_with_diffusers
from ._report import describe
from ._utils import attach_to_diffusers_logging
from ._version import __version__
from .attention_processors import (
    FlashInferAttentionConfig,
    LowPrecisionAttentionConfig,
    MiniMaxH3AttnProcessorBase,
    MiniMaxH3FAV100Processor,
    MiniMaxH3FlashInferProcessor,
    MiniMaxH3LowPrecisionAttnProcessor,
    MiniMaxH3VSAProcessor,
    VSAConfig,
    add_gate_compress,
    attention_processor_state,
    disable_attention_processor,
    disable_flashinfer_attention,
    disable_low_precision_attention,
    disable_vsa,
    enable_attention_processor,
    enable_flashinfer_attention,
    enable_low_precision_attention,
    enable_vsa,
    flashinfer_attention_state,
    install_call_plan_hook,
    low_precision_attention_state,
    register_attention_processor,
    set_vsa_head_groups,
    vsa_state,
)
from .hooks.fast_vae_decode import FastVAEDecodeConfig, disable_fast_vae_decode, enable_fast_vae_decode, vae_decode
from .hooks.v100_mode import NonFiniteActivationError, V100Mode, V100ModeConfig, disable_v100_mode, enable_v100_mode
from .kernels.attention.fa_v100 import FAV100BuildError, fa_v100_attention, fa_v100_reference
from .layout import (
    LayoutSegment,
    PackedLayout,
    current_packed_layout,
    require_packed_layout,
    use_packed_layout,
)
from .loaders.fasth3 import KNOWN_FASTH3_PRESETS, FastH3Preset, apply_fasth3_payload, split_fasth3_state_dict
from .loaders.fasth3_vae import load_nvfp4_decoder
from .loaders.lora import LoraLoadReport, MiniMaxH3LoraMixin
from .loaders.lora_presets import KNOWN_PRESETS, LoraDistillationPreset, get_preset
from .loaders.single_file import TransformerFileError, load_transformer_file
from .parallel.memory_model import RequestShape
from .parallel.memory_recipes import MemoryBudgetConfig, plan_request
from .pipelines import MiniMaxH3Pipeline, MiniMaxH3PipelineOutput, VideoWriter, export_to_video
from .pipelines.fasth3 import enable_fasth3_preset, load_fasth3_adapter
from .pipelines.recipe_loading import load_for_memory_budget
from .pipelines.speed_presets import SPEED_PRESETS, SpeedPresetConfig, enable_speed_preset, speed_preset_record
from .quantizers import (
    FP8Config,
    FP8Tensor,
    NVFP4Config,
    NVFP4Tensor,
    QuantizedTensor,
    QuantMethod,
    W8A16Config,
    W8A16Tensor,
    quantization_summary,
    quantize,
)
from .tasks import TASKS, TaskSpec, select_task


__all__ = [
    # User API: the pipeline, its inputs and outputs, fast paths, LoRA, quantization, reporting.
    "MiniMaxH3Pipeline",
    "MiniMaxH3PipelineOutput",
    "MiniMaxH3Reference",
    "MiniMaxH3ImageReference",
    "MiniMaxH3VideoReference",
    "MiniMaxH3AudioReference",
    "TASKS",
    "TaskSpec",
    "select_task",
    "export_to_video",
    "VideoWriter",
    "describe",
    "enable_vsa",
    "disable_vsa",
    "vsa_state",
    "set_vsa_head_groups",
    "VSAConfig",
    "add_gate_compress",
    "enable_low_precision_attention",
    "LowPrecisionAttentionConfig",
    "disable_low_precision_attention",
    "low_precision_attention_state",
    "enable_flashinfer_attention",
    "FlashInferAttentionConfig",
    "disable_flashinfer_attention",
    "flashinfer_attention_state",
    "enable_fast_vae_decode",
    "FastVAEDecodeConfig",
    "vae_decode",
    "disable_fast_vae_decode",
    "enable_v100_mode",
    "V100ModeConfig",
    "disable_v100_mode",
    "enable_speed_preset",
    "SpeedPresetConfig",
    "speed_preset_record",
    "SPEED_PRESETS",
    "load_for_memory_budget",
    "MemoryBudgetConfig",
    "RequestShape",
    "plan_request",
    "V100Mode",
    "NonFiniteActivationError",
    "MiniMaxH3LoraMixin",
    "LoraLoadReport",
    "LoraDistillationPreset",
    "KNOWN_PRESETS",
    "get_preset",
    "load_transformer_file",
    "TransformerFileError",
    "FastH3Preset",
    "KNOWN_FASTH3_PRESETS",
    "enable_fasth3_preset",
    "load_fasth3_adapter",
    "apply_fasth3_payload",
    "split_fasth3_state_dict",
    "load_nvfp4_decoder",
    "FP8Config",
    "NVFP4Config",
    "W8A16Config",
    "quantize",
    "quantization_summary",
    # Processor-author API: the packed-layout side channel, processors, quantized layers and kernels.
    "LayoutSegment",
    "PackedLayout",
    "current_packed_layout",
    "require_packed_layout",
    "use_packed_layout",
    "install_call_plan_hook",
    "MiniMaxH3AttnProcessorBase",
    "register_attention_processor",
    "enable_attention_processor",
    "disable_attention_processor",
    "attention_processor_state",
    "MiniMaxH3VSAProcessor",
    "MiniMaxH3FAV100Processor",
    "MiniMaxH3FlashInferProcessor",
    "MiniMaxH3LowPrecisionAttnProcessor",
    "QuantMethod",
    "QuantizedTensor",
    "FP8Tensor",
    "NVFP4Tensor",
    "W8A16Tensor",
    "FAV100BuildError",
    "fa_v100_attention",
    "fa_v100_reference",
    "__version__",
]

attach_to_diffusers_logging()
_register_with_diffusers()
