"""GEMM benchmark of the diffusers-h3 quantized linears at MiniMax-H3 prefill shapes.

    python benchmarks/gemm.py --out benchmarks/results/gemm_h200.json      # GPU: timings + weight memory
    python benchmarks/gemm.py --memory-only                                # CPU: 50-block weight memory only

Cases ``<method>_<gemm>`` for method in bf16 (cuBLAS), fp8 (fused per-token activation quantization +
``torch._scaled_mm``, quantization time included), w8a16 (Triton), nvfp4 (Triton weight-only) and gemm in qkv
(5376->21504), out (7168->5376), ffn_up (5376->28672), ffn_down (14336->5376), all at M = 38,222 rows, measured in the
same run: warm-up, then the median of CUDA-event timings; ``ratio`` = bf16 ms / case ms; ``rel_l2`` = ||out - bf16||
/ ||bf16|| against the bf16 cuBLAS output on random (never zero) data. ``weights_<method>`` cases carry ``peak_gib`` =
the weight memory of the full 50-block H3 DiT, **computed** from the config on the meta device (parameter counts x
bytes, scales included; nothing is allocated) with each config's default module selection.
"""

from __future__ import annotations

import argparse

import torch

from _common import cuda_median_ms, result_header, write_json


M_ROWS = 38222
GEMMS = {"qkv": (5376, 21504), "out": (7168, 5376), "ffn_up": (5376, 28672), "ffn_down": (14336, 5376)}
GIB = 1024**3


def weight_memory() -> dict:
    """Bytes of the full-size H3 DiT weights per method, computed on the meta device."""
    from diffusers import MiniMaxH3Transformer3DModel

    from diffusers_h3.quantizers import FP8Config, NVFP4Config, W8A16Config, linears_to_quantize

    with torch.device("meta"):
        model = MiniMaxH3Transformer3DModel()
    keep32 = model._keep_in_fp32_modules or []

    def dense_bytes(name, t):
        fp32 = any(k in name.split(".") for k in keep32)
        return t.numel() * (4 if fp32 else 2)

    bf16 = sum(dense_bytes(n, p) for n, p in model.named_parameters())
    blocks_bf16 = sum(dense_bytes(n, p) for n, p in model.named_parameters() if n.startswith("transformer_blocks."))
    result = {"bf16": {"bytes": bf16, "blocks_bytes": blocks_bf16, "quantized_layers": 0}}
    per_weight = {
        "w8a16": lambda n, k: n * k + 4 * n,
        "nvfp4": lambda n, k: n * k // 2 + n * k // 16 + 4,
        "fp8": lambda n, k: n * k + 4 * n,
    }
    for method, config in (("w8a16", W8A16Config()), ("nvfp4", NVFP4Config()), ("fp8", FP8Config())):
        names = set(linears_to_quantize(model, config, keep32))
        total = blocks = 0
        for name, p in model.named_parameters():
            module, _, tensor = name.rpartition(".")
            if module in names and tensor == "weight":
                b = per_weight[method](p.shape[0], p.shape[1])
            else:
                b = 2 * p.numel() if module in names else dense_bytes(name, p)  # quantized layers keep a 16-bit bias
            total += b
            blocks += b if name.startswith("transformer_blocks.") else 0
        result[method] = {"bytes": total, "blocks_bytes": blocks, "quantized_layers": len(names)}
    return result


def run_gemms(cases: dict, methods, fused: bool) -> None:
    """Time every method on every H3 GEMM shape against cuBLAS bf16 on the same inputs."""
    torch.manual_seed(0)
    for gemm, (k, n) in GEMMS.items():
        _run_gemm(cases, gemm, k, n, methods, fused)
        torch.cuda.empty_cache()


