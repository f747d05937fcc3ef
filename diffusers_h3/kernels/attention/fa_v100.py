"""FA-V100: FlashAttention-2-style fp16 attention forward for SM70-class GPUs (CUDA C++, WMMA tensor cores).

One entry point, :func:`fa_v100_attention`, with two paths of one numerics contract:

* ``backend="cuda"``: the kernel in ``csrc/fa_v100.cu``, built just in time through
  :func:`torch.utils.cpp_extension.load` (ninja) on first use, for the architecture of the GPU at hand, and cached in a
  build directory keyed by the source digest and the architecture;
* ``backend="reference"``: :func:`fa_v100_reference`, plain torch on any device.

Numerics contract: fp16 Q/K/V in ``(batch, seq, heads, head_dim)`` layout, head_dim 64 or 128, non-causal, no mask;
``S = Q K^T`` in fp32, softmax in fp32, ``P`` rounded to fp16 before ``P V`` (fp32 accumulation), the row sum taken over
the rounded ``P``, output fp16. The kernel uses an online softmax over key tiles of 64, so it matches the reference up
to fp16 rounding of ``P`` (its measured error against an fp32 oracle: docs/v100.md).

The kernel is *valid* on sm_70 and newer (WMMA 16x16x16). It was written for V100 (sm_70), where flash-attn, bf16 and
tensor-core Triton are unavailable; it has been run on a Hopper GPU (sm_90) only and compiled for sm_75 in CPU CI, and is
**not run on V100 hardware**. CUDA 13 toolkits cannot target sm_70: on a V100 build with a CUDA 12.x toolkit (the
cu126 torch wheels still carry sm_70).
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import shutil
import threading
from pathlib import Path
from typing import Optional, Tuple, Union

import torch

from ..._utils import cuda_capability
from .._triton_utils import kernel_op


SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_QUERY_TILES = (64, 128)

CSRC_DIR = Path(__file__).resolve().parent / "csrc"
KERNEL_SOURCE = CSRC_DIR / "fa_v100.cu"
BINDING_SOURCE = CSRC_DIR / "fa_v100_binding.cpp"


class FAV100BuildError(RuntimeError):
    """The FA-V100 extension cannot be built or loaded on this machine; the message says why and what to do."""


def is_sm70_class(device: Optional[Union[torch.device, str, int]] = None) -> bool:
    """True for compute capability 7.x (V100 sm_70, Xavier sm_72, Turing sm_75).

    These GPUs have fp16 tensor cores but no flash-attn 2, no bf16 tensor cores and (sm_70) no tensor-core Triton:
    FA-V100 is meant for them. On sm_80 and newer the kernel still runs (WMMA is valid there) but SDPA's flash / cuDNN
    kernels are faster, so callers use it there only on request (``allow_non_volta=True`` in the processor).
    """
    cap = cuda_capability(torch.device("cuda", device) if isinstance(device, int) else device)
    return cap is not None and cap[0] == 7


def default_build_dir() -> Path:
    """Cache directory for the JIT-built extension: ``~/.cache/diffusers_h3/torch_extensions``."""
    return Path.home() / ".cache" / "diffusers_h3" / "torch_extensions"


def source_digest() -> str:
    """SHA-256 over the kernel and binding sources; part of the extension's name, so an edit forces a rebuild."""
    digest = hashlib.sha256()
    for path in (KERNEL_SOURCE, BINDING_SOURCE):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


_BUILD_LOCK = threading.Lock()
_EXTENSIONS: dict = {}


def load_extension(
    device: Optional[Union[torch.device, str]] = None,
    *,
    build_dir: Optional[Union[str, os.PathLike]] = None,
    verbose: bool = False,
):
    """Build (once) and import the FA-V100 extension for the architecture of ``device``.

    The build runs :func:`torch.utils.cpp_extension.load` with ninja into ``build_dir`` (default
    :func:`default_build_dir`) under a name made of the source digest, the ``sm_XY`` target and the torch / CUDA
    versions, so later processes reuse the compiled library. Raises :class:`FAV100BuildError` naming the problem and the fix; a failed build is
    remembered and not retried in this process.
    """
    device = torch.device("cuda") if device is None else torch.device(device)
    capability = cuda_capability(device)
    if capability is None:
        raise FAV100BuildError("FA-V100 needs a CUDA GPU; none is available (use backend='reference' on CPU).")
    if capability < (7, 0):
        raise FAV100BuildError(
            f"FA-V100 needs fp16 tensor cores (sm_70 or newer); this GPU is sm_{capability[0]}{capability[1]}."
        )
    arch = f"{capability[0]}{capability[1]}"
    build_root = Path(build_dir) if build_dir is not None else default_build_dir()
    key = (arch, str(build_root))
    with _BUILD_LOCK:
        cached = _EXTENSIONS.get(key)
        if isinstance(cached, FAV100BuildError):
            raise cached
        if cached is not None:
            return cached
        try:
            module = _build(arch, build_root, verbose)
        except FAV100BuildError as error:
            _EXTENSIONS[key] = error
            raise
        _EXTENSIONS[key] = module
        return module


