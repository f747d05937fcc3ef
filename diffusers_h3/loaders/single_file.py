"""Single-file MiniMax-H3 DiTs: the checkpoints ComfyUI users already hold.

:func:`load_transformer_file` returns a ``MiniMaxH3Transformer3DModel`` from one ``.safetensors`` or ``.gguf`` file:

- **bf16 / fp16 / fp32 safetensors**, ComfyUI-named (``blocks.N.attn.qkv_proj``, ``mlp.fc1``, ``video_patch_proj``
  ... with or without the ``model.diffusion_model.`` prefix) or diffusers-named;
- **GGUF** (ComfyUI-GGUF files, any type diffusers' GGUF quantizer dequantizes: Q8_0, Q6_K, Q5_K, Q4_K, ...): the
  blocks stay packed in diffusers' ``GGUFLinear`` layers, whose GEMM dequantizes the weight per call (diffusers'
  ``forward_native``);
- **"fp8 scaled"** safetensors (``float8_e4m3fn`` weights with one scale per layer: ComfyUI's ``<layer>.weight_scale``
  + ``<layer>.comfy_quant`` layout, or the older ``<layer>.scale_weight`` + ``scaled_fp8`` marker layout): the codes
  go straight into :class:`~diffusers_h3.quantizers.FP8Tensor` weights of ``nn.Linear`` layers with the file's scale as their (per-row)
  ``weight_scale``, without a bf16 round trip;
- **pruned DiTs**: with fewer blocks (the block count is read from the keys; ``num_layers`` of the config is replaced
  by it), or in ComfyUI's curve form (an ``adaln_t_table`` replaces the time embedder, the AdaLN projections are
  rank-reduced: :mod:`._curve_adaln`), in any of the formats above.

Names are mapped with diffusers' own converter (``convert_minimax_h3_transformer_checkpoint_to_diffusers``: the
``[q; k; v]`` split of ``qkv_proj``, the ``[gate; value]`` -> ``[value; gate]`` swap of ``fc1``), so a file loads
to the same weights as diffusers' ``MiniMaxH3Transformer3DModel.from_single_file`` maps it to. What this module adds
to diffusers' single-file loader: a local config (the rest of the pipeline's), the ComfyUI key prefix, the
fp8-scaled layout, pruned block counts, the float32 modules kept in float32 (as ``from_pretrained`` keeps them;
``from_single_file`` casts them), and **one-line refusals before any tensor is read**: every key, shape and tensor
type of the file is checked against the model from its header alone (missing or unknown tensors, other widths, a
quantization type or ComfyUI ``comfy_quant`` format we do not know).

The loaded model carries a record of the file (:func:`transformer_file_record`), which ``diffusers_h3.describe``
reports.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from diffusers import MiniMaxH3Transformer3DModel
from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers
from torch import nn

from .._hooks import H3_SINGLE_FILE_HOOK, H3Hook, h3_record, register_h3_hook
from .._utils import move_non_persistent_buffers
from ._curve_adaln import CURVE_TABLE_KEY, is_curve_form, to_curve_form


SINGLE_FILE_SUFFIXES = (".safetensors", ".gguf")
# ComfyUI full checkpoints prefix the DiT's keys; diffusion-model files usually do not.
KEY_PREFIXES = ("model.diffusion_model.", "diffusion_model.")

FORMAT_DENSE = "dense"
FORMAT_GGUF = "gguf"
FORMAT_FP8_SCALED = "fp8_scaled"

# The per-layer sidecars of ComfyUI's quantized safetensors (new and legacy spelling).
_WEIGHT_SCALE_SUFFIXES = (".weight_scale", ".scale_weight")
_INPUT_SCALE_SUFFIXES = (".input_scale", ".scale_input")
_COMFY_QUANT_SUFFIX = ".comfy_quant"
_LEGACY_FP8_MARKER = "scaled_fp8"
_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_FP8_DTYPE = "F8_E4M3"
_CURVE_TABLE = "adaln_t_table"
_BLOCK_KEY = re.compile(r"^(?:transformer_blocks|blocks)\.(\d+)\.")


class TransformerFileError(ValueError):
    """A single-file DiT this package cannot load; the message is one line naming what is wrong and the fix."""


@dataclasses.dataclass
class TransformerFileRecord:
    """What a single-file DiT was (``describe()`` reports it)."""

    path: str
    format: str  # FORMAT_DENSE, FORMAT_GGUF or FORMAT_FP8_SCALED
    naming: str  # "ComfyUI" or "diffusers"
    tensor_types: Dict[str, int]  # file tensor type -> how many tensors
    num_layers: int
    config_num_layers: int
    notes: Tuple[str, ...] = ()

    @property
    def quantized(self) -> bool:
        return self.format != FORMAT_DENSE

    def summary(self) -> str:
        """One line: the file's format and what runs its GEMMs."""
        name = os.path.basename(self.path)
        if self.format == FORMAT_GGUF:
            packed = {t: n for t, n in self.tensor_types.items() if t not in ("F32", "F16", "BF16")}
            kinds = ", ".join(f"{t} x{n}" for t, n in sorted(packed.items())) or "no packed tensors"
            return (
                f"GGUF file {name} ({kinds}): diffusers' GGUFLinear layers, each GEMM dequantizes its weight per call "
                "(diffusers' dequantize path) and runs a 16-bit matmul"
            )
        if self.format == FORMAT_FP8_SCALED:
            return (
                f"fp8-scaled file {name} ({self.tensor_types.get(_FP8_DTYPE, 0)} float8_e4m3fn weights, one scale per "
                "layer): FP8Linear layers (diffusers-h3 FP8 GEMMs)"
            )
        kinds = ", ".join(f"{t} x{n}" for t, n in sorted(self.tensor_types.items()))
        return f"{self.naming}-named safetensors file {name} ({kinds})"

    def as_dict(self) -> Dict[str, Any]:
        out = {"file": self.path, "format": self.summary(), "naming": self.naming, "tensor_types": self.tensor_types}
        if self.num_layers != self.config_num_layers:
            out["blocks"] = f"{self.num_layers} (pruned: the config has {self.config_num_layers})"
        else:
            out["blocks"] = self.num_layers
        if self.notes:
            out["notes"] = list(self.notes)
        return out


