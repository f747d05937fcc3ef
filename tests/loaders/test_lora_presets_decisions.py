"""Decision of the distillation-preset detection that must not flip: a LightX2V Turbo preset is read from the file's
base name only; folder names (a hub snapshot path, a folder named after another adapter, a `768p/` folder) never
select or change it."""

import pytest

from diffusers_h3.loaders.lora_presets import preset_from_file_name


@pytest.mark.parametrize("separator", ["/", "\\"])
def test_preset_comes_from_the_base_name_only(separator):
    def path(*parts):
        return separator.join(parts)

    # A folder named like a Turbo file does not make an ordinary LoRA a distillation adapter.
    assert preset_from_file_name(path("loras", "minimax_h3_fl2v_turbo_4step_768p", "style.safetensors")) is None
    # The file's own name wins over a folder naming another adapter; a "768p" folder does not make it the 768p one.
    preset = preset_from_file_name(
        path("minimax_h3_ref2v_turbo_8step_768p", "768p", "minimax_h3_fl2v_turbo_4step_v1.2.safetensors")
    )
    assert preset.name == "lightx2v-fl2v-turbo-4step"
    assert preset.source == "file name 'minimax_h3_fl2v_turbo_4step_v1.2.safetensors'"


def test_the_base_name_alone_selects_the_768p_preset():
    preset = preset_from_file_name("minimax_h3_fl2v_turbo_4step_v1.2_768p.safetensors")
    assert preset.name == "lightx2v-fl2v-turbo-4step-768p" and preset.flow_shift == 6.0
