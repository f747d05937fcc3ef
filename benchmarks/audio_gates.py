"""Does an audio measure tell a faster path from a different clip? On the embedded demo checkpoint (CPU, float32):
the `fast` and `fastest` presets against `exact` on the same seed, and `exact` on another seed against `exact`, each
with every audio metric of `diffusers_h3.fidelity` (log-mel cosine, SI-SDR, waveform correlation, RMS ratio) and the
default gates (docs/fidelity.md, "Why two audio gates are on by default").

    python benchmarks/audio_gates.py --out benchmarks/results/audio_gates_cpu.json

The demo has random weights: the numbers are distances between paths, not quality.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from _common import result_header, write_json


PROMPT = "a street drummer under neon lights, rain on the pavement"
AUDIO_KEYS = ("spectral_cosine", "si_sdr_db", "si_sdr_db_per_channel", "correlation", "correlation_per_channel",
              "rms_ratio")  # fmt: skip


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=4, help="sigma points (default: %(default)s)")
    parser.add_argument("--work", default=None, help="folder for the clips (default: a temporary one)")
    parser.add_argument("--commit", default=None)
    args = parser.parse_args(argv)

    from diffusers_h3 import MiniMaxH3Pipeline
    from diffusers_h3.fidelity import FidelitySettings, Gates, compare_clips, evaluate_gates, json_ready, run_fidelity
    from diffusers_h3.testing.tiny import demo_checkpoint_dir

    work = Path(args.work or tempfile.mkdtemp(prefix="audio_gates_"))
    checkpoint = demo_checkpoint_dir(work / "cache")
    settings = FidelitySettings(prompts=[PROMPT], seeds=[0, 1], cases=["fast", "fastest"], against="exact",
                                num_frames=124, steps=args.steps, compile=False,
                                model="tiny demo checkpoint")  # fmt: skip
    report = run_fidelity(lambda case: MiniMaxH3Pipeline.from_pretrained(checkpoint), settings, work / "run",
                          progress=sys.stderr.isatty(), html=False)  # fmt: skip
    rows = {}
    failed = {n: c["error"] for n, c in report["cases"].items() if c.get("error")}
    if failed:
        raise SystemExit(f"cases failed: {failed}")
    for case in ("fast", "fastest"):
        clip = next(c for c in report["cases"][case]["clips"] if c["seed"] == 0)
        rows[f"{case} vs exact, seed 0"] = {k: clip["metrics"]["audio"][k] for k in AUDIO_KEYS}
    other = compare_clips(work / "run/clips/exact/p0_s0.mp4", work / "run/clips/exact/p0_s1.mp4", lpips=False)
    rows["exact seed 1 vs exact seed 0"] = {k: other["audio"][k] for k in AUDIO_KEYS}
    gates = Gates()
    for row in rows.values():
        summary = {"audio_si_sdr_db": row["si_sdr_db"], "audio_correlation": row["correlation"]}
        row["default_gates_passed"] = all(g["passed"] for g in evaluate_gates(summary, gates).values())
    data = {**result_header("audio_gates", commit=args.commit, device="cpu"),
            "choices": {"checkpoint": "embedded tiny demo (random weights)", "prompt": PROMPT, "steps": args.steps,
                        "canvas": "the demo's default, 64x96", "frames": 124, "compile": False, "crf": 0},
            "default_gates": gates.active(), "rows": rows}  # fmt: skip
    write_json(args.out, json_ready(data))
    for name, row in rows.items():
        print(f"{name:30s} cosine {row['spectral_cosine']:.4f}  SI-SDR {row['si_sdr_db']:.2f} dB  "
              f"corr {row['correlation']:.4f}  default gates {'pass' if row['default_gates_passed'] else 'FAIL'}")


if __name__ == "__main__":
    main()
