"""What a LoRA file's header says before its tensors are loaded: FP8-stored factors, Turbo-SLA adapters, and full DiTs
passed as a LoRA.

- **FP8 factors.** A LoRA may store its ``lora_A`` / ``lora_B`` (``lora_down`` / ``lora_up``) factors in FP8 to halve
  the download. :func:`read_fp8_lora` dequantizes them, ``code x scale`` in float32 then bfloat16 (the dtype of the
  bf16 releases), into a state dict that diffusers' converter takes like any other. Layouts read:

  * ``<factor>.weight`` stored as ``float8_e4m3fn`` / ``float8_e5m2`` with ComfyUI's sidecar
    ``<factor>.weight_scale`` (or the older ``<factor>.scale_weight``);
  * LightX2V's ``<key>`` payload (``uint8`` bytes of E4M3 codes, or a float8 tensor) with ``<key>__fp8_scale``;
  * float8 factors without a scale (a plain cast: scale 1).

  A scale is one number, one per row, or one per element; anything else, a scale without its factor or a scale on a
  16/32-bit tensor is refused in one line.
- **Turbo-SLA.** LightX2V's ``Minimax-h3-Turbo-SLA`` adapters were distilled together with sparse-linear attention
  (85 % of attention blocks skipped). Under dense attention they run off their training; this package has no SLA
  attention processor, so :func:`check_lora_file` refuses them by name or ``__metadata__``.
- **A full DiT passed as a LoRA** (e.g. LightX2V's ``..._turbo_4step_v1.1_768p_fp8.safetensors``, the Turbo LoRA
  merged into an fp8 DiT, 34 GB): refused with the way to load it (``--transformer-file`` / ``load_transformer_file``;
  the pipeline then runs the schedule the file's name gives, :func:`~diffusers_h3.loaders.lora.merged_distillation_preset`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, List, Mapping, Optional, Sequence

import torch

from .._checkpoint_files import turbo_sla_message, turbo_sla_reason


_FP8_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_COMFY_SCALE_SUFFIXES = (".weight_scale", ".scale_weight")
_LIGHTX2V_SCALE_SUFFIX = "__fp8_scale"
_FACTOR = re.compile(r"\.(lora_A|lora_B|lora_down|lora_up)(\.default)?\.weight$")
_DIT_KEY = re.compile(r"^(model\.diffusion_model\.|diffusion_model\.)?(blocks|transformer_blocks)\.\d+\.")


class LoraFileError(ValueError):
    """A LoRA file this package refuses, with the reason and the fix in one line."""


@dataclasses.dataclass
class Fp8Lora:
    """A LoRA whose FP8 factors were dequantized: the state dict to load and what was done, for the report."""

    state_dict: Dict[str, torch.Tensor]
    dequantized: int  # number of factor tensors read from FP8
    layout: str  # "ComfyUI weight_scale", "LightX2V __fp8_scale" or "float8 without scales"
    fp8_dtypes: List[str]

    def describe(self) -> str:
        return f"{self.dequantized} FP8 factors ({'/'.join(self.fp8_dtypes)}, {self.layout}) dequantized to bfloat16"


def _file_name(file_name: Optional[str]) -> str:
    return re.split(r"[/\\]", str(file_name or ""))[-1]


def check_lora_file(file_name: Optional[str], keys: Optional[Sequence[str]], metadata: Mapping[str, str]) -> None:
    """Refuse, in one line, a Turbo-SLA adapter or a full DiT passed as a LoRA (from the header alone)."""
    base = _file_name(file_name)
    reason = turbo_sla_reason(file_name, dict(metadata))
    if reason is not None:
        raise LoraFileError(turbo_sla_message(file_name, reason))
    if keys and not any("lora" in k for k in keys) and any(_DIT_KEY.match(k) for k in keys):
        raise LoraFileError(
            f"{base or 'this file'!r} holds full MiniMax-H3 DiT weights, not LoRA factors (a Turbo LoRA merged into "
            "the DiT): load it as the transformer with `--transformer-file` / `diffusers_h3.load_transformer_file` "
            "(a file named like a LightX2V Turbo file then runs that file's schedule)."
        )


def _scale_for(payload: torch.Tensor, scale: torch.Tensor, key: str) -> torch.Tensor:
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(())
    rows = payload.shape[0]
    if scale.numel() == rows:
        return scale.reshape((rows,) + (1,) * (payload.ndim - 1))
    if tuple(scale.shape) == tuple(payload.shape):
        return scale
    raise LoraFileError(
        f"The FP8 scale of LoRA tensor {key!r} has shape {tuple(scale.shape)} for a {tuple(payload.shape)} factor "
        "(one scale, one per row or one per element expected); the file is damaged or in an unknown layout."
    )


def _split_scales(keys: Sequence[str]):
    """``({factor key: scale key}, layout)`` for the scale sidecars among ``keys``."""
    scales, layouts = {}, set()
    for key in keys:
        if key.endswith(_LIGHTX2V_SCALE_SUFFIX):
            scales[key[: -len(_LIGHTX2V_SCALE_SUFFIX)]] = key
            layouts.add("LightX2V __fp8_scale")
        elif key.endswith(_COMFY_SCALE_SUFFIXES):
            scales[key.rsplit(".", 1)[0] + ".weight"] = key
            layouts.add("ComfyUI weight_scale")
    return scales, layouts


def read_fp8_lora(path: str) -> Optional[Fp8Lora]:
    """The dequantized state dict of a LoRA file with FP8 factors, or ``None`` when none of its tensors is FP8."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as handle:
        keys = list(handle.keys())
        dtypes = {k: handle.get_slice(k).get_dtype() for k in keys}
        scales, layouts = _split_scales(keys)
        if not scales and not any(d in _FP8_DTYPES for d in dtypes.values()):
            return None
        orphans = sorted(k for k in scales if k not in dtypes)
        if orphans:
            raise LoraFileError(
                f"LoRA file {_file_name(path)!r} has an FP8 scale ({scales[orphans[0]]!r}) without the factor "
                f"{orphans[0]!r}; the file is damaged."
            )
        out: Dict[str, torch.Tensor] = {}
        fp8_dtypes, count = set(), 0
        scale_keys = set(scales.values())
        for key in keys:
            if key in scale_keys:
                continue
            tensor = handle.get_tensor(key)
            dtype = dtypes[key]
            scale_key = scales.get(key)
            if dtype == "U8" and scale_key is not None and scale_key.endswith(_LIGHTX2V_SCALE_SUFFIX):
                tensor, dtype = tensor.view(torch.float8_e4m3fn), "F8_E4M3"  # LightX2V stores E4M3 codes as bytes
            if dtype not in _FP8_DTYPES:
                if scale_key is not None:
                    raise LoraFileError(
                        f"LoRA file {_file_name(path)!r} has an FP8 scale ({scale_key!r}) for {key!r}, which is "
                        f"stored as {dtype}, not FP8; the file is damaged."
                    )
                out[key] = tensor
                continue
            if not _FACTOR.search(key):
                raise LoraFileError(
                    f"LoRA file {_file_name(path)!r} stores {key!r} in FP8, but only LoRA factors (lora_A / lora_B) "
                    "may be FP8; the file is damaged or not a LoRA."
                )
            value = tensor.float()
            if scale_key is not None:
                value = value * _scale_for(tensor, handle.get_tensor(scale_key), key)
            out[key] = value.to(torch.bfloat16)
            fp8_dtypes.add(str(_FP8_DTYPES[dtype]).replace("torch.", ""))
            count += 1
    layout = " + ".join(sorted(layouts)) if layouts else "float8 without scales"
    return Fp8Lora(out, count, layout, sorted(fp8_dtypes))
