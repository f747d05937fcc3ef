"""Decisions of the CLI that must not flip: the safetensors completeness check counts the 8-byte length prefix of the
header (a file short by 1-8 bytes is truncated), `--vsa` takes sparsities in [0, 1) (1.0 is refused), and a rank
started by torchrun on a multi-node job uses `cuda:<LOCAL_RANK>`, not its global rank."""

import pytest
import torch

from diffusers_h3 import cli
from diffusers_h3.pipelines.pipeline_minimax_h3 import MiniMaxH3Pipeline


@pytest.fixture
def no_loading(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input checks")

    monkeypatch.setattr(MiniMaxH3Pipeline, "from_pretrained", classmethod(refuse))
    monkeypatch.setattr("diffusers_h3.testing.tiny.demo_checkpoint_dir", refuse)
    return tmp_path


def _error_line(argv, capsys):
    with pytest.raises(SystemExit) as raised:
        cli.main(argv)
    assert raised.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def _lora_file(path):
    from safetensors.torch import save_file

    save_file({"transformer.proj_out.lora_A.weight": torch.randn(4, 32)}, str(path))
    return path


@pytest.mark.parametrize("missing_bytes", [1, 8])
def test_a_file_short_by_at_most_the_length_prefix_is_truncated(no_loading, capsys, missing_bytes):
    complete = _lora_file(no_loading / "complete.safetensors")
    assert cli.safetensors_problem(complete) is None
    short = no_loading / "short.safetensors"
    short.write_bytes(complete.read_bytes()[:-missing_bytes])
    size = short.stat().st_size
    assert cli.safetensors_problem(short) == f"truncated: {size} bytes, but its header describes {size + missing_bytes} bytes"
    argv = ["generate", "--prompt", "a cat", "--out", str(no_loading / "clip.mp4"), "--device", "cpu", "--lora", str(short)]
    line = _error_line(argv, capsys)
    assert str(short) in line and "truncated" in line


def test_vsa_sparsity_upper_bound_is_exclusive(no_loading, capsys):
    parser = cli.build_parser()
    for accepted in ("0", "0.999"):
        assert parser.parse_args(["generate", "--prompt", "x", "--vsa", accepted]).vsa == float(accepted)
    for refused in ("1", "1.0"):
        line = _error_line(["generate", "--prompt", "x", "--vsa", refused], capsys)
        assert "sparsity must be in [0.0, 1.0)" in line


class _Loaded(Exception):
    pass


def test_torchrun_rank_uses_the_gpu_of_its_local_rank(no_loading, monkeypatch):
    import accelerate

    # Second node of two, one rank on each (the world size must divide the demo DiT's 2 attention heads): global
    # rank 1 is local rank 0 there.
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(accelerate, "PartialState", lambda *args, **kwargs: None)  # no process group needed here

    def load(args):
        raise _Loaded(args.device)

    monkeypatch.setattr(cli, "_load_pipeline", load)
    with pytest.raises(_Loaded) as loaded:
        cli.main(["generate", "--prompt", "a cat", "--out", str(no_loading / "clip.mp4"), "--device", "cuda"])
    assert loaded.value.args == ("cuda:0",)