def _run_gemm(cases: dict, gemm: str, k: int, n: int, methods, fused: bool) -> None:
    from diffusers_h3.kernels.gemm.fp8 import fp8_linear_scaled_mm, fp8_quantize_per_token, fp8_quantize_weight
    from diffusers_h3.kernels.gemm.nvfp4 import (
        nvfp4_dequantize,
        nvfp4_dequantize_triton,
        nvfp4_linear,
        nvfp4_linear_triton,
        nvfp4_quantize,
    )
    from diffusers_h3.kernels.gemm.w8a16 import (
        w8a16_dequantize,
        w8a16_dequantize_triton,
        w8a16_linear,
        w8a16_linear_triton,
        w8a16_quantize,
    )

    x = torch.randn(M_ROWS, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") * k**-0.5).to(torch.bfloat16)
    flops = 2.0 * M_ROWS * n * k
    ref = torch.nn.functional.linear(x, w)
    ref_f = ref.float()
    ref_norm = ref_f.norm()
    bf16_ms = cuda_median_ms(lambda: torch.nn.functional.linear(x, w))
    cases[f"bf16_{gemm}"] = {"ms": bf16_ms, "baseline": f"bf16_{gemm}", "ratio": 1.0, "rel_l2": 0.0, "peak_gib": None,
                             "tflops": flops / bf16_ms / 1e9, "weight_bytes": n * k * 2, "path": "cuBLAS bf16"}  # fmt: skip
    variants = []
    for method in methods:
        if method == "fp8":
            wq, ws = fp8_quantize_weight(w)
            xq, xs = fp8_quantize_per_token(x)
            extra = {
                "path": "fused per-token quant (Triton) + torch._scaled_mm row-wise, fast accum",
                "quant_ms": cuda_median_ms(lambda: fp8_quantize_per_token(x)),
                "scaled_mm_only_ms": cuda_median_ms(
                    lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.reshape(1, n),
                                             out_dtype=torch.bfloat16, use_fast_accum=True)),  # fmt: skip
            }
            del xq, xs
            variants.append((f"fp8_{gemm}", lambda: fp8_linear_scaled_mm(x, wq, ws), n * k + 4 * n, extra))
        elif method == "w8a16":
            q, s = w8a16_quantize(w)
            bitwise = torch.equal(w8a16_dequantize_triton(q, s, torch.bfloat16), w8a16_dequantize(q, s, torch.bfloat16))
            extra = {"path": "auto at this M: Triton dequantize to bf16 scratch + cuBLAS",
                     "dequant_ms": cuda_median_ms(lambda: w8a16_dequantize_triton(q, s, torch.bfloat16)),
                     "dequant_kernel_bitwise_equal_reference": bitwise}  # fmt: skip
            variants.append((f"w8a16_{gemm}", lambda: w8a16_linear(x, q, s), n * k + 4 * n, extra))
            if fused:
                variants.append((f"w8a16_fused_{gemm}", lambda: w8a16_linear_triton(x, q, s), n * k + 4 * n,
                                 {"path": "Triton fused GEMM, int8 dequantized in registers"}))  # fmt: skip
        elif method == "nvfp4":
            p, s4, g = nvfp4_quantize(w)
            wb = n * k // 2 + n * k // 16 + 4
            bitwise = torch.equal(nvfp4_dequantize_triton(p, s4, g, torch.bfloat16),
                                  nvfp4_dequantize(p, s4, g, torch.bfloat16))  # fmt: skip
            extra = {"path": "auto at this M: Triton dequantize to bf16 scratch + cuBLAS",
                     "dequant_ms": cuda_median_ms(lambda: nvfp4_dequantize_triton(p, s4, g, torch.bfloat16)),
                     "dequant_kernel_bitwise_equal_reference": bitwise}  # fmt: skip
            variants.append((f"nvfp4_{gemm}", lambda: nvfp4_linear(x, p, s4, g), wb, extra))
            if fused:
                variants.append((f"nvfp4_fused_{gemm}", lambda: nvfp4_linear_triton(x, p, s4, g), wb,
                                 {"path": "Triton fused weight-only GEMM, E2M1/E4M3 decoded in registers"}))  # fmt: skip
    for name, fn, wbytes, extra in variants:
        try:
            out = fn()  # autotune / compile
            rel = ((out.float() - ref_f).norm() / ref_norm).item()
            del out
            ms = cuda_median_ms(fn)
            cases[name] = {"ms": ms, "baseline": f"bf16_{gemm}", "ratio": bf16_ms / ms, "rel_l2": rel, "peak_gib": None,
                           "tflops": flops / ms / 1e9, "weight_bytes": wbytes, **extra}  # fmt: skip
        except Exception as e:  # keep the other cases
            cases[name] = {"ms": None, "baseline": f"bf16_{gemm}", "ratio": None, "rel_l2": None, "peak_gib": None,
                           "error": f"{type(e).__name__}: {e}"[:400], **extra}  # fmt: skip
        print(name, {k_: v for k_, v in cases[name].items() if k_ in ("ms", "ratio", "rel_l2", "error")}, flush=True)


def best_configs() -> dict:
    out = {}
    try:
        from diffusers_h3.kernels.gemm import nvfp4
        from diffusers_h3.kernels.gemm import w8a16 as w8a16_gemm

        for name, tuned in (("w8a16", w8a16_gemm._w8a16_autotuned), ("nvfp4", nvfp4._nvfp4_wo_autotuned)):
            out[name] = {str(k): str(v) for k, v in getattr(tuned, "cache", {}).items()}
    except Exception as e:  # pragma: no cover
        out["error"] = str(e)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--commit", default=None, help="commit measured (the device copy has no .git)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--memory-only", action="store_true")
    parser.add_argument("--methods", default="fp8,w8a16,nvfp4")
    parser.add_argument("--no-fused", action="store_true", help="skip the fused-GEMM variants (autotuning is slow)")
    args = parser.parse_args()

    cases = {}
    mem = weight_memory()
    for method, info in mem.items():
        cases[f"weights_{method}"] = {"ms": None, "baseline": None, "ratio": None, "rel_l2": None,
                                      "peak_gib": info["bytes"] / GIB, "vs_bf16": info["bytes"] / mem["bf16"]["bytes"],
                                      "blocks_gib": info["blocks_bytes"] / GIB, "quantized_layers": info["quantized_layers"],
                                      "computed": True}  # fmt: skip
        print(f"weights_{method}: {info['bytes'] / GIB:.2f} GiB ({info['bytes'] / mem['bf16']['bytes']:.3f}x bf16)")
    device = "cpu"
    if not args.memory_only and torch.cuda.is_available():
        device = torch.cuda.get_device_name()
        run_gemms(cases, [m for m in args.methods.split(",") if m], fused=not args.no_fused)
    result = {
        **result_header("gemm", args.commit, device),
        "shape": {"M": M_ROWS, "gemms": {g: {"K": k, "N": n} for g, (k, n) in GEMMS.items()}},
        "reference": "rel_l2 against the bf16 cuBLAS output of the same inputs; weights_* computed from the config",
        "autotune": best_configs(),
        "cases": cases,
    }
    if args.out:
        write_json(args.out, result)
    print("\n%-18s %9s %7s %9s %8s" % ("case", "ms", "ratio", "rel_l2", "TFLOP/s"))
    for name, c in cases.items():
        if c.get("ms") is not None:
            print("%-18s %9.3f %7.3f %9.2e %8.1f" % (name, c["ms"], c["ratio"], c["rel_l2"], c["tflops"]))


if __name__ == "__main__":
    main()
