"""Full 50-block MiniMax-H3 transformer forward at 768x1344x124 frames on one GPU: diffusers native vs our paths.

    python benchmarks/end_to_end.py --out benchmarks/results/end_to_end_h200.json

One process, same run for every case (the protocol of docs/benchmarking.md): a full-width H3 DiT with random bf16 weights (the fp32
modules kept fp32, as the checkpoint), the real packed layout of a t2va request (512 text rows, 414 audio rows,
37x24x42 video rows = 38,222 rows, rotary grid from diffusers' own layout builder) published as a PackedLayout.
Cases, in this order (FP8 weight quantization is applied in place, so it comes last):

* ``native_cudnn``      diffusers' processor, ``_native_cudnn`` backend (the baseline);
* ``vsa_bf16_sp0.8``    our VSA processor, bf16, sparsity 0.8;
* ``vsa_fp8_sp0.8``     our VSA processor, FP8 Q/K, bf16 PV, sparsity 0.8;
* ``fp8_gemm``          FP8Config quantization of the linears (per-token activations), cuDNN attention;
* ``fp8_gemm+vsa_fp8_sp0.8``  both.

``ms`` = median of ``--reps`` CUDA-event timed forwards after one warm-up; ``ratio`` = native ms / case ms;
``rel_l2`` = ||sample - native|| / ||native|| on the video output (random weights, so this measures numerical
distance, not quality); ``peak_gib`` = peak allocated memory during the case's timed forwards.
"""

from __future__ import annotations

import argparse

import torch

from _common import result_header, write_json


TEXT_ROWS, NUM_FRAMES, HEIGHT, WIDTH = 512, 124, 768, 1344


# fl2va at the same size: two 768x1344 keyframes. Each becomes 1,008 vision tokens (+ start/end) in the Qwen3-VL
# prompt, tagged video, and one 24x42 conditioning block of the packed sequence: 42,284 rows with a 512-token prompt.
FL2VA_TEXT_ROWS, FL2VA_IMAGE_TOKENS = 2558, 1008


