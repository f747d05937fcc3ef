"""The DiT forward's activation peak by packed rows, traced on the meta device (no GPU, no weights, seconds on a CPU).

    python benchmarks/activation_trace.py --out benchmarks/results/activation_trace.json

Builds the released MiniMax-H3 transformer on the ``meta`` device (two blocks: every block holds the same
activations, so the peak of two is the peak of fifty) and runs one forward over a packed sequence of each number of
rows in the grid, once per feed-forward chunking setting (``ffn_chunk_rows``: none, and the PC recipes'). A
``TorchDispatchMode`` counts the bytes of every tensor an op creates until its storage is freed; the peak of that
count is the forward's activation peak, weights excluded. Two kernels are stood in for by what their CUDA kernels
allocate, because their composite (meta) decompositions would allocate more: RMSNorm (one fused kernel: its output and
a float32 rstd per row) and attention (a flash kernel: its output; the projections, QK-norm and rotary around it run
as the package's processors run them). With those two stood in, a real CPU forward creates exactly the tensors the
meta trace counts (a test runs both).

The memory model (``benchmarks/memory_model.py --activations``) uses the traced peak as the forward's per-row term and
fits only the fixed part (weights in flight, small tensors) and the LoRA term on the measured forwards; the trace
carries the shape of the curve the measured shapes cannot show, e.g. where the rotary embedding's temporaries
overtake the chunked feed-forward's.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
import weakref
from pathlib import Path
from typing import Dict, Optional, Sequence


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402


GIB = 2**30
# The released transformer's configuration (docs/checkpoints.md; a test checks it against the config of the demo's
# scaled copy where the names overlap).
RELEASED_TRANSFORMER_CONFIG = {
    "num_attention_heads": 56, "attention_head_dim": 128, "hidden_size": 5376, "num_layers": 2,
    "num_refiner_layers": 2, "ffn_dim": 14336, "in_channels": 24, "audio_in_channels": 32, "text_dim": 5120,
    "freq_dim": 256, "time_embed_hidden_dim": 5376, "time_embed_dim": 2688, "rope_freq_dim": 16,
}  # fmt: skip
FP32_MODULES = ("proj_in", "audio_proj_in", "time_embedder", "proj_out", "audio_proj_out", "rope")
TEXT_ROWS, AUDIO_ROWS, GRID_HW = 512, 400, (24, 42)  # a 768x1344 canvas: 24 x 42 patches per latent frame
DEFAULT_ROWS = tuple(range(10_000, 160_001, 10_000))
DEFAULT_CHUNKS = (None, 8192, 16384)


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of the storages ops create while they live; ``peak`` is the largest count, ``at_peak`` the
    op and the few Python frames that made it. Storages in ``excluded`` (the weights) are not counted."""

    def __init__(self, excluded=()):
        super().__init__()
        self.live = self.peak = 0
        self.at_peak = ""
        self._counted = set()
        self._excluded = {id(s) for s in excluded}
        self._keep = list(excluded)  # the excluded storages' Python objects stay the same while counted

    def _count(self, tensor: torch.Tensor, op: str) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._counted or key in self._excluded:
            return
        nbytes = storage.nbytes()
        self._counted.add(key)
        self.live += nbytes
        if self.live > self.peak:
            self.peak = self.live
            frames = traceback.extract_stack()[-8:-3][::-1]
            self.at_peak = f"{op} in " + " <- ".join(f"{f.name}:{f.lineno}" for f in frames)
        weakref.finalize(storage, self._free, key, nbytes)

    def _free(self, key, nbytes):
        self.live -= nbytes
        self._counted.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor):
                self._count(item, str(func))
        return out


def _fused_rms_norm(x, normalized_shape, weight=None, eps=None):
    """What CUDA's fused RMSNorm allocates: the output and one float32 rstd per normalized row."""
    torch.empty(x.shape[: x.dim() - len(normalized_shape)], dtype=torch.float32, device=x.device)
    return torch.empty_like(x)


def _flash_like_processor():
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor

    from diffusers_h3.attention_processors._projections import project_output, project_qkv

    class FlashLikeProcessor(MiniMaxH3AttnProcessor):
        """The package's projections, QK-norm, rotary and output projection around an attention that allocates only
        its output (a flash kernel's footprint; its float32 log-sum-exp per row and head is negligible)."""

        def __call__(self, attn, hidden_states, rotary_emb=None, attention_mask=None):
            if rotary_emb is None:
                return super().__call__(attn, hidden_states, rotary_emb, attention_mask)
            query, key, value = project_qkv(attn, hidden_states, rotary_emb)
            return project_output(attn, torch.empty_like(query), query.dtype)

    return FlashLikeProcessor()


