"""MP4 export keeps the stereo channel layout: the written file, decoded back with PyAV, carries the left signal on
the left channel and the right signal on the right one (different sine frequencies per channel)."""

import numpy as np
import pytest
import torch

from diffusers_h3 import export_to_video


av = pytest.importorskip("av")

RATE = 32000
SECONDS = 1.0
LEFT_HZ, RIGHT_HZ = 440.0, 1250.0


def _sources():
    t = np.arange(int(RATE * SECONDS)) / RATE
    left = 0.5 * np.sin(2 * np.pi * LEFT_HZ * t)
    right = 0.3 * np.sin(2 * np.pi * RIGHT_HZ * t + 0.7)
    return np.stack([left, right]).astype(np.float32)


def _decode_audio(path):
    with av.open(str(path)) as container:
        stream = container.streams.audio[0]
        assert stream.codec_context.name == "aac" and stream.codec_context.channels == 2
        rate = stream.codec_context.sample_rate
        chunks = []
        for frame in container.decode(stream):
            array = frame.to_ndarray()
            if frame.format.is_planar:
                chunks.append(array.reshape(2, -1))
            else:  # interleaved: L R L R ...
                chunks.append(array.reshape(-1, 2).T)
    return np.concatenate(chunks, axis=1).astype(np.float64), rate


def _aligned(decoded, source):
    """Best integer lag (AAC priming delay) of ``decoded`` against ``source``, found on the sum of both channels so
    that the alignment cannot favour either pairing; returns the overlapping parts."""
    mono_d, mono_s = decoded.sum(0), source.sum(0)
    n = len(mono_s)
    best, best_lag = -np.inf, 0
    for lag in range(0, 4096):
        seg = mono_d[lag:lag + n]
        m = min(len(seg), n)
        c = float(np.dot(seg[:m], mono_s[:m]))
        if c > best:
            best, best_lag = c, lag
    m = min(decoded.shape[1] - best_lag, n)
    return decoded[:, best_lag:best_lag + m], source[:, :m]


def _rel_l2(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _corr(a, b):
    a, b = a - a.mean(), b - b.mean()
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


# Bounds: what a correct channel achieves after AAC (rel L2 ~1e-2), against what a swapped or duplicated channel
# gives (the two sines are orthogonal: correlation ~0, rel L2 >= 1). Both are asserted below on the sources too.
MAX_REL_L2 = 0.2
MIN_CORR = 0.95


def test_bounds_separate_right_from_swapped_or_duplicated():
    src = _sources()[:, 2000:]
    left, right = src
    # A swapped pairing (L written on R) and a duplicated one (L on both) cannot meet the bounds.
    assert _rel_l2(left, right) > 1.0 and abs(_corr(left, right)) < 0.05
    assert _rel_l2(right, left) > 1.0
    # A mono downmix on both channels (the other plausible wrong layout) cannot either.
    mix = 0.5 * (left + right)
    assert _rel_l2(mix, left) > MAX_REL_L2 and _rel_l2(mix, right) > MAX_REL_L2
    assert _corr(mix, right) < MIN_CORR and _corr(mix, left) < MIN_CORR


@pytest.mark.parametrize("as_batch", [False, True])
def test_each_channel_carries_its_source_after_aac(tmp_path, as_batch):
    frames = np.random.default_rng(0).random((24, 32, 32, 3), dtype=np.float32)
    source = _sources()
    audio = torch.from_numpy(source)[None] if as_batch else torch.from_numpy(source)
    path = export_to_video(frames, tmp_path / "clip.mp4", fps=24, audio=audio, sampling_rate=RATE)
    decoded, rate = _decode_audio(path)
    assert rate == RATE
    decoded, source = _aligned(decoded, source)
    assert decoded.shape[1] > 0.9 * RATE * SECONDS
    # Skip the codec's start-up transient.
    decoded, source = decoded[:, 2048:], source[:, 2048:]
    for channel, name in enumerate(("left", "right")):
        err = _rel_l2(decoded[channel], source[channel])
        corr = _corr(decoded[channel], source[channel])
        assert err < MAX_REL_L2 and corr > MIN_CORR, (name, err, corr)
        other = 1 - channel
        assert _rel_l2(decoded[channel], source[other]) > 1.0, name  # not the other source
