"""A model of MiniMax-H3's request time on consumer GPUs, from what one H200 measured: PREDICTED, not measured.

    python benchmarks/consumer_model.py --out benchmarks/results/consumer_model.json \\
        --plot benchmarks/results/consumer_model.png --readme README.md
    python benchmarks/placement.py --recipe-table diffusers_h3/parallel/memory_recipes.json   # the table's copy

No GPU is used: the script reads the committed results and NVIDIA's published specs (``GPUS``, each with its source).

What a request does, per stage, and how each stage is carried to another GPU:

* **DiT forward** (768x1344x124 t2va: 38,222 packed rows; fl2va: 42,284). Its FLOPs are counted from the shapes
  (``forward_flops``): per block the four GEMMs of ``gemm_h200.json`` (2·M·K·N each) and dense attention
  (4·S²·heads·head_dim, the count ``attention_h200.json`` reports its TFLOP/s with). On the H200 the native forward
  (``forward_h200.json``) splits into GEMM time (``gemm_h200.json``, in the recipe's weight format), attention time
  (the cuDNN core of ``attention_h200.json``) and the rest (norms, modulation, rotary: memory-bound). Another GPU
  runs the GEMMs and attention at the H200's time x (H200 dense bf16 TFLOP/s / its own) and the rest at x (H200
  memory bandwidth / its own): the same fraction of peak as the H200 reached. The weights a recipe does not keep on
  the GPU arrive every forward (read ahead, overlapped with compute): the forward takes the longer of its compute and
  that transfer (PCIe from host memory; from an NVMe drive, the slower of the drive and PCIe).
* **Text encode** (W8A16 Qwen3-VL-32B, 51 layers, 512 tokens): 2 x weights x tokens FLOPs, or its weights' transfer
  when they stream (from disk for ``low_ram``, from host memory for ``offload``), whichever is longer.
* **Video decode**: the H200's native bf16 tiled decode (``vae_h200.json``) scaled by TFLOP/s (its GEMMs dominate:
  ``vae_h200.json`` notes), plus the VAE's transfer when it is offloaded. **Audio decode** likewise (the resident
  H200 case's stage of ``placement_h200.json``).
* **What the model does not explain**: for each stage, the H200 measurement of the same recipe
  (``placement_h200.json``) minus the model's H200 figure, when positive, is added unchanged on every GPU (hook
  synchronization, host-side work). So each measured recipe's H200 request is reproduced; the recipes not measured
  yet take the ``low_ram`` case's.

Requests: t2va 50 steps = text encode + 49 forwards + decodes + the rest; the 4-step LoRA (LightX2V Turbo 4-step,
"Light4") = 4 forwards; fl2va Light4 adds the first-frame encode (``request_h200.json``'s condition encode, scaled by
TFLOP/s). The LoRA's own GEMMs are not counted (low rank: small next to the 5376-wide layers).

A recipe fits a card when its measured GPU need (peak reserved) is at most the card's memory less what ``--memory auto``
leaves (the CUDA context and ``GPU_MARGIN_GIB``); recipes not measured yet (``PLANNED``) are listed for the cards
their cap targets and larger, with memory "to be measured".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
GiB = 2**30
NVME_GB_S = (3.5, 7.0)  # a PCIe 3.0 x4 and a PCIe 4.0 x4 drive's sequential read
PCIE_EFFICIENCY = 0.8  # host-to-device copies reach about 80 % of the link's raw rate (PCIe 4.0 x16: ~25 GB/s)
PCIE_RAW_GB_S = {(3, 16): 15.75, (4, 8): 15.75, (4, 16): 31.5, (5, 16): 63.0}
CONTEXT_GIB = 0.4  # the CUDA context of a consumer card before anything is allocated (driver-dependent)
ROWS_T2VA, ROWS_FL2VA = 38222, 42284
TEXT_TOKENS = 512
BLOCKS, HIDDEN, ATTENTION_WIDTH = 50, 5376, 56 * 128

SPEC_SOURCES = {
    "ampere": "https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf",
    "ada": "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf",
    "blackwell": "https://images.nvidia.com/aem-dam/Solutions/geforce/blackwell/nvidia-rtx-blackwell-gpu-architecture.pdf",
    "fp32_accumulate": "https://github.com/pytorch/pytorch/issues/123157",
}
# Dense bf16 tensor FLOP/s with FP32 accumulation (what PyTorch's bf16 matmul and attention use): on GeForce cards
# half the FP16-accumulate rate; per SM and clock 512 FLOP on Ampere GA10x, Ada and GeForce Blackwell (the
# whitepapers' "Peak FP16 Tensor TFLOPS with FP32 Accumulate", e.g. RTX 4090 165.2, RTX 4080 97.5), so
# SMs x boost clock x 512. Memory bandwidth, PCIe link, SMs and boost clock: NVIDIA's product pages.
GPUS = [
    {"name": "RTX 3060 12 GB", "cuda_name": "NVIDIA GeForce RTX 3060", "architecture": "ampere", "capability": [8, 6],
     "sms": 28, "boost_ghz": 1.777, "memory_gib": 12, "memory_bandwidth_gb_s": 360.0, "pcie": [4, 16],
     "source": "https://www.nvidia.com/en-us/geforce/graphics-cards/30-series/rtx-3060-3060ti/"},
    {"name": "RTX 4060 Ti 16 GB", "cuda_name": "NVIDIA GeForce RTX 4060 Ti", "architecture": "ada",
     "capability": [8, 9], "sms": 34, "boost_ghz": 2.535, "memory_gib": 16, "memory_bandwidth_gb_s": 288.0,
     "pcie": [4, 8], "source": "https://www.nvidia.com/en-us/geforce/graphics-cards/40-series/rtx-4060-4060ti/"},
    {"name": "RTX 4070 12 GB", "cuda_name": "NVIDIA GeForce RTX 4070", "architecture": "ada", "capability": [8, 9],
     "sms": 46, "boost_ghz": 2.475, "memory_gib": 12, "memory_bandwidth_gb_s": 504.2, "pcie": [4, 16],
     "source": "https://www.nvidia.com/en-us/geforce/graphics-cards/40-series/rtx-4070-family/"},
    {"name": "RTX 4080 16 GB", "cuda_name": "NVIDIA GeForce RTX 4080", "architecture": "ada", "capability": [8, 9],
     "sms": 76, "boost_ghz": 2.505, "memory_gib": 16, "memory_bandwidth_gb_s": 716.8, "pcie": [4, 16],
     "source": "https://www.nvidia.com/en-us/geforce/graphics-cards/40-series/rtx-4080-family/"},
    {"name": "RTX 4090 24 GB", "cuda_name": "NVIDIA GeForce RTX 4090", "architecture": "ada", "capability": [8, 9],
     "sms": 128, "boost_ghz": 2.52, "memory_gib": 24, "memory_bandwidth_gb_s": 1008.0, "pcie": [4, 16],
     "source": "https://www.nvidia.com/en-us/geforce/graphics-cards/40-series/rtx-4090/"},
    {"name": "RTX 5090 32 GB", "cuda_name": "NVIDIA GeForce RTX 5090", "architecture": "blackwell",
     "capability": [12, 0], "sms": 170, "boost_ghz": 2.407, "memory_gib": 32, "memory_bandwidth_gb_s": 1792.0,
     "pcie": [5, 16], "source": "https://www.nvidia.com/en-us/geforce/graphics-cards/50-series/rtx-5090/"},
]  # fmt: skip
TENSOR_FLOP_PER_SM_CLOCK = 512  # dense bf16/fp16 with FP32 accumulate, GeForce (see above)
H200 = {"name": "H200 (SXM)", "bf16_dense_tflops": 989.4, "memory_bandwidth_gb_s": 4800.0, "pcie": [5, 16],
        "source": "https://www.nvidia.com/en-us/data-center/h200/ (1,979 TFLOP/s bf16 with sparsity: half dense)"}  # fmt: skip
# Recipes the lead measures next (benchmarks/placement.py): DiT, text encoder and video VAE streamed from disk.
PLANNED = {
    "pc_8gb_16gib": {"recipe": "low_ram", "cap_gib": 7.5, "host_target_gib": 12.0, "pc_ram_gib": 16},
    "pc_12gb_32gib": {"recipe": "low_ram", "cap_gib": 11.5, "host_target_gib": 20.0, "pc_ram_gib": 32},
}
LORA_FORWARDS = 4  # the LightX2V Turbo 4-step LoRA: 5 sigma points, 4 forwards


def load(name):
    return json.loads((RESULTS / name).read_text())


def dense_tflops(gpu):
    return round(gpu["sms"] * gpu["boost_ghz"] * 1e9 * TENSOR_FLOP_PER_SM_CLOCK / 1e12, 1)


def pcie_gb_s(link):
    return round(PCIE_RAW_GB_S[tuple(link)] * PCIE_EFFICIENCY, 1)


def forward_flops(rows):
    """``(gemm, attention)`` FLOPs of one 50-block forward on ``rows`` packed rows (dense attention)."""
    gemm = load("gemm_h200.json")["shape"]["gemms"]
    per_block = sum(2 * rows * g["K"] * g["N"] for g in gemm.values())
    return BLOCKS * per_block, BLOCKS * 4 * rows * rows * ATTENTION_WIDTH


def h200_forward_split(weight_format):
    """The H200's native forward in seconds: GEMMs in ``weight_format`` (``bf16``, ``w8a16``, ``nvfp4``), attention,
    and the rest (the measured forward less the two)."""
    gemm = load("gemm_h200.json")["cases"]
    gemm_s = BLOCKS * sum(gemm[f"{weight_format}_{name}"]["ms"] for name in ("qkv", "out", "ffn_up", "ffn_down")) / 1e3
    bf16_s = BLOCKS * sum(gemm[f"bf16_{name}"]["ms"] for name in ("qkv", "out", "ffn_up", "ffn_down")) / 1e3
    attention_s = BLOCKS * load("attention_h200.json")["cases"]["cudnn_dense"]["ms"] / 1e3
    native_s = load("forward_h200.json")["cases"]["native"]["ms"] / 1e3
    return {"gemm_s": gemm_s, "attention_s": attention_s, "rest_s": native_s - bf16_s - attention_s}


RECIPE_WEIGHTS = {"resident": "bf16", "offload": "w8a16", "low_ram": "nvfp4"}  # the GEMM path each recipe's DiT runs


def case_traffic(case_name, case, planned):
    """Where each component's weights come from during a request (``gpu``, ``host``: host memory over PCIe,
    ``disk``: the checkpoint's files) and their GiB."""
    if planned:  # the lead's pc recipes: everything big streams from the converted checkpoint's files
        written = load("placement_h200.json")["cases"]["low_ram_16gb"]["checkpoint"]["written_gib"]
        return {name: {"from": "disk", "gib": written[name]} for name in ("transformer", "text_encoder", "vae")} | {
            "audio_vae": {"from": "host", "gib": written["audio_vae"]}}
    placements = case.get("placements") or {}
    weights = dict(case.get("weights_gib") or {})
    weights.update((case.get("checkpoint") or {}).get("written_gib") or {})  # a streamed text encoder holds no weights
    out = {}
    for name in ("transformer", "text_encoder", "vae", "audio_vae"):
        where = placements.get(name, "") if isinstance(placements, dict) else ""
        if case_name.startswith("resident"):
            source = "gpu"
        elif "checkpoint files" in where or "to disk" in where:
            source = "disk"
        else:
            source = "host"
        out[name] = {"from": source, "gib": weights[name]}
    return out


