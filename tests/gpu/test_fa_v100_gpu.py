"""FA-V100 kernel on a real GPU (marked ``gpu``; run with ``pytest -m gpu tests/gpu/test_fa_v100_gpu.py``).

Builds the extension for the GPU at hand (sm_90 on H200; the same source builds for sm_70 with a CUDA 12 toolkit) and
compares it with an fp32 oracle on fresh random inputs: odd lengths and partial tiles, unequal query / key lengths,
strided and misaligned inputs, outputs poisoned with NaN before the call, query tiles 64 and 128, and H3 shapes.
"""


import pytest
import torch


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from diffusers_h3 import V100ModeConfig  # noqa: E402
from diffusers_h3.kernels.attention.fa_v100 import fa_v100_attention, fa_v100_reference, load_extension  # noqa: E402
from diffusers_h3.testing.tiny import tiny_transformer_inputs  # noqa: E402


# fp16 inputs with unit-variance Q/K/V: the kernel's error against the fp32 oracle is the fp16 rounding of P and of
# the output, ~5e-4 relative L2; 3e-3 leaves room without hiding an indexing bug (those give O(1) errors).
TOL = 3e-3


def _rel_l2(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _qkv(batch, seq_q, seq_k, heads, head_dim, scale=1.0):
    q = torch.randn(batch, seq_q, heads, head_dim, device="cuda") * scale
    k = torch.randn(batch, seq_k, heads, head_dim, device="cuda") * scale
    v = torch.randn(batch, seq_k, heads, head_dim, device="cuda")
    return q.half(), k.half(), v.half()


def _oracle(q, k, v):
    return fa_v100_reference(q.float(), k.float(), v.float(), round_probabilities=False)


def _poisoned(q):
    return torch.full(q.shape, float("nan"), dtype=torch.float16, device=q.device)


@pytest.fixture(scope="module", autouse=True)
def built():
    return load_extension()


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("query_tile", [64, 128])
@pytest.mark.parametrize(
    "batch,seq_q,seq_k,heads",
    [(1, 1, 1, 1), (1, 63, 65, 2), (2, 77, 77, 3), (1, 129, 300, 2), (1, 1000, 513, 1)],
)
def test_matches_fp32_oracle(batch, seq_q, seq_k, heads, head_dim, query_tile):
    q, k, v = _qkv(batch, seq_q, seq_k, heads, head_dim)
    out = fa_v100_attention(q, k, v, query_tile=query_tile, out=_poisoned(q))
    assert torch.isfinite(out).all()
    assert _rel_l2(out, _oracle(q, k, v)) < TOL
    # the torch reference of the same contract agrees as closely
    assert _rel_l2(out, fa_v100_reference(q, k, v)) < TOL


def test_query_tiles_are_bitwise_equal():
    q, k, v = _qkv(2, 517, 389, 3, 128)
    a = fa_v100_attention(q, k, v, query_tile=64)
    b = fa_v100_attention(q, k, v, query_tile=128)
    assert torch.equal(a, b)


def test_peaky_softmax_and_custom_scale():
    q, k, v = _qkv(1, 200, 333, 2, 128, scale=3.0)  # scores up to ~100: online rescaling matters
    out = fa_v100_attention(q, k, v, softmax_scale=0.2, out=_poisoned(q))
    ref = fa_v100_reference(q.float(), k.float(), v.float(), softmax_scale=0.2, round_probabilities=False)
    assert _rel_l2(out, ref) < TOL


def test_strided_and_misaligned_inputs():
    batch, seq, heads, head_dim = 1, 150, 2, 64
    fused = torch.randn(batch, seq, 3, heads, head_dim, device="cuda").half()
    q, k, v = fused.unbind(2)  # seq stride 3 * heads * head_dim: strided, no copy
    out = fa_v100_attention(q, k, v, out=_poisoned(q))
    assert _rel_l2(out, _oracle(q, k, v)) < TOL
    flat = torch.randn(batch * seq * heads * head_dim + 4, device="cuda").half()
    q_odd = flat[4:].view(batch, seq, heads, head_dim)  # base 8 bytes off 16-byte alignment: copied
    out = fa_v100_attention(q_odd, k, v)
    assert _rel_l2(out, _oracle(q_odd, k, v)) < TOL


def test_h3_shape_rank_slice():
    # 38,222 packed rows (37,296 video + 414 audio + 512 text), 2 of H3's 56 heads x 128
    q, k, v = _qkv(1, 38222, 38222, 2, 128)
    out = fa_v100_attention(q, k, v, query_tile=128, out=_poisoned(q))
    assert torch.isfinite(out).all()
    rows = torch.randint(0, 38222, (512,), device="cuda")
    ref = fa_v100_reference(q[:, rows].float(), k.float(), v.float(), round_probabilities=False)
    assert _rel_l2(out[:, rows], ref) < TOL


def test_processor_kernel_path_matches_diffusers_processor():
    from diffusers.models.transformers.transformer_minimax_h3 import (
        MiniMaxH3Attention,
        MiniMaxH3AttnProcessor,
        MiniMaxH3RotaryPosEmbed,
    )

    from diffusers_h3.attention_processors.fa_v100 import MiniMaxH3FAV100Processor

    torch.manual_seed(0)
    attn = MiniMaxH3Attention(hidden_size=256, heads=4, dim_head=128).cuda()
    pos = torch.randint(0, 20, (301, 3), device="cuda")
    rotary = MiniMaxH3RotaryPosEmbed(rope_freq_dim=16).cuda()(pos)
    hidden = torch.randn(1, 301, 256, device="cuda")
    with torch.no_grad():
        expected = MiniMaxH3AttnProcessor()(attn, hidden, rotary)
        processor = MiniMaxH3FAV100Processor(query_tile=128, allow_non_volta=True)
        got = processor(attn, hidden, rotary)
        # fp32 inputs with V beyond fp16 range: the power-of-two V scale keeps the fp16 kernel finite
        attn.to_v.weight.mul_(1e5)
        expected_big = MiniMaxH3AttnProcessor()(attn, hidden, rotary)
        got_big = processor(attn, hidden, rotary)
    assert "FA-V100 CUDA kernel" in processor.describe_path()
    assert got.dtype == torch.float32
    assert _rel_l2(got, expected) < TOL
    assert torch.isfinite(got_big).all() and _rel_l2(got_big, expected_big) < TOL


def test_v100_mode_on_gpu_uses_kernel_and_stays_close_to_fp32():
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    from diffusers_h3.hooks.v100_mode import enable_v100_mode, v100_mode_of

    torch.manual_seed(0)
    model = MiniMaxH3Transformer3DModel(
        num_attention_heads=2, attention_head_dim=128, hidden_size=64, num_layers=2, num_refiner_layers=1,
        ffn_dim=128, in_channels=4, audio_in_channels=8, text_dim=16, freq_dim=32, time_embed_hidden_dim=32,
        time_embed_dim=16, rope_freq_dim=16,
    ).cuda().eval()
    # Packed inputs beyond fp16 range (video rows ~3e4, text ~1e5).
    inputs = tiny_transformer_inputs(seq_text=7, seq_audio=6, grid=(3, 4, 5), video_scale=3e4, text_scale=1e5)
    inputs = {k: v.cuda() for k, v in inputs.items()}
    with torch.no_grad():
        ref = model(**inputs).sample
        mode = v100_mode_of(enable_v100_mode(model, V100ModeConfig(allow_non_volta=True)))
        got = model(**inputs).sample
    assert torch.isfinite(got).all()
    assert _rel_l2(got, ref) < 2e-2
    assert "FA-V100 CUDA kernel" in mode.describe_path()
