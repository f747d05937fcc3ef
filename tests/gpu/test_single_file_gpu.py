"""GPU checks of single-file DiTs: the GGUF GEMM path (diffusers' GGUFLinear, dequantize + bf16 matmul) and the
fp8-scaled path (FP8Tensor weights: per-token FP8 activations + torch._scaled_mm on SM89+), against the dense weights each
file decodes to; a GGUF DiT under model CPU offload and under the low-memory group offload.

Run on the device machine: ``python -m pytest tests/gpu/test_single_file_gpu.py -m gpu -q``.
"""

import numpy as np
import pytest
import torch

from diffusers_h3.loaders.single_file import is_gguf_linear, load_transformer_file
from diffusers_h3.testing.single_file import (
    dense_reference,
    random_gguf_blocks,
    write_fp8_scaled_safetensors,
    write_gguf,
)
from diffusers_h3.testing.tiny import (
    TINY_NUM_FRAMES,
    TINY_TRANSFORMER_CONFIG,
    tiny_transformer,
    tiny_transformer_inputs,
)


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

gguf = pytest.importorskip("gguf")

KQUANT = dict(TINY_TRANSFORMER_CONFIG, hidden_size=256, attention_head_dim=128, ffn_dim=256, time_embed_dim=32)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _run(model, device="cuda"):
    inputs = {k: v.to(device) for k, v in tiny_transformer_inputs().items()}
    with torch.no_grad():
        return model(**inputs)[0]


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K"])
def test_gguf_dit_on_gpu_runs_like_its_dequantized_weights(tmp_path, kind):
    torch.manual_seed(0)
    model = tiny_transformer(**KQUANT)
    path = tmp_path / f"h3-{kind}.gguf"
    decoded = write_gguf(model, path, kind)
    loaded = load_transformer_file(path, KQUANT, dtype=torch.bfloat16, device="cuda")
    assert all(m.weight.is_cuda for m in loaded.modules() if is_gguf_linear(m))
    reference = dense_reference(KQUANT, decoded).cuda()  # float32, the file's decoded weights
    out = _run(loaded)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()  # proj_out stays float32
    assert _rel(out, _run(reference)) < 2e-2  # bf16 activations and matmul


@pytest.mark.parametrize("kind", ["Q8_0", "Q6_K", "Q5_K", "Q4_K"])
def test_gguf_gemm_at_prefill_rows(kind):
    """One GGUFLinear at a large row count (the path the DiT's prefill takes) against the dequantized weight."""
    from diffusers.quantizers.gguf.utils import GGUFLinear, GGUFParameter, dequantize_gguf_tensor

    rows, k, n = 4099, 1024, 768
    blocks = torch.from_numpy(random_gguf_blocks(n, k, kind, np.random.default_rng(0)))
    with torch.device("meta"):
        layer = GGUFLinear(k, n, bias=False, compute_dtype=torch.bfloat16)
    layer.weight = GGUFParameter(blocks.cuda(), quant_type=gguf.GGMLQuantizationType[kind])
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        out = layer(x)
    weight = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[kind]).copy()).cuda()
    assert torch.isfinite(dequantize_gguf_tensor(layer.weight)).all()
    assert _rel(out, x.float() @ weight.T) < 1e-2


def test_fp8_scaled_dit_on_gpu_takes_the_fp8_gemm(tmp_path):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need SM89+")
    torch.manual_seed(1)
    model = tiny_transformer(**KQUANT)
    path = tmp_path / "h3_fp8_scaled.safetensors"
    written = write_fp8_scaled_safetensors(model, path, dtype=torch.bfloat16)
    loaded = load_transformer_file(path, KQUANT, dtype=torch.bfloat16, device="cuda")
    fp8 = loaded.transformer_blocks[0].attn.to_q
    assert "scaled_mm" in fp8.weight.describe_path()
    dequantized = {n: t.float() * written[n.replace(".weight", ".weight_scale")] if t.dtype == torch.float8_e4m3fn else t
                   for n, t in written.items() if not n.endswith((".weight_scale", ".comfy_quant"))}  # fmt: skip
    reference = dense_reference(KQUANT, dequantized).cuda()
    assert _rel(_run(loaded), _run(reference)) < 5e-2  # FP8 activations on top of the file's FP8 weights
    # one layer at prefill rows: torch._scaled_mm with the file's per-tensor scale broadcast to rows
    x = torch.randn(4099, fp8.in_features, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        assert _rel(fp8(x), x.float() @ fp8.weight.dequantize(torch.float32).T) < 5e-2


@pytest.mark.parametrize("offload", ["model_cpu_offload", "low_memory"])
def test_gguf_pipeline_under_offload(tmp_path, offload):
    from diffusers_h3 import MiniMaxH3Pipeline
    from diffusers_h3.parallel.placement import enable_low_memory_offload
    from diffusers_h3.testing.tiny import tiny_pipeline

    pipe = tiny_pipeline(with_transformer_ref=False)
    path = tmp_path / "h3-Q8_0.gguf"
    write_gguf(pipe.transformer, path, "Q8_0")
    pipe.save_pretrained(tmp_path / "pipe")
    run = {"prompt": "a fox", "height": 32, "width": 32, "num_frames": TINY_NUM_FRAMES, "num_inference_steps": 2,
           "output_type": "latent"}  # fmt: skip

    def load():
        transformer = load_transformer_file(path, tmp_path / "pipe", dtype=torch.float32)
        return MiniMaxH3Pipeline.from_pretrained(tmp_path / "pipe", task="t2va", transformer=transformer)

    resident = load().to("cuda")
    want = resident(generator=torch.Generator().manual_seed(0), **run).frames
    del resident
    offloaded = load()
    if offload == "model_cpu_offload":
        offloaded.enable_model_cpu_offload()
    else:
        enable_low_memory_offload(offloaded, "cuda")
    got = offloaded(generator=torch.Generator().manual_seed(0), **run).frames
    assert _rel(got.cpu(), want.cpu()) < 1e-5
