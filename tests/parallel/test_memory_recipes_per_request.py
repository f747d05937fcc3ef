"""Per-request memory decisions on faked machines: the recipe entry chosen for a request's shape from the memory model,
the one-line refusal naming what would fit, named machines, and the `plan` command."""

import dataclasses

import pytest

from diffusers_h3 import cli
from diffusers_h3.parallel import memory_recipes as mb
from diffusers_h3.parallel.memory_model import MemoryModel, RequestShape, features, frames_of_seconds


def _entry(case, gpu, host, seconds, recipe="low_ram", cap=None):
    return mb.MemoryRecipe(mb.RECIPES[recipe], gpu, host, seconds, case, True, "test", cap_gib=cap)


TABLE = (
    _entry("low_ram_16gb", 13.7, 7.5, 420.0, cap=15.5),
    _entry("pc_12gb_32gib", 11.2, 7.4, 520.0, cap=11.5),
    _entry("pc_8gb_16gib", 7.2, 7.5, 700.0, cap=7.5),
)
HOST = {"fixed": 6.5, "clip_megapixel_frames": 0.4, "lora_rank": 0.0}
# Device laws per entry (GiB): a fixed part and a per-10k-rows term; the faster entries hold more per row.
LAWS = {
    "low_ram_16gb": {"fixed": 6.0, "rows": 2.0, "decode_megapixels": 0.5, "lora_rank": 0.1},
    "pc_12gb_32gib": {"fixed": 5.5, "rows": 1.4, "decode_megapixels": 0.5, "lora_rank": 0.1},
    "pc_8gb_16gib": {"fixed": 5.0, "rows": 0.5, "decode_megapixels": 0.5, "lora_rank": 0.1},
}
MODEL = MemoryModel(cases={case: {"device_gib": law, "host_gib": HOST, "fitted_requests": 8} for case, law in LAWS.items()},
                    device="test GPU", holdout_max_error=0.05)  # fmt: skip


def _device_need(case, shape):
    x = features(shape)
    return LAWS[case]["fixed"] + sum(w * x[k] for k, w in LAWS[case].items() if k != "fixed")


def _fits_somewhere(shape, gpu):
    return any(_device_need(case, shape) <= gpu for case in LAWS)


SMALL = RequestShape(height=480, width=832, num_frames=124)
MEASURED = RequestShape()
LONG = RequestShape(num_frames=259)


def _expected(gpu, shape):
    """The fastest entry whose modelled device need fits (brute force over the laws)."""
    fitting = [e for e in TABLE if _device_need(e.case, shape) <= gpu]
    return min(fitting, key=lambda e: e.request_s).case if fitting else None


@pytest.mark.parametrize("gpu, shape", [(16.0, SMALL), (16.0, MEASURED), (12.0, MEASURED), (16.0, LONG), (12.0, LONG),
                                        (7.3, SMALL)])  # fmt: skip
def test_the_entry_chosen_depends_on_the_requests_shape(gpu, shape):
    expected = _expected(gpu, shape)
    chosen = mb.select_recipe(gpu, 32.0, table=TABLE, shape=shape, memory_model=MODEL)
    assert chosen.case == expected
    assert chosen.gpu_gib == pytest.approx(_device_need(expected, shape), abs=0.01)  # the request's need, not the table's
    assert chosen.request == shape.label() and "memory model" in chosen.line() and shape.key() in chosen.line()


def test_one_machine_accepts_a_short_clip_with_the_fast_entry_and_a_long_one_with_the_lean_entry():
    assert mb.select_recipe(16.0, 32.0, table=TABLE, shape=MEASURED, memory_model=MODEL).case == "low_ram_16gb"
    assert mb.select_recipe(16.0, 32.0, table=TABLE, shape=LONG, memory_model=MODEL).case == "pc_8gb_16gib"
    with pytest.raises(mb.MemoryBudgetError):
        mb.select_recipe(7.3, 32.0, table=TABLE, shape=LONG, memory_model=MODEL)


