"""Module surgery shared by ``quantize()`` and the diffusers quantizer: which ``nn.Linear`` layers a config selects,
and putting a new module at a dotted path."""

from __future__ import annotations

from typing import Iterable, List

from torch import nn

from .config import QuantizationConfigBase


def set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    """Replace the submodule at dotted path ``name`` of ``root`` by ``new``."""
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


def linears_to_quantize(
    module: nn.Module, config: QuantizationConfigBase, extra_skip: Iterable[str] = ()
) -> List[str]:
    """Dotted names of the ``nn.Linear`` layers ``config`` would quantize in ``module``."""
    extra_skip = list(extra_skip)
    return [name for name, sub in module.named_modules() if name and config.should_quantize(name, sub, extra_skip)]
