"""Shared helpers for the LoRA tests (tiny pipeline stand-in, random LoRAs written in every layout, an int8 stand-in
for a quantized layer), plus tests of the layout detector.

Every LoRA file is generated here from the tiny transformer's own module names: a *canonical* LoRA in diffusers names
(``{module: (A, B)}``, q/k/v sharing ``A`` as a fused-QKV LoRA does) is rewritten into each layout with the inverse of
the documented conversion (fused QKV, ``[gate; value]`` SwiGLU halves, native module names, kohya alpha, DiffSynth's
per-head interleave), so a correct load must reproduce ``B @ A`` for every module.
"""

from __future__ import annotations

import re
from typing import Dict, Optional, Tuple

import torch
from diffusers import DiffusionPipeline, MiniMaxH3Transformer3DModel
from torch import nn

from diffusers_h3.loaders.lora import MiniMaxH3LoraMixin
from diffusers_h3.quantizers import is_quantized_linear
from diffusers_h3.testing.tiny import TINY_TRANSFORMER_CONFIG


TINY = TINY_TRANSFORMER_CONFIG

LoRA = Dict[str, Tuple[torch.Tensor, torch.Tensor]]


class TinyLoraPipeline(DiffusionPipeline, MiniMaxH3LoraMixin):
    """Minimal pipeline holding the two H3 partitions, for testing the mixin without the full pipeline."""

    _optional_components = ["transformer", "transformer_ref"]

    def __init__(self, transformer=None, transformer_ref=None):
        super().__init__()
        self.register_modules(transformer=transformer, transformer_ref=transformer_ref)


def tiny_transformer(seed: int = 0, **overrides) -> MiniMaxH3Transformer3DModel:
    torch.manual_seed(seed)
    return MiniMaxH3Transformer3DModel(**{**TINY, **overrides}).eval()


# ----------------------------------------------------------------------------------------------------------------------
# Canonical LoRA and layout writers
# ----------------------------------------------------------------------------------------------------------------------
def canonical_lora(model: nn.Module, rank: int = 4, adaln_rank: int = 2, seed: int = 0, skip=()) -> LoRA:
    """Random LoRA over every linear of ``model`` (diffusers names); q/k/v share A; AdaLN projections get a different
    rank, like the published files (64 vs 16)."""
    g = torch.Generator().manual_seed(seed)
    lora: LoRA = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or any(s in name for s in skip):
            continue
        r = adaln_rank if ("adaln" in name or name.startswith("norm_out")) else rank
        A = torch.randn(r, module.in_features, generator=g) * 0.3
        B = torch.randn(module.out_features, r, generator=g) * 0.3
        if name.endswith(("attn.to_k", "attn.to_v")):
            A = lora[name.rsplit(".", 1)[0] + ".to_q"][0]
        lora[name] = (A, B)
    return lora


_STANDALONE = {
    "proj_in": "video_patch_proj",
    "audio_proj_in": "audio_patch_proj",
    "context_embedder": "condition_proj",
    "time_embedder.linear_1": "time_embedder.proj_in",
    "time_embedder.linear_2": "time_embedder.proj_out",
    "norm_out.linear": "final_layer.adaln_proj.linear",
    "proj_out": "final_layer.video_out",
    "audio_proj_out": "final_layer.audio_out",
}


def to_native(lora: LoRA, interleave_head_dim: Optional[int] = None) -> LoRA:
    """diffusers names -> the original checkpoint's names (fused QKV, [gate; value] fc1)."""
    native: LoRA = {}
    for name, (A, B) in lora.items():
        if name in _STANDALONE:
            native[_STANDALONE[name]] = (A, B)
            continue
        match = re.fullmatch(r"(transformer_blocks|token_refiner\.refiner_blocks)\.(\d+)\.(.+)", name)
        assert match, name
        block = ("blocks" if match[1] == "transformer_blocks" else "token_refiner.blocks") + f".{match[2]}"
        sub = match[3]
        prefix = name[: -len(sub)]
        if sub == "attn.to_q":
            Bq, Bk, Bv = B, lora[prefix + "attn.to_k"][1], lora[prefix + "attn.to_v"][1]
            if interleave_head_dim:
                d = interleave_head_dim
                heads = Bq.shape[0] // d
                fused = torch.cat([torch.cat([X[h * d : (h + 1) * d] for X in (Bq, Bk, Bv)]) for h in range(heads)])
            else:
                fused = torch.cat([Bq, Bk, Bv])
            native[f"{block}.attn.qkv_proj"] = (A, fused)
        elif sub in ("attn.to_k", "attn.to_v"):
            continue
        elif sub == "attn.to_out.0":
            native[f"{block}.attn.out_proj"] = (A, B)
        elif sub == "ff.net.0.proj":
            value, gate = B.chunk(2)
            native[f"{block}.mlp.fc1"] = (A, torch.cat([gate, value]))
        elif sub == "ff.net.2":
            native[f"{block}.mlp.fc2"] = (A, B)
        elif sub == "adaln_proj.linear":
            native[f"{block}.adaln_proj.linear"] = (A, B)
        else:
            raise AssertionError(name)
    return native


