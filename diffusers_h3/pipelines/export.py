"""Write a generated clip as MP4: H.264 video + AAC stereo audio, through PyAV.

`export_to_video` writes a whole clip; `VideoWriter` encodes frames as they arrive, in a background thread, and the
audio track in the same thread once it is written (written first, it is done before the last video chunk arrives).
Both take libx264's `crf`, `preset` and `pix_fmt` (defaults chosen by `benchmarks/export.py`, see docs/pipeline.md).
The clip is encoded into a hidden temporary file beside the target and renamed onto it only when encoding finished, so
an interrupted or failed export (Ctrl-C included) never leaves a truncated MP4 and never clobbers an existing one; an OS error (a full disk) is raised naming the target file and the cause.
"""

from __future__ import annotations

import os
import queue
import threading
import uuid
from fractions import Fraction
from typing import Any, Dict, List, Optional, Union

import numpy as np
import PIL.Image
import torch
from diffusers.utils import logging

from .._video_encoding import DEFAULT_CRF, DEFAULT_PIX_FMT, DEFAULT_PRESET, check_encoding_options


logger = logging.get_logger(__name__)


# Why a generated clip holds NaN or inf, for the one error that refuses to export it (a codec would fail on it later,
# or write noise).
NON_FINITE_CAUSES = (
    "the generation diverged; likely causes: a non-finite or very large LoRA scale or LoRA weights, fp16 overflow (run "
    "in bf16 or float32, or with pipe.enable_v100_mode() on a V100), or a step callback that returned non-finite "
    "tensors"
)


def check_finite(values: torch.Tensor, what: str) -> None:
    """Refuse `values` (a clip's latents, frames or audio) if any is NaN or inf: one `ValueError` naming the likely
    cause, before anything is written."""
    if values.is_floating_point() and not bool(torch.isfinite(values).all()):
        bad = int((~torch.isfinite(values)).sum())
        raise ValueError(f"{what} hold {bad} NaN/inf values of {values.numel()}: {NON_FINITE_CAUSES}; nothing was written.")


def _frames_to_uint8(frames) -> np.ndarray:
    """Accept pipeline output (`np`, `pt`, `pil`, with or without the batch axis) → uint8 `(F, H, W, 3)`."""
    if isinstance(frames, list) and frames and isinstance(frames[0], list):
        if len(frames) != 1:
            raise ValueError(f"export_to_video writes one clip; got a batch of {len(frames)}: pass frames[i].")
        frames = frames[0]
    if isinstance(frames, list):
        if not frames or not all(isinstance(f, PIL.Image.Image) for f in frames):
            raise ValueError("`frames` as a list must hold PIL images.")
        return np.stack([np.asarray(f.convert("RGB")) for f in frames])
    if isinstance(frames, torch.Tensor):
        array = frames.detach().float().cpu()
        if array.ndim == 5:
            array = array[0] if array.shape[0] == 1 else None
            if array is None:
                raise ValueError("export_to_video writes one clip; pass frames[i] for a batch.")
        if array.ndim != 4 or array.shape[1] != 3:
            raise ValueError(f"torch frames must be (F, 3, H, W) in [0, 1], got {tuple(frames.shape)}.")
        array = array.permute(0, 2, 3, 1).numpy()
    else:
        array = np.asarray(frames)
        if array.ndim == 5:
            if array.shape[0] != 1:
                raise ValueError("export_to_video writes one clip; pass frames[i] for a batch.")
            array = array[0]
    if array.ndim != 4 or array.shape[-1] != 3:
        raise ValueError(f"frames must be (F, H, W, 3), got shape {array.shape}.")
    if array.dtype != np.uint8:
        # torch for the passes over the whole clip: numpy's math in the array's own float dtype, on all cores.
        values = torch.from_numpy(np.ascontiguousarray(array))
        values = values if values.is_floating_point() else values.double()
        low, high = values.aminmax()  # NaN propagates into both
        if not bool(torch.isfinite(low) & torch.isfinite(high)):
            check_finite(values, "the frames")
        if low < 0 or high > 1:
            raise ValueError("float frames must lie in [0, 1] (the pipeline's `np`/`pt` output).")
        array = values.mul(255.0).round_().to(torch.uint8).numpy()
    return array


