"""Every private diffusers name the package uses is listed in docs/diffusers_compat.md, and the list holds no stale
entry: the list is what to check first when a new diffusers release breaks the plugin.

The scan (ast) finds: imports of private names or from private modules of diffusers (`from diffusers.x import _y`,
`from diffusers.x._y import z`), attribute chains through a diffusers import (`diffusers.x._y`,
`DiffusionPipeline._z`), in classes derived from a diffusers class, private members they define or read through
`self` / `cls` that the diffusers base already has (overridden hooks such as `_process_model_before_weight_loading`),
and names reached through objects (`transformer._cp_plan`, `getattr(processor, "_attention_backend")`): a private
attribute that diffusers' source defines (a `def`, `class`, assignment or `setattr` in the installed diffusers) and
that the package reads or writes through anything but its own `self` / `cls`, or never defines itself. Those are
listed by their bare name (`_cp_plan`); the diffusers code that defines them is named in the table.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple


ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "diffusers_compat.md"
SECTION = "## Private diffusers names the package uses"


def _is_private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _attribute_chain(node: ast.AST) -> Tuple[Optional[str], List[str]]:
    """`a.b.c` -> (`"a"`, `["b", "c"]`); `(None, [])` when the chain does not start at a plain name."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return (node.id, attrs[::-1]) if isinstance(node, ast.Name) else (None, [])


def _import_object(dotted: str):
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        obj = getattr(obj, part) if hasattr(obj, part) else importlib.import_module(".".join(parts[: i + 1]))
    return obj


def _diffusers_aliases(tree: ast.AST) -> Tuple[Dict[str, str], Set[str]]:
    """Local names bound to diffusers modules or objects (name -> dotted path), and the private names imported."""
    aliases, found = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "diffusers":
                    aliases[alias.asname or "diffusers"] = alias.name if alias.asname else "diffusers"
                    if any(map(_is_private, alias.name.split("."))):
                        found.add(alias.name)
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "diffusers":
            for alias in node.names:
                dotted = f"{node.module}.{alias.name}"
                aliases[alias.asname or alias.name] = dotted
                if any(map(_is_private, dotted.split("."))):
                    found.add(dotted)
    return aliases, found


def _private_names_in(tree: ast.AST) -> Set[str]:
    aliases, found = _diffusers_aliases(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            root, attrs = _attribute_chain(node)
            private = [i for i, attr in enumerate(attrs) if _is_private(attr)]
            if root in aliases and private:
                found.add(".".join([aliases[root]] + attrs[: private[0] + 1]))
        elif isinstance(node, ast.ClassDef):
            bases = []
            for base in node.bases:
                root, attrs = _attribute_chain(base)
                if root in aliases:
                    dotted = ".".join([aliases[root]] + attrs)
                    bases.append((dotted, _import_object(dotted)))
            members = set()
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    members.add(item.name)
                elif isinstance(item, ast.Assign):
                    members.update(t.id for t in item.targets if isinstance(t, ast.Name))
            for sub in ast.walk(node):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id in ("self", "cls"):
                    members.add(sub.attr)
            for member in filter(_is_private, members):
                owner = next((dotted for dotted, obj in bases if hasattr(obj, member)), None)
                if owner is not None:
                    found.add(f"{owner}.{member}")
    return found


# A private name a file defines: `def _x` / `class _X`, `_x = ...` (module or class level), `obj._x = ...`, and
# `setattr(obj, "_x", ...)`. Read with a regular expression: parsing all of diffusers would take the test seconds.
_DEFINITION = re.compile(
    r"^\s*(?:async\s+def|def|class)\s+(_\w+)|^\s*(_\w+)\s*(?::[^=\n]+)?=(?!=)|\.(_\w+)\s*(?::[^=\n(]+)?=(?!=)"
    r"|setattr\([^,]+,\s*[\"'](_\w+)[\"']",
    re.MULTILINE,
)


def _defined_private_names(folder: Path) -> Dict[str, Set[str]]:
    """Private name -> the files under `folder` that define it."""
    names: Dict[str, Set[str]] = {}
    for path in folder.rglob("*.py"):
        for match in _DEFINITION.finditer(path.read_text()):
            name = next(group for group in match.groups() if group)
            if _is_private(name):
                names.setdefault(name, set()).add(str(path.relative_to(folder)))
    return names


def _diffusers_definitions() -> Dict[str, Set[str]]:
    import diffusers

    return _defined_private_names(Path(diffusers.__file__).parent)


def _reached_through_objects(tree: ast.AST, in_diffusers, ours) -> Set[str]:
    """Private attributes of diffusers objects `tree` reaches through a variable, a call or `getattr(obj, "_x")`:
    names diffusers defines, used through anything but `self` / `cls` or never defined by the package. Chains that
    start at a diffusers import are the static scan's."""
    aliases, _ = _diffusers_aliases(tree)
    found = set()
    for node in ast.walk(tree):
        name, through_self = None, False
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            if _attribute_chain(node)[0] in aliases:
                continue
            name = node.attr
            through_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _is_private(node.args[1].value)
        ):
            name = node.args[1].value
        if name in in_diffusers and (not through_self or name not in ours):
            found.add(name)
    return found


def private_diffusers_names(package: Path = ROOT / "diffusers_h3") -> Dict[str, Set[str]]:
    """Private diffusers name -> the package files that use it."""
    in_diffusers, ours = _diffusers_definitions(), _defined_private_names(package)
    uses: Dict[str, Set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        named = _private_names_in(tree)
        owned = {name.rsplit(".", 1)[-1] for name in named}  # a file's use named with its owner is listed so only
        for name in named | (_reached_through_objects(tree, in_diffusers, ours) - owned):
            uses.setdefault(name, set()).add(str(path.relative_to(package)))
    return uses


def documented_names() -> Set[str]:
    text = DOC.read_text()
    assert SECTION in text, f"{DOC} lost its section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([^`]+)`", section, flags=re.MULTILINE))


