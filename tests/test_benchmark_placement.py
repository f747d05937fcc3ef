"""benchmarks/placement.py runs end to end on the CPU with tiny components (the full-size run is for a GPU)."""

import json
from pathlib import Path

import pytest

from tests._scripts import run_script


ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "placement.py"
STAGES = ["text_encode", "forwards", "video_decode", "audio_decode", "other"]


def _run(tmp_path, *args):
    out = tmp_path / "placement_h200.json"
    run = run_script(SCRIPT, "--tiny", "--out", out, *args)
    return run, out


def _check_case(data, name):
    case = data["cases"][name]
    assert data["notes"].get(name) is None, data["notes"]
    assert case["ms"] > 0 and list(case["stages"]) == STAGES
    assert all(case["stages"][s] > 0 for s in STAGES[:-1]), case["stages"]
    assert sum(case["stages"].values()) == pytest.approx(case["ms"], rel=1e-3, abs=1.0)
    # exactly one denoising forward, the first of the 50-sigma-point t2va schedule
    assert case["forwards"] == 1 and case["sigma_points"] == 50 and len(case["forward_ms"]) == 1
    assert case["stages"]["forwards"] == pytest.approx(case["forward_ms"][0], abs=0.1)
    # CPU: no cap, no device memory figures; host memory recorded
    assert case["cap_gib"] is None and case["peak_allocated_gib"] is None and case["peak_reserved_gib"] is None
    assert case["host_peak_rss_gib"] > 0
    assert set(case["weights_gib"]) == {"text_encoder", "transformer", "vae", "audio_vae"}
    assert set(case["weights"]) == set(case["weights_gib"]) | {"text_encoder_layers"}
    # the tiny text encoder has exactly the layers the pipeline needs: the recipe's trim removes none
    assert case["weights"]["text_encoder_layers"]["removed_layers"] == 0
    assert all(size > 0 for size in case["weights_gib"].values())
    return case


def test_unknown_case_is_refused_before_building(tmp_path):
    run, out = _run(tmp_path, "--cases", "offload_48gb,resident_24gb")
    assert run.returncode != 0 and "unknown case(s) ['resident_24gb']" in run.stderr
    assert "built" not in run.stdout  # refused before any pipeline was built
    assert not out.exists()


def test_tiny_offload_recipe_records_every_stage(tmp_path):
    run, out = _run(tmp_path, "--cases", "offload_48gb")
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["suite"] == "placement" and data["shape"]["tiny"] is True and set(data["cases"]) == {"offload_48gb"}
    assert data["shape"]["forwards"] == 1 and data["shape"]["output_type"] == "np"
    case = _check_case(data, "offload_48gb")
    assert "enable_low_memory_offload(pipe, " in case["recipe"]
    placements = case["placements"]
    assert placements["transformer"].startswith("group offload (block level")
    assert placements["text_encoder"].startswith("group offload (leaf level")
    assert all("low_cpu_mem_usage=True" in placements[n] for n in ("transformer", "text_encoder"))
    assert placements["vae"] == placements["audio_vae"] == "model offload"
    assert "W8A16Config" in case["weights"]["transformer"] and "W8A16Config" in case["weights"]["text_encoder"]
    assert case["warmup_s"] > 0


def test_tiny_resident_recipe_quantizes_like_the_recipe_and_merges(tmp_path):
    # a result already in --out (another command's case) is kept with --merge
    first, out = _run(tmp_path, "--cases", "offload_40gb", "--no-warmup")
    assert first.returncode == 0, first.stderr[-3000:]
    run, out = _run(tmp_path, "--cases", "resident_80gb", "--no-warmup", "--merge")
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data["cases"]) == {"offload_40gb", "resident_80gb"} and len(data["command"]) == 2
    case = _check_case(data, "resident_80gb")
    assert case["placements"] == "all on cpu" and case["warmup_s"] == 0
    # the configs of single_gpu_resident_kwargs(): FP8 DiT (emulated on the CPU) and W8A16 text encoder
    assert "FP8Config" in case["weights"]["transformer"] and "emulation" in case["weights"]["transformer"]
    assert "W8A16Config" in case["weights"]["text_encoder"]


