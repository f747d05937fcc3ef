"""The README's summary plot is redrawn from the committed results JSON, so it cannot drift from the numbers."""

import importlib.util
import json
from pathlib import Path

import pytest


pytest.importorskip("matplotlib")

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load_plot_script():
    spec = importlib.util.spec_from_file_location("benchmarks_plot", BENCHMARKS / "plot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plot_redraws_from_committed_json(tmp_path):
    plot = _load_plot_script()
    out = tmp_path / "summary.png"
    table = plot.main(["--results", str(BENCHMARKS / "results"), "--out", str(out)])

    assert out.exists() and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(table) == {"end_to_end_h200.json", "attention_h200.json", "gemm_h200.json"}
    for file, panel in table.items():
        data = json.loads((BENCHMARKS / "results" / file).read_text())
        assert panel["rows"], f"{file}: no case drawn"
        assert data["commit"] in panel["title"] and data["device"] in panel["title"]
        scale = 1e-3 if panel["unit"] == "s" else 1.0
        for name, value, ratio in panel["rows"]:
            assert value == pytest.approx(data["cases"][name]["ms"] * scale)
            assert ratio == data["cases"][name]["ratio"]


def test_plot_follows_the_json_it_is_given(tmp_path):
    """A changed number in the JSON changes the drawn table (the plot is not a copy of earlier output)."""
    plot = _load_plot_script()
    data = json.loads((BENCHMARKS / "results" / "attention_h200.json").read_text())
    data["cases"]["cudnn_dense"]["ms"] = 1234.5
    (tmp_path / "attention_h200.json").write_text(json.dumps(data))
    table = plot.main(["--results", str(tmp_path), "--out", str(tmp_path / "summary.png")])

    assert list(table) == ["attention_h200.json"]
    assert ("cudnn_dense", 1234.5, 1.0) in table["attention_h200.json"]["rows"]
    assert (tmp_path / "summary.png").exists()
