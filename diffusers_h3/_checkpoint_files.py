"""Checks of checkpoint files that read only their headers, with the standard library (the CLI runs them before
importing torch; the pipeline's loader runs them before transformers reads a file)."""

from __future__ import annotations

import json
import os
import re
import struct
import zipfile
from pathlib import Path
from typing import Any, Dict, Optional, Tuple


# A hub repo id: `name` or `namespace/name` (huggingface_hub's characters).
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def looks_like_local_path(value: str) -> bool:
    """Whether `value`, which does not exist, was meant as a local path rather than a hub repo id (`./x`, `/x`, `~/x`,
    a Windows path, a first part that exists as a folder, or anything a repo id cannot spell): such a value is
    refused as a missing file or folder instead of being sent to the hub."""
    first_part_exists = "/" in value and Path(value.split("/")[0]).expanduser().exists()
    return (
        value.startswith(("./", "../", "/", "~", ".\\", "..\\"))
        or value in (".", "..")
        or (os.sep in value and os.sep != "/")
        or first_part_exists
        or not _REPO_ID.match(value)
    )


def torch_checkpoint_problem(path: Path) -> Optional[str]:
    """Why `path` is not a file `torch.load` reads, or `None`; reads its first bytes or its zip directory only."""
    if zipfile.is_zipfile(path):  # torch.save's format: a zip archive with <name>/data.pkl
        with zipfile.ZipFile(path) as archive:
            if not any(name == "data.pkl" or name.endswith("/data.pkl") for name in archive.namelist()):
                return "a zip archive but not a PyTorch checkpoint (no data.pkl in it)"
        return None
    with open(path, "rb") as handle:
        head = handle.read(2)
    if len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5:  # the legacy format: a pickle (PROTO opcode)
        return None
    return (
        f"not a PyTorch checkpoint ({path.stat().st_size} bytes, neither torch.save's zip format, complete, nor "
        "a pickle)"
    )


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


# LightX2V Turbo-SLA adapters: "_sla" as a token of the file name, the Minimax-h3-Turbo-SLA repo, or "sla" in an
# attention field of the file's __metadata__.
_SLA_NAME = re.compile(r"(^|[-_.])sla([-_.]|$)", re.IGNORECASE)
_SLA_METADATA_KEYS = ("sparse_attention", "attention_type", "attn_type", "attention", "sla_sparsity")


def safetensors_metadata(path: Path) -> Dict[str, str]:
    """The ``__metadata__`` of a safetensors file (empty when it has none); reads its header only."""
    with open(path, "rb") as handle:
        (header_size,) = struct.unpack("<Q", handle.read(8))
        return dict(json.loads(handle.read(header_size)).get("__metadata__") or {})


def turbo_sla_reason(file_name: Optional[str], metadata: Dict[str, str]) -> Optional[str]:
    """Why a LoRA file is a LightX2V Turbo-SLA adapter (its name or its ``__metadata__``), or ``None``."""
    base = re.split(r"[/\\]", str(file_name or ""))[-1]
    keys = [k for k in _SLA_METADATA_KEYS if k in metadata and "sla" in str(metadata[k]).lower()]
    if keys:
        return f"its __metadata__ {keys[0]}={metadata[keys[0]]!r}"
    if _SLA_NAME.search(base.rsplit(".", 1)[0]):
        return "its name"
    if "minimax-h3-turbo-sla" in str(file_name or "").lower():
        return "its repository (Minimax-h3-Turbo-SLA)"
    return None


def turbo_sla_message(file_name: Optional[str], reason: str) -> str:
    """The one-line refusal of a Turbo-SLA adapter."""
    base = re.split(r"[/\\]", str(file_name or ""))[-1]
    what = repr(base) if base else "this LoRA"
    return (
        f"{what} is a LightX2V Turbo-SLA adapter ({reason}): it was distilled with sparse-linear attention (SLA, 85 % "
        "of attention blocks skipped), which diffusers-h3 does not implement, so under dense attention it runs off its "
        "training; use a dense Turbo file instead (e.g. minimax_h3_fl2v_turbo_4step_v1.2_768p.safetensors)."
    )
