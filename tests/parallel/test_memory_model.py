"""The memory model by rows: row counts from the package's packing code, the least-squares fit, the committed copy."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

from diffusers_h3.parallel.memory_model import (
    FEATURES,
    MEMORY_MODEL_PATH,
    RELEASED_GEOMETRY,
    RequestShape,
    derive_memory_model,
    features,
    largest_fitting,
    load_memory_model,
    packed_rows,
    shape_records,
    traced_activations_gib,
)


ROOT = Path(__file__).resolve().parents[2]


def test_released_geometry_is_the_checkpoint_classes_defaults():
    from diffusers_h3.pipelines.request import RequestConfig

    config = RequestConfig.from_configs({}, {"transformer": {}})
    assert (config.vae_spatial_compression_ratio, config.vae_frames_per_chunk, config.vae_latents_per_chunk) == (
        RELEASED_GEOMETRY["vae_spatial_compression_ratio"], RELEASED_GEOMETRY["vae_frames_per_chunk"],
        RELEASED_GEOMETRY["vae_latents_per_chunk"])  # fmt: skip
    assert tuple(config.patch_size) == RELEASED_GEOMETRY["patch_size"]
    assert config.canvas_rule == (RELEASED_GEOMETRY["canvas_short_edge"], RELEASED_GEOMETRY["canvas_max_pixels"])
    import inspect

    from diffusers_h3 import MiniMaxH3Pipeline

    default = inspect.signature(MiniMaxH3Pipeline.__init__).parameters["reference_image_short_edge"].default
    assert default == RELEASED_GEOMETRY["reference_image_short_edge"]


def test_rows_of_the_measured_shape():
    """768x1344x124: 37 latent frames x 24 x 42 video rows, 5.17 s x 40 latents/s x 2 channels audio rows, and the
    text rows; an fl2va keyframe adds one latent frame's grid."""
    rows = packed_rows(RequestShape())
    assert rows == {"text": 512, "keyframe": 0, "reference": 0, "audio": 414, "video": 37 * 24 * 42, "total": 38222}
    assert packed_rows(RequestShape(task="fl2va"))["keyframe"] == 24 * 42
    assert packed_rows(RequestShape(task="fl2va", keyframes=2))["keyframe"] == 2 * 24 * 42
    assert packed_rows(RequestShape(height=480, width=832))["video"] == 37 * 15 * 26
    assert packed_rows(RequestShape(num_frames=259))["video"] == 77 * 24 * 42


def test_ref2va_references_enter_as_rows():
    """An image reference at a 2048 short edge (16:9 canvas: 2048 x 3584) is one latent frame of 64 x 112 rows; a
    video reference is a clip on the canvas rule, with its soundtrack's rows."""
    one_image = packed_rows(RequestShape(task="ref2va", reference_images=1))
    assert one_image["reference"] == 64 * 112
    video = packed_rows(RequestShape(task="ref2va", reference_videos=1))
    assert video["reference"] == 37 * 24 * 42 + 414
    both = packed_rows(RequestShape(task="ref2va", reference_images=3, reference_videos=1))
    assert both["reference"] == 3 * 64 * 112 + 37 * 24 * 42 + 414
    assert both["total"] == 512 + both["reference"] + 414 + 37 * 24 * 42
    with pytest.raises(ValueError, match="references route a request to ref2va"):
        RequestShape(task="t2va", reference_images=1)


LAW = {
    "device_gib": {"fixed": 5.5, "rows": 0.42, "decode_megapixels": 0.8, "lora_rank": 0.25},
    "allocated_gib": {"fixed": 4.1, "rows": 0.35, "decode_megapixels": 0.5, "lora_rank": 0.2},
    "host_gib": {"fixed": 6.9, "clip_megapixel_frames": 0.6, "lora_rank": 0.1},
}
SHAPES = [("t2va", 480, 832, 124, 0), ("fl2va", 480, 832, 124, 64), ("t2va", 768, 1344, 124, 0),
          ("fl2va", 768, 1344, 124, 64), ("t2va", 768, 1344, 259, 0), ("fl2va", 768, 1344, 259, 64),
          ("t2va", 1088, 1920, 124, 0), ("fl2va", 544, 960, 345, 32)]  # fmt: skip
