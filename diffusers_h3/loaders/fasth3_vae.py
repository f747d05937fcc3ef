"""FastH3's light video VAE: a decoder depth-cut to a few evenly spaced ViT blocks, with an exported NVFP4 decoder.

The light VAE is diffusers' ``AutoencoderKLMiniMaxH3`` with fewer decoder blocks (``decoder_num_layers``; the
released one has 26, the full one 36). FastVideo distils a shallower NVFP4 student from it (quantization-aware, the
"fast-8L" export) and ships it as ``decoder.pt``: ``torch.save`` of

    {"format": "fastvideo_h3_decoder_nvfp4_deploy_v1",
     "metadata": {"student_layers": 8, "block_size": 16, "act_scale": "static" | "unit" | "dynamic",
                  "rotation_group": None | int, "skip_blocks": [...], "num_linears": N, ...},
     "decoder": <the student decoder's state dict>, "post_quant_conv": <its state dict>}

where each NVFP4 block linear (``transformer_blocks.{i}.attn.to_q/to_k/to_v/to_out.0``, ``ff.net.0.proj``,
``ff.net.2``) stores its bf16 master ``weight``, a bf16 ``bias`` and an fp32 ``input_amax`` (the calibrated
activation range of FastVideo's W4A4 GEMM), and everything else keeps its trained dtype. FastVideo packs the masters
at load (``freeze``); so does this loader, into :class:`~diffusers_h3.quantizers.NVFP4Tensor` weights of the same
``nn.Linear`` layers (weight-only here: the activations stay 16-bit, so ``input_amax`` is kept in the record but not
used; FlashInfer's W4A4 on FP4 tensor cores is ``NVFP4Config(activation="nvfp4")``'s path, **not run on hardware**). The student's blocks are the teacher's
evenly spaced ones (``round(i * (n - 1) / (k - 1))``, first and last kept), so a 26-block light VAE (or the 36-block
full one) hosts an 8-block student.

Not read: the ``fastvideo_h3_decoder_nvfp4_packed_v1`` safetensors (pre-packed, FlashInfer-swizzled scales) and
Hadamard-rotated exports (``rotation_group``); both are refused in one line.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch
from diffusers.utils import logging

from .._hooks import H3_LIGHT_VAE_HOOK, H3Hook, h3_record, register_h3_hook, remove_h3_hook
from ..quantizers import NVFP4Config, quantize
from ..quantizers.config import DEFAULT_MODULES_TO_NOT_CONVERT


logger = logging.get_logger(__name__)

DEPLOY_FORMAT = "fastvideo_h3_decoder_nvfp4_deploy_v1"
PACKED_FORMAT = "fastvideo_h3_decoder_nvfp4_packed_v1"
NVFP4_BLOCK = 16
# The decoder block linears FastVideo's NVFP4 decoder replaces, relative to ``decoder.``.
DECODER_BLOCK_LINEAR = re.compile(
    r"^transformer_blocks\.(\d+)\.(attn\.to_q|attn\.to_k|attn\.to_v|attn\.to_out\.0|ff\.net\.0\.proj|ff\.net\.2)$"
)


def evenly_spaced_blocks(total: int, count: int) -> List[int]:
    """The ``count`` of ``total`` decoder blocks a depth cut keeps: evenly spaced, first and last included."""
    if not 1 <= count <= total:
        raise ValueError(f"cannot keep {count} of {total} decoder blocks")
    return sorted({round(i * (total - 1) / max(count - 1, 1)) for i in range(count)})


def depth_cut_decoder(vae: torch.nn.Module, count: int) -> List[int]:
    """Keep ``count`` evenly spaced blocks of ``vae``'s ViT decoder (in place; the config follows, so the VAE saves and
    reloads with ``count`` blocks). Returns the kept indices."""
    blocks = vae.decoder.transformer_blocks
    kept = evenly_spaced_blocks(len(blocks), count)
    vae.decoder.transformer_blocks = torch.nn.ModuleList(blocks[i] for i in kept)
    vae.register_to_config(decoder_num_layers=count)
    return kept


def read_nvfp4_decoder(path: Union[str, Path]) -> Dict[str, Any]:
    """Read an exported NVFP4 decoder (``decoder.pt``, or the deploy-format safetensors) and check its format."""
    path = Path(path)
    if path.suffix == ".safetensors":
        import json

        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(str(path), framework="pt") as handle:
            header = handle.metadata() or {}
        fmt = header.get("format")
        if fmt == PACKED_FORMAT:
            raise ValueError(f"{path} is a pre-packed NVFP4 decoder ({PACKED_FORMAT}: FlashInfer-swizzled scales), "
                             f"which is not read yet: use the {DEPLOY_FORMAT} export (decoder.pt)")  # fmt: skip
        if fmt != DEPLOY_FORMAT or "nvfp4_metadata" not in header:
            raise ValueError(f"{path} is not an NVFP4 decoder export (format {fmt!r}); expected {DEPLOY_FORMAT}")
        tensors = load_file(str(path))
        checkpoint = {"format": fmt, "metadata": json.loads(header["nvfp4_metadata"])}
        for group in ("decoder", "post_quant_conv"):
            checkpoint[group] = {k[len(group) + 1:]: v for k, v in tensors.items() if k.startswith(group + ".")}
        return checkpoint
    checkpoint = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    found = checkpoint.get("format") if isinstance(checkpoint, dict) else type(checkpoint).__name__
    if found == PACKED_FORMAT:
        raise ValueError(f"{path} is a pre-packed NVFP4 decoder ({PACKED_FORMAT}), which is not read yet: use the "
                         f"{DEPLOY_FORMAT} export")  # fmt: skip
    if found != DEPLOY_FORMAT:
        raise ValueError(f"{path} is not an NVFP4 decoder export (format {found!r}); expected {DEPLOY_FORMAT}")
    missing = sorted({"decoder", "post_quant_conv", "metadata"} - set(checkpoint))
    if missing:
        raise ValueError(f"{path} is missing {missing}: not a complete {DEPLOY_FORMAT} export")
    return checkpoint


@dataclasses.dataclass(frozen=True)
class LightVAERecord:
    """What :func:`load_nvfp4_decoder` did, for ``describe``."""

    source: str
    blocks_before: int
    blocks_kept: Tuple[int, ...]
    nvfp4_linears: int
    act_scale: str
    input_amax: Dict[str, float]
    activation: Optional[str] = None

    def describe(self) -> Dict[str, Any]:
        if self.activation is None:
            how = f"weight-only NVFP4 (exported act_scale {self.act_scale!r} unused: activations stay 16-bit)"
        else:
            how = (f"W4A4 NVFP4 with dynamic activation scales (exported act_scale {self.act_scale!r} unused; FP4 "
                   "tensor cores not run on hardware)")  # fmt: skip
        return {
            "source": self.source,
            "decoder_blocks": f"{len(self.blocks_kept)} of {self.blocks_before} (kept {list(self.blocks_kept)})",
            "nvfp4_linears": f"{self.nvfp4_linears} decoder block linears, {how}",
        }


def _expected_keys(decoder: torch.nn.Module, kept: List[int], skip: set) -> Tuple[Dict[str, Tuple[int, ...]], List[str]]:
    """``({state key: shape}, NVFP4 linear names)`` the depth-cut decoder loads, without cutting it."""
    position = {old: new for new, old in enumerate(kept)}
    shapes: Dict[str, Tuple[int, ...]] = {}
    for key, tensor in decoder.state_dict().items():
        match = re.match(r"^transformer_blocks\.(\d+)\.(.*)$", key)
        if match:
            if int(match.group(1)) not in position:
                continue
            key = f"transformer_blocks.{position[int(match.group(1))]}.{match.group(2)}"
        shapes[key] = tuple(tensor.shape)
    linears = sorted({key.rsplit(".", 1)[0] for key in shapes if DECODER_BLOCK_LINEAR.match(key.rsplit(".", 1)[0])})
    linears = [name for name in linears if int(DECODER_BLOCK_LINEAR.match(name).group(1)) not in skip]
    for name in linears:
        shapes[f"{name}.input_amax"] = ()
    return shapes, linears


@torch.no_grad()
def load_nvfp4_decoder(
    vae: torch.nn.Module,
    decoder: Union[str, Path, Mapping[str, Any]],
    source: Optional[str] = None,
    activation: Optional[str] = None,
) -> LightVAERecord:
    """Turn ``vae`` (``AutoencoderKLMiniMaxH3``, light or full) into FastVideo's exported NVFP4 decoder, in place:
    depth-cut to the export's ``student_layers`` evenly spaced blocks, load its decoder and ``post_quant_conv``
    strictly, and quantize the block linears from their bf16 masters to weight-only NVFP4 (``NVFP4Tensor`` weights).

    ``decoder``: the export's path (``decoder.pt``) or its already-read dict. ``activation="nvfp4"``: W4A4 on FP4
    tensor cores (flashinfer ``mm_fp4`` on SM100+, **not run on hardware**; emulated elsewhere) with a dynamic
    per-tensor activation scale, not the export's calibrated ``input_amax``. Everything is checked before the VAE
    changes (format, metadata, every key and shape); a mismatch is one line and the VAE is left as it was.
    """
    source = source or (str(decoder) if isinstance(decoder, (str, Path)) else "an NVFP4 decoder export")
    checkpoint = read_nvfp4_decoder(decoder) if isinstance(decoder, (str, Path)) else decoder
    metadata = checkpoint.get("metadata") or {}
    if metadata.get("rotation_group"):
        raise ValueError(f"{source} is Hadamard-rotated (rotation_group={metadata['rotation_group']}): its activations "
                         "must be rotated at run time, which this loader does not do; use an unrotated export")  # fmt: skip
    if int(metadata.get("block_size", NVFP4_BLOCK)) != NVFP4_BLOCK:
        raise ValueError(f"{source}: NVFP4 block size {metadata['block_size']}, expected {NVFP4_BLOCK}")
    blocks_before = len(vae.decoder.transformer_blocks)
    count = int(metadata.get("student_layers", blocks_before))
    if count > blocks_before:
        raise ValueError(f"{source} needs {count} decoder blocks, this VAE has {blocks_before}: load a VAE with at "
                         "least that many (the light VAE or the full MiniMax-H3 vae/)")  # fmt: skip
    kept = evenly_spaced_blocks(blocks_before, count)
    skip = {int(i) for i in metadata.get("skip_blocks") or ()}
    expected, linears = _expected_keys(vae.decoder, kept, skip)
    state = dict(checkpoint["decoder"])
    problems = [f"missing {k}" for k in expected if k not in state]
    problems += [f"unexpected {k}" for k in state if k not in expected]
    problems += [f"{k} is {tuple(v.shape)}, the VAE's {expected[k]}" for k, v in state.items()
                 if k in expected and tuple(v.shape) != expected[k]]  # fmt: skip
    pqc = vae.post_quant_conv.state_dict()
    conv = checkpoint["post_quant_conv"]
    problems += [f"post_quant_conv.{k}" for k in set(pqc) ^ set(conv)]
    problems += [f"post_quant_conv.{k} shape" for k in set(pqc) & set(conv) if pqc[k].shape != conv[k].shape]
    if "num_linears" in metadata and int(metadata["num_linears"]) != len(linears):
        problems.insert(0, f"{metadata['num_linears']} NVFP4 linears in the export, {len(linears)} in this VAE")
    if problems:
        raise ValueError(f"{source} does not fit this VAE's decoder ({len(problems)} problems; first: {problems[0]}): "
                         "it was exported for another decoder width or depth")  # fmt: skip

    amax = {name: float(state.pop(f"{name}.input_amax")) for name in linears}
    depth_cut_decoder(vae, count)
    for key, tensor in state.items():  # bf16 masters into the (16- or 32-bit) dense layers: exact
        target = vae.decoder.get_parameter(key) if key in dict(vae.decoder.named_parameters()) else None
        target = target if target is not None else vae.decoder.get_buffer(key)
        target.copy_(tensor.to(target.dtype))
    vae.post_quant_conv.load_state_dict({k: v.to(pqc[k].dtype) for k, v in conv.items()})
    keep = [*DEFAULT_MODULES_TO_NOT_CONVERT, *(f"decoder.transformer_blocks.{i}" for i in sorted(skip))]  # cut indices
    quantize(vae, NVFP4Config(modules_to_not_convert=keep, activation=activation))
    record = LightVAERecord(source, blocks_before, tuple(kept), len(linears), str(metadata.get("act_scale", "dynamic")),
                            amax, activation)  # fmt: skip
    remove_h3_hook(vae, H3_LIGHT_VAE_HOOK, recurse=False)
    register_h3_hook(vae, H3Hook(record), H3_LIGHT_VAE_HOOK)  # nothing at run time: the record describe() reads
    logger.info(f"light VAE: {record.describe()}")
    return record


def light_vae_record(vae: Optional[torch.nn.Module]) -> Optional[LightVAERecord]:
    """What :func:`load_nvfp4_decoder` did to ``vae`` (its ``H3_LIGHT_VAE_HOOK`` record), ``None`` if nothing."""
    return h3_record(vae, H3_LIGHT_VAE_HOOK) if vae is not None else None
