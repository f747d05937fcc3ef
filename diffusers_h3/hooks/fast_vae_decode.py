"""Faster decode of the MiniMax-H3 video VAE: its tiles decoded as batches, optionally through `torch.compile`.

`AutoencoderKLMiniMaxH3` decodes in temporal chunks (`tokens_chunk_size + token_overlap` latent frames each) and, with
tiling on (the released default), each chunk in overlapping spatial tiles: 7 chunks x 28 tiles at 768x1344x124. Its
decoder is a non-causal ViT that keeps no state between calls, so every (chunk, tile) decode is independent, and all
of them have the same shape. Decoded one by one, each of the 196 calls runs its 36 layers as small GEMMs and the GPU
waits on launches; here same-shaped tiles are stacked along the batch axis and decoded together (batch elements do not
interact: per-token linears and norms, attention within each element).

Only the decoder calls change. Each chunk's tiles are stitched by diffusers' `_stitch_tiles` (the spatial tile blend)
and the chunks cross-faded and trimmed by `_decode`'s own loop (`_vae_tiles.iter_decoded_chunks`, bitwise diffusers'
`_decode` for the same chunks). In fp32 the result equals the native
tiled decode up to GEMM summation order (tested within 1e-6 relative L2); in bf16 the batched GEMMs may use other
kernels, and the measured distance is in `benchmarks/results/vae_h200.json`.

The path is a `FastVAEDecodeHook` registered as `H3_FAST_VAE_DECODE_HOOK` in the VAE's diffusers `HookRegistry`,
holding the `FastVAEDecodeState` record: the registry is the one place that says the fast decode is on. diffusers'
hooks wrap `forward`, but the VAE decodes through `decode` -> `_decode`, so nothing on the VAE is replaced: the
pipeline decodes through :func:`vae_decode` (and a chunk at a time through :func:`chunk_decoder`), which take the fast
path exactly while the hook is registered; `vae.decode` itself stays diffusers' own.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from diffusers.utils import logging

from .._hooks import H3_FAST_VAE_DECODE_HOOK, H3Hook, h3_record, register_h3_hook, remove_h3_hook
from .._utils import config_from_call
from .._vae_tiles import decode_from_tiles, tile_layout


logger = logging.get_logger(__name__)

# Tiles decoded in one decoder call unless the caller says otherwise: one 768x1344 chunk (28 tiles) fits with room.
DEFAULT_TILES_PER_BATCH = 32
FP8_LINEARS_NOTE = "FP8 decoder linears (FP8Config; approximate: measured error and speed in docs/vae.md)"
# `proj_in` maps the 24 latent channels (not a multiple of 16, and kept fp32 by the checkpoint).
FP8_KEEP = ("proj_in",)


def decoder_is_fp8(vae) -> bool:
    """Whether the VAE decoder's linears are quantized (``fp8_linears=True`` earlier; it cannot be undone)."""
    from ..quantizers import is_quantized_linear

    return any(is_quantized_linear(m) for m in vae.decoder.modules())


@dataclass
class FastVAEDecodeState:
    """What `enable_fast_vae_decode` installed on a VAE, and what its last decode actually ran."""

    tiles_per_batch: int
    compile: bool
    decoder: Callable[[torch.Tensor], torch.Tensor]
    fp8_linears: bool = False
    last_run: Optional[str] = None
    compile_seconds: Optional[float] = None
    _warned_parallel: bool = field(default=False, repr=False)

    def describe_path(self) -> str:
        mode = f"batched tiles (up to {self.tiles_per_batch} per decoder call)"
        mode += ", decoder under torch.compile" if self.compile else ", eager decoder"
        if self.fp8_linears:
            mode += f", {FP8_LINEARS_NOTE}"
        return f"{mode}; last decode: {self.last_run or 'none yet'}"


def _vae_of(pipe_or_vae):
    from diffusers import AutoencoderKLMiniMaxH3

    vae = getattr(pipe_or_vae, "vae", pipe_or_vae)
    if not isinstance(vae, AutoencoderKLMiniMaxH3):
        raise TypeError(
            f"fast VAE decode needs a MiniMax-H3 pipeline or an AutoencoderKLMiniMaxH3, got {type(pipe_or_vae).__name__}"
            " — pass `pipe` or `pipe.vae`."
        )
    return vae


