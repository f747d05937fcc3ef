"""The training data folder: clips (video with its audio track) or images, with captions, in the `videofolder` /
`imagefolder` convention of 🤗 Datasets.

```
my_clips/
  metadata.jsonl      {"file_name": "cat.mp4", "text": "a cat jumps onto the sofa, a soft thud"}
  cat.mp4             one line per file; the caption under "text" (or "caption", "prompt")
  dog.png
```

Everything that would make training fail later is checked up front by :func:`check_data_folder`: the whole folder is
probed (each clip opened and decoded, frames counted at 24 fps, its audio track found) and every problem found is
reported in one line, before any model loads.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import torch


METADATA_FILE = "metadata.jsonl"
CAPTION_COLUMNS = ("text", "caption", "prompt")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
VIDEO_EXTENSIONS = (".mp4", ".mov", ".mkv", ".webm", ".avi")
# H3's video rate: clips at other rates are resampled to it by timestamp.
FPS = 24
# A soundtrack may end this much before the video (encoder padding, muxing) and is padded with silence; a shorter one
# is reported as a problem.
AUDIO_SHORTFALL_S = 0.1
# How many problems the one-line report names before it counts the rest.
SHOWN_PROBLEMS = 6


class DataFolderError(ValueError):
    """A training data folder that cannot be trained on; the message is one line naming every problem and the fix."""


@dataclasses.dataclass(frozen=True)
class DataItem:
    """One training sample: a clip or an image and its caption."""

    path: Path
    caption: str
    kind: str  # "video" or "image"

    @property
    def name(self) -> str:
        return self.path.name


@dataclasses.dataclass
class DecodedSample:
    """A sample on the training canvas: `frames` uint8 `(num_frames, height, width, 3)` at 24 fps (one frame for an
    image), `audio` float32 stereo `(2, samples)` at the audio VAE's rate (`None` for an image)."""

    frames: np.ndarray
    audio: Optional[torch.Tensor]


