"""The NVFP4 Qwen3-VL text encoder of FastH3 stacks, loaded into :class:`~diffusers_h3.quantizers.NVFP4Tensor` weights.

FastVideo's serialized NVFP4 text encoder (``fastvideo/models/encoders/minimax_h3_checkpoint_nvfp4.py``) is a
transformers ``Qwen3VLForConditionalGeneration`` folder whose ``config.json`` carries

    "quantization_config": {"quant_method": "nvfp4", "activation_scheme": "dynamic", "fmt": "e2m1", "group_size": 16,
                            "scale_fmt": "e4m3", "scale_layout": "128x4",
                            "modules_to_not_convert": ["model.visual", "lm_head", <projection kinds kept bf16>]}

and stores every ``language_model.layers.*`` projection (q/k/v/o, gate/up/down) as three tensors and no ``weight``:
``<prefix>.weight_packed`` (uint8 ``[out, in / 2]``, two E2M1 codes per byte, the even element in the low nibble),
``<prefix>.weight_scale`` (uint8 ``[out, in / 16]``: E4M3 block scales in FlashInfer's 128x4 swizzled layout, every
weight a whole number of 128x4 tiles) and ``<prefix>.weight_global_scale`` (fp32 ``[1]``, ``448 * 6 / amax|W|``).
The weight is ``e2m1 * scale / global_scale``; an :class:`NVFP4Tensor` weight holds the same codes, the scales
unswizzled to row-major and ``weight_scale_2 = 1 / global_scale``. transformers' own ``"nvfp4"`` method reads another layout, so
this one is recognised by its ``scale_layout`` and loaded here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import torch
from diffusers.utils import logging

from ..quantizers import NVFP4Config, NVFP4Tensor, install_quantized_weight
from ..quantizers.apply import _attach_to_model


logger = logging.get_logger(__name__)

LANGUAGE_PROJECTIONS = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)  # fmt: skip
TENSOR_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale")
SCALE_LAYOUT = "128x4"
_REQUIRED = ("activation_scheme", "fmt", "group_size", "scale_fmt", "scale_layout", "modules_to_not_convert")
_LANGUAGE_LINEAR = re.compile(r"(?:^|\.)language_model\.layers\.\d+\.(" + "|".join(map(re.escape, LANGUAGE_PROJECTIONS)) + r")$")


def _quantization_config(config: Mapping[str, Any]) -> Optional[Mapping[str, Any]]:
    quantization = config.get("quantization_config")
    if quantization is None and isinstance(config.get("text_config"), Mapping):
        quantization = config["text_config"].get("quantization_config")
    return quantization if isinstance(quantization, Mapping) else None


def is_fasth3_nvfp4_text_encoder(folder: Union[str, Path]) -> bool:
    """Whether ``folder`` holds a text encoder in FastVideo's serialized NVFP4 layout (its ``config.json`` says so)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return False
    quantization = _quantization_config(json.loads(path.read_text()))
    return bool(quantization) and quantization.get("quant_method") == "nvfp4" and "scale_layout" in quantization


def check_quantization_config(quantization: Mapping[str, Any]) -> Tuple[str, ...]:
    """The projection kinds the checkpoint keeps in bf16; one line for a config this loader does not read."""
    where = "FastH3 NVFP4 text encoder quantization_config"
    missing = [key for key in _REQUIRED if key not in quantization]
    if missing:
        raise ValueError(f"{where} lacks {missing}: every field is required (FastVideo's serialized NVFP4 layout)")
    expected = {"activation_scheme": "dynamic", "fmt": "e2m1", "group_size": 16, "scale_fmt": "e4m3",
                "scale_layout": SCALE_LAYOUT}  # fmt: skip
    for key, value in expected.items():
        if str(quantization[key]).lower() != str(value):
            raise ValueError(f"{where}: {key}={quantization[key]!r}, only {value!r} is read")
    kept = []
    for name in quantization["modules_to_not_convert"]:
        if "visual" in name or name == "lm_head" or name.endswith(".lm_head"):
            continue
        if name not in LANGUAGE_PROJECTIONS:
            raise ValueError(f"{where}: modules_to_not_convert entry {name!r} is not a projection kind "
                             f"{LANGUAGE_PROJECTIONS}, the visual tower or lm_head")  # fmt: skip
        kept.append(name)
    return tuple(kept)