def _balanced_batches(indices: List[int], limit: int) -> List[List[int]]:
    """`indices` split into the fewest batches of at most `limit`, of sizes differing by at most one (fewer shapes
    for a compiled decoder to specialize on)."""
    num_batches = math.ceil(len(indices) / limit)
    base, extra = divmod(len(indices), num_batches)
    batches, start = [], 0
    for b in range(num_batches):
        size = base + int(b < extra)
        batches.append(indices[start : start + size])
        start += size
    return batches


def _decode_units(vae, state: FastVAEDecodeState, units: List[torch.Tensor]) -> Tuple[List[torch.Tensor], int]:
    """Decode every latent unit `(B, C, t, h, w)`; same-shaped units share decoder calls. Returns outputs in order
    and the number of decoder calls."""
    by_shape: Dict[Tuple[int, ...], List[int]] = {}
    for index, unit in enumerate(units):
        by_shape.setdefault(tuple(unit.shape), []).append(index)
    decoded: List[Optional[torch.Tensor]] = [None] * len(units)
    calls = 0
    for indices in by_shape.values():
        for batch in _balanced_batches(indices, state.tiles_per_batch):
            stacked = torch.cat([units[i] for i in batch], dim=0)
            started = time.perf_counter() if state.compile and state.compile_seconds is None else None
            out = state.decoder(vae.post_quant_conv(stacked))
            if started is not None:  # the first compiled call pays the compilation
                if out.is_cuda:
                    torch.cuda.synchronize(out.device)
                state.compile_seconds = time.perf_counter() - started
            calls += 1
            for i, piece in zip(batch, out.split(units[batch[0]].shape[0], dim=0)):
                decoded[i] = piece
    return decoded, calls


class FastVAEDecodeHook(H3Hook):
    """The fast decode's place in the VAE's registry: holds the `FastVAEDecodeState` record that :func:`vae_decode`
    and :func:`chunk_decoder` follow."""


def fast_vae_decode_state(vae: torch.nn.Module) -> Optional[FastVAEDecodeState]:
    """The record of the fast decode enabled on `vae`, or `None` (diffusers' own decode)."""
    return h3_record(vae, H3_FAST_VAE_DECODE_HOOK)


def vae_decode(vae, z: torch.Tensor) -> torch.Tensor:
    """`vae.decode(z).sample` on the path enabled on `vae`: with `enable_fast_vae_decode` its tiles (of all temporal
    chunks) in batched decoder calls, stitched and cross-faded as diffusers' `_decode` does; else `vae.decode` itself.
    The pipeline's video decode runs through it."""
    state = fast_vae_decode_state(vae)
    if state is None:
        return vae.decode(z, return_dict=False)[0]
    from diffusers.models.modeling_utils import get_parameter_dtype

    # What `vae.decode` does around `_decode`: model CPU offload moves the VAE onto its device, the latents take the
    # dtype of the first module that reads them, and sliced decoding decodes one video at a time.
    if hasattr(vae, "_hf_hook") and hasattr(vae._hf_hook, "pre_forward"):
        vae._hf_hook.pre_forward(vae)
    z = z.to(get_parameter_dtype(vae.post_quant_conv))
    if vae.use_slicing and z.shape[0] > 1:
        return torch.cat([_batched_decode(vae, state, z_slice) for z_slice in z.split(1)])
    return _batched_decode(vae, state, z)


def note_parallel_decode(vae) -> None:
    """The pipeline decoded with the context-parallel decode (tiles split over the ranks): say so once, and record it
    as the last decode, when the fast decode is on (its tiles are not batched on that path)."""
    state = fast_vae_decode_state(vae)
    if state is None:
        return
    if not state._warned_parallel:
        logger.warning("fast VAE decode: the context-parallel VAE decode splits the tiles over the ranks itself; tiles "
                       "are not batched on this path.")  # fmt: skip
        state._warned_parallel = True
    state.last_run = "deferred to the context-parallel decode (tiles split over ranks, not batched)"


