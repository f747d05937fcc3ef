"""benchmarks/vae.py runs every decode path on the CPU with tiny models (the full-size run is for a GPU)."""

import json
from pathlib import Path

from tests._scripts import run_script


ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "vae.py"


def test_unknown_case_is_refused(tmp_path):
    run = run_script(SCRIPT, "--tiny", "--cases", "native,fp8", "--out", tmp_path / "v.json")
    assert run.returncode != 0 and "--cases must include native" in run.stderr
    assert not (tmp_path / "v.json").exists()


def test_tiny_run_records_every_case(tmp_path):
    out = tmp_path / "vae_h200.json"
    run = run_script(SCRIPT, "--tiny", "--reps", "1", "--dit-layers", "2", "--tiles-per-batch", "5", "--out", out)
    assert run.returncode == 0, run.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["suite"] == "vae" and data["shape"]["latents"] == [1, 4, 9, 6, 9]
    cases = data["cases"]
    assert list(cases) == ["native", "batched_tiles", "batched_tiles+compile", "batched_tiles+compile+fp8",
                           "dit_no_cache", "dit_fbc_never_skips", "dit_fbc_skips"]  # fmt: skip
    assert cases["native"]["ratio"] == 1.0 and cases["native"]["rel_l2"] == 0.0
    batched = cases["batched_tiles"]
    assert batched["ms"] > 0 and batched["rel_l2"] <= 1e-6
    assert "16 tiles in 4 decoder calls (2 chunks)" in batched["path"]  # what ran, recorded at run time
    for compiled in ("batched_tiles+compile", "batched_tiles+compile+fp8"):
        assert cases[compiled]["ms"] is None and "not run" in cases[compiled]["notes"]
    assert cases["dit_fbc_never_skips"]["cache"] == "skipped 0 of 2 steps (steps none)"
    assert cases["dit_fbc_skips"]["cache"] == "skipped 1 of 2 steps (steps 1)"
    # Same inputs every step: a skip (head output + cached tail residual) reproduces the full forward.
    assert cases["dit_fbc_never_skips"]["rel_l2"] == 0.0 and cases["dit_fbc_skips"]["rel_l2"] <= 1e-5
    assert all(cases[name]["ms"] > 0 for name in ("dit_no_cache", "dit_fbc_never_skips", "dit_fbc_skips"))


def test_fp8_case_must_come_last(tmp_path):
    run = run_script(SCRIPT, "--tiny", "--cases", "native,batched_tiles+compile+fp8,batched_tiles",
                     "--out", tmp_path / "v.json")  # fmt: skip
    assert run.returncode != 0 and "must come last" in run.stderr

