"""benchmarks/multi_gpu_model.py: the communication count, and the script's --tiny CPU smoke test."""

import json
import sys
from pathlib import Path

from tests._scripts import run_script


ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "multi_gpu_model.py"
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_communication_counts_what_each_all_to_all_moves():
    from multi_gpu_model import communication_per_forward

    # 38,222 rows over 4 ranks: shards of 9,556 / 9,556 / 9,555 / 9,555; the largest sends 3/4 of its Q, K, V and
    # output (56 x 128 bf16 per row) to the other ranks in each of 50 blocks, and its 9,556 x 128 fp32 output rows to
    # each of the 3 others.
    comm = communication_per_forward(38222, 56, 128, 4)
    assert comm["all_to_all_bytes"] == int(9556 * 56 * 128 * 2 * 3 / 4 * 4 * 50)
    assert comm["all_gather_bytes"] == 9556 * 128 * 4 * 3
    assert comm["collectives"] == 4 * 50 + 2
    assert communication_per_forward(38222, 56, 128, 4, gated=True)["collectives"] == 5 * 50 + 2  # VSA's gate
    assert communication_per_forward(38222, 56, 128, 1) == {"all_to_all_bytes": 0, "all_gather_bytes": 0,
                                                            "collectives": 0}  # fmt: skip


def test_tiny_run_measures_and_predicts_every_degree(tmp_path):
    from plot import scaling_markdown, scaling_table

    out = tmp_path / "multi_gpu_model_h200.json"
    run = run_script(SCRIPT, "--tiny", "--presets", "native,fastest", "--reps", "1", "--warmup", "1", "--out", out)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data["measured"]["presets"]) == {"native", "fastest"} and not data["notes"]
    for preset, measured in data["measured"]["presets"].items():
        per_rank = measured["per_rank"]
        assert set(per_rank) == {"1", "2"}
        assert per_rank["2"]["heads"] == per_rank["1"]["heads"] // 2  # attention: the rank's heads
        assert per_rank["2"]["rows"] == -(-per_rank["1"]["rows"] // 2)  # everything else: the rank's rows
        assert all(r["rest_ms"] > 0 and r["attention_ms"] > 0 for r in per_rank.values())
        predicted = data["predicted"]["presets"][preset]
        assert predicted["1"]["speedup"] == 1.0 and predicted["1"]["communication_s"] == 0
        assert predicted["2"]["communication"]["all_to_all_bytes"] > 0
    assert set(data["measured"]["video_decode_share"]["ms"]) == {"1", "2"}
    assert data["assumptions"]["link_source"] and "predicted" in data["predicted"]["note"]
    # The docs table (benchmarks/plot.py --scaling) from the same file.
    table = scaling_table(tmp_path)
    assert [(r[0], r[1]) for r in table["rows"]] == [("native", 1), ("native", 2), ("fastest", 1), ("fastest", 2)]
    assert table["rows"][1][4] == data["predicted"]["presets"]["native"]["2"]["speedup"]
    lines = scaling_markdown(table).splitlines()
    assert len(lines) == 6 and lines[3].startswith("| native | 2 |")


def test_unknown_preset_is_refused(tmp_path):
    run = run_script(SCRIPT, "--tiny", "--presets", "turbo", "--out", tmp_path / "x")
    assert run.returncode != 0 and "unknown preset(s) ['turbo']" in run.stderr