def build_inputs(device, layers, text_rows=None, task="t2va"):
    """Transformer kwargs and the PackedLayout of a 768x1344x124 request, via diffusers' layout builder: ``t2va``
    (``text_rows`` prompt rows, default 512: 38,222 packed rows) or ``fl2va`` (first and last keyframes; default 2,558
    prompt rows, the vision tokens of each keyframe tagged video: 42,284 packed rows)."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
        audio_latent_num_frames,
        video_latent_num_frames,
    )

    from diffusers_h3.packing import t2va_fl2va_layout

    if task not in ("t2va", "fl2va"):
        raise ValueError(f"task {task!r}: choose t2va or fl2va")
    anchors = ("first", "last") if task == "fl2va" else ()
    if text_rows is None:
        text_rows = FL2VA_TEXT_ROWS if task == "fl2va" else TEXT_ROWS
    latent_frames = video_latent_num_frames(NUM_FRAMES, 17, 5)
    latent_h, latent_w = HEIGHT // 16, WIDTH // 16
    audio_latents = audio_latent_num_frames(NUM_FRAMES)
    tags = torch.ones(text_rows, dtype=torch.long)
    for index in range(len(anchors)):  # each keyframe's vision block in the prompt (after a short preamble)
        start = 16 + index * (FL2VA_IMAGE_TOKENS + 2) + 1
        tags[start : start + FL2VA_IMAGE_TOKENS] = 0
    position_ids, token_tags, video_idx, audio_idx, text_idx, _, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        tags, latent_frames, latent_h, latent_w, audio_latents, (1, 2, 2), 2, 2, 0, anchors
    )
    layout = t2va_fl2va_layout(text_rows, len(anchors), latent_frames, latent_h, latent_w, audio_latents, (1, 2, 2), 2)
    g = torch.Generator(device=device).manual_seed(0)
    kwargs = {
        "hidden_states": torch.randn(1, video_idx.numel(), 96, device=device, generator=g),
        "audio_hidden_states": torch.randn(1, audio_idx.numel(), 32, device=device, generator=g),
        "encoder_hidden_states": torch.randn(1, text_rows, 5120, device=device, generator=g).to(torch.bfloat16),
        "timestep": torch.tensor([0.3, 0.7], device=device),
        "timestep_indices": (torch.arange(position_ids.shape[0], device=device) % 2),
        "token_tags": token_tags.to(device),
        "position_ids": position_ids.to(device),
        "video_indices": video_idx.to(device),
        "audio_indices": audio_idx.to(device),
        "text_indices": text_idx.to(device),
        "return_dict": False,
    }
    return kwargs, layout.at_step(10, 50)


def build_model(device, layers, build_dtype=torch.float32):
    """The DiT with ``layers`` random blocks on ``device`` in bf16 (the ``_keep_in_fp32_modules`` in fp32). Built in
    ``build_dtype`` first: float32 (the default) draws the weights every committed result used, but holds the whole
    model in float32 on the device once (50 blocks do not fit an 80 GB card); bfloat16 draws other random weights
    straight in bf16 (half the memory: 50 blocks fit an H100), so its distances are not comparable with float32
    builds."""
    from diffusers import MiniMaxH3Transformer3DModel

    previous = torch.get_default_dtype()
    torch.set_default_dtype(build_dtype)
    try:
        with torch.device(device):
            model = MiniMaxH3Transformer3DModel(num_layers=layers)
    finally:
        torch.set_default_dtype(previous)
    model = model.to(torch.bfloat16)
    for name in model._keep_in_fp32_modules:
        getattr(model, name).float()
    return model.eval().requires_grad_(False)


def time_forward(model, kwargs, layout, reps):
    from diffusers_h3 import use_packed_layout

    def run():
        with torch.inference_mode(), use_packed_layout(layout):
            return model(**kwargs)[0]

    out = run()  # warm-up (and Triton autotuning)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = run()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2], out.float(), torch.cuda.max_memory_allocated() / 2**30


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/end_to_end_h200.json")
    parser.add_argument("--layers", type=int, default=50)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--commit", default=None, help="commit measured (the device copy has no .git)")
    parser.add_argument("--cases", default="native_cudnn,vsa_bf16_sp0.8,vsa_fp8_sp0.8,fp8_gemm,fp8_gemm+vsa_fp8_sp0.8,"
                                           "fp8_gemm+vsa_fp8_sp0.8+compile")
    args = parser.parse_args()
    wanted = args.cases.split(",")

    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor

    import diffusers_h3

    device = torch.device("cuda")
    model = build_model(device, args.layers)
    kwargs, layout = build_inputs(device, args.layers)
    results, reference = {}, None

    def dense_cudnn():
        model.set_attn_processor(MiniMaxH3AttnProcessor())
        model.set_attention_backend("_native_cudnn")

    steps = [
        ("native_cudnn", dense_cudnn),
        ("vsa_bf16_sp0.8", lambda: diffusers_h3.enable_vsa(model, sparsity=0.8, precision="bf16")),
        ("vsa_fp8_sp0.8", lambda: diffusers_h3.enable_vsa(model, sparsity=0.8, precision="fp8")),
        ("fp8_gemm", lambda: (diffusers_h3.quantize(model, diffusers_h3.FP8Config()), dense_cudnn())),
        ("fp8_gemm+vsa_fp8_sp0.8", lambda: diffusers_h3.enable_vsa(model, sparsity=0.8, precision="fp8")),
        # diffusers' regional compile (inductor) around our kernels (custom ops: one graph node each).
        ("fp8_gemm+vsa_fp8_sp0.8+compile", lambda: model.compile_repeated_blocks(fullgraph=False)),
    ]
    for name, setup in steps:
        setup()
        if name not in wanted:
            continue
        ms, out, peak = time_forward(model, kwargs, layout, args.reps)
        if reference is None:
            reference = out
        rel = ((out - reference).norm() / reference.norm()).item()
        results[name] = {"ms": round(ms, 1), "rel_l2": rel, "peak_gib": round(peak, 2)}
        print(f"{name:28s} {ms / 1000:7.3f} s  rel_l2 {rel:.3e}  peak {peak:.1f} GiB", flush=True)
        del out
        write_report(args, results, layout)  # after every case: a time limit cannot lose the finished ones


def write_report(args, results, layout):
    base = results.get("native_cudnn", {}).get("ms")
    for case in results.values():
        case["baseline"] = "native_cudnn"
        case["ratio"] = round(base / case["ms"], 3) if base else None

    report = {
        **result_header("end_to_end", args.commit),
        "shape": {"layers": args.layers, "rows": int(layout.seq_len), "text": TEXT_ROWS, "frames": NUM_FRAMES,
                  "height": HEIGHT, "width": WIDTH, "heads": 56, "head_dim": 128},  # fmt: skip
        "reference": "native_cudnn bf16 output (random weights: numerical distance, not quality)",
        "protocol": f"1 warm-up + median of {args.reps} CUDA-event timed full forwards, one process",
        "cases": results,
    }
    write_json(args.out, report)


if __name__ == "__main__":
    main()
