"""V100 mode: run the bf16-trained MiniMax-H3 transformer in fp16 without overflow, and name the layer if it does.

V100 (sm_70) has fp16 tensor cores but no usable bf16, so H3 runs there as fp16 GEMMs inside an fp32 model. A plain
``transformer.half()`` overflows: the residual stream and some GEMM inputs/outputs leave fp16's range (65504).
:func:`enable_v100_mode` applies, in place and reversibly (weights aside):

1. **Weights.** fp16 for the linear layers of the block stack and the token refiner; fp32 for what the reference
   keeps in fp32 (``_keep_in_fp32_modules``: patch projections, timestep MLP, output heads, rope), for every norm, and
   for ``context_embedder`` (its input, text-encoder features, can exceed fp16). H3 quantized layers
   (``nn.Linear`` with a quantized weight tensor) keep their packed storage and compute in fp16 (the W8A16 dequantize + cuBLAS path on V100).
   A weight that does not fit fp16 raises an error naming it (keep its module in fp32 with ``fp32_modules``).
2. **fp32 residual stream.** The embedders are fp32 and every hooked linear returns fp32 (step 3), so the residual
   adds, norms, AdaLN modulation, gates and the SwiGLU product run in fp32 with no cast at the block inputs.
3. **Power-of-two scaled fp16 GEMMs.** Each linear layer's input is split per row into ``x = 2^e * x'`` with
   ``max|x'| <= activation_limit`` (``e >= 0``; 1Cat-vLLM's recipe), cast to fp16, multiplied on fp16 tensor cores,
   and the output is restored in fp32 (``y = 2^e * (y' - b) + b``; exact for the bias-free H3 layers).
4. **Attention** through :class:`~diffusers_h3.attention_processors.fa_v100.MiniMaxH3FAV100Processor` (fp16 kernel,
   fp32 softmax; V scaled by a power of two if needed), or kept as it is with ``attention="keep"``.
5. **Non-finite detection.** Every hooked module's output is checked on the device without a host sync; after each
   transformer forward one sync reads the flags and, if any inf/NaN appeared, :class:`NonFiniteActivationError` names
   the first module (in execution order) whose output went non-finite.

Hooks: every hooked module holds a diffusers ``ModelHook`` named ``H3_V100_MODE_HOOK`` in its ``HookRegistry`` (the
transformer's own holds the :class:`V100Mode` record and the inf/NaN check); :func:`disable_v100_mode` (or
``V100Mode.remove``) removes them all by that name.

Hardware honesty: the transforms are tested on CPU and on a Hopper GPU; the mode has **not been run on V100 hardware**.
Apply it after loading LoRA adapters so that PEFT layers are wrapped as a whole.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Dict, List, Optional, Sequence, Union

import torch
import torch.nn as nn

from .._hooks import H3_V100_MODE_HOOK, H3Hook, h3_record, partitions_of, register_h3_hook, remove_h3_hook
from .._utils import config_from_call


FP16_MAX = 65504.0
INPUT_SUFFIX = " (input)"


class NonFiniteActivationError(FloatingPointError):
    """inf/NaN appeared in V100 mode; ``module_name`` is the first module whose output was non-finite."""

    def __init__(self, message: str, module_name: str):
        super().__init__(message)
        self.module_name = module_name


def _is_quantized_layer(module: nn.Module) -> bool:
    from ..quantizers import is_quantized_linear

    return is_quantized_linear(module)


def _is_linear_like(module: nn.Module) -> bool:
    """nn.Linear, an H3 quantized linear, or a PEFT tuner layer wrapping one (hooked as a whole)."""
    if isinstance(module, nn.Linear) or _is_quantized_layer(module):
        return True
    base = getattr(module, "base_layer", None)
    return isinstance(base, nn.Module) and (isinstance(base, nn.Linear) or _is_quantized_layer(base))


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(name == p or name.startswith(p + ".") or f".{p}." in f".{name}." for p in patterns)


def pow2_row_scale(x: torch.Tensor, limit: float) -> torch.Tensor:
    """Per-row power-of-two factor ``2^e`` (``e >= 0``) such that ``max|x_row| / 2^e <= limit``; fp32, no host sync."""
    amax = x.detach().abs().amax(dim=-1, keepdim=True).float()
    exponent = torch.clamp(torch.ceil(torch.log2(amax.clamp_min(1e-30) / limit)), min=0.0)
    # inf/NaN rows keep factor 1 so that the non-finite value reaches the detector unchanged
    exponent = torch.where(torch.isfinite(exponent), exponent, torch.zeros_like(exponent))
    return torch.exp2(exponent)


@dataclasses.dataclass
class V100Mode:
    """The record of :func:`enable_v100_mode`, held by the transformer's ``H3_V100_MODE_HOOK``: ``remove()`` takes
    the mode's hooks off (weights keep their dtypes)."""

    transformer: nn.Module = dataclasses.field(repr=False)
    activation_limit: float
    detect_non_finite: bool
    attention: str
    hooked_linears: List[str] = dataclasses.field(repr=False)
    fp32_modules: List[str] = dataclasses.field(repr=False)
    _flags: list = dataclasses.field(default_factory=list, repr=False)

    def remove(self) -> None:
        if v100_mode_of(self.transformer) is self:
            remove_h3_hook(self.transformer, H3_V100_MODE_HOOK)

    def describe_path(self) -> str:
        attention = "attention processors unchanged"
        if self.attention == "fa_v100":
            processors = {
                m.processor.describe_path()
                for m in self.transformer.modules()
                if callable(getattr(getattr(m, "processor", None), "describe_path", None))
            }
            attention = "attention: " + "; ".join(sorted(processors))
        text = (
            f"V100 mode: {len(self.hooked_linears)} linear layers as fp16 GEMMs with per-row power-of-two input "
            f"scaling (limit {self.activation_limit:g}), fp32 residual stream / norms / softmax, "
            f"{len(self.fp32_modules)} modules kept fp32, non-finite detection "
            f"{'on' if self.detect_non_finite else 'off'}; {attention}"
        )
        return text if text.endswith("not run on V100 hardware") else text + "; not run on V100 hardware"

    # -- non-finite detection --------------------------------------------------------------------------------------
    def _record(self, name: str, value) -> None:
        tensors = _tensors_of(value)
        if tensors:
            flag = torch.stack([~torch.isfinite(t).all() for t in tensors]).any()
            self._flags.append((name, flag))

    def _check(self) -> None:
        flags, self._flags = self._flags, []
        if not flags:
            return
        bad = torch.stack([f.to(flags[0][1].device) for _, f in flags]).nonzero()
        if bad.numel() == 0:
            return
        name = flags[int(bad[0, 0])][0]
        if name.startswith("input:"):
            raise NonFiniteActivationError(
                f"V100 mode: the transformer input `{name[6:]}` already contains inf/NaN; the problem is upstream "
                "(text encoder, latents or scheduler), not in the transformer.",
                name,
            )
        if name.endswith(INPUT_SUFFIX):
            name = name[: -len(INPUT_SUFFIX)]
            module = self.transformer.get_submodule(name)
            raise NonFiniteActivationError(
                f"V100 mode: inf/NaN first appeared in the input of `{name}` ({type(module).__name__}): the operation "
                "just before it produced it (the attention core for `to_out.0`, the SwiGLU product for `ff.net.2`). "
                "Check the processor's describe_path(), or keep the enclosing module in fp32 with "
                "enable_v100_mode(..., V100ModeConfig(fp32_modules=(...))).",
                name,
            )
        module = self.transformer.get_submodule(name) if name else self.transformer
        raise NonFiniteActivationError(
            f"V100 mode: inf/NaN first appeared in the output of `{name}` ({type(module).__name__}) while its inputs "
            f"were finite. Fixes: lower activation_limit (now {self.activation_limit:g}), or keep this module in fp32 "
            f"with enable_v100_mode(..., V100ModeConfig(fp32_modules=({name!r},))).",
            name,
        )