def write_layout(lora: LoRA, layout: str, head_dim: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """The state dict of ``lora`` in ``layout``."""
    sd: Dict[str, torch.Tensor] = {}
    if layout == "diffusers":
        for m, (A, B) in lora.items():
            sd[f"transformer.{m}.lora_A.weight"], sd[f"transformer.{m}.lora_B.weight"] = A, B
    elif layout == "diffusers_ref":
        for m, (A, B) in lora.items():
            sd[f"transformer_ref.{m}.lora_A.weight"], sd[f"transformer_ref.{m}.lora_B.weight"] = A, B
    elif layout == "peft_dump":  # LightX2V Turbo
        for m, (A, B) in lora.items():
            sd[f"{m}.lora_A.default.weight"], sd[f"{m}.lora_B.default.weight"] = A, B
    elif layout in ("native", "ai_toolkit"):
        prefix = "diffusion_model." if layout == "ai_toolkit" else ""
        for m, (A, B) in to_native(lora).items():
            sd[f"{prefix}{m}.lora_A.weight"], sd[f"{prefix}{m}.lora_B.weight"] = A, B
    elif layout in ("kohya", "musubi"):
        # alpha = 2 * rank, so the file stores A / 2 and the loader's alpha / rank fold restores A exactly.
        for m, (A, B) in to_native(lora).items():
            key = "lora_unet_" + m.replace(".", "_") if layout == "musubi" else f"diffusion_model.{m}"
            sd[f"{key}.lora_down.weight"], sd[f"{key}.lora_up.weight"] = A / 2, B
            sd[f"{key}.alpha"] = torch.tensor(2.0 * A.shape[0])
    elif layout == "diffsynth":
        for m, (A, B) in to_native(lora, interleave_head_dim=head_dim).items():
            sd[f"{m}.lora_A.default.weight"], sd[f"{m}.lora_B.default.weight"] = A, B
    else:
        raise AssertionError(layout)
    return {k: v.clone().contiguous() for k, v in sd.items()}


LAYOUTS = ("diffusers", "peft_dump", "native", "ai_toolkit", "kohya", "musubi")


def save_lora(path, state_dict, metadata=None) -> str:
    from safetensors.torch import save_file

    save_file(state_dict, str(path), metadata=metadata)
    return str(path)


def loaded_delta(model: nn.Module, module_name: str, adapter: str) -> torch.Tensor:
    layer = model.get_submodule(module_name)
    A, B = layer.lora_A[adapter].weight.float(), layer.lora_B[adapter].weight.float()
    return (B @ A) * layer.scaling[adapter]


def assert_deltas(model: nn.Module, lora: LoRA, adapter: str, scale: float = 1.0, atol: float = 1e-5):
    for name, (A, B) in lora.items():
        expected = (B.float() @ A.float()) * scale
        torch.testing.assert_close(loaded_delta(model, name, adapter), expected, atol=atol, rtol=1e-5, msg=name)


def dense_twin(quantized_model: nn.Module, seed: int = 0, **overrides) -> nn.Module:
    """An unquantized copy of ``quantized_model`` whose linears hold the dequantized weights."""
    twin = tiny_transformer(seed, **overrides).to(next(quantized_model.parameters()).dtype)
    modules = dict(quantized_model.named_modules())
    with torch.no_grad():
        for name, module in twin.named_modules():
            if isinstance(module, nn.Linear):
                q = modules[name]
                weight = q.weight
                module.weight.copy_(weight.dequantize(module.weight.dtype) if is_quantized_linear(q) else weight)
                if module.bias is not None:
                    module.bias.copy_(q.bias)
    return twin
