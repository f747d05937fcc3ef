"""FastH3-shaped files for tests and benchmarks: a stack's contract, trained-looking gates, an exported NVFP4 decoder,
a whole stack folder. The layouts are the published ones (docs/checkpoints.md, "FastH3 stacks"); the weights are
random."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch

from ..attention_processors import add_gate_compress
from ..loaders.fasth3 import CONTRACT_FILE, SCHEDULER_FILES
from ..loaders.fasth3_vae import DECODER_BLOCK_LINEAR, DEPLOY_FORMAT, evenly_spaced_blocks


# The 4-step preview's fastvideo_inference.json (FastVideo/FastVideo-FastH3-4-step-Preview-v1-VSA-DataFree).
FOUR_STEP_CONTRACT: Dict[str, Any] = {
    "schema_version": "fasth3-inference-contract-v1",
    "model_id": "FastVideo/FastVideo-FastH3-4-step-Preview-v1-VSA-DataFree",
    "task": "t2av",
    "guidance_scale": 1.0,
    "transformer_forwards": 4,
    "num_inference_steps": 5,
    "dmd_denoising_steps": [999, 749, 500, 250],
    "attention_backend": "VIDEO_SPARSE_ATTN_H3",
    "vsa_tile_size": 64,
    "vsa_sparsity": 0.9,
}

# The 8-step V2's fastvideo_inference.json (FastVideo/FastVideo-FastH3-8-Step-V2): an explicit 8-rung DMD ladder; its
# video shift 10 is in scheduler/scheduler_config.json (and may be repeated here as video_scheduler_shift).
EIGHT_STEP_V2_CONTRACT: Dict[str, Any] = {
    **FOUR_STEP_CONTRACT,
    "model_id": "FastVideo/FastVideo-FastH3-8-Step-V2",
    "transformer_forwards": 8,
    "num_inference_steps": 9,
    "dmd_denoising_steps": [999, 874, 749, 624, 500, 375, 250, 125],
    "video_scheduler_shift": 10.0,
    "audio_scheduler_shift": 3.0,
    "vsa_sparsity": 0.8,
}


@torch.no_grad()
def add_random_gates(transformer: torch.nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Give every block a ``to_gate_compress`` with random weights (a VSA-distilled DiT's layout)."""
    add_gate_compress(transformer)
    device = transformer.transformer_blocks[0].attn.to_gate_compress.weight.device
    gen = torch.Generator(device=device).manual_seed(seed)  # generated where the weights live (50 x 38.5M at full size)
    for block in transformer.transformer_blocks:
        weight = block.attn.to_gate_compress.weight
        weight.copy_(torch.randn(weight.shape, generator=gen, device=device) * std)


@torch.no_grad()
def nvfp4_decoder_export(vae: torch.nn.Module, student_layers: int, seed: Optional[int] = None, **metadata) -> Dict:
    """FastVideo's deploy-format NVFP4 decoder (``decoder.pt``'s dict) of a student cut from ``vae``'s decoder to
    ``student_layers`` evenly spaced blocks: block linears as bf16 masters with an ``input_amax``, everything else as
    stored. ``seed``: perturb every tensor a little (a distilled student is not its teacher)."""
    kept = evenly_spaced_blocks(len(vae.decoder.transformer_blocks), student_layers)
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    state = {}
    for key, value in vae.decoder.state_dict().items():
        match = re.match(r"^transformer_blocks\.(\d+)\.(.*)$", key)
        if match:
            if int(match.group(1)) not in kept:
                continue
            key = f"transformer_blocks.{kept.index(int(match.group(1)))}.{match.group(2)}"
        value = value.detach().cpu()
        if gen is not None and value.is_floating_point():
            value = value + 0.01 * torch.randn(value.shape, generator=gen).to(value.dtype)
        module = key.rsplit(".", 1)[0]
        if DECODER_BLOCK_LINEAR.match(module):
            value = value.to(torch.bfloat16)
            if key.endswith(".weight"):
                state[f"{module}.input_amax"] = torch.tensor(3.0)
        state[key] = value
    linears = sum(1 for key in state if key.endswith(".input_amax"))
    meta = {"format": "fastvideo_h3_decoder_nvfp4_qad", "block_size": 16, "rotation_group": None, "skip_blocks": [],
            "act_scale": "static", "num_linears": linears, "student_layers": student_layers, **metadata}  # fmt: skip
    conv = {k: v.detach().cpu() for k, v in vae.post_quant_conv.state_dict().items()}
    return {"format": DEPLOY_FORMAT, "metadata": meta, "decoder": state, "post_quant_conv": conv}


