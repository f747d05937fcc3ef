"""Entry point of the `diffusers-h3` command, kept outside the `diffusers_h3` package on purpose.

`import diffusers_h3` registers the pipeline and the quantizers with diffusers, which imports diffusers, transformers
and torch (seconds). Parsing the command line needs none of that: the arguments are parsed first with
`diffusers_h3/cli.py` loaded on its own (it imports only the standard library), so `--help`, `--version`, usage
errors and the checks that read only the arguments (`cli.check_arguments`) answer at once; the package proper is
imported only to run a command.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import List, Optional


PACKAGE = "diffusers_h3"


def _parse_without_the_package(argv: List[str]) -> None:
    """Parse `argv` with the CLI's own parser while `diffusers_h3/__init__.py` stays unexecuted (exits on --help,
    --version and usage errors, as argparse does)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return
    shell = types.ModuleType(PACKAGE)
    shell.__path__ = list(spec.submodule_search_locations)
    names = (PACKAGE, f"{PACKAGE}._version", f"{PACKAGE}._checkpoint_files", f"{PACKAGE}._video_encoding", f"{PACKAGE}.cli")
    saved = {name: sys.modules.pop(name) for name in names if name in sys.modules}
    sys.modules[PACKAGE] = shell
    try:
        importlib.import_module(f"{PACKAGE}.cli").parse_arguments(argv)  # and the checks that read only arguments
    finally:
        for name in names:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if PACKAGE not in sys.modules:
        _parse_without_the_package(argv)
    try:
        from diffusers_h3.cli import main as run
    except KeyboardInterrupt:  # Ctrl-C while the package imports: one line, as in the command itself
        print(f"{PACKAGE.replace('_', '-')}: interrupted", file=sys.stderr)
        return 130
    except ImportError as error:  # `_torch_install.BrokenTorchInstallError`: torch and torchvision do not fit
        if type(error).__name__ != "BrokenTorchInstallError":
            raise
        print(f"{PACKAGE.replace('_', '-')}: error: {error}", file=sys.stderr)
        return 2

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