class _ScaledFP16Linear(H3Hook):
    """A linear's input split into ``2^e * x'`` (per row), cast to fp16; its output restored in fp32."""

    def __init__(self, mode: V100Mode, name: str):
        super().__init__()
        self.mode, self.name, self.scale = mode, name, None

    def pre_forward(self, module, *args, **kwargs):
        x = args[0]
        if self.mode.detect_non_finite:
            self.mode._record(self.name + INPUT_SUFFIX, x)
        self.scale = pow2_row_scale(x, self.mode.activation_limit)
        return ((x / self.scale.to(x.dtype)).to(torch.float16),) + tuple(args[1:]), kwargs

    def post_forward(self, module, output):
        scale, self.scale = self.scale, None
        bias = getattr(getattr(module, "base_layer", module), "bias", None)
        y = output.float()
        if bias is not None:
            y = (y - bias.float()) * scale + bias.float()
        else:
            y = y * scale
        if self.mode.detect_non_finite:
            self.mode._record(self.name, y)
        return y


class _WatchOutput(H3Hook):
    """Flags (on the device) whether a module's output went non-finite."""

    def __init__(self, mode: V100Mode, name: str):
        super().__init__()
        self.mode, self.name = mode, name

    def post_forward(self, module, output):
        self.mode._record(self.name, output)
        return output


