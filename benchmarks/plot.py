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
                "video_decode": "#e9c46a", "audio_decode": "#f4a261", "mux": "#e76f51", "video_decode+mux": "#e9a04a",
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


SCALING_FILE = "multi_gpu_model_h200.json"


def scaling_table(results_dir=RESULTS, file: str = SCALING_FILE) -> Optional[dict]:
    """``{"title", "rows": [(preset, degree, per-rank block ms (measured), forward s, speed-up, efficiency,
    50-step denoise s, request s)]}`` from benchmarks/multi_gpu_model.py's JSON (everything but the block time is
    predicted), or ``None`` when the file is absent."""
    path = Path(results_dir) / file
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    rows = []
    for preset, degrees in data["predicted"]["presets"].items():
        measured = data["measured"]["presets"][preset]["per_rank"]
        for degree, entry in sorted(degrees.items(), key=lambda item: int(item[0])):
            forward = entry.get("forward_s_scaled") or entry["forward_s"]
            rows.append((preset, int(degree), measured[degree]["block_ms"], forward, entry["speedup"],
                         entry["efficiency"], entry.get("denoise_s"), entry.get("request_s")))  # fmt: skip
    link = data["assumptions"]
    title = (f"Context parallel scaling, predicted from one-GPU measurements ({data['device']}, {data['commit']}; "
             f"{link['link']} at {link['all_to_all_efficiency']:.0%} of {link['link_gb_per_s_per_direction']:.0f} GB/s)")
    return {"title": title, "rows": rows, "anchors": data.get("anchors", {})}


def scaling_markdown(table: dict) -> str:
    """The docs table of :func:`scaling_table` (predicted except the measured per-rank block time)."""
    lines = ["| preset | GPUs | per-rank block, ms (measured) | forward, s | speed-up | efficiency | 50-step "
             "denoise, s | request, s |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for preset, degree, block_ms, forward, speedup, efficiency, denoise, request in table["rows"]:
        cells = [preset, str(degree), f"{block_ms:.1f}", f"{forward:.2f}", f"{speedup:.2f}x", f"{efficiency:.0%}",
                 "" if denoise is None else f"{denoise:.1f}", "" if request is None else f"{request:.1f}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_scaling(table: dict, out) -> None:
    """Predicted speed-up per preset against GPUs (ideal dashed) and predicted 50-step denoise time, with the public
    SGLang 4xH200 Ulysses-4 denoise time as a point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    presets = list(dict.fromkeys(row[0] for row in table["rows"]))
    degrees = sorted({row[1] for row in table["rows"]})
    left.plot(degrees, degrees, "--", color="#999999", label="ideal")
    for preset in presets:
        rows = [row for row in table["rows"] if row[0] == preset]
        left.plot([r[1] for r in rows], [r[4] for r in rows], "o-", label=preset)
        if all(r[6] is not None for r in rows):
            right.plot([r[1] for r in rows], [r[6] for r in rows], "o-", label=preset)
    sglang = table["anchors"].get("sglang_4xh200_ulysses4_t2va_50_steps")
    if sglang:
        right.plot([4], [sglang["denoise_s"]], "k*", markersize=11, label="SGLang 4xH200 Ulysses-4 (public)")
    left.set(xlabel="GPUs (Ulysses degree)", ylabel="predicted speed-up", xticks=degrees)
    right.set(xlabel="GPUs (Ulysses degree)", ylabel="predicted 50-step denoise, s", xticks=degrees)
    for ax in (left, right):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(table["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    print(f"wrote {out}")


def main(argv=None) -> Dict[str, dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", default=str(RESULTS), help="folder holding the results JSON files")
    parser.add_argument("--out", default=None, help="PNG to write (default: <results>/summary.png)")
    parser.add_argument("--scaling", action="store_true",
                        help=f"draw the context-parallel scaling plot from {SCALING_FILE} instead "
                             "(default --out: <results>/multi_gpu_model.png) and print its docs table")  # fmt: skip
    args = parser.parse_args(argv)
    if args.scaling:
        scaling = scaling_table(args.results)
        if scaling is None:
            raise SystemExit(f"no {SCALING_FILE} in {args.results}")
        plot_scaling(scaling, args.out or str(Path(args.results) / "multi_gpu_model.png"))
        print(scaling_markdown(scaling))
        return {SCALING_FILE: scaling}

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
