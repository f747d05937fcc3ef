"""MiniMax-H3 video VAE decode at 768x1344x124 on one GPU: diffusers' tiled decode vs batched tiles (and compiled).

    PYTHONPATH=. python benchmarks/vae.py --out benchmarks/results/vae_h200.json

One process, same latents for every case (the protocol of docs/benchmarking.md): the released VAE config (24 latent
channels, 16x spatial / 4x temporal compression, a 36-layer 32x64 ViT decoder) with random weights built on the GPU,
bf16 with the checkpoint's fp32 modules kept fp32, decoding a (1, 24, 37, 48, 84) latent (124 frames of 768x1344:
7 temporal chunks x 28 spatial tiles with the released tiling). Cases, in this order:

* ``native``                  diffusers' ``vae.decode`` (one decoder call per tile; the baseline and the reference);
* ``batched_tiles``           ``enable_fast_vae_decode(vae, FastVAEDecodeConfig(batch_tiles=N))``;
* ``batched_tiles+compile``   the same with ``compile=True``; the first decode (which compiles) is recorded apart
  as ``compile_s``;
* ``batched_tiles+compile+fp8``  the same with ``fp8_linears=True``: the decoder's linears quantized to FP8
  (``FP8Config``: E4M3 weights, per-token E4M3 activations, ``torch._scaled_mm``; ``proj_in`` (24 inputs) stays as it
  is). In place, so it runs last.

``--profile`` adds, for each compiled case, a CUDA kernel-time breakdown of one decode (GEMMs, attention,
inductor-fused elementwise, FP8 quantization, copies, other) and its top kernels.

``ms`` = median of ``--reps`` timed decodes after one untimed decode (whose output is compared); ``rel_l2`` = ||video -
native|| / ||native|| (random weights: numerical distance, not quality); ``peak_gib`` = peak memory allocated beyond
the model and latents. Optional (``--dit-layers L``, default 4): diffusers' FirstBlockCache on a full-width H3 DiT of L
blocks at the 38,222-row t2va shape: its per-forward overhead when it never skips and the forward time when it skips.
Each case is written to ``--out`` as soon as it finishes. ``--tiny`` runs every path on the CPU with tiny models (a
smoke test, no compile).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from _common import profile_forward, rel_l2, result_header, synchronize, write_json


LATENT_SHAPE = (1, 24, 37, 48, 84)  # 124 frames -> 5 * 7 + 2 latent frames; 768 / 16 x 1344 / 16 latents
TINY_LATENT_SHAPE = (1, 4, 9, 6, 9)  # 2 temporal chunks x 8 tiles with TINY_TILING
TINY_TILING = (64, 64, 32, 32)


def median_ms(fn, reps, device):
    times = []
    for _ in range(reps):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def peak_start(device):
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak_gib(device, base):
    return None if device.type != "cuda" else round((torch.cuda.max_memory_allocated(device) - base) / 2**30, 2)


def build_vae(device, dtype, tiny):
    from diffusers import AutoencoderKLMiniMaxH3

    if tiny:
        from diffusers_h3.testing.tiny import tiny_vae

        vae = tiny_vae().to(device)
        vae.enable_tiling(*TINY_TILING)
    else:
        with torch.device(device):
            vae = AutoencoderKLMiniMaxH3()
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        # The released init zeroes the residual scales and register tokens (blocks would be identities): randomize.
        for name, param in vae.decoder.named_parameters():
            if name.endswith(("scale1", "scale2", "register_tokens")):
                param.copy_(0.1 * torch.randn(param.shape, device=device, generator=generator))
    vae = vae.to(dtype)
    keep = set(vae._keep_in_fp32_modules)
    for name, param in vae.named_parameters():
        if keep & set(name.split(".")):
            param.data = param.data.float()
    return vae.eval().requires_grad_(False)


COMPILED_CASES = ("batched_tiles+compile", "batched_tiles+compile+fp8")
CASES = ("native", "batched_tiles") + COMPILED_CASES


def decode_cases(vae, z, device, reps, tiles_per_batch, cases, record, profile=False):
    from diffusers_h3 import FastVAEDecodeConfig, disable_fast_vae_decode, enable_fast_vae_decode
    from diffusers_h3.hooks.fast_vae_decode import fast_vae_decode_state, vae_decode

    def decode():  # the pipeline's decode: the batched tiles while `enable_fast_vae_decode` is on
        with torch.inference_mode():
            return vae_decode(vae, z)

    reference = None
    for name in cases:
        disable_fast_vae_decode(vae)
        entry = {"ms": None, "baseline": "native", "ratio": None, "rel_l2": None, "peak_gib": None}
        try:
            compile_s = None
            if name == "batched_tiles":
                enable_fast_vae_decode(vae, FastVAEDecodeConfig(batch_tiles=tiles_per_batch))
            elif name in COMPILED_CASES:
                if device.type != "cuda":
                    entry["notes"] = "not run: --tiny runs on the CPU, compile is measured on the GPU only"
                    record(name, entry)
                    continue
                fp8 = name.endswith("+fp8")
                if fp8:
                    torch._dynamo.reset()  # the bf16 decoder's graphs must not be reused
                enable_fast_vae_decode(vae, FastVAEDecodeConfig(batch_tiles=tiles_per_batch, compile=True,
                                                                fp8_linears=fp8))  # fmt: skip
                state = fast_vae_decode_state(vae)
            base = peak_start(device)
            started = time.perf_counter()
            out = decode()  # untimed: compilation on the compiled case, and the output that is compared
            synchronize(device)
            if name in COMPILED_CASES:
                compile_s = round(state.compile_seconds if state.compile_seconds is not None else 0.0, 1)
                entry["compile_s"] = compile_s
                entry["first_decode_s"] = round(time.perf_counter() - started, 1)
            entry["ms"] = round(median_ms(decode, reps, device), 1)
            entry["peak_gib"] = peak_gib(device, base)
            if name == "native":
                reference = out
            entry["rel_l2"] = None if reference is None else float(f"{rel_l2(out, reference):.3g}")
            del out
            if name != "native":
                from diffusers_h3.hooks.fast_vae_decode import describe_vae_decode

                entry["path"] = describe_vae_decode(vae)
            if profile and name in COMPILED_CASES:
                entry["profile"] = profile_forward(decode, device, top=12)
        except Exception as error:  # noqa: BLE001 - a case that fails is recorded with its reason, not dropped
            entry["ms"] = None
            entry["notes"] = f"failed: {type(error).__name__}: {error}"[:500]
        record(name, entry)
    disable_fast_vae_decode(vae)


def first_block_cache_cases(device, layers, reps, tiny, record):
    """Forward time of an L-block DiT: no cache, FirstBlockCache never skipping and always skipping.

    The inputs are the same at every step, so a threshold of 0 would already skip; -1 never does."""
    from diffusers.hooks import FirstBlockCacheConfig

    import diffusers_h3  # noqa: F401 - registers H3's block with diffusers' cache hooks
    from diffusers_h3 import use_packed_layout
    from diffusers_h3.hooks.cache import cache_stats, start_cache_request

    if tiny:
        from diffusers_h3.testing.tiny import tiny_transformer, tiny_transformer_inputs

        model = tiny_transformer(num_layers=layers).to(device)
        kwargs, layout = {**tiny_transformer_inputs(seed=0), "return_dict": False}, None
    else:
        from end_to_end import build_inputs, build_model

        model = build_model(device, layers)
        kwargs, layout = build_inputs(device, layers)

    def forward(step):
        with torch.inference_mode(), model.cache_context("cond", step_index=step, num_inference_steps=reps + 1):
            if layout is None:
                return model(**kwargs)[0]
            with use_packed_layout(layout):
                return model(**kwargs)[0]

    reference = None
    for name, threshold in (("dit_no_cache", None), ("dit_fbc_never_skips", -1.0), ("dit_fbc_skips", 1e9)):
        entry = {"ms": None, "baseline": "dit_no_cache", "ratio": None, "rel_l2": None, "peak_gib": None}
        try:
            if model.is_cache_enabled:
                model.disable_cache()
            if threshold is not None:
                model.enable_cache(FirstBlockCacheConfig(threshold=threshold))
            start_cache_request(model, reps + 1)  # what the pipeline does before a request: fresh state, skip counter
            base = peak_start(device)
            outputs = [forward(0)]  # step 0 is always computed in full
            steps = iter(range(1, reps + 1))
            entry["ms"] = round(median_ms(lambda: outputs.append(forward(next(steps))), reps, device), 1)
            entry["peak_gib"] = peak_gib(device, base)
            if reference is None:
                reference = outputs[0]
            # Same inputs at every step, so even a skipped step must reproduce the full forward (head output plus the
            # cached tail residual): this checks the cache's bookkeeping, not its quality.
            entry["rel_l2"] = float(f"{rel_l2(outputs[-1], reference):.3g}")
            if threshold is not None:
                entry["cache"] = cache_stats(model).describe_path()
        except Exception as error:  # noqa: BLE001
            entry["notes"] = f"failed: {type(error).__name__}: {error}"[:500]
        record(name, entry)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results/vae_h200.json")
    parser.add_argument("--reps", type=int, default=3, help="timed decodes per case (after one untimed)")
    parser.add_argument("--tiles-per-batch", type=int, default=28, help="tiles per decoder call (28 = one chunk)")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--profile", action="store_true", help="kernel-time breakdown of the compiled cases")
    parser.add_argument("--dit-layers", type=int, default=4, help="FirstBlockCache overhead on an L-block DiT; 0: off")
    parser.add_argument("--commit", default=None, help="commit measured (a copy of the tree without .git)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run with tiny models")
    args = parser.parse_args(argv)
    cases = args.cases.split(",")
    unknown = set(cases) - set(CASES)
    if unknown or "native" not in cases:
        parser.error(f"--cases must include native and may add {', '.join(CASES[1:])}; got {args.cases}")
    if "batched_tiles+compile+fp8" in cases and cases[-1] != "batched_tiles+compile+fp8":
        parser.error("--cases: batched_tiles+compile+fp8 quantizes the decoder in place, so it must come last")

    if args.tiny:
        device, dtype, shape = torch.device("cpu"), torch.float32, TINY_LATENT_SHAPE
    else:
        if not torch.cuda.is_available():
            raise SystemExit("benchmarks/vae.py needs a CUDA GPU (or --tiny for the CPU smoke run)")
        device, dtype, shape = torch.device("cuda"), torch.bfloat16, LATENT_SHAPE

    import diffusers_h3  # noqa: F401

    vae = build_vae(device, dtype, args.tiny)
    z = torch.randn(shape, device=device, generator=torch.Generator(device=device).manual_seed(1)).to(dtype)
    results = {
        **result_header("vae", commit=args.commit),
        "shape": {"latents": list(shape), "video": "tiny (CPU smoke run)" if args.tiny else "768x1344x124",
                  "tiling": [vae.tile_sample_min_height, vae.tile_sample_min_width,
                             vae.tile_sample_min_overlap_height, vae.tile_sample_min_overlap_width],
                  "dtype": str(dtype).replace("torch.", ""), "tiles_per_batch": args.tiles_per_batch},
        "reference": "native (diffusers' tiled AutoencoderKLMiniMaxH3.decode, same run, same dtype)",
        "protocol": f"one untimed decode, then the median of {args.reps} wall-clock timings (synchronized)",
        "cases": {},
    }  # fmt: skip

    def record(name, entry):
        baseline = entry["ms"] if name == entry["baseline"] else results["cases"].get(entry["baseline"], {}).get("ms")
        if entry["ms"] is not None and baseline:
            entry["ratio"] = round(baseline / entry["ms"], 2)
        results["cases"][name] = entry
        write_json(args.out, results)
        print(name, entry, flush=True)

    decode_cases(vae, z, device, args.reps, args.tiles_per_batch, cases, record, profile=args.profile)
    del vae, z
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if args.dit_layers > 0:
        first_block_cache_cases(device, args.dit_layers, args.reps, args.tiny, record)
    return results


if __name__ == "__main__":
    main()
