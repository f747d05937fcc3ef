"""`diffusers-h3 compare` and `diffusers-h3 fidelity`: end to end on MP4 files and on the embedded tiny demo
checkpoint, their exit codes (0 pass, 1 a gate or a case failed, 2 a usage error before anything loads)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from diffusers_h3 import export_to_video
from diffusers_h3.cli import main


def _clip(path, brightness=1.0, frames=24):
    yy, xx = np.meshgrid(np.linspace(0, 1, 64), np.linspace(0, 1, 96), indexing="ij")
    picture = np.stack([yy, xx, 0.5 * (yy + xx)], axis=-1)
    video = np.stack([picture * brightness * (0.5 + 0.5 * i / frames) for i in range(frames)]).astype(np.float32)
    t = np.arange(int(32000 * frames / 24)) / 32000
    audio = np.stack([0.3 * np.sin(2 * np.pi * 440 * t), 0.3 * np.sin(2 * np.pi * 660 * t)]).astype(np.float32)
    return export_to_video(video[None], path, fps=24, audio=audio[None], sampling_rate=32000)


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clips")
    return {"a": _clip(folder / "a.mp4"), "same": _clip(folder / "same.mp4"),
            "darker": _clip(folder / "darker.mp4", brightness=0.8), "short": _clip(folder / "short.mp4", frames=12)}


def test_compare_prints_one_line_per_metric(clips, capsys):
    assert main(["compare", clips["a"], clips["darker"]]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == ["frames", "psnr_y", "ssim_y", "psnr_yuv420", "ssim_yuv420", "lpips",
                                                 "audio_cosine", "audio_si_sdr", "audio_corr", "rms_ratio",
                                                 "gate", "gate"]  # fmt: skip (the two default audio gates)
    assert re.match(r"psnr_y +mean \d+\.\d\d dB, worst \d+\.\d\d dB \(frame \d+\), drift -?\d+\.\d\d dB/s", out[1])


def test_compare_json_and_gates(clips, capsys):
    assert main(["compare", clips["a"], clips["same"], "--json", "--min-ssim", "0.999", "--min-audio-cosine",
                 "0.99"]) == 0  # fmt: skip
    record = json.loads(capsys.readouterr().out)
    assert record["psnr_y"]["mean"] == "inf" and record["identical_video"] is True
    assert all(gate["passed"] for gate in record["gates"].values()) and len(record["gates"]) == 4  # + 2 default
    # The darker clip is far below SSIM 0.999: exit status 1, the failing gate named.
    assert main(["compare", clips["a"], clips["darker"], "--min-ssim", "0.999", "--rms-ratio-range", "0.9,1.1"]) == 1
    out = capsys.readouterr().out
    assert "gate min_ssim 0.999: FAIL" in out and "gate rms_ratio_range [0.9, 1.1]: pass" in out
    # LPIPS without its weights: the gate fails and says why rather than passing unchecked.
    assert main(["compare", clips["a"], clips["same"], "--max-lpips", "0.2"]) == (0 if _lpips_local() else 1)


def _lpips_local():
    from diffusers_h3.fidelity.metrics import lpips_unavailable_reason

    return lpips_unavailable_reason() is None


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["compare", "{a}", "{missing}"], "candidate {missing}: no such file"),
        (["compare", "{a}", "{short}"], "the clips have 24 and 12 frames"),
        (["fidelity", "--prompts", "{missing}"], "--prompts {missing}: no such file"),
        (["fidelity", "--prompts", "{prompts}", "--seeds", "0,x"], "--seeds entry must be an integer"),
        (["fidelity", "--prompts", "{prompts}", "--cases", "fast,turbo"], "unknown case(s) turbo"),
        (["fidelity", "--prompts", "{empty}"], "holds no prompt"),
        (["fidelity", "--prompts", "{prompts}", "--out", "{a}"], "is a file"),
        (["fidelity", "--prompts", "{prompts}", "--rms-ratio-range", "1.2,0.8"], "LOW 1.2 is above HIGH 0.8"),
        (["fidelity", "--prompts", "{prompts}", "--min-ssim", "1.5"], "--min-ssim must be in [-1, 1]"),
    ],
)
def test_usage_errors_exit_2_before_loading(argv, expected, clips, tmp_path, capsys):
    names = {**clips, "missing": str(tmp_path / "nope.mp4"), "prompts": tmp_path / "p.txt", "empty": tmp_path / "e.txt"}
    (tmp_path / "p.txt").write_text("a cat\n")
    (tmp_path / "e.txt").write_text("# only a comment\n\n")
    argv = [a.format(**names) for a in argv]
    with pytest.raises(SystemExit) as raised:
        main(argv)
    assert raised.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("diffusers-h3: error: ") and expected.format(**names) in err[0]


def test_fidelity_on_the_demo_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# one prompt\na cat playing the piano\n")
    out = tmp_path / "run"
    argv = ["fidelity", "--prompts", str(prompts), "--seeds", "1", "--against", "exact", "--cases", "fast", "--steps",
            "2", "--out", str(out), "--device", "cpu", "--no-progress"]  # fmt: skip
    assert main([*argv, "--min-ssim", "0.5"]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"fast +ok .* SSIM [01]\.\d{4}  PSNR dB \d+\.\d\d", printed), printed
    assert "pass" in printed.splitlines()[-1]
    report = json.loads((out / "fidelity.json").read_text())
    assert report["cases"]["exact"]["status"] == "reference" and report["cases"]["fast"]["passed"] is True
    assert "random weights" in report["note"] and report["settings"]["num_frames"] == 124
    ssim = report["cases"]["fast"]["summary"]["ssim_yuv420"]
    assert 0.5 < ssim < 1.0  # W8A16 weights and INT8 attention on the CPU move the clip, a little
    assert report["cases"]["fast"]["summary"]["psnr_yuv420"] != "inf"
    for source in re.findall(r"<img src='([^']+)'", (out / "index.html").read_text()):
        assert (out / source).is_file()
    # Again with a gate the case misses: the clips are reused (nothing loads) and the exit status is 1.
    monkeypatch.setattr("diffusers_h3.cli._load_pipeline", lambda args: pytest.fail("a clip was generated again"))
    assert main([*argv, "--min-ssim", "1"]) == 1
    assert "FAILED min_ssim" in capsys.readouterr().out


def test_fidelity_text_encoder_first_writes_the_same_clips(tmp_path, monkeypatch, capsys):
    """--text-encoder-first loads the text encoder alone, then the rest without it (never both): the report's
    distances are those of the run that loads the whole pipeline."""
    import diffusers_h3.cli as cli

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat playing the piano\n")
    loaded, load_pipeline = [], cli._load_pipeline

    def recording(args):
        pipe = load_pipeline(args)
        loaded.append((getattr(pipe, "text_encoder", None) is not None, getattr(pipe, "transformer", None) is not None))
        return pipe

    monkeypatch.setattr(cli, "_load_pipeline", recording)
    summaries = {}
    for flags in ((), ("--text-encoder-first",)):
        loaded.clear()
        out = tmp_path / f"run{len(flags)}"
        argv = ["fidelity", "--prompts", str(prompts), "--cases", "fast", "--steps", "2", "--frames", "22",
                "--out", str(out), "--device", "cpu", "--no-progress", "--thumbnail-width", "16", *flags]  # fmt: skip
        assert main(argv) == 0, capsys.readouterr()
        report = json.loads((out / "fidelity.json").read_text())
        summaries[flags] = report["cases"]["fast"]["summary"]
        expected = [(True, True)] * 2 if not flags else [(True, False), (False, True)] * 2
        assert loaded == expected  # exact, then fast; with the option text encoder and DiT never loaded together
        assert report["settings"]["text_encoder_first"] is bool(flags)
    assert summaries[()] == summaries[("--text-encoder-first",)] and summaries[()]["psnr_yuv420"] != "inf"


_WITHOUT_TORCH = """
import sys
import diffusers_h3_launcher
for argv in (["compare", "--help"], ["fidelity", "--help"], ["compare", "a.mp4", "b.mp4"],
             ["fidelity", "--prompts", "missing.txt"], ["fidelity", "--prompts", "p.txt", "--cases", "turbo"],
             ["fidelity", "--prompts", "p.txt", "--seeds", "-1"]):
    try:
        diffusers_h3_launcher.main(argv)
    except SystemExit as stop:
        print("EXIT", argv[-1], stop.code)
