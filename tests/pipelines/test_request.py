"""`H3Request`: the checked call, built from configs and call arguments alone."""

import dataclasses
import json
import re
from pathlib import Path

import PIL.Image
import pytest
import torch
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MINIMAX_H3_TEXT_TAG, video_latent_num_frames

from diffusers_h3.pipelines.request import (
    DEFAULT_MAX_CANVAS_PIXELS,
    DEFAULT_MAX_DURATION_S,
    DEFAULT_MIN_DURATION_S,
    H3Clip,
    H3Request,
    RequestConfig,
    check_inputs,
    frame_range,
)
from diffusers_h3.tasks import get_task
from diffusers_h3.testing.tiny import TINY_DURATION_LIMITS, TINY_TRANSFORMER_CONFIG, TINY_VAE_CONFIG, tiny_pipeline


def _config(**overrides):
    config = RequestConfig.from_configs(TINY_VAE_CONFIG, {"transformer": TINY_TRANSFORMER_CONFIG})
    return dataclasses.replace(config, **overrides)


def _build(config=None, **kwargs):
    call = {"prompt": "a cat", "height": 32, "width": 32, "num_frames": 124, **kwargs}
    return H3Request.build(config or _config(), **call)


def test_request_is_frozen():
    request = _build()
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.num_frames = 22
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.clips[0].generator = torch.Generator()
    with pytest.raises(TypeError):
        request.conditioning["image"] = PIL.Image.new("RGB", (32, 32))
    with pytest.raises(dataclasses.FrozenInstanceError):
        _config().min_duration_s = 1.0


def test_request_is_built_from_configs_alone(tmp_path):
    """A checkpoint folder holding only its JSON configs (no weights) gives the same request config."""
    for name, config in (("vae", TINY_VAE_CONFIG), ("transformer", TINY_TRANSFORMER_CONFIG)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "MiniMaxH3Pipeline", "min_duration_s": 0.5,
                                                           "vae": ["diffusers", "AutoencoderKLMiniMaxH3"]}))  # fmt: skip
    config = RequestConfig.from_folder(tmp_path)
    assert config == _config(min_duration_s=0.5)
    assert dict(config.text_dims) == {"transformer": TINY_TRANSFORMER_CONFIG["text_dim"]}
    request = _build(config, num_frames=22)
    assert (request.task, request.num_frames, request.height, request.width) == ("t2va", 22, 32, 32)
    # The same configs as the loaded pipeline: the request is what `__call__` builds.
    pipe = tiny_pipeline()
    assert pipe.request_config() == _config(**TINY_DURATION_LIMITS, text_dims=pipe.request_config().text_dims)
    assert request.geometry == pipe._latent_geometry(22, 32, 32)


def test_request_resolves_task_and_canvas():
    """The canvas the task's `prepare_conditions` resolves on the pipeline, resolved from configs alone."""
    pipe = tiny_pipeline()
    request = _build(height=None, width=None)
    assert (request.task, request.height, request.width) == ("t2va", 768, 1344)
    keyframe = PIL.Image.new("RGB", (300, 600))
    request = _build(height=None, width=None, last_image=keyframe)
    conditions = get_task("fl2va").prepare_conditions(pipe.task_components(), request.conditioning, None, None, request.num_frames)
    assert request.task == "fl2va" and (request.height, request.width) == (conditions.height, conditions.width)
    assert request.height > request.width
    assert request.conditioning["last_image"] is keyframe and request.conditioning["image"] is None


def test_batch_split_one_generator_is_shared():
    generator = torch.Generator().manual_seed(0)
    request = _build(prompt=["a cat", "a dog"], num_videos_per_prompt=2, generator=generator)
    assert [clip.prompt for clip in request.clips] == ["a cat", "a cat", "a dog", "a dog"]
    assert all(clip.generator is generator for clip in request.clips)
    assert all(isinstance(clip, H3Clip) and clip.latents is None for clip in request.clips)


def test_batch_split_generator_list_and_latent_slices():
    generators = [torch.Generator().manual_seed(i) for i in range(2)]
    latents, audio_latents = torch.randn(2, 4, 37, 2, 2), torch.randn(4, 8, 207)
    request = _build(prompt=["a cat", "a dog"], generator=generators, latents=latents, audio_latents=audio_latents)
    for i, clip in enumerate(request.clips):
        assert clip.generator is generators[i]
        assert torch.equal(clip.latents, latents[i : i + 1])
        assert torch.equal(clip.audio_latents, audio_latents[2 * i : 2 * i + 2])
    with pytest.raises(ValueError, match="list of 1 generators but the batch has 2 clips"):
        _build(prompt=["a cat", "a dog"], generator=generators[:1])
    with pytest.raises(ValueError, match="`latents` has batch 2 but the batch has 3 clips"):
        _build(prompt=["a", "b", "c"], latents=latents)


