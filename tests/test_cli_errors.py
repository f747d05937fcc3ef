"""Every user mistake of the CLI: one line `diffusers-h3: error: <what> — <fix>`, exit code 2, checked before any
model loads, nothing written."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from diffusers_h3 import cli
from diffusers_h3.pipelines.pipeline_minimax_h3 import MiniMaxH3Pipeline


@pytest.fixture
def no_loading(monkeypatch, tmp_path):
    """Any model load fails the test: the checks must run before it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input checks")

    monkeypatch.setattr(MiniMaxH3Pipeline, "from_pretrained", classmethod(refuse))
    monkeypatch.setattr("diffusers_h3.testing.tiny.demo_checkpoint_dir", refuse)
    return tmp_path


def _fails(argv, capsys, *expected, after_loading=False):
    """Run the CLI; it must exit 2 with one `diffusers-h3: error:` line containing `expected` (after loading, progress
    bars come first: the error is then the last line)."""
    with pytest.raises(SystemExit) as raised:
        cli.main(argv)
    assert raised.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 or after_loading, err
    lines = lines[-1:]
    assert err.count("diffusers-h3: error:") == 1 and "Traceback" not in err, err
    assert lines[0].startswith("diffusers-h3: error: ") and " — " in lines[0], lines[0]
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def _image(path, size=(96, 64)):
    Image.fromarray(np.random.randint(0, 255, (size[1], size[0], 3), np.uint8)).save(path)
    return str(path)


def _safetensors(path):
    import torch
    from safetensors.torch import save_file

    save_file({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.randn(4, 32)}, str(path))
    return path