def _batched_decode(vae, state: FastVAEDecodeState, z: torch.Tensor) -> torch.Tensor:
    """diffusers' `_decode` of `z` with the tiles of all its chunks decoded in batches."""
    decoder_calls = 0

    def decode_tiles(tiles):
        nonlocal decoder_calls
        decoded, decoder_calls = _decode_units(vae, state, tiles)
        return decoded

    out, tiles, chunks = decode_from_tiles(vae, z, decode_tiles)
    state.last_run = f"{tiles} tiles in {decoder_calls} decoder calls ({chunks} chunks)"
    return out


def chunk_decoder(vae) -> Callable[[torch.Tensor], torch.Tensor]:
    """The decode of one temporal chunk (the latent slice diffusers' `_decode` hands to `_decode_clip`) on the path
    installed on `vae`: diffusers' `_decode_clip` (its tiles one by one), or with `enable_fast_vae_decode` the
    chunk's tiles in batched decoder calls, stitched by diffusers' `_stitch_tiles`.

    For a chunk-by-chunk decode (`MiniMaxH3Pipeline.decode_to_video`). Batches never mix chunks here, while the
    whole-clip fast decode batches the tiles of all chunks together; at 768x1344 both decode the 28 tiles of one
    chunk per call (`DEFAULT_TILES_PER_BATCH` 32, balanced batches), so the calls are the same shape.
    """
    state = fast_vae_decode_state(vae)
    if state is None:
        return vae._decode_clip
    totals = {"chunks": 0, "tiles": 0, "calls": 0}

    def decode_clip(clip: torch.Tensor) -> torch.Tensor:
        rows, y_overlaps, x_overlaps = tile_layout(vae, clip)
        tiles = [tile for row in rows for tile in row]
        decoded, calls = _decode_units(vae, state, tiles)
        pieces = iter(decoded)
        grid = [[next(pieces) for _ in row] for row in rows]
        totals["chunks"] += 1
        totals["tiles"] += len(tiles)
        totals["calls"] += calls
        state.last_run = (f"{totals['tiles']} tiles in {totals['calls']} decoder calls ({totals['chunks']} chunks, "
                          "decoded chunk by chunk)")  # fmt: skip
        return vae._stitch_tiles(grid, y_overlaps, x_overlaps) if vae.use_tiling else grid[0][0]

    return decode_clip


@dataclass(frozen=True)
class FastVAEDecodeConfig:
    """The options of :func:`enable_fast_vae_decode`.

    Args:
        batch_tiles (`bool` or `int`, defaults to `True`): Stack same-shaped tiles (of all temporal chunks) into one
            decoder call, at most `DEFAULT_TILES_PER_BATCH` per call for `True`, or at most this many for an int.
            The decoder's activation memory grows linearly with it.
            `False` decodes one tile per call (only useful with `compile`).
        compile (`bool`, defaults to `False`): Run the decoder through `torch.compile` (one graph per batch shape,
            compiled on the first decode; the time it took is reported by `describe`). The VAE's own `decoder`
            module is left as it is.
        fp8_linears (`bool`, defaults to `False`): Quantize the decoder's linears to FP8 (`FP8Config`: E4M3 weights,
            per-token activations; FP8 tensor cores on SM89+, elsewhere FP8Config's fallbacks) in place, once — an
            approximation (its measured speed and error: docs/vae.md). It cannot be undone: reload the VAE for bf16
            linears.
    """

    batch_tiles: Union[bool, int] = True
    compile: bool = False
    fp8_linears: bool = False

    def __post_init__(self):
        batch_tiles = self.batch_tiles
        if not isinstance(batch_tiles, bool) and not (isinstance(batch_tiles, int) and batch_tiles >= 1):
            raise ValueError(f"`batch_tiles` must be True, False or a positive int, got {batch_tiles!r}.")
        if not isinstance(self.compile, bool):
            raise ValueError(f"`compile` must be True or False, got {self.compile!r}.")
        if not isinstance(self.fp8_linears, bool):
            raise ValueError(f"`fp8_linears` must be True or False, got {self.fp8_linears!r}.")

    @property
    def tiles_per_batch(self) -> int:
        if isinstance(self.batch_tiles, bool):
            return DEFAULT_TILES_PER_BATCH if self.batch_tiles else 1
        return self.batch_tiles


