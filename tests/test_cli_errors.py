"""Every user mistake of the CLI: one line `diffusers-h3: error: <what> — <fix>`, exit code 2, checked before any
model loads, nothing written."""

import argparse
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
    "height not a multiple": (["--height", "100", "--width", "96"], ["multiples of 32", "got --height 100 --width 96"]),
    "height without width": (["--height", "64"], ["--height and --width have to be passed together"]),
    "aspect ratio": (["--height", "32", "--width", "256"], ["aspect ratios from 1:4 to 4:1 (width:height)",
                                                            "got --height 32 --width 256"]),
    "less than one VAE chunk": (["--frames", "5"], ["--frames 5 rounds up to 5 frames", "17n+5", "at least 22 frames"]),
    "too many frames, strict": (["--num-frames", "400", "--strict-duration"], ["--frames 400", "--strict-duration",
                                                                            "Pass 6 to 345 frames"]),
    "steps": (["--steps", "1"], ["--steps must be from 2 to 1000", "got 1"]),
    "steps past the bound": (["--steps", "100000"], ["--steps must be from 2 to 1000", "20x the default", "got 100000"]),
    "width without height": (["--width", "96"], ["--height and --width have to be passed together",
                                                 "--width without --height"]),
    "no frames": (["--frames", "0"], ["--frames must be at least 1, got 0"]),
    "prompt of 100,000 characters": (["--prompt", "a" * 100_000], ["--prompt is 100000 tokens", "(2048 tokens",
                                                                    "max_prompt_tokens", "at most 2048 tokens"]),
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
    "last image is a folder": (["--last-image", "{tmp}"], ["--last-image", "is a folder, not a file"]),
    "reference is a folder": (["--reference", "image:{tmp}"], ["--reference", "is a folder, not a file"]),
    "out in a folder nobody can write": (["--out", "/proc/clip.mp4"], ["--out /proc/clip.mp4", "cannot write in /proc"]),
    "unknown device": (["--device", "foo"], ["--device foo: not a torch device", "pass cpu, cuda"]),
    "negative seed": (["--seed", "-1"], ["--seed must be from 0 to 2**64-1, got -1"]),
    "seed above 64 bits": (["--seed", str(2**64)], ["--seed must be from 0 to 2**64-1"]),
    "prompt not utf-8": (["--prompt", "caf\udce9"], ["--prompt is not valid UTF-8", "byte 0xe9 at character 3"]),
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
    "request-sized cap without a recipe": (["--request-sized-cap"], ["--request-sized-cap", "add --memory auto"]),
    "low memory with compile": (["--low-memory", "--speed", "fast"], ["--low-memory with --speed"]),
    "flashinfer with fastest": (["--speed", "fastest", "--flashinfer", "on"], ["--flashinfer on",
                                                                                "add --speed exact / fast"]),
    "flashinfer on the cpu": (["--speed", "exact", "--flashinfer", "on"], ["not on --device cpu", "--flashinfer off"]),
    "crf above the range": (["--crf", "52"], ["--crf must be from 0 to 51, got 52", "lower is better"]),
    "crf below the range": (["--crf", "-1"], ["--crf must be from 0 to 51, got -1"]),
    "crf not an integer": (["--crf", "18.5"], ["argument --crf", "invalid int value: '18.5'"]),
    "unknown x264 preset": (["--preset", "fastest"], ["argument --preset", "'fastest'", "veryfast"]),
    "unknown pixel format": (["--pix-fmt", "rgb24"], ["argument --pix-fmt", "'rgb24'", "yuv420p"]),
    # Both ran: the first failed after loading with a traceback asking for 8.7e17 bytes, the second ran on.
    "canvas of a billion squared": (["--height", "1000000000", "--width", "1000000000"],
                                    ["The canvas --height 1000000000 --width 1000000000 has",
                                     "more than this pipeline generates (2,088,960", "1080p"]),
    "4096 square canvas": (["--height", "4096", "--width", "4096"], ["16,777,216 pixels", "e.g. --height 768"]),
    "gpus that do not divide the heads": (["--gpus", "3"], ["--gpus 3: context parallelism splits the DiT's 2 "
                                                            "attention heads", "pass --gpus 2"]),
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