def forward_inputs(rows: int, config: Optional[dict] = None, device="meta") -> Dict[str, torch.Tensor]:
    """A t2va forward's inputs of ``rows`` packed rows (512 text, 400 audio, the rest video on a 768x1344 canvas's
    24 x 42 patch grid) for the transformer of ``config`` (default: the released one); empty tensors on ``device``."""
    config = config or RELEASED_TRANSFORMER_CONFIG
    h, w = GRID_HW
    video_rows = rows - TEXT_ROWS - AUDIO_ROWS
    if video_rows < h * w:
        raise ValueError(f"{rows} rows leave less than one latent frame of video rows ({h * w})")
    seq = TEXT_ROWS + AUDIO_ROWS + video_rows
    text = torch.arange(0, TEXT_ROWS)
    audio = torch.arange(TEXT_ROWS, TEXT_ROWS + AUDIO_ROWS)
    video = torch.arange(TEXT_ROWS + AUDIO_ROWS, seq)
    tags = torch.zeros(seq, dtype=torch.long)
    tags[text], tags[audio] = 1, 2
    positions = torch.zeros(seq, 3, dtype=torch.long)
    flat = torch.arange(video_rows)
    positions[video] = torch.stack([flat // (h * w), flat // w % h, flat % w], -1)
    bf16 = torch.bfloat16
    patch_channels = config["in_channels"] * 4  # patch (1, 2, 2)
    return {
        "hidden_states": torch.randn(1, video_rows, patch_channels, device=device).to(bf16),
        "audio_hidden_states": torch.randn(1, AUDIO_ROWS, config["audio_in_channels"], device=device).to(bf16),
        "encoder_hidden_states": torch.randn(1, TEXT_ROWS, config["text_dim"], device=device).to(bf16),
        "timestep": torch.full((1,), 0.5, device=device),
        "timestep_indices": torch.zeros(seq, dtype=torch.long, device=device),
        "token_tags": tags.to(device), "position_ids": positions.to(device), "video_indices": video.to(device),
        "audio_indices": audio.to(device), "text_indices": text.to(device), "return_dict": False,
    }  # fmt: skip


def build_meta_transformer(config: Optional[dict] = None, ffn_chunk_rows: Optional[int] = None, device="meta"):
    """The transformer of ``config`` (default: the released one, two blocks) on ``device`` (meta: no memory), bf16
    with the float32 modules diffusers keeps, the flash-like processor and the feed-forward chunking of
    ``ffn_chunk_rows``."""
    from diffusers import MiniMaxH3Transformer3DModel
    from diffusers.utils import logging as diffusers_logging

    from diffusers_h3.hooks.feed_forward_chunks import FeedForwardChunking, enable_feed_forward_chunking

    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # the float32-modules notice of .to(bfloat16): kept below on purpose
    try:
        with torch.device(device):
            model = MiniMaxH3Transformer3DModel(**(config or RELEASED_TRANSFORMER_CONFIG)).to(torch.bfloat16)
    finally:
        diffusers_logging.set_verbosity(verbosity)
    for name in FP32_MODULES:
        module = getattr(model, name, None)
        if module is not None:
            module.float()
    model.set_attn_processor(_flash_like_processor())
    if ffn_chunk_rows:
        enable_feed_forward_chunking(model, FeedForwardChunking(rows=int(ffn_chunk_rows)))
    return model


def _flash_sdpa(query, key, value, *args, **kwargs):
    """What a flash kernel allocates for the token refiner's attention (diffusers' SDPA call): its output."""
    return torch.empty_like(query)


def trace_forward_peak(model, inputs) -> LiveTensorBytes:
    """One no-grad forward of ``model`` on ``inputs`` under the counter, with RMSNorm as its fused CUDA kernel and
    SDPA as a flash kernel (the meta device and the CPU would otherwise take other attention paths)."""
    weights = [t.untyped_storage() for t in list(model.parameters()) + list(model.buffers())]
    counter = LiveTensorBytes(excluded=weights)
    functional = torch.nn.functional
    saved = functional.rms_norm, torch.rms_norm, functional.scaled_dot_product_attention
    functional.rms_norm = torch.rms_norm = _fused_rms_norm
    functional.scaled_dot_product_attention = _flash_sdpa
    try:
        with torch.no_grad(), counter:
            model(**inputs)
    finally:
        functional.rms_norm, torch.rms_norm, functional.scaled_dot_product_attention = saved
    return counter


def trace(rows: Sequence[int] = DEFAULT_ROWS, chunks: Sequence[Optional[int]] = DEFAULT_CHUNKS) -> Dict:
    out = {"rows": list(rows), "peaks_gib": {}, "at_peak": {}}
    for chunk in chunks:
        model = build_meta_transformer(ffn_chunk_rows=chunk)
        key = str(chunk) if chunk else "none"
        peaks, where = [], []
        for n in rows:
            counter = trace_forward_peak(model, forward_inputs(n))
            peaks.append(round(counter.peak / GIB, 4))
            where.append(counter.at_peak)
        out["peaks_gib"][key], out["at_peak"][key] = peaks, where
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "activation_trace.json")
    parser.add_argument("--rows", default=",".join(str(r) for r in DEFAULT_ROWS), help="comma list of packed rows")
    args = parser.parse_args(argv)
    result = {
        "suite": "activation trace (meta device)",
        "command": "python benchmarks/activation_trace.py" + ("" if args.rows == parser.get_default("rows")
                                                                 else f" --rows {args.rows}"),
        "torch": torch.__version__,
        "label": "traced, not measured: the bytes of the tensors a no-grad DiT forward creates, on the meta device",
        "config": RELEASED_TRANSFORMER_CONFIG, "text_rows": TEXT_ROWS, "audio_rows": AUDIO_ROWS,
        "stand_ins": {"rms_norm": "the fused CUDA kernel's output + float32 rstd",
                      "attention": "a flash kernel's output (projections, QK-norm, rotary as the package runs them)"},
        **trace([int(r) for r in args.rows.split(",")]),
    }  # fmt: skip
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for key, peaks in result["peaks_gib"].items():
        print(f"ffn_chunk_rows={key}: " + ", ".join(f"{r // 1000}k {p:.2f}" for r, p in zip(result["rows"], peaks)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
