"""Every benchmark figure the README and docs quote is the one in benchmarks/results/*.json: a table of (document,
quoted text with `{}` where the figure stands, figure read from the JSON and formatted as quoted)."""

import json
import re
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _json(name):
    return json.loads((RESULTS / name).read_text())


def _seconds(name, case, digits=2):
    return lambda: f"{_json(name)['cases'][case]['ms'] / 1000:.{digits}f}"


def _ratio(name, slow, fast, digits=2):
    return lambda: f"{_json(name)['cases'][slow]['ms'] / _json(name)['cases'][fast]['ms']:.{digits}f}"


def _peak(name, case):
    return lambda: f"{_json(name)['cases'][case]['peak_gib']:.1f}"


def _qk_error_ratio():
    error = _json("qk_rounding_error_cpu.json")["rel_l2"]
    return f"{error['e4m3_qk'] / error['int8_qk']:.1f}"


def _export(case, field):
    return lambda: str(_json("export_cpu.json")["cases"][case][field])


def _streamed(mode):
    return lambda: str(_json("export_cpu.json")["streaming_smooth"][mode]["after_last_chunk_s"])


def _vae(case, field, spec):
    return lambda: format(_json("vae_h200.json")["cases"][case][field], spec).replace("e-0", "e-")


def _streamed_pipeline(mode, field="after_last_chunk_s"):
    return lambda: str(_json("export_cpu.json")["streaming_pipeline"][mode][field])


def _text_encoder_layers():
    described = (RESULTS / "request_h200.json").read_text()  # "Qwen3-VL-32B config, decoder layers 0-50 built, 0-49 run"
    first, last, run_first, run_last = re.search(r"decoder layers (\d+)-(\d+) built, (\d+)-(\d+) run", described).groups()
    return f"{first}–{last} built, {run_first}–{run_last}"


E2E, FWD, FI, FAST_FI = "end_to_end_h200.json", "forward_h200.json", "forward_flashinfer_h200.json", "forward_fast_flashinfer_h200.json"
def _placement(case, field, result="placement_h200.json"):
    return lambda: f"{_json(result)['cases'][case][field]:.2f}"


def _h100_shape(case, index, field):
    return lambda: f"{_json('placement_h100.json')['cases'][case]['shapes'][index][field]:.2f}"


def _h100_light4(case, field, scale=1.0, digits=2):
    return lambda: f"{_json('placement_h100.json')['cases'][case]['fl2va_light4'][field] * scale:.{digits}f}"


def _recipe_host(recipe):
    table = json.loads((ROOT / "diffusers_h3" / "parallel" / "memory_recipes.json").read_text())
    return lambda: f"{next(r for r in table['recipes'] if r['recipe'] == recipe)['host_gib']:.2f}"


def _audio(row, field, digits):
    return lambda: f"{_json('audio_gates_cpu.json')['rows'][row][field]:.{digits}f}"


def _train(field, digits=2, case="card_24gb"):
    return lambda: f"{_json('train_lora_h100.json')['cases'][case][field]:.{digits}f}"


def _fasth3_h100(case, field, scale=1.0, digits=2):
    return lambda: f"{_json('fasth3_h100.json')['cases'][case][field] * scale:.{digits}f}"


def _compile_run(run, case, field="rel_l2"):
    return lambda: f"{_json('forward_compile_options_h100.json')['runs'][run]['cases'][case][field]:.2e}".replace("e-0", "e-")


def _taylorseer_prediction(case, computed=12):
    """The TaylorSeer profile's predicted request time (s): ``computed`` forwards at the case's median forward plus the
    case's other stages, from request_h200.json."""

    def value():
        record = _json("request_h200.json")["cases"][case]
        other = sum(v for stage, v in record["stages"].items() if stage != "forwards")
        return f"{(computed * record['forward_median_ms'] + other) / 1000:.1f}"

    return value


def _cache_profile_row(case, label, name="fidelity_cache_profiles_h100.json"):
    """docs/speed.md's cache-profile row: skips, SSIM, PSNR, SI-SDR and correlation from an H100 fidelity run."""

    def row():
        record = _json(name)["report"]["cases"][case]
        summary, skips = record["summary"], record["clips"][0]["generation"]["cache"]["transformer"]
        skipped = skips.split(" steps")[0].removeprefix("skipped ")
        return (f"| {label} | {skipped} | {summary['ssim_yuv420']:.4f} | {summary['psnr_yuv420']:.2f} dB | "
                f"{summary['audio_si_sdr_db']:.2f} dB | {summary['audio_correlation']:.4f} | "
                f"{record['speed']['seconds']:.1f} |")  # fmt: skip

    return row


