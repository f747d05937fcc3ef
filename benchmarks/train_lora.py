"""LoRA training steps at the released sizes (pass 2 of `diffusers_h3.training`): seconds per optimizer step, the
allocator's peaks, the card's peak (`DeviceMemorySampler`), host peak RSS and disk traffic, per recipe.

    python benchmarks/train_lora.py --out benchmarks/results/train_lora_h100.json
    python benchmarks/train_lora.py --checkpoint-only                                  # write the checkpoint first
    python benchmarks/train_lora.py --cases card_80gb --merge --out benchmarks/results/train_lora_h100.json
    python benchmarks/train_lora.py --tiny --out /tmp/train_lora_tiny.json          # CPU smoke test

Cases (each in a fresh process, so that peak RSS and disk counters are the case's own):

* ``card_24gb``  the 24 GB-card recipe: 480x832, 124 frames, rank 32, the NVFP4 base streamed block by block from its
                 pre-quantized checkpoint (`stream_base=True`, `low_ram`'s streaming), gradient checkpointing, LoRA
                 factors in float32, AdamW over the LoRA only; allocator capped at 22.5 GiB
                 (`set_per_process_memory_fraction`). Bounds the issue sets: device peak <= 22.5 GiB, host peak RSS
                 <= 28 GiB.
* ``card_80gb``  the base resident on the card (the same NVFP4 checkpoint, not streamed), 768x1344, 124 frames, rank
                 32, gradient checkpointing; cap 78.5 GiB.

Weights: random, no downloads: the checkpoint of `placement.py`'s low_ram cases (`write_low_ram_checkpoint`: NVFP4 DiT
at the released 50-block size, written piece by piece), reused when the folder exists. The cache of pass 1 is
synthetic (random latents and prompt embeddings of the request's shapes: 256 prompt tokens), so the case measures the
training step alone; pass 1 runs one model at a time and is timed by `diffusers-h3 train-lora` itself.

Protocol per case: build (load + LoRA + optimizer), `--warmup` untimed steps, `--steps` timed optimizer steps
(CUDA-synchronized wall time each), peaks over the timed steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from _common import DeviceMemorySampler, device_peak_fields, result_header, write_json


GiB = 2**30
CASES = {
    "card_24gb": {"height": 480, "width": 832, "num_frames": 124, "stream_base": True, "cap_gib": 22.5},
    "card_80gb": {"height": 768, "width": 1344, "num_frames": 124, "stream_base": False, "cap_gib": 78.5},
}
BOUNDS = {"card_24gb": {"device_peak_gib": 22.5, "host_peak_rss_gib": 28.0}}
PROMPT_TOKENS = 256
RANK = 32


def _gib(nbytes):
    return round(nbytes / GiB, 2)


def _synthetic_sample(transformer, height, width, num_frames, tiny, generator):
    """A cached sample's tensors at the request's shapes (what `LatentCache.sample` returns)."""
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
        audio_latent_num_frames,
        video_latent_num_frames,
    )

    config = transformer.config
    frames = video_latent_num_frames(num_frames, 17, 5)
    channels = config.in_channels
    return {
        "latents": torch.randn(1, channels, frames, height // 16, width // 16, generator=generator),
        "audio_latents": torch.randn(2, config.audio_in_channels, audio_latent_num_frames(num_frames), generator=generator),
        "prompt_embeds": torch.randn(1, 8 if tiny else PROMPT_TOKENS, config.text_dim, generator=generator),
        "text_token_tags": torch.ones(8 if tiny else PROMPT_TOKENS, dtype=torch.long),
        "is_image": torch.tensor(False),
    }


def run_case(args, name):
    """One case in this (fresh) process; returns its record."""
    from placement import host_memory, io_since, proc_io

    from diffusers_h3.training.loss import FlowMatchingConfig, flow_matching_loss, pack_sample
    from diffusers_h3.training.trainer import (
        TrainLoraConfig,
        _optimizer,
        add_lora,
        load_base_transformer,
        trainable_parameters,
    )

    setup = CASES[name]
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    sampler = DeviceMemorySampler().start() if cuda else None
    if cuda:
        torch.cuda.set_per_process_memory_fraction(setup["cap_gib"] * GiB / torch.cuda.get_device_properties(0).total_memory)
    io_before = proc_io()
    started = time.perf_counter()
    height, width, frames = (64, 96, 22) if args.tiny else (setup["height"], setup["width"], setup["num_frames"])
    config = TrainLoraConfig(model=str(args.checkpoint), data_dir=".", output_dir=".", rank=RANK, height=height,
                             width=width, num_frames=frames, dtype="bfloat16", stream_base=setup["stream_base"],
                             gradient_checkpointing=True, learning_rate=1e-4)  # fmt: skip
    transformer, shifts = load_base_transformer(config, device)
    add_lora(transformer, config)
    transformer.enable_gradient_checkpointing()
    if setup["stream_base"]:
        from diffusers_h3.parallel.checkpoint_streaming import stream_from_checkpoint

        stream_from_checkpoint(transformer, Path(args.checkpoint) / "transformer", device)
    else:
        transformer.to(device)
    optimizer = _optimizer(config, trainable_parameters(transformer))
    build_s = time.perf_counter() - started
    generator = torch.Generator().manual_seed(0)
    sample = pack_sample(_synthetic_sample(transformer, height, width, frames, args.tiny, generator), "t2va",
                         tuple(transformer.config.patch_size))  # fmt: skip
    loss_config = FlowMatchingConfig(flow_shift=shifts[0], audio_flow_shift=shifts[1])
    times = []
    for step in range(args.warmup + args.steps):
        if step == args.warmup and cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        begin = time.perf_counter()
        loss, _ = flow_matching_loss(transformer, sample, loss_config, torch.Generator().manual_seed(step), device,
                                     torch.bfloat16)  # fmt: skip
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - begin)
    record = {
        "case": name, "height": height, "width": width, "num_frames": frames, "rank": RANK,
        "base": "NVFP4 pre-quantized checkpoint" + (", streamed block by block" if setup["stream_base"] else ", resident"),
        "sequence_rows": int(sample.structure["position_ids"].shape[0]), "cap_gib": setup["cap_gib"] if cuda else None,
        "build_s": round(build_s, 2), "s_per_step": round(sorted(times)[len(times) // 2], 3),
        "step_times_s": [round(t, 3) for t in times], "loss_finite": bool(torch.isfinite(loss)),
        "lora_parameters": sum(p.numel() for p in trainable_parameters(transformer)),
    }  # fmt: skip
    if cuda:
        sampler.stop()
        reserved = _gib(torch.cuda.max_memory_reserved())
        record.update(peak_allocated_gib=_gib(torch.cuda.max_memory_allocated()), peak_reserved_gib=reserved,
                      **device_peak_fields(sampler.peak_bytes, reserved, sampler.source))  # fmt: skip
    record.update(host_memory())
    record["disk"] = io_since(io_before)
    for key, bound in BOUNDS.get(name, {}).items():
        value = record.get(key)
        record.setdefault("within_bounds", {})[key] = None if value is None else bool(value <= bound)
    return record


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="the JSON to write (needed unless --checkpoint-only)")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--checkpoint", default="/tmp/h3_low_ram_checkpoint", help="the low_ram checkpoint folder")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="tiny components on the CPU (smoke test)")
    parser.add_argument("--merge", action="store_true", help="keep the other cases already in --out")
    parser.add_argument("--checkpoint-only", action="store_true", help="write the checkpoint and stop")
    parser.add_argument("--commit", default=None, help="commit measured (the device copy has no .git)")
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)  # one case in a child process
    args = parser.parse_args()
    if args.case is not None:
        try:
            record = run_case(args, args.case)
        except Exception as error:  # the parent records the failure next to the other cases
            record = {"case": args.case, "error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
        print("RECORD " + json.dumps(record))
        return
    if not (Path(args.checkpoint) / "model_index.json").exists():
        # In its own process (placement.py's writer): this one must hold no CUDA context while the cases run, or the
        # card would count it beside theirs.
        placement = str(Path(__file__).with_name("placement.py"))
        writer = [sys.executable, placement, "--write-checkpoint", str(args.checkpoint)] + (["--tiny"] if args.tiny else [])
        subprocess.run(writer, check=True)
    if args.checkpoint_only:
        return
    if args.out is None:
        parser.error("--out is needed to run the cases")
    results = {"header": result_header("train_lora", args.commit), "bounds": BOUNDS, "cases": {}}
    if args.merge and Path(args.out).is_file():
        results["cases"] = json.loads(Path(args.out).read_text()).get("cases", {})
    for name in args.cases.split(","):
        command = [sys.executable, __file__, "--case", name, "--out", args.out, "--checkpoint", str(args.checkpoint),
                   "--steps", str(args.steps), "--warmup", str(args.warmup)] + (["--tiny"] if args.tiny else [])
        done = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy())
        lines = [line for line in done.stdout.splitlines() if line.startswith("RECORD ")]
        results["cases"][name] = (json.loads(lines[-1][7:]) if lines else
                                  {"case": name, "error": f"exit {done.returncode}", "stderr": done.stderr[-4000:]})
        print(json.dumps(results["cases"][name], indent=2))
        write_json(args.out, results)


if __name__ == "__main__":
    main()