def test_nothing_fits_is_one_line_naming_the_longest_clip_and_largest_canvas_that_fit():
    shape = RequestShape(num_frames=frames_of_seconds(45))
    gpu = 9.0
    with pytest.raises(mb.MemoryBudgetError) as refused:
        mb.select_recipe(gpu, 32.0, table=TABLE, shape=shape, memory_model=MODEL)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"no memory recipe fits {shape.label()} in 9.00 GiB of GPU")
    # brute force over what the refusal claims
    frames = max(f for f in range(22, frames_of_seconds(60) + 1, 17)
                 if _fits_somewhere(dataclasses.replace(shape, num_frames=f), gpu))  # fmt: skip
    assert f"at 768x1344 up to {frames} frames ({frames / 24:.1f} s) fit" in message
    assert not _fits_somewhere(dataclasses.replace(shape, num_frames=frames + 17), gpu)
    edges = [e for e in range(256, 769, 32) if _fits_somewhere(dataclasses.replace(
        shape, height=e, width=round(e * 1344 / 768 / 32) * 32), gpu)]  # fmt: skip
    canvas = f"{edges[-1]}x{round(edges[-1] * 1344 / 768 / 32) * 32}"
    assert f"at {shape.num_frames} frames up to {canvas}" in message
    assert "shorten the clip or lower the resolution" in message


def test_without_a_model_only_requests_the_measurements_bound_are_accepted():
    empty = MemoryModel(cases={})
    small = mb.select_recipe(16.0, 32.0, table=TABLE, shape=SMALL, memory_model=empty)
    assert small.case == "low_ram_16gb" and small.gpu_gib == 13.7 and "no memory model yet" in small.line()
    with pytest.raises(mb.MemoryBudgetError, match="no memory recipe is measured or modelled for t2va 768x1344x259"):
        mb.select_recipe(80.0, 256.0, table=TABLE, shape=LONG, memory_model=empty)
    assert mb.bounded_by_measured(RequestShape(task="fl2va", lora_rank=64))
    assert not mb.bounded_by_measured(RequestShape(task="ref2va", reference_images=1))


def test_host_need_per_request_refuses_too():
    shape = RequestShape(num_frames=frames_of_seconds(30))
    host_need = HOST["fixed"] + HOST["clip_megapixel_frames"] * features(shape)["clip_megapixel_frames"]
    with pytest.raises(mb.MemoryBudgetError):
        mb.select_recipe(80.0, host_need - 0.1, table=TABLE, shape=shape, memory_model=MODEL)


@pytest.mark.parametrize("card, usable", [(8, 7.3), (12, 11.25), (24, 22.5), (80, 75.0)])
def test_named_cards_leave_the_driver_and_desktop_their_share(card, usable):
    assert mb.usable_card_gib(card) == usable
    assert mb.named_gpu_budget(str(card)).gpu_gib == usable


def test_gpus_are_named_as_the_consumer_model_lists_them():
    predictions = mb.load_predictions()
    cuda_name = next(iter(predictions["gpus"]))
    entry = predictions["gpus"][cuda_name]
    for spelling in (cuda_name, entry["name"], cuda_name.replace("NVIDIA GeForce ", "").lower()):
        budget = mb.named_gpu_budget(spelling, predictions)
        assert budget.gpu_name == cuda_name and budget.gpu_gib == mb.usable_card_gib(entry["memory_gib"])
    with pytest.raises(mb.MemoryBudgetError, match="not a card size nor a GPU"):
        mb.named_gpu_budget("Voodoo 3", predictions)


def test_plan_gives_recipe_peaks_and_predicted_times():
    plan = mb.plan_request(LONG, host_gib=12.0, gpu="16", table=TABLE, memory_model=MODEL, predictions={})
    lines = plan.lines()
    expected = _expected(mb.usable_card_gib(16), LONG)
    assert plan.recipe.case == expected and len(lines) == 5
    assert lines[0].startswith("request: t2va 768x1344x259") and "packed rows" in lines[0]
    assert "peaks (predicted)" in lines[3] and f"{_device_need(expected, LONG):.2f} GiB device" in lines[3]
    assert lines[4].startswith("time: 50 steps") and "x " in lines[4] and "measured on an H200" in lines[4]
    seconds = {e.case: e.request_s for e in TABLE}[expected]
    assert plan.seconds == pytest.approx(seconds * plan.recipe.time_scale) and plan.recipe.time_scale > 2


