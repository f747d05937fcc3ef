"""The rank launcher's start methods: forked ranks see the caller's environment of the moment, as spawned ones do."""

import os

import pytest

from diffusers_h3.parallel._launch import launch as product_launch

from ._ranks import launch


def _rank_environment(name):
    import torch.distributed as dist

    return dist.get_rank(), os.environ.get(name), os.environ["WORLD_SIZE"]


def test_forked_ranks_take_the_callers_environment_of_the_launch(monkeypatch):
    name = "DIFFUSERS_H3_TEST_LAUNCH_VALUE"
    monkeypatch.setenv(name, "before")
    launch(_rank_environment, 2, args=(name,), timeout_s=120)  # the forkserver exists from here on
    monkeypatch.setenv(name, "after")
    assert launch(_rank_environment, 2, args=(name,), timeout_s=120) == [(0, "after", "2"), (1, "after", "2")]
    monkeypatch.delenv(name)
    assert launch(_rank_environment, 2, args=(name,), timeout_s=120) == [(0, None, "2"), (1, None, "2")]


def test_unknown_start_method_is_refused_before_starting_anything():
    with pytest.raises(ValueError, match="start_method must be 'spawn' or 'forkserver', got 'fork'"):
        product_launch(_rank_environment, 2, args=("X",), start_method="fork")