HOLDOUT = [("t2va", 640, 1088, 175, 0), ("fl2va", 640, 1088, 175, 64)]


def _record(task, height, width, frames, rank, law=LAW, scale=1.0, **extra):
    shape = RequestShape(task=task, height=height, width=width, num_frames=frames, lora_rank=rank)
    x = features(shape)

    def peak(name):
        return scale * sum(w * (1.0 if k == "fixed" else x[k]) for k, w in law[name].items())

    return {"task": task, "height": height, "width": width, "num_frames": frames, "prompt_tokens": 512,
            "reference_images": 0, "reference_videos": 0, "lora_rank": rank, "recipe": "low_ram",
            "settings": {"read_ahead": 1}, "device_peak_gib": peak("device_gib"), "peak_reserved_gib": None,
            "peak_allocated_gib": peak("allocated_gib"), "host_peak_rss_gib": peak("host_gib"), "ms": 1.0,
            "fits": True, **extra}  # fmt: skip


def _results(records, case="pc_8gb_16gib"):
    return {"device": "NVIDIA H100 80GB HBM3", "commit": "abc1234",
            "cases": {case: {"recipe_name": "low_ram", "settings": {"read_ahead": 1}, "cap_gib": 7.0,
                             "shapes": records}}}  # fmt: skip


def _entry(model):
    return model["cases"]["pc_8gb_16gib"]


def test_fit_recovers_a_known_law_and_reports_the_holdout_error():
    records = [_record(*s) for s in SHAPES] + [_record(*s, scale=1.1) for s in HOLDOUT]  # holdouts measured 10 % high
    model = derive_memory_model(_results(records), "synthetic.json", holdout=["640x1088x175"])
    entry = model["cases"]["pc_8gb_16gib"]
    for name, law in LAW.items():
        for term, weight in law.items():
            assert entry[name][term] == pytest.approx(weight, abs=2e-4), (name, term)
    assert entry["fitted_requests"] == len(SHAPES) and len(model["holdout"]) == 2
    assert model["fit_shapes_max_error"] == pytest.approx(0, abs=1e-3)
    for row in model["holdout"]:  # predicted by the law, measured 1.1x: error -1/11
        assert row["device_error"] == pytest.approx(-1 / 11, abs=1e-3)
        assert row["host_error"] == pytest.approx(-1 / 11, abs=1e-3)
        assert row["measured_device_gib"] == pytest.approx(1.1 * row["predicted_device_gib"], abs=2e-3)
    assert model["holdout_max_error"] == pytest.approx(1 / 11, abs=1e-3)
    # A record marked as holdout is not fitted either.
    marked = derive_memory_model(_results([_record(*s) for s in SHAPES] + [_record(*HOLDOUT[0], holdout=True)]), "x")
    assert [r["shape"] for r in marked["holdout"]] == [RequestShape(task="t2va", height=640, width=1088,
                                                                    num_frames=175).label()]  # fmt: skip


def test_a_negative_or_constant_term_is_dropped_with_its_reason():
    law = {**LAW, "device_gib": {**LAW["device_gib"], "decode_megapixels": -0.3}}
    records = [_record(*s, law=law) for s in SHAPES]
    entry = derive_memory_model(_results(records), "x")["cases"]["pc_8gb_16gib"]
    assert entry["device_gib"]["decode_megapixels"] == 0.0
    assert "negative" in entry["device_gib_dropped"]["decode_megapixels"]
    no_lora = [_record(t, h, w, f, 0) for t, h, w, f, _ in SHAPES]
    entry = derive_memory_model(_results(no_lora), "x")["cases"]["pc_8gb_16gib"]
    assert entry["device_gib"]["lora_rank"] == 0.0 and "does not vary" in entry["device_gib_dropped"]["lora_rank"]


