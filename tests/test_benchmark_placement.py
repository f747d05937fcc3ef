"""benchmarks/placement.py runs end to end on the CPU with tiny components (the full-size run is for a GPU)."""

import json
from pathlib import Path

import pytest

from tests._scripts import run_script


ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "placement.py"
STAGES = ["text_encode", "forwards", "video_decode", "audio_decode", "other"]


def _run(tmp_path, *args):
    out = tmp_path / "placement_h200.json"
    run = run_script(SCRIPT, "--tiny", "--out", out, *args)
    return run, out


def _check_case(data, name):
    case = data["cases"][name]
    assert data["notes"].get(name) is None, data["notes"]
    assert case["ms"] > 0 and list(case["stages"]) == STAGES
    assert all(case["stages"][s] > 0 for s in STAGES[:-1]), case["stages"]
    assert sum(case["stages"].values()) == pytest.approx(case["ms"], rel=1e-3, abs=1.0)
    # exactly one denoising forward, the first of the 50-sigma-point t2va schedule
    assert case["forwards"] == 1 and case["sigma_points"] == 50 and len(case["forward_ms"]) == 1
    assert case["stages"]["forwards"] == pytest.approx(case["forward_ms"][0], abs=0.1)
    # CPU: no cap, no device memory figures; host memory recorded
    assert case["cap_gib"] is None and case["peak_allocated_gib"] is None and case["peak_reserved_gib"] is None
    assert case["host_peak_rss_gib"] > 0
    assert set(case["weights_gib"]) == {"text_encoder", "transformer", "vae", "audio_vae"}
    assert set(case["weights"]) == set(case["weights_gib"]) | {"text_encoder_layers"}
    # the tiny text encoder has exactly the layers the pipeline needs: the recipe's trim removes none
    assert case["weights"]["text_encoder_layers"]["removed_layers"] == 0
    assert all(size > 0 for size in case["weights_gib"].values())
    return case


def test_unknown_case_is_refused_before_building(tmp_path):
    run, out = _run(tmp_path, "--cases", "offload_48gb,resident_24gb")
    assert run.returncode != 0 and "unknown case(s) ['resident_24gb']" in run.stderr
    assert "built" not in run.stdout  # refused before any pipeline was built
    assert not out.exists()


def test_tiny_offload_recipe_records_every_stage(tmp_path):
    run, out = _run(tmp_path, "--cases", "offload_48gb")
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["suite"] == "placement" and data["shape"]["tiny"] is True and set(data["cases"]) == {"offload_48gb"}
    assert data["shape"]["forwards"] == 1 and data["shape"]["output_type"] == "np"
    case = _check_case(data, "offload_48gb")
    assert "enable_low_memory_offload(pipe, " in case["recipe"]
    placements = case["placements"]
    assert placements["transformer"].startswith("group offload (block level")
    assert placements["text_encoder"].startswith("group offload (leaf level")
    assert all("low_cpu_mem_usage=True" in placements[n] for n in ("transformer", "text_encoder"))
    assert placements["vae"] == placements["audio_vae"] == "model offload"
    assert "W8A16Config" in case["weights"]["transformer"] and "W8A16Config" in case["weights"]["text_encoder"]
    assert case["warmup_s"] > 0


def test_tiny_resident_recipe_quantizes_like_the_recipe_and_merges(tmp_path):
    # a result already in --out (another command's case) is kept with --merge
    first, out = _run(tmp_path, "--cases", "offload_40gb", "--no-warmup")
    assert first.returncode == 0, first.stderr[-3000:]
    run, out = _run(tmp_path, "--cases", "resident_80gb", "--no-warmup", "--merge")
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data["cases"]) == {"offload_40gb", "resident_80gb"} and len(data["command"]) == 2
    case = _check_case(data, "resident_80gb")
    assert case["placements"] == "all on cpu" and case["warmup_s"] == 0
    # the configs of single_gpu_resident_kwargs(): FP8 DiT (emulated on the CPU) and W8A16 text encoder
    assert "FP8Config" in case["weights"]["transformer"] and "emulation" in case["weights"]["transformer"]
    assert "W8A16Config" in case["weights"]["text_encoder"]
