"""Write a trained LoRA where every H3 user can load it.

`save_trained_lora` writes, into one folder:

- `pytorch_lora_weights.safetensors`: diffusers' PEFT layout (`transformer.<module>.lora_A.weight`, the adapter's
  `LoraConfig` in the file's metadata), which `MiniMaxH3Pipeline.load_lora_weights` and diffusers load;
- `adapter_config.json`: PEFT's `LoraConfig` of the adapter;
- `<name>_comfyui.safetensors`: the reference / ComfyUI module names under `diffusion_model.` (fused `qkv_proj`,
  `mlp.fc1` with its gate half first, `.alpha` per module), the layout ComfyUI, ai-toolkit and the Light4 / Turbo
  files use;
- `README.md`: a model card (base model, trigger captions, settings, how to load it).

The ComfyUI file is the same adapter, exactly: q / k / v LoRAs with their own `A` factors become one fused `qkv_proj`
LoRA of rank `3r` whose `A` stacks the three and whose `B` is block-diagonal, so `B A` is the three updates stacked;
the PEFT scale `alpha / r` is recorded as `.alpha = scale * rank` so that every loader applies the same scale.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Dict, Optional, Sequence

import torch
from safetensors.torch import save_file

from ..loaders.native_names import native_name


DIFFUSERS_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
COMFY_PREFIX = "diffusion_model."
# The modules a LoRA may train outside the blocks, and inside a block (besides q / k / v, fused on writing).
_STANDALONE = ("proj_in", "audio_proj_in", "context_embedder", "time_embedder.linear_1", "time_embedder.linear_2",
               "norm_out.linear", "proj_out", "audio_proj_out")  # fmt: skip
_IN_BLOCK = ("attn.to_out.0", "ff.net.2", "adaln_proj.linear")
_BLOCK = re.compile(r"^(transformer_blocks|token_refiner\.refiner_blocks)\.(\d+)\.(.+)$")
_QKV = ("to_q", "to_k", "to_v")


def to_comfyui_layout(state_dict: Dict[str, torch.Tensor], scales: Dict[str, float]) -> Dict[str, torch.Tensor]:
    """A diffusers-named LoRA (`<module>.lora_A.weight` / `.lora_B.weight`, PEFT scale `scales[module]`) in the
    reference / ComfyUI layout (see the module docstring); the result loads back to the same update."""
    pairs: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        module, _, kind = key.rpartition(".lora_")
        pairs.setdefault(module, {})[kind.split(".")[0]] = value
    out: Dict[str, torch.Tensor] = {}

    def put(native: str, down: torch.Tensor, up: torch.Tensor, scale: float) -> None:
        out[f"{COMFY_PREFIX}{native}.lora_A.weight"] = down.contiguous()
        out[f"{COMFY_PREFIX}{native}.lora_B.weight"] = up.contiguous()
        out[f"{COMFY_PREFIX}{native}.alpha"] = torch.tensor(float(scale) * down.shape[0])

    fused: Dict[str, Dict[str, str]] = {}
    for module, pair in pairs.items():
        down, up, scale = pair["A"], pair["B"], scales[module]
        if module in _STANDALONE:
            put(native_name(module), down, up, scale)
            continue
        match = _BLOCK.match(module)
        if match is None:
            raise ValueError(f"The LoRA module {module!r} has no name in the reference / ComfyUI layout.")
        block, rest = native_name(f"{match.group(1)}.{match.group(2)}"), match.group(3)
        if rest.startswith("attn.") and rest[5:] in _QKV:
            fused.setdefault(block, {})[rest[5:]] = module
        elif rest == "ff.net.0.proj":  # diffusers' SwiGLU holds [value; gate], the reference [gate; value]
            value_half, gate_half = up.chunk(2, dim=0)
            put(f"{block}.mlp.fc1", down, torch.cat([gate_half, value_half]), scale)
        elif rest in _IN_BLOCK:
            put(native_name(module), down, up, scale)
        else:
            raise ValueError(f"The LoRA module {module!r} has no name in the reference / ComfyUI layout.")
    for block, modules in fused.items():
        # One fused LoRA for the three projections: A stacked, B block-diagonal; each factor carries its own scale
        # (folded into B) so that the fused module's scale is 1.
        downs, ups = [], []
        template = next(iter(modules.values()))
        out_features = pairs[template]["B"].shape[0]
        for proj in _QKV:
            if proj in modules:
                downs.append(pairs[modules[proj]]["A"])
                ups.append(pairs[modules[proj]]["B"] * scales[modules[proj]])
            else:  # a projection the adapter does not train contributes zero rows
                downs.append(torch.zeros_like(pairs[template]["A"]))
                ups.append(torch.zeros(out_features, pairs[template]["A"].shape[0], dtype=pairs[template]["B"].dtype))
        down = torch.cat(downs)
        up = torch.block_diag(*ups)
        put(f"{block}.attn.qkv_proj", down, up, 1.0)
    return out


def lora_scales(transformer, adapter_name: str) -> Dict[str, float]:
    """PEFT's `alpha / r` scale of every module carrying `adapter_name`."""
    scales = {}
    for name, module in transformer.named_modules():
        scaling = getattr(module, "scaling", None)
        if isinstance(scaling, dict) and adapter_name in scaling and hasattr(module, "lora_A"):
            scales[name] = float(scaling[adapter_name])
    return scales