def test_terms_the_shapes_cannot_separate_are_refused():
    """Requests at one canvas and one frame count (only their text rows differ a little) cannot separate the per-row
    term from the fixed part: the fit is refused rather than trading one against the other."""
    same = [_record("t2va", 768, 1344, 124, 0), _record("fl2va", 768, 1344, 124, 64)] * 3
    with pytest.raises(ValueError, match="cannot separate the terms"):
        derive_memory_model(_results([dict(r, prompt_tokens=512 + i) for i, r in enumerate(same)]), "x")


def test_too_few_requests_leave_the_case_out():
    model = derive_memory_model(_results([_record(*s) for s in SHAPES[:3]]), "x")
    assert model["cases"] == {} and "3 measured requests" in model["not_fit"]["pc_8gb_16gib"]
    assert 1 + max(len(v) for v in FEATURES.values()) == 4


def test_requests_that_ran_out_under_the_cap_are_not_fitted_and_the_model_refuses_them():
    """A request that ran out of memory under the cap measured the cap, not its need: it is listed under
    ``beyond_cap`` with the need the allocations law predicts, which must exceed the cap."""
    big = _record("t2va", 1088, 1920, 345, 0, fits=False, device_peak_gib=7.4, peak_allocated_gib=6.9,
                  error="OutOfMemoryError: CUDA out of memory")  # fmt: skip
    model = derive_memory_model(_results([_record(*s) for s in SHAPES] + [big]), "x")
    assert _entry(model)["fitted_requests"] == len(SHAPES)
    assert _entry(model)["allocated_gib"]["rows"] == pytest.approx(LAW["allocated_gib"]["rows"], abs=2e-4)
    [row] = model["beyond_cap"]
    assert row["shape"].startswith("t2va 1088x1920x345") and row["cap_gib"] == 7.0
    assert row["predicted_allocated_gib"] > 7.0 and row["model_refuses"] is True


def test_the_device_prediction_is_bounded_by_the_cap_and_what_lies_outside_the_allocator(tmp_path):
    """Under a cap the allocator caches freed blocks up to the cap: a request that fits is predicted no higher than
    the cap plus the largest measured memory outside the allocator (device peak less reserved peak)."""
    records = [_record(*s, peak_reserved_gib=_record(*s)["device_peak_gib"] - 0.75) for s in SHAPES]
    model = derive_memory_model(_results(records), "x")
    entry = _entry(model)
    assert entry["outside_allocator_gib"] == pytest.approx(0.75, abs=1e-6)
    assert entry["device_bound_gib"] == pytest.approx(7.75, abs=1e-6)
    path = tmp_path / "m.json"
    path.write_text(json.dumps(model))
    loaded = load_memory_model(path)
    small = loaded.predict("pc_8gb_16gib", RequestShape(height=480, width=832))
    assert small.fits_cap and small.device_gib == pytest.approx(_record("t2va", 480, 832, 124, 0)["device_peak_gib"],
                                                                abs=0.01)  # fmt: skip
    # a request whose law exceeds the bound but whose allocations still fit the cap: the bound
    entry["device_gib"]["fixed"] += 5.0
    path.write_text(json.dumps(model))
    assert load_memory_model(path).predict("pc_8gb_16gib", RequestShape(height=480, width=832)).device_gib == 7.75
    huge = loaded.predict("pc_8gb_16gib", RequestShape(height=1088, width=1920, num_frames=345))
    assert not huge.fits_cap and huge.allocated_gib > 7.0


def test_a_term_every_fitted_request_held_fixed_is_not_modelled(tmp_path):
    """Fitted without a LoRA, the model does not speak for a request with one (the LoRA's cost was never measured)."""
    no_lora = [_record(t, h, w, f, 0) for t, h, w, f, _ in SHAPES]
    model = derive_memory_model(_results(no_lora), "x")
    assert _entry(model)["constant_terms"] == {"lora_rank": 0.0}
    path = tmp_path / "m.json"
    path.write_text(json.dumps(model))
    loaded = load_memory_model(path)
    assert loaded.models("pc_8gb_16gib", RequestShape(task="fl2va"))
    assert not loaded.models("pc_8gb_16gib", RequestShape(task="fl2va", lora_rank=64))
    assert not loaded.models("pc_12gb_32gib", RequestShape())


