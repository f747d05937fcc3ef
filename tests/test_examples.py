"""The example script and notebook run end to end on the tiny demo checkpoint."""

import json
import runpy
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def test_example_script_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "argv", ["generate_t2va_fl2va.py", "--out-dir", str(tmp_path / "out"), "--steps", "2"])
    runpy.run_path(str(ROOT / "examples" / "generate_t2va_fl2va.py"), run_name="__main__")
    assert (tmp_path / "out" / "t2va.mp4").stat().st_size > 0
    assert (tmp_path / "out" / "fl2va.mp4").stat().st_size > 0


def test_example_notebook_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    notebook = json.loads((ROOT / "examples" / "quickstart_t2va_fl2va.ipynb").read_text())
    namespace = {}
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), "notebook", "exec"), namespace)
    assert (tmp_path / "t2va.mp4").exists() and (tmp_path / "fl2va.mp4").exists()
    assert namespace["result"].audio.shape[1] == 2


def test_train_lora_example_runs_on_the_demo(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train_lora.py", "--demo", "--output", str(tmp_path / "lora")])
    try:
        runpy.run_path(str(ROOT / "examples" / "train_lora.py"), run_name="__main__")
    except SystemExit as exit_info:
        assert exit_info.code == 0
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").stat().st_size > 0
    assert (tmp_path / "lora" / "lora_comfyui.safetensors").stat().st_size > 0