def _build(arch: str, build_root: Path, verbose: bool):
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        raise FAV100BuildError("FA-V100 is built with ninja, which is not installed: `pip install ninja`.")
    nvcc = Path(cpp_extension.CUDA_HOME or "") / "bin" / "nvcc"
    if cpp_extension.CUDA_HOME is None or not (nvcc.exists() or shutil.which("nvcc")):
        raise FAV100BuildError(
            "FA-V100 needs the CUDA toolkit (nvcc) to build; none was found. Install a CUDA toolkit matching your "
            "torch build (CUDA 12.x for V100: CUDA 13 dropped sm_70) and set CUDA_HOME."
        )
    # the library links against this torch: its version is part of the name, like the sources and the target
    torch_tag = re.sub(r"[^0-9A-Za-z]+", "_", f"{torch.__version__}_cu{torch.version.cuda}")
    name = f"diffusers_h3_fa_v100_{source_digest()[:12]}_sm{arch}_torch{torch_tag}"
    directory = build_root / name
    directory.mkdir(parents=True, exist_ok=True)
    try:
        return cpp_extension.load(
            name=name,
            sources=[str(BINDING_SOURCE), str(KERNEL_SOURCE)],
            extra_cflags=["-O3"],
            # An explicit -gencode keeps cpp_extension from adding the targets of TORCH_CUDA_ARCH_LIST.
            extra_cuda_cflags=["-O3", "--use_fast_math", f"-gencode=arch=compute_{arch},code=sm_{arch}"],
            build_directory=str(directory),
            verbose=verbose,
        )
    except Exception as error:  # compiler errors come as RuntimeError / subprocess errors with the build log
        hint = " CUDA 13 toolkits cannot target sm_70: use a CUDA 12.x toolkit." if arch == "70" else ""
        raise FAV100BuildError(
            f"Building the FA-V100 extension for sm_{arch} in {directory} failed: {error}.{hint} "
            "Run load_extension(verbose=True) to see the compiler output."
        ) from error


def _check_operands(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> Tuple[int, int, int, int, int]:
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if tensor.dim() != 4:
            raise ValueError(
                "fa_v100_attention expects (batch, seq, heads, head_dim) tensors; "
                f"{name} has shape {tuple(tensor.shape)}."
            )
    batch, seq_q, heads, head_dim = query.shape
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have the same shape.")
    if key.shape[0] != batch or key.shape[2] != heads or key.shape[3] != head_dim:
        raise ValueError(
            f"query {tuple(query.shape)} and key {tuple(key.shape)} must agree on batch, heads and head_dim "
            "(layout (batch, seq, heads, head_dim))."
        )
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"FA-V100 supports head_dim {SUPPORTED_HEAD_DIMS}, got {head_dim}; use SDPA for other head sizes."
        )
    seq_k = key.shape[1]
    if min(batch, heads, seq_q, seq_k) <= 0:
        raise ValueError(f"empty attention: query {tuple(query.shape)}, key {tuple(key.shape)}.")
    return batch, seq_q, seq_k, heads, head_dim


def _kernel_ready(tensor: torch.Tensor) -> torch.Tensor:
    """The kernel reads 16-byte chunks: contiguous head_dim, strides in multiples of 8 elements, aligned base."""
    if tensor.stride(-1) == 1 and all(s % 8 == 0 for s in tensor.stride()[:3]) and tensor.data_ptr() % 16 == 0:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)  # a fresh allocation: aligned, dense strides


def fa_v100_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    softmax_scale: Optional[float] = None,
    round_probabilities: bool = True,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """Torch reference of the FA-V100 contract, on any device and for fp16 / bf16 / fp32 inputs.

    Scores, softmax and accumulation in fp32; with ``round_probabilities`` the probabilities (relative to the row max)
    are rounded to fp16 before ``P V`` and the row sum is taken over the rounded values, as in the kernel. With
    ``round_probabilities=False`` this is an exact fp32 attention (the oracle tests compare against). Query rows are
    processed ``chunk_size`` at a time to bound memory. Returns ``query.dtype``.
    """
    _, _, _, _, head_dim = _check_operands(query, key, value)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    q = query.float().transpose(1, 2)
    k = key.float().transpose(1, 2)
    v = value.float().transpose(1, 2)
    outputs = []
    for start in range(0, q.shape[2], chunk_size):
        scores = torch.matmul(q[:, :, start : start + chunk_size], k.transpose(-1, -2)) * scale
        probs = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
        if round_probabilities:
            probs = probs.half().float()
        outputs.append(torch.matmul(probs, v) / probs.sum(dim=-1, keepdim=True))
    return torch.cat(outputs, dim=2).transpose(1, 2).to(query.dtype)


