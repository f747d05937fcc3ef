"""PDD Acc-LoRA head banks on a GPU (marked ``gpu``; run with ``pytest -m gpu tests/gpu/test_pdd_gpu.py -s``).

At the released head width (5376 -> 96 video, 5376 -> 32 audio, 32 heads, bf16 in the file, float32 heads in the
model) the hook's mixture matches a float64 oracle for every step of the trained schedule, and its cost per call is
printed; on the tiny pipeline moved to the GPU after loading, a PDD request runs and unloading puts the base heads
back bit for bit on the GPU.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HIDDEN, VIDEO_OUT, AUDIO_OUT, HEADS = 5376, 96, 32, 32


def _sigmas(shift, points):
    ts = [1 - i / (points - 1) for i in range(points)]
    return [shift * t / (1 + (shift - 1) * t) for t in ts]


def test_released_width_mixture_matches_a_float64_oracle():
    from diffusers_h3.layout import LayoutSegment, PackedLayout, use_packed_layout
    from diffusers_h3.loaders import pdd

    torch.manual_seed(0)
    model = nn.Module()
    model.proj_out = nn.Linear(HIDDEN, VIDEO_OUT)
    model.audio_proj_out = nn.Linear(HIDDEN, AUDIO_OUT)
    model = model.cuda()
    heads = {
        "proj_out": (torch.randn(HEADS, VIDEO_OUT, HIDDEN).bfloat16() * 0.02, torch.randn(HEADS, VIDEO_OUT).bfloat16()),
        "audio_proj_out": (torch.randn(HEADS, AUDIO_OUT, HIDDEN).bfloat16() * 0.02,
                           torch.randn(HEADS, AUDIO_OUT).bfloat16()),
    }  # fmt: skip
    file = pdd.PDDFile("test", {}, heads, pdd.PDDSchedule(HEADS, 4), 64, 64.0, ())
    pdd.install_head_bank(model, file, "pdd", probe=None)
    for name in ("proj_out", "audio_proj_out"):  # weight 1 without a PEFT probe: run the bank
        pdd.get_h3_hook(getattr(model, name), pdd.H3_PDD_HEAD_BANK_HOOK).record.probe = _AlwaysOn()
    x = torch.randn(4097, HIDDEN, device="cuda")
    video, audio = _sigmas(12.0, 9), _sigmas(3.0, 9)
    segments = (LayoutSegment("text", "prompt", 0, 1),)
    for step in range(8):
        layout = PackedLayout(segments, 1).at_step(step, 8, (video[step], video[step + 1]), (audio[step], audio[step + 1]))
        for name, shift in (("proj_out", 12.0), ("audio_proj_out", 3.0)):
            fine = _sigmas(shift, HEADS + 1)
            block = range(4 * step, 4 * step + 4)
            span = fine[block[0]] - fine[block[-1] + 1]
            weight, bias = heads[name]
            w = sum((fine[k] - fine[k + 1]) / span * weight[k].double() for k in block).cuda()
            b = sum((fine[k] - fine[k + 1]) / span * bias[k].double() for k in block).cuda()
            with torch.no_grad(), use_packed_layout(layout):
                got = getattr(model, name)(x)
            expected = x.double() @ w.T + b
            rel = ((got.double() - expected).norm() / expected.norm()).item()
            assert rel < 1e-5, (step, name, rel)
    with torch.no_grad(), use_packed_layout(layout):
        for _ in range(3):
            model.proj_out(x)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            model.proj_out(x)
        end.record()
        torch.cuda.synchronize()
    print(f"PDD video head, 4097 rows: {start.elapsed_time(end) / 20:.3f} ms per call (mixture + GEMM)")


class _AlwaysOn(nn.Module):
    """A stand-in PEFT layer: adapter 'pdd' active at weight 1."""

    def __init__(self):
        super().__init__()
        self.lora_A = {"pdd": None}
        self.disable_adapters = False
        self.active_adapters = ["pdd"]
        self.lora_alpha, self.r, self.scaling = {"pdd": 1.0}, {"pdd": 1}, {"pdd": 1.0}


def test_tiny_pipeline_on_the_gpu_runs_pdd_and_unloads_bitwise(tmp_path):
    from diffusers_h3.testing.tiny import tiny_pipeline

    from ..loaders._lora_helpers import save_lora, tiny_transformer
    from ..loaders.test_pdd import CALL, FL2VA_FILE, METADATA, alibaba_state_dict

    pipe = tiny_pipeline(seed=0, with_transformer_ref=False)
    sd, _ = alibaba_state_dict(tiny_transformer(seed=1), seed=3)
    path = save_lora(tmp_path / FL2VA_FILE, sd, METADATA)
    pipe.to("cuda")
    before = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    pipe.load_lora_weights(path, adapter_name="pdd")
    assert pipe.transformer.proj_out.weight.is_cuda
    out = pipe(**CALL, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(out.frames).all() and torch.isfinite(out.audio).all()
    pipe.unload_lora_weights()
    after = pipe.transformer.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], v) and after[k].device == v.device for k, v in before.items())


def test_pdd_under_the_low_memory_offload_on_the_gpu_equals_the_resident_pipeline(tmp_path):
    """The offload groups are rebuilt around the bank: with the heads onloaded by their group, a PDD request equals
    the same request with the whole pipeline resident on the GPU."""
    from diffusers_h3.parallel.placement import enable_low_memory_offload
    from diffusers_h3.testing.tiny import tiny_pipeline

    from ..loaders._lora_helpers import save_lora, tiny_transformer
    from ..loaders.test_pdd import CALL, FL2VA_FILE, METADATA, alibaba_state_dict

    sd, _ = alibaba_state_dict(tiny_transformer(seed=1), seed=4)
    path = save_lora(tmp_path / FL2VA_FILE, sd, METADATA)
    resident = tiny_pipeline(seed=2, with_transformer_ref=False).to("cuda")
    resident.load_lora_weights(path, adapter_name="pdd")
    expected = resident(**CALL, generator=torch.Generator().manual_seed(0))
    offloaded = tiny_pipeline(seed=2, with_transformer_ref=False)
    enable_low_memory_offload(offloaded, "cuda")
    offloaded.load_lora_weights(path, adapter_name="pdd")
    got = offloaded(**CALL, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(got.frames, expected.frames, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.audio, expected.audio, atol=1e-5, rtol=1e-5)
    offloaded.unload_lora_weights()
    assert offloaded.transformer.proj_out.weight.shape[0] == offloaded.transformer.proj_out.out_features
