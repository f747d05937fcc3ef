# Copyright 2026 The diffusers-h3 authors. Licensed under the Apache License, Version 2.0.
"""A clip as the metrics read it: 8-bit YUV 4:2:0 planes, RGB frames (for the pictures and LPIPS), the stereo track;
read from an MP4 file with PyAV, or taken from pipeline output."""

from __future__ import annotations

import os
from dataclasses import dataclass
from fractions import Fraction
from typing import List, Optional, Union

import numpy as np
import torch

from .metrics import rgb_to_yuv420


@dataclass
class Clip:
    """``planes``: ``[Y (F, H, W), U (F, H/2, W/2), V]`` uint8; ``rgb``: ``(F, H, W, 3)`` uint8; ``audio``:
    ``(channels, samples)`` float32 in [-1, 1] or ``None``; ``source``: the file or ``"pipeline output"``."""

    planes: List[torch.Tensor]
    rgb: torch.Tensor
    fps: float
    audio: Optional[torch.Tensor]
    sample_rate: Optional[int]
    source: str

    @property
    def num_frames(self) -> int:
        return int(self.rgb.shape[0])

    @property
    def size(self):
        """``(height, width)``."""
        return int(self.rgb.shape[1]), int(self.rgb.shape[2])


def read_clip(path: Union[str, os.PathLike]) -> Clip:
    """Decode an MP4 (any file PyAV reads): every video frame as stored, converted to yuv420p only when stored in
    another pixel format (yuv444p), and the first audio stream as float samples."""
    import av

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file.")
    try:
        container = av.open(path)
    except av.error.FFmpegError as error:
        raise ValueError(f"{path}: not a readable video file ({error}).") from None
    with container:
        if not container.streams.video:
            raise ValueError(f"{path}: has no video stream.")
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate or Fraction(24)
        planes: List[List[np.ndarray]] = [[], [], []]
        rgb = []
        for frame in container.decode(video=0):
            height, width = frame.height, frame.width
            if height % 2 or width % 2:
                raise ValueError(f"{path}: {width}x{height} frames: YUV 4:2:0 needs an even height and width.")
            yuv = frame.to_ndarray(format="yuv420p")  # (H * 3/2, W): Y, then U and V, each (H/2, W/2) row-major
            planes[0].append(yuv[:height])
            chroma = yuv[height:].reshape(2, height // 2, width // 2)
            planes[1].append(chroma[0])
            planes[2].append(chroma[1])
            rgb.append(frame.to_ndarray(format="rgb24"))
        if not rgb:
            raise ValueError(f"{path}: the video stream has no frames.")
    audio, sample_rate = _read_audio(path)
    return Clip(planes=[torch.from_numpy(np.stack(p)) for p in planes], rgb=torch.from_numpy(np.stack(rgb)),
                fps=float(rate), audio=audio, sample_rate=sample_rate, source=path)  # fmt: skip


def _read_audio(path: str):
    import av

    with av.open(path) as container:
        if not container.streams.audio:
            return None, None
        sample_rate = container.streams.audio[0].codec_context.sample_rate
        chunks = []
        for frame in container.decode(audio=0):
            samples = frame.to_ndarray()  # planar formats: (channels, n); packed: (1, n * channels)
            if not frame.format.is_planar:
                samples = samples.reshape(-1, len(frame.layout.channels)).T
            if samples.dtype.kind in "iu":  # integer PCM -> [-1, 1]
                samples = samples.astype(np.float32) / float(np.iinfo(samples.dtype).max)
            chunks.append(samples.astype(np.float32))
    if not chunks:
        return None, sample_rate
    return torch.from_numpy(np.concatenate(chunks, axis=1)), int(sample_rate)


def clip_from_output(frames, audio=None, sampling_rate: Optional[int] = None, fps: float = 24.0) -> Clip:
    """A clip from pipeline output: ``frames`` as `export_to_video` takes them (``np``/``pt``/``pil``, one clip),
    ``audio`` ``(2, samples)`` (or with the batch axis)."""
    from ..pipelines.export import _audio_to_tensor, _frames_to_uint8

    rgb = torch.from_numpy(np.ascontiguousarray(_frames_to_uint8(frames)))
    track = _audio_to_tensor(audio) if audio is not None else None
    if track is not None and sampling_rate is None:
        raise ValueError("`sampling_rate` is needed with `audio` (the pipeline output's `sampling_rate`).")
    return Clip(planes=rgb_to_yuv420(rgb), rgb=rgb, fps=float(fps), audio=track, sample_rate=sampling_rate,
                source="pipeline output")  # fmt: skip