def _float_options():
    """`(subcommand, flag, type)` of every option of every subcommand that parses a float."""
    subcommands = cli.build_parser()._subparsers._group_actions[0].choices
    return [(command, action.option_strings[-1], action.type) for command, parser in subcommands.items()
            for action in parser._actions
            if action.option_strings and (action.type is float or getattr(action.type, "kind", None) is float)]  # fmt: skip


NON_FINITE = ("nan", "NaN", "inf", "-inf", "Infinity")


def test_every_float_option_refuses_nan_and_inf():
    options = _float_options()
    flags = {flag for command, flag, _ in options if command == "generate"}
    assert {"--vsa", "--lora-scale", "--cache-threshold"} <= flags, flags
    for command, flag, parse in options:
        for value in NON_FINITE:
            with pytest.raises(argparse.ArgumentTypeError, match="must be a finite number"):
                parse(value)
                pytest.fail(f"{command} {flag} {value} was accepted")


def test_float_pair_options_refuse_nan_and_inf():
    subcommands = cli.build_parser()._subparsers._group_actions[0].choices
    pairs = [(command, action.option_strings[-1], action.type) for command, parser in subcommands.items()
             for action in parser._actions if action.type is cli._ratio_range]  # fmt: skip
    assert {flag for _, flag, _ in pairs} == {"--rms-ratio-range"}, pairs
    for command, flag, parse in pairs:
        for value in ("nan,1", "0.8,inf", "-inf,1", "0.8,NaN"):
            with pytest.raises(argparse.ArgumentTypeError, match="must be a finite number"):
                parse(value)
                pytest.fail(f"{command} {flag} {value} was accepted")


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_float_options_with_nan_or_inf_are_one_line_before_loading(value, no_loading, capsys):
    out = str(no_loading / "out.mp4")
    base = {"generate": ["generate", "--prompt", "a cat", "--out", out, "--device", "cpu"],
            "compare": ["compare", "reference.mp4", "candidate.mp4"],
            "fidelity": ["fidelity", "--prompts", "prompts.txt", "--out", str(no_loading / "fidelity")],
            "plan": ["plan", "--gpu", "8"],
            "train-lora": ["train-lora", "--data", str(no_loading), "--output", str(no_loading / "lora")]}  # fmt: skip
    for command, flag, _ in _float_options():  # `--flag=-inf`: argparse reads a bare `-inf` as an option
        _fails([*base[command], f"{flag}={value}"], capsys, f"argument {flag}", "must be a finite number", repr(value))
    for command in ("compare", "fidelity"):
        _fails([*base[command], f"--rms-ratio-range=0.8,{value}"], capsys, "--rms-ratio-range", "finite")
    for memory in (f"{value},32", f"16,{value}"):  # --memory's two numbers
        _fails([*base["generate"], f"--memory={memory}"], capsys, "--memory")
    assert not (no_loading / "out.mp4").exists() and not (no_loading / "fidelity").exists()


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
    assert "multiples of 32" in text and "default: 124" in text and "17n+5" in text and "from 2 to 1000" in text


