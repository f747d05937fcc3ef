"""What single-file DiTs cost: GEMM time at MiniMax-H3 prefill shapes and the DiT's weight memory per file format.

    python benchmarks/single_file.py --out benchmarks/results/single_file_h200.json     # GPU
    python benchmarks/single_file.py --tiny --out /tmp/single_file_cpu.json             # CPU smoke run
    python benchmarks/single_file.py --memory-only --out benchmarks/results/single_file_memory.json   # CPU: memory

Cases ``<format>_<gemm>`` for format in bf16 (``nn.Linear``, cuBLAS), the GGUF types Q8_0 / Q6_K / Q5_K / Q4_K
(diffusers' ``GGUFLinear``: every call dequantizes the weight, then a 16-bit matmul) and fp8_scaled (``FP8Tensor``
holding a ComfyUI fp8-scaled layer, one scale per tensor: per-token FP8 activations + ``torch._scaled_mm``), and gemm
in qkv (5376->21504), out (7168->5376), ffn_up (5376->28672), ffn_down (14336->5376), at M = 38,222 rows, measured in
the same run: warm-up, then the median of CUDA-event timings; ``ratio`` = bf16 ms / case ms; ``rel_l2`` against the
bf16 matmul with the same (dequantized) weight; ``peak_gib`` = the largest allocation during the case (the GGUF
dequantization scratch included). Weights are random valid blocks (GGUF) and random codes (FP8).

``dit_gemm_<format>`` = 50 x the four GEMMs (derived: the DiT's block GEMMs per forward, the AdaLN's one-row GEMMs
left out). ``weights_<format>``: the full 50-block DiT's weight memory as that file format holds it, **computed** from
the config on the meta device (ComfyUI-GGUF's plan: the block linears in the type, or in llama.cpp's fallback type
where their width does not block (the 2688-wide AdaLN of K-quant files: Q5_0 for Q4_K, Q5_1 for Q5_K, Q8_0 for Q6_K),
the refiner and the text projection F16, 1-D tensors and the float32 modules F32; ComfyUI's fp8-scaled: the block linears E4M3 + one scale each, the
rest bf16 / float32).
"""


from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from _common import cuda_median_ms, rel_l2, result_header, write_json


M_ROWS = 38222
GEMMS = {"qkv": (5376, 21504), "out": (7168, 5376), "ffn_up": (5376, 28672), "ffn_down": (14336, 5376)}
TINY_GEMMS = {"qkv": (256, 384), "out": (256, 128), "ffn_up": (256, 256), "ffn_down": (256, 128)}
GGUF_TYPES = ("Q8_0", "Q6_K", "Q5_K", "Q4_K")
GIB = 1024**3


def gguf_layer(kind: str, k: int, n: int, dtype, device, rng):
    """A diffusers ``GGUFLinear`` holding random valid ``kind`` blocks, and its dequantized weight."""
    import gguf
    from diffusers.quantizers.gguf.utils import GGUFLinear, GGUFParameter, dequantize_gguf_tensor

    from diffusers_h3.testing.single_file import random_gguf_blocks

    blocks = torch.from_numpy(random_gguf_blocks(n, k, kind, rng))
    with torch.device("meta"):
        layer = GGUFLinear(k, n, bias=False, compute_dtype=dtype)
    layer.weight = GGUFParameter(blocks.to(device), quant_type=gguf.GGMLQuantizationType[kind])
    return layer, dequantize_gguf_tensor(layer.weight).to(dtype)


def fp8_scaled_layer(k: int, n: int, dtype, device):
    """An ``nn.Linear`` with an FP8 weight loaded as from a ComfyUI fp8-scaled file (E4M3 codes, one float32
    scale), and its dequantized weight."""
    from diffusers_h3.quantizers import FP8Tensor, install_quantized_weight

    dense = torch.randn(n, k, device=device) * 0.02
    scale = dense.abs().amax() / 448.0
    layer = torch.nn.Linear(k, n, bias=False, device="meta")
    weight = FP8Tensor.from_storage({"weight": (dense / scale).to(torch.float8_e4m3fn), "weight_scale": scale.reshape(1)},
                                    n, k, dtype)  # fmt: skip
    install_quantized_weight(layer, weight)
    return layer, weight.dequantize(dtype)


def time_ms(fn, device, reps):
    if device.type == "cuda":
        return cuda_median_ms(fn, warmup=2, reps=reps)
    import time

    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) * 1000 / reps


