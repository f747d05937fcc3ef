"""benchmarks/multi_gpu.py under torchrun on 2 gloo ranks with the tiny model (the full-size run needs several GPUs)."""

import json
from pathlib import Path

from tests._scripts import run_script


ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "multi_gpu.py"


def _torchrun(*args, timeout=300, ranks=2):
    """The script on `ranks` gloo ranks, as `torchrun --nproc-per-node RANKS` starts it."""
    return run_script(SCRIPT, "--tiny", "--device", "cpu", "--reps", "1", *args, ranks=ranks, timeout=timeout)


def test_every_case_on_two_gloo_ranks(tmp_path):
    out = tmp_path / "multi_gpu_cpux2.json"
    run = _torchrun("--cases", "native_cudnn,vsa_fp8_sp0.8,fastest,tp2", "--tp-quant", "w8a16", "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["world_size"] == 2 and data["tiny"] is True and data["packed_rows"] == 99
    forward = data["forward"]
    assert list(forward) == ["native_cudnn", "vsa_fp8_sp0.8", "fastest", "tp2"]
    for case in ("native_cudnn", "vsa_fp8_sp0.8", "fastest"):  # CP on CPU: the same arithmetic as one process
        assert forward[case]["rel_l2"] <= 1e-6, (case, forward[case])
        assert forward[case]["cp_ms"] > 0 and forward[case]["baseline_1gpu_ms"] > 0
    # W8A16 weights under TP against the bf16 baseline: small but not zero (the quantization is applied)
    assert forward["tp2"]["weights"] == "w8a16" and 0 < forward["tp2"]["rel_l2"] < 0.05
    assert data["vae_decode"]["rel_l2"] <= 1e-6


def test_unknown_case_is_refused(tmp_path):
    run = _torchrun("--cases", "native_cudnn,turbo", "--out", str(tmp_path / "x.json"), timeout=120)
    assert run.returncode != 0 and "unknown case(s) ['turbo']" in run.stderr
    assert not (tmp_path / "x.json").exists()


def test_degree_one_records_the_baselines_alone(tmp_path):
    """One GPU: the same cases without context parallelism (the numbers later launches are compared with)."""
    out = tmp_path / "multi_gpu_cpux1.json"
    run = _torchrun("--cases", "native_cudnn,fastest", "--out", str(out), ranks=1)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["world_size"] == 1 and list(data["forward"]) == ["native_cudnn", "fastest"]
    for case in data["forward"].values():
        assert set(case) == {"baseline_1gpu_ms", "baseline_1gpu_peak_gib"} and case["baseline_1gpu_ms"] > 0
    # At one rank the parallel decode is vae.decode itself: only the serial decode is timed.
    assert data["vae_decode"]["serial_ms"] > 0 and data["vae_decode"]["parallel_ms"] is None
    refused = _torchrun("--tp", "--out", str(tmp_path / "x.json"), ranks=1, timeout=120)
    assert refused.returncode != 0 and "tensor parallelism needs two or more ranks" in refused.stderr