class _FakeAllocator:
    """The CUDA allocator's peak statistics, played on a CPU: ``use(gib)`` raises the peak until the next reset."""

    def __init__(self):
        self.allocated = self.reserved = 0.0

    def use(self, gib):
        self.allocated, self.reserved = max(self.allocated, gib), max(self.reserved, gib + 1.0)

    def install(self, monkeypatch, module):
        gib = 2**30
        cuda = module.torch.cuda
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: self.allocated * gib)
        monkeypatch.setattr(cuda, "max_memory_reserved", lambda device=None: self.reserved * gib)
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device=None: self.__init__())
        monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: 0)
        monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: 0)
        monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: (80 * gib, 80 * gib))
        monkeypatch.setattr(module, "host_memory", lambda: {"host_peak_rss_gib": 1.0})


def _placement_module(monkeypatch):
    import importlib.util

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("benchmarks_placement", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _StagedPipe:
    """A pipeline whose stages use the memory given (GiB), in the order the real request runs them."""

    def __init__(self, allocator, text_encode, forward, video_decode, audio_decode, fail_in=None):
        import torch

        self.allocator, self.fail_in = allocator, fail_in
        self.use = {"text_encode": text_encode, "video_decode": video_decode, "audio_decode": audio_decode}
        self.transformer = torch.nn.Identity()
        self.transformer.register_forward_pre_hook(lambda module, args: allocator.use(forward))
        self.components = {"transformer": self.transformer}

    def _stage(self, name):
        self.allocator.use(self.use[name])
        if name == self.fail_in:
            raise MemoryError(f"out of memory in {name}")

    def encode_prompt(self, *args, **kwargs):
        import torch

        self._stage("text_encode")
        return torch.zeros(1, 2, 4), None  # prompt embeddings and mask, as the pipeline's

    def _decode_video(self, *args, **kwargs):
        self._stage("video_decode")

    def _decode_audio(self, *args, **kwargs):
        self._stage("audio_decode")

    def _encode_visual_condition(self, *args, **kwargs):
        pass

    def __call__(self):
        import torch

        self.encode_prompt()
        self.transformer(torch.zeros(1))
        self._decode_video()
        self._decode_audio()


@pytest.mark.parametrize("stage_uses", [(13.7, 9.0, 5.0, 1.5), (2.0, 9.6, 4.0, 1.5), (2.0, 3.0, 7.4, 0.5)])
def test_the_case_peak_is_the_largest_stage_peak(stage_uses, monkeypatch):
    """StageTimer resets the allocator's peak at every stage: the record's peak must still be the whole request's
    (a stage early in the request, e.g. the text encode, must not be lost to the last stage's smaller peak)."""
    module = _placement_module(monkeypatch)
    allocator = _FakeAllocator()
    allocator.install(monkeypatch, module)
    pipe = _StagedPipe(allocator, *stage_uses)
    monkeypatch.setattr(module, "one_request", lambda pipe, tiny: pipe())
    import torch

    record = module.timed_request(pipe, torch.device("cuda"), tiny=True)
    stage_peaks = record["stage_peak_gib"]
    assert {"text_encode", "forwards", "video_decode", "audio_decode"} <= set(stage_peaks)
    for stage, (allocated, reserved) in stage_peaks.items():
        assert record["peak_allocated_gib"] >= allocated and record["peak_reserved_gib"] >= reserved, stage
    assert record["peak_allocated_gib"] == max(stage_uses) and record["peak_reserved_gib"] == max(stage_uses) + 1.0


def test_a_failing_case_records_the_peak_of_the_stage_that_failed(monkeypatch):
    module = _placement_module(monkeypatch)
    allocator = _FakeAllocator()
    allocator.install(monkeypatch, module)
    pipe = _StagedPipe(allocator, 2.0, 7.0, 7.4, 0.5, fail_in="video_decode")
    monkeypatch.setattr(module, "one_request", lambda pipe, tiny: pipe())
    import torch

    with pytest.raises(MemoryError) as error:
        module.timed_request(pipe, torch.device("cuda"), tiny=True)
    allocator.__init__()  # the allocator's own peak no longer knows the request
    peaks = module.failure_peaks(error.value, torch.device("cuda"))
    assert peaks["peak_allocated_before_failure_gib"] == 7.4 and peaks["stage_peak_gib"]["video_decode"] == [7.4, 8.4]


def _common_module(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import _common

    return _common


def test_the_sampler_keeps_the_peak_of_its_samples_and_of_each_window(monkeypatch):
    common = _common_module(monkeypatch)
    values = iter([1, 5, 3, 9, 2, 4, 4, 4])
    sampler = common.DeviceMemorySampler(read=lambda: next(values), interval_s=0.2)
    sampler.sample()  # 1
    with sampler.window("first"):  # 5 on entering, 3 inside, 9 on leaving
        sampler.sample()
    with sampler.window("second"):  # 2, then 4
        pass
    assert sampler.peak_bytes == 9 and sampler.windows == {"first": 9, "second": 4} and sampler.samples == 6
    with pytest.raises(ValueError, match="5 Hz"):
        common.DeviceMemorySampler(read=lambda: 0, interval_s=0.5)


def test_the_sampler_thread_samples_at_least_five_times_a_second(monkeypatch):
    import time

    common = _common_module(monkeypatch)
    sampler = common.DeviceMemorySampler(read=lambda: 7, interval_s=0.05).start()
    time.sleep(0.6)
    sampler.stop()
    assert sampler.samples >= 0.6 * 5 and sampler.peak_bytes == 7


@pytest.mark.parametrize("context_gib", [0.0, 0.6])
def test_the_device_peak_is_never_below_the_allocators_reserved_peak(context_gib, monkeypatch):
    """The request record's ``device_peak_gib`` counts the card's memory: the allocator's reserved memory plus what
    lies outside it. A sampler that saw only the context (it missed the reserved top) must not report less than
    the allocator reserved."""
    module = _placement_module(monkeypatch)
    allocator = _FakeAllocator()
    allocator.install(monkeypatch, module)
    gib = 2**30
    sampler = module.DeviceMemorySampler(read=lambda: int((allocator.reserved + context_gib) * gib), interval_s=0.2)
    monkeypatch.setattr(module, "_SAMPLER", sampler)
    pipe = _StagedPipe(allocator, 2.0, 7.0, 5.0, 0.5)
    monkeypatch.setattr(module, "one_request", lambda pipe, tiny: pipe())
    import torch

    record = module.timed_request(pipe, torch.device("cuda"), tiny=True)
    assert record["device_peak_gib"] >= record["peak_reserved_gib"] == 8.0
    if context_gib:  # the stage boundaries' samples saw the forward's top with the context on it
        assert record["device_peak_gib"] == pytest.approx(8.6) and "lower bound" not in record["device_peak_source"]
    else:
        assert record["device_peak_gib"] == 8.0


def test_a_sampled_peak_below_the_reserved_peak_is_reported_as_the_lower_bound(monkeypatch):
    common = _common_module(monkeypatch)
    fields = common.device_peak_fields(int(6.2 * 2**30), 7.5, "nvml device used - baseline")
    assert fields["device_peak_gib"] == 7.5 and "lower bound" in fields["device_peak_source"]
    fields = common.device_peak_fields(int(8.25 * 2**30), 7.5, "nvml per-process")
    assert fields == {"device_peak_gib": 8.25, "device_peak_source": "nvml per-process"}