def transfer_s(gib, source, gpu_pcie, nvme):
    if source == "gpu":
        return 0.0
    rate = gpu_pcie if source == "host" else min(gpu_pcie, nvme)
    return gib * GiB / (rate * 1e9)


def stage_model(gpu, traffic, weight_format, nvme):
    """The physical part of each stage on ``gpu`` (seconds): compute scaled from the H200, transfers at its links."""
    compute = H200["bf16_dense_tflops"] / gpu["bf16_dense_tflops"]
    memory = H200["memory_bandwidth_gb_s"] / gpu["memory_bandwidth_gb_s"]
    link = gpu["pcie_effective_gb_s"]
    split = h200_forward_split(weight_format)
    gemm_t2va, attention_t2va = forward_flops(ROWS_T2VA)
    gemm_fl2va, attention_fl2va = forward_flops(ROWS_FL2VA)
    dit = transfer_s(traffic["transformer"]["gib"], traffic["transformer"]["from"], link, nvme)

    def forward(gemm_scale, attention_scale):
        work = (split["gemm_s"] * gemm_scale + split["attention_s"] * attention_scale) * compute
        work += split["rest_s"] * gemm_scale * memory  # the rest grows with the rows, like the GEMMs
        return max(work, dit)

    te_flops = 2 * traffic["text_encoder"]["gib"] * GiB * TEXT_TOKENS  # ~1 byte per W8A16 weight
    te_compute = te_flops / (gpu["bf16_dense_tflops"] * 1e12 * 0.5)  # at half the peak: small GEMMs (512 rows)
    vae = load("vae_h200.json")["cases"]["native"]["ms"] / 1e3
    audio = load("placement_h200.json")["cases"]["resident_80gb"]["stages"]["audio_decode"] / 1e3
    condition = load("request_h200.json")["cases"]["fl2va_light4_fastest"]["stages"]["condition_encode"] / 1e3
    return {
        "text_encode": max(te_compute, transfer_s(traffic["text_encoder"]["gib"], traffic["text_encoder"]["from"],
                                                  link, nvme)),
        "forward": forward(1.0, 1.0),
        "forward_fl2va": forward(gemm_fl2va / gemm_t2va, attention_fl2va / attention_t2va),
        "video_decode": vae * compute + transfer_s(traffic["vae"]["gib"], traffic["vae"]["from"], link, nvme),
        "audio_decode": audio * compute + transfer_s(traffic["audio_vae"]["gib"], traffic["audio_vae"]["from"], link,
                                                     nvme),
        "condition_encode": condition * compute,
        "forward_bound": "compute" if forward(1.0, 1.0) > dit else f"weights from {traffic['transformer']['from']}",
    }  # fmt: skip


