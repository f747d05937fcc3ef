"""Context-parallel DiT forward and parallel VAE decode on N GPUs, with a same-run one-GPU baseline.

    torchrun --nproc-per-node 4 benchmarks/multi_gpu.py            # -> benchmarks/results/multi_gpu_h200x4.json
    accelerate launch --num-processes 4 benchmarks/multi_gpu.py
    torchrun --nproc-per-node 2 benchmarks/multi_gpu.py --tiny --device cpu   # smoke test of the script (gloo)
    torchrun --nproc-per-node 1 benchmarks/multi_gpu.py            # degree 1: the one-GPU baselines alone (x1.json)

One launch measures one context-parallel degree (= the world size). Protocol (docs/benchmarking.md): full-width H3 DiT
with random bf16 weights (fp32 modules kept fp32) and the packed layout of a 768x1344x124 t2va request (38,222 rows);
first rank 0 alone runs every case without context parallelism (the baseline; the other ranks wait), then all ranks
run the same cases under Ulysses context parallelism. Cases: diffusers' processor (``_native_cudnn``), VSA bf16 0.8,
VSA FP8 0.8, dense FP8 attention; ``fastest`` (the speed preset on a fresh copy of the weights: FP8 GEMMs, VSA 0.8 INT8,
regional compile on CUDA; measured after the others because it quantizes in place); ``tp<N>`` (``--cases ...,tp4`` or ``--tp``; N = the world size) runs diffusers' processor under
tensor parallelism instead (heads and FFN columns split, rank-order reduction; ``--tp-fp32-reduce`` adds in fp32;
``--tp-quant w8a16|fp8`` quantizes the weights first). ``--text-rows`` sets the prompt rows (513 gives an odd packed
length, 38,223: uneven shards on every degree). ``ms`` = median of ``--reps`` timed forwards after one warm-up, synchronized over ranks;
``speedup`` = baseline ms / CP ms; ``rel_l2`` = CP output vs baseline output; ``peak_gib_per_rank`` = peak allocated
memory of each rank during the case. The video VAE decode of the same request is timed serially (rank 0) and with its
tiles split over all ranks.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from _common import device_name, rel_l2, result_header, synchronize, write_json


CASES = ("native_cudnn", "vsa_bf16_sp0.8", "vsa_fp8_sp0.8", "dense_fp8", "fastest")
# Cases that change the weights in place: run on a fresh copy, after the others.
FRESH_MODEL_CASES = ("fastest",)


def timed(fn, device, reps, group=None):
    """Median ms of `reps` calls after one warm-up; with a group, every call ends at a barrier (the slowest rank)."""
    out = fn()
    times = []
    for _ in range(reps):
        synchronize(device)
        if group is not None:
            dist.barrier(group=group)
        start = time.perf_counter()
        out = fn()
        synchronize(device)
        if group is not None:
            dist.barrier(group=group)
        times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    return times[len(times) // 2], out


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device):
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def build_transformer(device, tiny):
    from diffusers import MiniMaxH3Transformer3DModel

    from diffusers_h3.testing.tiny import TINY_TRANSFORMER_CONFIG

    config = {**TINY_TRANSFORMER_CONFIG, "num_attention_heads": 4} if tiny else {}
    torch.manual_seed(0)  # identical random weights on every rank
    with torch.device(device):
        model = MiniMaxH3Transformer3DModel(**config)
    if not tiny:
        model = model.to(torch.bfloat16)
        for name in model._keep_in_fp32_modules:
            getattr(model, name).float()
    return model.eval().requires_grad_(False)


def build_inputs(device, tiny, text_rows=512):
    if tiny:
        from diffusers_h3.layout import LayoutSegment, PackedLayout
        from diffusers_h3.testing.tiny import tiny_transformer_inputs

        grid = (3, 5, 6)
        kwargs = tiny_transformer_inputs(seq_text=5, seq_audio=4, grid=grid)
        layout = PackedLayout(
            (
                LayoutSegment("text", "prompt", 0, 5),
                LayoutSegment("audio", "target", 5, 9),
                LayoutSegment("video", "target", 9, 99, grid=grid),
            ),
            seq_len=99,
        )
        kwargs = {k: v.to(device) for k, v in kwargs.items()}
        return {**kwargs, "return_dict": False}, layout
    from end_to_end import build_inputs as full_inputs

    return full_inputs(device, 50, text_rows=text_rows)


def set_case(model, case, tiny):
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor

    from diffusers_h3.attention_processors import (
        LowPrecisionAttentionConfig,
        enable_low_precision_attention,
        enable_vsa,
    )

    if case == "native_cudnn":
        model.set_attn_processor(MiniMaxH3AttnProcessor())
        if not tiny:
            model.set_attention_backend("_native_cudnn")
    elif case == "vsa_bf16_sp0.8":
        enable_vsa(model, sparsity=0.8, precision="bf16", **({"tile": (2, 2, 4), "backend": "torch"} if tiny else {}))
    elif case == "vsa_fp8_sp0.8":
        enable_vsa(model, sparsity=0.8, precision="fp8", **({"tile": (2, 2, 4), "backend": "torch"} if tiny else {}))
    elif case == "dense_fp8":
        enable_low_precision_attention(model, LowPrecisionAttentionConfig("fp8"))
    elif case == "fastest":
        from diffusers_h3.pipelines.speed_presets import enable_speed_preset_on_transformer

        enable_speed_preset_on_transformer(model, "fastest")  # compiles on CUDA only
        if tiny:  # the tiny grid needs the small tile (and exact torch kernels on CPU)
            enable_vsa(model, sparsity=0.8, precision="int8", tile=(2, 2, 4), backend="torch")
    else:
        raise ValueError(f"unknown case {case!r}; cases: {CASES}")


def build_vae(device, tiny):
    from diffusers_h3.testing.tiny import tiny_vae

    torch.manual_seed(0)
    if tiny:
        vae = tiny_vae().to(device)
        vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_min_overlap_height=16,
                          tile_sample_min_overlap_width=16)  # fmt: skip
        return vae, torch.randn(1, vae.config.latent_channels, 9, 3, 4, device=device)
    from vae import build_vae as full_width_vae  # vae.py's bf16 decoder with randomized residual scales

    vae = full_width_vae(device, torch.bfloat16, tiny=False)
    latents = torch.randn(1, vae.config.latent_channels, 37, 48, 84, device=device)  # 768x1344x124
    return vae, latents.to(torch.bfloat16)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="default: benchmarks/results/multi_gpu_<gpu>x<N>.json")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="tiny random model (smoke test of the script)")
    parser.add_argument("--skip-vae", action="store_true")
    parser.add_argument("--tp", action="store_true", help="also run the tensor-parallel case tp<world size>")
    parser.add_argument("--tp-fp32-reduce", action="store_true", help="tensor-parallel partial sums added in fp32")
    parser.add_argument("--tp-quant", default="none", choices=("none", "w8a16", "fp8"), help="weights of the tp case")
    parser.add_argument("--text-rows", type=int, default=512, help="prompt rows (513: odd packed length)")
    parser.add_argument("--commit", default=None, help="commit measured (the device copy has no .git)")
    args = parser.parse_args()
    cases = args.cases.split(",")
    tp_cases = [c for c in cases if c.startswith("tp")]
    cases = [c for c in cases if not c.startswith("tp")]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {unknown}: choose from {', '.join(CASES)} and tp<world size>")
    fresh_cases = [c for c in cases if c in FRESH_MODEL_CASES]
    cases = [c for c in cases if c not in FRESH_MODEL_CASES]

    from diffusers import ContextParallelConfig

    from diffusers_h3.layout import use_packed_layout
    from diffusers_h3.parallel import enable_context_parallel
    from diffusers_h3.parallel.vae import parallel_vae_decode

    backend = "cpu:gloo,cuda:nccl" if args.device == "cuda" else "cpu:gloo"
    own_group = not dist.is_initialized()  # a launcher (torchrun, accelerate, a notebook) may have made it already
    if own_group:
        dist.init_process_group(backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    single = world_size == 1  # degree 1 on one GPU: the baselines (and the decode) alone, for later launches
    if single and (tp_cases or args.tp):
        raise SystemExit("tensor parallelism needs two or more ranks; drop --tp / tp<N> for the degree-1 run")
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")

    model = build_transformer(device, args.tiny)
    kwargs, layout = build_inputs(device, args.tiny, text_rows=args.text_rows)

    def forward():
        with torch.inference_mode(), use_packed_layout(layout):
            return model(**kwargs)[0]

    # 1. One-GPU baseline: rank 0 alone, same weights, same inputs.
    baseline = {}

    def measure_baseline(case):
        reset_peak(device)
        ms, out = timed(forward, device, args.reps)
        baseline[case] = {"ms": ms, "peak_gib": peak_gib(device), "out": out.float().cpu()}

    def fresh_model():
        nonlocal model
        model = None  # frees the previous copy first
        if device.type == "cuda":
            torch.cuda.empty_cache()
        model = build_transformer(device, args.tiny)

    if rank == 0:
        for case in cases:
            set_case(model, case, args.tiny)
            measure_baseline(case)
    dist.barrier()

    # 2. The same cases under Ulysses context parallelism over all ranks.
    if not single:
        enable_context_parallel(model, ContextParallelConfig(ulysses_degree=world_size))
    results = {}

    def measure_cp(case):
        if single:
            results[case] = {"baseline_1gpu_ms": baseline[case]["ms"], "baseline_1gpu_peak_gib": baseline[case]["peak_gib"]}
            return
        reset_peak(device)
        ms, out = timed(forward, device, args.reps, group=dist.group.WORLD)
        peaks = [None] * world_size
        dist.all_gather_object(peaks, peak_gib(device))
        if rank == 0:
            reference = baseline[case]["out"]
            out = out.float().cpu()
            results[case] = {
                "baseline_1gpu_ms": baseline[case]["ms"],
                "baseline_1gpu_peak_gib": baseline[case]["peak_gib"],
                "cp_ms": ms,
                "speedup": baseline[case]["ms"] / ms,
                "rel_l2": rel_l2(out, reference),
                "peak_gib_per_rank": peaks,
            }

    for case in cases:
        set_case(model, case, args.tiny)
        measure_cp(case)

    # 2a. Cases that quantize in place: a fresh copy of the same weights each, baseline on rank 0, then context parallel.
    for case in fresh_cases:
        fresh_model()
        set_case(model, case, args.tiny)
        if rank == 0:
            measure_baseline(case)
        dist.barrier()
        if device.type == "cuda":
            torch._dynamo.reset()  # the context-parallel hooks change the blocks' inputs: compile them afresh
        if not single:
            enable_context_parallel(model, ContextParallelConfig(ulysses_degree=world_size))
        measure_cp(case)
    # 2b. Tensor parallelism over all ranks (`tp<N>`): a fresh copy of the same weights (the CP one has its hooks),
    # diffusers' processor, heads and FFN columns split, deterministic rank-order reduction.
    tp_case = f"tp{world_size}"
    if tp_cases and tp_cases != [tp_case]:
        raise SystemExit(f"one launch measures one degree: {tp_cases} asked, the world size gives {tp_case}")
    if tp_cases or args.tp:
        from diffusers_h3.parallel import enable_tensor_parallel, tensor_parallel_state

        fresh_model()
        set_case(model, "native_cudnn", args.tiny)
        if args.tp_quant != "none":
            from diffusers_h3.quantizers import FP8Config, W8A16Config, quantize

            quantize(model, {"w8a16": W8A16Config, "fp8": FP8Config}[args.tp_quant]())
        enable_tensor_parallel(model, tp_degree=world_size, reduce_dtype=torch.float32 if args.tp_fp32_reduce else None)
        reset_peak(device)
        ms, out = timed(forward, device, args.reps, group=dist.group.WORLD)
        peaks = [None] * world_size
        dist.all_gather_object(peaks, peak_gib(device))
        if rank == 0:
            reference = baseline["native_cudnn"]["out"] if "native_cudnn" in baseline else None
            out = out.float().cpu()
            results[tp_case] = {
                "baseline_1gpu_ms": baseline.get("native_cudnn", {}).get("ms"),
                "tp_ms": ms,
                "speedup": baseline["native_cudnn"]["ms"] / ms if reference is not None else None,
                "rel_l2": rel_l2(out, reference) if reference is not None else None,
                "peak_gib_per_rank": peaks,
                "parameter_gib_per_rank": tensor_parallel_state(model)["parameter_bytes_per_rank"] / 2**30,
                "reduce_dtype": tensor_parallel_state(model)["reduce_dtype"],
                "weights": args.tp_quant,
                "rel_l2_note": "vs the bf16 baseline" if args.tp_quant != "none" else None,
            }
    model = None  # frees the DiT before the VAE case
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # 3. Video VAE decode: serial on rank 0, then tiles split over all ranks.
    vae_result = None
    if not args.skip_vae:
        vae, latents = build_vae(device, args.tiny)
        serial = None
        if rank == 0:
            reset_peak(device)
            serial_ms, serial = timed(lambda: vae.decode(latents).sample, device, 1)
            serial_peak = peak_gib(device)
        dist.barrier()
        if single:  # at one rank parallel_vae_decode is vae.decode: nothing more to time
            vae_result = {"serial_ms": serial_ms, "serial_peak_gib": serial_peak, "parallel_ms": None}
        else:
            reset_peak(device)
            parallel_ms, decoded = timed(lambda: parallel_vae_decode(vae, latents), device, 1, group=dist.group.WORLD)
            peaks = [None] * world_size
            dist.all_gather_object(peaks, peak_gib(device))
            if rank == 0:
                vae_result = {
                    "serial_ms": serial_ms,
                    "serial_peak_gib": serial_peak,
                    "parallel_ms": parallel_ms,
                    "speedup": serial_ms / parallel_ms,
                    "rel_l2": rel_l2(decoded, serial),
                    "peak_gib_per_rank": peaks,
                }

    if rank == 0:
        gpu = device_name() if device.type == "cuda" else "cpu"
        short = "cpu" if device.type == "cpu" else gpu.lower().replace("nvidia", "").split()[0]
        out_path = args.out or f"benchmarks/results/multi_gpu_{short}x{world_size}.json"
        data = {
            **result_header("multi_gpu", args.commit, gpu),
            "world_size": world_size,
            "ulysses_degree": world_size,
            "tiny": args.tiny,
            "packed_rows": int(layout.seq_len),
            "forward": results,
            "vae_decode": vae_result,
        }
        write_json(out_path, data)
        print(f"wrote {out_path}")
    if own_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
