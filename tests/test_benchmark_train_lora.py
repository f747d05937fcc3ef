"""benchmarks/train_lora.py runs its cases on the tiny components (CPU smoke test of the GPU benchmark)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_train_lora_benchmark_tiny(tmp_path):
    out = tmp_path / "train_lora.json"
    subprocess.run([sys.executable, "train_lora.py", "--tiny", "--out", str(out), "--checkpoint", str(tmp_path / "ckpt"),
                    "--steps", "1", "--warmup", "1"], cwd=ROOT / "benchmarks", check=True)  # fmt: skip
    record = json.loads(out.read_text())
    for name in ("card_24gb", "card_80gb"):
        case = record["cases"][name]
        assert "error" not in case, case
        assert case["loss_finite"] and case["s_per_step"] > 0 and case["lora_parameters"] > 0
    assert record["cases"]["card_24gb"]["base"].endswith("streamed block by block")