class _V100ModeHook(H3Hook):
    """On the transformer: holds the :class:`V100Mode` record; with detection on, checks the inputs before the
    forward and, after it, reads every flag of the forward with one host sync."""

    def pre_forward(self, module, *args, **kwargs):
        mode: V100Mode = self.record
        if mode.detect_non_finite:
            mode._flags = []
            named = dict(kwargs)
            for value, key in zip(args, ("hidden_states", "audio_hidden_states", "encoder_hidden_states")):
                named[key] = value
            for key in ("hidden_states", "audio_hidden_states", "encoder_hidden_states", "timestep"):
                if isinstance(named.get(key), torch.Tensor):
                    mode._record(f"input:{key}", named[key])
        return args, kwargs

    def post_forward(self, module, output):
        mode: V100Mode = self.record
        if mode.detect_non_finite:
            mode._record("", output)
            mode._check()
        return output


def v100_mode_of(transformer: nn.Module) -> Optional[V100Mode]:
    """The :class:`V100Mode` enabled on ``transformer``, or ``None``."""
    return h3_record(transformer, H3_V100_MODE_HOOK)


def disable_v100_mode(pipe_or_transformer):
    """Take V100 mode's hooks off a transformer or a pipeline's partitions (weights keep their dtypes; a no-op where
    it is not enabled); returns the argument."""
    for _, model in partitions_of(pipe_or_transformer):
        mode = v100_mode_of(model)
        if mode is not None:
            mode.remove()
    return pipe_or_transformer


def _tensors_of(value) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, dict) or hasattr(value, "values"):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_of(v)]
    return []


def _fp32_patterns(transformer: nn.Module, extra: Sequence[str]) -> List[str]:
    keep = list(getattr(transformer, "_keep_in_fp32_modules", None) or [])
    return keep + ["context_embedder"] + list(extra)


def _cast_weights(transformer: nn.Module, fp32_patterns: Sequence[str]) -> List[str]:
    """fp16 everywhere except fp32 modules and norms; quantized layers switch their compute dtype to fp16."""
    fp32_modules = []
    quantized = set()
    for name, module in transformer.named_modules():
        if any(name.startswith(q + ".") for q in quantized):
            continue
        if _is_quantized_layer(module):
            quantized.add(name)
            module.half()  # keeps the packed int8 / fp4 storage and fp32 scales; compute dtype becomes fp16
            continue
        keep_fp32 = _matches(name, fp32_patterns) or isinstance(module, (nn.RMSNorm, nn.LayerNorm, nn.GroupNorm))
        if keep_fp32 and name:
            fp32_modules.append(name)
        for pname, param in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            if param is None or not param.is_floating_point():
                continue
            if keep_fp32:
                param.data = param.data.float()
                continue
            if param.dtype != torch.float16:
                amax = param.detach().abs().max().item() if param.numel() else 0.0
                if amax > FP16_MAX:
                    raise ValueError(
                        f"V100 mode: `{name}.{pname}` holds values up to {amax:.3g}, beyond fp16's {FP16_MAX:g}. Keep "
                        f"its module in fp32: enable_v100_mode(..., V100ModeConfig(fp32_modules=({name!r},)))."
                    )
                param.data = param.data.half()
    # drop nested duplicates (a norm inside an fp32 module) from the report
    return [n for n in fp32_modules if not any(n.startswith(o + ".") for o in fp32_modules if o != n)]


@dataclasses.dataclass(frozen=True)
class V100ModeConfig:
    """The options of :func:`enable_v100_mode`.

    Args:
        attention (`str`, defaults to `"fa_v100"`): ``"fa_v100"`` installs :class:`MiniMaxH3FAV100Processor`;
            ``"keep"`` leaves the attention processors alone.
        query_tile (`int`), allow_non_volta (`bool`), build_dir (`str`, *optional*): passed to the FA-V100 processor.
        activation_limit (`float`, defaults to `2048.0`): rows of a GEMM input are scaled by a power of two to stay
            within this magnitude (2^11 leaves fp16 headroom for the GEMM's sums).
        detect_non_finite (`bool`, defaults to `True`): check every hooked linear's input and output and every
            attention / block / fp32 module's output on the device (an extra read of each activation); one host sync
            per transformer forward.
        fp32_modules (`tuple[str]`): extra module names (or name fragments) to keep entirely in fp32.
    """

    attention: str = "fa_v100"
    query_tile: int = 128
    allow_non_volta: bool = False
    activation_limit: float = 2048.0
    detect_non_finite: bool = True
    fp32_modules: Sequence[str] = ()
    build_dir: Optional[Union[str, os.PathLike]] = None

    def __post_init__(self):
        if self.attention not in ("fa_v100", "keep"):
            raise ValueError(f"attention must be 'fa_v100' or 'keep', got {self.attention!r}.")
        if not self.activation_limit > 0 or self.activation_limit > FP16_MAX / 4:
            raise ValueError(f"activation_limit must be in (0, {FP16_MAX / 4:g}], got {self.activation_limit}.")
        object.__setattr__(self, "fp32_modules", tuple(self.fp32_modules))