def enable_fast_vae_decode(pipe_or_vae: Any, config: Optional[FastVAEDecodeConfig] = None, **legacy) -> Any:
    """Decode the MiniMax-H3 video VAE's tiles in batches; the pipeline's decode (`vae_decode`) uses it from now on.

    Args:
        pipe_or_vae: A `MiniMaxH3Pipeline` (its `vae`) or an `AutoencoderKLMiniMaxH3`.
        config (`FastVAEDecodeConfig`, *optional*): The options (default: batched tiles, no compile, bf16 linears).
            `batch_tiles=` / `compile=` / `fp8_linears=` as separate arguments still work for one release, with a
            `FutureWarning`.

    Returns the argument. The pipeline's decode takes the fast path; outside it, decode with `vae_decode(vae, z)`
    (`vae.decode` stays diffusers' own). What was enabled (and what the last decode ran) is the `FastVAEDecodeState`
    record its `H3_FAST_VAE_DECODE_HOOK` holds: `fast_vae_decode_state(vae)`, reported by `diffusers_h3.describe`.
    Enabling again replaces the earlier options. The tile geometry and blend are the VAE's own
    (`vae.enable_tiling(...)` still sets them). Undo with `disable_fast_vae_decode`.
    """
    config = config_from_call(FastVAEDecodeConfig, config, legacy, call="enable_fast_vae_decode")
    vae = _vae_of(pipe_or_vae)
    tiles_per_batch, compile, fp8_linears = config.tiles_per_batch, config.compile, config.fp8_linears
    already_fp8 = decoder_is_fp8(vae)
    if already_fp8 and not fp8_linears:
        raise ValueError(
            "the VAE decoder's linears are already quantized (fp8_linears=True earlier), which cannot be undone: pass "
            "fp8_linears=True, or reload the VAE for bf16 linears."
        )
    if tiles_per_batch == 1 and not compile:
        raise ValueError(
            "FastVAEDecodeConfig(batch_tiles=False, compile=False) would change nothing: enable one of them, or "
            "call disable_fast_vae_decode."
        )
    if fp8_linears and not already_fp8:
        from ..quantizers import FP8Config, quantize

        quantize(vae.decoder, FP8Config(modules_to_not_convert=list(FP8_KEEP)))
    decoder = torch.compile(vae.decoder, dynamic=False) if compile else vae.decoder
    state = FastVAEDecodeState(tiles_per_batch=tiles_per_batch, compile=compile, decoder=decoder,
                               fp8_linears=fp8_linears)  # fmt: skip
    remove_h3_hook(vae, H3_FAST_VAE_DECODE_HOOK, recurse=False)
    register_h3_hook(vae, FastVAEDecodeHook(state), H3_FAST_VAE_DECODE_HOOK)
    return pipe_or_vae


def disable_fast_vae_decode(pipe_or_vae: Any) -> Any:
    """Restore diffusers' tile-by-tile decode (a no-op when the fast decode is not enabled) by removing the
    `H3_FAST_VAE_DECODE_HOOK`; returns the argument. FP8 decoder linears (`fp8_linears=True`) stay FP8."""
    vae = _vae_of(pipe_or_vae)
    remove_h3_hook(vae, H3_FAST_VAE_DECODE_HOOK, recurse=False)
    return pipe_or_vae


def describe_vae_decode(vae: torch.nn.Module) -> str:
    """The decode path of an `AutoencoderKLMiniMaxH3`, with what its last decode ran."""
    state = fast_vae_decode_state(vae)
    if state is None:
        tiling = "tiled" if getattr(vae, "use_tiling", False) else "untiled"
        fp8 = f", {FP8_LINEARS_NOTE}" if decoder_is_fp8(vae) else ""
        return f"diffusers native {tiling} decode (one decoder call per tile){fp8}"
    text = state.describe_path()
    if state.compile_seconds is not None:
        text += f"; first compiled call {state.compile_seconds:.1f} s"
    return text