def write_fasth3_stack(
    directory: Union[str, Path],
    components: Dict[str, Any],
    contract: Optional[Dict[str, Any]] = None,
    decoder_student_layers: Optional[int] = None,
    gate_seed: int = 7,
) -> Path:
    """Write a FastH3 stack: ``components`` in the official hub layout with random trained-looking gates in the DiT,
    ``fastvideo_inference.json`` (default: the 4-step preview's) and, with ``decoder_student_layers``, the exported
    NVFP4 decoder of a student of the VAE as ``vae/decoder.pt``."""
    from .tiny import save_hub_layout

    directory = Path(directory)
    if components.get("transformer") is not None:
        add_random_gates(components["transformer"], seed=gate_seed, std=1.0)
    save_hub_layout(components, directory)
    contract = contract or FOUR_STEP_CONTRACT
    (directory / CONTRACT_FILE).write_text(json.dumps(contract, indent=2))
    for modality, file in SCHEDULER_FILES.items():  # the checkpoint's schedulers carry the contract's shifts
        shift = contract.get(f"{modality}_scheduler_shift")
        if shift is not None:
            config = json.loads((directory / file).read_text())
            (directory / file).write_text(json.dumps({**config, "shift": shift}, indent=2))
    if decoder_student_layers is not None:
        export = nvfp4_decoder_export(components["vae"], decoder_student_layers, seed=5)
        torch.save(export, directory / "vae" / "decoder.pt")
    return directory


def swizzle_128x4(scale: torch.Tensor) -> torch.Tensor:
    """Row-major ``[rows, cols]`` block scales -> FlashInfer's ``layout_128x4`` order (rows % 128 == 0, cols % 4 == 0),
    stored ``[rows, cols]`` as FastVideo's serialized NVFP4 text encoder stores them."""
    rows, cols = scale.shape
    return scale.reshape(rows // 128, 4, 32, cols // 4, 4).permute(0, 3, 2, 1, 4).reshape(rows, cols).contiguous()


@torch.no_grad()
def write_nvfp4_text_encoder(model: torch.nn.Module, folder: Union[str, Path], keep_bf16: tuple = ()) -> Path:
    """Save a Qwen3-VL text encoder in FastVideo's serialized NVFP4 layout: each ``language_model.layers.*``
    projection (except the kinds in ``keep_bf16``) as ``weight_packed`` / 128x4-swizzled ``weight_scale`` /
    ``weight_global_scale`` (``448 * 6 / amax``), everything else as stored, and the ``quantization_config``."""
    from safetensors.torch import save_file

    from ..kernels.gemm import nvfp4_quantize
    from ..loaders.fasth3_text_encoder import _LANGUAGE_LINEAR

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    quantized = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and _LANGUAGE_LINEAR.search(n)
                 and not any(n.endswith(k) for k in keep_bf16)}  # fmt: skip
    for key, value in model.state_dict().items():
        module = key.rsplit(".", 1)[0]
        if module in quantized and key.endswith(".weight"):
            packed, block_scale, global_scale = nvfp4_quantize(value)
            tensors[f"{module}.weight_packed"] = packed
            tensors[f"{module}.weight_scale"] = swizzle_128x4(block_scale.view(torch.uint8))
            tensors[f"{module}.weight_global_scale"] = (1.0 / global_scale).reshape(1)
        else:
            tensors[key] = value.contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    model.config.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "nvfp4", "activation_scheme": "dynamic", "fmt": "e2m1", "group_size": 16, "scale_fmt": "e4m3",
        "scale_layout": "128x4", "modules_to_not_convert": ["model.visual", "lm_head", *keep_bf16],
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder
