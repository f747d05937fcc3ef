"""The multi-rank cases shared by tests/gpu/test_multi_gpu.py (one GPU per rank, NCCL) and
tests/gpu/test_parallel_one_gpu.py (N ranks sharing one GPU over gloo), and by their CPU variants in tests/parallel.

Every `rank_*` function runs inside a rank started by `diffusers_h3.parallel._launch.launch` (a fresh interpreter with
the process group up) and returns picklable CPU results; `device_type` is "cuda" (the GPU kernels, bf16) or "cpu".
"""

import os
import sys
import time
from pathlib import Path

import torch
from diffusers import ContextParallelConfig

from diffusers_h3 import LowPrecisionAttentionConfig, SpeedPresetConfig


# 4 heads x 128 (the H3 head width, which the GPU attention kernels are built for); a video grid of whole and
# partial 4x4x4 tiles (VSA's default tile); an odd packed length (uneven shards).
CONFIG = {"num_attention_heads": 4, "attention_head_dim": 128, "hidden_size": 64, "ffn_dim": 128}
GRID, TEXT_ROWS, AUDIO_ROWS = (5, 8, 12), 7, 6

CP_CASES = ("diffusers_default", "vsa_0", "vsa_0.8_bf16", "vsa_0.8_fp8", "vsa_0.8_int8", "dense_fp8", "dense_int8")
TP_CASES = ("bf16", "w8a16", "fp8", "nvfp4")
TP_CONFIGS = {"bf16": None, "w8a16": "W8A16Config", "fp8": "FP8Config", "nvfp4": "NVFP4Config"}

# The real shape: full-width H3 blocks (5376 wide, 56 heads x 128) on the 38,222-row t2va layout of a 768x1344x124
# request, random weights. Its inputs come from benchmarks/end_to_end.py (one definition of that layout).
REAL_SHAPE_BLOCKS = 2
REAL_SHAPE_CP_CASES = ("dense_cudnn", "vsa_0.8_fp8", "fastest_processors_fp8_gemms")
REAL_SHAPE_TP_CASES = ("w8a16",)

PIPELINE_RUN = {"prompt": "a drum", "height": 32, "width": 32, "num_frames": 124, "num_inference_steps": 3,
                "output_type": "np"}  # fmt: skip


