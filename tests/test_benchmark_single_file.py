"""benchmarks/single_file.py runs every file format's GEMM on the CPU with small shapes (the H3-sized run is for a
GPU) and records the computed weight memory of each format."""

import json
from pathlib import Path

import pytest

from tests._scripts import run_script


ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "single_file.py"
FORMATS = ("bf16", "Q8_0", "Q6_K", "Q5_K", "Q4_K", "fp8_scaled")


def test_tiny_run_records_every_format(tmp_path):
    pytest.importorskip("gguf")
    out = tmp_path / "single_file_cpu.json"
    run = run_script(SCRIPT, "--tiny", "--reps", "1", "--out", out)
    assert run.returncode == 0, run.stderr[-2000:]
    data = json.loads(out.read_text())
    cases = data["cases"]
    assert data["suite"] == "single_file" and data["shape"]["rows"] == 64
    for fmt in FORMATS:
        for gemm in ("qkv", "out", "ffn_up", "ffn_down"):
            case = cases[f"{fmt}_{gemm}"]
            assert case["ms"] > 0 and case["baseline"] == cases[f"bf16_{gemm}"]["ms"]
        assert cases[f"dit_gemm_{fmt}"]["notes"].startswith("derived")
        assert cases[f"weights_{fmt}"]["peak_gib"] > 0 and "computed" in cases[f"weights_{fmt}"]["notes"]
    # GGUF runs the dequantized weight: the same product as the dense matmul; FP8 adds its activation rounding
    assert all(cases[f"{kind}_out"]["rel_l2"] < 1e-6 for kind in ("Q8_0", "Q6_K", "Q5_K", "Q4_K"))
    assert 1e-4 < cases["fp8_scaled_out"]["rel_l2"] < 0.05
    assert "FP8Linear" in cases["fp8_scaled_qkv"]["path"] and "dequantize" in cases["Q4_K_qkv"]["path"]