def test_plan_command_on_a_named_machine(monkeypatch, capsys):
    monkeypatch.setattr(mb, "load_memory_model", lambda path=None: MODEL)
    monkeypatch.setattr(mb, "load_recipe_table", lambda path=None: TABLE)
    assert cli.main(["plan", "--gpu", "12", "--ram", "16", "--frames", "259"]) == 0
    out = capsys.readouterr().out
    assert f"'low_ram' as {_expected(mb.usable_card_gib(12), LONG)}" in out and "peaks (predicted)" in out
    assert "note: 259 frames" not in out
    assert cli.main(["plan", "--gpu", "8", "--ram", "16", "--frames", "1081"]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("no memory recipe fits t2va 768x1344x1093") and "fit" in out[0]
    assert cli.main(["plan", "--gpu", "24", "--ram", "32", "--frames", "72"]) == 0
    assert "outside the 5-15 s" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--task", "ref2va"], "needs at least one reference"), (["--reference-images", "2"], "takes no references"),
    (["--height", "100"], "not multiples of 32"), (["--ram", "4"], "leave 4 GiB")])  # fmt: skip
def test_plan_argument_mistakes_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["plan", "--gpu", "8", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_load_for_memory_budget_chooses_for_the_shape_before_loading(monkeypatch, tmp_path):
    from diffusers_h3.pipelines import recipe_loading

    monkeypatch.setattr(mb, "load_memory_model", lambda path=None: MODEL)
    monkeypatch.setattr(mb, "load_recipe_table", lambda path=None: TABLE)
    chosen = []
    monkeypatch.setattr(recipe_loading, "_quantization_plan",
                        lambda directory, recipe, *a: chosen.append(recipe) or pytest.skip("stop before loading"))
    monkeypatch.setattr(recipe_loading, "resolve_repo", lambda *a: str(tmp_path))
    with pytest.raises(mb.MemoryBudgetError, match="at 768x1344 up to"):
        recipe_loading.load_for_memory_budget("x", "t2va", 9.0, 32.0, device="cpu",
                                              shape=RequestShape(num_frames=frames_of_seconds(45)))  # fmt: skip


def test_auto_compares_a_whole_device_need_without_the_allocator_margin(monkeypatch):
    """A memory-model need counts the CUDA context (already missing from the free memory read), so `auto` compares it
    with the free memory itself; a measured allocator need keeps the margin."""
    from tests.parallel.test_memory_recipes_decisions import fake_machine

    fake_machine(monkeypatch, gpu_free_gib=7.6, mem_total_gib=32.0, mem_available_gib=30.0)
    need = _device_need("pc_8gb_16gib", MEASURED)
    assert 7.6 - mb.GPU_MARGIN_GIB < need <= 7.6
    chosen = mb.select_recipe(table=TABLE[2:], shape=MEASURED, memory_model=MODEL)
    assert chosen.case == "pc_8gb_16gib" and "without the 0.5 GiB margin" in chosen.line()
    measured = (_entry("pc_8gb_16gib", need, 7.5, 700.0),)  # the same need, measured by the allocator
    with pytest.raises(mb.MemoryBudgetError):
        mb.select_recipe(table=measured, shape=MEASURED, memory_model=MemoryModel(cases={}))


def test_cli_reads_the_loras_rank_from_its_file(tmp_path):
    import torch
    from safetensors.torch import save_file

    path = tmp_path / "style.safetensors"
    save_file({"transformer.blocks.0.attn.to_q.lora_A.weight": torch.zeros(16, 64),
               "transformer.blocks.0.attn.to_q.lora_B.weight": torch.zeros(64, 16)}, str(path))  # fmt: skip
    args = cli.build_parser().parse_args(["generate", "--prompt", "a cat", "--lora", str(path)])
    assert cli._lora_rank(args) == 16
    assert cli._lora_rank(cli.build_parser().parse_args(["generate", "--prompt", "a cat"])) == 0


def test_plan_on_a_listed_gpu_gives_its_predicted_times_scaled_to_the_request():
    predictions = mb.load_predictions()
    cuda_name, entry = next((n, g) for n, g in predictions["gpus"].items() if g["memory_gib"] >= 16 and g["cases"])
    plan = mb.plan_request(LONG, host_gib=28.0, gpu=cuda_name, table=TABLE, memory_model=MODEL, predictions=predictions)
    times = mb.predicted_seconds(plan.recipe, cuda_name, predictions=predictions)
    assert times is not None and "not measured" in plan.lines()[4] and "4 forwards" in plan.lines()[4]
    assert plan.seconds == pytest.approx(times["t2va_s"] * plan.recipe.time_scale)
    assert plan.few_step_seconds == pytest.approx(times["t2va_4step_s"] * plan.recipe.time_scale)


def test_a_pipeline_placed_by_a_recipe_refuses_a_request_predicted_not_to_fit(monkeypatch, h3_logs):
    """After `enable_memory_budget`, each call's request is checked against the budget the recipe was chosen for:
    a request the model predicts too large is one line before anything runs; one it fits runs."""
    from diffusers_h3.testing.tiny import tiny_pipeline

    pipe = tiny_pipeline()
    budget = mb.MemoryBudget(gpu_gib=9.0, host_gib=32.0)
    pipe._h3_memory_recipe = dataclasses.replace(TABLE[2], budget=budget)
    monkeypatch.setattr(mb, "load_memory_model", lambda path=None: MODEL)
    call = {"prompt": "a cat", "num_inference_steps": 2, "output_type": "latent"}
    long_clip = RequestShape(height=768, width=1344, num_frames=frames_of_seconds(45), prompt_tokens=5)
    assert _device_need("pc_8gb_16gib", long_clip) > 9.0
    monkeypatch.setattr(type(pipe), "_generate", lambda self, request, clip: pytest.fail("ran before the check"))
    with pytest.raises(mb.MemoryBudgetError, match=r"t2va 768x1344x1093 .* more than the 9\.00 GiB GPU .* it was "
                                                   r"placed for; with it at 768x1344 up to \d+ frames"):  # fmt: skip
        pipe(**call, height=768, width=1344, num_frames=1081)
    monkeypatch.undo()
    monkeypatch.setattr(mb, "load_memory_model", lambda path=None: MODEL)
    out = pipe(**call, height=32, width=32, num_frames=22)  # small: fits, runs
    assert out.frames.shape[2] == 7
    pipe._h3_memory_recipe = dataclasses.replace(TABLE[2], budget=budget)
    monkeypatch.setattr(mb, "load_memory_model", lambda path=None: MemoryModel(cases={}))
    monkeypatch.setattr(mb, "_UNMODELLED_WARNED", set())
    monkeypatch.setattr(type(pipe), "_generate", lambda self, request, clip: pytest.skip("checked, then ran"))
    with h3_logs.expect("neither modelled nor measured for t2va 768x1344x1093"):
        with pytest.raises(pytest.skip.Exception):
            pipe(**call, height=768, width=1344, num_frames=1081)


# An entry with stage laws: the forwards' allocations 2 GiB + 1 GiB per 10k rows (no activation trace: zero), the
# decode 1 GiB, the rest 0.5; measured with 0.75 GiB outside the allocator under a 10 GiB cap.
FLAT_TRACE = {"rows": [0.0, 100.0], "gib": [0.0, 0.0]}
STAGED = {"device_gib": {"fixed": 9.0}, "host_gib": HOST, "fitted_requests": 4, "cap_gib": 10.0,
          "outside_allocator_gib": 0.75, "device_bound_gib": 10.75,
          "allocated_stages": {"forwards": {"fixed": 2.0, "rows": 1.0}, "video_decode": {"fixed": 1.0},
                               "rest_gib": 0.5, "activation_trace": FLAT_TRACE}}  # fmt: skip
SMALL = RequestShape(height=480, width=832, num_frames=124, prompt_tokens=512)


def _staged_model(**entry):
    return MemoryModel(cases={"pc_12gb_32gib": {**STAGED, **entry}}, device="test GPU")


def test_a_request_sized_cap_is_the_predicted_allocations_plus_headroom():
    from diffusers_h3.parallel.memory_model import REQUEST_CAP_MARGIN, REQUEST_CAP_SLACK_GIB, request_cap_gib

    prediction = _staged_model().predict("pc_12gb_32gib", SMALL)
    want = prediction.allocated_gib * (1 + REQUEST_CAP_MARGIN) + REQUEST_CAP_SLACK_GIB
    assert prediction.request_cap_gib == pytest.approx(want, abs=0.01) and prediction.request_cap_gib < 10.0
    assert prediction.request_capped_device_gib == pytest.approx(prediction.request_cap_gib + 0.75, abs=0.01)
    assert prediction.device_gib == 9.0  # the entry was not measured under request caps: its own law stands
    measured_so = _staged_model(request_sized_cap={"margin": REQUEST_CAP_MARGIN}).predict("pc_12gb_32gib", SMALL)
    assert measured_so.device_gib == measured_so.request_capped_device_gib < 9.0
    assert request_cap_gib(20.0, 10.0) == 10.0  # never above the recipe's cap


def test_a_pipeline_placed_with_request_sized_caps_caps_each_call_to_its_request(monkeypatch):
    import torch

    from diffusers_h3.parallel.placement import placement_of
    from diffusers_h3.testing.tiny import tiny_pipeline

    pipe = tiny_pipeline()
    pipe._h3_memory_recipe = dataclasses.replace(TABLE[1], budget=mb.MemoryBudget(gpu_gib=11.2, host_gib=32.0))
    pipe._h3_request_sized_cap = mb.RequestSizedCap(torch.device("cuda", 0), ceiling_gib=10.0)
    caps = []
    monkeypatch.setattr(mb, "set_allocator_cap", lambda gib, device: caps.append((gib, str(device))))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: caps.append("emptied"))
    model = _staged_model()
    monkeypatch.setattr(mb, "load_memory_model", lambda path=None: model)
    monkeypatch.setattr(type(pipe), "_generate", lambda self, request, clip: pytest.skip("capped, then ran"))
    with pytest.raises(pytest.skip.Exception):
        pipe(prompt="a cat", num_inference_steps=2, output_type="latent", height=32, width=32, num_frames=22)
    shape_cap = caps[-1][0]
    assert caps[-2] == "emptied" and caps[-1][1] == "cuda:0" and shape_cap < 10.0
    assert placement_of(pipe)["request_cap"].startswith(f"capped at {shape_cap:.2f} GiB for t2va 32x32x22")
    # a request the model does not speak for runs under the recipe's cap, or the whole card without one
    monkeypatch.setattr(mb, "load_memory_model", lambda path=None: MemoryModel(cases={}))
    line = mb.apply_request_sized_cap(pipe, pipe._h3_memory_recipe, SMALL)
    assert caps[-1] == (10.0, "cuda:0") and "not predicted by the memory model" in line
    pipe._h3_request_sized_cap = mb.RequestSizedCap(torch.device("cuda", 0), ceiling_gib=None)
    assert "the recipe's cap (none)" in mb.apply_request_sized_cap(pipe, pipe._h3_memory_recipe, SMALL)
    assert caps[-1] == (None, "cuda:0")
    del pipe._h3_request_sized_cap  # not placed with request-sized caps: nothing is touched
    count = len(caps)
    assert mb.apply_request_sized_cap(pipe, pipe._h3_memory_recipe, SMALL) is None and len(caps) == count


