"""The CPU suite runs on the CPU on every host (loaded with ``-p tests._cpu_host`` from ``pyproject.toml``).

A run whose marker expression leaves out the ``gpu`` tests (the default ``-m 'not gpu and not slow'``) hides the
host's GPUs from itself and its xdist workers before anything touches CUDA: on a GPU host its tests then take the paths
they take on CI (the Triton interpreter, the kernels' torch references, CPU meshes for the gloo ranks) instead of
meeting CUDA half-way, with tensors built on the CPU and kernels or meshes chosen for the GPU. The GPU paths have their
own tests, marked ``gpu`` (``python -m pytest -o addopts="" -m gpu``), which keep the GPUs.
"""

import os


def selects_gpu_tests(markexpr: str) -> bool:
    """Whether ``-m markexpr`` keeps a test marked only ``gpu`` (no expression keeps every test)."""
    if not markexpr:
        return True
    from _pytest.mark.expression import Expression

    return bool(Expression.compile(markexpr).evaluate(lambda name, **kwargs: name == "gpu"))


def pytest_load_initial_conftests(early_config, parser, args):
    # Before tests/conftest.py imports torch: CUDA reads CUDA_VISIBLE_DEVICES once, when it starts.
    if not selects_gpu_tests(early_config.known_args_namespace.markexpr):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