def adapter_state_dict(transformer, adapter_name: str) -> Dict[str, torch.Tensor]:
    """The adapter's factors by diffusers module name (`<module>.lora_A.weight`), on the CPU."""
    from peft.utils import get_peft_model_state_dict

    state = get_peft_model_state_dict(transformer, adapter_name=adapter_name)
    return {key: value.detach().cpu().contiguous() for key, value in state.items()}


def _card(output_dir: Path, base_model: Optional[str], name: str, settings: Dict, captions: Sequence[str]) -> None:
    from huggingface_hub import ModelCardData

    from .._model_card import BASE_TAGS, _card, source_base_model, source_license, write_model_card

    base = source_base_model(base_model)
    data = ModelCardData(library_name="diffusers", pipeline_tag="text-to-video", base_model=base,
                         tags=list(BASE_TAGS) + ["lora", "diffusers-h3-training"],
                         **source_license(base_model))  # fmt: skip
    examples = "\n".join(f"- {caption}" for caption in list(captions)[:5])
    shown = "\n".join(f"| `{key}` | `{value}` |" for key, value in settings.items())
    body = (
        f"A LoRA for MiniMax-H3 ({settings.get('task', 't2va')}), trained with `diffusers-h3 train-lora`.\n\n"
        "## Use\n\n```python\nimport torch\nimport diffusers_h3\nfrom diffusers_h3 import MiniMaxH3Pipeline\n\n"
        f'pipe = MiniMaxH3Pipeline.from_pretrained("{base or "MiniMaxAI/MiniMax-H3"}", task="t2va", '
        "dtype=torch.bfloat16)\n"
        f'pipe.load_lora_weights("{output_dir.name}", weight_name="{DIFFUSERS_WEIGHT_NAME}", adapter_name="{name}")\n'
        "```\n\n"
        f"ComfyUI (and other tools reading the reference module names): `{name}_comfyui.safetensors`.\n\n"
        f"## Training captions (first {min(5, len(captions))})\n\n{examples}\n\n"
        f"## Settings\n\n| setting | value |\n|---|---|\n{shown}\n"
    )
    write_model_card(str(output_dir), _card(data, f"MiniMax-H3 LoRA: {name}", body))


def save_trained_lora(output_dir, transformer, adapter_name: str, lora_config, *, name: str = "lora",
                      base_model: Optional[str] = None, settings: Optional[Dict] = None,
                      captions: Sequence[str] = ()) -> Dict[str, Path]:  # fmt: skip
    """Write the adapter `adapter_name` of `transformer` in the three layouts and its card; returns the paths."""
    from ..pipelines.pipeline_minimax_h3 import MiniMaxH3Pipeline

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    state = adapter_state_dict(transformer, adapter_name)
    metadata = lora_config.to_dict()
    metadata = {k: (sorted(v) if isinstance(v, set) else v) for k, v in metadata.items()}
    MiniMaxH3Pipeline.save_lora_weights(output_dir, transformer_lora_layers=state, weight_name=DIFFUSERS_WEIGHT_NAME,
                                        transformer_lora_adapter_metadata=metadata)  # fmt: skip
    lora_config.save_pretrained(str(output_dir))  # adapter_config.json
    comfy = to_comfyui_layout(state, lora_scales(transformer, adapter_name))
    comfy_path = output_dir / f"{name}_comfyui.safetensors"
    temporary = comfy_path.with_name(comfy_path.name + ".tmp")
    save_file(comfy, str(temporary), metadata={"format": "pt", "diffusers_h3_settings": json.dumps(settings or {})})
    os.replace(temporary, comfy_path)
    _card(output_dir, base_model, name, settings or {}, captions)
    return {"diffusers": output_dir / DIFFUSERS_WEIGHT_NAME, "peft_config": output_dir / "adapter_config.json",
            "comfyui": comfy_path, "card": output_dir / "README.md"}  # fmt: skip