H200_DISK_GB_S = 7.0  # the H200 host's local NVMe read rate assumed when carrying its measurement over


def unexplained(case, traffic, weight_format):
    """Per stage, the H200 measurement of ``case`` less the model's H200 figure (>= 0): kept on every GPU."""
    h200 = {**H200, "pcie_effective_gb_s": pcie_gb_s(H200["pcie"])}
    model = stage_model(h200, traffic, weight_format, H200_DISK_GB_S)
    from diffusers_h3.parallel.memory_recipes import case_forward_ms

    stages = case["stages"]
    forward = case_forward_ms(case)
    return {
        "text_encode": max(0.0, stages["text_encode"] / 1e3 - model["text_encode"]),
        "forward": max(0.0, forward / 1e3 - model["forward"]),
        "video_decode": max(0.0, stages["video_decode"] / 1e3 - model["video_decode"]),
        "audio_decode": max(0.0, stages["audio_decode"] / 1e3 - model["audio_decode"]),
        "other": stages["other"] / 1e3,
    }


def predict(gpu, traffic, weight_format, extra, nvme):
    stage = stage_model(gpu, traffic, weight_format, nvme)
    forward = stage["forward"] + extra["forward"]
    forward_fl2va = stage["forward_fl2va"] + extra["forward"]
    fixed = (stage["text_encode"] + extra["text_encode"] + stage["video_decode"] + extra["video_decode"]
             + stage["audio_decode"] + extra["audio_decode"] + extra["other"])  # fmt: skip
    return {
        "forward_s": round(forward, 1),
        "forward_fl2va_s": round(forward_fl2va, 1),
        "forward_bound": stage["forward_bound"],
        "stages_s": {"text_encode": round(stage["text_encode"] + extra["text_encode"], 1),
                     "video_decode": round(stage["video_decode"] + extra["video_decode"], 1),
                     "audio_decode": round(stage["audio_decode"] + extra["audio_decode"], 1),
                     "condition_encode": round(stage["condition_encode"], 1), "other": round(extra["other"], 1)},
        "t2va_50_s": round(fixed + 49 * forward, 1),
        "t2va_4step_s": round(fixed + LORA_FORWARDS * forward, 1),
        "fl2va_light4_s": round(fixed + stage["condition_encode"] + LORA_FORWARDS * forward_fl2va, 1),
    }  # fmt: skip