_HELP_WITHOUT_TORCH = """
import importlib.util, sys, types
from pathlib import Path
# Stand in for the package's __init__ (which registers with diffusers, and so imports torch): the CLI module itself
# must import neither torch nor diffusers to parse --help / --version.
package = types.ModuleType("diffusers_h3")
package.__path__ = [str(Path({root!r}) / "diffusers_h3")]
sys.modules["diffusers_h3"] = package
import diffusers_h3.cli as cli
for argv in (["--help"], ["generate", "--help"], ["describe", "--help"], ["plan", "--help"], ["--version"]):
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
# Checks that read only the arguments answer before the package (and torch) is imported.
for name, argv in (("empty-prompt", ["--prompt", " "]), ("unwritable-out", ["--prompt", "a cat", "--out", "/proc/x.mp4"]),
                   ("seed", ["--prompt", "a cat", "--seed", "-1"]), ("folder-image", ["--prompt", "a", "--image", "."]),
                   ("crf", ["--prompt", "a cat", "--crf", "99"]), ("preset", ["--prompt", "a cat", "--preset", "x"]),
                   ("height-alone", ["--prompt", "a cat", "--height", "64"]), ("no-frames", ["--prompt", "a", "--frames", "0"]),
                   ("steps", ["--prompt", "a cat", "--steps", "100000"]), ("vsa-nan", ["--prompt", "a", "--vsa", "nan"]),
                   ("lora-scale-inf", ["--prompt", "a cat", "--lora-scale", "inf"])):
    try:
        diffusers_h3_launcher.main(["generate", *argv])
    except SystemExit as stop:
        print("EXIT", name, stop.code)
heavy = sorted(name for name in ("torch", "diffusers", "transformers", "diffusers_h3") if name in sys.modules)
print("HEAVY", heavy)
try:  # the frame count is checked against the checkpoint's VAE: that needs the package
    diffusers_h3_launcher.main(["generate", "--prompt", "a cat", "--frames", "5", "--out", "x.mp4"])
except SystemExit as stop:
    print("EXIT frames", stop.code)
print("LOADED", "diffusers_h3" in sys.modules and hasattr(sys.modules["diffusers_h3"], "MiniMaxH3Pipeline"))
"""


def test_console_entry_point_parses_before_importing_the_package(tmp_path):
    # The installed `diffusers-h3` command runs diffusers_h3_launcher.main: help, version and usage errors answer
    # without importing diffusers; a real command imports the package proper (registration included).
    root = str(Path(cli.__file__).resolve().parents[1])
    result = subprocess.run([sys.executable, "-c", _LAUNCHER], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])})  # fmt: skip
    out = result.stdout
    assert "EXIT --help 0" in out and "EXIT --version 0" in out and "EXIT --no-such-flag 2" in out, out
    assert "HEAVY []" in out, out
    for name in ("empty-prompt", "unwritable-out", "seed", "folder-image", "crf", "preset", "height-alone", "no-frames",
                 "steps", "vsa-nan", "lora-scale-inf"):
        assert f"EXIT {name} 2" in out, out
    assert "EXIT frames 2" in out and "LOADED True" in out, out
    assert "--prompt is empty" in result.stderr and "--frames 5 rounds up" in result.stderr
    assert "Traceback" not in result.stderr, result.stderr


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


def test_cuda_without_a_gpu_is_one_line_before_loading(no_loading, capsys, monkeypatch):
    import torch

    out = no_loading / "out.mp4"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _fails(["generate", "--prompt", "a cat", "--out", str(out), "--device", "cuda"], capsys,
           "--device cuda: this host has no usable CUDA GPU", "pass --device cpu")  # fmt: skip
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    _fails(["generate", "--prompt", "a cat", "--out", str(out), "--device", "cuda:1"], capsys,
           "--device cuda:1: only 1 CUDA device(s) visible", "cuda:0")  # fmt: skip
    assert not out.exists()


