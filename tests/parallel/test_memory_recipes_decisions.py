"""Memory budget decisions on faked machines: which table entry `--memory auto` picks, the host headroom and GPU margin
it keeps, the few-step LoRA it names for slow requests, the GPU and host needs kept apart, and the CLI's refusals."""

import json
from types import SimpleNamespace

import pytest
import torch

from diffusers_h3 import cli
from diffusers_h3.loaders.lora_presets import KNOWN_PRESETS, preset_from_file_name
from diffusers_h3.parallel import memory_recipes as mb


GiB = mb.GiB


def _entry(case, gpu, host, seconds, recipe="low_ram", cap=None):
    return mb.MemoryRecipe(mb.RECIPES[recipe], gpu, host, seconds, case, True, "test", cap_gib=cap)


# Three measured entries of one recipe (different caps and settings) and one of another.
TABLE = (
    _entry("low_ram_16gb", 13.7, 30.0, 420.0, cap=15.5),
    _entry("pc_12gb_32gib", 11.2, 19.0, 520.0, cap=11.5),
    _entry("pc_8gb_16gib", 7.4, 11.5, 700.0, cap=7.5),
    _entry("offload_24gb", 16.4, 71.0, 470.0, recipe="offload", cap=22.5),
)


def fake_machine(monkeypatch, *, gpu_free_gib=None, mem_total_gib=32.0, mem_available_gib=30.0, cgroup_room_gib=None,
                 gpu_name="NVIDIA GeForce RTX 4060 Ti", capability=(8, 9), sms=34):  # fmt: skip
    """A host with ``mem_*`` GiB of memory and, when ``gpu_free_gib`` is given, one CUDA GPU with that much free."""
    meminfo = {"MemTotal": mem_total_gib * GiB, "MemAvailable": mem_available_gib * GiB}
    monkeypatch.setattr(mb, "_meminfo_bytes", lambda field: int(meminfo[field]))
    monkeypatch.setattr(mb, "_cgroup_limit_bytes", lambda: None if cgroup_room_gib is None else int(cgroup_room_gib * GiB))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu_free_gib is not None)
    if gpu_free_gib is not None:
        properties = SimpleNamespace(name=gpu_name, major=capability[0], minor=capability[1],
                                     multi_processor_count=sms, total_memory=int((gpu_free_gib + 0.4) * GiB))
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(gpu_free_gib * GiB), properties.total_memory))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: properties)


@pytest.mark.parametrize(
    "gpu, host, expected",
    [(16, 32, "low_ram_16gb"), (12, 32, "pc_12gb_32gib"), (16, 20, "pc_12gb_32gib"), (8, 16, "pc_8gb_16gib"),
     (24, 128, "low_ram_16gb"), (11.2, 19.0, "pc_12gb_32gib")],
)  # fmt: skip
def test_the_fastest_entry_that_fits_among_several_of_one_recipe(gpu, host, expected):
    chosen = mb.select_recipe(gpu, host, table=TABLE)
    assert chosen.case == expected and chosen.name == "low_ram"


def test_equally_fast_entries_choose_the_one_that_needs_least_memory():
    table = (_entry("big", 13.0, 20.0, 500.0), _entry("small", 9.0, 20.0, 500.0), _entry("smaller_host", 9.0, 12.0, 500.0))
    assert mb.select_recipe(16, 32, table=table).case == "smaller_host"
    assert mb.select_recipe(16, 32, table=table[:2]).case == "small"