def test_loaded_model_predicts_what_the_fit_recorded(tmp_path):
    model = derive_memory_model(_results([_record(*s) for s in SHAPES]), "x")
    path = tmp_path / "memory_model.json"
    path.write_text(json.dumps(model))
    loaded = load_memory_model(path)
    shape = RequestShape(task="fl2va", height=768, width=1344, num_frames=259, lora_rank=64)
    prediction = loaded.predict("pc_8gb_16gib", shape)
    expected = _record("fl2va", 768, 1344, 259, 64)
    assert prediction.device_gib == pytest.approx(expected["device_peak_gib"], abs=0.01)
    assert prediction.host_gib == pytest.approx(expected["host_peak_rss_gib"], abs=0.01)
    assert prediction.rows == packed_rows(shape)["total"] and "pc_8gb_16gib" in prediction.basis
    assert load_memory_model(tmp_path / "missing.json") is None


def test_fit_script_writes_the_device_file_and_the_package_copy(tmp_path):
    spec = importlib.util.spec_from_file_location("memory_model_script", ROOT / "benchmarks" / "memory_model.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    results = tmp_path / "placement_h100.json"
    results.write_text(json.dumps(_results([_record(*s) for s in SHAPES + HOLDOUT])))
    out, copy = tmp_path / "memory_model_h100.json", tmp_path / "copy.json"
    assert script.main(["--results", str(results), "--holdout", "640x1088x175", "--out", str(out),
                        "--package-copy", str(copy)]) == 0  # fmt: skip
    written = json.loads(out.read_text())
    assert written == json.loads(copy.read_text())
    assert {"fit_shapes", "holdout", "cases"} <= set(written) and len(written["holdout"]) == 2
    assert script.device_slug("NVIDIA H100 80GB HBM3") == "h100" and script.device_slug("NVIDIA H200") == "h200"


def test_largest_fitting_bisects_over_steps():
    assert largest_fitting(lambda v: v <= 260, 22, 1000, 17) == 260 - (260 - 22) % 17
    assert largest_fitting(lambda v: False, 22, 1000, 17) is None
    assert largest_fitting(lambda v: True, 22, 1000, 17) == 22 + (1000 - 22) // 17 * 17


def _measured_results():
    """The committed placement results that hold measured requests (``cases[<case>]["shapes"]``)."""
    found = {}
    for path in sorted((ROOT / "benchmarks" / "results").glob("placement_*.json")):
        results = json.loads(path.read_text())
        if shape_records(results):
            found[path.relative_to(ROOT).as_posix()] = results
    return found


@pytest.mark.skipif(not _measured_results(), reason="no committed placement result holds measured requests yet")
def test_committed_model_is_the_fit_of_the_committed_measurements():
    """The package's memory_model.json is what benchmarks/memory_model.py derives from the committed measurements,
    and it reproduces the measured peaks it was fitted on (as the fit reported them)."""
    measured = _measured_results()
    assert MEMORY_MODEL_PATH.is_file(), (
        f"{sorted(measured)} hold measured requests but the package has no memory model: run python "
        "benchmarks/memory_model.py --results <that file> --holdout HxWxF --package-copy "
        "diffusers_h3/parallel/memory_model.json"
    )
    model = json.loads(MEMORY_MODEL_PATH.read_text())
    assert model["source"] in measured, (model["source"], sorted(measured))
    results = measured[model["source"]]
    activations = None
    if model.get("activations_source"):
        activations = json.loads((ROOT / model["activations_source"]).read_text())
    derived = derive_memory_model(results, model["source"], model["holdout_shapes"], activations)
    if activations is not None:
        derived["activations_source"] = model["activations_source"]
    assert derived == model
    loaded = load_memory_model()
    records = {(case, RequestShape.from_record(r).label()): r for case, r in shape_records(results)}
    for row in model["fit_shapes"] + model["holdout"]:
        record = records[(row["case"], row["shape"])]
        prediction = loaded.predict(row["case"], RequestShape.from_record(record))
        assert math.isclose(prediction.device_gib, row["predicted_device_gib"], abs_tol=0.01)
        assert math.isclose(prediction.host_gib, row["predicted_host_gib"], abs_tol=0.01)
        assert math.isclose(record["device_peak_gib"], row["measured_device_gib"], abs_tol=0.001)
    assert model["holdout"], "the committed model names no holdout request"


# A synthetic activation trace: flat-ish up to 30k rows (a chunked feed-forward's peak), then steep (the rotary
# embedding's temporaries), as benchmarks/activation_trace.py traces the released DiT.
TRACE = {"rows": [10_000, 20_000, 30_000, 40_000, 80_000], "peaks_gib": {"8192": [1.5, 2.0, 2.5, 4.9, 9.7]},
         "label": "synthetic"}
STAGE_FIXED, STAGE_LORA, DECODE_FIXED, DECODE_PER_MP, REST = 1.0, 0.5, 5.0, 0.6, 2.2


def _stage_record(task, height, width, frames, rank, **extra):
    shape = RequestShape(task=task, height=height, width=width, num_frames=frames, lora_rank=rank)
    x = features(shape)
    trace = {"rows": [r / 1e4 for r in TRACE["rows"]], "gib": TRACE["peaks_gib"]["8192"]}
    forwards = STAGE_FIXED + traced_activations_gib(trace, x["rows"]) + STAGE_LORA * x["lora_rank"]
    decode = DECODE_FIXED + DECODE_PER_MP * x["decode_megapixels"]
    record = _record(task, height, width, frames, rank, **extra)
    record.update(settings={"read_ahead": 1, "ffn_chunk_rows": 8192}, peak_allocated_gib=max(forwards, decode, REST),
                  stage_peak_gib={"forwards": [forwards, 7.0], "video_decode": [decode, 7.0],
                                  "text_encode": [REST, 3.0], "audio_decode": [0.6, 6.0]})  # fmt: skip
    return record


def _stage_results(records):
    results = _results(records)
    results["cases"]["pc_8gb_16gib"]["settings"] = {"read_ahead": 1, "ffn_chunk_rows": 8192}
    return results


def test_traced_activations_interpolate_and_extend_the_last_segment():
    trace = {"rows": [1.0, 2.0, 4.0], "gib": [1.0, 2.0, 6.0]}
    assert traced_activations_gib(trace, 1.5) == pytest.approx(1.5)
    assert traced_activations_gib(trace, 3.0) == pytest.approx(4.0)
    assert traced_activations_gib(trace, 6.0) == pytest.approx(10.0)  # the last slope beyond the trace
    assert traced_activations_gib(trace, 0.5) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="at least two"):
        traced_activations_gib({"rows": [1.0], "gib": [1.0]}, 1.0)


