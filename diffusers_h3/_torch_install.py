"""A torch / torchvision pair that does not belong together, named in one line before anything else imports it.

pip falls back to PyPI's default build when the CPU index is unreachable, which pairs a CPU torch with a CUDA
torchvision (or the other way round). torchvision's compiled operators then fail to register and its import raises
`operator torchvision::nms does not exist`; transformers imports it lazily and reports only "Could not import module
'PreTrainedModel'", 30 lines further down. `check_torchvision` imports torchvision first and names the real cause.
"""

from __future__ import annotations

import importlib.util
from importlib import metadata


CPU_FIX = "pip install torch torchvision --index-url https://download.pytorch.org/whl/cpu"


class BrokenTorchInstallError(ImportError):
    """torch and torchvision are builds that do not fit together (one line: what, and the install command)."""


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "?"


def check_torchvision() -> None:
    """Import torchvision (when installed); raise `BrokenTorchInstallError` when its compiled operators do not load."""
    if importlib.util.find_spec("torchvision") is None:
        return
    try:
        import torchvision  # noqa: F401
    except RuntimeError as error:
        if "torchvision::" not in str(error) and "does not exist" not in str(error):
            raise
        cause = str(error).strip().splitlines()[0]
        raise BrokenTorchInstallError(
            f"torchvision {_version('torchvision')} does not fit torch {_version('torch')} ({cause}: typically a CPU "
            f"build of torch with a CUDA build of torchvision) — reinstall both from one index: {CPU_FIX} (or the "
            "CUDA index that matches your GPU driver)"
        ) from None


check_torchvision()  # on import: `diffusers_h3/__init__.py` imports this module before diffusers