print("HEAVY", sorted(name for name in ("torch", "diffusers", "numpy", "PIL", "diffusers_h3") if name in sys.modules))
"""


def test_help_and_usage_errors_import_no_torch(tmp_path):
    # The console entry point answers --help and the mistakes the arguments alone show before importing anything heavy.
    root = str(Path(__file__).resolve().parents[1])
    (tmp_path / "p.txt").write_text("a cat\n")
    result = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": root})  # fmt: skip
    out = result.stdout
    assert "EXIT --help 0" in out and "HEAVY []" in out, out + result.stderr
    for last in ("b.mp4", "missing.txt", "turbo", "-1"):
        assert f"EXIT {last} 2" in out, out
    assert "--min-audio-cosine" in out and "first_block_cache" in out


@pytest.fixture(scope="module")
def demo_clips(tmp_path_factory):
    """Two clips of the demo checkpoint that differ only in the seed, and a second render of the first (the same
    bytes: the CPU float32 pipeline is deterministic)."""
    import torch

    from diffusers_h3 import MiniMaxH3Pipeline
    from diffusers_h3.testing.tiny import demo_checkpoint_dir

    folder = tmp_path_factory.mktemp("demo")
    pipe = MiniMaxH3Pipeline.from_pretrained(demo_checkpoint_dir(folder / "cache"))
    pipe.set_progress_bar_config(disable=True)
    paths = {}
    for name, seed in (("seed0", 0), ("seed0_again", 0), ("seed1", 1)):
        out = pipe(prompt="a street drummer under neon lights, rain on the pavement", num_inference_steps=4,
                   output_type="latent", generator=torch.Generator().manual_seed(seed))  # fmt: skip
        paths[name] = str(pipe.decode_to_video(out.frames, out.audio, folder / f"{name}.mp4", crf=0))
    return paths


def test_another_seed_fails_the_default_audio_gates_and_the_same_clip_passes(demo_clips, capsys):
    # The same clip: every default gate passes (SI-SDR infinite, correlation 1).
    assert main(["compare", demo_clips["seed0"], demo_clips["seed0_again"], "--json"]) == 0
    same = json.loads(capsys.readouterr().out)
    assert set(same["gates"]) == {"min_audio_si_sdr", "min_audio_correlation"}
    assert same["audio"]["si_sdr_db"] == "inf" and same["audio"]["correlation"] == pytest.approx(1.0)
    # Another seed: the spectral cosine barely moves, SI-SDR and correlation fail the default gates (exit status 1).
    assert main(["compare", demo_clips["seed0"], demo_clips["seed1"], "--json"]) == 1
    other = json.loads(capsys.readouterr().out)
    audio, gates = other["audio"], other["gates"]
    assert audio["spectral_cosine"] > 0.95  # what did not separate the two
    # the demo's random weights make seeds sound alike: still below 20 dB / 0.995, where the fast presets are above
    assert audio["si_sdr_db"] < 20.0 and audio["correlation"] < 0.995
    assert not gates["min_audio_si_sdr"]["passed"] and not gates["min_audio_correlation"]["passed"]
    # The text output names the failing gates; `off` turns a default gate off.
    assert main(["compare", demo_clips["seed0"], demo_clips["seed1"], "--min-audio-si-sdr", "off",
                 "--min-audio-correlation", "off"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "audio_si_sdr" in out and "audio_corr" in out and "gate " not in out


def test_default_audio_gates_do_not_apply_to_clips_without_audio(tmp_path, capsys):
    yy, xx = np.meshgrid(np.linspace(0, 1, 64), np.linspace(0, 1, 96), indexing="ij")
    video = np.stack([np.stack([yy, xx, 0.5 * (yy + xx)], axis=-1)] * 24).astype(np.float32)
    a = export_to_video(video[None], tmp_path / "a.mp4", fps=24)
    assert main(["compare", a, a]) == 0
    assert "not applicable: neither clip has an audio track" in capsys.readouterr().out


def test_cli_default_gates_are_the_library_defaults():
    from diffusers_h3 import cli
    from diffusers_h3.fidelity import run

    assert (cli.DEFAULT_MIN_AUDIO_SI_SDR, cli.DEFAULT_MIN_AUDIO_CORRELATION) == (
        run.DEFAULT_MIN_AUDIO_SI_SDR, run.DEFAULT_MIN_AUDIO_CORRELATION)
