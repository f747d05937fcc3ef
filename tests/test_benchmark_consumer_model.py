"""benchmarks/consumer_model.py: the predicted consumer-GPU request times (schema, sources, and that the model moves
the right way when a GPU is slower, a drive is slower or the rows grow)."""

import importlib.util
import json
from pathlib import Path

import pytest

from tests._scripts import run_script


ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "consumer_model.py"
GPU_NAMES = {"RTX 3060 12 GB", "RTX 4060 Ti 16 GB", "RTX 4070 12 GB", "RTX 4080 16 GB", "RTX 4090 24 GB",
             "RTX 5090 32 GB"}  # fmt: skip


@pytest.fixture(scope="module")
def model():
    spec = importlib.util.spec_from_file_location("benchmarks_consumer_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_script_writes_labelled_sourced_predictions(tmp_path):
    out = tmp_path / "consumer_model.json"
    run = run_script(SCRIPT, "--out", out)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["suite"] == "consumer_model" and "PREDICTED" in data["label"] and data["nvme_gb_s"] == [3.5, 7.0]
    assert {g["name"] for g in data["gpus"]} == GPU_NAMES
    for gpu in data["gpus"]:
        assert gpu["bf16_dense_tflops"] > 0 and gpu["memory_bandwidth_gb_s"] > 0 and gpu["pcie"][0] in (3, 4, 5)
        assert gpu["sources"] and all(url.startswith("https://") for url in gpu["sources"]), gpu
        assert gpu["cuda_name"].startswith("NVIDIA GeForce RTX")
    keys = {"gpu", "case", "recipe", "nvme_gb_s", "measured_memory", "fits", "forward_s", "t2va_50_s", "t2va_4step_s",
            "fl2va_light4_s", "stages_s"}  # fmt: skip
    for row in data["predictions"]:
        assert keys <= set(row), row
        assert row["t2va_50_s"] > row["t2va_4step_s"] > 0 and row["fl2va_light4_s"] > row["t2va_4step_s"]
        if row["measured_memory"]:  # a measured need above what the card leaves is not listed
            assert row["gpu_need_gib"] <= row["gpu_usable_gib"], row
    # every card gets at least one recipe; each measured case's row on each card comes at both drive speeds
    assert {r["gpu"] for r in data["predictions"]} == GPU_NAMES
    pairs = {(r["gpu"], r["case"]) for r in data["predictions"]}
    assert len(data["predictions"]) == 2 * len(pairs)
    # the pc recipes are listed with their measured memory
    pc_rows = [r for r in data["predictions"] if r["case"].startswith("pc_")]
    assert pc_rows and all(r["measured_memory"] for r in pc_rows)
    assert "matplotlib" not in run.stderr  # no plot asked for, none needed


def _gpu(model, **changes):
    gpu = {**model.GPUS[3], **changes}
    gpu["bf16_dense_tflops"] = model.dense_tflops(gpu)
    gpu["pcie_effective_gb_s"] = model.pcie_gb_s(gpu["pcie"])
    return gpu


def _predict(model, gpu, case="low_ram_16gb", nvme=3.5, planned=False):
    placement = model.load("placement_h200.json")
    record = placement["cases"]["low_ram_16gb"]
    traffic = model.case_traffic(case, None if planned else record, planned=planned)
    extra = model.unexplained(record, model.case_traffic("low_ram_16gb", record, planned=False), "nvfp4")
    return model.predict(gpu, traffic, "nvfp4", extra, nvme)


def test_times_grow_when_tflops_or_bandwidth_shrink(model):
    base = _predict(model, _gpu(model))
    fewer_sms = _predict(model, _gpu(model, sms=38))  # half the tensor FLOP/s
    slower_memory = _predict(model, _gpu(model, memory_bandwidth_gb_s=358.4))
    for slower in (fewer_sms, slower_memory):
        for key in ("forward_s", "t2va_50_s", "t2va_4step_s", "fl2va_light4_s"):
            assert slower[key] > base[key], (key, slower[key], base[key])
    # compute dominates: half the tensor rate costs more than half the memory bandwidth
    assert fewer_sms["t2va_50_s"] > slower_memory["t2va_50_s"]


def test_a_dit_streamed_from_disk_waits_for_a_slow_drive_only_when_compute_is_faster(model):
    # a consumer card computes a forward in tens of seconds: 17.5 GiB from either drive hides behind it
    consumer = model.GPUS[4] | {"bf16_dense_tflops": model.dense_tflops(model.GPUS[4]), "pcie_effective_gb_s": 25.2}
    slow, fast = (_predict(model, consumer, "pc_8gb_16gib", nvme, planned=True) for nvme in (3.5, 7.0))
    assert slow["forward_s"] == fast["forward_s"] and slow["forward_bound"] == "compute"
    # a GPU fast enough to outrun the drive waits for it: the slower drive makes the forward longer
    fast_gpu = _gpu(model, sms=7600, memory_bandwidth_gb_s=71680.0, pcie=[5, 16])
    slow, fast = (_predict(model, fast_gpu, "pc_8gb_16gib", nvme, planned=True) for nvme in (3.5, 7.0))
    assert slow["forward_s"] > fast["forward_s"] and slow["forward_bound"] == "weights from disk"
    assert slow["stages_s"]["text_encode"] > fast["stages_s"]["text_encode"]  # 26.6 GiB streamed per prompt


def test_the_h200_measurement_is_reproduced_and_fl2va_rows_cost_more(model):
    h200 = {**model.H200, "pcie_effective_gb_s": model.pcie_gb_s(model.H200["pcie"])}
    predicted = _predict(model, h200, nvme=model.H200_DISK_GB_S)
    table = {e["case"]: e for e in json.loads((ROOT / "diffusers_h3/parallel/memory_recipes.json").read_text())["recipes"]}
    assert predicted["t2va_50_s"] == pytest.approx(table["low_ram_16gb"]["request_s"], abs=0.5)
    assert predicted["forward_fl2va_s"] > predicted["forward_s"]  # 42,284 rows against 38,222


def test_the_plot_is_a_small_png(tmp_path):
    pytest.importorskip("matplotlib")
    run = run_script(SCRIPT, "--out", tmp_path / "m.json", "--plot", tmp_path / "m.png")
    assert run.returncode == 0, run.stderr[-3000:]
    png = (tmp_path / "m.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) < 200_000


def test_the_committed_result_and_the_readme_rows_are_the_models_output(model):
    """benchmarks/results/consumer_model.json is what the model gives for the committed measurements, and the README's
    consumer-GPU rows are generated from it (regenerate both with the command in the script's docstring)."""
    committed = json.loads((ROOT / "benchmarks" / "results" / "consumer_model.json").read_text())
    _, cases, rows, _ = model.build(*model.measured_inputs())
    assert committed["predictions"] == rows and committed["cases"] == cases
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index(model.README_START) + len(model.README_START) : readme.index(model.README_END)]
    assert block.strip().splitlines() == model.readme_rows(committed)
    assert all("(predicted)" in line for line in block.strip().splitlines()[2:])
