import pytest
import torch

from diffusers_h3.testing.tiny import tiny_transformer


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    """A tiny dense MiniMax-H3 transformer saved with ``save_pretrained``."""
    torch.manual_seed(0)
    model = tiny_transformer()
    path = tmp_path_factory.mktemp("dense")
    model.save_pretrained(path)
    return path
