"""benchmarks/fasth3.py runs end to end on the CPU with tiny components (the full-size run is for a GPU)."""

import json
from pathlib import Path

import pytest

from diffusers_h3.loaders.fasth3 import KNOWN_FASTH3_PRESETS
from tests._scripts import run_script


SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "fasth3.py"


def test_unknown_case_is_refused_before_building(tmp_path):
    run = run_script(SCRIPT, "--tiny", "--cases", "t2va_turbo", "--out", tmp_path / "r.json")
    assert run.returncode != 0 and "unknown case(s) ['t2va_turbo']" in run.stderr
    assert not (tmp_path / "r.json").exists()


def test_tiny_stack_request_runs_the_preset(tmp_path):
    out = tmp_path / "fasth3.json"
    run = run_script(SCRIPT, "--tiny", "--cases", "t2va_fasth3", "--dit-format", "bf16", "--no-warmup", "--out", out,
                     timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["suite"] == "fasth3" and data["shape"]["tiny"] is True and data["notes"] == {}
    case = data["cases"]["t2va_fasth3"]
    # Four forwards at the trained rungs (video sigmas through shift 12), all timed, nothing extrapolated.
    video = KNOWN_FASTH3_PRESETS["fasth3-4step-preview-vsa"].sigmas()[0]
    assert case["forwards"] == case["forwards_timed"] == 4 and case["extrapolated"] is False
    assert case["sigmas"] == pytest.approx(video, abs=1e-6)
    assert case["vsa"]["sparsity"] == 0.9 and case["vsa"]["gated_blocks"] == case["vsa"]["blocks"]
    assert case["fasth3"]["light_vae"]["nvfp4_linears"].startswith("6 decoder block linears, weight-only NVFP4")
    assert all(case["stages"][s] > 0 for s in ("text_encode", "forwards", "audio_decode", "video_decode+mux"))
    assert sum(case["stages"].values()) == pytest.approx(case["ms"], rel=1e-3, abs=1.0)


def test_bf16_cases_need_the_bf16_dit_format(tmp_path):
    run = run_script(SCRIPT, "--tiny", "--cases", "fl2va_fasth3", "--out", tmp_path / "r.json")
    assert run.returncode != 0 and "fl2va_fasth3 run the bf16 DiT: pass --dit-format bf16" in run.stderr
    assert not (tmp_path / "r.json").exists()


def test_tiny_stack_with_the_dit_quantized_before_the_preset(tmp_path):
    """The default: the DiT (gates included) quantized to the fastest preset's format before the preset, which keeps
    it; the record says so."""
    out = tmp_path / "fasth3.json"
    run = run_script(SCRIPT, "--tiny", "--cases", "t2va_fasth3_fastest", "--no-warmup", "--no-compile", "--out", out,
                     timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["dit_format"] == "quantized" and data["card_bound_gib"] == 75.0 and data["notes"] == {}
    case = data["cases"]["t2va_fasth3_fastest"]
    assert "already quantized: kept" in json.dumps(case["speed_preset"])
    assert case["forwards"] == 4 and case["vsa"]["gated_blocks"] == case["vsa"]["blocks"]
