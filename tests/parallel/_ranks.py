"""How the CPU tests start gloo ranks: forked from one server process per test worker that imported the package once.

A spawned rank imports torch and diffusers again, and a test starts 2 or 4 ranks (the cost is in docs/testing.md); a
rank forked from the server starts from its imports. The product (`--gpus N`) keeps spawning its ranks.
"""

import os

from diffusers_h3.parallel._launch import launch as _launch


# What every rank of these tests imports; the rank functions' own modules are imported on top, per launch.
PRELOAD = ("diffusers_h3", "diffusers_h3.testing.tiny", "tests.parallel._tiny_cp")


def launch(fn, world_size, args=(), **options):
    if os.environ.get("TRITON_INTERPRET") == "1":
        # The server imported triton once, without the interpreter (conftest turns it off outside kernel tests): its
        # kernels would not run on CPU tensors in a forked rank.
        raise RuntimeError("forked ranks run the kernels' torch references: a multi-rank test under the Triton "
                           "interpreter needs spawned ranks (diffusers_h3.parallel._launch.launch)")
    return _launch(fn, world_size, args, start_method="forkserver", preload=PRELOAD, **options)
