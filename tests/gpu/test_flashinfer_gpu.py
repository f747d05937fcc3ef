"""FlashInfer's dense kernel through MiniMaxH3FlashInferProcessor against cuDNN on the GPU (needs flashinfer-python).

Run on a GPU machine with FlashInfer installed: ``python -m pytest tests/gpu/test_flashinfer_gpu.py -m gpu -q``.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("seq", [1000, 4133])  # partial tiles at both lengths
def test_flashinfer_core_matches_cudnn(seq):
    pytest.importorskip("flashinfer")
    from diffusers_h3.attention_processors import MiniMaxH3FlashInferProcessor
    from diffusers_h3.kernels.attention.flashinfer_dense import resolve_backend

    backend = resolve_backend("auto", torch.cuda.get_device_capability())
    gen = torch.Generator("cuda").manual_seed(seq)
    q, k, v = (torch.randn(2, seq, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    processor = MiniMaxH3FlashInferProcessor(backend)
    out = processor.core(q, k, v)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    exact = F.scaled_dot_product_attention(*(t.transpose(1, 2).double() for t in (q, k, v))).transpose(1, 2)
    err = ((out.double() - exact).norm() / exact.norm()).item()
    ref_err = ((ref.double() - exact).norm() / exact.norm()).item()
    assert err < 2 * ref_err + 1e-4, (err, ref_err)  # bf16 attention: the same rounding level as cuDNN
    assert f"single_prefill {backend}" in processor.describe_path()
