"""The light VAE's depth cut: which teacher decoder blocks a shallower student keeps.

FastVideo keeps ``round(i * (n - 1) / (k - 1))`` for ``i`` in ``0..k-1`` (Python's ``round``: halves go to the even
neighbour), first and last included; an exported student's blocks are those, so another choice (flooring the
positions, rounding halves up) loads the export onto other blocks than the ones it was distilled from."""

from fractions import Fraction

import pytest
import torch
from diffusers import AutoencoderKLMiniMaxH3

from diffusers_h3.loaders.fasth3_vae import depth_cut_decoder, evenly_spaced_blocks
from diffusers_h3.testing.tiny import TINY_VAE_CONFIG, tiny_vae


def _fastvideo_kept(total, count):
    """The rule computed exactly: each position as a fraction, rounded half to even (``Fraction.__round__``)."""
    if count == 1:
        return [0]
    return sorted({round(Fraction(i * (total - 1), count - 1)) for i in range(count)})


# Flooring keeps other blocks at (26, 8), (12, 5) and (50, 7); rounding halves up at (6, 3) and (50, 7) (2.5, 24.5);
# the others agree under any of these rules and check the ends and the bounds.
DEPTHS = [(26, 8), (36, 8), (6, 3), (12, 5), (10, 4), (9, 5), (50, 7), (8, 8), (5, 1)]


@pytest.mark.parametrize("total, count", DEPTHS)
def test_depth_cut_keeps_fastvideos_evenly_spaced_blocks(total, count):
    kept = evenly_spaced_blocks(total, count)
    assert kept == _fastvideo_kept(total, count)
    assert len(kept) == count and kept[0] == 0 and (count == 1 or kept[-1] == total - 1)


def test_the_light_vaes_eight_block_student_keeps_the_published_blocks():
    """The 26-block light VAE's 8-block student: positions 0, 3.57, 7.14, 10.71, 14.29, 17.86, 21.43, 25 rounded
    (flooring would keep 3, 10, 17 instead of 4, 11, 18)."""
    assert evenly_spaced_blocks(26, 8) == [0, 4, 7, 11, 14, 18, 21, 25]
    assert evenly_spaced_blocks(36, 8) == [0, 5, 10, 15, 20, 25, 30, 35]


def test_depth_cut_decoder_keeps_those_modules_in_order():
    torch.manual_seed(0)
    reference = tiny_vae().config
    vae = AutoencoderKLMiniMaxH3(**{**TINY_VAE_CONFIG, "decoder_num_layers": 12},
                                 latents_mean=reference.latents_mean, latents_std=reference.latents_std)  # fmt: skip
    before = list(vae.decoder.transformer_blocks)
    kept = depth_cut_decoder(vae, 5)
    assert kept == _fastvideo_kept(12, 5) == [0, 3, 6, 8, 11]
    assert [id(b) for b in vae.decoder.transformer_blocks] == [id(before[i]) for i in kept]
    assert vae.config.decoder_num_layers == 5


def test_depth_cut_refuses_a_count_outside_the_decoder():
    for count in (0, 7):
        with pytest.raises(ValueError, match=f"cannot keep {count} of 6 decoder blocks"):
            evenly_spaced_blocks(6, count)