def _audio_to_tensor(audio) -> torch.Tensor:
    tensor = (
        torch.as_tensor(np.asarray(audio) if not isinstance(audio, torch.Tensor) else audio).detach().float().cpu()
    )
    if tensor.ndim == 3:
        if tensor.shape[0] != 1:
            raise ValueError("export_to_video writes one clip; pass audio[i] for a batch.")
        tensor = tensor[0]
    if tensor.ndim != 2 or tensor.shape[0] != 2:
        raise ValueError(f"audio must be stereo (2, samples) or (1, 2, samples), got {tuple(tensor.shape)}.")
    check_finite(tensor, "the audio")
    return tensor


VIDEO_EXTENSIONS = (".mp4",)


def check_output_path(path: Union[str, os.PathLike]) -> str:
    """The one clear error for an output path we cannot write (checked before any encoding or generation)."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"the output directory {directory} does not exist: create it or choose another path.")
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path} is a directory: pass a file name such as {os.path.join(path, 'clip.mp4')}.")
    extension = os.path.splitext(path)[1].lower()
    if extension not in VIDEO_EXTENSIONS:
        raise ValueError(
            f"{path}: export_to_video writes MP4 (H.264 + AAC); the file name must end in .mp4"
            f"{f', not {extension}' if extension else ''}."
        )
    return path


# Chunks waiting for the encoder thread: enough to keep it busy, few enough to bound the memory of a fast producer.
MAX_QUEUED_CHUNKS = 2
_END_OF_VIDEO = object()


class _AudioTrack:
    """The stereo track in the encoder's queue: encoded by the encoder thread as soon as it is known (before the last
    video chunk when the caller has it early), so that closing the clip does not wait for the AAC encoder."""

    def __init__(self, samples: torch.Tensor):
        self.samples = samples


def _check_rate(value, name: str) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, (int, float, Fraction)) or not value > 0:
        raise ValueError(f"`{name}` must be a positive number, got {value!r}.")
    return Fraction(value).limit_denominator(1001)


def _check_frame_size(height: int, width: int, pix_fmt: str) -> None:
    """libx264 subsamples chroma 2x2 in yuv420p and 2x1 in yuv422p: those dimensions must be even."""
    needs_even_height = pix_fmt == "yuv420p"
    if width % 2 or (needs_even_height and height % 2):
        what = "even height and width" if needs_even_height else "an even width"
        raise ValueError(f"H.264 ({pix_fmt}) needs {what}, got height={height}, width={width}.")


def _encode_audio(container, stream, audio: torch.Tensor, sampling_rate: int) -> None:
    """Encode the whole stereo track and flush the encoder; the samples go in as planar float, AAC's own format, so
    nothing is rounded to 16 bits on the way."""
    import av

    samples = np.ascontiguousarray(audio.clamp(-1.0, 1.0).numpy(), dtype=np.float32)
    frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout="stereo")
    frame.sample_rate = sampling_rate
    frame.pts = 0
    for packet in stream.encode(frame):
        container.mux(packet)
    for packet in stream.encode(None):
        container.mux(packet)


class VideoWriter:
    """Write an MP4 clip whose frames arrive in chunks: each chunk is encoded in a background thread while the caller
    produces the next one; the audio track is encoded in the same thread once it is written.

    ```py
    with VideoWriter("clip.mp4", fps=24, sampling_rate=32000) as writer:
        for chunk in frame_chunks:  # each (F, H, W, 3), as `export_to_video` takes frames
            writer.write_frames(chunk)
        writer.write_audio(audio)  # stereo (2, samples)
    ```

    The file at `path` appears when the `with` block ends without an error (or at `close()`), complete; an error or
    Ctrl-C inside the block stops the encoder, removes the partial file and leaves an existing file at `path` as it
    was. `sampling_rate=None` writes a clip without audio.

    Args:
        path: the `.mp4` file to write.
        fps: frames per second of the clip.
        sampling_rate: the audio's sampling rate in Hz, or `None` for no audio stream.
        crf: libx264's constant rate factor, from 0 (lossless) to 51; lower is better quality and larger files.
        preset: libx264's speed preset (`ultrafast` ... `veryslow`); slower presets make smaller files at the same crf.
        pix_fmt: `yuv420p` (plays everywhere), `yuv422p` or `yuv444p` (full colour resolution, fewer players).
    """

    def __init__(
        self,
        path: Union[str, os.PathLike],
        fps: Union[int, float, Fraction] = 24,
        sampling_rate: Optional[int] = None,
        *,
        crf: int = DEFAULT_CRF,
        preset: str = DEFAULT_PRESET,
        pix_fmt: str = DEFAULT_PIX_FMT,
    ):
        self.path = check_output_path(path)
        self.fps = _check_rate(fps, "fps")
        if sampling_rate is not None and (isinstance(sampling_rate, bool) or not isinstance(sampling_rate, int)
                                          or sampling_rate <= 0):  # fmt: skip
            raise ValueError(f"`sampling_rate` must be a positive integer (Hz) or None, got {sampling_rate!r}.")
        check_encoding_options(crf, preset, pix_fmt)
        self.sampling_rate, self.crf, self.preset, self.pix_fmt = sampling_rate, crf, preset, pix_fmt
        self.num_frames = 0
        directory, name = os.path.split(os.path.abspath(self.path))
        # Same directory (so the rename is atomic), hidden, unique per writer; created with the first frames.
        self._temporary = os.path.join(directory, f".{name}.{uuid.uuid4().hex[:12]}.partial.mp4")
        self._container = self._video_stream = self._audio_stream = self._audio = self._size = None
        self._chunks: queue.Queue = queue.Queue(maxsize=MAX_QUEUED_CHUNKS)
        self._stop = threading.Event()
        self._encoder: Optional[threading.Thread] = None
        self._encoder_error: Optional[BaseException] = None
        self._state = "open"

    # -- the caller's side -------------------------------------------------------------------------------------------
    def write_frames(self, frames: Union[np.ndarray, torch.Tensor, List[PIL.Image.Image]]) -> None:
        """Queue `frames` (`(F, H, W, 3)` in [0, 1] or uint8, `(F, 3, H, W)` torch in [0, 1], or PIL images) for
        encoding; returns once they are converted, while the encoder works on earlier chunks."""
        self._check_open()
        with self._aborting_on_error():
            video = _frames_to_uint8(frames)
            if self._size is None:
                self._open(*video.shape[1:3])
            elif video.shape[1:3] != self._size:
                raise ValueError(f"every chunk must have the first chunk's size {self._size}, got {video.shape[1:3]}.")
            self._queue(video)
            self.num_frames += len(video)

    def write_audio(self, audio: Union[np.ndarray, torch.Tensor]) -> None:
        """Set the stereo track (`(2, samples)` or `(1, 2, samples)` in [-1, 1]), once; the encoder thread encodes it
        as soon as the streams exist, so written before the video's last chunk it costs nothing at `close`."""
        self._check_open()
        if self.sampling_rate is None:
            raise ValueError("this VideoWriter has no audio stream: pass `sampling_rate` when creating it.")
        if self._audio is not None:
            raise ValueError("the audio track was already written: call `write_audio` once per clip.")
        with self._aborting_on_error():
            self._audio = _audio_to_tensor(audio)
            if self._size is not None:  # the streams exist: queue it behind the chunks already written
                self._queue(_AudioTrack(self._audio))

    def close(self) -> str:
        """Finish the video (the audio track was encoded when it was written) and move the file onto `path`; returns
        `path`."""
        self._check_open()
        with self._aborting_on_error():
            if self._size is None:
                raise ValueError("no frames were written: call `write_frames` before closing the clip.")
            if self.sampling_rate is not None and self._audio is None:
                raise ValueError(
                    "the clip declares an audio stream (`sampling_rate`) but `write_audio` was not called."
                )
            self._queue(_END_OF_VIDEO)  # not a plain put: a failed encoder no longer empties a full queue
            self._encoder.join()
            self._raise_encoder_error()
            self._container.close()
            os.replace(self._temporary, self.path)
            self._state = "closed"
        logger.debug(f"wrote {self.path}: {self.num_frames} frames, crf {self.crf}, preset {self.preset}")
        return self.path

    def abort(self) -> None:
        """Stop encoding and remove the partial file; the file at `path` is left as it was."""
        if self._state != "open":
            return
        self._state = "aborted"
        self._stop.set()
        try:
            if self._encoder is not None:
                self._encoder.join()
            if self._container is not None:
                try:
                    self._container.close()
                except Exception:  # the partial file is removed next: a failed trailer does not matter
                    pass
        finally:
            if os.path.exists(self._temporary):
                os.remove(self._temporary)

    def __enter__(self) -> "VideoWriter":
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is not None:
            self.abort()
        elif self._state == "open":
            self.close()

    # -- internals ---------------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._state != "open":
            raise RuntimeError(f"this VideoWriter is {self._state}: create a new one to write another clip.")

    def _open(self, height: int, width: int) -> None:
        import av

        _check_frame_size(height, width, self.pix_fmt)
        self._size = (height, width)
        self._container = av.open(self._temporary, mode="w")
        options = {"crf": str(self.crf), "preset": self.preset}
        self._video_stream = self._container.add_stream("libx264", rate=self.fps, options=options)
        self._video_stream.width, self._video_stream.height, self._video_stream.pix_fmt = width, height, self.pix_fmt
        if self.sampling_rate is not None:
            self._audio_stream = self._container.add_stream("aac", rate=self.sampling_rate)
            self._audio_stream.codec_context.layout = "stereo"
            self._audio_stream.codec_context.time_base = Fraction(1, self.sampling_rate)
        self._encoder = threading.Thread(target=self._encode_chunks, name="h3-video-encoder", daemon=True)
        self._encoder.start()
        if self._audio is not None:  # written before the first frames: encoded first
            self._queue(_AudioTrack(self._audio))

    def _encode_chunks(self) -> None:
        """The encoder thread: encode queued chunks until the end marker, then flush the encoder."""
        import av

        try:
            while not self._stop.is_set():
                try:
                    chunk = self._chunks.get(timeout=0.1)
                except queue.Empty:
                    continue
                if chunk is _END_OF_VIDEO:
                    for packet in self._video_stream.encode(None):
                        self._container.mux(packet)
                    return
                if isinstance(chunk, _AudioTrack):
                    _encode_audio(self._container, self._audio_stream, chunk.samples, self.sampling_rate)
                    continue
                for array in chunk:
                    if self._stop.is_set():
                        return
                    for packet in self._video_stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")):
                        self._container.mux(packet)
        except BaseException as error:  # handed to the caller's thread, which raises it
            self._encoder_error = error

    def _queue(self, item) -> None:
        """Hand ``item`` to the encoder thread; the queue is bounded: wait for room, but not on an encoder that has
        failed."""
        while True:
            self._raise_encoder_error()
            try:
                self._chunks.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _raise_encoder_error(self) -> None:
        if self._encoder_error is not None:
            raise self._encoder_error

    def _aborting_on_error(self):
        return _AbortOnError(self)