def fa_v100_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    softmax_scale: Optional[float] = None,
    query_tile: int = 128,
    backend: str = "cuda",
    build_dir: Optional[Union[str, os.PathLike]] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Non-causal attention ``softmax(Q K^T * scale) V`` over ``(batch, seq, heads, head_dim)`` tensors.

    Args:
        query: ``(batch, seq_q, heads, head_dim)``; key, value: ``(batch, seq_k, heads, head_dim)``. float16 for the
            CUDA path (V100 has no bf16 tensor cores; cast first, watching for overflow), any float dtype for the
            reference.
        softmax_scale: defaults to ``1 / sqrt(head_dim)``.
        query_tile: query rows per thread block, 64 or 128 (4 or 8 warps). Both give bitwise-identical results; 128
            is the default (the faster one, docs/v100.md).
        backend: ``"cuda"`` (the kernel; built on first use) or ``"reference"`` (:func:`fa_v100_reference`).
        build_dir: where the CUDA path builds and caches the extension (default :func:`default_build_dir`).
        out: optional float16 ``(batch, seq_q, heads, head_dim)`` buffer the result is copied into (and returned).

    Returns ``(batch, seq_q, heads, head_dim)`` in the query's dtype. Raises :class:`FAV100BuildError` when the
    kernel cannot be built on this machine (callers that want a fallback catch it: see
    :class:`~diffusers_h3.attention_processors.fa_v100.MiniMaxH3FAV100Processor`). The work runs in the custom op
    ``diffusers_h3::fa_v100_attention`` (one node under ``torch.compile``).
    """
    result = fa_v100_attention_op(query, key, value, softmax_scale, query_tile, backend,
                                  None if build_dir is None else os.fspath(build_dir))
    if out is None:
        return result
    if out.shape != query.shape or out.dtype != torch.float16 or out.device != query.device:
        raise ValueError(
            f"out must be a float16 tensor of the query's shape {tuple(query.shape)} on {query.device}; got "
            f"{out.dtype} {tuple(out.shape)} on {out.device}."
        )
    return out.copy_(result)


def _fa_v100_fake(query, key, value, *options) -> torch.Tensor:
    return torch.empty_like(query, memory_format=torch.contiguous_format)


@kernel_op("fa_v100_attention", _fa_v100_fake)
def fa_v100_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, softmax_scale: Optional[float],
                         query_tile: int, backend: str, build_dir: Optional[str]) -> torch.Tensor:
    """:func:`fa_v100_attention` over tensors and scalars (a fresh output)."""
    batch, seq_q, seq_k, heads, head_dim = _check_operands(query, key, value)
    if query_tile not in SUPPORTED_QUERY_TILES:
        raise ValueError(f"query_tile must be one of {SUPPORTED_QUERY_TILES}, got {query_tile}.")
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    if backend == "reference":
        return fa_v100_reference(query, key, value, softmax_scale=scale).contiguous()
    if backend != "cuda":
        raise ValueError(f"backend must be 'cuda' or 'reference', got {backend!r}.")
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if tensor.dtype != torch.float16:
            raise TypeError(
                f"The FA-V100 kernel takes float16 inputs; {name} is {tensor.dtype}. Cast to float16 (V100 has no bf16 "
                "tensor cores), or use backend='reference'."
            )
        if tensor.device.type != "cuda" or tensor.device != query.device:
            raise ValueError(
                f"The FA-V100 kernel needs query, key and value on one CUDA device; {name} is on {tensor.device}."
            )
    if seq_q >= 2**31 or seq_k >= 2**31 or batch > 65535 or heads > 65535:
        raise ValueError(
            f"sizes out of the kernel's range: batch {batch}, heads {heads}, seq_q {seq_q}, seq_k {seq_k}."
        )
    extension = load_extension(query.device, build_dir=build_dir)
    out = torch.empty((batch, seq_q, heads, head_dim), dtype=torch.float16, device=query.device)
    extension.forward(_kernel_ready(query), _kernel_ready(key), _kernel_ready(value), out, scale, int(query_tile))
    return out
