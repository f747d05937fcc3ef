"""Installing attention processors: one registry, one ``enable`` / ``disable`` / ``state``, and the block helpers.

A processor of this package is a :class:`~.base.MiniMaxH3AttnProcessorBase` subclass with a frozen config dataclass,
registered once with :func:`register_attention_processor` (modelled on diffusers' ``_AttentionBackendRegistry.register``,
which maps a backend name to its function and constraints). The registration is all the installation needs:

* :func:`enable_attention_processor` ``(target, config)`` finds the processor of ``config``'s class, checks every
  transformer of the target (``prepare``) before any block changes, installs one processor per transformer block (the
  token refiner keeps its own) and registers the call-plan hook that plans every transformer call for them;
* :func:`attention_processor_state` ``(transformer, config class)`` reads what is installed back from the processors;
* :func:`disable_attention_processor` puts diffusers' default processor back and removes the hook;
* :func:`processor_entry_points` gives the named ``enable_x`` / ``disable_x`` / ``x_state`` functions of the public API.

So a new processor is its own file (config, processor, registration) plus its import in ``attention_processors``'s
``__init__``: ``tests/attention_processors/test_install.py`` registers one in the test file and runs it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor

from .._hooks import partitions_of
from .._utils import config_from_call
from .call_plan import install_call_plan_hook, remove_call_plan_hook


# -- block helpers ----------------------------------------------------------------------------------------------------


def transformer_blocks(transformer, who: str) -> Sequence[torch.nn.Module]:
    """``transformer.transformer_blocks``, or the ``TypeError`` naming ``who`` for anything that has none."""
    blocks = getattr(transformer, "transformer_blocks", None)
    if blocks is None:
        raise TypeError(f"{who} expects a MiniMaxH3Transformer3DModel (with .transformer_blocks) or a MiniMaxH3Pipeline, "
                        f"got {type(transformer).__name__}")
    return blocks


def transformer_models(pipe_or_transformer, who: str) -> List[Tuple[str, torch.nn.Module]]:
    """``[(name, transformer)]`` of a pipeline (its loaded transformer partitions) or of one transformer."""
    models = partitions_of(pipe_or_transformer)
    if isinstance(pipe_or_transformer, torch.nn.Module) or not (models or hasattr(pipe_or_transformer, "components")):
        transformer_blocks(pipe_or_transformer, who)  # the error for something that is neither
    return models


def block_processors(transformer, cls: type, who: str) -> List[Any]:
    """The attention processors of ``transformer``'s blocks that are exactly ``cls`` (not a subclass), in block order."""
    processors = (getattr(block.attn, "processor", None) for block in transformer_blocks(transformer, who))
    return [p for p in processors if type(p) is cls]


def restore_default_processors(pipe_or_transformer, who: str):
    """Diffusers' default ``MiniMaxH3AttnProcessor`` on every transformer block (of a pipeline's partitions or of one
    transformer) and no call-plan hook; returns the argument (``who``: the ``disable_*`` named in errors)."""
    for _, model in transformer_models(pipe_or_transformer, who):
        for block in transformer_blocks(model, who):
            block.attn.set_processor(MiniMaxH3AttnProcessor())
        remove_call_plan_hook(model)
    return pipe_or_transformer


# -- the registry -----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ProcessorEntry:
    """One registered processor: its ``name`` (``enable_<name>``), class, config class, and the names of the config
    fields its ``enable_*`` still takes by position for one release (``legacy_positional``)."""

    name: str
    processor_cls: type
    config_cls: type
    legacy_positional: Tuple[str, ...] = ()


class AttentionProcessorRegistry:
    """The processors :func:`enable_attention_processor` can install, by config class (one processor per config)."""

    _entries: Dict[type, ProcessorEntry] = {}

    @classmethod
    def register(cls, name: str, config: type, legacy_positional: Sequence[str] = ()) -> Callable[[type], type]:
        """Class decorator: register the processor class for ``config`` (a frozen dataclass) under ``name``."""

        def decorator(processor_cls: type) -> type:
            known = cls._entries.get(config)
            if known is not None and known.processor_cls is not processor_cls:
                raise ValueError(f"{config.__name__} is already the config of {known.processor_cls.__name__}")
            cls._entries[config] = ProcessorEntry(name, processor_cls, config, tuple(legacy_positional))
            processor_cls.config_class = config
            return processor_cls

        return decorator

    @classmethod
    def entry(cls, config_or_class: Any) -> ProcessorEntry:
        config_cls = config_or_class if isinstance(config_or_class, type) else type(config_or_class)
        entry = cls._entries.get(config_cls)
        if entry is None:
            known = sorted(c.__name__ for c in cls._entries)
            raise TypeError(f"{config_cls.__name__} is not the config of a registered attention processor; known: "
                            f"{known} (register one with register_attention_processor)")  # fmt: skip
        return entry

    @classmethod
    def entries(cls) -> List[ProcessorEntry]:
        return list(cls._entries.values())


