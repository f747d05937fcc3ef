"""Run a benchmark script's command line in processes forked from the tests' forkserver (see tests/parallel/_ranks.py).

A subprocess per run imports torch and diffusers again (2 or 3 processes under torchrun; what this costs is in
docs/testing.md); a forked process starts from the server's imports. The script runs as `__main__` with its arguments, in its own process, as
`python SCRIPT ...` or `torchrun --nproc-per-node N SCRIPT ...` would run it (ranks: RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR / MASTER_PORT set; the gloo process group already made); stdout, stderr and the exit status come back.
"""

import contextlib
import io
import os
import runpy
import subprocess
import sys
from pathlib import Path

from tests.parallel._ranks import launch


ROOT = Path(__file__).resolve().parents[1]


def _rank_run_script(script, argv, cwd):
    os.chdir(cwd)
    sys.path[:0] = [str(Path(script).parent), str(ROOT)]  # as `python SCRIPT` and PYTHONPATH=ROOT would have it
    sys.argv = [str(script), *argv]
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(str(script), run_name="__main__")
        except SystemExit as exit_:
            if isinstance(exit_.code, str):  # what the interpreter prints for SystemExit("message")
                print(exit_.code, file=sys.stderr)
            code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    return code, out.getvalue(), err.getvalue()


def run_script(script, *args, ranks=1, cwd=ROOT, timeout=300):
    """`subprocess.CompletedProcess` of `script args` on `ranks` processes (rank 0's output; a failing rank's exit
    status wins), in this process's environment."""
    results = launch(_rank_run_script, ranks, args=(str(script), [str(a) for a in args], str(cwd)), timeout_s=timeout)
    code = next((c for c, _, _ in results if c), 0)
    return subprocess.CompletedProcess([str(script), *map(str, args)], code, results[0][1], results[0][2])