def test_the_allocations_are_the_largest_stage_with_the_trace_as_the_forward_rows_term(tmp_path):
    """Fitted per stage, the model recovers the forward's fixed part and LoRA term and the decode's law, and predicts
    a request beyond the measured rows from the trace's steep part: refused under a cap the straight-line law, fitted
    on the same requests (mostly decode-bound), lets through."""
    small = [("t2va", 480, 832, 124, 0), ("fl2va", 480, 832, 124, 64), ("t2va", 768, 1344, 124, 0),
             ("t2va", 544, 960, 175, 0), ("fl2va", 768, 1344, 124, 64)]  # fmt: skip
    records = [_stage_record(*s) for s in small]
    model = derive_memory_model(_stage_results(records), "x", activations=TRACE)
    stages = _entry(model)["allocated_stages"]
    assert stages["forwards"]["fixed"] == pytest.approx(STAGE_FIXED, abs=1e-3)
    assert stages["forwards"]["lora_rank"] == pytest.approx(STAGE_LORA, abs=1e-3)
    assert stages["video_decode"]["decode_megapixels"] == pytest.approx(DECODE_PER_MP, abs=1e-3)
    assert stages["rest_gib"] == pytest.approx(REST) and stages["activation_trace"]["ffn_chunk_rows"] == 8192
    assert model["fit_shapes_max_error"] is not None
    assert max(abs(r["allocated_error"]) for r in model["fit_shapes"]) < 1e-3
    path = tmp_path / "m.json"
    path.write_text(json.dumps(model))
    long_clip = RequestShape(height=768, width=1344, num_frames=260)
    staged = load_memory_model(path).predict("pc_8gb_16gib", long_clip)
    expected = _stage_record("t2va", 768, 1344, 260, 0)["peak_allocated_gib"]
    assert staged.allocated_gib == pytest.approx(expected, abs=0.01) and not staged.fits_cap
    straight = derive_memory_model(_stage_results(records), "x")  # no trace: the one straight line
    assert "allocated_stages" not in _entry(straight)
    path.write_text(json.dumps(straight))
    assert load_memory_model(path).predict("pc_8gb_16gib", long_clip).allocated_gib < expected - 1.0