def test_decompression_bomb_image_is_one_line(no_loading, capsys, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 96x64 = 6144 pixels: past PIL's error limit (2x)
    image = _image(no_loading / "key.png")
    argv = ["generate", "--prompt", "a cat", "--out", str(no_loading / "out.mp4"), "--device", "cpu", "--image", image]
    _fails(argv, capsys, "--image", "decompression bomb", "pass a smaller image")


def test_a_bin_lora_that_is_not_a_checkpoint_is_named(no_loading, capsys):
    import torch

    base = ["generate", "--prompt", "a cat", "--out", str(no_loading / "out.mp4"), "--device", "cpu"]
    text = no_loading / "style.bin"
    text.write_text("not a checkpoint at all")
    _fails([*base, "--lora", str(text)], capsys, f"--lora {text}", "not a PyTorch checkpoint")
    good = no_loading / "good.bin"
    torch.save({"lora_A.weight": torch.zeros(2, 2)}, good)
    assert cli.torch_checkpoint_problem(good) is None
    legacy = no_loading / "legacy.pt"
    torch.save({"lora_A.weight": torch.zeros(2, 2)}, legacy, _use_new_zipfile_serialization=False)
    assert cli.torch_checkpoint_problem(legacy) is None
    truncated = no_loading / "truncated.bin"
    truncated.write_bytes(good.read_bytes()[:-40])
    _fails([*base, "--lora", str(truncated)], capsys, "not a PyTorch checkpoint")


def test_hub_id_without_network_blames_the_network(no_loading, capsys, monkeypatch):
    import socket

    def no_dns(*args, **kwargs):
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    base = ["generate", "--prompt", "a cat", "--out", str(no_loading / "out.mp4"), "--device", "cpu"]
    _fails([*base, "--model", "someone/h3-checkpoint"], capsys, "--model someone/h3-checkpoint",
           "cannot reach the Hugging Face Hub", "name resolution", "HF_HUB_OFFLINE=1", "local folder")  # fmt: skip
    _fails(["describe", "--model", "someone/h3-checkpoint"], capsys, "cannot reach the Hugging Face Hub")
    _fails([*base, "--lora", "someone/h3-lora"], capsys, "--lora someone/h3-lora", "cannot reach")


def test_hub_offline_uses_the_cache_without_a_request(no_loading, capsys, monkeypatch):
    import socket

    from huggingface_hub import constants

    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: pytest.fail("HF_HUB_OFFLINE made a network request"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(no_loading / "hub"))
    base = ["generate", "--prompt", "a cat", "--out", str(no_loading / "out.mp4"), "--device", "cpu"]
    _fails([*base, "--model", "someone/h3-checkpoint"], capsys, "HF_HUB_OFFLINE is set",
           "not in the Hugging Face cache", str(no_loading / "hub"))  # fmt: skip
    # In the cache: the checks pass and loading starts (refused here), still without a request.
    snapshot = no_loading / "hub" / "models--someone--h3-checkpoint" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "model_index.json").write_text("{}")
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    with pytest.raises(AssertionError, match="a model was loaded"):
        cli.main([*base, "--model", "someone/h3-checkpoint"])


def test_prompt_longer_than_the_text_encoder_reads_is_refused_before_loading(no_loading, capsys):
    from diffusers_h3.testing.tiny import tiny_tokenizer

    model = no_loading / "model"
    (model / "text_encoder").mkdir(parents=True)
    (model / "model_index.json").write_text(json.dumps({"_class_name": "MiniMaxH3Pipeline"}))
    (model / "text_encoder" / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 16}}))
    tiny_tokenizer().save_pretrained(model / "tokenizer")
    base = ["generate", "--out", str(no_loading / "out.mp4"), "--device", "cpu", "--model", str(model)]
    _fails([*base, "--prompt", "a cat playing the piano"], capsys, "--prompt is 23 tokens",
           "(16 tokens: the pipeline's max_prompt_tokens or the text encoder's max_position_embeddings)",
           "at most 16 tokens")  # fmt: skip
    with pytest.raises(AssertionError, match="a model was loaded"):  # 16 tokens fit: on to loading
        cli.main([*base, "--prompt", "a cat plays jazz"])
    # The pipeline's own bound (model_index.json's max_prompt_tokens) when it is the smaller one.
    (model / "model_index.json").write_text(json.dumps({"_class_name": "MiniMaxH3Pipeline", "max_prompt_tokens": 8}))
    _fails([*base, "--prompt", "a cat plays jazz"], capsys, "--prompt is 16 tokens", "(8 tokens", "at most 8 tokens")