def read_metadata(data_dir: Union[str, os.PathLike]) -> Tuple[List[DataItem], List[str]]:
    """The items `metadata.jsonl` lists and the problems found reading it (a missing file, a line without caption)."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataFolderError(f"data folder {data_dir}: not a folder — pass the folder holding {METADATA_FILE}.")
    metadata = data_dir / METADATA_FILE
    if not metadata.is_file():
        raise DataFolderError(
            f"data folder {data_dir}: no {METADATA_FILE} — write one line per clip or image, "
            '{"file_name": "clip.mp4", "text": "its caption"} (the videofolder / imagefolder convention).'
        )
    items, problems, seen = [], [], set()
    for number, line in enumerate(metadata.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as error:
            problems.append(f"{METADATA_FILE} line {number}: not JSON ({error.msg})")
            continue
        name = entry.get("file_name") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not name:
            problems.append(f"{METADATA_FILE} line {number}: no file_name")
            continue
        caption = next((entry[c] for c in CAPTION_COLUMNS if isinstance(entry.get(c), str)), None)
        path = data_dir / name
        suffix = path.suffix.lower()
        if caption is None or not caption.strip():
            problems.append(f"{name}: no caption ({' / '.join(CAPTION_COLUMNS)})")
        elif name in seen:
            problems.append(f"{name}: listed twice")
        elif not path.is_file():
            problems.append(f"{name}: file not found")
        elif suffix not in IMAGE_EXTENSIONS + VIDEO_EXTENSIONS:
            problems.append(f"{name}: not a clip ({', '.join(VIDEO_EXTENSIONS)}) or image ({', '.join(IMAGE_EXTENSIONS)})")
        else:
            items.append(DataItem(path, caption.strip(), "image" if suffix in IMAGE_EXTENSIONS else "video"))
        seen.add(name)
    listed = {item.name for item in items} | seen
    for path in sorted(data_dir.iterdir()):
        if path.suffix.lower() in VIDEO_EXTENSIONS + IMAGE_EXTENSIONS and path.name not in listed:
            problems.append(f"{path.name}: no caption (not in {METADATA_FILE})")
    return items, problems


def audio_samples(num_frames: int, sampling_rate: int) -> int:
    """Samples of soundtrack a `num_frames` clip at 24 fps covers."""
    return int(round(num_frames / FPS * sampling_rate))


def _fit_to_canvas(image, height: int, width: int) -> np.ndarray:
    """Cover-resize (LANCZOS) and center-crop a PIL image to `height` x `width`, as uint8 RGB."""
    from PIL import Image

    image = image.convert("RGB")
    scale = max(width / image.width, height / image.height)
    size = (max(width, round(image.width * scale)), max(height, round(image.height * scale)))
    left, top = (size[0] - width) // 2, (size[1] - height) // 2
    image = image.resize(size, Image.Resampling.LANCZOS).crop((left, top, left + width, top + height))
    return np.array(image, dtype=np.uint8)  # a writable copy (torch.from_numpy warns on a read-only one)


def _decode_video(path: Path, num_frames: Optional[int], size: Optional[Tuple[int, int]]):
    """`(frames or None, frames available at 24 fps, has audio)`: decodes (and fits to `size`) only when asked."""
    import av

    with av.open(str(path)) as container:
        if not container.streams.video:
            raise ValueError("no video stream")
        has_audio = bool(container.streams.audio)
        stream = container.streams.video[0]
        times, pictures = [], []
        for frame in container.decode(video=0):
            times.append(float(frame.time) if frame.time is not None else len(times) / FPS)
            if size is not None:
                pictures.append(frame.to_image())
        if not times:
            raise ValueError("the video stream has no frames")
    rate = float(stream.average_rate or stream.guessed_rate or FPS)
    start = times[0]
    # The 24 fps grid over the clip: target frame i shows the last source frame at or before i / 24 s.
    duration = times[-1] - start + 1.0 / rate
    available = int(math.floor(duration * FPS + 1e-6))
    if size is None or num_frames is None:
        return None, available, has_audio
    offsets = np.asarray(times) - start
    picks = [int(np.searchsorted(offsets, i / FPS + 1e-6, side="right") - 1) for i in range(num_frames)]
    frames = np.stack([_fit_to_canvas(pictures[max(p, 0)], *size) for p in picks])
    return frames, available, has_audio


def _decode_audio(path: Path, sampling_rate: int, num_samples: int) -> torch.Tensor:
    """The first audio stream as float32 stereo `(2, num_samples)` at `sampling_rate` (PyAV's resampler)."""
    import av

    chunks = []
    with av.open(str(path)) as container:
        resampler = av.AudioResampler(format="fltp", layout="stereo", rate=sampling_rate)
        for frame in container.decode(audio=0):
            for out in resampler.resample(frame):
                chunks.append(out.to_ndarray())
        for out in resampler.resample(None):
            chunks.append(out.to_ndarray())
    audio = np.concatenate(chunks, axis=1) if chunks else np.zeros((2, 0), np.float32)
    shortfall = num_samples - audio.shape[1]
    if shortfall > AUDIO_SHORTFALL_S * sampling_rate:
        raise ValueError(f"the soundtrack is {audio.shape[1] / sampling_rate:.2f} s, the clip needs "
                         f"{num_samples / sampling_rate:.2f} s")  # fmt: skip
    if shortfall > 0:
        audio = np.pad(audio, ((0, 0), (0, shortfall)))
    return torch.from_numpy(np.ascontiguousarray(audio[:, :num_samples], dtype=np.float32))


def _probe(item: DataItem, num_frames: int) -> Optional[str]:
    """What is wrong with one item for a `num_frames` clip, or `None`."""
    if item.kind == "image":
        from PIL import Image

        try:
            with Image.open(item.path) as image:
                image.verify()
        except Exception as error:  # PIL raises many types for a broken file
            return f"{item.name}: cannot decode the image ({type(error).__name__}: {error})"
        return None
    try:
        _, available, has_audio = _decode_video(item.path, None, None)
    except Exception as error:  # PyAV's FFmpegError family and our own ValueError
        return f"{item.name}: cannot decode ({str(error).splitlines()[0] if str(error) else type(error).__name__})"
    if available < num_frames:
        return f"{item.name}: {available} frames at 24 fps, the clips must have at least {num_frames}"
    if not has_audio:
        return f"{item.name}: no audio track"
    return None


def check_data_folder(data_dir: Union[str, os.PathLike], num_frames: int) -> List[DataItem]:
    """Read `metadata.jsonl` and probe every file; returns the items, or raises :class:`DataFolderError` whose one-line
    message names every problem (missing captions or files, clips that fail to decode, too few frames, no audio track)
    and the fix."""
    items, problems = read_metadata(data_dir)
    problems += [problem for problem in (_probe(item, num_frames) for item in items) if problem]
    if not items and not problems:
        problems.append(f"{METADATA_FILE} lists no files")
    if problems:
        shown = "; ".join(problems[:SHOWN_PROBLEMS])
        more = f"; and {len(problems) - SHOWN_PROBLEMS} more" if len(problems) > SHOWN_PROBLEMS else ""
        raise DataFolderError(
            f"data folder {data_dir}: {len(problems)} problem{'s' * (len(problems) > 1)}: {shown}{more} — fix or "
            f"remove those files (clips need >= {num_frames} frames at 24 fps and an audio track; every file a "
            f"caption in {METADATA_FILE})."
        )
    return items


def decode_sample(item: DataItem, num_frames: int, height: int, width: int, sampling_rate: int) -> DecodedSample:
    """An item on the training canvas: a clip's first `num_frames` frames at 24 fps and their soundtrack, or an image."""
    if item.kind == "image":
        from PIL import Image

        with Image.open(item.path) as image:
            return DecodedSample(_fit_to_canvas(image, height, width)[None], None)
    frames, _, _ = _decode_video(item.path, num_frames, (height, width))
    return DecodedSample(frames, _decode_audio(item.path, sampling_rate, audio_samples(num_frames, sampling_rate)))


def write_clip(path: Union[str, os.PathLike], frames: np.ndarray, audio: Optional[torch.Tensor], sampling_rate: int,
               fps: float = FPS) -> None:  # fmt: skip
    """Write uint8 `frames` `(F, H, W, 3)` and stereo `audio` as an MP4 (H.264 + AAC): what the tests and the docs'
    example build their data folders with."""
    from ..pipelines.export import export_to_video

    export_to_video(frames, path, fps=fps, audio=audio, sampling_rate=sampling_rate)


def write_metadata(data_dir: Union[str, os.PathLike], entries: Sequence[Tuple[str, str]]) -> Path:
    """Write `metadata.jsonl` for `(file_name, caption)` pairs."""
    path = Path(data_dir) / METADATA_FILE
    path.write_text("".join(json.dumps({"file_name": name, "text": text}) + "\n" for name, text in entries))
    return path
