"""Plot the committed benchmark results: `python benchmarks/plot.py` -> benchmarks/results/summary.png.

Reads end_to_end_h200.json, attention_h200.json and gemm_h200.json (one H200, same-run baselines) and draws one panel per suite: time per case with the baseline marked, and the speed-up over it. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _load(name):
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def _bars(ax, title, labels, values, ratios, unit):
    colors = ["#888888" if r == 1.0 else ("#2a9d8f" if r > 1.0 else "#e76f51") for r in ratios]
    ax.barh(labels, values, color=colors)
    for y, (value, ratio) in enumerate(zip(values, ratios)):
        ax.text(value, y, f"  {value:.3g} {unit} ({ratio:.2f}x)", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_title(title, fontsize=10)
    ax.set_xlim(0, max(values) * 1.45)
    ax.tick_params(labelsize=8)


def main():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(RESULTS / "summary.png"))
    args = parser.parse_args()

    e2e, attention, gemm = _load("end_to_end_h200.json"), _load("attention_h200.json"), _load("gemm_h200.json")
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    if e2e:
        cases = dict(e2e["cases"])
        _bars(axes[0], f"Full 50-block DiT forward, {e2e['shape']['rows']:,} rows ({e2e['device']}, {e2e['commit']})",
              list(cases), [c["ms"] / 1000 for c in cases.values()], [c["ratio"] for c in cases.values()], "s")  # fmt: skip
    if attention:
        cases = {k: v for k, v in attention["cases"].items() if v.get("ms") and "fine_only" not in k}
        _bars(axes[1], f"Attention core, 56x128 heads ({attention['device']}, {attention['commit']})",
              list(cases), [c["ms"] for c in cases.values()], [c["ratio"] for c in cases.values()], "ms")  # fmt: skip
    if gemm:
        cases = {k: v for k, v in gemm["cases"].items() if v.get("ms") and "_fused_" not in k and k.endswith("ffn_up")}
        _bars(axes[2], f"FFN up GEMM, M=38,222 ({gemm['device']}, {gemm['commit']})",
              list(cases), [c["ms"] for c in cases.values()], [c["ratio"] for c in cases.values()], "ms")  # fmt: skip
    fig.suptitle("diffusers-h3 on one H200 vs diffusers native (grey = baseline; green faster, red slower)", fontsize=11)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
