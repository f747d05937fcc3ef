"""Writers of single-file MiniMax-H3 DiTs in their published layouts, for tests and benchmarks (random weights).

- :func:`to_comfy_state_dict`: a diffusers state dict in ComfyUI's naming (``blocks.N.attn.qkv_proj`` as the
  ``[q; k; v]`` stack, ``mlp.fc1`` as ``[gate; value]``, ``video_patch_proj``, ``final_layer.*`` ...), the inverse of
  diffusers' ``convert_minimax_h3_transformer_checkpoint_to_diffusers``;
- :func:`write_comfy_safetensors`: that state dict as one safetensors file (bf16 blocks, float32 for the modules the
  released checkpoint keeps in float32, optionally under ``model.diffusion_model.``);
- :func:`write_fp8_scaled_safetensors`: ComfyUI's "fp8 scaled" layout: ``float8_e4m3fn`` block linears with one
  float32 scale each (``weight_scale`` + ``comfy_quant``, or the older ``scale_weight`` + ``scaled_fp8`` marker);
- :func:`write_gguf`: a GGUF file written with the ``gguf`` package's ``GGUFWriter``, block linears in a GGUF
  quantization type (Q8_0 quantized by ``gguf`` itself; the K-quants, which ``gguf`` can read but not write, as
  random valid blocks with bounded scales), everything else F32 / F16 as ComfyUI-GGUF stores it.

Each writer returns what the loaded model must hold, so a test can build the dense reference from it.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Optional, Union

import numpy as np
import torch

from ..loaders.native_names import native_name


# The modules the released checkpoint (and ComfyUI's repack) keeps in float32.
FLOAT32_PREFIXES = ("video_patch_proj.", "audio_patch_proj.", "time_embedder.", "final_layer.video_out.",
                    "final_layer.audio_out.")  # fmt: skip


def to_comfy_state_dict(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A ``MiniMaxH3Transformer3DModel`` state dict in ComfyUI's single-file naming and fused layouts."""
    out = {}
    for name, tensor in state_dict.items():
        if ".attn.to_k." in name or ".attn.to_v." in name:
            continue
        if ".attn.to_q." in name:
            stack = [state_dict[name.replace(".to_q.", f".to_{p}.")] for p in "qkv"]
            out[native_name(name.replace(".attn.to_q.", ".attn.qkv_proj."))] = torch.cat(stack, 0)
        elif ".ff.net.0.proj." in name:
            value, gate = tensor.chunk(2, 0)
            out[native_name(name)] = torch.cat([gate, value], 0)
        else:
            out[native_name(name)] = tensor
    return out


def _is_block_linear(name: str, tensor: torch.Tensor) -> bool:
    """The 2-D weights ComfyUI's quantized files quantize: the linears of the DiT blocks (not the refiner's)."""
    return name.startswith("blocks.") and name.endswith(".weight") and tensor.dim() == 2 and "norm" not in name