class _TransformerFileHook(H3Hook):
    """Holds the :class:`TransformerFileRecord` of a model loaded from one file; changes nothing at run time."""


def transformer_file_record(model: nn.Module) -> Optional[TransformerFileRecord]:
    """The record of the single file ``model`` was loaded from, or ``None``."""
    return h3_record(model, H3_SINGLE_FILE_HOOK)


def is_gguf_linear(module: nn.Module) -> bool:
    """A diffusers ``GGUFLinear`` (its weight is a packed ``GGUFParameter``)."""
    return type(module).__name__ == "GGUFLinear" and hasattr(getattr(module, "weight", None), "quant_type")


# ---------------------------------------------------------------------------------------------------------------------
# Reading headers (no tensor data)
# ---------------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _FileTensor:
    shape: Tuple[int, ...]  # logical shape (GGUF: the unpacked shape)
    kind: str  # safetensors dtype ("BF16", "F8_E4M3", ...) or GGUF type name ("Q4_K", "F32", ...)


def _fail(path, what: str, fix: str) -> TransformerFileError:
    return TransformerFileError(f"{path}: {what} — {fix}")


def check_transformer_file_path(path) -> Path:
    """``path`` as an existing ``.safetensors`` / ``.gguf`` file (one-line :class:`TransformerFileError` otherwise)."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise _fail(path, "is a folder, not a single-file DiT", "pass the .safetensors or .gguf file itself")
    if not path.is_file():
        raise _fail(path, "no such file", "check the path")
    if path.suffix.lower() not in SINGLE_FILE_SUFFIXES:
        raise _fail(
            path,
            f"a {path.suffix or 'suffix-less'} file is not a single-file DiT format this package reads",
            "pass a .safetensors (bf16 or fp8-scaled) or .gguf file",
        )
    return path


def _read_safetensors(path: Path) -> Tuple[Dict[str, _FileTensor], Dict[str, str]]:
    from .._checkpoint_files import safetensors_problem

    problem = safetensors_problem(path)
    if problem:
        raise _fail(path, problem, "download the file again")
    from safetensors import safe_open

    tensors = {}
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
        for key in handle.keys():
            view = handle.get_slice(key)
            tensors[key] = _FileTensor(tuple(view.get_shape()), view.get_dtype())
    return tensors, metadata


def _read_gguf(path: Path) -> Dict[str, _FileTensor]:
    try:
        import gguf
    except ImportError:
        raise _fail(path, "reading GGUF files needs the `gguf` package", "pip install 'diffusers-h3[gguf]'") from None
    from diffusers.quantizers.gguf.utils import SUPPORTED_GGUF_QUANT_TYPES

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError, IndexError) as error:
        raise _fail(path, f"not a readable GGUF file ({error})", "download the file again") from None
    readable = set(SUPPORTED_GGUF_QUANT_TYPES) | {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}
    tensors = {}
    for tensor in reader.tensors:
        kind = gguf.GGMLQuantizationType(tensor.tensor_type)
        if kind not in readable:
            raise _fail(
                path,
                f"tensor {tensor.name!r} is stored as GGUF type {kind.name}, which diffusers' GGUF quantizer cannot "
                f"dequantize (it reads {', '.join(sorted(t.name for t in readable))})",
                "use a GGUF of one of those types (e.g. Q8_0, Q6_K, Q5_K_M, Q4_K_M)",
            )
        tensors[tensor.name] = _FileTensor(tuple(int(n) for n in reversed(tensor.shape.tolist())), kind.name)
    return tensors


def _strip_prefix(names) -> Tuple[Dict[str, str], Optional[str]]:
    """``{name without ComfyUI's prefix: name in the file}`` and the prefix found (or ``None``)."""
    names = list(names)
    for prefix in KEY_PREFIXES:
        if names and all(n.startswith(prefix) or n == _LEGACY_FP8_MARKER for n in names):
            return {n[len(prefix) :] if n.startswith(prefix) else n: n for n in names}, prefix
    return {n: n for n in names}, None


def _read_comfy_quant(path: Path, file_key: str) -> Dict[str, Any]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        blob = handle.get_tensor(file_key)
    try:
        return json.loads(bytes(blob.to(torch.uint8).tolist()).decode())
    except (UnicodeDecodeError, ValueError) as error:
        raise _fail(path, f"{file_key!r} is not a ComfyUI quantization record ({error})", "download the file again") from None


@dataclasses.dataclass
class _FileLayout:
    """The tensors of a file sorted by role (names without ComfyUI's prefix)."""

    path: Path
    format: str
    file_names: Dict[str, str]  # name -> name in the file
    weights: Dict[str, _FileTensor]  # every model tensor (weights, biases, norms)
    weight_scales: Dict[str, str]  # FP8 module (file naming) -> name of its scale tensor
    input_scales: List[str]
    prefix: Optional[str]
    curve: Optional[Tuple[int, int]] = None  # (grid, rank) of a curve-form DiT's adaln_t_table


def _sort_tensors(path: Path, tensors: Dict[str, _FileTensor], fmt_hint: str) -> _FileLayout:
    names, prefix = _strip_prefix(tensors)
    weights, weight_scales, input_scales, comfy_quant = {}, {}, [], {}
    legacy_marker = None
    for name, file_name in names.items():
        tensor = tensors[file_name]
        if name == _LEGACY_FP8_MARKER:
            legacy_marker = tensor.kind
        elif name.endswith(_WEIGHT_SCALE_SUFFIXES):
            weight_scales[name.rsplit(".", 1)[0]] = name
        elif name.endswith(_INPUT_SCALE_SUFFIXES):
            input_scales.append(name)
        elif name.endswith(_COMFY_QUANT_SUFFIX):
            comfy_quant[name[: -len(_COMFY_QUANT_SUFFIX)]] = file_name
        else:
            weights[name] = tensor
    curve = None
    if _CURVE_TABLE in weights:  # a curve-form "pruned" DiT: the table is its time embedder (loaded as CURVE_TABLE_KEY)
        table = weights.pop(_CURVE_TABLE)
        if len(table.shape) != 2 or table.shape[0] < 2 or table.kind not in _FLOAT_DTYPES and fmt_hint != FORMAT_GGUF:
            raise _fail(path, f"{_CURVE_TABLE} is {list(table.shape)} {table.kind}, not a [grid, rank] float table",
                        "download the file again")  # fmt: skip
        curve = (int(table.shape[0]), int(table.shape[1]))
        weights[CURVE_TABLE_KEY] = table
        names[CURVE_TABLE_KEY] = names.pop(_CURVE_TABLE)
    for module, file_key in sorted(comfy_quant.items()):
        record = _read_comfy_quant(path, file_key)
        if record.get("format") != "float8_e4m3fn":
            raise _fail(
                path,
                f"layer {module!r} is quantized as ComfyUI format {record.get('format')!r} (comfy_quant {record}); "
                "this package reads float8_e4m3fn (fp8 scaled) layers only",
                "use a bf16, fp8-scaled or GGUF file",
            )
        if module not in weight_scales:
            raise _fail(path, f"fp8 layer {module!r} has a comfy_quant record but no weight_scale", "download the file again")
    if legacy_marker is not None and legacy_marker != _FP8_DTYPE:
        raise _fail(path, f"its scaled_fp8 marker says {legacy_marker}; only float8_e4m3fn is read", "use an e4m3fn file")
    kinds = Counter(t.kind for t in weights.values())
    fmt = fmt_hint
    if fmt_hint != FORMAT_GGUF:
        unknown = sorted(k for k in kinds if k not in _FLOAT_DTYPES and k != _FP8_DTYPE)
        if unknown:
            example = next(n for n, t in weights.items() if t.kind == unknown[0])
            raise _fail(
                path,
                f"tensor {example!r} is stored as {unknown[0]} (a quantized layout this package does not read; e.g. "
                "ComfyUI int8 / NVFP4 / MXFP8 files)",
                "use a bf16, fp8-scaled (float8_e4m3fn) or GGUF file",
            )
        fp8 = [n for n, t in weights.items() if t.kind == _FP8_DTYPE]
        if fp8:
            fmt = FORMAT_FP8_SCALED
            unscaled = [n for n in fp8 if n.rsplit(".", 1)[0] not in weight_scales]
            if unscaled:
                raise _fail(
                    path,
                    f"{len(unscaled)} float8_e4m3fn weights have no per-layer scale (e.g. {unscaled[0]!r}): a plain "
                    "fp8 cast, not an fp8-scaled file",
                    "use an fp8-scaled file (weight_scale / scale_weight per layer) or a bf16 file",
                )
            orphans = sorted(set(weight_scales) - {n.rsplit(".", 1)[0] for n in fp8})
            if orphans:
                raise _fail(path, f"scale tensor of {orphans[0]!r} belongs to no float8 weight", "download the file again")
        elif weight_scales:
            raise _fail(
                path,
                f"it holds weight scales (e.g. {next(iter(weight_scales.values()))!r}) but no float8 weights",
                "download the file again",
            )
        else:
            fmt = FORMAT_DENSE
    return _FileLayout(path, fmt, names, weights, weight_scales, input_scales, prefix, curve)


def _read_layout(path: Path) -> _FileLayout:
    if path.suffix.lower() == ".gguf":
        return _sort_tensors(path, _read_gguf(path), FORMAT_GGUF)
    tensors, _metadata = _read_safetensors(path)
    return _sort_tensors(path, tensors, FORMAT_DENSE)


# ---------------------------------------------------------------------------------------------------------------------
# Config and key mapping, on the meta device
# ---------------------------------------------------------------------------------------------------------------------
def _load_config(config) -> Dict[str, Any]:
    """The transformer config: a dict, a folder (``config.json`` in it or in its ``transformer/``), a hub repo id, or
    ``None`` (the released MiniMax-H3 DiT: the class defaults)."""
    if config is None:
        parameters = inspect.signature(MiniMaxH3Transformer3DModel.__init__).parameters
        return {name: p.default for name, p in parameters.items() if name != "self"}
    if isinstance(config, dict):
        return dict(config)
    folder = Path(str(config)).expanduser()
    if folder.is_dir():
        for candidate in (folder, folder / "transformer"):
            if (candidate / "config.json").is_file():
                return dict(MiniMaxH3Transformer3DModel.load_config(str(candidate)))
        raise TransformerFileError(
            f"{folder}: no config.json in it or in its transformer/ folder — pass the pipeline folder the file belongs "
            "to (--model), or config=None for the released MiniMax-H3 config"
        )
    return dict(MiniMaxH3Transformer3DModel.load_config(str(config), subfolder="transformer"))


def _file_block_count(path: Path, names) -> int:
    indices = sorted({int(m.group(1)) for m in map(_BLOCK_KEY.match, names) if m})
    if not indices:
        raise _fail(path, "holds no transformer blocks (no blocks.N.* keys): not a MiniMax-H3 DiT", "pass the DiT file")
    missing = sorted(set(range(indices[-1] + 1)) - set(indices))
    if missing:
        raise _fail(
            path,
            f"its transformer blocks are numbered 0..{indices[-1]} with {len(missing)} missing (e.g. {missing[:5]})",
            "renumber a pruned file's blocks 0..N-1 (the order they run in)",
        )
    return indices[-1] + 1


def _meta(shape, kind: str) -> torch.Tensor:
    return torch.empty(shape, device="meta", dtype=torch.uint8 if kind == _FP8_DTYPE else torch.float32)


def _map_names(path: Path, shapes: Dict[str, Tuple[Tuple[int, ...], str]], config, qkv_layout: str, expected):
    """``{diffusers name: (file name, shape)}``: diffusers' converter run on meta tensors of the file's shapes (each
    tensor alone, so that every output is traced back to its file tensor); diffusers-named files pass as they are."""
    if set(shapes) <= set(expected):
        return {name: (name, shape) for name, (shape, _) in shapes.items()}, "diffusers"
    mapped = {}
    for name, (shape, kind) in shapes.items():
        try:
            converted = convert_minimax_h3_transformer_checkpoint_to_diffusers(
                {name: _meta(shape, kind)}, config=config, qkv_layout=qkv_layout
            )
        except (RuntimeError, ValueError) as error:
            raise _fail(path, f"tensor {name!r} {list(shape)} does not convert ({error})", "pass a MiniMax-H3 DiT file")
        for new_name, tensor in converted.items():
            mapped[new_name] = (name, tuple(tensor.shape))
    return mapped, "ComfyUI"


def _check_against_model(path: Path, mapped, expected: Dict[str, torch.Size], config) -> None:
    for name in sorted(set(expected) & set(mapped)):  # other widths first: they name the config that does not fit
        if tuple(expected[name]) != tuple(mapped[name][1]):
            raise _fail(
                path,
                f"tensor {mapped[name][0]!r} is {list(mapped[name][1])} but the model config (hidden_size "
                f"{config['hidden_size']}, {config['num_attention_heads']} heads x {config['attention_head_dim']}, "
                f"ffn_dim {config['ffn_dim']}) needs {list(expected[name])} for {name}",
                "pass the config of the model the file was saved from",
            )
    missing = sorted(set(expected) - set(mapped))
    unexpected = sorted(set(mapped) - set(expected))
    if missing:
        raise _fail(
            path,
            f"{len(missing)} tensors the model needs are not in the file (e.g. {missing[:4]})",
            "pass a complete MiniMax-H3 DiT file (a partial save or a LoRA is not a DiT)",
        )
    if unexpected:
        sources = [mapped[n][0] for n in unexpected[:4]]
        raise _fail(
            path,
            f"{len(unexpected)} tensors of the file are not MiniMax-H3 DiT tensors (e.g. {sources})",
            "pass a MiniMax-H3 DiT file (another model, or a DiT variant with extra modules such as trained gates)",
        )


@dataclasses.dataclass
class TransformerFilePlan:
    """Everything checked from the file's header, before any tensor is read."""

    layout: _FileLayout
    config: Dict[str, Any]
    mapped: Dict[str, Tuple[str, Tuple[int, ...]]]
    naming: str
    config_num_layers: int


def inspect_transformer_file(path, config=None, num_layers: Optional[int] = None, qkv_layout: str = "stacked"):
    """Check a single-file DiT against the model from its header alone; returns the plan :func:`load_transformer_file`
    loads, or raises one :class:`TransformerFileError` line naming what is wrong."""
    path = check_transformer_file_path(path)
    layout = _read_layout(path)
    config = _load_config(config)
    config_num_layers = int(config.get("num_layers", 50))
    blocks = _file_block_count(path, layout.weights)
    if num_layers is not None and num_layers != blocks:
        raise _fail(path, f"holds {blocks} transformer blocks, not num_layers={num_layers}", "drop num_layers")
    config["num_layers"] = blocks
    if layout.curve is not None:  # the AdaLN projections read the curve's rank instead of the time embedder's width
        config["time_embed_dim"] = layout.curve[1]
    model = _empty_model(config, layout.curve)
    expected = {name: tensor.shape for name, tensor in model.state_dict().items()}
    shapes = {name: (tensor.shape, tensor.kind) for name, tensor in layout.weights.items()}
    mapped, naming = _map_names(path, shapes, config, qkv_layout, expected)
    _check_against_model(path, mapped, expected, config)
    if layout.format == FORMAT_FP8_SCALED:
        linears = {name for name, module in model.named_modules() if type(module) is nn.Linear}
        for new_name, (file_name, _) in mapped.items():
            if layout.weights[file_name].kind == _FP8_DTYPE and new_name.rsplit(".", 1)[0] not in linears:
                raise _fail(path, f"float8 tensor {file_name!r} is not the weight of a Linear layer", "use a bf16 file")
    return TransformerFilePlan(layout, config, mapped, naming, config_num_layers)


# ---------------------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------------------
def _convert(plan: TransformerFilePlan, state_dict: Dict[str, torch.Tensor], qkv_layout: str) -> Dict[str, torch.Tensor]:
    if plan.naming == "diffusers":
        return state_dict
    return convert_minimax_h3_transformer_checkpoint_to_diffusers(state_dict, config=plan.config, qkv_layout=qkv_layout)


def _read_tensors(plan: TransformerFilePlan) -> Dict[str, torch.Tensor]:
    path = plan.layout.path
    if plan.layout.format == FORMAT_GGUF:
        from diffusers.models.model_loading_utils import load_gguf_checkpoint

        tensors = load_gguf_checkpoint(str(path))
    else:
        from safetensors import safe_open

        # Copied out of the memory map: the file's tensors sit at arbitrary byte offsets, and unaligned weights take
        # other (slower, differently rounding) CPU GEMM kernels than the same weights loaded by from_pretrained.
        with safe_open(str(path), framework="pt") as handle:
            tensors = {name: handle.get_tensor(name).clone() for name in handle.keys()}
    renamed = {name: tensors.pop(file_name) for name, file_name in plan.layout.file_names.items()}
    renamed.pop(_LEGACY_FP8_MARKER, None)
    return renamed


def _empty_model(config, curve: Optional[Tuple[int, int]] = None) -> MiniMaxH3Transformer3DModel:
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = MiniMaxH3Transformer3DModel.from_config(config)
    if curve is not None:
        to_curve_form(model, *curve)
    return model


def _keep_fp32() -> List[str]:
    return list(MiniMaxH3Transformer3DModel._keep_in_fp32_modules or [])


def _check_loaded(model: nn.Module, path: Path) -> None:
    left = [name for name, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    left = [name for name in left if not name.endswith("rope.inv_freq")]
    if left:  # the header check makes this unreachable; never hand out a half-loaded model
        raise _fail(path, f"{len(left)} tensors were not loaded (e.g. {left[:4]})", "report this file")


def _load_dense(plan, tensors, dtype, device, qkv_layout) -> MiniMaxH3Transformer3DModel:
    from diffusers.models.model_loading_utils import load_model_dict_into_meta

    model = _empty_model(plan.config, plan.layout.curve)
    state_dict = _convert(plan, tensors, qkv_layout)
    load_model_dict_into_meta(model, state_dict, dtype=dtype, device_map={"": device}, keep_in_fp32_modules=_keep_fp32())
    return model


def _load_gguf(plan, tensors, dtype, device, qkv_layout) -> MiniMaxH3Transformer3DModel:
    from diffusers import GGUFQuantizationConfig
    from diffusers.models.model_loading_utils import load_model_dict_into_meta
    from diffusers.quantizers import DiffusersAutoQuantizer

    model = _empty_model(plan.config, plan.layout.curve)
    state_dict = _convert(plan, tensors, qkv_layout)
    quantizer = DiffusersAutoQuantizer.from_config(GGUFQuantizationConfig(compute_dtype=dtype))
    quantizer.validate_environment()
    dtype = quantizer.update_torch_dtype(dtype)
    quantizer.preprocess_model(model=model, device_map=None, state_dict=state_dict, keep_in_fp32_modules=_keep_fp32())
    load_model_dict_into_meta(
        model, state_dict, dtype=dtype, device_map={"": device}, hf_quantizer=quantizer,
        keep_in_fp32_modules=_keep_fp32(),
    )  # fmt: skip
    quantizer.postprocess_model(model)
    model.hf_quantizer = quantizer
    return model


def _fp8_rows(plan, tensors, qkv_layout) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """``({module: E4M3 codes}, {module: per-row fp32 scale})`` in diffusers naming. The file's scale (one per layer,
    or one per row) goes through the converter as a ``[rows, 1]`` column beside its codes, so the qkv split and the fc1
    half swap move codes and scales alike."""
    codes, scales = {}, {}
    for module, scale_name in plan.layout.weight_scales.items():
        weight = tensors.pop(f"{module}.weight")
        scale = tensors.pop(scale_name).float().reshape(-1)
        rows = weight.shape[0]
        if scale.numel() not in (1, rows):
            raise _fail(
                plan.layout.path,
                f"{scale_name!r} holds {scale.numel()} scales for {rows} rows (one per layer or one per row expected)",
                "use an fp8-scaled file with per-tensor or per-row scales",
            )
        column = scale.expand(rows).reshape(rows, 1).contiguous()
        for name, part in _convert(plan, {f"{module}.weight": weight.view(torch.uint8)}, qkv_layout).items():
            codes[name.rsplit(".", 1)[0]] = part.contiguous().view(torch.float8_e4m3fn)
        for name, part in _convert(plan, {f"{module}.weight": column}, qkv_layout).items():
            scales[name.rsplit(".", 1)[0]] = part.reshape(-1).contiguous()
    return codes, scales


def _load_fp8_scaled(plan, tensors, dtype, device, qkv_layout, backend: str) -> MiniMaxH3Transformer3DModel:
    from diffusers.models.model_loading_utils import load_model_dict_into_meta

    from ..quantizers import FP8Config, FP8Tensor, install_quantized_weight, is_quantized_linear
    from ..quantizers.apply import _attach_to_model
    from ..quantizers.config import module_name_matches

    for name in plan.layout.input_scales:
        tensors.pop(name)
    codes, scales = _fp8_rows(plan, tensors, qkv_layout)
    model = _empty_model(plan.config, plan.layout.curve)
    keep = _keep_fp32()
    fp32_modules = sorted(name for name in codes if module_name_matches(name, keep))
    fp8_modules = sorted(set(codes) - set(fp32_modules))
    config = FP8Config(compute_dtype=dtype, backend=backend)
    for name in fp8_modules:
        linear = model.get_submodule(name)
        weight = FP8Tensor.from_storage({"weight": codes[name].to(device), "weight_scale": scales[name].to(device)},
                                        linear.out_features, linear.in_features, dtype, **config.layer_kwargs())
        install_quantized_weight(linear, weight)
    state_dict = _convert(plan, tensors, qkv_layout)
    for name in fp32_modules:  # a float32 module of the model: dequantized once (E4M3 x scale is exact in float32)
        state_dict[f"{name}.weight"] = codes[name].float() * scales[name][:, None]
    load_model_dict_into_meta(model, state_dict, dtype=dtype, device_map={"": device}, keep_in_fp32_modules=keep)
    dense = [n for n, m in model.named_modules() if type(m) is nn.Linear and not is_quantized_linear(m)]
    # The file decides which layers are FP8: an explicit list of the dense ones, so that save_pretrained /
    # from_pretrained reproduce exactly this selection.
    config.modules_to_not_convert = dense
    _attach_to_model(model, config)
    return model


def _file_dtype(layout: _FileLayout) -> torch.dtype:
    """A dense file's own dtype (that of most of its block tensors); bfloat16 for GGUF and fp8-scaled files."""
    if layout.format != FORMAT_DENSE:
        return torch.bfloat16
    kinds = Counter(t.kind for name, t in layout.weights.items() if _BLOCK_KEY.match(name))
    return _FLOAT_DTYPES[kinds.most_common(1)[0][0]]


def load_transformer_file(
    path: Union[str, os.PathLike],
    config: Union[None, str, os.PathLike, Dict[str, Any]] = None,
    *,
    dtype: Optional[torch.dtype] = None,
    device: Union[str, torch.device] = "cpu",
    num_layers: Optional[int] = None,
    qkv_layout: str = "stacked",
    quantization_config=None,
    fp8_backend: str = "auto",
) -> MiniMaxH3Transformer3DModel:
    """Load a ``MiniMaxH3Transformer3DModel`` from one ``.safetensors`` (bf16 / fp16 / fp32 or fp8-scaled) or
    ``.gguf`` file (see the module docstring for the layouts).

    Args:
        path: the file.
        config: the transformer config the file was saved with: a pipeline folder (its ``transformer/config.json``), a
            transformer folder, a hub repo id, a dict, or ``None`` for the released MiniMax-H3 config. ``num_layers``
            is replaced by the number of blocks the file holds (pruned DiTs).
        dtype: the dtype of the dense weights and the compute dtype of GGUF / FP8 layers (the model's float32
            modules stay float32, as ``from_pretrained`` keeps them). ``None``: a dense file's own dtype (that of
            most of its block weights), bfloat16 for a GGUF or fp8-scaled file.
        device: where the weights are loaded.
        num_layers: the number of blocks the caller expects (checked against the file).
        qkv_layout: diffusers' converter option: ``"stacked"`` (``[q; k; v]``, every published single file) or
            ``"interleaved"`` (the per-head order of the MiniMaxAI shards merged by hand).
        quantization_config: a diffusers-h3 config (``FP8Config``, ``W8A16Config``, ``NVFP4Config``) to quantize a
            dense file with after loading; a GGUF or fp8-scaled file is already quantized and refuses it.
        fp8_backend: the ``backend`` of the FP8 layers of an fp8-scaled file (``FP8Config``'s choices).

    Raises:
        TransformerFileError: one line naming what is wrong, before any tensor data is read.
    """
    if qkv_layout not in ("stacked", "interleaved"):
        raise ValueError(f"qkv_layout must be 'stacked' or 'interleaved', got {qkv_layout!r}.")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ValueError(f"dtype must be None or a floating torch.dtype, got {dtype!r}.")
    plan = inspect_transformer_file(path, config, num_layers=num_layers, qkv_layout=qkv_layout)
    if dtype is None:
        dtype = _file_dtype(plan.layout)
    if quantization_config is not None and plan.layout.format != FORMAT_DENSE:
        raise _fail(
            plan.layout.path,
            f"the file is already quantized ({plan.layout.format}); quantization_config would quantize it twice",
            "drop quantization_config (--quantize), or load a bf16 file",
        )
    if quantization_config is not None:
        from ..quantizers import QuantizationConfigBase

        if not isinstance(quantization_config, QuantizationConfigBase):
            raise TypeError(
                f"quantization_config must be a diffusers-h3 config (FP8Config, W8A16Config, NVFP4Config), got "
                f"{type(quantization_config).__name__}."
            )
    device = torch.device(device)
    tensors = _read_tensors(plan)
    kinds = Counter(t.kind for t in plan.layout.weights.values())
    notes = []
    if plan.layout.prefix:
        notes.append(f"key prefix {plan.layout.prefix!r} stripped")
    if plan.layout.curve is not None:
        notes.append(
            f"curve-form (pruned) AdaLN: {_CURVE_TABLE} {list(plan.layout.curve)} interpolated per timestep replaces the "
            f"time embedder, rank-{plan.layout.curve[1]} AdaLN projections without SiLU"
        )
    if plan.layout.format == FORMAT_GGUF:
        model = _load_gguf(plan, tensors, dtype, device, qkv_layout)
    elif plan.layout.format == FORMAT_FP8_SCALED:
        model = _load_fp8_scaled(plan, tensors, dtype, device, qkv_layout, fp8_backend)
        if plan.layout.input_scales:
            notes.append(
                f"{len(plan.layout.input_scales)} static input scales of the file unused: FP8Linear quantizes "
                "activations per token at run time"
            )
    else:
        model = _load_dense(plan, tensors, dtype, device, qkv_layout)
    _check_loaded(model, plan.layout.path)
    move_non_persistent_buffers(model, device)  # built at init on the CPU, outside the file
    model.eval()
    if quantization_config is not None:
        from ..quantizers import quantize

        quantize(model, quantization_config)
        notes.append(f"quantized after loading with {type(quantization_config).__name__}")
    record = TransformerFileRecord(
        path=str(plan.layout.path),
        format=plan.layout.format,
        naming=plan.naming,
        tensor_types=dict(sorted(kinds.items())),
        num_layers=plan.config["num_layers"],
        config_num_layers=plan.config_num_layers,
        notes=tuple(notes),
    )
    register_h3_hook(model, _TransformerFileHook(record), H3_SINGLE_FILE_HOOK)
    return model


def describe_transformer_file(model: nn.Module) -> Optional[Dict[str, Any]]:
    """What ``describe()`` reports for a model loaded from one file: the file's record, and how many GGUF layers run
    which GEMM path (read from the layers themselves); ``None`` for a model not loaded by :func:`load_transformer_file`."""
    record = transformer_file_record(model)
    gguf_layers = Counter(
        getattr(module.weight.quant_type, "name", str(module.weight.quant_type))
        for module in model.modules()
        if is_gguf_linear(module)
    )
    if record is None and not gguf_layers:
        return None
    info = record.as_dict() if record is not None else {}
    if gguf_layers:
        from diffusers.quantizers.gguf import utils as gguf_utils

        kinds = ", ".join(f"{kind} x{count}" for kind, count in sorted(gguf_layers.items()))
        compute = sorted({str(m.compute_dtype).replace("torch.", "") for m in model.modules() if is_gguf_linear(m)})
        how = (
            "the kernels package's CUDA dequantize kernel on CUDA inputs, torch dequantization elsewhere"
            if gguf_utils.ops is not None
            else "torch dequantization of the packed blocks"
        )
        info["gguf_layers"] = (
            f"GGUFLinear ({kinds}): diffusers' dequantize path, every call dequantizes the weight ({how}) to the "
            f"compute dtype ({', '.join(compute)}) and runs a matmul in it; no GGUF GEMM kernel"
        )
    return info


def check_saveable(pipe_or_model) -> None:
    """Refuse, in one line, to save DiT partitions that hold GGUF layers (diffusers' GGUF quantizer cannot serialize
    them; the .gguf file is their saved form). Dense and fp8-scaled files save and reload like any model."""
    from .._hooks import partitions_of

    for name, model in partitions_of(pipe_or_model):
        if is_curve_form(model):
            raise ValueError(
                f"{name} is a curve-form (pruned) DiT, which a saved config.json cannot describe (from_pretrained would "
                "build the released time embedder) — keep the single file and pass transformer=load_transformer_file(...) "
                "when loading the saved pipeline"
            )
        layers = sum(1 for module in model.modules() if is_gguf_linear(module))
        if layers:
            record = transformer_file_record(model)
            source = f" (loaded from {record.path})" if record is not None else ""
            raise ValueError(
                f"{name} holds {layers} GGUF layers{source}, which diffusers' GGUF quantizer cannot save — keep the "
                ".gguf file and pass transformer=load_transformer_file(...) again when loading the saved pipeline"
            )


def check_fusable(pipe_or_model) -> None:
    """Refuse, in one line and before any layer changes, to fuse a LoRA into GGUF layers: their packed blocks cannot
    take ``W + B @ A`` without re-quantizing to a GGUF type, which nothing here writes. Unfused, the LoRA runs on top
    of the GGUF GEMMs (PEFT's ``Linear`` around diffusers' ``GGUFLinear``)."""
    from .._hooks import partitions_of

    for name, model in partitions_of(pipe_or_model):
        layers = sum(1 for module_name, module in model.named_modules()
                     if is_gguf_linear(module) and module_name.endswith(".base_layer"))  # fmt: skip
        if layers:
            raise ValueError(
                f"fuse_lora: {layers} of {name}'s LoRA layers wrap GGUF layers, whose packed blocks cannot hold W + BA "
                "— keep the LoRA unfused (it runs on top of the GGUF layers), or load a bf16 / fp8-scaled file to fuse"
            )