def unswizzle_128x4(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """FlashInfer's ``layout_128x4`` block scales -> row-major ``[rows, cols]``: the buffer holds
    ``(row tile of 128, column tile of 4, row % 32, (row // 32) % 4, column % 4)``."""
    if rows % 128 or cols % 4:
        raise ValueError(f"a 128x4-swizzled scale matrix of a whole number of tiles has rows % 128 == 0 and cols % 4 "
                         f"== 0, got [{rows}, {cols}]")  # fmt: skip
    return scale.reshape(rows // 128, cols // 4, 32, 4, 4).permute(0, 3, 2, 1, 4).reshape(rows, cols)


def _shards(folder: Path):
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no .safetensors files")
    return files


@torch.no_grad()
def load_nvfp4_text_encoder(folder: Union[str, Path], dtype: torch.dtype = torch.bfloat16, device="cpu"):
    """Load FastVideo's serialized NVFP4 Qwen3-VL text encoder from ``folder`` with weight-only NVFP4 language
    projections (``NVFP4Tensor`` weights: Triton on SM80+, the torch reference on the CPU; the W4A4 of FP4 tensor
    cores is ``NVFP4Config(activation="nvfp4")``'s path). No 16-bit copy of a quantized weight is made. Every key,
    shape and tensor kind is checked; the result saves and reloads in this package's NVFP4 format."""
    import transformers
    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device
    from safetensors import safe_open

    folder = Path(folder)
    raw = json.loads((folder / "config.json").read_text())
    quantization = _quantization_config(raw)
    if quantization is None or quantization.get("quant_method") != "nvfp4":
        raise ValueError(f"{folder} is not a serialized NVFP4 text encoder (no nvfp4 quantization_config)")
    kept = check_quantization_config(quantization)
    config = transformers.AutoConfig.from_pretrained(folder)
    for holder in (config, getattr(config, "text_config", None)):
        if holder is not None and getattr(holder, "quantization_config", None) is not None:
            del holder.quantization_config
    architecture = (config.architectures or ["Qwen3VLForConditionalGeneration"])[0]
    with init_empty_weights():
        model = getattr(transformers, architecture)(config).to(dtype)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and _LANGUAGE_LINEAR.search(n)
             and not any(n.endswith(k) for k in kept)]  # fmt: skip
    for name in names:
        linear = model.get_submodule(name)
        if linear.out_features % 128 or linear.in_features % 64:
            raise ValueError(f"{name} is {linear.out_features}x{linear.in_features}: the serialized NVFP4 layout needs "
                             "out % 128 == 0 and in % 64 == 0")  # fmt: skip

    parts: Dict[str, Dict[str, torch.Tensor]] = {}
    expected = set(model.state_dict())
    for file in _shards(folder):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for key in handle.keys():
                module, _, suffix = key.rpartition(".")
                if suffix in TENSOR_SUFFIXES:
                    if module not in names:
                        raise ValueError(f"{key} in {file.name}: {module} is no NVFP4 projection of this model")
                    parts.setdefault(module, {})[suffix] = handle.get_tensor(key)
                    continue
                if key not in expected:
                    raise ValueError(f"{key} in {file.name} names nothing in {architecture}: not this model's file")
                tensor = handle.get_tensor(key)
                expected.discard(key)
                set_module_tensor_to_device(model, key, device,
                                            value=tensor.to(dtype) if tensor.is_floating_point() else tensor)  # fmt: skip
    for name in names:
        layer, tensors = model.get_submodule(name), parts.get(name, {})
        missing = [s for s in TENSOR_SUFFIXES if s not in tensors]
        if missing:
            raise ValueError(f"{name} lacks {[f'{name}.{s}' for s in missing]}: the checkpoint is incomplete")
        packed, scale, global_scale = (tensors[s] for s in TENSOR_SUFFIXES)
        if scale.shape != (layer.out_features, layer.in_features // 16) or scale.dtype != torch.uint8:
            raise ValueError(f"{name}.weight_scale is {scale.dtype} {tuple(scale.shape)}, expected uint8 "
                             f"{(layer.out_features, layer.in_features // 16)}")  # fmt: skip
        if global_scale.numel() != 1 or not torch.isfinite(global_scale).all() or float(global_scale) <= 0:
            raise ValueError(f"{name}.weight_global_scale must be one positive finite number, got {global_scale}")
        install_quantized_weight(layer, NVFP4Tensor.from_storage({
            "weight": packed.view(torch.uint8),
            "weight_scale": unswizzle_128x4(scale, layer.out_features, layer.in_features // 16).view(torch.float8_e4m3fn),
            "weight_scale_2": (1.0 / global_scale.float()).reshape(()),
        }, layer.out_features, layer.in_features, dtype))  # fmt: skip
        for key in list(expected):
            if key.startswith(f"{name}.") and key.rsplit(".", 1)[-1] in ("weight", "weight_scale", "weight_scale_2"):
                expected.discard(key)
        layer.to(device)
    if getattr(config.get_text_config(), "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False):
        expected.discard("lm_head.weight")
        model.tie_weights()
    still_meta = sorted(expected)
    if still_meta:
        raise ValueError(f"{folder} lacks {len(still_meta)} tensors of the model (first: {still_meta[0]}): the "
                         "checkpoint is incomplete")  # fmt: skip
    _attach_to_model(model, NVFP4Config(modules_to_not_convert=["visual", "lm_head", *kept]))
    logger.info(f"FastH3 NVFP4 text encoder: {len(names)} language projections in weight-only NVFP4 from {folder}")
    return model.eval()