def _stored_dtype(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.float() if name.startswith(FLOAT32_PREFIXES) else tensor.to(dtype)


def write_comfy_safetensors(model, path: Union[str, os.PathLike], dtype: torch.dtype = torch.bfloat16,
                            prefix: str = "") -> Dict[str, torch.Tensor]:  # fmt: skip
    """``model`` as a ComfyUI-named single file (``dtype`` blocks, float32 modules in float32); returns the tensors
    written (without ``prefix``)."""
    from safetensors.torch import save_file

    tensors = {n: _stored_dtype(n, t, dtype).contiguous() for n, t in to_comfy_state_dict(model.state_dict()).items()}
    save_file({prefix + n: t for n, t in tensors.items()}, str(path))
    return tensors


def write_fp8_scaled_safetensors(
    model, path: Union[str, os.PathLike], dtype: torch.dtype = torch.bfloat16, legacy: bool = False,
    input_scales: bool = False, prefix: str = "",
) -> Dict[str, torch.Tensor]:  # fmt: skip
    """``model`` in ComfyUI's "fp8 scaled" layout: every block linear as ``float8_e4m3fn`` codes with one float32
    per-tensor scale (``amax / 448``), the rest as :func:`write_comfy_safetensors`. ``legacy``: the older spelling
    (``scale_weight`` per layer and a ``scaled_fp8`` marker) instead of ``weight_scale`` + ``comfy_quant``. Returns the
    tensors written (codes and scales included, without ``prefix``)."""
    from safetensors.torch import save_file

    tensors = {}
    for name, tensor in to_comfy_state_dict(model.state_dict()).items():
        if not _is_block_linear(name, tensor):
            tensors[name] = _stored_dtype(name, tensor, dtype).contiguous()
            continue
        module = name[: -len(".weight")]
        scale = (tensor.float().abs().amax() / 448.0).clamp(min=1e-12).reshape(())
        tensors[name] = (tensor.float() / scale).to(torch.float8_e4m3fn)
        if legacy:
            tensors[f"{module}.scale_weight"] = scale
            if input_scales:
                tensors[f"{module}.scale_input"] = torch.tensor(1.0)
        else:
            tensors[f"{module}.weight_scale"] = scale
            record = json.dumps({"format": "float8_e4m3fn"}).encode()
            tensors[f"{module}.comfy_quant"] = torch.tensor(list(record), dtype=torch.uint8)
            if input_scales:
                tensors[f"{module}.input_scale"] = torch.tensor(1.0)
    if legacy:
        tensors["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    save_file({prefix + n: t for n, t in tensors.items()}, str(path))
    return tensors


# -- GGUF ---------------------------------------------------------------------------------------------------------------
# Byte layout of one block of each type (llama.cpp's ggml-common.h): where its fp16 (super-)block scales sit, and the
# value they get here so that random blocks decode to weights of magnitude <~1.
_RANDOM_BLOCK_SCALES = {
    "Q8_0": ((0,), 4e-3),  # d, then 32 int8 codes
    "Q4_K": ((0, 2), 1e-3),  # d, dmin at bytes 0..3, then 12 bytes of 6-bit scales / mins, 128 bytes of 4-bit codes
    "Q5_K": ((0, 2), 5e-4),  # d, dmin, 12 bytes of scales, 32 bytes of high bits, 128 bytes of low nibbles
    "Q6_K": ((208,), 1e-4),  # 128 low nibbles, 64 high bits, 16 int8 scales, then d at byte 208
}
RANDOM_BLOCK_TYPES = tuple(_RANDOM_BLOCK_SCALES)
# The K-quants, which the gguf package can read but not write.
_K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def random_gguf_blocks(rows: int, cols: int, kind: str, generator: np.random.Generator) -> np.ndarray:
    """``[rows, cols / block * block bytes]`` uint8: random valid blocks of GGUF type ``kind`` (one of
    :data:`RANDOM_BLOCK_TYPES`) whose fp16 scales are bounded, for a ``[rows, cols]`` weight."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = generator.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    offsets, magnitude = _RANDOM_BLOCK_SCALES[kind]
    scale = (generator.uniform(0.5, 1.0, size=(rows, cols // block, len(offsets))) * magnitude).astype(np.float16)
    for i, offset in enumerate(offsets):
        data[:, :, offset : offset + 2] = scale[:, :, i : i + 1].view(np.uint8)
    return data.reshape(rows, -1)


# llama.cpp's fallback for a tensor whose rows a K-quant cannot block (input width not a multiple of 256), which
# ComfyUI-GGUF's K-quant files carry (H3's AdaLN projections read 2688 features).
GGUF_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def gguf_plan(state_dict: Dict[str, torch.Tensor], kind: str) -> Dict[str, str]:
    """``{ComfyUI name: GGUF type}`` of the tensors :func:`write_gguf` quantizes: the block linears, in ``kind``, or
    in its llama.cpp fallback (:data:`GGUF_FALLBACK`) when their width does not block; the others are F32 / F16."""
    import gguf

    def fits(t, name):
        return t.shape[1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]][0] == 0

    plan = {}
    for name, tensor in state_dict.items():
        if not _is_block_linear(name, tensor):
            continue
        for candidate in (kind, GGUF_FALLBACK.get(kind)):
            if candidate is not None and fits(tensor, candidate):
                plan[name] = candidate
                break
    return plan


def write_gguf(model, path: Union[str, os.PathLike], kind: str = "Q8_0", seed: int = 0,
               arch: Optional[str] = "minimax_h3") -> Dict[str, torch.Tensor]:  # fmt: skip
    """``model`` as a ComfyUI-GGUF file: block linears in ``kind`` (or its llama.cpp fallback, :func:`gguf_plan`),
    the float32 modules, 1-D tensors and small tensors as F32, the rest F16. Q8_0 / Q5_x / Q4_x are quantized from the
    model's weights by ``gguf``; K-quants are random valid blocks (``gguf`` cannot quantize them). Returns the
    ComfyUI-named float32 weights the file decodes to (``gguf``'s own dequantization)."""
    import gguf
    from gguf import quants

    rng = np.random.default_rng(seed)
    comfy = to_comfy_state_dict(model.state_dict())
    plan = gguf_plan(comfy, kind)
    writer = gguf.GGUFWriter(path=None, arch=arch)
    decoded = {}
    for name, tensor in comfy.items():
        array = tensor.detach().float().numpy()
        if name in plan:
            qtype = gguf.GGMLQuantizationType[plan[name]]
            if plan[name] in _K_QUANTS:
                data = random_gguf_blocks(array.shape[0], array.shape[1], plan[name], rng)
            else:
                data = quants.quantize(array, qtype)
            writer.add_tensor(name, data, raw_dtype=qtype)
            decoded[name] = torch.from_numpy(quants.dequantize(data, qtype).copy())
        elif name.startswith(FLOAT32_PREFIXES) or array.ndim == 1 or array.size <= 1024:
            writer.add_tensor(name, array, raw_dtype=gguf.GGMLQuantizationType.F32)
            decoded[name] = torch.from_numpy(array.copy())
        else:
            half = array.astype(np.float16)
            writer.add_tensor(name, half, raw_dtype=gguf.GGMLQuantizationType.F16)
            decoded[name] = torch.from_numpy(half.astype(np.float32))
    writer.write_header_to_file(path=str(path))
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return decoded


def dense_reference(config: Dict, comfy_weights: Dict[str, torch.Tensor], dtype: torch.dtype = torch.float32):
    """A ``MiniMaxH3Transformer3DModel`` of ``config`` holding ``comfy_weights`` (ComfyUI naming, e.g. the decoded
    weights :func:`write_gguf` returns), mapped with diffusers' own converter: the dense model a quantized file is
    compared with."""
    from diffusers import MiniMaxH3Transformer3DModel
    from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers

    state_dict = convert_minimax_h3_transformer_checkpoint_to_diffusers(
        {n: t.clone() for n, t in comfy_weights.items()}, config=config
    )
    model = MiniMaxH3Transformer3DModel(**config).to(dtype).eval()
    model.load_state_dict(state_dict, strict=True)
    return model
