"""A scaling model of context parallelism from one-GPU measurements: what `--gpus N` should buy, before N GPUs exist.

    python benchmarks/multi_gpu_model.py --out benchmarks/results/multi_gpu_model_h200.json
    python benchmarks/multi_gpu_model.py --tiny --out /tmp/multi_gpu_model_cpu.json   # CPU smoke test

Under Ulysses context parallelism of degree N, one rank of the DiT does, per block: its 1/N of the packed rows
through every GEMM, norm and modulation (the sequence is split at block 0), and attention for its 56/N heads over the
full sequence (the all-to-all trades rows for heads). On ONE GPU this script times exactly that work, per preset
(`native`, `exact`, `fast`, `fastest`; benchmarks/forward.py's cases, applied with speed_presets.py):

* ``rest_ms`` (measured): block 0 of a full-width model called on the first (largest) of N row shards of its real
  inputs (hidden states, rotary table and AdaLN indices split as diffusers' `_cp_plan` splits them), attention
  replaced by an identity: norms, modulation, FFN and residuals at S/N rows;
* ``attention_ms`` (measured): the attention module (Q/K/V/O projections and the preset's attention core) of a
  block with 56/N heads x 128 and the same 5376 width, on all S rows and the full packed layout: the rank's
  attention core exactly; its projections have the rank's FLOPs in the transposed aspect (S x 5376/N instead of
  S/N x 5376);
* ``outside_ms`` (measured, degree 1): the rest of a 1-block forward (embedders, token refiner, rotary table, output
  heads), counted unsplit at every degree;
* the video VAE decode share (measured): diffusers' tiled decode where this rank decodes every N-th tile (the first
  rank: the most tiles) and the others' tiles come from a cache, so stitching and blending are timed as they run.

Blocks are timed once each and counted 50 times (the model has 50 identical blocks). Compile is off unless
``--compile`` (the presets' regional compile costs minutes per model); each preset's degree-1 prediction is compared
with its compiled forward in forward_h200.json, and ``forward_s_scaled`` carries the predicted speed-up over to that
measured forward. Communication is counted, not measured (no NVLink here): the bytes each all-to-all and all-gather
moves per forward, timed at a stated link bandwidth and all-to-all efficiency (``ASSUMPTIONS``). The request adds the
one-GPU stages of request_h200.json that do not split (text encode on rank 0, audio decode, MP4 mux).
"""

from __future__ import annotations

import argparse
import inspect
import json
import time
from typing import Any, Dict, List, Optional, Sequence

import torch

from _common import RESULTS, result_header, synchronize, write_json


PRESETS = ("native", "exact", "fast", "fastest")
DEGREES = (1, 2, 4, 8)
TINY_DEGREES = (1, 2)  # the tiny model has 2 heads
BLOCKS = 50  # identical blocks of the released DiT
FORWARDS_PER_REQUEST = 49  # a 50-step request (request_h200.json: 49 transformer forwards)

# The link the prediction assumes: NVLink 4 on H200 SXM (HGX), 18 links, 900 GB/s total per GPU = 450 GB/s per
# direction (NVIDIA H200 Tensor Core GPU datasheet, "NVLink: 900GB/s"). All-to-all over NVSwitch reaches part of it;
# the efficiency is an assumption (not measured here: the gloo-on-one-GPU path stages through host memory and says
# nothing about NVLink), as is the fixed cost per collective.
ASSUMPTIONS = {
    "link": "NVLink 4 (H200 SXM, NVSwitch)",
    "link_gb_per_s_per_direction": 450.0,
    "link_source": "NVIDIA H200 Tensor Core GPU datasheet: NVLink 900 GB/s per GPU (both directions)",
    "all_to_all_efficiency": 0.7,
    "all_to_all_efficiency_source": "assumed: NCCL all-to-all over NVSwitch sustains roughly 60-80 % of the "
                                    "per-direction link rate at 50-400 MB messages; not measured here",
    "collective_latency_us": 30.0,
    "collective_latency_source": "assumed fixed cost per NCCL collective launch and sync",
    "overlap": "none: communication is added to compute (the all-to-all sits between projections and attention)",
}  # fmt: skip

