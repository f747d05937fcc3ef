import os

import pytest
import torch


# Run Triton kernels through the interpreter on machines without a GPU (CI). Must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Keep CPU runs deterministic and small.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_components_factory():
    from diffusers_h3.testing.tiny import tiny_components

    return tiny_components


# Small canvas rule shared by both pipelines in parity tests so that video references stay tiny.
SMALL_CANVAS = {"canvas_short_edge": 32, "canvas_max_pixels": 32 * 64, "reference_image_short_edge": 64}
