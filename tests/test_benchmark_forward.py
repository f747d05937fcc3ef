"""benchmarks/forward.py runs every case on the CPU with the tiny model (the full-size run is for a GPU), and its
kernel classification sorts kernel names into the categories the fusion decision reads."""

import importlib.util
import json
from pathlib import Path

import pytest

from diffusers_h3 import SpeedPresetConfig
from tests._scripts import run_script


ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "forward.py"
CASES = ["native", "exact", "fast", "fastest"]


def _forward_module(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # the script imports _common from its folder
    spec = importlib.util.spec_from_file_location("benchmarks_forward", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _common_module(monkeypatch):
    """benchmarks/_common.py, where the kernel-time breakdown of every profiling suite lives."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import _common

    return _common


def _run(*args, timeout=120):
    return run_script(SCRIPT, *args, timeout=timeout)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--cases", "native,turbo"], "unknown case(s) ['turbo']"),
        (["--cases", "native", "--profile", "fast"], "--profile fast: not in --cases"),
    ],
)
def test_bad_cases_are_refused_before_building(tmp_path, args, message):
    run = _run("--tiny", *args, "--out", str(tmp_path / "f.json"))
    assert run.returncode != 0 and message in run.stderr
    assert "built the model" not in run.stdout
    assert not (tmp_path / "f.json").exists()


def test_tiny_run_records_every_case(tmp_path):
    out = tmp_path / "forward_h200.json"
    run = _run("--tiny", "--reps", "2", "--profile", "native,fastest", "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["suite"] == "forward" and data["device"] == "cpu (tiny smoke test)"
    assert data["shape"]["tiny"] is True and data["shape"]["layers"] == 2 and data["shape"]["rows"] > 0
    assert data["notes"] == {}
    cases = data["cases"]
    assert list(cases) == CASES
    for name, case in cases.items():
        assert case["ms"] > 0 and len(case["times_ms"]) == 2 and min(case["times_ms"]) <= case["ms"]
        assert case["baseline"] == "native" and case["ratio"] > 0
        assert len(case["warmup_s"]) == 2 and case["first_call_s"] == case["warmup_s"][0] >= 0
        assert case["peak_gib"] is None  # CPU: no CUDA memory statistics
        assert set(case["dynamo"]) == {"graphs_traced", "graph_breaks", "graph_break_reasons", "recompiled_while_timed"}
        assert case["dynamo"]["graph_break_reasons"] == {}  # no compile on a CPU (and none in the blocks anyway)
        assert case["dynamo"]["recompiled_while_timed"] is False
        assert case["rel_l2_audio"] is not None and case["paths"]["attention"]

    native = cases["native"]
    assert native["rel_l2"] == 0.0 and native["rel_l2_audio"] == 0.0 and native["ratio"] == 1.0
    assert native["preset"]["preset"] is None
    # exact on a CPU: the same processor and backend, no compile (CUDA only): bitwise the native output.
    assert cases["exact"]["rel_l2"] == 0.0
    assert cases["exact"]["preset"]["preset"] == "exact"
    assert "CUDA only" in cases["exact"]["preset"]["compile"]["transformer"]
    # fast / fastest quantize the weights (W8A16 on a CPU) and the attention operands: the output changes.
    for name in ("fast", "fastest"):
        case = cases[name]
        assert 0 < case["rel_l2"] < 0.1, (name, case["rel_l2"])
        assert case["preset"]["preset"] == name and "W8A16Config" in case["preset"]["weights"]["transformer"]
        assert "INT8" in case["preset"]["attention"]["transformer"]
        assert any("W8A16Linear" in path for path in case["paths"]["quantized_layers"])
    assert "already quantized: kept" in cases["fastest"]["preset"]["weights"]["transformer"]
    assert any("VSA sparsity=0.8" in path for path in cases["fastest"]["paths"]["attention"])
    assert cases["fastest"]["rel_l2"] > cases["fast"]["rel_l2"]  # dropping 80 % of the video key tiles costs more

    # The profile (CPU operators here) in the schema the GPU run writes.
    for name in ("native", "fastest"):
        profile = cases[name]["profile"]
        categories = profile["categories"]
        assert list(categories) == ["gemm", "attention", "inductor_fused", "quantization", "other"]
        assert sum(c["pct"] for c in categories.values()) == pytest.approx(100.0, abs=0.1)
        assert sum(c["ms"] for c in categories.values()) == pytest.approx(profile["kernel_ms"], abs=0.01)
        assert categories["gemm"]["count"] > 0 and categories["gemm"]["ms"] > 0  # aten::mm / addmm / bmm
        top = profile["top_kernels"]
        assert 0 < len(top) <= 15 and [k["ms"] for k in top] == sorted((k["ms"] for k in top), reverse=True)
        assert profile["kernel_ms_over_ms"] > 0
    assert "profile" not in cases["exact"] and "profile" not in cases["fast"]
    assert cases["native"]["profile"]["categories"]["attention"]["ms"] > 0  # aten::_scaled_dot_product_*


def test_tiny_fl2va_inputs_run_after_t2va_in_the_same_process(tmp_path):
    out = tmp_path / "forward_fl2va.json"
    run = _run("--tiny", "--reps", "1", "--warmup", "1", "--cases", "native,fastest", "--tasks", "t2va,fl2va",
               "--out", str(out))  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(out.read_text())
    cases = data["cases"]
    assert list(cases) == ["native", "native_fl2va", "fastest", "fastest_fl2va"] and data["notes"] == {}
    assert data["shape"]["fl2va_rows"] > data["shape"]["rows"]  # the keyframes' prompt tokens and condition rows
    assert cases["fastest"]["task"] == "t2va" and cases["fastest_fl2va"]["task"] == "fl2va"
    assert cases["fastest_fl2va"]["rows"] == data["shape"]["fl2va_rows"]
    assert cases["native_fl2va"]["rel_l2"] == 0.0 and cases["fastest_fl2va"]["baseline"] == "native_fl2va"
    assert 0 < cases["fastest_fl2va"]["rel_l2"] < 0.1
    assert "t2va, fl2va" in data["protocol"] or "t2va,fl2va" in data["protocol"]


def test_bad_tasks_are_refused(tmp_path):
    run = _run("--tiny", "--tasks", "t2va,i2v", "--out", str(tmp_path / "f.json"))
    assert run.returncode != 0 and "--tasks 't2va,i2v'" in run.stderr
    assert not (tmp_path / "f.json").exists()


def test_new_graph_breaks_counts_only_the_breaks_of_a_case(monkeypatch):
    forward = _forward_module(monkeypatch)
    before = {"Unsupported: foo": 2}
    after = {"Unsupported: foo": 5, "Skip calling   torch.compiler.disable\n function": 1}
    assert forward.new_graph_breaks(before, after) == {"Unsupported: foo": 3,
                                                       "Skip calling torch.compiler.disable function": 1}  # fmt: skip
    assert forward.new_graph_breaks(after, after) == {}


def test_kernel_category(monkeypatch):
    common = _common_module(monkeypatch)
    category = common.kernel_category
    expected = {
        # cuBLAS / cuBLASLt / CUTLASS GEMMs and torch._scaled_mm
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopB_TNT": "gemm",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel__5x_cublas": "gemm",
        "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8>(Params)": "gemm",
        "cutlass3x_sm90_gemm_e4m3_e4m3_f32_bf16_bf16_128x128x128_1x2x1_0_tnn_align16_warpspecialized_cooperative": "gemm",
        "void gemv2T_kernel_val<int, int, __nv_bfloat16, float, float, 128, 16, 4, 4, false, false>(...)": "gemm",
        "void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, true, false>(...)": "gemm",
        "_w8a16_kernel": "gemm",
        "aten::addmm": "gemm",
        # attention: ours (Triton / Gluon), cuDNN, FlashAttention, memory-efficient, CPU SDPA
        "_bsa_fwd_kernel": "attention",
        "_sparse_fwd_sm90_ws_kernel": "attention",
        "_dense_fwd_sm90_ws_kernel": "attention",
        "_select_tiles_kernel": "attention",
        "void fa_v100_forward_kernel<128, 64>(__half const*, __half const*, __half const*, __half*, int, int, ...)": "attention",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0": "attention",
        "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>>(...)": "attention",
        "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<...>>>(...)": "attention",
        "fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...>::Params)": "attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
        # inductor's generated kernels, whatever ops they fused (a quantizing cast or a matmul template included)
        "triton_poi_fused__to_copy_add_mul_0": "inductor_fused",
        "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_1": "inductor_fused",
        "triton_red_fused__to_copy_abs_amax_clamp_div_2": "inductor_fused",
        "triton_tem_fused_addmm_3": "inductor_fused",
        # our quantization kernels
        "_quant_row_kernel": "quantization",
        "_tile_pool_kernel": "quantization",
        "_quantize_v_kernel": "quantization",
        "_w8a16_dequant_kernel": "quantization",
        "void at::native::quantize_tensor_per_tensor_affine(...)": "quantization",
        # the rest
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, ...>(...)": "other",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>(...)": "other",
        "Memcpy DtoD (Device -> Device)": "other",
        "Memset (Device)": "other",
        "aten::copy_": "other",
        "triton_kernel_of_someone_else": "other",
        "_bsa_fwd_kernel_v2": "other",  # a name that merely starts like one of ours is not ours
    }
    got = {name: category(name) for name in expected}
    assert got == expected
    assert set(expected.values()) == set(common.CATEGORIES)


def test_kernel_breakdown_sums_and_ranks(monkeypatch):
    common = _common_module(monkeypatch)
    rows = [
        ("nvjet_tst_128x256", 6000.0, 100),
        ("_quant_row_kernel", 1000.0, 100),
        ("triton_poi_fused_add_0", 1500.0, 50),
        ("_sparse_fwd_sm90_ws_kernel", 1000.0, 50),
        ("Memset (Device)", 500.0, 7),
    ]
    result = common.kernel_breakdown(rows, top=3)
    assert result["kernel_ms"] == 10.0
    categories = result["categories"]
    assert categories["gemm"] == {"ms": 6.0, "pct": 60.0, "count": 100, "top": ["nvjet_tst_128x256"]}
    assert categories["quantization"]["ms"] == 1.0 and categories["quantization"]["pct"] == 10.0
    assert categories["inductor_fused"]["count"] == 50 and categories["attention"]["pct"] == 10.0
    assert categories["other"] == {"ms": 0.5, "pct": 5.0, "count": 7, "top": ["Memset (Device)"]}
    assert [k["name"] for k in result["top_kernels"]] == ["nvjet_tst_128x256", "triton_poi_fused_add_0",
                                                          "_quant_row_kernel"]  # fmt: skip
    assert result["top_kernels"][1] == {"name": "triton_poi_fused_add_0", "category": "inductor_fused", "ms": 1.5,
                                        "pct": 15.0, "count": 50}  # fmt: skip
    assert common.kernel_breakdown([])["kernel_ms"] == 0


def test_the_per_transformer_preset_checks_before_changing_anything():
    """The benchmark applies presets to the transformer alone; the pipeline call's checks hold there too."""
    from diffusers_h3.pipelines.speed_presets import enable_speed_preset_on_transformer
    from diffusers_h3.quantizers import is_quantized_linear
    from diffusers_h3.testing.tiny import tiny_transformer

    model = tiny_transformer()
    with pytest.raises(ValueError, match="unknown speed preset 'turbo'"):
        enable_speed_preset_on_transformer(model, "turbo")
    record = enable_speed_preset_on_transformer(model, SpeedPresetConfig("fast", compile=False))
    assert record.describe()["compile"] == {"transformer": "off (compile=False)"}
    assert record.decode == "not applied (transformer only)"
    layers = [m for m in model.modules() if is_quantized_linear(m)]
    assert layers
    with pytest.raises(ValueError, match=r"'exact' runs bf16 weights.*already quantized \(h3_w8a16\)"):
        enable_speed_preset_on_transformer(model, "exact")
    assert [m for m in model.modules() if is_quantized_linear(m)] == layers


@pytest.mark.parametrize("build_dtype", ["float32", "bfloat16"])
def test_the_full_size_dit_is_drawn_in_the_build_dtype_then_cast_to_bf16(monkeypatch, build_dtype):
    """--build-dtype bfloat16 draws the random DiT in bf16 (50 blocks then fit an 80 GB card); either way the model
    runs in bf16 with its fp32 modules kept, and the default dtype is restored."""
    import diffusers
    import torch

    _forward_module(monkeypatch)  # puts benchmarks/ on the path, as the script runs
    import end_to_end

    seen = []

    class Stand(torch.nn.Module):  # the released DiT's construction, in miniature
        _keep_in_fp32_modules = ["kept"]

        def __init__(self, num_layers):
            super().__init__()
            seen.append((torch.get_default_dtype(), num_layers))
            self.block, self.kept = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    monkeypatch.setattr(diffusers, "MiniMaxH3Transformer3DModel", Stand)
    dtype = getattr(torch, build_dtype)
    model = end_to_end.build_model(torch.device("cpu"), 3, dtype)
    assert seen == [(dtype, 3)] and torch.get_default_dtype() == torch.float32
    assert model.block.weight.dtype == torch.bfloat16 and model.kept.weight.dtype == torch.float32