def test_batch_split_prompt_embeds_rows():
    embeds, tags = torch.randn(2, 5, TINY_TRANSFORMER_CONFIG["text_dim"]), torch.full((5,), MINIMAX_H3_TEXT_TAG)
    request = _build(prompt=None, prompt_embeds=embeds, text_token_tags=tags, num_videos_per_prompt=2)
    assert [clip.prompt for clip in request.clips] == [None] * 4
    for i, clip in enumerate(request.clips):
        assert torch.equal(clip.prompt_embeds, embeds[i // 2][None]) and clip.text_token_tags is tags


@pytest.fixture
def fresh_duration_warnings(monkeypatch):
    """Forget the durations this process already warned about, so each test sees its own warnings."""
    monkeypatch.setattr("diffusers_h3.pipelines.request._WARNED_DURATIONS", set())


def _duration_warnings(h3_logs):
    return [r.getMessage() for r in h3_logs.caplog.records if "was trained for" in r.getMessage()]


def test_default_range_is_recommended_strict_refuses_4_and_16_seconds(fresh_duration_warnings, h3_logs):
    config = _config()
    assert (config.min_duration_s, config.max_duration_s) == (DEFAULT_MIN_DURATION_S, DEFAULT_MAX_DURATION_S) == (5, 15)
    assert frame_range(config) == (124, 345)
    with pytest.raises(ValueError, match=r"5–15 s.*strict_duration=True.*rounds up to 107 frames .* e\.g\. 124 "
                                         r"\(5\.2 s\) or 345 \(14\.4 s\)"):  # fmt: skip
        _build(num_frames=96, strict_duration=True)  # 4 s
    with pytest.raises(ValueError, match=r"rounds up to 396 frames"):
        _build(num_frames=384, strict_duration=True)  # 16 s
    with pytest.raises(ValueError, match=r"rounds up to 396 frames"):
        _build(dataclasses.replace(config, strict_duration=True), num_frames=384)  # the config's own setting
    h3_logs.caplog.clear()
    assert _build(num_frames=124).num_frames == 124 and _build(num_frames=345).num_frames == 345
    assert _duration_warnings(h3_logs) == []
    # Outside the range without strict: generated after a warning naming the trained range.
    assert _build(num_frames=96).num_frames == 107 and _build(num_frames=384).num_frames == 396
    warned = _duration_warnings(h3_logs)
    assert len(set(warned)) == 2 and all("outside the 5–15 s (124–345 frames)" in m for m in warned), warned


def test_duration_warning_is_given_once(fresh_duration_warnings, h3_logs):
    h3_logs.caplog.clear()
    for _ in range(3):
        _build(num_frames=72)  # 3 s
    assert len(set(_duration_warnings(h3_logs))) == 1
    count = len(_duration_warnings(h3_logs))
    _build(num_frames=72)
    assert len(_duration_warnings(h3_logs)) == count  # nothing new for the same duration
    _build(num_frames=480)  # 20 s: a new duration, a new warning
    assert len(set(_duration_warnings(h3_logs))) == 2


def test_less_than_one_vae_chunk_is_refused_even_without_strict():
    with pytest.raises(ValueError, match=r"rounds up to 5 frames .* less than one VAE chunk: .* at least 22 frames"):
        _build(num_frames=5)
    assert _build(_config(**TINY_DURATION_LIMITS), num_frames=6).num_frames == 22


def test_pipeline_warns_outside_the_range_and_refuses_when_strict(fresh_duration_warnings, h3_logs):
    """A 3 s and a 20 s clip generate with one warning each; `strict_duration` (call or config) refuses them."""
    pipe = tiny_pipeline(min_duration_s=DEFAULT_MIN_DURATION_S, max_duration_s=DEFAULT_MAX_DURATION_S)
    call = {"prompt": "a cat", "height": 32, "width": 32, "num_inference_steps": 2, "output_type": "latent"}
    for num_frames, aligned in ((72, 73), (480, 481)):
        with pytest.raises(ValueError, match=rf"5–15 s.*rounds up to {aligned} frames"):
            pipe(**call, num_frames=num_frames, strict_duration=True)
        h3_logs.caplog.clear()
        latents = pipe(**call, num_frames=num_frames).frames
        assert latents.shape[2] == video_latent_num_frames(aligned, 17, 5)
        assert len(set(_duration_warnings(h3_logs))) == 1
    strict = tiny_pipeline(min_duration_s=DEFAULT_MIN_DURATION_S, max_duration_s=DEFAULT_MAX_DURATION_S,
                           strict_duration=True)  # fmt: skip
    assert strict.config.strict_duration is True and strict.request_config().strict_duration is True
    with pytest.raises(ValueError, match=r"5–15 s.*rounds up to 73 frames"):
        strict(**call, num_frames=72)
    assert strict(**call, num_frames=72, strict_duration=False).frames.shape[2] == video_latent_num_frames(73, 17, 5)


def test_limits_come_from_the_pipeline_config():
    """Fails if a duration limit stops coming from the pipeline's config (e.g. back to a module constant)."""

    def check(pipe, num_frames):
        return check_inputs(pipe.request_config(), "t2va", prompt="a cat", height=32, width=32, num_frames=num_frames,
                            conditioning={})  # fmt: skip

    default = tiny_pipeline(min_duration_s=DEFAULT_MIN_DURATION_S, max_duration_s=DEFAULT_MAX_DURATION_S,
                            strict_duration=True)  # fmt: skip
    with pytest.raises(ValueError, match="5–15 s"):
        check(default, 22)
    short = tiny_pipeline(min_duration_s=0.5, max_duration_s=2.0, strict_duration=True)
    assert (short.config.min_duration_s, short.config.max_duration_s) == (0.5, 2.0)
    assert check(short, 22) == 22
    with pytest.raises(ValueError, match=r"0\.5–2 s.*rounds up to 56 frames"):
        check(short, 40)
    with pytest.raises(ValueError, match=r"0\.5–2 s"):
        short(prompt="a cat", height=32, width=32, num_frames=124, num_inference_steps=2, output_type="latent")


def test_cli_and_api_read_one_duration_rule(fresh_duration_warnings, tmp_path):
    """The CLI checks a request on the same `RequestConfig` the loaded pipeline builds: for the demo checkpoint (its
    saved config) and for a checkpoint folder, the accepted, warned and refused frame counts agree."""
    from diffusers_h3.testing.tiny import demo_pipeline_config

    demo_cli = RequestConfig.from_configs(TINY_VAE_CONFIG, {"transformer": TINY_TRANSFORMER_CONFIG}, demo_pipeline_config())
    demo_pipe = tiny_pipeline(**demo_pipeline_config())
    api = demo_pipe.request_config()
    assert dataclasses.replace(demo_cli, text_dims=api.text_dims) == api
    tiny_pipeline(max_duration_s=2.0, strict_duration=True).save_pretrained(tmp_path)
    folder_cli = RequestConfig.from_folder(tmp_path)
    from diffusers_h3 import MiniMaxH3Pipeline

    loaded = MiniMaxH3Pipeline.from_pretrained(tmp_path).request_config()
    assert folder_cli == dataclasses.replace(loaded, missing_text_components=())
    assert folder_cli.strict_duration is True and (folder_cli.min_duration_s, folder_cli.max_duration_s) == (0.5, 2.0)

    def outcome(config, num_frames):
        try:
            return _build(config, num_frames=num_frames).num_frames
        except ValueError as error:
            return str(error)

    for num_frames in (5, 22, 40, 124, 400):
        assert outcome(demo_cli, num_frames) == outcome(api, num_frames)
        assert outcome(folder_cli, num_frames) == outcome(loaded, num_frames)


def test_one_check_inputs_for_the_api_and_the_cli():
    """One request check: `check_inputs` in this module, run by `H3Request.build` for `__call__` and the CLI; the
    pipeline keeps no second copy."""
    from diffusers_h3 import MiniMaxH3Pipeline

    assert not hasattr(MiniMaxH3Pipeline, "check_inputs")
    cli_source = (Path(__file__).resolve().parents[2] / "diffusers_h3" / "cli.py").read_text()
    assert "H3Request.build(" in cli_source


@pytest.mark.parametrize(
    "setting, value, message",
    [
        ("min_duration_s", None, "`min_duration_s` .* must be a finite number above 0, got None"),
        ("max_duration_s", float("nan"), "`max_duration_s` .* must be a finite number above 0, got nan"),
        ("text_encoder_layer", None, "`text_encoder_layer` .* must be a positive int, got None"),
        ("text_encoder_layer", 50.0, "`text_encoder_layer` .* must be a positive int, got 50.0"),
        ("canvas_short_edge", "768", "`canvas_short_edge` .* must be a positive int"),
        ("max_prompt_tokens", 0, "`max_prompt_tokens` .* must be a positive int"),
        ("max_canvas_pixels", 32 * 32, r"`canvas_max_pixels`=.* is above `max_canvas_pixels`=1024"),
    ],
)
def test_pipeline_settings_are_checked_at_construction(setting, value, message):
    """A wrong type for a typed pipeline setting is refused when the pipeline is built (it used to be accepted and
    fail later as a bare TypeError in `encode_prompt`)."""
    with pytest.raises(ValueError, match=message):
        tiny_pipeline(**{setting: value})


def test_canvas_limit_is_the_pipeline_setting(tmp_path):
    config = _config()
    assert config.max_canvas_pixels == DEFAULT_MAX_CANVAS_PIXELS == 1920 * 1088
    _build(config, height=1088, width=1920)
    _build(config, height=1920, width=1088)
    with pytest.raises(ValueError, match=r"height=1120, width=1920 has 2,150,400 pixels"):
        _build(config, height=1120, width=1920)
    _build(_config(max_canvas_pixels=1120 * 1920), height=1120, width=1920)
    from diffusers_h3 import MiniMaxH3Pipeline

    tiny_pipeline(canvas_short_edge=64, canvas_max_pixels=64 * 64, max_canvas_pixels=64 * 64).save_pretrained(tmp_path)
    loaded = MiniMaxH3Pipeline.from_pretrained(tmp_path)
    assert loaded.request_config().max_canvas_pixels == RequestConfig.from_folder(tmp_path).max_canvas_pixels == 4096
    with pytest.raises(ValueError, match="more than this pipeline generates"):
        loaded(prompt="a cat", height=64, width=96, num_frames=22, num_inference_steps=2, output_type="latent")


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="min_duration_s <= max_duration_s"):
        _config(min_duration_s=3.0, max_duration_s=2.0)


def test_limits_survive_save_and_load(tmp_path):
    from diffusers_h3 import MiniMaxH3Pipeline

    tiny_pipeline(max_duration_s=2.0).save_pretrained(tmp_path)
    loaded = MiniMaxH3Pipeline.from_pretrained(tmp_path)
    assert (loaded.config.min_duration_s, loaded.config.max_duration_s) == (TINY_DURATION_LIMITS["min_duration_s"], 2.0)
    assert RequestConfig.from_folder(tmp_path) == dataclasses.replace(loaded.request_config(), missing_text_components=())


# Tests that still generate 5-15 s tiny clips, and why: GPU and multi-process runs share cases with the GPU suite;
# the hub-cache loads keep the hub layout's default limits; this file tests the limits themselves.
LONG_CLIPS_ALLOWED = ("tests/gpu/", "tests/parallel/", "tests/pipelines/test_hub_loading.py", "tests/pipelines/test_request.py")


def test_tiny_end_to_end_tests_run_short_clips():
    """The CPU suite's tiny end-to-end runs generate short clips (`TINY_NUM_FRAMES`), not the 124+ frames the real
    limits need."""
    root = Path(__file__).resolve().parents[2]
    long_clips = [
        path.relative_to(root).as_posix()
        for path in sorted((root / "tests").rglob("*.py"))
        if not path.relative_to(root).as_posix().startswith(LONG_CLIPS_ALLOWED)
        and re.search(r"[\"']num_frames[\"']: 124\b|num_frames=124\b", path.read_text())
    ]
    assert not long_clips, f"tiny end-to-end runs at 124 frames: {long_clips}"


@pytest.mark.parametrize("limits", [{}, TINY_DURATION_LIMITS, {"min_duration_s": 6.0, "max_duration_s": 10.0}])
def test_frame_message_names_the_counts_accepted(limits):
    """The strict refusal's "Pass A to B frames" is exactly the range `align_frames` accepts strictly (it once said
    120-360 where 108-345 are accepted)."""
    config = _config(**limits, strict_duration=True)
    with pytest.raises(ValueError) as refused:
        _build(config, num_frames=1000)
    low, high = map(int, re.search(r"Pass (\d+) to (\d+) frames", str(refused.value)).groups())

    def accepted(num_frames):
        try:
            _build(config, num_frames=num_frames)
            return True
        except ValueError:
            return False

    assert accepted(low) and accepted(high) and not accepted(low - 1) and not accepted(high + 1), (low, high)
    if not limits:
        assert (low, high) == (108, 345)


def test_prompt_bound_is_the_pipeline_setting_counted_in_tokens():
    config = _config(max_prompt_tokens=8, count_prompt_tokens=lambda text: len(text.split()))
    _build(config, prompt="one two three four five six seven eight")  # 8 tokens (39 bytes) fit
    with pytest.raises(ValueError, match=r"`prompt\[1\]` has 9 tokens, more than this pipeline encodes \(8, .*"
                                         r"`max_prompt_tokens=9`"):  # fmt: skip
        _build(config, prompt=["a cat", "one two three four five six seven eight nine"])
    # Without a tokenizer (configs alone) only what the bytes prove is checked: the CLI counts the rest itself.
    _build(_config(max_prompt_tokens=8), prompt="one two three four five six seven eight nine")


def test_prompt_bound_of_the_loaded_pipeline(tmp_path, monkeypatch):
    """`max_prompt_tokens` is a pipeline config value (saved, overridable on loading); the default refuses a
    100,000-byte prompt (the tiny tokenizer reads one token per byte) before any model runs, `encode_prompt` too."""
    pipe = tiny_pipeline()
    assert pipe.config.max_prompt_tokens == 2048 and pipe.request_config().max_prompt_tokens == 2048
    for name in ("text_encoder", "transformer", "vae"):
        monkeypatch.setattr(getattr(pipe, name), "forward", lambda *a, **k: pytest.fail("a model ran"))
    with pytest.raises(ValueError, match="`prompt` has 100000 tokens, more than this pipeline encodes"):
        pipe(prompt="a" * 100_000, num_frames=22, num_inference_steps=2)
    with pytest.raises(ValueError, match="`prompt` has 2049 tokens"):
        pipe.encode_prompt("a" * 2049)
    monkeypatch.undo()
    pipe.save_pretrained(tmp_path)
    loaded = type(pipe).from_pretrained(tmp_path, max_prompt_tokens=4)
    assert loaded.config.max_prompt_tokens == 4
    with pytest.raises(ValueError, match="`prompt` has 5 tokens"):
        loaded.encode_prompt("a cat")
    # The text encoder's positions bound it too, where they are fewer.
    loaded.text_encoder.config.text_config.max_position_embeddings = 3
    assert loaded.request_config().max_prompt_tokens == 3


def test_long_text_encodes_show_progress_per_decoder_layer(monkeypatch):
    from diffusers_h3.pipelines import pipeline_minimax_h3

    pipe = tiny_pipeline()
    quiet = pipe.encode_prompt("a cat plays")[0]
    bars = []
    original = pipe.progress_bar

    def progress_bar(*args, **kwargs):
        bars.append(original(*args, **kwargs))
        return bars[-1]

    monkeypatch.setattr(pipe, "progress_bar", progress_bar)
    pipe.encode_prompt("a cat plays")
    assert bars == []  # short: no bar
    monkeypatch.setattr(pipeline_minimax_h3, "LONG_TEXT_ENCODE_TOKENS", 11)  # "a cat plays": 11 tokens
    shown = pipe.encode_prompt("a cat plays")[0]
    layer = pipe.config.text_encoder_layer
    assert len(bars) == 1 and bars[0].total == layer and bars[0].n == layer, bars
    assert torch.equal(shown, quiet)  # the bar's hooks change nothing


def test_build_takes_the_call_arguments_by_keyword():
    """Fails if `H3Request.build` takes `prompt` (or any call argument) by position again."""
    with pytest.raises(TypeError, match="positional"):
        H3Request.build(_config(), "a cat")
    assert _build().clips[0].prompt == "a cat"


def test_schedule_check_takes_what_the_scheduler_takes():
    """Lists, 1-D tensors and 1-D NumPy arrays of noise levels pass (the scheduler takes them verbatim); the bounds
    are the scheduler's own: strictly decreasing in float32, ending at 0."""
    import numpy as np

    from diffusers_h3.pipelines.request import check_schedule

    for sigmas in ([1, 0.5, 0], torch.tensor([1.0, 0.5, 0.0]), np.array([1.0, 0.5, 0.0])):
        check_schedule(None, sigmas, None, 6, 3.0)
    with pytest.raises(ValueError, match="strictly decreasing"):
        check_schedule(None, [1.0, 1.0 - 1e-9, 0.0], None, None, None)  # distinct in float64, equal in float32
    with pytest.raises(ValueError, match="`sigmas` must be a list of numbers .* got a list"):
        check_schedule(None, ["x"] * 100, None, None, None)