def test_frames_rule_in_help_is_the_rule_applied(no_loading, tmp_path, h3_logs, monkeypatch):
    """The help's shortest clip and the released model's recommended range are what the CLI accepts: outside the
    range with a warning, refused with --strict-duration (one rule with the pipeline: tests/pipelines/test_request)."""
    import re

    text = " ".join(cli.build_parser()._subparsers._group_actions[0].choices["generate"].format_help().split())
    shortest = int(re.search(r"at least (\d+) frames", text).group(1))
    low, high = map(int, re.search(r"\((\d+)-(\d+) frames after rounding\)", text).groups())
    released = tmp_path / "released"  # the hub layout's configs: no duration keys, the released defaults
    released.mkdir()
    (released / "model_index.json").write_text(json.dumps({"_class_name": "MiniMaxH3Pipeline"}))

    def accepted(frames, *flags, model=None):
        argv = ["generate", "--prompt", "a cat", "--out", str(no_loading / "o.mp4"), "--device", "cpu",
                "--frames", str(frames), *flags, *(["--model", str(model)] if model else [])]  # fmt: skip
        try:
            cli.check_generate(cli.build_parser().parse_args(argv))
            return True
        except cli.UsageError:
            return False

    assert shortest == 22 and accepted(shortest) and accepted(6) and not accepted(5)  # 6-22 round up to 22
    strict = ("--strict-duration",)
    assert accepted(low - 16, *strict, model=released) and not accepted(low - 17, *strict, model=released)
    assert accepted(high, *strict, model=released) and not accepted(high + 1, *strict, model=released)
    monkeypatch.setattr("diffusers_h3.pipelines.request._WARNED_DURATIONS", set())
    h3_logs.caplog.clear()
    assert accepted(low - 17, model=released) and accepted(high + 1, model=released)
    warned = {r.getMessage() for r in h3_logs.caplog.records if "outside the" in r.getMessage()}
    assert len(warned) == 2 and all("5–15 s" in m and "--strict-duration" in m for m in warned), warned