def test_without_stage_peaks_or_a_trace_for_the_setting_the_straight_line_law_stays():
    records = [_stage_record(*s) for s in SHAPES]
    records[0].pop("stage_peak_gib")
    assert "allocated_stages" not in _entry(derive_memory_model(_stage_results(records), "x", activations=TRACE))
    other = {**TRACE, "peaks_gib": {"16384": TRACE["peaks_gib"]["8192"]}}
    full = [_stage_record(*s) for s in SHAPES]
    assert "allocated_stages" not in _entry(derive_memory_model(_stage_results(full), "x", activations=other))


def test_a_prediction_names_its_own_entrys_holdout_errors_per_peak(tmp_path):
    records = [_record(*s) for s in SHAPES] + [_record(*s, scale=1.1) for s in HOLDOUT]
    model = derive_memory_model(_results(records), "x", holdout=["640x1088x175"])
    other = {**_entry(model), "fitted_requests": 1}
    model["cases"]["pc_12gb_32gib"] = other  # an entry without holdout rows of its own
    model["holdout_max_error"] = 0.5
    path = tmp_path / "m.json"
    path.write_text(json.dumps(model))
    loaded = load_memory_model(path)
    basis = loaded.predict("pc_8gb_16gib", RequestShape()).basis
    assert "holdout error up to 9% for the allocations, 9% for the device peak, 9% for the host peak" in basis
    assert loaded.predict("pc_12gb_32gib", RequestShape()).basis.endswith("holdout error up to 50%")


def test_requests_measured_under_request_sized_caps_are_predicted_at_that_cap_plus_what_lies_outside(tmp_path):
    """When every fitted request ran under a request-sized cap, the entry says so and its device prediction is the
    request's own cap plus the memory outside the allocator; without that record the device law stands."""
    from diffusers_h3.parallel.memory_model import request_cap_gib

    small = [("t2va", 480, 832, 124, 0), ("fl2va", 480, 832, 124, 64), ("t2va", 768, 1344, 124, 0),
             ("t2va", 544, 960, 175, 0), ("fl2va", 768, 1344, 124, 64)]  # fmt: skip
    plain = [_stage_record(*s) for s in small]
    for record in plain:
        record["peak_reserved_gib"] = record["device_peak_gib"] - 0.75
    capped = [dict(r, request_cap_gib=request_cap_gib(r["peak_allocated_gib"], 7.0)) for r in plain]
    entry_plain = _entry(derive_memory_model(_stage_results(plain), "x", activations=TRACE))
    entry_capped = _entry(derive_memory_model(_stage_results(capped), "x", activations=TRACE))
    assert "request_sized_cap" not in entry_plain and entry_capped["request_sized_cap"]["margin"] > 0
    shape = RequestShape(height=480, width=832)
    for entry, capped_run in ((entry_plain, False), (entry_capped, True)):
        entry["device_gib"]["fixed"] += 5.0  # a device law above both bounds: which bound applies shows
        path = tmp_path / "m.json"
        path.write_text(json.dumps({"cases": {"pc_8gb_16gib": entry}}))
        prediction = load_memory_model(path).predict("pc_8gb_16gib", shape)
        assert prediction.request_capped_device_gib == pytest.approx(prediction.request_cap_gib + 0.75, abs=0.01)
        bound = prediction.request_capped_device_gib if capped_run else entry["device_bound_gib"]
        assert prediction.device_gib == pytest.approx(bound, abs=0.01) and prediction.request_cap_gib < 7.0
