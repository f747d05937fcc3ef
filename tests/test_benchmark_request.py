"""benchmarks/request.py runs end to end on the CPU with tiny components (the full-size run is for a GPU)."""

import importlib.util
import json
from pathlib import Path

import pytest

from tests._scripts import run_script


ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "request.py"


def test_unknown_case_is_refused_before_building(tmp_path):
    run = run_script(SCRIPT, "--tiny", "--cases", "t2va_turbo", "--out", tmp_path / "r.json")
    assert run.returncode != 0 and "unknown case(s) ['t2va_turbo']" in run.stderr
    assert not (tmp_path / "r.json").exists()


def test_tiny_request_records_every_stage(tmp_path):
    out = tmp_path / "request_h200.json"
    run = run_script(SCRIPT, "--tiny", "--cases", "t2va_native,t2va_fast", "--forwards", "1", "--no-warmup",
                     "--out", out, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["suite"] == "request" and data["shape"]["tiny"] is True
    assert set(data["cases"]) == {"t2va_native", "t2va_fast"} and data["notes"] == {}
    # The fast preset quantizes the text encoder (W8A16): its prompt embeddings move from the first case's, a little.
    assert data["cases"]["t2va_native"]["prompt_embeds_rel_l2"] is None  # it is the reference
    assert 0 < data["cases"]["t2va_fast"]["prompt_embeds_rel_l2"] < 0.05
    assert "W8A16Config" in data["cases"]["t2va_fast"]["speed_preset"]["weights"]["text_encoder"]
    case = data["cases"]["t2va_native"]
    assert case["stage_peak_gib"] == {} and case["peak_reserved_gib"] is None  # CPU: no CUDA memory statistics
    assert list(case["stages"]) == ["text_encode", "forwards", "video_decode", "audio_decode", "mux", "other"]
    assert all(case["stages"][s] > 0 for s in ("text_encode", "forwards", "video_decode", "audio_decode", "mux"))
    # 50 sigma points = 49 forwards; one timed, the rest extrapolated at the median forward.
    assert case["forwards"] == 49 and case["forwards_timed"] == 1 and case["extrapolated"] is True
    assert len(case["forward_ms"]) == 1
    # forward_median_ms is rounded to 0.1 ms in the JSON: 49 x that rounding (2.45 ms) + the stage's own rounding
    assert case["stages"]["forwards"] == pytest.approx(49 * case["forward_median_ms"], abs=2.6)
    assert sum(case["stages"].values()) == pytest.approx(case["ms"], rel=1e-3, abs=1.0)

    # The summary plot's stage panel reads exactly these numbers.
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("benchmarks_plot", ROOT / "benchmarks" / "plot.py")
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    stages = plot.stage_table(tmp_path)
    (name, seconds, total, extrapolated), _ = stages["rows"]
    assert name == "t2va_native" and extrapolated is True and total == pytest.approx(case["ms"] / 1000)
    assert seconds == {k: pytest.approx(v / 1000) for k, v in case["stages"].items()}
    plot.main(["--results", str(tmp_path), "--out", str(tmp_path / "summary.png")])
    assert (tmp_path / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_preset_change_warms_the_decode_again(tmp_path, monkeypatch):
    """A preset picks its own decode path (and the Dynamo reset drops a compiled decoder): the warm-up must decode
    again after each preset change, or the timed request pays the decoder's compilation."""
    spec = importlib.util.spec_from_file_location("benchmarks_request", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec.loader.exec_module(module)
    warmed = []
    monkeypatch.setattr(module, "warm_up", lambda pipe, case, tiny, decode: warmed.append((case, decode)))
    record = {"ms": 1.0, "stages": {"forwards": 1.0}, "peak_gib": None, "forwards": 1, "forwards_timed": 1}
    monkeypatch.setattr(module, "request", lambda *args, **kwargs: dict(record))
    module.main(["--tiny", "--cases", "t2va_native,t2va_fast,t2va_fastest", "--out", str(tmp_path / "r.json")])
    assert warmed == [("t2va_native", True), ("t2va_fast", True), ("t2va_fastest", True)]


def test_flashinfer_case_applies_the_fast_preset_with_flashinfer(tmp_path, monkeypatch):
    """t2va_fast_flashinfer is the fast preset with flashinfer=True (a preset change: applied again after t2va_fast)."""
    spec = importlib.util.spec_from_file_location("benchmarks_request", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec.loader.exec_module(module)
    assert "t2va_fast_flashinfer" not in module.DEFAULT_CASES  # needs flashinfer-python: only when asked for
    import diffusers_h3

    applied = []
    monkeypatch.setattr(diffusers_h3, "enable_speed_preset",
                        lambda pipe, config: applied.append((config.preset, config.flashinfer)))  # fmt: skip
    monkeypatch.setattr(module, "warm_up", lambda *args, **kwargs: None)
    record = {"ms": 1.0, "stages": {"forwards": 1.0}, "peak_gib": None, "forwards": 1, "forwards_timed": 1}
    monkeypatch.setattr(module, "request", lambda *args, **kwargs: dict(record))
    module.main(["--tiny", "--cases", "t2va_fast,t2va_fast_flashinfer", "--out", str(tmp_path / "r.json")])
    assert applied == [("fast", None), ("fast", True)]


def test_cache_profiles_run_one_per_process(tmp_path):
    mixed = run_script(SCRIPT, "--tiny", "--cases", "t2va_fast_first_block_cache,t2va_fast_taylorseer", "--out",
                       tmp_path / "r.json")  # fmt: skip
    assert mixed.returncode != 0 and "run each cache profile as its own --cases" in mixed.stderr
    out = tmp_path / "cache.json"
    cases = ("t2va_fast_taylorseer_lite", "t2va_fastest_taylorseer_lite")  # one cache, two presets: one process
    run = run_script(SCRIPT, "--tiny", "--cases", ",".join(cases), "--forwards", "8", "--no-warmup", "--no-compile",
                     "--out", out, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    for name, preset in zip(cases, ("fast", "fastest")):
        case = json.loads(out.read_text())["cases"][name]
        assert case["preset"] == preset and "TaylorSeerCacheConfig" in case["cache"]["config"]
        assert "audio_proj_out" in case["cache"]["config"]  # the lite form: both outputs extrapolated
        assert case["cache"]["last_request"].startswith("skipped ")


def test_quantized_build_refuses_the_bf16_cases_before_building(tmp_path):
    run = run_script(SCRIPT, "--tiny", "--dit-format", "quantized", "--cases", "t2va_exact,t2va_fast",
                     "--out", tmp_path / "r.json")  # fmt: skip
    assert run.returncode != 0 and "t2va_exact run(s) the bf16 model" in run.stderr
    assert "built the pipeline" not in run.stdout and not (tmp_path / "r.json").exists()


def test_quantized_build_runs_a_cache_profile_on_weights_the_preset_keeps(tmp_path):
    """--dit-format quantized (one 80 GB GPU): the text encoder and the DiT arrive in the preset's formats, and the
    preset keeps them instead of quantizing again; the cache profile's skipped steps are recorded."""
    out = tmp_path / "request.json"
    run = run_script(SCRIPT, "--tiny", "--dit-format", "quantized", "--cases", "t2va_fastest_taylorseer",
                     "--no-warmup", "--no-compile", "--out", out, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["shape"]["dit_format"] == "quantized" and data["notes"] == {}
    weights = data["cases"]["t2va_fastest_taylorseer"]["speed_preset"]["weights"]
    assert weights["text_encoder"] == "h3_w8a16 [already quantized: kept]"
    assert "already quantized: kept" in weights["transformer"], weights
    assert data["cases"]["t2va_fastest_taylorseer"]["cache"]


def test_each_case_records_the_cards_count_of_its_window(tmp_path, monkeypatch):
    """With a card sampler (CUDA), the build gets ``build_device_peak_gib`` and each case's record ``device_peak_gib``:
    the sampled peak over its warm-up and timed request, never below the allocator's reserved peak."""
    spec = importlib.util.spec_from_file_location("benchmarks_request", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "warm_up", lambda pipe, case, tiny, decode: None)

    def fake_request(pipe, case, *args, sampler=None, **kwargs):
        sampler.sample()
        return {"ms": 1.0, "stages": {"forwards": 1.0}, "peak_gib": 4.0, "peak_reserved_gib": 6.0, "forwards": 1,
                "forwards_timed": 1}  # fmt: skip

    monkeypatch.setattr(module, "request", fake_request)
    for card_gib, expected in ((9, 9.0), (5, 6.0)):
        sampler = module.DeviceMemorySampler(read=lambda: card_gib * 2**30, interval_s=0.2)
        monkeypatch.setattr(module, "card_sampler", lambda device: sampler)
        out = tmp_path / f"r{card_gib}.json"
        module.main(["--tiny", "--cases", "t2va_native", "--out", str(out)])
        data = json.loads(out.read_text())
        record = data["cases"]["t2va_native"]
        assert data["build_device_peak_gib"] == card_gib  # the build's own window
        assert record["device_peak_gib"] == expected
        assert ("lower bound" in record["device_peak_source"]) is (card_gib < 6)