@pytest.mark.parametrize(
    "total, available, cgroup, budget",
    [(16.0, 14.0, None, 12.0), (16.0, 9.0, None, 9.0), (64.0, 60.0, 20.0, 20.0), (32.0, 30.0, None, 28.0)],
)
def test_auto_keeps_the_host_headroom(total, available, cgroup, budget, monkeypatch):
    fake_machine(monkeypatch, gpu_free_gib=8.0, mem_total_gib=total, mem_available_gib=available,
                 cgroup_room_gib=cgroup)  # fmt: skip
    assert mb.HOST_HEADROOM_GIB == 4.0  # documented in docs/memory.md
    fits = (_entry("fits", 1.0, budget, 100.0),)
    assert mb.select_recipe(table=fits).case == "fits"
    with pytest.raises(mb.MemoryBudgetError, match=f"{budget:.2f} GiB of host memory"):
        mb.select_recipe(table=(_entry("too_big", 1.0, budget + 0.1, 100.0),))


def test_auto_keeps_the_gpu_margin(monkeypatch):
    fake_machine(monkeypatch, gpu_free_gib=8.0)
    budget = 8.0 - mb.GPU_MARGIN_GIB
    assert mb.select_recipe(table=(_entry("fits", budget, 1.0, 100.0),)).case == "fits"
    with pytest.raises(mb.MemoryBudgetError, match=f"{budget:.2f} GiB of GPU memory"):
        mb.select_recipe(table=(_entry("too_big", budget + 0.1, 1.0, 100.0),))


def test_auto_on_a_16_gib_pc_with_an_8_gb_card_picks_the_pc_entry_and_says_why(monkeypatch):
    fake_machine(monkeypatch, gpu_free_gib=7.95, mem_total_gib=15.6, mem_available_gib=13.0,
                 gpu_name="NVIDIA GeForce RTX 4060")  # fmt: skip
    chosen = mb.select_recipe(table=TABLE, predictions={})
    assert chosen.case == "pc_8gb_16gib"
    line = chosen.line()
    assert "\n" not in line and "'low_ram'" in line and "pc_8gb_16gib" in line
    # the numbers compared: the needs, the budget and where the budget came from
    for said in ("needs 7.40 GiB GPU / 11.50 GiB host", "7.45 GiB of GPU memory (7.95 GiB free on the NVIDIA GeForce "
                 "RTX 4060 less 0.5 GiB margin)", "11.60 GiB of host memory", "MemAvailable 13.00 GiB",
                 "MemTotal 15.60 GiB less 4 GiB headroom", "the only table entry that fits"):  # fmt: skip
        assert said in line, (said, line)


def _predictions(seconds, four_steps, name="NVIDIA GeForce RTX 4060 Ti", case="low_ram_16gb", sms=34):
    return {"gpus": {name: {"capability": [8, 9], "sms": sms,
                            "cases": {case: {"t2va_s": seconds, "t2va_4step_s": four_steps}}}}}  # fmt: skip


def test_a_request_predicted_over_ten_minutes_names_the_four_step_lora(monkeypatch):
    fake_machine(monkeypatch, gpu_free_gib=15.5, mem_available_gib=30.0, mem_total_gib=48.0)
    slow = mb.select_recipe(table=TABLE, predictions=_predictions(1500.0, 130.0)).line()
    assert mb.FEW_STEP_LORA_FILE in slow and mb.FEW_STEP_LORA_PRESET in slow
    assert "25 min per 50-step t2va (predicted for the NVIDIA GeForce RTX 4060 Ti, not measured)" in slow
    assert "about 2.2 min" in slow
    fast = mb.select_recipe(table=TABLE, predictions=_predictions(590.0, 60.0)).line()
    assert mb.FEW_STEP_LORA_FILE not in fast and "10 min per 50-step t2va (predicted" in fast