def build(placement, memory_results=None):
    """The GPUs, cases and predictions. Times come from ``placement`` (the H200's measurements the model carries
    over); each case's memory needs from ``memory_results`` (default: ``placement``; a merged result whose newer
    cases, e.g. the PC recipes re-measured on an H100 as the card counts it, replace the H200's)."""
    sys.path.insert(0, str(ROOT))
    from diffusers_h3.parallel.memory_recipes import GPU_MARGIN_GIB, derive_recipe_table

    gpus = []
    for gpu in GPUS:
        gpus.append({**{k: v for k, v in gpu.items() if k != "source"}, "bf16_dense_tflops": dense_tflops(gpu),
                     "pcie_effective_gb_s": pcie_gb_s(gpu["pcie"]),
                     "bf16_basis": f"{gpu['sms']} SMs x {gpu['boost_ghz']} GHz boost x {TENSOR_FLOP_PER_SM_CLOCK} "
                                   "FLOP/clock (dense, FP32 accumulate)",
                     "sources": [gpu["source"], SPEC_SOURCES[gpu["architecture"]], SPEC_SOURCES["fp32_accumulate"]]})  # fmt: skip
    h200_times = {entry["case"]: entry["request_s"] for entry in derive_recipe_table(placement)["recipes"]}
    table = derive_recipe_table(memory_results or placement)["recipes"]
    cases = {}
    for entry in table:
        if entry["case"] not in h200_times:
            continue  # no H200 measurement to carry the times over from
        case = placement["cases"][entry["case"]]
        cases[entry["case"]] = {"recipe": entry["recipe"], "measured_memory": True, "gpu_gib": entry["gpu_gib"],
                                "host_gib": entry["host_gib"], "cap_gib": entry["cap_gib"],
                                "memory_measured_on": short_device(entry.get("device") or placement.get("device")),
                                "traffic": case_traffic(entry["case"], case, planned=False),
                                "h200_request_s": h200_times[entry["case"]], "unexplained_from": entry["case"]}  # fmt: skip
    for name, plan in PLANNED.items():
        if name in cases:
            continue  # measured since: its table entry above
        cases[name] = {"recipe": plan["recipe"], "measured_memory": False, "gpu_gib": None, "host_gib": None,
                       "cap_gib": plan["cap_gib"], "host_target_gib": plan["host_target_gib"],
                       "pc_ram_gib": plan["pc_ram_gib"],
                       "traffic": case_traffic(name, None, planned=True), "unexplained_from": "low_ram_16gb"}  # fmt: skip
    rows = []
    for gpu in gpus:
        usable = gpu["memory_gib"] - CONTEXT_GIB - GPU_MARGIN_GIB
        for name, case in cases.items():
            need = case["gpu_gib"] if case["measured_memory"] else case["cap_gib"]
            if need > usable and case["measured_memory"]:
                continue
            if not case["measured_memory"] and case["cap_gib"] > gpu["memory_gib"]:
                continue  # a planned recipe for a larger card
            fmt = RECIPE_WEIGHTS[case["recipe"]]
            extra = unexplained(placement["cases"][case["unexplained_from"]],
                                cases[case["unexplained_from"]]["traffic"], fmt)  # fmt: skip
            for nvme in NVME_GB_S:
                rows.append({"gpu": gpu["name"], "case": name, "recipe": case["recipe"], "nvme_gb_s": nvme,
                             "measured_memory": case["measured_memory"], "gpu_need_gib": need,
                             "gpu_usable_gib": round(usable, 2),
                             "fits": "measured" if case["measured_memory"] else
                                     ("by its cap" if need <= usable else "only if measured below its cap"),
                             **predict(gpu, case["traffic"], fmt, extra, nvme)})  # fmt: skip
    t2va_gemm, t2va_attention = forward_flops(ROWS_T2VA)
    return gpus, cases, rows, {"forward_flops_t2va": {"gemm": t2va_gemm, "attention": t2va_attention},
                               "forward_flops_fl2va": dict(zip(("gemm", "attention"), forward_flops(ROWS_FL2VA))),
                               "h200_forward_split_s": {f: {k: round(v, 3) for k, v in h200_forward_split(f).items()}
                                                        for f in ("bf16", "w8a16", "nvfp4")}}  # fmt: skip


