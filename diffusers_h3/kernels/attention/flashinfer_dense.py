"""Dense attention through FlashInfer's prefill kernels: 16-bit (FlashAttention-3 on Hopper, FlashAttention-2
elsewhere) and FP8 (FlashAttention-3's FP8 kernel, Hopper only).

FlashInfer is an optional dependency (``pip install flashinfer-python``): it builds its kernels just in time on first
use (slow once, then cached on disk). This module is the only place that calls it; it adds nothing to the math.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from typing import Optional, Tuple

import torch

from .._triton_utils import kernel_op
from .fp8_per_head import quantize_fp8_per_head
from .router import KernelChoice


BACKENDS = ("auto", "fa2", "fa3")
# Where FlashInfer looks for CUDA when neither CUDA_HOME / CUDA_PATH nor an nvcc on PATH says.
DEFAULT_CUDA_HOME = "/usr/local/cuda"


def import_flashinfer():
    """The ``flashinfer`` module, or one clear error naming the fix."""
    try:
        import flashinfer
    except ImportError as error:
        raise ImportError(
            f"FlashInfer attention needs the flashinfer-python package ({error}); `pip install flashinfer-python`, "
            "or use diffusers' attention (cuDNN) instead"
        ) from error
    return flashinfer


def flashinfer_kernel_source() -> Optional[str]:
    """Where FlashInfer's kernels would come from here: its prebuilt package (``flashinfer-jit-cache``) or a CUDA
    compiler for its just-in-time build, found the way FlashInfer looks for one (``FLASHINFER_NVCC``, ``CUDA_HOME`` /
    ``CUDA_PATH``, ``nvcc`` on ``PATH``, ``/usr/local/cuda``). ``None``: the first call would fail to build."""
    if importlib.util.find_spec("flashinfer_jit_cache") is not None:
        return "prebuilt kernels (flashinfer-jit-cache)"
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    on_path = shutil.which("nvcc")
    candidates = [os.environ.get("FLASHINFER_NVCC")] + [os.path.join(h, "bin", "nvcc") for h in homes if h]
    candidates += [on_path, os.path.join(DEFAULT_CUDA_HOME, "bin", "nvcc")]
    for nvcc in candidates:
        if nvcc and os.path.isfile(nvcc) and os.access(nvcc, os.X_OK):
            return f"built on first use with {nvcc}"
    return None


def check_flashinfer_kernels() -> str:
    """The package importable (:func:`import_flashinfer`) and :func:`flashinfer_kernel_source`, or one clear error
    naming the fix (before anything is changed)."""
    import_flashinfer()
    source = flashinfer_kernel_source()
    if source is None:
        raise RuntimeError(
            "FlashInfer attention: flashinfer-python builds its kernels on first use with CUDA's compiler, and no nvcc "
            "was found (CUDA_HOME, CUDA_PATH, PATH, /usr/local/cuda) nor its prebuilt kernels; install the CUDA "
            "toolkit and set CUDA_HOME, or `pip install flashinfer-jit-cache`"
        )
    return source


def resolve_backend(backend: str, capability: Optional[Tuple[int, int]]) -> str:
    """``"fa3"`` (Hopper, SM90) or ``"fa2"`` (SM80+) for ``backend="auto"``; an explicit choice is checked."""
    if backend not in BACKENDS:
        raise ValueError(f"FlashInfer backend must be one of {BACKENDS}, got {backend!r}")
    if capability is None or capability < (8, 0):
        where = "this device" if capability is None else f"sm_{capability[0]}{capability[1]}"
        raise ValueError(f"FlashInfer attention needs a CUDA GPU of SM80 or newer; {where} is not one")
    if backend == "auto":
        return "fa3" if capability[0] == 9 else "fa2"
    if backend == "fa3" and capability[0] != 9:
        raise ValueError(f"FlashInfer's fa3 backend runs on Hopper (SM90) only, not sm_{capability[0]}{capability[1]}")
    return backend


def flashinfer_kernel_choice(
    backend: str, precision: str = "bf16", smooth_k: bool = True, on_cuda: bool = True
) -> KernelChoice:
    """What a FlashInfer attention call runs, and why, from its options alone (no tensors: the processor plans it
    before the call). ``backend``: ``"fa2"`` or ``"fa3"`` (resolved; FP8 always runs FA3); ``precision``: ``"bf16"``
    (16-bit Q/K/V as they come) or ``"fp8"``; ``on_cuda``: whether the inputs are CUDA tensors (FP8 quantizes them
    with Triton there, with the torch reference elsewhere)."""
    if precision == "fp8":
        quantized_by = "one Triton pass each" if on_cuda else "the torch reference"
        centred = " (K mean-centred)" if smooth_k else ""
        return KernelChoice("flashinfer", "single_prefill fa3 fp8",
                            f"E4M3 Q/K/V, one scale per head{centred} (quantized by {quantized_by}), FP8 P·V")  # fmt: skip
    if precision != "bf16":
        raise ValueError(f"FlashInfer attention precision must be 'bf16' or 'fp8', got {precision!r}")
    return KernelChoice("flashinfer", f"single_prefill {backend}",
                        "dense 16-bit attention; FA3 and FA2 have GPU tests (tests/gpu/test_flashinfer_gpu.py)")  # fmt: skip


def _batched(outputs):
    """One ``[batch, seq, heads, dim]`` tensor from the per-item outputs (one item: a view, no copy)."""
    return outputs[0].unsqueeze(0) if len(outputs) == 1 else torch.stack(outputs)


def _check_16bit_operands(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, what: str) -> None:
    if query.dtype not in (torch.bfloat16, torch.float16) or key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(f"{what} takes bf16 or fp16 Q/K/V of one dtype, got {query.dtype}, {key.dtype}, {value.dtype}")


def flashinfer_dense_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, backend: str
) -> Tuple[torch.Tensor, KernelChoice]:
    """``softmax(Q K^T / sqrt(d)) V`` on ``(batch, seq, heads, head_dim)`` bf16 / fp16 tensors, no mask, one FlashInfer
    single-prefill call per batch item (``backend`` already resolved: ``"fa2"`` or ``"fa3"``), in the custom op
    ``diffusers_h3::flashinfer_dense_attention``."""
    return flashinfer_dense_attention_op(query, key, value, backend), flashinfer_kernel_choice(backend)


def _attention_fake(query, key, value, *options) -> torch.Tensor:
    return torch.empty_like(query, memory_format=torch.contiguous_format)


@kernel_op("flashinfer_dense_attention", _attention_fake)  # a library call, opaque to torch.compile
def flashinfer_dense_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                  backend: str) -> torch.Tensor:
    _check_16bit_operands(query, key, value, "FlashInfer attention")
    flashinfer = import_flashinfer()
    scale = query.shape[-1] ** -0.5
    outputs = []
    for q, k, v in zip(query, key, value):  # (seq, heads, head_dim): FlashInfer's "NHD" layout
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        outputs.append(
            flashinfer.single_prefill_with_kv_cache(q, k, v, causal=False, kv_layout="NHD", sm_scale=scale, backend=backend)
        )
    return _batched(outputs).contiguous()


def fp8_per_head_operands(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, smooth_k: bool, backend: str = "auto"
):
    """FA3 FP8's operands: E4M3 Q, K, V ``(batch, seq, heads, head_dim)`` with one fp32 scale per batch item and head;
    with ``smooth_k`` the per-head key mean is subtracted first, in fp32 (exact under softmax: it shifts every score of
    a query row by the same amount). ``backend``: as :func:`~.fp8_per_head.quantize_fp8_per_head` (``"torch"``: the
    reference). Returns ``[(x8, scale [batch, heads]) for Q, K, V]``."""
    return [quantize_fp8_per_head(query, backend=backend), quantize_fp8_per_head(key, center=smooth_k, backend=backend),
            quantize_fp8_per_head(value, backend=backend)]  # fmt: skip


def flashinfer_fp8_reference(query, key, value, smooth_k: bool = True) -> torch.Tensor:
    """What :func:`flashinfer_fp8_attention` computes, in torch: the dequantized FP8 operands through fp32 softmax
    attention (FlashInfer also rounds P to E4M3 inside the kernel; this reference keeps P in fp32)."""
    (q8, sq), (k8, sk), (v8, sv) = fp8_per_head_operands(query, key, value, smooth_k, backend="torch")
    q, k, v = (x8.float() * s[:, None, :, None] for x8, s in ((q8, sq), (k8, sk), (v8, sv)))
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=query.shape[-1] ** -0.5
    )
    return out.transpose(1, 2).to(query.dtype)


def flashinfer_fp8_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, smooth_k: bool = True
) -> Tuple[torch.Tensor, KernelChoice]:
    """``softmax(Q K^T / sqrt(d)) V`` through FlashInfer's FlashAttention-3 FP8 kernel (Hopper): E4M3 Q/K/V with one
    scale per head (:func:`fp8_per_head_operands`), FP8 P·V inside the kernel, output in the inputs' 16-bit dtype; one
    single-prefill call per batch item, in the custom op ``diffusers_h3::flashinfer_fp8_attention``."""
    choice = flashinfer_kernel_choice("fa3", "fp8", smooth_k, on_cuda=query.is_cuda)
    return flashinfer_fp8_attention_op(query, key, value, smooth_k), choice


@kernel_op("flashinfer_fp8_attention", _attention_fake)  # a library call, opaque to torch.compile
def flashinfer_fp8_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                smooth_k: bool) -> torch.Tensor:
    _check_16bit_operands(query, key, value, "FlashInfer FP8 attention")
    flashinfer = import_flashinfer()
    scale = query.shape[-1] ** -0.5
    # FlashInfer runs on CUDA tensors; a CPU call (a stand-in of the library in tests) takes the torch reference.
    quantizer = "triton" if query.is_cuda else "torch"
    (q8, sq), (k8, sk), (v8, sv) = fp8_per_head_operands(query, key, value, smooth_k, backend=quantizer)
    outputs = [
        flashinfer.single_prefill_with_kv_cache(
            q8[b], k8[b], v8[b], scale_q=sq[b], scale_k=sk[b], scale_v=sv[b], o_dtype=query.dtype, causal=False,
            kv_layout="NHD", sm_scale=scale, backend="fa3",
        )
        for b in range(query.shape[0])
    ]  # fmt: skip
    return _batched(outputs).contiguous()
