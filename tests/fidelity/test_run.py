"""Fidelity runs on the tiny pipeline (22 frames, 2 sigma points): the report's schema, the gates, resuming, a failing
case, and the page's pictures."""

import json
import re

import pytest
import torch

from diffusers_h3 import MiniMaxH3Pipeline
from diffusers_h3.fidelity import FidelityRunError, FidelitySettings, Gates, evaluate_gates, run_fidelity
from diffusers_h3.fidelity.cases import FIDELITY_CASES
from diffusers_h3.testing.tiny import TINY_NUM_FRAMES, tiny_pipeline


def _settings(**overrides):
    values = {"prompts": ["a cat", "a drum"], "seeds": [3], "cases": ["native"], "against": "exact", "height": 64,
              "width": 96, "num_frames": TINY_NUM_FRAMES, "steps": 2, "compile": False, "model": "tiny"}
    return FidelitySettings(**{**values, **overrides})


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """One run: `native` against `exact` for two prompts, and `first_block_cache`, whose loading fails."""
    out = tmp_path_factory.mktemp("fidelity")
    saved = out.parent / f"{out.name}_tiny"
    tiny_pipeline(seed=0).save_pretrained(saved)
    calls = []

    def load(case):
        calls.append(case.name)
        if case.name == "first_block_cache":
            raise RuntimeError("CUDA out of memory (simulated)")
        return MiniMaxH3Pipeline.from_pretrained(saved)  # a fresh pipeline per case, as the CLI loads one

    settings = _settings(cases=["native", "first_block_cache"])
    report = run_fidelity(load, settings, out, gates=Gates(min_ssim=0.99, min_audio_cosine=0.99), progress=False,
                          note="random weights")  # fmt: skip
    return out, report, calls, load


def test_report_schema_and_values(first_run):
    out, report, calls, _ = first_run
    assert calls == ["exact", "native", "first_block_cache"]  # the reference first, each case loaded once
    assert json.loads((out / "fidelity.json").read_text()) == report
    assert report["schema"] == "diffusers-h3-fidelity/1" and report["note"] == "random weights"
    assert set(report) == {"schema", "note", "settings", "gates", "environment", "cases", "passed", "html"}
    assert set(report["cases"]["native"]) == {"description", "status", "error", "applied", "speed", "summary", "clips",
                                              "gates", "passed"}
    assert report["settings"]["prompts"] == ["a cat", "a drum"]
    assert report["gates"] == {"min_ssim": 0.99, "min_audio_cosine": 0.99, "min_audio_si_sdr": 20.0,
                               "min_audio_correlation": 0.995}  # the two default audio gates
    exact, native = report["cases"]["exact"], report["cases"]["native"]
    assert exact["status"] == "reference" and "summary" not in exact and exact["speed"]["seconds"] > 0
    assert native["status"] == "ok" and native["error"] is None and len(native["clips"]) == 2
    clip = native["clips"][0]
    assert (clip["prompt_index"], clip["seed"], clip["file"]) == (0, 3, "clips/native/p0_s3.mp4")
    # On the CPU in float32 the exact preset changes nothing: the same frames and sound.
    assert clip["metrics"]["identical_video"] and clip["summary"]["psnr_y"] == "inf"
    assert clip["summary"]["ssim_yuv420"] == pytest.approx(1.0)
    assert len(clip["metrics"]["ssim_y"]["per_frame"]) == TINY_NUM_FRAMES
    # Written lossless (crf 0): the distance is the path's, not the encoder's.
    assert json.loads((out / "clips" / "native" / "p0_s3.json").read_text())["export"]["crf"] == 0
    assert native["summary"]["audio_cosine"] == pytest.approx(1.0) and native["summary"]["rms_ratio"] == 1.0
    assert native["gates"]["min_ssim"] == {"metric": "ssim_yuv420", "threshold": 0.99,
                                           "value": native["summary"]["ssim_yuv420"], "passed": True}
    assert native["passed"] is True
    assert native["applied"] == ["nothing: the pipeline as loaded"] and clip["generation"]["seed"] == 3
    assert exact["applied"][0].startswith("speed preset exact: ") and clip["generation"]["cache"] is None
    assert native["speed"]["per_clip_s"] and native["speed"]["speedup_vs_reference"] > 0
    # A case that fails is recorded, and the run is not a pass.
    failed = report["cases"]["first_block_cache"]
    assert failed["status"] == "failed" and "CUDA out of memory (simulated)" in failed["error"]
    assert failed["passed"] is False and failed["clips"] == [] and report["passed"] is False


def test_page_references_pictures_that_exist(first_run):
    out, report, _, _ = first_run
    page = (out / "index.html").read_text()
    sources = re.findall(r"<img src='([^']+)'", page)
    assert len(sources) == 2 * 3  # two clips: frame strip, PSNR/SSIM plot, spectrograms
    for source in sources:
        assert (out / source).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "random weights" in page and "CUDA out of memory (simulated)" in page


