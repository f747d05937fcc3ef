"""Fit the memory model by rows on measured requests and write it (no GPU: it reads committed measurements).

    python benchmarks/memory_model.py --results benchmarks/results/placement_h100.json \\
        --holdout 640x1088x175 --activations benchmarks/results/activation_trace.json \\
        --package-copy diffusers_h3/parallel/memory_model.json

Reads the requests each case of a placement result measured (``cases[<case>]["shapes"]``: task, canvas, frames,
text rows, references, LoRA rank, ``device_peak_gib``, ``host_peak_rss_gib``), fits per case the laws of
``diffusers_h3.parallel.memory_model`` (device and host peak from a fixed part and per-row, canvas and LoRA terms),
and writes ``benchmarks/results/memory_model_<device>.json``: the laws, and per request (``fit_shapes``; the
``holdout`` ones, marked in the record or named by ``--holdout``, are not fitted) the predicted and measured peaks.
``--package-copy`` writes the same model where the package loads it (a CPU test checks the two agree).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from diffusers_h3._utils import gpu_model_name  # noqa: E402
from diffusers_h3.parallel.memory_model import derive_memory_model  # noqa: E402


def device_slug(device: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``h100``: the result files' device suffix."""
    model = gpu_model_name(device)
    return model.lower() if model else re.sub(r"[^a-z0-9]+", "_", (device or "unknown").lower()).strip("_")


def relative_source(path: Path) -> str:
    path = path.resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def build(results_path: Path, holdout=(), activations_path: Path = None):
    results = json.loads(results_path.read_text())
    activations = json.loads(activations_path.read_text()) if activations_path is not None else None
    model = derive_memory_model(results, relative_source(results_path), holdout, activations)
    if activations_path is not None:
        model["activations_source"] = relative_source(activations_path)
    return model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, required=True, help="a placement result with measured requests")
    parser.add_argument("--holdout", action="append", default=[], metavar="HxWxF",
                        help="requests of this canvas and frame count are predicted, not fitted (repeatable)")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: benchmarks/results/memory_model_<device>.json")
    parser.add_argument("--package-copy", type=Path, default=None, help="also write the model here")
    parser.add_argument("--activations", type=Path, default=None,
                        help="an activation trace (benchmarks/activation_trace.py): fit the allocations per stage")
    args = parser.parse_args(argv)
    model = build(args.results, args.holdout, args.activations)
    if not model["cases"]:
        print(f"{args.results}: no case has enough measured requests to fit ({model['not_fit'] or 'none measured'})",
              file=sys.stderr)
        return 1
    out = args.out or ROOT / "benchmarks" / "results" / f"memory_model_{device_slug(model['device'])}.json"
    text = json.dumps(model, indent=1) + "\n"
    out.write_text(text)
    if args.package_copy is not None:
        args.package_copy.write_text(text)
    for name in ("fit_shapes", "holdout"):
        for row in model[name]:
            print(f"{name:10s} {row['case']:16s} {row['shape']}: device {row['predicted_device_gib']:.2f} predicted / "
                  f"{row['measured_device_gib']:.2f} measured GiB ({row['device_error']:+.1%}), host "
                  f"{row['predicted_host_gib']:.2f} / {row['measured_host_gib']:.2f} GiB ({row['host_error']:+.1%}), "
                  f"allocations {row['predicted_allocated_gib']:.2f} / {row['measured_allocated_gib']:.2f} GiB "
                  f"({row['allocated_error']:+.1%})")
    for row in model["beyond_cap"]:
        print(f"beyond_cap {row['case']:16s} {row['shape']}: {row['predicted_allocated_gib']:.2f} GiB of allocations "
              f"predicted against a {row['cap_gib']} GiB cap: {'refused' if row['model_refuses'] else 'NOT refused'} "
              f"(measured: {row['measured'][:60]})")
    print(f"wrote {out}: holdout error up to {model['holdout_max_error']}, fit error up to "
          f"{model['fit_shapes_max_error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
