"""diffusers-h3: MiniMax-H3 (video + 32 kHz stereo audio) inside Hugging Face Diffusers.

`import diffusers_h3` registers `MiniMaxH3Pipeline` with diffusers, so that `DiffusionPipeline.from_pretrained(...)`
resolves it for both our own layout and the official hub layout.
"""

__version__ = "0.1.0"

import diffusers as _diffusers
from diffusers.modular_pipelines.minimax_h3.references import (  # noqa: E402
    MiniMaxH3AudioReference,
    MiniMaxH3ImageReference,
    MiniMaxH3Reference,
    MiniMaxH3VideoReference,
)

from .attention_processors.layout import (  # noqa: E402
    LayoutSegment,
    PackedLayout,
    current_packed_layout,
    require_packed_layout,
    use_packed_layout,
)
from ._report import describe, format_report  # noqa: E402
from .pipelines import MiniMaxH3Pipeline, MiniMaxH3PipelineOutput, export_to_video  # noqa: E402
from .pipelines.loading import install_diffusion_pipeline_dispatch as _install_dispatch  # noqa: E402
from .attention_processors.fa_v100 import MiniMaxH3FAV100Processor  # noqa: E402
from .attention_processors.vsa import MiniMaxH3VSAProcessor, add_gate_compress, disable_vsa, enable_vsa  # noqa: E402
from .kernels.attention.fa_v100 import FAV100BuildError, fa_v100_attention, fa_v100_reference  # noqa: E402
from .hooks.v100_mode import NonFiniteActivationError, V100Mode, enable_v100_mode  # noqa: E402
from .loaders.lora import LoraLoadReport, MiniMaxH3LoraMixin  # noqa: E402
from .loaders.lora_presets import KNOWN_PRESETS, LoraDistillationPreset, get_preset  # noqa: E402
from .quantizers import (  # noqa: E402
    FP8Config,
    FP8Linear,
    H3QuantizedLinear,
    H3QuantMethod,
    NVFP4Config,
    NVFP4Linear,
    W8A16Config,
    W8A16Linear,
    quantization_summary,
    quantize,
    register_quantizers,
)


def _register_with_diffusers() -> None:
    existing = getattr(_diffusers, "MiniMaxH3Pipeline", None)
    if existing is not None and existing is not MiniMaxH3Pipeline:
        import warnings

        warnings.warn(
            "diffusers already defines MiniMaxH3Pipeline; diffusers_h3 leaves it in place. Use "
            "diffusers_h3.MiniMaxH3Pipeline explicitly.",
            RuntimeWarning,
        )
        return
    _diffusers.MiniMaxH3Pipeline = MiniMaxH3Pipeline
    _install_dispatch()
    register_quantizers()


_register_with_diffusers()