def measured_inputs():
    """The H200 placement result (the times carried over) and the same merged with the H100's (the memory needs of
    the cases re-measured there, as the card counts it)."""
    sys.path.insert(0, str(ROOT))
    from diffusers_h3.parallel.memory_recipes import merged_placement_results

    placement = load("placement_h200.json")
    return placement, merged_placement_results(placement, [load("placement_h100.json")])


def short_device(device):
    """``NVIDIA H100 80GB HBM3`` -> ``H100``."""
    sys.path.insert(0, str(ROOT))
    from diffusers_h3._utils import gpu_model_name

    return gpu_model_name(device) or device or "unknown device"


def plot(rows, gpus, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), dpi=90, sharey=True)
    names = [g["name"] for g in gpus]
    for ax, key, title in ((axes[0], "t2va_50_s", "t2va, 50 steps"), (axes[1], "fl2va_light4_s", "fl2va, Light4 LoRA (4 forwards)")):
        for offset, nvme in ((-0.2, 3.5), (0.2, 7.0)):
            best = []
            for name in names:
                times = [r[key] for r in rows if r["gpu"] == name and r["nvme_gb_s"] == nvme]
                best.append(min(times) / 60 if times else 0)
            ax.bar([i + offset for i in range(len(names))], best, width=0.4, label=f"NVMe {nvme:g} GB/s")
        ax.set_title(f"{title}: PREDICTED")
        ax.set_xticks(range(len(names)), [n.replace(" GB", "") for n in names], rotation=30, fontsize=7)
        ax.set_yscale("log")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("minutes per request (fastest fitting recipe)")
    axes[1].legend(fontsize=7)
    fig.suptitle("MiniMax-H3 768x1344x124 on consumer GPUs: predicted from H200 measurements (not measured)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


README_START = "<!-- consumer GPUs: generated by `python benchmarks/consumer_model.py --readme README.md` -->"
README_END = "<!-- end of consumer GPUs -->"


def _minutes(seconds):
    return f"{seconds / 60:.0f} min" if seconds >= 600 else f"{seconds / 60:.1f} min"


PC_RAM_GIB = 16  # the README lists, per card, the fastest entry that fits a PC of this much RAM as well


def readme_rows(report):
    """The README's consumer-GPU rows: per card, the fastest measured table entry that fits it (with the RAM it
    needs: its host need plus ``--memory auto``'s headroom) and the PC recipes still to be measured, each with its
    predicted request times at the slower drive."""
    sys.path.insert(0, str(ROOT))
    from diffusers_h3.parallel.memory_recipes import HOST_HEADROOM_GIB

    nvme = min(report["nvme_gb_s"])
    lines = ["| GPU (link) | RAM | recipe: GPU / host need | t2va, 50 steps | fl2va, Light4 LoRA |", "|---|---|---|---|---|"]
    for gpu in report["gpus"]:
        rows = [r for r in report["predictions"] if r["gpu"] == gpu["name"] and r["nvme_gb_s"] == nvme]
        link = f"PCIe {gpu['pcie'][0]}.0 x{gpu['pcie'][1]}"
        fastest = min((r for r in rows if r["measured_memory"]), key=lambda r: r["t2va_50_s"], default=None)
        small_ram = min((r for r in rows if r["measured_memory"] and report["cases"][r["case"]]["host_gib"]
                         + HOST_HEADROOM_GIB <= PC_RAM_GIB), key=lambda r: r["t2va_50_s"], default=None)  # fmt: skip
        chosen = [fastest] + ([small_ram] if small_ram is not None and small_ram is not fastest else [])
        for measured in (r for r in chosen if r is not None):  # a 16 GiB PC's row too
            case = report["cases"][measured["case"]]
            ram = int(-(-(case["host_gib"] + HOST_HEADROOM_GIB) // 1))
            lines.append(f"| {gpu['name']} ({link}) | ≥ {ram} GiB | `{case['recipe']}` as `{measured['case']}`: "
                         f"{case['gpu_gib']:.2f} / {case['host_gib']:.2f} GiB (measured on an "
                         f"{case.get('memory_measured_on', 'H200')}) | "
                         f"{_minutes(measured['t2va_50_s'])} (predicted) | {_minutes(measured['fl2va_light4_s'])} "
                         "(predicted) |")  # fmt: skip
        planned = [r for r in rows if not r["measured_memory"]]
        if planned:  # one row: the PC recipes still to be measured (their predicted times are the slower one's)
            cases = [report["cases"][r["case"]] | {"name": r["case"]} for r in planned]
            rams = " / ".join(f"{c['pc_ram_gib']} GiB" for c in cases)
            said = ", ".join(f"`{c['name']}` (cap {c['cap_gib']:g}, host ≤ {c['host_target_gib']:g} GiB)" for c in cases)
            slow = max(planned, key=lambda r: r["t2va_50_s"])
            lines.append(f"| {gpu['name']} ({link}) | {rams} | `low_ram` as {said}: **to be measured** | "
                         f"{_minutes(slow['t2va_50_s'])} (predicted) | {_minutes(slow['fl2va_light4_s'])} "
                         "(predicted) |")  # fmt: skip
    return lines


def write_readme_rows(report, path):
    """Replace the block between ``README_START`` and ``README_END`` in ``path`` with :func:`readme_rows`."""
    text = Path(path).read_text()
    start, end = text.index(README_START), text.index(README_END)
    block = "\n".join([README_START, *readme_rows(report), README_END])
    Path(path).write_text(text[:start] + block + text[end + len(README_END):])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(RESULTS / "consumer_model.json"))
    parser.add_argument("--plot", default=None, help="also draw the PNG (needs matplotlib: the bench extra)")
    parser.add_argument("--commit", default=None)
    parser.add_argument("--readme", default=None, metavar="README.md",
                        help="rewrite the consumer-GPU rows of this README from the result (between its markers)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import result_header, write_json

    placement, memory = measured_inputs()
    gpus, cases, rows, inputs = build(placement, memory)
    header = result_header("consumer_model", args.commit, device="none: a model of measurements and specs")
    report = {
        **header,
        "label": "PREDICTED request times, not measured on these GPUs",
        "model": __doc__.split("\n\n", 3)[3].strip(),
        "inputs": {"files": ["forward_h200.json", "gemm_h200.json", "attention_h200.json", "vae_h200.json",
                             "request_h200.json", "placement_h200.json", "placement_h100.json (memory needs of its "
                             "cases)"], **inputs,
                   "placement_commit": placement.get("commit"), "memory_commit": memory["cases"].get(
                       "pc_8gb_16gib", {}).get("commit")},
        "assumptions": {"nvme_gb_s": list(NVME_GB_S), "pcie_efficiency": PCIE_EFFICIENCY,
                        "context_gib": CONTEXT_GIB, "h200_disk_gb_s": H200_DISK_GB_S,
                        "same_fraction_of_peak_as_the_h200": True, "read_ahead_overlaps_transfer_and_compute": True,
                        "lora_gemms_counted": False},
        "nvme_gb_s": list(NVME_GB_S),
        "reference_gpu": {**H200, "pcie_effective_gb_s": pcie_gb_s(H200["pcie"])},
        "gpus": gpus,
        "cases": cases,
        "predictions": rows,
    }  # fmt: skip
    write_json(args.out, report)
    if args.plot:
        plot(rows, gpus, args.plot)
    if args.readme:
        write_readme_rows(json.loads(Path(args.out).read_text()), args.readme)
    for gpu in gpus:
        fitting = [r for r in rows if r["gpu"] == gpu["name"] and r["nvme_gb_s"] == NVME_GB_S[0]]
        best = min(fitting, key=lambda r: r["t2va_50_s"], default=None)
        said = f"{best['case']}: t2va {best['t2va_50_s'] / 60:.0f} min, fl2va Light4 {best['fl2va_light4_s'] / 60:.1f} min" \
            if best else "nothing fits"  # fmt: skip
        print(f"{gpu['name']:18s} {gpu['bf16_dense_tflops']:6.1f} TFLOP/s  {said} (predicted)")


if __name__ == "__main__":
    main()