class _Pipe:
    text_encoder = None


@pytest.fixture
def placed_without_weights(monkeypatch):
    """``enable_memory_budget`` with the recipe resolved to the 12 GB test entry and nothing placed or capped: what
    is left is the request-sized-cap decision. Returns that entry."""
    import torch

    entry = dataclasses.replace(TABLE[1], budget=None)
    monkeypatch.setattr(mb, "resolve_recipe", lambda *a, **k: entry)
    monkeypatch.setattr(mb, "check_weights_for_recipe", lambda pipe, recipe: None)
    monkeypatch.setattr(mb, "place_for_recipe", lambda *a, **k: None)
    monkeypatch.setattr(mb, "hold_allocator_for_recipe", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return entry


def test_enable_memory_budget_keeps_a_request_sized_cap_on_cuda_only(placed_without_weights):
    import torch

    Pipe = _Pipe
    for device, kept in (("cuda", True), ("cpu", False)):
        pipe = Pipe()
        mb.enable_memory_budget(pipe, mb.MemoryBudgetConfig(gpu_gib=9.0, device=device, request_sized_cap=True))
        state = getattr(pipe, "_h3_request_sized_cap", None)
        assert (state is not None) == kept
    assert state is None
    pipe = Pipe()
    mb.enable_memory_budget(pipe, mb.MemoryBudgetConfig(gpu_gib=9.0, device="cuda", request_sized_cap=True))
    assert pipe._h3_request_sized_cap == mb.RequestSizedCap(torch.device("cuda", 0), 9.0)
    from diffusers_h3.parallel.placement import placement_of

    assert placement_of(pipe)["request_cap"] == ("each call held to its request's predicted allocations + 5% + 0.25 GiB, "
                                                 "no higher than 9 GiB")  # fmt: skip


def test_request_sized_caps_default_to_how_the_entry_was_measured(monkeypatch, placed_without_weights):
    """``request_sized_cap=None`` (the default) caps each call to its request exactly when the memory model's entry
    was fitted on requests run that way; True / False override it."""
    entry, Pipe = placed_without_weights, _Pipe
    for measured in (False, True):
        model = _staged_model(**({"request_sized_cap": {"margin": 0.05}} if measured else {}))
        monkeypatch.setattr(mb, "load_memory_model", lambda path=None, model=model: model)
        assert mb.measured_with_request_sized_caps(entry) is measured
        for asked, kept in ((None, measured), (True, True), (False, False)):
            pipe = Pipe()
            mb.enable_memory_budget(pipe, mb.MemoryBudgetConfig(gpu_gib=9.0, device="cuda", request_sized_cap=asked))
            assert hasattr(pipe, "_h3_request_sized_cap") is kept, (measured, asked)


def test_the_packaged_12gb_entry_was_measured_under_request_sized_caps():
    """The committed measurements decide the default: the 12 GB entry's requests all ran under request-sized caps, the
    8 GB entry's under its whole cap."""
    model = mb.load_memory_model()
    by_case = {case: mb.measured_with_request_sized_caps(dataclasses.replace(TABLE[1], case=case), model)
               for case in ("pc_12gb_32gib", "pc_8gb_16gib")}  # fmt: skip
    assert by_case == {"pc_12gb_32gib": True, "pc_8gb_16gib": False}


def test_plan_says_what_a_request_sized_cap_would_hold():
    staged = _staged_model()
    plan = mb.plan_request(SMALL, gpu_gib=11.5, host_gib=32.0, table=(TABLE[1],), memory_model=staged,
                           predictions={})  # fmt: skip
    prediction = staged.predict("pc_12gb_32gib", SMALL)
    assert plan.lines()[-1] == (f"with --request-sized-cap: allocator capped at {prediction.request_cap_gib:.2f} GiB "
                                f"for this request, device peak about {prediction.request_capped_device_gib:.2f} GiB "
                                "(predicted; this entry was measured under its whole cap)")  # fmt: skip
    measured_so = _staged_model(request_sized_cap={"margin": 0.05})
    plan = mb.plan_request(SMALL, gpu_gib=11.5, host_gib=32.0, table=(TABLE[1],), memory_model=measured_so,
                           predictions={})  # fmt: skip
    assert plan.lines()[-1] == (f"allocator: capped at {prediction.request_cap_gib:.2f} GiB for this request, as the "
                                f"entry was measured (--no-request-sized-cap: its whole {TABLE[1].cap_gib:g} GiB cap)")
    assert len(mb.plan_request(SMALL, gpu_gib=11.5, host_gib=32.0, table=(TABLE[1],), memory_model=MODEL,
                               predictions={}).lines()) == 5  # a model without the allocator's outside: no line


def test_set_allocator_cap_replaces_an_earlier_smaller_cap(monkeypatch):
    """A request-sized cap is set for every call: the whole card (fraction 1) when there is no cap or it exceeds the
    card, so an earlier call's smaller cap never stays."""
    from types import SimpleNamespace

    import torch

    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=8 * mb.GiB))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: calls.append((f, str(device))))
    assert mb.set_allocator_cap(6.0, "cuda:0") == 0.75
    assert mb.set_allocator_cap(None, "cuda:0") == 1.0 and mb.set_allocator_cap(20.0, "cuda:0") == 1.0
    assert calls == [(0.75, "cuda:0"), (1.0, "cuda:0"), (1.0, "cuda:0")]


def test_plan_shows_the_cap_the_allocator_is_held_to_on_this_machine():
    """An entry whose cap is above this machine's GPU budget runs held to the budget (recipe_gpu_cap): the plan says so
    instead of the entry's cap."""
    staged = _staged_model()
    line = mb.plan_request(SMALL, gpu_gib=9.5, host_gib=32.0, table=(TABLE[1],), memory_model=staged,
                           predictions={}).lines()[2]  # fmt: skip
    assert f"GPU cap 9.5 GiB: the entry's {TABLE[1].cap_gib:g}, no higher than this machine's" in line, line
    line = mb.plan_request(SMALL, gpu_gib=11.5, host_gib=32.0, table=(TABLE[1],), memory_model=staged,
                           predictions={}).lines()[2]  # fmt: skip
    assert line.endswith(f"GPU cap {TABLE[1].cap_gib:g} GiB)"), line