def test_a_gpu_the_model_does_not_list_is_scaled_by_sm_count_from_one_of_its_architecture(monkeypatch):
    fake_machine(monkeypatch, gpu_free_gib=15.5, mem_available_gib=30.0, mem_total_gib=48.0,
                 gpu_name="NVIDIA GeForce RTX 4060 Ti Laptop GPU", sms=17)  # fmt: skip
    line = mb.select_recipe(table=TABLE, predictions=_predictions(500.0, 60.0)).line()
    assert "17 min per 50-step t2va" in line and "scaled by SM count (34 vs 17)" in line  # 500 s x 2
    assert mb.FEW_STEP_LORA_FILE in line
    # another architecture: no prediction; the H200 measurement alone (420 s) is not over ten minutes
    fake_machine(monkeypatch, gpu_free_gib=15.5, mem_available_gib=30.0, mem_total_gib=48.0, capability=(8, 6),
                 gpu_name="NVIDIA GeForce RTX 3080 Ti Laptop GPU")  # fmt: skip
    other = mb.select_recipe(table=TABLE, predictions=_predictions(500.0, 60.0)).line()
    assert "predicted" not in other and mb.FEW_STEP_LORA_FILE not in other


def test_the_few_step_lora_named_is_a_known_four_step_preset_for_t2va():
    preset = preset_from_file_name(mb.FEW_STEP_LORA_FILE)
    assert preset is not None and preset.name == mb.FEW_STEP_LORA_PRESET and preset.name in KNOWN_PRESETS
    assert preset.num_inference_steps == 5 and "t2va" in preset.tasks  # 4 forwards


def test_gpu_and_host_needs_reach_their_own_fields(tmp_path):
    """A swap anywhere from the measurement to the choice would send a 16 GB card to a recipe that needs 30 GiB of
    GPU memory: the case needs 30 GiB of GPU and 12 GiB of host memory."""
    case = {"recipe_name": "low_ram", "ms": 1000.0, "stages": {"forwards": 100.0}, "forwards": 1, "sigma_points": 50,
            "peak_reserved_gib": 30.0, "peak_allocated_gib": 20.0, "host_peak_rss_gib": 12.0,
            "host_includes_load": True, "cap_gib": 31.5}  # fmt: skip
    table = mb.derive_recipe_table({"cases": {"gpu_heavy": case}})
    assert (table["recipes"][0]["gpu_gib"], table["recipes"][0]["host_gib"]) == (30.0, 12.0)
    path = tmp_path / "memory_recipes.json"
    path.write_text(json.dumps(table))
    (entry,) = mb.load_recipe_table(path)
    assert (entry.gpu_gib, entry.host_gib, entry.cap_gib) == (30.0, 12.0, 31.5)
    assert mb.select_recipe(32, 16, table=(entry,)).case == "gpu_heavy"
    with pytest.raises(mb.MemoryBudgetError, match="the smallest GPU need is 30.00 GiB"):
        mb.select_recipe(16, 64, table=(entry,))


def test_a_recipe_named_directly_takes_its_fitting_entry_or_its_smallest(monkeypatch):
    monkeypatch.setattr(mb, "load_recipe_table", lambda path=None: TABLE)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert mb.resolve_recipe("low_ram", None, None, "cpu").case == "pc_8gb_16gib"
    assert mb.resolve_recipe("low_ram", 12, 32, "cpu").case == "pc_12gb_32gib"
    assert mb.resolve_recipe("pc_12gb_32gib", None, None, "cpu").case == "pc_12gb_32gib"
    with pytest.raises(mb.MemoryBudgetError, match="not in the recipe table"):
        mb.resolve_recipe("tiny_ram", None, None, "cpu")
    with pytest.raises(mb.MemoryBudgetError, match="no CUDA GPU is visible"):
        mb.resolve_recipe("low_ram", None, None, "cuda")


# -- the command line --------------------------------------------------------------------------------------------------


def _memory_check(argv):
    args = cli.build_parser().parse_args(["generate", "--prompt", "a cat", "--out", "clip.mp4", *argv])
    cli.check_generate(args)  # the request's checks, then the recipe for its shape
    return args