register_attention_processor = AttentionProcessorRegistry.register


def enable_attention_processor(pipe_or_transformer, config, *, who: Optional[str] = None):
    """Install the registered processor of ``config`` on every transformer block of a pipeline's transformer
    partition(s) or of one transformer, with the call-plan hook; every transformer is checked (the processor's
    ``prepare``) before any block changes. Returns the argument."""
    entry = AttentionProcessorRegistry.entry(config)
    who = who or f"enable_{entry.name}"
    checked = []
    for _, model in transformer_models(pipe_or_transformer, who):
        blocks = transformer_blocks(model, who)
        checked.append((model, blocks, entry.processor_cls.prepare(config, model, blocks)))
    for model, blocks, prepared in checked:
        for index, block in enumerate(blocks):
            block.attn.set_processor(entry.processor_cls.for_block(config, prepared, index, block))
        install_call_plan_hook(model)
    return pipe_or_transformer


def attention_processor_state(transformer, config_cls: type, *, who: Optional[str] = None) -> Optional[Dict[str, Any]]:
    """What :func:`enable_attention_processor` installed for ``config_cls`` on ``transformer``, read from its blocks'
    processors of exactly that class (``None`` when no block has one)."""
    entry = AttentionProcessorRegistry.entry(config_cls)
    blocks = transformer_blocks(transformer, who or f"{entry.name}_state")
    found = [(block, block.attn.processor) for block in blocks
             if type(getattr(block.attn, "processor", None)) is entry.processor_cls]  # fmt: skip
    return entry.processor_cls.state(found) if found else None


def disable_attention_processor(pipe_or_transformer, *, who: str = "disable_attention_processor"):
    """Diffusers' default processor back on every transformer block, the call-plan hook removed. Returns the
    argument."""
    return restore_default_processors(pipe_or_transformer, who)


def processor_entry_points(processor_cls: type) -> Tuple[Callable, Callable, Callable]:
    """``(enable_<name>, disable_<name>, <name>_state)`` of a registered processor: the named functions of the public
    API, each one call of the generic functions above. ``enable_<name>(target, config=None)`` takes the config
    object (default: the config's defaults); the fields named by ``legacy_positional`` and every field as a keyword
    still work for one release with a ``FutureWarning`` (``_utils.config_from_call``)."""
    entry = AttentionProcessorRegistry.entry(processor_cls.config_class)
    config_cls, name = entry.config_cls, entry.name

    def enable(pipe_or_transformer, config=None, *args, **legacy):
        config = config_from_call(config_cls, config, legacy, call=f"enable_{name}",
                                  legacy_positional=entry.legacy_positional, legacy_args=args)  # fmt: skip
        return enable_attention_processor(pipe_or_transformer, config, who=f"enable_{name}")

    def disable(pipe_or_transformer):
        return disable_attention_processor(pipe_or_transformer, who=f"disable_{name}")

    def state(transformer):
        return attention_processor_state(transformer, config_cls, who=f"{name}_state")

    cls_name, config_name = processor_cls.__name__, config_cls.__name__
    enable.__name__, disable.__name__, state.__name__ = f"enable_{name}", f"disable_{name}", f"{name}_state"
    enable.__doc__ = (
        f"Install one :class:`{cls_name}` per transformer block of a pipeline's transformer partition(s) or of one "
        f"transformer (the token refiner keeps its processor), with the options of ``config`` (a :class:`{config_name}`; "
        f"default: its defaults), and the call-plan hook. Every transformer is checked before any block changes. "
        f"Returns the argument; what was installed is read with :func:`{name}_state`, undone with :func:`disable_{name}`."
    )
    disable.__doc__ = ("Put diffusers' default ``MiniMaxH3AttnProcessor`` back on every transformer block (of a "
                       "pipeline's partitions or of one transformer). Returns the argument.")  # fmt: skip
    state.__doc__ = (f"What :func:`enable_{name}` installed on ``transformer``, read from its blocks' :class:`{cls_name}` "
                     f"instances (``None`` when no block has one); see :meth:`{cls_name}.state`.")  # fmt: skip
    for function in (enable, disable, state):
        function.__module__ = processor_cls.__module__
        function.__qualname__ = function.__name__
    return enable, disable, state