BAD_INPUTS = {
    "empty prompt": (["--prompt", "  "], ["--prompt is empty"]),
    "height not a multiple": (["--height", "100", "--width", "96"], ["multiples of 32", "100x96"]),
    "height without width": (["--height", "64"], ["--height and --width have to be passed together"]),
    "aspect ratio": (["--height", "32", "--width", "256"], ["aspect ratios from 1:4 to 4:1"]),
    "too few frames": (["--frames", "50"], ["--frames 50", "17n+5"]),
    "too many frames": (["--num-frames", "400"], ["--frames 400"]),
    "steps": (["--steps", "1"], ["--steps must be at least 2"]),
    "sparsity": (["--vsa", "1.5"], ["sparsity must be in [0.0, 1.0)"]),
    "unknown quantization": (["--quantize", "int3"], ["--quantize int3", "fp8"]),
    "dense first steps without vsa": (["--dense-first-steps", "2"], ["--dense-first-steps", "--vsa"]),
    "lora scale without lora": (["--lora-scale", "0.5"], ["--lora-scale without --lora"]),
    "cache threshold without cache": (["--cache-threshold", "0.1"], ["--cache-threshold without --cache"]),
    "taylorseer threshold": (["--cache", "taylorseer", "--cache-threshold", "0.1"], ["TaylorSeer"]),
    "mag without steps": (["--cache", "mag"], ["--cache mag needs --steps"]),
    "unknown cache": (["--cache", "lru"], ["invalid choice: 'lru'"]),
    "v100 with vsa": (["--v100", "--vsa", "0.5"], ["--v100"]),
    "missing model folder": (["--model", "./no/such/model"], ["--model ./no/such/model", "does not exist"]),
    "model under a missing folder": (["--model", "../nowhere"], ["does not exist"]),
    "missing lora file": (["--lora", "./style.safetensors"], ["--lora ./style.safetensors", "does not exist"]),
    "missing image": (["--image", "nope.png"], ["--image nope.png", "does not exist"]),
    "unknown reference kind": (["--reference", "thing.xyz"], ["--reference thing.xyz", "image:PATH"]),
    "ref2va on the demo": (["--reference", "image:{img}"], ["tiny demo", "--model"]),
    "two tasks": (["--image", "{img}", "--reference", "image:{img}"], ["cannot be combined"]),
    "no mp4": (["--out", "{tmp}/clip.avi"], ["--out", ".mp4"]),
    "missing out folder": (["--out", "{tmp}/missing/clip.mp4"], ["missing does not exist"]),
    "out is a folder": (["--out", "{tmp}/folder.mp4"], ["is a folder"]),
    "unknown flag": (["--hieght", "64"], ["unrecognized arguments: --hieght"]),
    "two placements": (["--low-memory", "--cpu-offload"], ["--low-memory and --cpu-offload"]),
    "low memory on several gpus": (["--low-memory", "--gpus", "2"], ["--low-memory", "--gpus 2"]),
    "text encoder offload on one process": (["--text-encoder-offload"], ["--text-encoder-offload", "add --gpus N"]),
    "low memory with compile": (["--low-memory", "--speed", "fast"], ["--low-memory with --speed"]),
    "flashinfer with fastest": (["--speed", "fastest", "--flashinfer", "on"], ["--flashinfer on",
                                                                                "add --speed exact / fast"]),
    "flashinfer on the cpu": (["--speed", "exact", "--flashinfer", "on"], ["not on --device cpu", "--flashinfer off"]),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_is_one_line_before_loading_and_writes_nothing(name, no_loading, capsys, monkeypatch):
    tmp = no_loading
    monkeypatch.chdir(tmp)
    (tmp / "folder.mp4").mkdir()
    img = _image(tmp / "key.png")
    flags, expected = BAD_INPUTS[name]
    flags = [flag.format(img=img, tmp=tmp) for flag in flags]
    out = tmp / "out.mp4"
    argv = ["generate", "--prompt", "a cat", "--out", str(out), "--device", "cpu", *flags]
    if "--prompt" in flags:
        argv = argv[:1] + argv[3:]
    _fails(argv, capsys, *expected)
    assert not out.exists() and not (tmp / "cache").exists()
    assert not (tmp / "clip.avi").exists() and not (tmp / "missing").exists()


def test_corrupt_files_are_named_with_the_reason(no_loading, capsys):
    tmp = no_loading
    out = tmp / "out.mp4"
    base = ["generate", "--prompt", "a cat", "--out", str(out), "--device", "cpu"]
    # A LoRA that is not a safetensors file.
    fake = tmp / "style.safetensors"
    fake.write_text("this is not a LoRA, just text that is long enough to have 8 bytes")
    _fails([*base, "--lora", str(fake)], capsys, str(fake), "not a safetensors file")
    # A model folder with a truncated weights file and one with a broken model_index.json.
    model = tmp / "model"
    (model / "vae").mkdir(parents=True)
    (model / "model_index.json").write_text(json.dumps({"_class_name": "MiniMaxH3Pipeline"}))
    weights = _safetensors(model / "vae" / "diffusion_pytorch_model.safetensors")
    weights.write_bytes(weights.read_bytes()[:-10])
    _fails([*base, "--model", str(model)], capsys, str(weights), "truncated")
    weights.unlink()
    (model / "model_index.json").write_text('{"_class_name": "MiniMaxH3Pipeline",')
    _fails([*base, "--model", str(model)], capsys, str(model / "model_index.json"), "not valid JSON")
    # An unreadable keyframe.
    (tmp / "key.png").write_bytes(b"not a png")
    _fails([*base, "--image", str(tmp / "key.png")], capsys, "--image", "not a readable image")
    assert not out.exists()


def test_a_complete_lora_file_passes_the_header_check(tmp_path):
    assert cli.safetensors_problem(_safetensors(tmp_path / "ok.safetensors")) is None


def test_describe_checks_model_path_before_loading(no_loading, capsys):
    _fails(["describe", "--model", "./missing"], capsys, "--model ./missing", "does not exist")
    _fails(["describe", "--model", "x/y", "--demo"], capsys, "--demo and --model")


def test_debug_shows_the_traceback(no_loading):
    from diffusers_h3.cli import UsageError

    with pytest.raises(UsageError, match="--prompt is empty"):
        cli.main(["generate", "--prompt", "", "--debug"])


def test_lora_key_error_names_the_cli_flag(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    import torch
    from safetensors.torch import save_file

    lora = tmp_path / "style.safetensors"
    save_file({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.randn(4, 32),
               "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.randn(64, 4),
               "transformer.no_such_module.lora_A.weight": torch.randn(4, 32),
               "transformer.no_such_module.lora_B.weight": torch.randn(64, 4)}, str(lora))  # fmt: skip
    out = tmp_path / "out.mp4"
    argv = ["generate", "--prompt", "a cat", "--out", str(out), "--steps", "2", "--device", "cpu", "--lora", str(lora)]
    line = _fails(argv, capsys, "--lora-allow-unmatched", after_loading=True)
    assert "allow_unmatched_keys" not in line and not out.exists()


def test_cache_names_match_the_library():
    from diffusers_h3.hooks.cache import CACHE_METHODS

    assert cli.CACHE_METHOD_CHOICES == CACHE_METHODS


def test_cache_option_enables_the_cache(tmp_path, monkeypatch):
    from diffusers import MiniMaxH3Transformer3DModel

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    enabled = []
    original = MiniMaxH3Transformer3DModel.enable_cache
    monkeypatch.setattr(MiniMaxH3Transformer3DModel, "enable_cache",
                        lambda self, config: (enabled.append(config), original(self, config))[1])  # fmt: skip
    out = tmp_path / "cached.mp4"
    argv = ["generate", "--prompt", "a cat", "--out", str(out), "--steps", "3", "--device", "cpu",
            "--cache", "first-block", "--cache-threshold", "0.2"]  # fmt: skip
    assert cli.main(argv) == 0
    assert out.exists()
    assert len(enabled) == 1 and type(enabled[0]).__name__ == "FirstBlockCacheConfig" and enabled[0].threshold == 0.2


def test_every_flag_has_help():
    def actions(parser):
        for action in parser._actions:
            yield action
            for sub in getattr(action, "choices", None) or {}:
                if hasattr(action.choices, "items"):
                    yield from actions(action.choices[sub])

    missing = [a.option_strings for a in actions(cli.build_parser()) if a.option_strings and not a.help]
    assert missing == []
    text = cli.build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    assert "multiples of 32" in text and "default: 124" in text and "17n+5" in text and "at least 2" in text


_HELP_WITHOUT_TORCH = """
import importlib.util, sys, types
from pathlib import Path
# Stand in for the package's __init__ (which registers with diffusers, and so imports torch): the CLI module itself
# must import neither torch nor diffusers to parse --help / --version.
package = types.ModuleType("diffusers_h3")
package.__path__ = [str(Path({root!r}) / "diffusers_h3")]
sys.modules["diffusers_h3"] = package
import diffusers_h3.cli as cli
for argv in (["--help"], ["generate", "--help"], ["describe", "--help"], ["--version"]):
    try:
        cli.main(argv)
    except SystemExit as exit:
        assert exit.code == 0, exit.code
heavy = sorted(name for name in ("torch", "diffusers", "transformers", "numpy", "PIL") if name in sys.modules)
print("HEAVY", heavy)
"""


def test_help_and_version_import_no_torch():
    root = str(Path(cli.__file__).resolve().parents[1])
    result = subprocess.run([sys.executable, "-c", _HELP_WITHOUT_TORCH.format(root=root)], capture_output=True,
                            text=True, timeout=120, cwd=root, env={**os.environ, "PYTHONPATH": root})  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "HEAVY []" in result.stdout, result.stdout
    assert "--prompt" in result.stdout and "diffusers-h3 0.1.0" in result.stdout


_LAUNCHER = """
import sys
import diffusers_h3_launcher
for argv in (["--help"], ["--version"], ["generate", "--help"], ["generate", "--no-such-flag"]):
    try:
        diffusers_h3_launcher.main(argv)
    except SystemExit as stop:
        print("EXIT", argv[-1], stop.code)
heavy = sorted(name for name in ("torch", "diffusers", "transformers", "diffusers_h3") if name in sys.modules)
print("HEAVY", heavy)
try:
    diffusers_h3_launcher.main(["generate", "--prompt", " ", "--out", "x.mp4"])
except SystemExit as stop:
    print("EXIT empty-prompt", stop.code)
print("LOADED", "diffusers_h3" in sys.modules and hasattr(sys.modules["diffusers_h3"], "MiniMaxH3Pipeline"))
"""


def test_console_entry_point_parses_before_importing_the_package(tmp_path):
    # The installed `diffusers-h3` command runs diffusers_h3_launcher.main: help, version and usage errors answer
    # without importing diffusers; a real command imports the package proper (registration included).
    root = str(Path(cli.__file__).resolve().parents[1])
    result = subprocess.run([sys.executable, "-c", _LAUNCHER], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": root})  # fmt: skip
    out = result.stdout
    assert "EXIT --help 0" in out and "EXIT --version 0" in out and "EXIT --no-such-flag 2" in out, out
    assert "HEAVY []" in out, out
    assert "EXIT empty-prompt 2" in out and "LOADED True" in out, out
    assert "--prompt is empty" in result.stderr


def test_flashinfer_on_without_the_package_is_one_line(no_loading, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # not installed
    out = no_loading / "out.mp4"
    argv = ["generate", "--prompt", "a cat", "--out", str(out), "--device", "cuda", "--speed", "exact",
            "--flashinfer", "on"]  # fmt: skip
    _fails(argv, capsys, "--flashinfer on", "pip install flashinfer-python", "--flashinfer auto / off")
    assert not out.exists()


def test_fast_flashinfer_on_a_non_hopper_gpu_is_one_line(no_loading, capsys, monkeypatch, flashinfer_stand_in):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # an A100, as far as the check can tell
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    out = no_loading / "out.mp4"
    argv = ["generate", "--prompt", "a cat", "--out", str(out), "--device", "cuda", "--speed", "fast",
            "--flashinfer", "on"]  # fmt: skip
    _fails(argv, capsys, "FA3's FP8 kernel", "Hopper (SM90) only, not sm_80", "--flashinfer off")
    assert not out.exists()