class _AbortOnError:
    """Abort the writer on any error (KeyboardInterrupt too); an OS error (a full disk, a vanished folder) is raised
    naming the target file, not the temporary one, and its cause."""

    def __init__(self, writer: VideoWriter):
        self.writer = writer

    def __enter__(self):
        return self

    def __exit__(self, exc_type, error, traceback) -> None:
        if exc_type is None:
            return
        self.writer.abort()
        if isinstance(error, OSError):
            raise OSError(
                error.errno, f"cannot write the clip ({error.strerror or error})", self.writer.path
            ) from None


def export_settings(pipe=None, *, crf: Optional[int] = None, preset: Optional[str] = None,
                    pix_fmt: Optional[str] = None) -> Dict[str, Any]:  # fmt: skip
    """libx264's `crf`, `preset` and `pix_fmt` for a clip of `pipe`: the ones given, the others from the speed preset
    applied to `pipe` (`describe(pipe)["speed_preset"]["export"]`), else the measured defaults; checked."""
    record = getattr(pipe, "_h3_speed_preset", None)
    chosen = dict(getattr(record, "export", None) or {})
    settings = {"crf": DEFAULT_CRF, "preset": DEFAULT_PRESET, "pix_fmt": DEFAULT_PIX_FMT}
    settings.update({key: chosen[key] for key in settings if key in chosen})
    settings.update({key: value for key, value in (("crf", crf), ("preset", preset), ("pix_fmt", pix_fmt))
                     if value is not None})  # fmt: skip
    check_encoding_options(**settings)
    return settings


def export_to_video(
    frames: Union[np.ndarray, torch.Tensor, List[PIL.Image.Image]],
    path: Union[str, os.PathLike],
    fps: Union[int, float, Fraction] = 24,
    audio: Optional[Union[np.ndarray, torch.Tensor]] = None,
    sampling_rate: int = 32000,
    *,
    crf: int = DEFAULT_CRF,
    preset: str = DEFAULT_PRESET,
    pix_fmt: str = DEFAULT_PIX_FMT,
) -> str:
    """Write `frames` (and, if given, the stereo `audio` at `sampling_rate`) to an MP4 file; returns the path.

    H.264 through libx264 with `crf`, `preset` and `pix_fmt` (see `VideoWriter`), AAC stereo audio. Atomic: the file
    at `path` is either the complete new clip or left as it was (an existing file keeps its bytes).
    """
    with VideoWriter(path, fps, sampling_rate if audio is not None else None, crf=crf, preset=preset,
                     pix_fmt=pix_fmt) as writer:  # fmt: skip
        writer.write_frames(frames)
        if audio is not None:
            writer.write_audio(audio)
    return writer.path
