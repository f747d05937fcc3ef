"""`resolve_schedule`: the schedule a call runs with under a distillation preset, as a pure function."""

import copy

import pytest

from diffusers_h3.loaders.lora_presets import LoraDistillationPreset, resolve_schedule


TURBO = LoraDistillationPreset("turbo", num_inference_steps=5, flow_shift=6.0, audio_flow_shift=3.0)


def test_no_preset_changes_nothing():
    assert resolve_schedule(None, 50, None, 12.0, None, 3.0) == (50, 12.0, 3.0, [])
    assert resolve_schedule(None, None, None, None) == (None, None, None, [])


def test_unset_values_are_filled_from_the_preset():
    assert resolve_schedule(TURBO, None, None, None) == (5, 6.0, 3.0, [])


def test_matching_explicit_values_are_not_differences():
    assert resolve_schedule(TURBO, 5, None, 6.0, None, 3.0) == (5, 6.0, 3.0, [])
    # An int shift equal to the preset's float shift is the same setting.
    assert resolve_schedule(TURBO, 5, None, 6, None, 3) == (5, 6, 3, [])


def test_explicit_values_are_kept_and_listed():
    steps, shift, audio_shift, differences = resolve_schedule(TURBO, 50, None, 12.0, None, 4.0)
    assert (steps, shift, audio_shift) == (50, 12.0, 4.0)
    assert differences == [
        "num_inference_steps=50 (trained: 5)",
        "flow_shift=12 (trained: 6)",
        "audio_flow_shift=4 (trained: 3)",
    ]


def test_explicit_sigmas_replace_steps_and_shift():
    sigmas = [1.0, 0.7, 0.4, 0.1, 0.0]
    # Explicit sigmas of the trained length: steps stay unset (the sigmas are the schedule), the video shift is
    # neither filled-in-conflict nor compared, the audio shift is still filled.
    assert resolve_schedule(TURBO, None, sigmas, 9.0) == (None, 9.0, 3.0, [])
    _, _, _, differences = resolve_schedule(TURBO, None, sigmas[1:], None)
    assert differences == ["4 video sigmas (trained: 5 sigma points)"]
    _, _, audio_shift, differences = resolve_schedule(TURBO, None, sigmas, None, sigmas[:3], 7.0)
    assert audio_shift == 7.0 and differences == ["3 audio sigmas (trained: 5 sigma points)"]


def test_unconstrained_fields_stay_free():
    steps_only = LoraDistillationPreset("steps-only", num_inference_steps=9)
    assert resolve_schedule(steps_only, None, None, 12.0, None, 2.0) == (9, 12.0, 2.0, [])
    shift_only = LoraDistillationPreset("shift-only", flow_shift=5.0)
    assert resolve_schedule(shift_only, 50, None, None) == (50, 5.0, None, [])


@pytest.mark.parametrize("args", [(TURBO, None, [1.0, 0.0], None, [1.0, 0.0], None), (TURBO, 50, None, 1.0)])
def test_pure_function_of_its_arguments(args):
    before = copy.deepcopy(args)
    first = resolve_schedule(*args)
    assert resolve_schedule(*args) == first
    assert args == before
