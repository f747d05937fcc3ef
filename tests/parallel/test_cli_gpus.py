"""`diffusers-h3 generate --gpus 2` starts two gloo ranks on the CPU and writes the same clip as one process."""

import av
import numpy as np
import pytest

from diffusers_h3.cli import main


def _frames(path):
    with av.open(str(path)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


@pytest.mark.slow
def test_generate_with_two_ranks_writes_the_one_process_clip(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    argv = ["generate", "--prompt", "a cat", "--steps", "3", "--seed", "1", "--device", "cpu"]
    assert main([*argv, "--out", str(tmp_path / "one.mp4")]) == 0
    # Rank 0 streams the text encoder (group offload), rank 1 never holds it: the clip must not change.
    assert main([*argv, "--gpus", "2", "--text-encoder-offload", "--out", str(tmp_path / "two.mp4")]) == 0
    one, two = _frames(tmp_path / "one.mp4"), _frames(tmp_path / "two.mp4")
    assert one.shape == two.shape and one.shape[0] == 124
    # Same latents up to float rounding of the sharded attention; H.264 can turn a one-level input difference into
    # a different block decision, so bound the typical difference, not the worst pixel.
    diff = np.abs(one.astype(int) - two.astype(int))
    assert diff.mean() < 0.05 and np.percentile(diff, 99.9) <= 2


@pytest.mark.slow
def test_generate_under_torchrun_on_a_cpu_host_writes_the_one_process_clip(tmp_path, monkeypatch):
    """`torchrun --nproc-per-node 2 diffusers-h3 generate ...` on a host without GPUs: the CLI's process group comes
    from Accelerate's PartialState (backend "undefined"), which used to send diffusers' size exchange to CUDA on a
    CUDA build of torch ("Found no NVIDIA driver")."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    argv = ["generate", "--prompt", "a cat", "--steps", "3", "--seed", "1", "--device", "cpu"]
    assert main([*argv, "--out", str(tmp_path / "one.mp4")]) == 0
    env = {**os.environ, "PYTHONPATH": str(root), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          str(root / "diffusers_h3_launcher.py"), *argv, "--out", str(tmp_path / "two.mp4")],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    one, two = _frames(tmp_path / "one.mp4"), _frames(tmp_path / "two.mp4")
    assert one.shape == two.shape and one.shape[0] == 124
    diff = np.abs(one.astype(int) - two.astype(int))  # see the test above: H.264 and float rounding
    assert diff.mean() < 0.05 and np.percentile(diff, 99.9) <= 2


def test_generate_gpus_hands_each_rank_picklable_arguments(tmp_path, monkeypatch):
    """The ranks of `generate --gpus N` are fresh processes: every argument they get must pickle (the checked request
    holds configs that do not; each rank checks the request again)."""
    import pickle

    import diffusers_h3.parallel._launch as launcher

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    handed = []
    monkeypatch.setattr(launcher, "launch", lambda fn, world_size, args=(), **kw: handed.append(pickle.dumps(args)))
    argv = ["generate", "--prompt", "a cat", "--steps", "3", "--device", "cpu", "--gpus", "2", "--out",
            str(tmp_path / "two.mp4")]  # fmt: skip
    assert main(argv) == 0
    (rank_args,) = pickle.loads(handed[0])
    assert rank_args.gpus == 2 and rank_args.prompt == "a cat" and not hasattr(rank_args, "checked_request")