def enable_v100_mode(pipe_or_transformer, config: Optional[V100ModeConfig] = None, **legacy):
    """Make a MiniMax-H3 transformer (or every transformer partition of a pipeline) run fp16 GEMMs safely (see the
    module docstring) with the options of ``config`` (a :class:`V100ModeConfig`; default: its defaults); returns the
    argument. The options as separate keyword arguments still work for one release, with a ``FutureWarning``. The
    :class:`V100Mode` record (``v100_mode_of(transformer)``) says what was set up; :func:`disable_v100_mode` undoes
    the hooks. ``transformer``: a ``MiniMaxH3Transformer3DModel`` (any dtype; bf16 checkpoints are converted)."""
    config = config_from_call(V100ModeConfig, config, legacy, call="enable_v100_mode")
    models = partitions_of(pipe_or_transformer)
    if not models:
        raise TypeError(f"enable_v100_mode expects a MiniMaxH3Transformer3DModel or a pipeline with a `transformer`, "
                        f"got {type(pipe_or_transformer).__name__}.")  # fmt: skip
    for _, model in models:
        _enable_v100_mode(model, config)
    return pipe_or_transformer


def _enable_v100_mode(transformer: nn.Module, config: V100ModeConfig) -> None:
    if v100_mode_of(transformer) is not None:
        raise RuntimeError(
            "V100 mode is already enabled on this transformer; call disable_v100_mode(transformer) first."
        )
    blocks = list(getattr(transformer, "transformer_blocks", []))
    refiner = getattr(transformer, "token_refiner", None)
    refiner_blocks = list(getattr(refiner, "refiner_blocks", [])) if refiner is not None else []
    if not blocks:
        raise TypeError(
            f"enable_v100_mode expects a MiniMaxH3Transformer3DModel (with transformer_blocks), got "
            f"{type(transformer).__name__}."
        )

    kept = _cast_weights(transformer, _fp32_patterns(transformer, config.fp32_modules))
    fp32_patterns = _fp32_patterns(transformer, config.fp32_modules)

    if config.attention == "fa_v100":
        from ..attention_processors.fa_v100 import MiniMaxH3FAV100Processor

        transformer.set_attn_processor(MiniMaxH3FAV100Processor(
            query_tile=config.query_tile, allow_non_volta=config.allow_non_volta, build_dir=config.build_dir
        ))  # fmt: skip

    # Linear-like modules of the block stack, the refiner and the output norm, outermost only.
    targets: Dict[str, nn.Module] = {}
    for name, module in transformer.named_modules():
        if not name or _matches(name, fp32_patterns) or any(name.startswith(t + ".") for t in targets):
            continue
        if not name.startswith(("transformer_blocks.", "token_refiner.", "norm_out.")):
            continue
        if _is_linear_like(module):
            targets[name] = module

    mode = V100Mode(
        transformer=transformer,
        activation_limit=float(config.activation_limit),
        detect_non_finite=bool(config.detect_non_finite),
        attention=config.attention,
        hooked_linears=list(targets),
        fp32_modules=kept,
    )

    register_h3_hook(transformer, _V100ModeHook(mode), H3_V100_MODE_HOOK)
    for name, module in targets.items():
        register_h3_hook(module, _ScaledFP16Linear(mode, name), H3_V100_MODE_HOOK, root=transformer)

    if config.detect_non_finite:
        watched = set(targets)
        for name, module in transformer.named_modules():
            if not name or name in watched or any(name.startswith(t + ".") for t in targets):
                continue
            is_block = any(module is b for b in blocks + refiner_blocks)
            if is_block or hasattr(module, "processor") or _matches(name, fp32_patterns):
                if any(name.startswith(w + ".") for w in watched if _matches(w, fp32_patterns)):
                    continue
                watched.add(name)
                register_h3_hook(module, _WatchOutput(mode, name), H3_V100_MODE_HOOK, root=transformer)