def test_resumed_run_reuses_the_clips(first_run):
    out, report, calls, load = first_run
    calls.clear()
    again = run_fidelity(load, _settings(cases=["native", "first_block_cache"]), out, progress=False, html=False)
    assert calls == ["first_block_cache"]  # only the case without its clips runs again
    assert again["cases"]["native"]["summary"] == report["cases"]["native"]["summary"]
    with pytest.raises(FidelityRunError, match="other settings \\(steps differ\\)"):
        run_fidelity(load, _settings(steps=3), out, progress=False)


def test_gates():
    summary = {"ssim_yuv420": 0.93, "psnr_yuv420": 28.2, "audio_cosine": 0.85, "lpips": None, "rms_ratio": 1.3,
               "rms_ratio_range": [0.95, 1.3]}  # fmt: skip
    results = evaluate_gates(summary, Gates(min_ssim=0.93, min_psnr=30.0, min_audio_cosine=0.8, max_lpips=0.2,
                                            rms_ratio_range=(0.8, 1.25), min_audio_si_sdr=None,
                                            min_audio_correlation=None))  # fmt: skip
    assert {name: r["passed"] for name, r in results.items()} == {
        "min_ssim": True, "min_psnr": False, "min_audio_cosine": True, "max_lpips": False, "rms_ratio_range": False}
    assert "not computed" in results["max_lpips"]["reason"]  # a metric that is missing fails its gate
    assert evaluate_gates(summary, Gates.none()) == {}
    # Each gate's direction: a maximum passes below its threshold, a minimum above it, a range inside it.
    for lpips, passed in ((0.1, True), (0.2, True), (0.3, False)):
        assert evaluate_gates({**summary, "lpips": lpips}, Gates(max_lpips=0.2))["max_lpips"]["passed"] is passed
    for ssim, passed in ((0.92, False), (0.93, True), (0.99, True)):
        assert evaluate_gates({**summary, "ssim_yuv420": ssim}, Gates(min_ssim=0.93))["min_ssim"]["passed"] is passed
    inside = evaluate_gates({**summary, "rms_ratio_range": [0.81, 1.2]}, Gates(rms_ratio_range=(0.8, 1.25)))
    below = evaluate_gates({**summary, "rms_ratio_range": [0.79, 1.0]}, Gates(rms_ratio_range=(0.8, 1.25)))
    assert inside["rms_ratio_range"]["passed"] and not below["rms_ratio_range"]["passed"]


def test_default_audio_gates():
    """On by default: SI-SDR >= 20 dB and correlation >= 0.995 of the worst clip; a summary without them fails, one
    where neither clip had audio passes as not applicable."""
    assert Gates().active() == {"min_audio_si_sdr": 20.0, "min_audio_correlation": 0.995}
    for si_sdr, corr, passed in ((19.9, 0.999, (False, True)), (20.0, 0.995, (True, True)), (35.0, 0.99, (True, False)),
                                 (float("inf"), 1.0, (True, True))):  # fmt: skip
        results = evaluate_gates({"audio_si_sdr_db": si_sdr, "audio_correlation": corr}, Gates())
        assert (results["min_audio_si_sdr"]["passed"], results["min_audio_correlation"]["passed"]) == passed
    missing = evaluate_gates({"audio_si_sdr_db": None, "audio_correlation": None}, Gates())
    assert not missing["min_audio_si_sdr"]["passed"] and "not computed" in missing["min_audio_si_sdr"]["reason"]
    silent = evaluate_gates({"no_audio": True}, Gates(min_audio_cosine=0.9))
    assert all(r["passed"] and r["reason"].startswith("not applicable") for r in silent.values()) and len(silent) == 3


def test_case_names_match_the_cli():
    from diffusers_h3.cli import FIDELITY_CASE_CHOICES

    assert FIDELITY_CASE_CHOICES == tuple(FIDELITY_CASES)


def test_speed_leaves_out_the_first_clip_of_a_case(tmp_path):
    from diffusers_h3.fidelity.run import _speed

    folder = tmp_path / "clips" / "fast"
    folder.mkdir(parents=True)
    for (index, seed), seconds in zip([(0, 0), (0, 1), (1, 0)], (90.0, 2.0, 4.0)):  # the first one compiled
        (folder / f"p{index}_s{seed}.json").write_text(json.dumps({"seconds": seconds}))
    speed = _speed(tmp_path, "fast", [(0, 0), (0, 1), (1, 0)])
    assert speed == {"seconds": 3.0, "per_clip_s": [90.0, 2.0, 4.0], "includes_warmup": False}
    single = _speed(tmp_path, "fast", [(0, 0)])
    assert single["seconds"] == 90.0 and single["includes_warmup"] is True
    assert _speed(tmp_path, "exact", [(0, 0)])["seconds"] is None


@pytest.mark.parametrize("name", ["fast_first_block_cache", "fast_taylorseer", "fastest_first_block_cache",
                                  "fastest_taylorseer", "fast_taylorseer_lite", "fastest_taylorseer_lite"])  # fmt: skip