def test_ctrl_c_is_one_line_and_exit_130(no_loading, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(MiniMaxH3Pipeline, "from_pretrained", classmethod(interrupted))
    monkeypatch.setattr("diffusers_h3.testing.tiny.demo_checkpoint_dir", lambda: no_loading)
    try:  # a KeyboardInterrupt escaping would stop the test session: catch it to fail this test only
        cli.main(["generate", "--prompt", "a cat", "--out", str(no_loading / "out.mp4"), "--device", "cpu"])
    except BaseException as stop:  # noqa: B036
        ended = stop
    assert isinstance(ended, SystemExit) and ended.code == 130, repr(ended)
    err = capsys.readouterr().err
    assert "diffusers-h3: interrupted" in err and "Traceback" not in err, err


def test_nan_latents_are_one_line_and_write_nothing(tmp_path, monkeypatch, capsys):
    """A generation that diverged (here: a step callback poisons the latents) ends in one line naming the likely
    cause, not in a codec traceback after the model ran."""
    import torch

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    original = MiniMaxH3Pipeline.__call__

    def diverging(self, *args, **kwargs):
        def poison(pipe, step, timestep, tensors):
            return {"latents": torch.full_like(tensors["latents"], float("nan"))}

        return original(self, *args, **kwargs, callback_on_step_end=poison)

    monkeypatch.setattr(MiniMaxH3Pipeline, "__call__", diverging)
    out = tmp_path / "out.mp4"
    _fails(["generate", "--prompt", "a cat", "--out", str(out), "--steps", "2", "--device", "cpu"], capsys,
           "the video latents hold", "NaN/inf", "likely causes", "--lora-scale", after_loading=True)  # fmt: skip
    assert not out.exists()


def test_dry_run_checks_the_request_and_loads_nothing(no_loading, capsys, monkeypatch, h3_logs):
    monkeypatch.setattr("diffusers_h3.pipelines.request._WARNED_DURATIONS", set())
    out = no_loading / "out.mp4"
    with h3_logs.expect("outside the 0.5–15 s"):  # a 20 s clip: generated after a warning
        assert cli.main(["generate", "--prompt", "a cat", "--out", str(out), "--device", "cpu", "--frames", "480",
                         "--dry-run"]) == 0  # fmt: skip
    printed = capsys.readouterr()
    assert "dry run: t2va 64x96x481 (20.0 s), 5 text rows" in printed.out and "nothing loaded" in printed.out
    assert not out.exists()
    _fails(["generate", "--prompt", "a cat", "--out", str(out), "--device", "cpu", "--frames", "480",
            "--strict-duration", "--dry-run"], capsys, "--frames 480", "--strict-duration")  # fmt: skip


def test_turbo_sla_lora_is_refused_before_loading(no_loading, capsys):
    """A LightX2V Turbo-SLA adapter (by name, or by its __metadata__) is refused in one line before anything loads."""
    import torch
    from safetensors.torch import save_file

    base = ["generate", "--prompt", "a cat", "--out", str(no_loading / "out.mp4"), "--device", "cpu"]
    tensors = {"transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(2, 8)}
    by_name = no_loading / "minimax_h3_fl2v_turbo_4step_v0.1_768p_sla_bf16.safetensors"
    save_file(tensors, str(by_name))
    line = _fails([*base, "--lora", str(by_name)], capsys, "Turbo-SLA adapter (its name)", "sparse-linear attention")
    assert "use a dense Turbo file" in line
    by_metadata = no_loading / "renamed.safetensors"
    save_file(tensors, str(by_metadata), metadata={"sparse_attention": "sla"})
    _fails([*base, "--lora", str(by_metadata)], capsys, "its __metadata__ sparse_attention='sla'")
    assert not (no_loading / "out.mp4").exists()


def test_gpus_beyond_the_cores_or_devices_is_one_line_before_loading(no_loading, capsys, monkeypatch):
    """`--gpus N` started N processes whatever the host held."""
    import torch

    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    argv = ["generate", "--prompt", "a cat", "--out", str(no_loading / "o.mp4"), "--gpus", "2"]
    _fails([*argv, "--device", "cpu"], capsys, "--gpus 2 on --device cpu starts 2 processes", "has 1 CPU cores",
           "pass --gpus 1 or fewer")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cli, "_check_device", lambda args: None)
    _fails([*argv, "--device", "cuda"], capsys, "--gpus 2: only 1 CUDA device(s) visible")


def test_torchvision_that_does_not_fit_torch_is_one_line(tmp_path):
    """A CPU torch with a CUDA torchvision: torchvision's import raises 'operator torchvision::nms does not exist',
    which transformers reported as a 30-line traceback ending "Could not import module 'PreTrainedModel'". Simulated
    with a torchvision whose import raises exactly that, ahead of the real one on the path."""
    fake = tmp_path / "fake" / "torchvision"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    root = str(Path(cli.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "fake"), root])}
    command = ("import sys, diffusers_h3_launcher; "
               "sys.exit(diffusers_h3_launcher.main(['generate', '--prompt', 'a cat', '--out', 'x.mp4']))")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", command], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            env=env)  # fmt: skip
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("diffusers-h3: error: torchvision ") and "torchvision::nms does not exist" in lines[0]
    assert "pip install torch torchvision --index-url https://download.pytorch.org/whl/cpu" in lines[0]
    # The Python API: `import diffusers_h3` raises the same one-line ImportError, not transformers' chain.
    result = subprocess.run([sys.executable, "-c", "import diffusers_h3"], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path, env=env)  # fmt: skip
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("diffusers_h3._torch_install.BrokenTorchInstallError: torchvision "), result.stderr
    assert "PreTrainedModel" not in result.stderr


def test_torchrun_world_size_that_does_not_divide_the_heads_is_one_line(no_loading, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    _fails(["generate", "--prompt", "a cat", "--out", str(no_loading / "o.mp4"), "--device", "cpu"], capsys,
           "WORLD_SIZE=3: context parallelism splits the DiT's 2 attention heads", "launch 2 ranks")
