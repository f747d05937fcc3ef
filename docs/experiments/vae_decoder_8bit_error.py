"""Probe (CPU): rounding error of 8-bit GEMM formats through the full 36-layer MiniMax-H3 video decoder, on one tile.

The GPU decode measured FP8 decoder linears at 3.9e-2 relative L2 against the native bf16 decode (vae_h200.json);
the decode target allows 1e-2. This runs one 7x16x16-latent tile (1,792 tokens, one of the 196 of a 768x1344x124
decode) through the released-size decoder with the benchmark's random weights, in fp32, with every decoder linear
but `proj_in` computed from rounded operands: bf16 (weights and activations rounded to bf16), FP8 E4M3 (per-token
activations, per-channel weights: the FP8Config numerics) and INT8 (symmetric, per-token activations, per-channel
weights, exact integer products). Relative L2 of each against fp32.
    PYTHONPATH=.:benchmarks python docs/experiments/vae_decoder_8bit_error.py OUT.json
"""

import json
import sys
import time

import torch
from vae import build_vae

from diffusers_h3.kernels.gemm.fp8 import fp8_quantize_per_token_reference, fp8_quantize_weight


def int8_rows(x):
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127.0
    return torch.round(x / scale).clamp(-127, 127), scale


def rounded_linear(mode):
    def linear(x, weight, bias=None):
        x2 = x.reshape(-1, x.shape[-1]).float()
        w = weight.float()
        if mode == "bf16":
            out = x2.bfloat16().float() @ w.bfloat16().float().T
        elif mode == "fp8":
            xq, xs = fp8_quantize_per_token_reference(x2)
            wq, ws = fp8_quantize_weight(w)
            out = (xq.float() @ wq.float().T) * xs * ws.reshape(1, -1)
        elif mode == "int8":
            xq, xs = int8_rows(x2)
            wq, ws = int8_rows(w)
            out = (xq @ wq.T) * xs * ws.reshape(1, -1)
        else:
            out = x2 @ w.T
        if bias is not None:
            out = out + bias.float()
        return out.reshape(*x.shape[:-1], weight.shape[0])

    return linear


def main(out_path):
    torch.manual_seed(0)
    vae = build_vae(torch.device("cpu"), torch.float32, tiny=False)
    decoder = vae.decoder
    linears = [m for n, m in decoder.named_modules() if isinstance(m, torch.nn.Linear) and n != "proj_in"]
    z = torch.randn(1, 24, 7, 16, 16, generator=torch.Generator().manual_seed(1))
    results, reference = {"tile_latent": list(z.shape), "linears": len(linears)}, None
    for mode in ("fp32", "bf16", "fp8", "int8"):
        for m in linears:
            m.forward = (lambda m: lambda x: rounded_linear(mode)(x, m.weight, m.bias))(m)
        start = time.perf_counter()
        with torch.no_grad():
            out = decoder(vae.post_quant_conv(z)).float()
        if reference is None:
            reference = out
        results[mode] = {
            "rel_l2_vs_fp32": ((out - reference).norm() / reference.norm()).item(),
            "seconds": round(time.perf_counter() - start, 1),
        }
        print(mode, results[mode], flush=True)
        json.dump(results, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