def test_cache_profiles_run_their_cache_under_their_preset(name):
    """Each cache profile: its step cache and its speed preset on one pipeline; TaylorSeer skips steps on a fixed
    interval (from the 3rd step on, 4 of every 5), so a 9-point request skips some; the preset records the weights."""
    from diffusers_h3 import describe
    from diffusers_h3.fidelity import apply_case, get_case
    from diffusers_h3.hooks.cache import cache_stats

    case = get_case(name)
    pipe = tiny_pipeline(seed=0, with_transformer_ref=False)
    pipe.set_progress_bar_config(disable=True)
    applied = apply_case(pipe, case, compile=False)
    assert applied[0] == f"step cache: {case.cache}" and applied[1].startswith(f"speed preset {case.speed}: ")
    out = pipe(prompt="a cat", height=64, width=96, num_frames=TINY_NUM_FRAMES, num_inference_steps=9,
               output_type="latent", generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert torch.isfinite(out.frames).all()
    stats = cache_stats(pipe.transformer)
    assert stats.forwards == 8
    if case.cache.startswith("taylorseer"):
        assert len(stats.skipped_steps) > 0
    report = describe(pipe)
    assert report["speed_preset"]["preset"] == case.speed


def test_text_encoder_first_writes_the_clips_the_whole_pipeline_writes(tmp_path):
    """`load_text_encoder`: each case's prompts are encoded by a pipeline without DiT, in the text-encoder weights
    the case runs (`fast` quantizes it to W8A16, `low_ram` names W8A16, `exact` keeps it), and the clips come from a
    pipeline without text encoder: the same frames and sound as the whole pipeline's, case by case."""
    from diffusers_h3.fidelity.clips import read_clip
    from diffusers_h3.quantizers import quantized_weight

    saved = tmp_path / "tiny"
    tiny_pipeline(seed=0).save_pretrained(saved)
    encoders, dits = [], []

    def load_text_encoder(case):
        pipe = MiniMaxH3Pipeline.from_pretrained(saved, transformer=None, transformer_ref=None)
        encoders.append((case.name, pipe))
        return pipe

    def load_without_text_encoder(case):
        pipe = MiniMaxH3Pipeline.from_pretrained(saved, text_encoder=None, tokenizer=None, processor=None)
        dits.append(case.name)
        return pipe

    settings = _settings(cases=["fast", "low_ram"], prompts=["a cat"])
    whole = run_fidelity(lambda case: MiniMaxH3Pipeline.from_pretrained(saved), settings, tmp_path / "whole",
                         progress=False, html=False)  # fmt: skip
    staged = run_fidelity(load_without_text_encoder, settings, tmp_path / "staged", progress=False, html=False,
                          load_text_encoder=load_text_encoder)  # fmt: skip
    assert [name for name, _ in encoders] == dits == ["exact", "fast", "low_ram"]
    quantized = {name: any(quantized_weight(m) is not None for m in pipe.text_encoder.modules())
                 for name, pipe in encoders}  # fmt: skip
    assert quantized == {"exact": False, "fast": True, "low_ram": True}
    assert staged["settings"]["text_encoder_first"] is True and whole["settings"]["text_encoder_first"] is False
    assert "prompts encoded before the DiT loaded" in staged["cases"]["fast"]["applied"][-1]
    assert staged["cases"]["fast"]["clips"][0]["generation"]["prompt_encoded_before"] is True
    assert whole["cases"]["fast"]["clips"][0]["generation"]["prompt_encoded_before"] is False
    for case in ("exact", "fast", "low_ram"):
        a = read_clip(tmp_path / "whole" / "clips" / case / "p0_s3.mp4")
        b = read_clip(tmp_path / "staged" / "clips" / case / "p0_s3.mp4")
        assert all(torch.equal(torch.as_tensor(x), torch.as_tensor(y)) for x, y in zip(a.planes, b.planes)), case
        assert torch.equal(torch.as_tensor(a.audio), torch.as_tensor(b.audio)), case
    # `fast` differs from `exact` (its quantized text encoder and DiT), so the equality above is not trivial.
    assert whole["cases"]["fast"]["summary"]["psnr_yuv420"] != "inf"
    assert staged["cases"]["fast"]["summary"] == whole["cases"]["fast"]["summary"]


def test_text_encoder_first_needs_a_pipeline_without_text_encoder(tmp_path):
    saved = tmp_path / "tiny"
    tiny_pipeline(seed=0).save_pretrained(saved)
    report = run_fidelity(lambda case: MiniMaxH3Pipeline.from_pretrained(saved), _settings(cases=[]),
                          tmp_path / "out", progress=False, html=False,
                          load_text_encoder=lambda case: MiniMaxH3Pipeline.from_pretrained(saved, transformer=None))  # fmt: skip
    assert report["cases"]["exact"]["status"] == "failed"
    assert "load_pipeline must return a pipeline without text encoder" in report["cases"]["exact"]["error"]
