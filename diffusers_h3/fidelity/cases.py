# Copyright 2026 The diffusers-h3 authors. Licensed under the Apache License, Version 2.0.
"""The paths a fidelity run can compare, each a recipe on a freshly loaded pipeline.

A case names the weight formats it needs (the CLI loads them quantized; a pipeline of dense weights is quantized in
place by :func:`apply_case`) and what is turned on after loading: a speed preset, diffusers' FirstBlockCache, FP8
decoder linears. Placement does not enter: `low_ram` is that recipe's weight formats (NVFP4 DiT, W8A16 text encoder)
with the weights resident, since streaming them from host memory or disk moves the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch


@dataclass(frozen=True)
class FidelityCase:
    """``speed``: the speed preset applied after loading (``None``: the attention diffusers loads); ``dit_format`` /
    ``text_encoder_format``: registered weight formats (``None``: as loaded, or as the preset quantizes);
    ``cache``: a `diffusers_h3.hooks.cache` method; ``fp8_decode``: FP8 video-decoder linears (batched decode)."""

    name: str
    description: str
    speed: Optional[str] = None
    dit_format: Optional[str] = None
    text_encoder_format: Optional[str] = None
    cache: Optional[str] = None
    fp8_decode: bool = False


# (case-name suffix, `hooks.cache` method, description) of the cache profiles on `fast` and `fastest`.
CACHE_PROFILE_METHODS = (
    ("first_block_cache", "first-block", "diffusers' FirstBlockCache (threshold 0.05)"),
    ("taylorseer", "taylorseer", "diffusers' TaylorSeer (every 5th step computed from step 3 on, first order)"),
    ("taylorseer_lite", "taylorseer-lite", "TaylorSeer on the video and audio outputs only (blocks skipped on "
                                            "predicted steps)"),
)

FIDELITY_CASES: Dict[str, FidelityCase] = {
    case.name: case
    for case in (
        FidelityCase("native", "the pipeline as loaded: diffusers' default attention, dense weights"),
        FidelityCase("exact", "speed preset exact: dense weights, fastest exact attention", speed="exact"),
        FidelityCase("fast", "speed preset fast: FP8 GEMMs (W8A16 without FP8 tensor cores), INT8 attention, "
                             "W8A16 text encoder, batched decode", speed="fast"),  # fmt: skip
        FidelityCase("fastest", "speed preset fastest: fast + VSA 0.8, FP8 decoder linears where FP8 tensor cores "
                                "exist", speed="fastest"),  # fmt: skip
        FidelityCase("low_ram", "the low_ram recipe's weights: NVFP4 DiT (weight-only 4-bit), W8A16 text encoder "
                                "(resident: its streaming moves the same numbers)",
                     dit_format="nvfp4", text_encoder_format="w8a16"),  # fmt: skip
        FidelityCase("fp8_decode", "speed preset exact + FP8 video-decoder linears (batched decode)", speed="exact",
                     fp8_decode=True),  # fmt: skip
        FidelityCase("first_block_cache", "speed preset exact + diffusers' FirstBlockCache (threshold 0.05)",
                     speed="exact", cache="first-block"),  # fmt: skip
        # The cache profiles: a step cache on top of a fast preset (the cache hooks first, the preset compiles last).
        *(FidelityCase(f"{speed}_{name}", f"speed preset {speed} + {what}", speed=speed, cache=method)
          for speed in ("fast", "fastest")
          for name, method, what in CACHE_PROFILE_METHODS),
    )
}


def _flat(value) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{key} {item}" for key, item in value.items())
    return str(value)


def get_case(name: str) -> FidelityCase:
    if name not in FIDELITY_CASES:
        raise ValueError(f"unknown fidelity case {name!r}: choose from {', '.join(FIDELITY_CASES)}.")
    return FIDELITY_CASES[name]


def _quantized_method(module: torch.nn.Module) -> Optional[str]:
    from ..quantizers import quantized_weight

    return next((quantized_weight(m).quant_method for m in module.modules() if quantized_weight(m) is not None), None)


def _ensure_format(module: torch.nn.Module, fmt: str, what: str) -> None:
    """Quantize a dense ``module`` to ``fmt`` in place; one already in ``fmt`` stays; another format is an error."""
    from ..quantizers import get_format, quantize

    wanted = get_format(fmt)
    stored = _quantized_method(module)
    if stored is None:
        quantize(module, wanted.config_cls())
    elif stored != wanted.method:
        raise ValueError(f"the {what} is loaded as {stored}, the case needs {fmt}: load it dense or in {fmt}.")


def apply_case(pipe, case: FidelityCase, compile: bool = True) -> List[str]:
    """Turn ``case`` on for a freshly loaded pipeline; returns what was applied, one line each. ``compile``: the
    presets' regional torch.compile (on CUDA; the presets never compile on a CPU)."""
    applied = []
    if case.dit_format is not None:
        for name, model in pipe._partitions():
            _ensure_format(model, case.dit_format, name)
        applied.append(f"DiT weights: {case.dit_format}")
    if case.text_encoder_format is not None and getattr(pipe, "text_encoder", None) is not None:
        _ensure_format(pipe.text_encoder, case.text_encoder_format, "text encoder")
        applied.append(f"text encoder weights: {case.text_encoder_format}")
    if case.cache is not None:  # before the preset: the preset compiles the blocks last
        from ..hooks.cache import cache_config

        for _, model in pipe._partitions():
            model.enable_cache(cache_config(case.cache))
        applied.append(f"step cache: {case.cache}")
    if case.speed is not None:
        from ..pipelines.speed_presets import SpeedPresetConfig, speed_preset_record

        record = speed_preset_record(pipe.enable_speed_preset(SpeedPresetConfig(case.speed, compile=compile)))
        record = record.describe()
        # What ran, as the preset recorded it; its export settings are not the run's (the clips are written lossless).
        parts = [f"{key}: {_flat(record[key])}" for key in ("weights", "attention", "compile", "decode")]
        applied.append(f"speed preset {case.speed}: " + "; ".join(parts))
    if case.fp8_decode:
        from ..hooks.fast_vae_decode import FastVAEDecodeConfig, enable_fast_vae_decode

        on_cuda = pipe.vae.device.type == "cuda"
        enable_fast_vae_decode(pipe, FastVAEDecodeConfig(batch_tiles=True, compile=compile and on_cuda,
                                                         fp8_linears=True))  # fmt: skip
        applied.append("video decode: batched tiles, FP8 decoder linears" + (", compiled" if compile and on_cuda
                                                                              else ""))  # fmt: skip
    return applied or ["nothing: the pipeline as loaded"]


def apply_text_encoder_case(pipe, case: FidelityCase) -> str:
    """Give the text encoder of ``pipe`` (a freshly loaded pipeline that only encodes prompts) the weights ``case``
    runs it with: the case's format, or what its speed preset does to a dense text encoder (``"fast"`` /
    ``"fastest"``: weight-only INT8), so that prompts encoded before the DiT loads are the ones the whole case
    would have encoded. Returns what was applied, one line."""
    if case.text_encoder_format is not None:
        _ensure_format(pipe.text_encoder, case.text_encoder_format, "text encoder")
        return f"text encoder weights: {case.text_encoder_format} (prompts encoded before the DiT loaded)"
    if case.speed is None:
        return "text encoder as loaded (prompts encoded before the DiT loaded)"
    from ..pipelines.speed_presets import _plan_text_encoder
    from ..quantizers import quantize

    config, weights = _plan_text_encoder(pipe.text_encoder, case.speed, None)
    if config is not None:
        quantize(pipe.text_encoder, config)
    return f"text encoder as speed preset {case.speed} runs it: {weights} (prompts encoded before the DiT loaded)"
