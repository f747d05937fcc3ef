"""The task table: partitions, LoRA families, routing, and one clear error for bad combinations."""

import dataclasses

import pytest
from PIL import Image

from diffusers_h3.loaders.lora_presets import KNOWN_PRESETS
from diffusers_h3.pipelines.loading import _check_partitions_present
from diffusers_h3.tasks import (
    PARTITIONS,
    TASKS,
    TaskSpec,
    get_task,
    partition_for_task,
    partition_for_tasks,
    partitions_for_task,
    select_task,
    tasks_of_family,
)


def test_table_partitions_and_families():
    assert list(TASKS) == ["t2va", "fl2va", "ref2va"]
    assert {name: spec.partition for name, spec in TASKS.items()} == {
        "t2va": "transformer",
        "fl2va": "transformer",
        "ref2va": "transformer_ref",
    }
    assert tasks_of_family("fl2v") == ("t2va", "fl2va")
    assert tasks_of_family("ref2v") == ("ref2va",)
    assert partitions_for_task(None) == PARTITIONS
    assert partitions_for_task("fl2va") == ("transformer",)
    assert partition_for_tasks(("t2va", "fl2va")) == "transformer"
    with pytest.raises(ValueError, match="different partitions"):
        partition_for_tasks(("t2va", "ref2va"))
    with pytest.raises(ValueError, match="Unknown LoRA family"):
        tasks_of_family("i2v")


def test_every_task_conditioning_input_belongs_to_one_task():
    owners = [name for spec in TASKS.values() for name in spec.conditioning_inputs]
    assert len(owners) == len(set(owners))
    assert sorted(owners) == ["image", "last_image", "references"]


def test_presets_read_the_table():
    # The LightX2V presets' tasks come from the spec's LoRA family, not from a copy of the rule.
    for preset in KNOWN_PRESETS.values():
        family = "ref2v" if "-ref2v-" in preset.name else "fl2v"
        assert preset.tasks == tasks_of_family(family)
        assert partition_for_tasks(preset.tasks) == TASKS[preset.tasks[0]].partition


def test_specs_are_frozen_and_checked():
    spec = TASKS["t2va"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.partition = "transformer_ref"
    with pytest.raises(ValueError, match="`partition` must be one of"):
        dataclasses.replace(spec, name="x2va", partition="transformer_x")
    assert isinstance(dataclasses.replace(spec, name="x2va"), TaskSpec)


def test_select_task_routes_by_inputs():
    image = Image.new("RGB", (32, 32))
    assert select_task() == "t2va"
    assert select_task(image=image) == "fl2va"
    assert select_task(last_image=image) == "fl2va"
    assert select_task(image=image, last_image=image) == "fl2va"
    assert select_task(references=[object()]) == "ref2va"


@pytest.mark.parametrize(
    "inputs",
    [
        {"image": 1, "references": [1]},
        {"last_image": 1, "references": [1]},
        {"image": 1, "last_image": 1, "references": []},
    ],
)
def test_bad_combinations_give_one_clear_error(inputs):
    with pytest.raises(ValueError) as error:
        select_task(**inputs)
    message = str(error.value)
    assert "cannot be combined" in message and "fl2va" in message and "ref2va" in message
    assert "\n" not in message


def test_unknown_task_names():
    with pytest.raises(ValueError, match=r"`task` must be one of \('t2va', 'fl2va', 'ref2va'\), got 'i2v'"):
        get_task("i2v")
    with pytest.raises(ValueError, match="`task` must be one of"):
        partition_for_task("i2v")


def test_conditioning_checks_run_before_models():
    TASKS["t2va"].check_conditions({})
    TASKS["fl2va"].check_conditions({"image": Image.new("RGB", (8, 8)), "last_image": None})
    with pytest.raises(ValueError, match="must be PIL images"):
        TASKS["fl2va"].check_conditions({"image": "first.png"})
    with pytest.raises(ValueError, match="non-empty list"):
        TASKS["ref2va"].check_conditions({"references": []})
    with pytest.raises(ValueError, match=r"references\[0\]"):
        TASKS["ref2va"].check_conditions({"references": ["subject.png"]})


def test_loader_reads_the_table_for_the_partition_it_needs(tmp_path):
    (tmp_path / "transformer").mkdir()
    index = {"transformer": ["diffusers", "MiniMaxH3Transformer3DModel"]}
    _check_partitions_present(tmp_path, index, "fl2va", {})
    with pytest.raises(ValueError, match="needs the `transformer_ref` partition"):
        _check_partitions_present(tmp_path, index, "ref2va", {})