def rel_l2(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def rank_device(device_type):
    """This rank's device: the current CUDA device (set per rank for NCCL; device 0 when ranks share one GPU)."""
    return torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")


def tiny_model(device, seed=0):
    from diffusers import MiniMaxH3Transformer3DModel

    from diffusers_h3.attention_processors import add_gate_compress
    from diffusers_h3.testing.tiny import TINY_TRANSFORMER_CONFIG

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MiniMaxH3Transformer3DModel(**{**TINY_TRANSFORMER_CONFIG, **CONFIG}).eval()
        add_gate_compress(model)
        for block in model.transformer_blocks:
            block.attn.to_gate_compress.weight.data.normal_(0, 0.3)
    model = model.to(device=device, dtype=torch.bfloat16)
    for name in model._keep_in_fp32_modules or ():
        getattr(model, name).float()
    return model


def tiny_inputs(device):
    from diffusers_h3.layout import LayoutSegment, PackedLayout
    from diffusers_h3.testing.tiny import tiny_transformer_inputs

    inputs = tiny_transformer_inputs(seed=1, seq_text=TEXT_ROWS, seq_audio=AUDIO_ROWS, grid=GRID)
    seq = TEXT_ROWS + AUDIO_ROWS + GRID[0] * GRID[1] * GRID[2]
    layout = PackedLayout(
        (
            LayoutSegment("text", "prompt", 0, TEXT_ROWS),
            LayoutSegment("audio", "target", TEXT_ROWS, TEXT_ROWS + AUDIO_ROWS),
            LayoutSegment("video", "target", TEXT_ROWS + AUDIO_ROWS, seq, grid=GRID),
        ),
        seq_len=seq,
    )
    return {k: v.to(device) for k, v in inputs.items()}, layout


def forward_outputs(model, inputs, layout):
    """The video and audio outputs of one forward, flattened into one fp32 CPU vector."""
    from diffusers_h3.layout import use_packed_layout

    with torch.no_grad(), use_packed_layout(layout):
        out = model(**inputs, return_dict=False)
    return torch.cat([out[0].flatten(), out[1].flatten()]).float().cpu()


def install_attention(name):
    from diffusers_h3.attention_processors import enable_low_precision_attention, enable_vsa

    return {
        "diffusers_default": lambda m: None,
        "vsa_0": lambda m: enable_vsa(m, sparsity=0.0),
        "vsa_0.8_bf16": lambda m: enable_vsa(m, sparsity=0.8, precision="bf16"),
        "vsa_0.8_fp8": lambda m: enable_vsa(m, sparsity=0.8, precision="fp8"),
        "vsa_0.8_int8": lambda m: enable_vsa(m, sparsity=0.8, precision="int8"),
        "dense_fp8": lambda m: enable_low_precision_attention(m, LowPrecisionAttentionConfig("fp8")),
        "dense_int8": lambda m: enable_low_precision_attention(m, LowPrecisionAttentionConfig("int8")),
    }[name]


def rank_cp(device_type="cuda", cases=CP_CASES):
    """Every CP case: rel-L2 of the context-parallel forward (degree = world size) against this rank's one-process
    forward of the same model."""
    import torch.distributed as dist

    from diffusers_h3.parallel import enable_context_parallel

    device = rank_device(device_type)
    inputs, layout = tiny_inputs(device)
    results = {}
    for case in cases:
        single = tiny_model(device)
        install_attention(case)(single)
        reference = forward_outputs(single, inputs, layout)
        config = ContextParallelConfig(ulysses_degree=dist.get_world_size())
        parallel = enable_context_parallel(tiny_model(device), config)
        install_attention(case)(parallel)  # installed after enabling: the processors take the parallel config
        results[case] = rel_l2(forward_outputs(parallel, inputs, layout), reference)
    return results


def rank_tp(device_type="cuda", cases=TP_CASES):
    """Every TP case: rel-L2 of the tensor-parallel forward against the unsplit model with the same weights."""
    import torch.distributed as dist

    from diffusers_h3 import quantizers
    from diffusers_h3.parallel import enable_tensor_parallel

    device = rank_device(device_type)
    inputs, layout = tiny_inputs(device)
    results = {}
    for case in cases:
        outputs = []
        for split in (False, True):
            model = tiny_model(device)
            if TP_CONFIGS[case] is not None:
                quantizers.quantize(model, getattr(quantizers, TP_CONFIGS[case])())
            if split:
                enable_tensor_parallel(model, tp_degree=dist.get_world_size())
            outputs.append(forward_outputs(model, inputs, layout))
        results[case] = rel_l2(outputs[1], outputs[0])
    return results


# ---------------------------------------------------------------------------------------------------------------------
# The real shape


def _benchmarks_on_path():
    benchmarks = str(Path(__file__).resolve().parents[2] / "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)


def real_shape_model(device, blocks=REAL_SHAPE_BLOCKS):
    """Full-width H3 blocks with random bf16 weights (fp32 modules kept fp32), the same in every process."""
    _benchmarks_on_path()
    from end_to_end import build_model

    from diffusers_h3.attention_processors import add_gate_compress

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        model = build_model(device, blocks)
        add_gate_compress(model)
        for block in model.transformer_blocks:
            block.attn.to_gate_compress.weight.data.normal_(0, 0.02)  # a gate that changes the output
    return model


def real_shape_inputs(device, blocks=REAL_SHAPE_BLOCKS):
    """``(kwargs, PackedLayout)`` of the 38,222-row t2va forward."""
    _benchmarks_on_path()
    from end_to_end import build_inputs

    kwargs, layout = build_inputs(device, blocks)
    kwargs.pop("return_dict", None)
    return kwargs, layout


def install_real_shape_case(model, case):
    from diffusers_h3.attention_processors import enable_vsa
    from diffusers_h3.pipelines.speed_presets import enable_speed_preset_on_transformer

    if case == "dense_cudnn":
        from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor

        from diffusers_h3.pipelines.speed_presets import set_attention_backend_on_model

        model.set_attn_processor(MiniMaxH3AttnProcessor())
        set_attention_backend_on_model(model, "_native_cudnn")  # this model only: the process-wide default stays
    elif case == "vsa_0.8_fp8":
        enable_vsa(model, sparsity=0.8, precision="fp8")
    elif case == "fastest_processors_fp8_gemms":
        # The preset's processors and weights without regional compile (the test times nothing).
        enable_speed_preset_on_transformer(model, SpeedPresetConfig("fastest", compile=False))
    else:
        raise ValueError(f"unknown real-shape case {case!r}")


def real_shape_reference(device_type="cuda"):
    """One process: ``{case: output}`` for every real-shape CP and TP case (run in the test's own process)."""
    from diffusers_h3 import quantizers

    device = rank_device(device_type)
    inputs, layout = real_shape_inputs(device)
    outputs = {}
    for case in REAL_SHAPE_CP_CASES:
        model = real_shape_model(device)
        install_real_shape_case(model, case)
        outputs[("cp", case)] = forward_outputs(model, inputs, layout)
        del model
    for case in REAL_SHAPE_TP_CASES:
        model = real_shape_model(device)
        quantizers.quantize(model, getattr(quantizers, TP_CONFIGS[case])())
        outputs[("tp", case)] = forward_outputs(model, inputs, layout)
        del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return outputs


def rank_real_shape(device_type="cuda"):
    """This rank's outputs of the real-shape cases: CP (Ulysses over all ranks) and TP (degree = world size)."""
    import torch.distributed as dist

    from diffusers_h3 import quantizers
    from diffusers_h3.parallel import enable_context_parallel, enable_tensor_parallel

    device = rank_device(device_type)
    inputs, layout = real_shape_inputs(device)
    outputs = {}
    for case in REAL_SHAPE_CP_CASES:
        model = real_shape_model(device)
        install_real_shape_case(model, case)
        enable_context_parallel(model, ContextParallelConfig(ulysses_degree=dist.get_world_size()))
        outputs[("cp", case)] = forward_outputs(model, inputs, layout)
        del model
    for case in REAL_SHAPE_TP_CASES:
        model = real_shape_model(device)
        quantizers.quantize(model, getattr(quantizers, TP_CONFIGS[case])())
        enable_tensor_parallel(model, tp_degree=dist.get_world_size())
        outputs[("tp", case)] = forward_outputs(model, inputs, layout)
        del model
    return outputs


# ---------------------------------------------------------------------------------------------------------------------
# The pipeline, the VAE decode, a failing rank


def pipeline_reference(device_type="cuda"):
    """The tiny pipeline in one process: ``(frames, audio)`` of :data:`PIPELINE_RUN`."""
    from diffusers_h3.testing.tiny import tiny_pipeline

    device = rank_device(device_type)
    out = tiny_pipeline(seed=2).to(device)(**PIPELINE_RUN, generator=torch.Generator().manual_seed(0))
    return torch.as_tensor(out.frames), torch.as_tensor(out.audio).float().cpu()


def rank_pipeline_to_mp4(out_dir, device_type="cuda"):
    """The tiny pipeline under `enable_context_parallel`, end to end; rank 0 writes the MP4 (as the CLI does)."""
    import torch.distributed as dist

    from diffusers_h3 import export_to_video
    from diffusers_h3.parallel import enable_context_parallel, is_main_rank
    from diffusers_h3.testing.tiny import tiny_pipeline

    pipe = tiny_pipeline(seed=2).to(rank_device(device_type))
    enable_context_parallel(pipe, ContextParallelConfig(ulysses_degree=dist.get_world_size()))
    out = pipe(**PIPELINE_RUN, generator=torch.Generator().manual_seed(0))
    written = None
    if is_main_rank():
        written = export_to_video(out.frames[0], os.path.join(out_dir, "clip.mp4"), fps=24, audio=out.audio[0],
                                  sampling_rate=out.sampling_rate)  # fmt: skip
    return {"frames": torch.as_tensor(out.frames), "audio": torch.as_tensor(out.audio).float().cpu(),
            "written": None if written is None else str(written)}  # fmt: skip


# Two temporal chunks of 2x3 spatial tiles: 12 tile decodes to split.
VAE_LATENT_SHAPE = (1, 4, 9, 3, 4)


def _tiled_vae(device, dtype):
    from diffusers_h3.testing.tiny import tiny_vae

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        vae = tiny_vae()
    vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_min_overlap_height=16,
                      tile_sample_min_overlap_width=16)  # fmt: skip
    return vae.to(device=device, dtype=dtype)


def rank_vae(device_type="cuda"):
    """`parallel_vae_decode` and the serial tiled decode in this same process, in fp32 and bf16."""
    from diffusers_h3.parallel.vae import parallel_vae_decode

    device = rank_device(device_type)
    latents = torch.randn(VAE_LATENT_SHAPE, generator=torch.Generator().manual_seed(0)).to(device)
    results = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        vae = _tiled_vae(device, dtype)
        parallel = parallel_vae_decode(vae, latents.to(dtype))
        with torch.no_grad():
            serial = vae.decode(latents.to(dtype)).sample
        results[name] = {"parallel": parallel.float().cpu(), "serial": serial.float().cpu()}
    return results


FAILING_MESSAGE = "boom inside the forward"


def rank_fails_inside_forward(failing_rank, device_type="cuda"):
    """Every rank runs a context-parallel forward; `failing_rank` raises in block 1 while the others wait in its
    all-to-all."""
    import torch.distributed as dist

    from diffusers_h3.parallel import enable_context_parallel

    device = rank_device(device_type)
    model = enable_context_parallel(tiny_model(device), ContextParallelConfig(ulysses_degree=dist.get_world_size()))
    inputs, layout = tiny_inputs(device)
    forward_outputs(model, inputs, layout)  # one good forward first: the group works
    if dist.get_rank() == failing_rank:

        def fail(module, args):
            raise RuntimeError(f"{FAILING_MESSAGE} on rank {failing_rank} at {time.time():.3f}")

        model.transformer_blocks[1].register_forward_pre_hook(fail)
    forward_outputs(model, inputs, layout)
    return "unreachable"  # every rank ends: the failing one raises, the others are waiting in its collective


def assert_failure_ends_the_job(device_type, backend, collective_timeout_s=30, launch=None):
    """Rank 1 raises inside a forward while rank 0 waits in a collective: the launch ends with one error naming rank
    1 and its message, well within the collective timeout after the failure (the waiting rank is ended, not left to
    time out). `launch` defaults to the product's (spawned ranks)."""
    import re

    import pytest

    from diffusers_h3.parallel._launch import RankFailedError
    from diffusers_h3.parallel._launch import launch as spawn_launch

    launch = launch or spawn_launch

    with pytest.raises(RankFailedError, match=f"(?s)rank 1 failed.*{FAILING_MESSAGE} on rank 1") as error:
        launch(rank_fails_inside_forward, 2, args=(1, device_type), backend=backend, timeout_s=240,
               collective_timeout_s=collective_timeout_s)  # fmt: skip
    failed_at = float(re.search(rf"{FAILING_MESSAGE} on rank 1 at ([0-9.]+)", str(error.value)).group(1))
    assert time.time() - failed_at < collective_timeout_s
    assert str(error.value).count("Traceback") == 1  # one error: the failing rank's, not the partner's broken wait
