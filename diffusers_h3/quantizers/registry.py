"""The one table of quantization formats.

A format is registered once, with :func:`register_format`; everything else reads it from here: ``quantize()`` (which
weight class an ``nn.Linear`` gets), the diffusers quantizer (``from_pretrained(..., quantization_config=...)`` and
pre-quantized checkpoints, through diffusers' ``AUTO_QUANTIZER_MAPPING`` / ``AUTO_QUANTIZATION_CONFIG_MAPPING``), the
transformers quantizer (the same for the text encoder, through transformers' ``register_quantizer`` /
``register_quantization_config``) and the CLI's ``--quantize`` choices. Adding a format is a config, a weight tensor class, a kernel and one ``register_format(...)``
line at the bottom of this file (see docs/quantization.md, "Adding a format").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Type

from diffusers.quantizers import auto as _diffusers_auto
from transformers.quantizers import auto as _transformers_auto

from .config import FP8Config, NVFP4Config, QuantizationConfigBase, QuantMethod, W8A16Config
from .diffusers_quantizer import QuantizerBase
from .tensors import FP8Tensor, NVFP4Tensor, QuantizedTensor, W8A16Tensor
from .transformers_quantizer import TransformersQuantizerBase


@dataclass(frozen=True)
class QuantFormat:
    """One quantization format.

    - ``name``: the short name of the CLI (``--quantize w8a16``);
    - ``method``: the ``quant_method`` written to ``config.json`` (prefixed so it clashes with no diffusers /
      transformers method);
    - ``config_cls`` / ``weight_cls``: its :class:`QuantizationConfigBase` and :class:`QuantizedTensor` subclasses (the
      weight a quantized ``nn.Linear`` holds);
    - ``quantizer_cls``: its diffusers :class:`QuantizerBase` subclass (made by :func:`register_format` when not
      given);
    - ``transformers_quantizer_cls``: its transformers :class:`TransformersQuantizerBase` subclass (likewise).
    """

    name: str
    method: str
    config_cls: Type[QuantizationConfigBase]
    weight_cls: Type[QuantizedTensor]
    quantizer_cls: Optional[Type[QuantizerBase]] = None
    transformers_quantizer_cls: Optional[Type[TransformersQuantizerBase]] = None


_FORMATS: Dict[str, QuantFormat] = {}  # by name, in registration order
_installed_in_diffusers = False


def _check_new_format(name, method, config_cls, weight_cls, quantizer_cls) -> None:
    if not isinstance(name, str) or not name.isidentifier() or name != name.lower():
        raise ValueError(f"register_format: name must be a lowercase identifier such as 'w8a16', got {name!r}.")
    if name in _FORMATS:
        raise ValueError(f"register_format: a format named {name!r} is already registered; unregister_format it first.")
    if not isinstance(method, str) or not method:
        raise ValueError(f"register_format: method must be a non-empty string such as 'h3_w8a16', got {method!r}.")
    taken = {fmt.method: fmt.name for fmt in _FORMATS.values()}
    if method in taken:
        raise ValueError(f"register_format: method {method!r} already belongs to format {taken[method]!r}.")
    for library, auto in (("diffusers", _diffusers_auto), ("transformers", _transformers_auto)):
        if method in auto.AUTO_QUANTIZER_MAPPING or method in auto.AUTO_QUANTIZATION_CONFIG_MAPPING:
            raise ValueError(
                f"register_format: method {method!r} is one of {library}' own quantization methods; pick a prefixed "
                "name (e.g. 'h3_...')."
            )
    if not (isinstance(config_cls, type) and issubclass(config_cls, QuantizationConfigBase)):
        raise TypeError(f"register_format: config_cls must subclass QuantizationConfigBase, got {config_cls!r}.")
    if not (isinstance(weight_cls, type) and issubclass(weight_cls, QuantizedTensor)):
        raise TypeError(f"register_format: weight_cls must subclass QuantizedTensor, got {weight_cls!r}.")
    if quantizer_cls is not None and not (isinstance(quantizer_cls, type) and issubclass(quantizer_cls, QuantizerBase)):
        raise TypeError(f"register_format: quantizer_cls must subclass QuantizerBase, got {quantizer_cls!r}.")
    for cls in (config_cls, weight_cls, quantizer_cls):
        bound = [fmt.name for fmt in _FORMATS.values() if cls in (fmt.config_cls, fmt.weight_cls, fmt.quantizer_cls)]
        if cls is not None and bound:
            raise ValueError(f"register_format: {cls.__name__} already serves format {bound[0]!r}.")


def register_format(
    name: str,
    method: str,
    config_cls: Type[QuantizationConfigBase],
    weight_cls: Type[QuantizedTensor],
    quantizer_cls: Optional[Type[QuantizerBase]] = None,
) -> QuantFormat:
    """Register a quantization format (see :class:`QuantFormat`) and return its record.

    Sets ``config_cls.quant_method`` and ``weight_cls.quant_method`` to ``method``, makes the diffusers quantizer
    ``<Config name without "Config">Quantizer`` and the transformers quantizer ``<...>HfQuantizer``, and adds the
    method to diffusers' and transformers' auto maps if :func:`register_quantizers` already ran (it runs when
    ``diffusers_h3`` is imported).
    """
    _check_new_format(name, method, config_cls, weight_cls, quantizer_cls)
    stem = config_cls.__name__[: -len("Config")] if config_cls.__name__.endswith("Config") else config_cls.__name__
    if quantizer_cls is None:
        quantizer_cls = type(
            f"{stem}Quantizer",
            (QuantizerBase,),
            {"__module__": __name__, "__doc__": f"Diffusers quantizer of the {name!r} format ({method})."},
        )
    transformers_quantizer_cls = type(
        f"{stem}HfQuantizer",
        (TransformersQuantizerBase,),
        {"__module__": __name__, "__doc__": f"Transformers quantizer of the {name!r} format ({method})."},
    )
    for cls in (quantizer_cls, transformers_quantizer_cls):
        cls.config_class = config_cls
        cls.weight_class = weight_cls
    config_cls.quant_method = QuantMethod(method)
    weight_cls.quant_method = method
    fmt = QuantFormat(name, method, config_cls, weight_cls, quantizer_cls, transformers_quantizer_cls)
    _FORMATS[name] = fmt
    if _installed_in_diffusers:
        _install(fmt)
    return fmt


def unregister_format(name: str) -> QuantFormat:
    """Remove a format registered with :func:`register_format` (from this table and from the auto maps of diffusers
    and transformers)."""
    fmt = get_format(name)
    del _FORMATS[name]
    for mapping, cls in (
        (_diffusers_auto.AUTO_QUANTIZER_MAPPING, fmt.quantizer_cls),
        (_diffusers_auto.AUTO_QUANTIZATION_CONFIG_MAPPING, fmt.config_cls),
        (_transformers_auto.AUTO_QUANTIZER_MAPPING, fmt.transformers_quantizer_cls),
        (_transformers_auto.AUTO_QUANTIZATION_CONFIG_MAPPING, fmt.config_cls),
    ):
        if mapping.get(fmt.method) is cls:
            del mapping[fmt.method]  # transformers has no unregister function
    fmt.config_cls.quant_method = None
    fmt.weight_cls.quant_method = ""
    return fmt


def _install(fmt: QuantFormat) -> None:
    _diffusers_auto.AUTO_QUANTIZER_MAPPING[fmt.method] = fmt.quantizer_cls
    _diffusers_auto.AUTO_QUANTIZATION_CONFIG_MAPPING[fmt.method] = fmt.config_cls
    if _transformers_auto.AUTO_QUANTIZATION_CONFIG_MAPPING.get(fmt.method) is not fmt.config_cls:
        _transformers_auto.register_quantization_config(fmt.method)(fmt.config_cls)
    if _transformers_auto.AUTO_QUANTIZER_MAPPING.get(fmt.method) is not fmt.transformers_quantizer_cls:
        _transformers_auto.register_quantizer(fmt.method)(fmt.transformers_quantizer_cls)


def register_quantizers() -> None:
    """Add every registered format to diffusers' ``AUTO_QUANTIZER_MAPPING`` / ``AUTO_QUANTIZATION_CONFIG_MAPPING``
    (diffusers has no registration API; this is the mechanism its own plugins use) and to transformers' (through its
    ``register_quantization_config`` / ``register_quantizer``), and every format registered later as it is
    registered. Idempotent."""
    global _installed_in_diffusers
    for fmt in _FORMATS.values():
        _install(fmt)
    _installed_in_diffusers = True


def formats() -> Tuple[QuantFormat, ...]:
    """Every registered format, in registration order."""
    return tuple(_FORMATS.values())


def format_names() -> Tuple[str, ...]:
    """The CLI names of the registered formats, in registration order."""
    return tuple(_FORMATS)


def get_format(name: str) -> QuantFormat:
    """The format registered under the CLI name ``name``."""
    if name not in _FORMATS:
        raise KeyError(f"Unknown quantization format {name!r}; registered formats: {list(_FORMATS)}.")
    return _FORMATS[name]


def format_for_config(config: QuantizationConfigBase) -> QuantFormat:
    """The format whose config class ``config`` is an instance of (the nearest registered class of its MRO)."""
    by_config = {fmt.config_cls: fmt for fmt in _FORMATS.values()}
    for cls in type(config).__mro__:
        if cls in by_config:
            return by_config[cls]
    raise TypeError(
        f"{type(config).__name__} is not the config of a registered quantization format "
        f"(registered: {[fmt.config_cls.__name__ for fmt in _FORMATS.values()]}); call register_format(...) first."
    )


def weight_class_for(config: QuantizationConfigBase) -> Type[QuantizedTensor]:
    return format_for_config(config).weight_cls


def quantizer_for(config: QuantizationConfigBase, pre_quantized: bool = True) -> QuantizerBase:
    return format_for_config(config).quantizer_cls(config, pre_quantized=pre_quantized)


def transformers_quantizer_for(config: QuantizationConfigBase, pre_quantized: bool = True) -> TransformersQuantizerBase:
    return format_for_config(config).transformers_quantizer_cls(config, pre_quantized=pre_quantized)


# -- built-in formats: one line each --------------------------------------------------------------------------------
register_format(name="fp8", method="h3_fp8", config_cls=FP8Config, weight_cls=FP8Tensor)
register_format(name="w8a16", method="h3_w8a16", config_cls=W8A16Config, weight_cls=W8A16Tensor)
register_format(name="nvfp4", method="h3_nvfp4", config_cls=NVFP4Config, weight_cls=NVFP4Tensor)