ANCHORS = {
    "sglang_4xh200_ulysses4_t2va_50_steps": {"denoise_s": 71.7, "end_to_end_s": 74.4,
                                             "source": "SGLang, 4xH200, Ulysses-4, 50-step t2va"},
    "vllm_omni_8xh20": {"scaling_efficiency": 0.96, "source": "vLLM-Omni, 8xH20"},
}  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# Communication (pure functions: tests/test_benchmark_multi_gpu_model.py)


def communication_per_forward(rows: int, heads: int, head_dim: int, degree: int, blocks: int = BLOCKS,
                              dtype_bytes: int = 2, gated: bool = False, out_channels: int = 128) -> Dict[str, Any]:  # fmt: skip
    """Bytes one rank sends per DiT forward under Ulysses of ``degree``: per block an all-to-all of Q, K, V (and VSA's
    gate when ``gated``) before attention and one of the output after it, each moving the (N-1)/N of the rank's
    ``rows/N x heads x head_dim`` tensor that belongs to other ranks; plus the output heads' all-gather (``out_channels``
    fp32 values per row: 96 video + 32 audio)."""
    if degree == 1:
        return {"all_to_all_bytes": 0, "all_gather_bytes": 0, "collectives": 0}
    local_rows = -(-rows // degree)  # the largest shard
    per_tensor = local_rows * heads * head_dim * dtype_bytes * (degree - 1) / degree
    tensors = 3 + int(gated) + 1
    gather = local_rows * out_channels * 4 * (degree - 1)  # this rank's shard goes to N-1 ranks
    return {
        "all_to_all_bytes": int(per_tensor * tensors * blocks),
        "all_gather_bytes": int(gather),
        "collectives": tensors * blocks + 2,
    }


def communication_seconds(comm: Dict[str, Any], assumptions: Dict[str, Any] = ASSUMPTIONS) -> float:
    rate = assumptions["link_gb_per_s_per_direction"] * 1e9 * assumptions["all_to_all_efficiency"]
    moved = comm["all_to_all_bytes"] + comm["all_gather_bytes"]
    return moved / rate + comm["collectives"] * assumptions["collective_latency_us"] * 1e-6


# ---------------------------------------------------------------------------------------------------------------------
# Measurements


class _NoAttention(torch.nn.Module):
    """Stands in for a block's attention when only the rest of the block is timed."""

    def forward(self, hidden_states, rotary_emb=None, attention_mask=None):
        return hidden_states


def capture_block_inputs(model, run) -> Dict[str, Any]:
    """Block 0's arguments in one forward (by name)."""
    block = model.transformer_blocks[0]
    captured = {}

    def grab(module, args, kwargs):
        if not captured:
            captured.update(inspect.signature(module.forward).bind(*args, **kwargs).arguments)

    handle = block.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        run()
    finally:
        handle.remove()
    return captured


def rank_shard(inputs: Dict[str, Any], degree: int) -> Dict[str, Any]:
    """The first rank's block inputs at ``degree``, split as diffusers' `_cp_plan` splits them (hidden states on
    dim 1, the rotary table and the AdaLN indices on dim 0; `tensor_split`, so the first shard is the largest)."""
    shard = dict(inputs)
    shard["hidden_states"] = inputs["hidden_states"].tensor_split(degree, dim=1)[0]
    shard["adaln_indices"] = inputs["adaln_indices"].tensor_split(degree, dim=0)[0]
    shard["rotary_emb"] = tuple(t.tensor_split(degree, dim=0)[0] for t in inputs["rotary_emb"])
    return shard


def apply_preset(model, preset: str, device, compile: bool) -> Dict[str, Any]:
    """benchmarks/forward.py's case set-up (native: diffusers' processor, cuDNN backend) or the speed preset
    (``exact`` without FlashInfer: cuDNN)."""
    from forward import set_up

    from diffusers_h3.pipelines.speed_presets import SpeedPresetConfig, enable_speed_preset_on_transformer

    if preset == "native":
        return set_up("native", model, device)
    torch._dynamo.reset()
    config = SpeedPresetConfig(preset, compile=compile and device.type == "cuda", flashinfer=False)
    return enable_speed_preset_on_transformer(model, config).describe()


def heads_model(model, heads: int, device):
    """A 1-block model like ``model`` with ``heads`` heads of the same width (hidden size unchanged), random weights."""
    accepted = inspect.signature(type(model).__init__).parameters  # not the quantizer's record in the config
    config = {k: v for k, v in model.config.items() if k in accepted}
    config.update(num_attention_heads=heads, num_layers=1)
    dtype = next(model.transformer_blocks.parameters()).dtype
    torch.manual_seed(1)
    with torch.device(device):
        other = type(model)(**config)
    other = other.to(dtype)
    for name in other._keep_in_fp32_modules or ():
        getattr(other, name).float()
    return other.eval().requires_grad_(False)


def timed_ms(fn, device, warmup: int, reps: int) -> float:
    from forward import measure

    record, _ = measure(fn, device, warmup, reps)
    return record["ms"]


def measure_preset(preset, build, device, degrees, warmup, reps, compile) -> Dict[str, Any]:
    from diffusers_h3 import use_packed_layout

    model, kwargs, layout, shape = build()
    heads = model.config.num_attention_heads
    turned_on = apply_preset(model, preset, device, compile)

    def run_model():
        with torch.inference_mode(), use_packed_layout(layout):
            return model(**kwargs)

    block = model.transformer_blocks[0]
    with torch.inference_mode():
        inputs = capture_block_inputs(model, run_model)

    def run_block(block_inputs):
        def run():
            with torch.inference_mode(), use_packed_layout(layout):
                return block(**block_inputs)

        return run

    model_ms = timed_ms(run_model, device, warmup, reps)
    block_ms = timed_ms(run_block(inputs), device, warmup, reps)
    attention_input = torch.randn_like(inputs["hidden_states"])
    per_rank = {}
    attention = block.attn
    for degree in degrees:
        block.attn = _NoAttention()
        try:
            rest_ms = timed_ms(run_block(rank_shard(inputs, degree)), device, warmup, reps)
        finally:
            block.attn = attention
        if degree == 1:
            attn_module = attention
        else:
            other = heads_model(model, heads // degree, device)
            apply_preset(other, preset, device, compile)
            attn_module = other.transformer_blocks[0].attn

        def run_attention():
            with torch.inference_mode(), use_packed_layout(layout):
                return attn_module(attention_input, inputs["rotary_emb"], None)

        attention_ms = timed_ms(run_attention, device, warmup, reps)
        per_rank[degree] = {"rest_ms": rest_ms, "attention_ms": attention_ms, "block_ms": rest_ms + attention_ms,
                            "rows": int(inputs["hidden_states"].tensor_split(degree, dim=1)[0].shape[1]),
                            "heads": heads // degree}  # fmt: skip
        print(f"{preset:8s} N={degree}: rest {rest_ms:8.2f} ms + attention {attention_ms:8.2f} ms per block",
              flush=True)  # fmt: skip
    return {
        "preset": turned_on,
        "heads": heads,
        "head_dim": model.config.attention_head_dim,
        "model_1_block_ms": model_ms,
        "block_ms": block_ms,
        "outside_ms": max(model_ms - block_ms, 0.0),
        # the decomposition at degree 1 (identity attention + attention module alone) against the whole block
        "parts_over_block_at_degree_1": round(per_rank[1]["block_ms"] / block_ms, 3) if 1 in per_rank else None,
        "per_rank": per_rank,
        "shape": shape,
    }


def measure_decode(device, tiny: bool, degrees) -> Dict[int, float]:
    """The first rank's share of the tiled video decode, per degree (ms): its tiles decoded, the others' from a cache,
    diffusers' stitching and cross-fade as they run."""
    from vae import build_vae

    from diffusers_h3._vae_tiles import decode_from_tiles

    dtype = torch.float32 if tiny else torch.bfloat16
    vae = build_vae(device, dtype, tiny)
    shape = (1, vae.config.latent_channels, 9, 3, 4) if tiny else (1, vae.config.latent_channels, 37, 48, 84)
    z = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype)
    cache: List[torch.Tensor] = []

    def share(degree):
        def decode_tiles(tiles):
            if not cache:  # the first call decodes every tile and keeps them
                cache.extend(vae.decoder(vae.post_quant_conv(t)) for t in tiles)
                return list(cache)
            return [vae.decoder(vae.post_quant_conv(t)) if k % degree == 0 else cache[k] for k, t in enumerate(tiles)]

        return decode_from_tiles(vae, z, decode_tiles)

    times = {}
    with torch.inference_mode():
        share(1)  # warm-up, fills the cache
        tile_bytes = sum(t.numel() * t.element_size() for t in cache)
        for degree in degrees:
            synchronize(device)
            start = time.perf_counter()
            share(degree)
            synchronize(device)
            times[degree] = (time.perf_counter() - start) * 1e3
            print(f"decode   N={degree}: {times[degree]:8.1f} ms", flush=True)
    return {"ms": times, "tiles": len(cache), "decoded_tile_bytes": tile_bytes}


# ---------------------------------------------------------------------------------------------------------------------
# Prediction


def predict(measured: Dict[str, Any], decode: Dict[str, Any], rows: int, heads: int, head_dim: int,
            one_gpu_forward_ms: Optional[float], request_stages_ms: Optional[Dict[str, float]],
            assumptions: Dict[str, Any] = ASSUMPTIONS, gated: bool = False) -> Dict[int, Dict[str, Any]]:  # fmt: skip
    """Forward, 49-forward denoise and request per degree from one preset's measurements (all predicted)."""
    per_rank = measured["per_rank"]
    base = None
    out = {}
    for degree, rank in sorted(per_rank.items()):
        comm = communication_per_forward(rows, heads, head_dim, degree, gated=gated)
        comm_s = communication_seconds(comm, assumptions)
        # The decoded tiles are broadcast from their owners: each rank receives the (N-1)/N it did not decode.
        decode_bytes = decode["decoded_tile_bytes"] * (degree - 1) / degree
        decode_comm_s = decode_bytes / (assumptions["link_gb_per_s_per_direction"] * 1e9 * assumptions["all_to_all_efficiency"])
        forward_s = (BLOCKS * rank["block_ms"] + measured["outside_ms"]) / 1e3 + comm_s
        base = forward_s if degree == 1 else base
        scaled = one_gpu_forward_ms / 1e3 * forward_s / base if one_gpu_forward_ms and base else None
        entry = {
            "forward_s": round(forward_s, 4),
            "communication_s": round(comm_s, 4),
            "communication": comm,
            "speedup": round(base / forward_s, 3),
            "efficiency": round(base / forward_s / degree, 3),
            "forward_s_scaled": round(scaled, 4) if scaled is not None else None,
            "video_decode_s": round(decode["ms"][degree] / 1e3 + decode_comm_s, 3),
        }
        if scaled is not None:
            entry["denoise_s"] = round(FORWARDS_PER_REQUEST * scaled, 2)
            if request_stages_ms:
                fixed = sum(v for k, v in request_stages_ms.items() if k not in ("forwards", "video_decode")) / 1e3
                entry["request_s"] = round(entry["denoise_s"] + entry["video_decode_s"] + fixed, 2)
        out[degree] = entry
    return out


def _load(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(RESULTS / "multi_gpu_model_h200.json"))
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="the presets' regional compile (minutes per model)")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--commit", default=None, help="commit measured (the device copy has no .git)")
    parser.add_argument("--tiny", action="store_true", help="tiny model on the CPU (smoke test), degrees 1 and 2")
    args = parser.parse_args(argv)

    presets = [p for p in args.presets.split(",") if p]
    unknown = sorted(set(presets) - set(PRESETS))
    if unknown:
        raise SystemExit(f"unknown preset(s) {unknown}: choose from {', '.join(PRESETS)}")
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("benchmarks/multi_gpu_model.py needs a CUDA GPU (or --tiny for the CPU smoke test)")
    device = torch.device("cpu" if args.tiny else "cuda")
    degrees = TINY_DEGREES if args.tiny else DEGREES

    from forward import build

    started = time.perf_counter()
    measured, notes = {}, {}
    for preset in presets:
        torch.manual_seed(0)
        try:
            measured[preset] = measure_preset(preset, lambda: build(device, 1, args.tiny), device, degrees,
                                              args.warmup, args.reps, args.compile)  # fmt: skip
        except Exception as error:  # noqa: BLE001 - one failing preset must not lose the others
            notes[preset] = f"failed: {type(error).__name__}: {str(error)[:400]}"
            print(f"{preset}: {notes[preset]}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    decode = None if args.skip_decode else measure_decode(device, args.tiny, degrees)

    forward_file = _load(RESULTS / "forward_h200.json") if not args.tiny else None
    request_file = _load(RESULTS / "request_h200.json") if not args.tiny else None
    predicted = {}
    for preset, m in measured.items():
        shape = m["shape"]
        heads, head_dim = m["heads"], m["head_dim"]
        one_gpu = (forward_file or {}).get("cases", {}).get(preset, {}).get("ms") if forward_file else None
        stages = (request_file or {}).get("cases", {}).get(f"t2va_{preset}", {}).get("stages") if request_file else None
        no_decode = {"ms": dict.fromkeys(degrees, 0.0), "decoded_tile_bytes": 0}
        predicted[preset] = predict(m, decode or no_decode, shape["rows"], heads, head_dim, one_gpu, stages)
        if one_gpu:
            m["one_gpu_forward_ms_measured_compiled"] = one_gpu
            m["model_degree_1_forward_s"] = predicted[preset][1]["forward_s"]
    shape = next(iter(measured.values()))["shape"] if measured else None
    report = {
        **result_header("multi_gpu_model", args.commit, device="cpu (tiny smoke test)" if args.tiny else None),
        "shape": shape,
        "protocol": f"one process, one GPU; per preset a 1-block model (timings counted {BLOCKS} times), "
                    f"{args.warmup} warm-up + median of {args.reps} timed calls per measurement; compile "
                    f"{'on' if args.compile else 'off (eager)'}; exact = cuDNN (FlashInfer off)",
        "measured": {"note": "measured on one GPU: per-rank compute at each degree", "presets": measured,
                     "video_decode_share": decode},
        "assumptions": ASSUMPTIONS,
        "predicted": {"note": "predicted: per-rank compute (measured) x blocks + unsplit work + communication at the "
                              "assumed link; forward_s_scaled and denoise_s/request_s scale forward_h200.json's "
                              "measured one-GPU forward by the predicted speed-up; request adds request_h200.json's "
                              "unsplit stages",
                      "presets": predicted},
        "anchors": ANCHORS,
        "notes": notes,
        "elapsed_s": round(time.perf_counter() - started, 1),
    }  # fmt: skip
    write_json(args.out, report)
    print(f"wrote {args.out} in {report['elapsed_s']} s")
    return report


if __name__ == "__main__":
    main()
