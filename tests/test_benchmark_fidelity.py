"""benchmarks/fidelity.py: its case check, and the tiny CPU run that writes the JSON and the page."""

import json
import re
from pathlib import Path

from tests._scripts import run_script


ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "fidelity.py"


def test_unknown_case_is_refused_before_building(tmp_path):
    run = run_script(SCRIPT, "--tiny", "--cases", "fast,turbo", "--out", tmp_path / "f.json")
    assert run.returncode != 0 and "unknown case(s) ['turbo']" in run.stderr
    assert not (tmp_path / "f.json").exists()


def test_tiny_run_writes_the_report_and_the_page(tmp_path):
    out, page = tmp_path / "fidelity_cpu.json", tmp_path / "page"
    run = run_script(SCRIPT, "--tiny", "--cases", "first_block_cache", "--out", out, "--page", page,
                     "--work", tmp_path / "work", timeout=900)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["suite"] == "fidelity" and data["choices"]["compile"] is False and data["choices"]["steps"] == 3
    report = data["report"]
    assert report["settings"]["choices"] == data["choices"] and "not a measure of quality" in report["note"]
    assert list(report["cases"]) == ["exact", "first_block_cache"] and report["passed"] is True
    clips = report["cases"]["first_block_cache"]["clips"]
    assert len(clips) == 2  # two prompts, one seed
    assert "transformer" in clips[0]["generation"]["cache"]  # what the step cache skipped is recorded
    sources = re.findall(r"<img src='([^']+)'", (page / "index.html").read_text())
    assert len(sources) == 6 and all((page / source).is_file() for source in sources)
    assert not list(page.rglob("*.mp4"))  # the clips stay in the work folder


def test_docs_quote_the_cpu_run():
    """docs/fidelity.md's table of the tiny CPU run holds benchmarks/results/fidelity_cpu.json's figures."""
    cases = json.loads((ROOT / "benchmarks" / "results" / "fidelity_cpu.json").read_text())["report"]["cases"]
    text = " ".join((ROOT / "docs" / "fidelity.md").read_text().split())
    for case in ("fast", "fastest", "low_ram", "fp8_decode"):
        summary = cases[case]["summary"]
        row = (f"| `{case}` | {summary['ssim_yuv420']:.4f} | {summary['psnr_yuv420']:.2f} dB | "
               f"{summary['audio_cosine']:.4f} |")  # fmt: skip
        assert row in text, row
    assert cases["first_block_cache"]["summary"]["psnr_yuv420"] == "inf" and "| `first_block_cache` | 1.0000 | inf |" in text


def test_text_encoder_first_run_matches_the_whole_pipeline(tmp_path):
    """--text-encoder-first on the tiny pipeline (whose weights do not depend on the build order): the same
    distances as the run that builds everything at once, and the choice is recorded."""
    reports = {}
    for flag in ((), ("--text-encoder-first",)):
        out = tmp_path / f"f{len(flag)}.json"
        run = run_script(SCRIPT, "--tiny", "--cases", "fast", "--seeds", "0", "--out", out, "--no-page",
                         "--work", tmp_path / f"work{len(flag)}", *flag, timeout=900)  # fmt: skip
        assert run.returncode == 0, run.stderr[-2000:]
        reports[flag] = json.loads(out.read_text())
    whole, staged = reports[()], reports[("--text-encoder-first",)]
    assert whole["choices"]["text_encoder_first"] is False
    assert "without the DiT" in staged["choices"]["text_encoder_first"]
    assert staged["report"]["settings"]["text_encoder_first"] is True
    assert staged["report"]["cases"]["fast"]["summary"] == whole["report"]["cases"]["fast"]["summary"]
    assert whole["report"]["cases"]["fast"]["summary"]["psnr_yuv420"] != "inf"
