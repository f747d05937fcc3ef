"""Draw the summary plot from the committed results: ``python benchmarks/plot.py`` -> benchmarks/results/summary.png.

Reads end_to_end_h200.json, attention_h200.json and gemm_h200.json and draws one panel per suite: time per case
(same-run baseline in grey) and the speed-up over the baseline; when request_h200.json exists, one more panel with the
whole request per case as a stacked bar of its stages (``stage_table``). Every number on the plot comes from those
files; ``main`` returns the table of the per-suite panels. Needs matplotlib (``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Dict, List, Optional, Tuple


RESULTS = Path(__file__).resolve().parent / "results"

# (results file, panel title, unit, case filter, ms -> unit)
PANELS = [
    ("end_to_end_h200.json", "Full 50-block DiT forward, {rows:,} rows", "s", lambda name, case: True, 1e-3),
    ("attention_h200.json", "Attention core, {heads}x{head_dim} heads, {rows:,} rows", "ms",
     lambda name, case: "fine_only" not in name, 1.0),
    ("gemm_h200.json", "FFN up GEMM, M={M:,}", "ms", lambda name, case: "_fused_" not in name and name.endswith("ffn_up"), 1.0),
]  # fmt: skip


def summary_table(results_dir=RESULTS) -> Dict[str, dict]:
    """``{file: {"title", "unit", "rows": [(case, value in unit, ratio)]}}`` for every panel whose file exists;
    cases without a time (not measured) are left out."""
    table = {}
    for file, title, unit, keep, scale in PANELS:
        path = Path(results_dir) / file
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        rows: List[Tuple[str, float, Optional[float]]] = [
            (name, case["ms"] * scale, case.get("ratio"))
            for name, case in data["cases"].items()
            if case.get("ms") is not None and keep(name, case)
        ]
        shape = {**data.get("shape", {})}
        table[file] = {
            "title": f"{title.format(**shape)} ({data['device']}, {data['commit']})",
            "unit": unit,
            "rows": rows,
        }
    return table


REQUEST_FILE = "request_h200.json"
STAGE_COLORS = {"text_encode": "#264653", "condition_encode": "#8ab17d", "forwards": "#2a9d8f",
                "video_decode": "#e9c46a", "audio_decode": "#f4a261", "mux": "#e76f51",
                "other": "#bbbbbb"}  # fmt: skip


def stage_table(results_dir=RESULTS) -> Optional[dict]:
    """``{"title", "rows": [(case, {stage: seconds}, whole request seconds, extrapolated)]}`` from request_h200.json,
    or ``None`` when the file is absent; cases that did not run are left out."""
    path = Path(results_dir) / REQUEST_FILE
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    rows = [
        (name, {stage: ms * 1e-3 for stage, ms in case["stages"].items()}, case["ms"] * 1e-3, case.get("extrapolated"))
        for name, case in data["cases"].items()
        if case.get("ms") is not None and case.get("stages")
    ]
    shape = data.get("shape", {})
    size = f"{shape.get('height')}x{shape.get('width')}x{shape.get('frames')}"
    title = f"Whole request, {size} ({data['device']}, {data['commit']})"
    return {"title": title, "rows": rows}


def _stacked(ax, title, rows):
    labels = [name for name, _, _, _ in rows]
    for y, (_, stages, total, extrapolated) in enumerate(rows):
        left = 0.0
        for stage, seconds in stages.items():
            ax.barh(y, seconds, left=left, color=STAGE_COLORS.get(stage, "#999999"),
                    label=stage if y == 0 or stage not in rows[0][1] else None)  # fmt: skip
            left += seconds
        ax.text(total, y, f"  {total:.3g} s" + (" (extrapolated)" if extrapolated else ""), va="center", fontsize=8)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_title(title, fontsize=10)
    ax.set_xlim(0, max(total for _, _, total, _ in rows) * 1.45 if rows else 1)
    ax.tick_params(labelsize=8)
    ax.legend(fontsize=7, loc="lower right")


def _bars(ax, title, rows, unit):
    labels = [name for name, _, _ in rows]
    values = [value for _, value, _ in rows]
    ratios = [ratio for _, _, ratio in rows]
    colors = ["#888888" if r == 1.0 else ("#2a9d8f" if (r or 0) > 1.0 else "#e76f51") for r in ratios]
    ax.barh(labels, values, color=colors)
    for y, (value, ratio) in enumerate(zip(values, ratios)):
        speed = f" ({ratio:.2f}x)" if ratio is not None else ""
        ax.text(value, y, f"  {value:.3g} {unit}{speed}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_title(title, fontsize=10)
    ax.set_xlim(0, max(values) * 1.45)
    ax.tick_params(labelsize=8)


def main(argv=None) -> Dict[str, dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", default=str(RESULTS), help="folder holding the results JSON files")
    parser.add_argument("--out", default=None, help="PNG to write (default: <results>/summary.png)")
    args = parser.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = summary_table(args.results)
    stages = stage_table(args.results)
    if not table and not stages:
        raise SystemExit(f"no results JSON found in {args.results}")
    panels = len(table) + (stages is not None)
    fig, axes = plt.subplots(1, panels, figsize=(5.7 * panels, 4.8), squeeze=False)
    for ax, panel in zip(axes[0], table.values()):
        _bars(ax, panel["title"], panel["rows"], panel["unit"])
    if stages is not None:
        _stacked(axes[0][-1], stages["title"], stages["rows"])
    fig.suptitle("diffusers-h3 vs diffusers native, same-run baselines (grey = baseline; green faster, red slower)",
                 fontsize=11)  # fmt: skip
    fig.tight_layout()
    out = args.out or str(Path(args.results) / "summary.png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"wrote {out}")
    return table


if __name__ == "__main__":
    main()
