"""Checks of checkpoint files that read only their headers, with the standard library (the CLI runs them before
importing torch; the pipeline's loader runs them before transformers reads a file)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Dict, Optional, Tuple


def read_safetensors_header(path: Path) -> Tuple[int, Dict[str, Any]]:
    """``(offset of the data section, header)`` of a safetensors file: the header maps each tensor name to its
    ``dtype``, ``shape`` and ``data_offsets`` (relative to the data section); ``__metadata__`` is dropped."""
    with open(path, "rb") as handle:
        (header_size,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(header_size))
    header.pop("__metadata__", None)
    return 8 + header_size, header


def safetensors_problem(path: Path) -> Optional[str]:
    """Why `path` is not a complete safetensors file, or `None`; reads its header only."""
    size = path.stat().st_size
    if size < 8:
        return f"not a safetensors file ({size} bytes, shorter than a safetensors header)"
    with open(path, "rb") as handle:
        (header_size,) = struct.unpack("<Q", handle.read(8))
        if header_size > size - 8:
            return (
                f"not a safetensors file (its first 8 bytes announce a {header_size}-byte header, the file has "
                f"{size} bytes)"
            )
        try:
            header = json.loads(handle.read(header_size))
            end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, IndexError) as error:
            return f"not a safetensors file (unreadable header: {error})"
    if 8 + header_size + end > size:
        return f"truncated: {size} bytes, but its header describes {8 + header_size + end} bytes"
    return None


def gguf_problem(path: Path) -> Optional[str]:
    """Why `path` is not a GGUF file (its magic and version), or `None`; reads its first 8 bytes only."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(8)
    if len(head) < 8 or head[:4] != b"GGUF":
        return f"not a GGUF file ({size} bytes, no 'GGUF' magic at its start)"
    (version,) = struct.unpack("<I", head[4:8])
    if version not in (2, 3):
        return f"a GGUF file of version {version}, not 2 or 3 (the versions the gguf package reads)"
    return None