def test_every_private_diffusers_name_in_use_is_documented():
    used, documented = private_diffusers_names(), documented_names()
    undocumented = {name: sorted(files) for name, files in used.items() if name not in documented}
    assert not undocumented, f"add these private diffusers names (and why) to {DOC.name}: {undocumented}"
    stale = sorted(documented - set(used))
    assert not stale, f"{DOC.name} lists private diffusers names the package no longer uses: {stale}"


def test_scan_finds_each_kind_of_use():
    source = """
import diffusers
import diffusers.hooks.first_block_cache as fbc
from diffusers import DiffusionPipeline, ModelMixin
from diffusers.utils import _get_model_file
from diffusers.hooks._helpers import TransformerBlockRegistry

hook = fbc._FBC_BLOCK_HOOK
read = DiffusionPipeline._dict_from_json_file.__func__
public = diffusers.utils.logging.get_logger


class Model(ModelMixin):
    _keep_in_fp32_modules = ["norm"]
    _our_own_name = 1

    def forward(self):
        return self._supports_gradient_checkpointing, self._our_state
"""
    tree = ast.parse(source)
    assert _reached_through_objects(tree, {"_cp_plan", "_blend", "_our_state"}, {"_our_state"}) == set()
    assert _private_names_in(tree) == {
        "diffusers.utils._get_model_file",
        "diffusers.hooks._helpers.TransformerBlockRegistry",
        "diffusers.hooks.first_block_cache._FBC_BLOCK_HOOK",
        "diffusers.DiffusionPipeline._dict_from_json_file",
        "diffusers.ModelMixin._keep_in_fp32_modules",
        "diffusers.ModelMixin._supports_gradient_checkpointing",
    }


def test_scan_finds_names_reached_through_objects():
    source = """
import torch


def plan(transformer, vae, processor):
    blend = vae._blend
    backend = getattr(processor, "_attention_backend", None)
    return transformer._cp_plan, torch._C


class Ours:
    def run(self, other):
        return self._decode(), other._decode(), self._inherited, self._mine
"""
    in_diffusers = {"_cp_plan", "_blend", "_attention_backend", "_decode", "_inherited", "_mine"}
    ours = {"_decode", "_mine"}  # names the package defines too
    # `self._mine` is the package's own; `other._decode` may be diffusers'; `self._inherited` can only be diffusers'
    # (the package never defines it); `torch._C` is no diffusers name.
    assert _reached_through_objects(ast.parse(source), in_diffusers, ours) == {
        "_cp_plan", "_blend", "_attention_backend", "_decode", "_inherited"
    }  # fmt: skip
    definitions = _DEFINITION.findall("def _a(x):\n    _b: int = 1\n    obj._c = 2\n    setattr(obj, '_d', 3)\n    x == _e\n")
    assert {next(g for g in groups if g) for groups in definitions} == {"_a", "_b", "_c", "_d"}


OTHER_SECTION = "## Private transformers and Accelerate names the package uses"


def _other_private_names() -> Dict[str, Set[str]]:
    """Private names of transformers and Accelerate the package uses, with the files: Accelerate's attributes on a
    module (`module._hf_hook`, set by `accelerate.hooks`), transformers' quantizer hooks (`HfQuantizer` members the
    package overrides or calls, in files that import transformers' quantizers) and `PreTrainedModel` attributes that
    diffusers' `ModelMixin` does not have (those are in the diffusers list), in files that import transformers."""
    import accelerate.hooks
    from diffusers import ModelMixin
    from transformers import PreTrainedModel
    from transformers.quantizers.base import HfQuantizer

    accelerate_source = Path(accelerate.hooks.__file__).read_text()
    found: Dict[str, Set[str]] = {}
    for path in sorted((ROOT / "diffusers_h3").rglob("*.py")):
        source = path.read_text()
        imports_transformers = re.search(r"^\s*(from|import) transformers\b", source, re.M) is not None
        for node in ast.walk(ast.parse(source)):
            names = []
            if isinstance(node, ast.Attribute):
                names.append(node.attr)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.append(node.name)
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr"):
                names += [a.value for a in node.args[1:2] if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            for name in filter(_is_private, names):
                if (
                    re.search(rf"\.{name}\s*=", accelerate_source)
                    or (imports_transformers and "transformers.quantizers" in source and hasattr(HfQuantizer, name))
                    or (imports_transformers and hasattr(PreTrainedModel, name) and not hasattr(ModelMixin, name))
                ):
                    found.setdefault(name, set()).add(path.relative_to(ROOT / "diffusers_h3").as_posix())
    return found


def test_every_private_transformers_or_accelerate_name_in_use_is_documented():
    section = DOC.read_text().split(OTHER_SECTION, 1)
    assert len(section) == 2, f"{DOC} lost its section {OTHER_SECTION!r}"
    rows = dict(re.findall(r"^\| `([^`]+)` \| ([^|]+) \|", section[1].split("\n## ", 1)[0], re.M))
    used = _other_private_names()
    assert {"_hf_hook", "_dequantize", "_keep_in_fp32_modules_strict"} <= set(used), used  # the scan finds them
    assert set(rows) == set(used), f"undocumented: {set(used) - set(rows)}; stale: {set(rows) - set(used)}"
    for name, files in used.items():
        assert set(re.findall(r"`([^`]+\.py)`", rows[name])) == files, (name, rows[name], files)