def weight_memory(config=None) -> dict:
    """Bytes of the H3 DiT's weights in each file format, computed on the meta device (no allocation)."""
    import gguf
    from diffusers import MiniMaxH3Transformer3DModel

    from diffusers_h3.testing.single_file import GGUF_FALLBACK

    with torch.device("meta"):
        model = MiniMaxH3Transformer3DModel(**(config or {}))
    keep32 = model._keep_in_fp32_modules or []
    linears = {n for n, m in model.named_modules() if type(m) is torch.nn.Linear}

    def plan(name, p, fmt):
        module = name.rpartition(".")[0]
        block_linear = name.startswith("transformer_blocks.") and module in linears and name.endswith(".weight")
        fp32 = any(k in name.split(".") for k in keep32)
        if fmt == "bf16":
            return p.numel() * (4 if fp32 else 2)
        if fmt == "fp8_scaled":
            return p.numel() + 4 if block_linear else p.numel() * (4 if fp32 else 2)
        for kind in (fmt, GGUF_FALLBACK.get(fmt)):
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]] if kind else (0, 0)
            if block_linear and kind and p.shape[-1] % block == 0:
                return p.numel() // block * size
        return p.numel() * (4 if fp32 or p.dim() == 1 or p.numel() <= 1024 else 2)

    return {fmt: sum(plan(n, p, fmt) for n, p in model.named_parameters()) for fmt in ("bf16", "fp8_scaled", *GGUF_TYPES)}


def main(argv=None) -> int:
    from diffusers_h3.quantizers import describe_layer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="results JSON")
    parser.add_argument("--tiny", action="store_true", help="small shapes on the CPU (a smoke run, not a measurement)")
    parser.add_argument("--rows", type=int, default=None, help=f"GEMM rows (default {M_ROWS}; --tiny: 64)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--memory-only", action="store_true", help="only the full-size DiT's computed weight memory")
    args = parser.parse_args(argv)
    if args.memory_only:
        cases = {f"weights_{fmt}": {"ms": None, "baseline": None, "ratio": None, "rel_l2": None, "peak_gib": size / GIB,
                                    "notes": "computed from the config (not measured)"}
                 for fmt, size in weight_memory().items()}  # fmt: skip
        write_json(args.out, {**result_header("single_file_memory", args.commit, device="none (computed)"),
                              "shape": {"model": "MiniMax-H3 DiT, 50 blocks"}, "cases": cases})  # fmt: skip
        return 0
    if not args.tiny and not torch.cuda.is_available():
        print("benchmarks/single_file.py needs a CUDA GPU (or --tiny)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    rows = args.rows or (64 if args.tiny else M_ROWS)
    gemms = TINY_GEMMS if args.tiny else GEMMS
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    cases = {}
    for gemm, (k, n) in gemms.items():
        x = torch.randn(rows, k, device=device, dtype=dtype)
        bf16_layer = torch.nn.Linear(k, n, bias=False, device=device, dtype=dtype)
        base_ms = time_ms(lambda: bf16_layer(x), device, args.reps)
        cases[f"bf16_{gemm}"] = {"ms": base_ms, "baseline": base_ms, "ratio": 1.0, "rel_l2": 0.0, "peak_gib": None,
                                 "path": "nn.Linear (cuBLAS)"}  # fmt: skip
        builders = [(kind, lambda kind=kind: gguf_layer(kind, k, n, dtype, device, rng)) for kind in GGUF_TYPES]
        builders.append(("fp8_scaled", lambda: fp8_scaled_layer(k, n, dtype, device)))
        for fmt, build in builders:
            layer, weight = build()
            reference = x @ weight.T
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            with torch.no_grad():
                ms = time_ms(lambda layer=layer: layer(x), device, args.reps)
                out = layer(x)
            peak = torch.cuda.max_memory_allocated() / GIB if device.type == "cuda" else None
            path = describe_layer(layer) or "GGUFLinear: dequantize + matmul"
            cases[f"{fmt}_{gemm}"] = {"ms": ms, "baseline": base_ms, "ratio": base_ms / ms,
                                      "rel_l2": rel_l2(out, reference), "peak_gib": peak, "path": path}  # fmt: skip
            del layer, weight, reference, out
    for fmt in ("bf16", "fp8_scaled", *GGUF_TYPES):
        ms = 50 * sum(cases[f"{fmt}_{g}"]["ms"] for g in gemms)
        base = 50 * sum(cases[f"bf16_{g}"]["ms"] for g in gemms)
        cases[f"dit_gemm_{fmt}"] = {"ms": ms, "baseline": base, "ratio": base / ms, "rel_l2": None, "peak_gib": None,
                                    "notes": "derived: 50 x the four block GEMMs of this run"}  # fmt: skip
    config = {"num_layers": 2, "hidden_size": 256, "attention_head_dim": 128, "ffn_dim": 256} if args.tiny else None
    for fmt, size in weight_memory(config).items():
        cases[f"weights_{fmt}"] = {"ms": None, "baseline": None, "ratio": None, "rel_l2": None, "peak_gib": size / GIB,
                                   "notes": "computed from the config (not measured)"}  # fmt: skip
    data = {**result_header("single_file", args.commit), "shape": {"rows": rows, "gemms": gemms, "dtype": str(dtype)},
            "cases": cases}  # fmt: skip
    write_json(args.out, data)
    for name, case in cases.items():
        print(name, {k: v for k, v in case.items() if k in ("ms", "ratio", "rel_l2", "peak_gib")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