def _usage_error(argv):
    with pytest.raises(cli.UsageError) as error:
        _memory_check(argv)
    message = str(error.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("budget", ["16,32", "auto"])
def test_cli_memory_without_a_cuda_gpu_is_refused_instead_of_running_on_the_cpu(budget, monkeypatch):
    fake_machine(monkeypatch, gpu_free_gib=None)
    message = _usage_error(["--memory", budget])
    assert f"--memory {budget}: the memory recipes place the model on a CUDA GPU, and this host has none" in message
    assert "drop --memory" in message


def test_cli_memory_with_device_cpu_is_refused(monkeypatch):
    fake_machine(monkeypatch, gpu_free_gib=15.0)
    assert "--device cpu asks for another device" in _usage_error(["--memory", "16,32", "--device", "cpu"])


def test_cli_memory_words_are_the_clis(monkeypatch):
    fake_machine(monkeypatch, gpu_free_gib=15.0)
    message = _usage_error(["--memory", "0.1,0.1"])
    assert message.count("docs/memory.md") == 1 and "gpu_gib" not in message and "host_gib" not in message
    assert "no memory recipe fits t2va 64x96x124 (5.2 s), 5 text rows in 0.10 GiB of GPU memory and 0.10 GiB of host " \
           "memory" in message


@pytest.mark.parametrize("value", ["-1,-1", "-0.5,32", "abc", "16", "16,32,1", "nan,3", "16,inf", "0,32"])
def test_cli_bad_memory_values_are_named_without_torch(value, monkeypatch):
    monkeypatch.setattr(cli, "_check_memory", lambda args: pytest.fail("the value reached the torch-side check"))
    parser = cli.build_parser()
    args = parser.parse_args(["generate", "--prompt", "a cat", "--out", "clip.mp4", "--memory", value])
    with pytest.raises(cli.UsageError, match=f"--memory {value}: not 'auto' nor"):
        cli.check_arguments(args)


def test_cli_memory_prints_one_line_naming_the_recipe(monkeypatch, capsys):
    fake_machine(monkeypatch, gpu_free_gib=15.0, mem_total_gib=64.0, mem_available_gib=50.0)
    args = _memory_check(["--memory", "auto"])
    assert args.memory_budget == (None, None) and args.memory_recipe.name in mb.RECIPES
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"memory recipe {args.memory_recipe.name!r}") and "MemAvailable" in err[0]


def test_the_help_states_autos_margin_and_headroom(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"free memory (less {mb.GPU_MARGIN_GIB:g} GiB)" in text
    assert f"available memory (at most all but {mb.HOST_HEADROOM_GIB:g} GiB)" in text


def test_cli_memory_with_a_checkpoint_in_other_formats_is_one_line(tmp_path, monkeypatch, capsys):
    """The recipe needs an NVFP4 DiT: a checkpoint saved with a W8A16 one is refused in one line, not a traceback."""
    from diffusers_h3.pipelines import MiniMaxH3Pipeline
    from diffusers_h3.quantizers import W8A16Config, quantize
    from diffusers_h3.testing import tiny

    components = tiny.tiny_components(seed=0, with_transformer_ref=False)
    components.pop("transformer_ref")
    quantize(components["transformer"], W8A16Config())
    MiniMaxH3Pipeline(**components, **tiny.TINY_DURATION_LIMITS).save_pretrained(tmp_path / "ckpt")
    capsys.readouterr()  # save_pretrained's progress bars
    fake_machine(monkeypatch, gpu_free_gib=15.5, mem_total_gib=64.0, mem_available_gib=60.0)
    monkeypatch.setattr(MiniMaxH3Pipeline, "from_pretrained", classmethod(lambda *a, **k: pytest.fail("loaded")))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", "--model", str(tmp_path / "ckpt"), "--prompt", "a cat", "--out", str(tmp_path / "c.mp4"),
                  "--memory", "16,32", "--height", "64", "--width", "96", "--frames", "22"])  # fmt: skip
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("memory recipe 'low_ram'") and len(err) == 2, err  # the choice, then the refusal
    assert err[1].startswith("diffusers-h3: error: --memory 16,32: ") and "is saved as h3_w8a16" in err[1]
    assert err[1].count("docs/memory.md") == 1