def _cache_request_row(cache, speed, label, mark=""):
    """docs/speed.md's cache-profile request row from request_cache_<cache>_h100.json: the request, its forwards stage,
    the steps the cache skipped, the card's peak and the allocator's peaks (``mark``: the footnote after the peaks)."""

    def row():
        record = _json(f"request_cache_{cache}_h100.json")["cases"][f"t2va_{speed}_{cache}"]
        skipped = record["cache"]["last_request"].split(" steps")[0].removeprefix("skipped ")
        return (f"| {label} | **{record['ms'] / 1000:.1f} s** | {record['stages']['forwards'] / 1000:.1f} s | {skipped} | "
                f"{record['device_peak_gib']:.2f} GiB{mark} | {record['peak_gib']:.2f} / {record['peak_reserved_gib']:.2f} GiB{mark} |")  # fmt: skip

    return row


SEED, FAST, FASTEST = "exact seed 1 vs exact seed 0", "fast vs exact, seed 0", "fastest vs exact, seed 0"
QUOTES = [
    *(("docs/speed.md", "{}", _cache_profile_row(case, label)) for case, label in (
        ("fast_first_block_cache", "`fast` + first-block cache"), ("fast_taylorseer", "`fast` + TaylorSeer"),
        ("fastest_first_block_cache", "`fastest` + first-block cache"), ("fastest_taylorseer", "`fastest` + TaylorSeer"))),
    *(("docs/speed.md", "{}", _cache_profile_row(case, label, "fidelity_taylorseer_lite_h100.json")) for case, label in (
        ("fast_taylorseer_lite", "`fast` + TaylorSeer lite ²"), ("fastest_taylorseer_lite", "`fastest` + TaylorSeer lite ²"))),
    *(("docs/speed.md", "{}", _cache_request_row(cache, speed, label)) for cache, speed, label in (
        ("first_block_cache", "fast", "`fast` + first-block cache"),
        ("first_block_cache", "fastest", "`fastest` + first-block cache"),
        ("taylorseer_lite", "fast", "`fast` + TaylorSeer lite"))),
    # Ran after the `fast` case in one process, before the script emptied the allocator's cache between cases.
    ("docs/speed.md", "{}", _cache_request_row("taylorseer_lite", "fastest", "`fastest` + TaylorSeer lite", " ³")),
    ("docs/speed.md", "so they bound `fastest`\nfrom above rather than measure it alone (its allocated peak, {} GiB, is its own)",
     lambda: f"{_json('request_cache_taylorseer_lite_h100.json')['cases']['t2va_fastest_taylorseer_lite']['peak_gib']:.2f}"),
    ("docs/speed.md", "A computed forward took {} s under `fast`", lambda: f"{_json('request_cache_first_block_cache_h100.json')['cases']['t2va_fast_first_block_cache']['forward_median_ms'] / 1000:.2f}"),
    ("docs/speed.md", "and {} s under `fastest` (the same", lambda: f"{_json('request_cache_first_block_cache_h100.json')['cases']['t2va_fastest_first_block_cache']['forward_median_ms'] / 1000:.2f}"),
    ("docs/speed.md", "uncached requests take {} / 134.3 s", _seconds("request_h200.json", "t2va_fast", 1)),
    ("docs/speed.md", "uncached requests take 225.9 / {} s", _seconds("request_h200.json", "t2va_fastest", 1)),
    ("docs/checkpoints.md", "Everything but the four forwards takes {} s", lambda: f"{sum(v for k, v in _json('fasth3_h200.json')['cases']['fl2va_fasth3_fastest']['stages'].items() if k != 'forwards') / 1000:.2f}"),
    ("docs/checkpoints.md", "prefix_h200.json`: {} s at these 154,081 pairs", lambda: f"{json.loads((ROOT / 'docs/experiments/fl2va_prefix_h200.json').read_text())['rules']['dense_prefix_sp0.9']['forward_ms'] / 1000:.2f}"),
    ("README.md", "`fastest` + TaylorSeer lite {} s, `fast`", _seconds("request_cache_taylorseer_lite_h100.json", "t2va_fastest_taylorseer_lite", 1)),
    ("README.md", "`fast` + first-block {} s, all within", _seconds("request_cache_first_block_cache_h100.json", "t2va_fast_first_block_cache", 1)),
    ("docs/speed.md", "its `exact` took {} s", lambda: f"{_json('fidelity_taylorseer_lite_h100.json')['report']['cases']['exact']['speed']['seconds']:.1f}"),
    ("docs/speed.md", "measured H100 requests ({} s / 62.4 s above)", _seconds("request_cache_taylorseer_lite_h100.json", "t2va_fastest_taylorseer_lite", 1)),
    ("docs/speed.md", "measured H100 requests (39.0 s / {} s above)", _seconds("request_cache_taylorseer_lite_h100.json", "t2va_fast_taylorseer_lite", 1)),
    ("docs/vae.md", "`fastest` request took {} s on one H100", _seconds("request_cache_taylorseer_lite_h100.json", "t2va_fastest_taylorseer_lite", 1)),
    ("docs/speed.md", "| `exact` (reference) | — | — | — | — | — | {} |",
     lambda: f"{_json('fidelity_cache_profiles_h100.json')['report']['cases']['exact']['speed']['seconds']:.1f}"),
    ("docs/speed.md", "the quantized build peaked at {} GiB on the card",
     lambda: f"{_json('request_cache_taylorseer_h100.json')['build_device_peak_gib']}"),
    ("docs/speed.md", "predicts about **{} s** for `fastest` + TaylorSeer", _taylorseer_prediction("t2va_fastest")),
    ("docs/speed.md", "and **{} s** for `fast` + TaylorSeer", _taylorseer_prediction("t2va_fast")),
    ("docs/speed.md", "(12 × {} ms +\n3.85 s)", lambda: f"{_json('request_h200.json')['cases']['t2va_fastest']['forward_median_ms']}"),
    ("docs/architecture.md", "`exact` 6091.6 → {} ms", lambda: f"{_json('forward_before_after_h100.json')['summary']['exact']['aa14a75_ms']}"),
    ("docs/architecture.md", "`fast` 4643.8 → {} ms", lambda: f"{_json('forward_before_after_h100.json')['summary']['fast']['aa14a75_ms']}"),
    ("docs/architecture.md", "`fastest` 2775.4 → {} ms", lambda: f"{_json('forward_before_after_h100.json')['summary']['fastest']['aa14a75_ms']}"),
    ("docs/architecture.md", "`fastest` {} → 2734.7 ms", lambda: f"{_json('forward_before_after_h100.json')['summary']['fastest']['6e4832a_ms']}"),
    ("docs/training.md", "| {} s | **22.44 GiB**", _train("s_per_step", 1)),
    ("README.md", "24 GB recipe {} s/step", _train("s_per_step", 1)),
    ("README.md", "s/step within {} GiB on the card", _train("device_peak_gib")),
    ("README.md", "80 GB recipe {} s/step", _train("s_per_step", 1, case="card_80gb")),
    ("README.md", "s/step at {} GiB (`train_lora_h100.json`", _train("device_peak_gib", case="card_80gb")),
    ("docs/training.md", "| **{} GiB** (bound 22.5)", _train("device_peak_gib")),
    ("docs/training.md", "(bound 22.5) | {} / 21.62 GiB", _train("peak_allocated_gib")),
    ("docs/training.md", "| 18.11 / {} GiB |", _train("peak_reserved_gib")),
    ("docs/training.md", "| **{} GiB** (bound 28)", _train("host_peak_rss_gib")),
    ("docs/training.md", "| {} s | **65.04 GiB**", _train("s_per_step", 1, case="card_80gb")),
    ("docs/training.md", "| **{} GiB** (cap 78.5", _train("device_peak_gib", case="card_80gb")),
    ("docs/training.md", "66,601 MiB) | {} / 64.29 GiB", _train("peak_allocated_gib", case="card_80gb")),
    ("docs/training.md", "| 58.51 / {} GiB | 2.18", _train("peak_reserved_gib", case="card_80gb")),
    ("docs/checkpoints.md", "| t2va | **{} s**", _fasth3_h100("t2va_fasth3_fastest", "ms", 1e-3, 1)),
    ("README.md", "`fastest`: t2va 11.8 s / fl2va 16.6 s on an H200, {} s", _fasth3_h100("t2va_fasth3_fastest", "ms", 1e-3, 1)),
    ("README.md", "on an 80 GB H100 within {} GiB", _fasth3_h100("fl2va_fasth3_fastest", "device_peak_gib")),
    ("docs/checkpoints.md", "| fl2va | **{} s** | 3.60", _fasth3_h100("fl2va_fasth3_fastest", "ms", 1e-3, 1)),
    ("docs/checkpoints.md", "| 2.48 s | **{} GiB**", _fasth3_h100("t2va_fasth3_fastest", "device_peak_gib")),
    ("docs/checkpoints.md", "| 3.60 s | **{} GiB**", _fasth3_h100("fl2va_fasth3_fastest", "device_peak_gib")),
    ("docs/checkpoints.md", "**58.13 GiB** | {} / 57.45", _fasth3_h100("t2va_fasth3_fastest", "peak_gib")),
    ("docs/speed.md", "`fast` {} with it", _compile_run("head", "fast")),
    ("docs/speed.md", "with it against {} without", _compile_run("static", "fast")),
    ("docs/speed.md", "`fastest` {} against", _compile_run("head", "fastest")),
    ("docs/speed.md", "against {} (the", _compile_run("static", "fastest")),
    ("docs/fidelity.md", "seed 0 scores a cosine of {}", _audio(SEED, "spectral_cosine", 4)),
    ("docs/fidelity.md", "against {} / 0.9997 for the `fast`", _audio(FAST, "spectral_cosine", 4)),
    ("docs/fidelity.md", "against 0.9996 / {} for the `fast`", _audio(FASTEST, "spectral_cosine", 4)),
    ("docs/fidelity.md", "the other seed scores {} dB", _audio(SEED, "si_sdr_db", 2)),
    ("docs/fidelity.md", "the other seed scores 18.10 dB / {},", _audio(SEED, "correlation", 4)),
    ("docs/fidelity.md", "the presets {} / 24.20 dB", _audio(FAST, "si_sdr_db", 2)),
    ("docs/fidelity.md", "the presets 23.20 / {} dB", _audio(FASTEST, "si_sdr_db", 2)),
    ("docs/fidelity.md", "dB and {} / 0.9981", _audio(FAST, "correlation", 4)),
    ("docs/fidelity.md", "dB and 0.9976 / {}, so", _audio(FASTEST, "correlation", 4)),
    ("README.md", "`low_ram_16gb`: peak {} GiB reserved", _placement("low_ram_16gb", "peak_reserved_gib")),
    ("README.md", "host peak RSS {} GiB (load included)", _placement("low_ram_16gb", "host_peak_rss_gib")),
    ("README.md", "t2va 50 steps {} s (1 forward", lambda: f"{_json('placement_h200.json')['cases']['low_ram_16gb']['request_s_extrapolated']}"),
    ("README.md", "t2va 768x1344x124 at {} GiB as the card counts it** (7,241", _h100_shape("pc_8gb_16gib", 0, "device_peak_gib")),
    ("README.md", "**fl2va Light4 (VSA FP8 + rank-64 LoRA, unfused) at {} GiB**", _h100_light4("pc_8gb_16gib", "device_peak_gib")),
    ("README.md", "unfused) at 7.07 GiB**, {} s on the H100", _h100_light4("pc_8gb_16gib", "ms", scale=1e-3, digits=1)),
    ("README.md", "**fl2va Light4 at {} GiB**", _h100_light4("pc_12gb_32gib", "device_peak_gib")),
    ("README.md", "**fl2va Light4 at 8.12 GiB**, {} s on the H100", _h100_light4("pc_12gb_32gib", "ms", scale=1e-3, digits=1)),
    ("README.md", "GiB), {} GiB reserved under a 6.4 GiB cap", _h100_shape("pc_8gb_16gib", 0, "peak_reserved_gib")),
    ("README.md", "6.4 GiB cap, host peak RSS {} GiB", _placement("pc_8gb_16gib", "host_peak_rss_gib", "placement_h100.json")),
    ("README.md", "t2va 768x1344x124 at {} GiB as the card counts it** (the allocator held at", _h100_shape("pc_12gb_32gib", 0, "device_peak_gib")),
    ("README.md", "the allocator held at {} GiB for it", _h100_shape("pc_12gb_32gib", 0, "request_cap_gib")),
    ("README.md", "for it; {} GiB over the whole run", _placement("pc_12gb_32gib", "device_peak_gib", "placement_h100.json")),
    ("README.md", "a 12 GB card gives about 11.2 GiB), host peak RSS {} GiB", _placement("pc_12gb_32gib", "host_peak_rss_gib", "placement_h100.json")),
    ("docs/multi_gpu.md", "predicts a {} s 50-step denoise", lambda: f"{_json('multi_gpu_model_h200.json')['predicted']['presets']['exact']['4']['denoise_s']:.1f}"),
    ("README.md", "`offload_24gb`: peak {} GiB reserved", _placement("offload_24gb", "peak_reserved_gib")),
    ("README.md", "GiB reserved, host {} GiB (`offload_40gb`", _placement("offload_24gb", "host_peak_rss_gib")),
    ("README.md", "`resident_80gb`: peak {} GiB reserved", _placement("resident_80gb", "peak_reserved_gib")),
    ("README.md", "host: the weights' {} GiB", _recipe_host("resident")),
    ("README.md", "2.61 s ({}×)", _ratio(E2E, "native_cudnn", "fp8_gemm+vsa_fp8_sp0.8+compile")),
    ("README.md", "= {}x the native forward", _ratio(E2E, "native_cudnn", "fp8_gemm+vsa_fp8_sp0.8+compile")),
    ("README.md", "native cuDNN {} s → VSA bf16 0.8", _seconds(E2E, "native_cudnn")),
    ("README.md", "VSA bf16 0.8: {} s", _seconds(E2E, "vsa_bf16_sp0.8")),
    ("README.md", "VSA FP8 0.8: {} s", _seconds(E2E, "vsa_fp8_sp0.8")),
    ("README.md", "FP8 GEMMs: {} s", _seconds(E2E, "fp8_gemm")),
    ("README.md", "FP8 GEMMs + VSA FP8 0.8: {} s", _seconds(E2E, "fp8_gemm+vsa_fp8_sp0.8")),
    ("README.md", "torch.compile`: **{} s", _seconds(E2E, "fp8_gemm+vsa_fp8_sp0.8+compile")),
    ("README.md", "peak {} GiB vs", _peak(E2E, "fp8_gemm+vsa_fp8_sp0.8+compile")),
    ("README.md", "forward {} s vs 6.00 s with cuDNN", _seconds(FI, "exact_flashinfer")),
    ("README.md", "forward 5.58 s vs {} s with cuDNN", _seconds(FI, "exact")),
    ("README.md", "`fast` forward {} s vs", _seconds(FAST_FI, "fast_flashinfer_fp8")),
    ("README.md", "`fast` forward 4.09 s vs {} s with INT8", _seconds(FAST_FI, "fast")),
    ("docs/attention.md", "native {} s → VSA bf16 0.8", _seconds(E2E, "native_cudnn")),
    ("docs/attention.md", "VSA bf16 0.8 {} s", _seconds(E2E, "vsa_bf16_sp0.8")),
    ("docs/attention.md", "VSA FP8 {} s, FP8 GEMMs", _seconds(E2E, "vsa_fp8_sp0.8")),
    ("docs/attention.md", "FP8 GEMMs + VSA FP8 {} s, with regional compile", _seconds(E2E, "fp8_gemm+vsa_fp8_sp0.8")),
    ("docs/attention.md", "with regional compile {} s", _seconds(E2E, "fp8_gemm+vsa_fp8_sp0.8+compile")),
    ("docs/attention.md", "2.61 s ({}×)", _ratio(E2E, "native_cudnn", "fp8_gemm+vsa_fp8_sp0.8+compile")),
    ("docs/attention.md", "forward {} s eager", _seconds(E2E, "fp8_gemm+vsa_fp8_sp0.8")),
    ("docs/attention.md", "→ {} s compiled", _seconds(E2E, "fp8_gemm+vsa_fp8_sp0.8+compile")),
    ("docs/attention.md", "(native cuDNN {} s)", _seconds(E2E, "native_cudnn")),
    ("docs/attention.md", "~{}× less rounding error than E4M3", _qk_error_ratio),
    ("docs/attention.md", "forward inside the `exact` preset takes {} s", _seconds(FI, "exact_flashinfer")),
    ("docs/attention.md", "takes 5.58 s against {} s", _seconds(FI, "exact")),
    ("docs/quantization.md", "FP8 GEMMs: {} s →", _seconds(E2E, "native_cudnn")),
    ("docs/quantization.md", "→ {} s, peak memory", _seconds(E2E, "fp8_gemm")),
    ("docs/quantization.md", "peak memory {} →", _peak(E2E, "native_cudnn")),
    ("docs/quantization.md", "→ {} GiB", _peak(E2E, "fp8_gemm")),
    ("docs/speed.md", "same-run native {} s", _seconds(FI, "native")),
    ("docs/speed.md", "cuDNN `exact` {} s", _seconds(FI, "exact")),
    ("docs/speed.md", "drops from {} s", _seconds(FI, "exact")),
    ("docs/speed.md", "to **{} s**", _seconds(FI, "exact_flashinfer")),
    ("docs/speed.md", "decoder layers {} run", _text_encoder_layers),
    ("docs/pipeline.md", "took {} s for 46.48 dB", _export("smooth_medium_crf23", "export_s")),
    ("docs/pipeline.md", "took 7.07 s for {} dB", _export("smooth_medium_crf23", "codec_psnr_db")),
    ("docs/pipeline.md", "crf 23 took {} s for 47.13 dB", _export("smooth_superfast_crf23", "export_s")),
    ("docs/pipeline.md", "crf 23 took 1.78 s for {} dB", _export("smooth_superfast_crf23", "codec_psnr_db")),
    ("docs/pipeline.md", "at {} MB instead of 0.57 MB", _export("smooth_superfast_crf23", "size_mb")),
    ("docs/pipeline.md", "at 0.93 MB instead of {} MB", _export("smooth_medium_crf23", "size_mb")),
    ("docs/pipeline.md", "quality at crf 23 ({} dB)", _export("smooth_veryfast_crf23", "codec_psnr_db")),
    ("docs/pipeline.md", "the fastest ({} s)", _export("smooth_ultrafast_crf23", "export_s")),
    ("docs/pipeline.md", "and worse ({} dB)", _export("smooth_ultrafast_crf23", "codec_psnr_db")),
    ("docs/pipeline.md", "`medium` takes {} s against", _export("noise_medium_crf23", "export_s")),
    ("docs/pipeline.md", "against {} s for `superfast`", _export("noise_superfast_crf23", "export_s")),
    ("docs/pipeline.md", "finished {} s after the last chunk", _streamed("streamed")),
    ("docs/pipeline.md", "against {} s for the one-shot export", _streamed("one_shot")),
    ("docs/speed.md", "in the same run): native {} s", _seconds("vae_h200.json", "native")),
    ("docs/speed.md", "batched tiles + compile (`fast`) {} s", _seconds("vae_h200.json", "batched_tiles+compile")),
    ("docs/speed.md", "s at rel-L2 {}; + FP8 decoder linears", _vae("batched_tiles+compile", "rel_l2", ".1e")),
    ("docs/speed.md", "(`fastest` on FP8 GPUs) {} s", _seconds("vae_h200.json", "batched_tiles+compile+fp8")),
    ("docs/speed.md", "s at rel-L2 {}, an approximation", _vae("batched_tiles+compile+fp8", "rel_l2", ".1e")),
    ("docs/speed.md", "tile-batch shape ({} s on the H200", _vae("batched_tiles+compile", "compile_s", ".1f")),
    ("docs/pipeline.md", "`decode_to_video` finished the file {} s after", _streamed_pipeline("streamed")),
    ("docs/pipeline.md", "against {} s for the one-shot `_decode_video`", _streamed_pipeline("one_shot")),
    ("docs/pipeline.md", "file was done after {} s and", _streamed_pipeline("streamed", "after_last_decode_s")),
    ("docs/pipeline.md", "the one-shot after {} s: on a CPU", _streamed_pipeline("one_shot", "after_last_decode_s")),
]


def _normalized(text):
    return " ".join(text.split())


@pytest.mark.parametrize("document, quote, figure", QUOTES, ids=[f"{d}: {q}" for d, q, _ in QUOTES])
def test_quoted_figure_is_the_measured_one(document, quote, figure):
    text = _normalized((ROOT / document).read_text())
    expected = quote.format(figure())
    assert _normalized(expected) in text, f"{document} should quote {expected!r} (from benchmarks/results)"
