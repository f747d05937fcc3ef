"""Write a generated clip as MP4: H.264 video + AAC stereo audio, through PyAV (diffusers' `encode_video`).

The clip is encoded into a hidden temporary file beside the target and renamed onto it only when encoding finished,
so an interrupted or failed export (Ctrl-C included) never leaves a truncated MP4 and never clobbers an existing one;
an OS error (a full disk) is raised naming the target file and the cause.
"""

from __future__ import annotations

import os
import uuid
from typing import List, Optional, Union

import numpy as np
import PIL.Image
import torch


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
        low, high = values.aminmax()
        if low < 0 or high > 1:
            raise ValueError("float frames must lie in [0, 1] (the pipeline's `np`/`pt` output).")
        array = values.mul(255.0).round_().to(torch.uint8).numpy()
    if array.shape[1] % 2 or array.shape[2] % 2:
        raise ValueError(f"H.264 (yuv420p) needs even height and width, got height={array.shape[1]}, width={array.shape[2]}.")
    return array


def _audio_to_tensor(audio) -> torch.Tensor:
    tensor = torch.as_tensor(np.asarray(audio) if not isinstance(audio, torch.Tensor) else audio).detach().float().cpu()
    if tensor.ndim == 3:
        if tensor.shape[0] != 1:
            raise ValueError("export_to_video writes one clip; pass audio[i] for a batch.")
        tensor = tensor[0]
    if tensor.ndim != 2 or tensor.shape[0] != 2:
        raise ValueError(f"audio must be stereo (2, samples) or (1, 2, samples), got {tuple(tensor.shape)}.")
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


def export_to_video(
    frames: Union[np.ndarray, torch.Tensor, List[PIL.Image.Image]],
    path: Union[str, os.PathLike],
    fps: int = 24,
    audio: Optional[Union[np.ndarray, torch.Tensor]] = None,
    sampling_rate: int = 32000,
) -> str:
    """Write `frames` (and, if given, the stereo `audio` at `sampling_rate`) to an MP4 file; returns the path.

    Atomic: the file at `path` is either the complete new clip or left as it was (an existing file keeps its bytes).
    """
    from diffusers.utils.export_utils import encode_video

    path = check_output_path(path)
    if fps <= 0:
        raise ValueError(f"`fps` must be positive, got {fps}.")
    video = torch.from_numpy(_frames_to_uint8(frames))
    audio_tensor = _audio_to_tensor(audio) if audio is not None else None
    directory, name = os.path.split(os.path.abspath(path))
    # Same directory (so the rename is atomic), hidden, unique per call; PyAV creates it with the usual permissions.
    temporary = os.path.join(directory, f".{name}.{uuid.uuid4().hex[:12]}.partial.mp4")
    try:
        encode_video(
            video, fps=fps, output_path=temporary, audio=audio_tensor,
            audio_sample_rate=sampling_rate if audio is not None else None,
        )  # fmt: skip
        os.replace(temporary, path)
    except BaseException as error:  # KeyboardInterrupt too: never leave the partial file behind
        if os.path.exists(temporary):
            os.remove(temporary)
        if isinstance(error, OSError):  # a full disk, a vanished folder: the target (not the temporary) and the cause
            raise OSError(error.errno, f"cannot write the clip ({error.strerror or error})", path) from None
        raise
    return path
