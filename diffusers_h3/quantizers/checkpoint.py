"""Refusing a saved model folder whose quantized tensors its ``config.json`` does not explain.

Without a ``quantization_config`` (stripped, or a config of a method no loader knows), diffusers and transformers
load int8 / FP8 / FP4 codes into float weights and only warn about the unused scales: the model silently computes
garbage. :func:`check_checkpoint_quantization` reads the ``config.json`` and the safetensors headers (no tensor
data) and fails with one line instead; the pipeline loader runs it on every component folder before loading.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from diffusers.quantizers import auto as _diffusers_auto
from transformers.quantizers import auto as _transformers_auto


# Names of quantized storage: the scales next to packed weights (ours, ModelOpt, transformers' FP8) ...
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_2", ".weight_scale_inv")
# ... and the safetensors dtypes of packed weights (int8 codes, E2M1 pairs in uint8, FP8).
PACKED_DTYPES = ("I8", "U8", "F8_E4M3", "F8_E5M2")


def _known_method(quantization_config: dict) -> bool:
    if quantization_config.get("load_in_8bit") or quantization_config.get("load_in_4bit"):
        return True  # bitsandbytes, whose config names its method by these flags
    method = quantization_config.get("quant_method")
    return any(
        method in auto.AUTO_QUANTIZATION_CONFIG_MAPPING for auto in (_diffusers_auto, _transformers_auto)
    )


def _first_packed_tensor(folder: Path) -> Optional[str]:
    from safetensors import safe_open

    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                if key.endswith(SCALE_SUFFIXES):
                    return f"{key!r} in {file.name}"
                if key.endswith(".weight") and handle.get_slice(key).get_dtype() in PACKED_DTYPES:
                    return f"{key!r} ({handle.get_slice(key).get_dtype()}) in {file.name}"
    return None


def check_checkpoint_quantization(folder) -> None:
    """Raise one ``ValueError`` line when the model saved in ``folder`` holds quantized tensors that its
    ``config.json`` gives no known ``quantization_config`` for (a loader would read them as float weights)."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        return
    config = json.loads(config_path.read_text())
    quantization_config = config.get("quantization_config")
    if quantization_config is None and isinstance(config.get("text_config"), dict):
        quantization_config = config["text_config"].get("quantization_config")
    if isinstance(quantization_config, dict) and _known_method(quantization_config):
        return
    packed = _first_packed_tensor(folder)
    if packed is None:
        return
    if quantization_config is None:
        reason = "its config.json has no quantization_config"
        fix = "restore the quantization_config it was saved with (or load the dense checkpoint)"
    else:
        reason = f"its config.json names the quantization method {quantization_config.get('quant_method')!r}, unknown here"
        fix = "import the package that registers that method (diffusers_h3 registers 'h3_*')"
    raise ValueError(
        f"{folder} holds quantized tensors (e.g. {packed}) but {reason}, so they would load as float weights; {fix}."
    )
