"""User-reachable options that no default-path test tells apart: each test runs with the option and without it and
checks the difference the option defines (pipeline call arguments, export options, CLI flags)."""

import argparse

import pytest
import torch

from diffusers_h3.testing.tiny import tiny_pipeline


RUN = {"height": 32, "width": 32, "num_frames": 22, "num_inference_steps": 3, "output_type": "latent"}


def _call(pipe, **kwargs):
    return pipe(prompt="a fox in snow", **{**RUN, **kwargs}, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline(seed=11, with_transformer_ref=False)


@pytest.fixture(scope="module")
def base(pipe):
    return _call(pipe)


# -- pipeline call arguments -----------------------------------------------------------------------------------------


def test_attention_kwargs_scale_reaches_the_lora_layers(pipe, base, tmp_path):
    from tests.loaders._lora_helpers import canonical_lora, save_lora, tiny_transformer, write_layout

    shape = ("attention_head_dim", "num_attention_heads")
    reference = tiny_transformer(**{k: pipe.transformer.config[k] for k in shape})
    lora = save_lora(tmp_path / "style.safetensors", write_layout(canonical_lora(reference, seed=61), "native"))
    pipe.load_lora_weights(lora, "style")
    try:
        full = _call(pipe)
        zero = _call(pipe, attention_kwargs={"scale": 0.0})
        half = _call(pipe, attention_kwargs={"scale": 0.5})
        pipe.set_adapters("style", 0.5)
        half_by_weight = _call(pipe)
    finally:
        pipe.unload_lora_weights()
    assert not torch.allclose(full.frames, base.frames, atol=1e-4)
    torch.testing.assert_close(zero.frames, base.frames, atol=1e-6, rtol=0)  # scale 0 == no LoRA
    torch.testing.assert_close(zero.audio, base.audio, atol=1e-6, rtol=0)
    torch.testing.assert_close(half.frames, half_by_weight.frames, atol=1e-6, rtol=0)  # per-call scale == adapter weight
    assert not torch.allclose(half.frames, full.frames, atol=1e-4)


def test_audio_sigmas_are_used_verbatim_and_change_only_the_audio(pipe, base):
    default_audio_sigmas = pipe.audio_scheduler.sigmas.clone()
    video_sigmas = pipe.scheduler.sigmas.clone()
    audio_sigmas = [1.0, 0.3, 0.0]
    assert not torch.allclose(default_audio_sigmas, torch.tensor(audio_sigmas))
    out = _call(pipe, sigmas=video_sigmas.tolist(), audio_sigmas=audio_sigmas)
    torch.testing.assert_close(pipe.audio_scheduler.sigmas.float(), torch.tensor(audio_sigmas))
    torch.testing.assert_close(pipe.scheduler.sigmas, video_sigmas)  # the video schedule is untouched
    assert not torch.allclose(out.audio, base.audio, atol=1e-4)


def test_audio_flow_shift_changes_the_audio_schedule_only(pipe):
    _call(pipe)
    video, audio = pipe.scheduler.sigmas.clone(), pipe.audio_scheduler.sigmas.clone()
    _call(pipe, audio_flow_shift=1.0)
    assert torch.equal(pipe.scheduler.sigmas, video)
    assert not torch.equal(pipe.audio_scheduler.sigmas, audio)
    _call(pipe, flow_shift=2.0)
    assert not torch.equal(pipe.scheduler.sigmas, video)
    assert torch.equal(pipe.audio_scheduler.sigmas, audio)


def test_callback_prompt_embeds_replace_the_embeddings_of_later_steps(pipe, base):
    seen = []

    def record(module, args, kwargs):
        seen.append(kwargs["encoder_hidden_states"].clone())

    def zero_prompt(p, step, timestep, tensors):
        return {"prompt_embeds": torch.zeros_like(tensors["prompt_embeds"])}

    hook = pipe.transformer.register_forward_pre_hook(record, with_kwargs=True)
    try:
        out = _call(pipe, callback_on_step_end=zero_prompt, callback_on_step_end_tensor_inputs=["prompt_embeds"])
    finally:
        hook.remove()
    assert len(seen) == 2 and torch.count_nonzero(seen[0]) > 0 and torch.count_nonzero(seen[1]) == 0
    assert not torch.allclose(out.frames, base.frames, atol=1e-5)


def test_latents_option_is_the_initial_noise(pipe, base):
    noise = torch.Generator().manual_seed(123)
    shaped = _call(pipe)  # same seed: the same noise as base
    assert torch.equal(shaped.frames, base.frames)
    latents = torch.randn(base.frames.shape, generator=noise)  # output_type="latent": frames are the latents
    audio_latents = torch.randn(base.audio.shape, generator=noise)
    out = _call(pipe, latents=latents, audio_latents=audio_latents)
    again = pipe(prompt="a fox in snow", **RUN, latents=latents, audio_latents=audio_latents,
                 generator=torch.Generator().manual_seed(99))  # fmt: skip
    assert not torch.equal(out.frames, base.frames)
    assert not torch.equal(out.audio, base.audio)
    # the given noise, not the generator's, decides the clip (t2va draws no other noise)
    assert torch.equal(out.frames, again.frames) and torch.equal(out.audio, again.audio)


# -- export options ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fps", [24, 12])
def test_export_fps_sets_the_stream_rate_and_duration(tmp_path, fps):
    import av
    import numpy as np

    from diffusers_h3 import export_to_video

    frames = np.random.default_rng(0).random((12, 32, 32, 3), dtype=np.float32)
    path = export_to_video(frames, tmp_path / f"clip{fps}.mp4", fps=fps)
    with av.open(path) as container:
        stream = container.streams.video[0]
        assert stream.average_rate == fps
        decoded = sum(1 for _ in container.decode(stream))
        duration = float(stream.duration * stream.time_base) if stream.duration else None
    assert decoded == 12
    if duration is not None:
        assert abs(duration - 12 / fps) < 1.5 / fps


# -- CLI flags: each one reaches the library call it names ------------------------------------------------------------


class _Stop(Exception):
    pass


class _FakePipe:
    def __init__(self, log):
        self.log = log

    def enable_model_cpu_offload(self, device=None):
        self.log.append(("enable_model_cpu_offload", device))

    def to(self, device):
        self.log.append(("to", device))
        return self

    def load_lora_weights(self, path, adapter_name=None, allow_unmatched_keys=False, allow_step_recipe_stacking=False):
        self.log.append(("load_lora_weights", adapter_name, allow_unmatched_keys, allow_step_recipe_stacking))
        return "report"

    def set_adapters(self, names, weights):
        self.log.append(("set_adapters", list(names), list(weights)))

    def enable_v100_mode(self, **options):
        self.log.append(("enable_v100_mode", options))

    def enable_vsa(self, **options):
        self.log.append(("enable_vsa", options))

    def register_to_config(self, **options):
        self.log.append(("register_to_config", options))

    def _partitions(self):
        return []

    def __call__(self, **call):
        self.log.append(("call", call))
        raise _Stop


@pytest.fixture
def cli_run(monkeypatch, tmp_path):
    """Runs `diffusers-h3 generate ...` up to the pipeline call with a recording pipeline; returns the log."""
    import diffusers_h3.testing.tiny as tiny
    from diffusers_h3 import MiniMaxH3Pipeline, cli

    def run(*flags, conditioning=None):
        log = []

        def from_pretrained(model, **kwargs):
            log.append(("from_pretrained", model, kwargs))
            return _FakePipe(log)

        monkeypatch.setattr(MiniMaxH3Pipeline, "from_pretrained", staticmethod(from_pretrained))
        monkeypatch.setattr(tiny, "demo_checkpoint_dir", lambda *a, **k: tmp_path / "demo")
        if conditioning is not None:  # a task the demo checkpoint cannot check (ref2va): skip the pre-checks
            def checked(args):
                args.task = "t2va"
                return conditioning

            monkeypatch.setattr(cli, "check_generate", checked)
        args = cli.build_parser().parse_args(["generate", "--prompt", "a cat", "--out", str(tmp_path / "o.mp4"),
                                              "--device", "cpu", *flags])  # fmt: skip
        with pytest.raises(_Stop):
            cli.cmd_generate(args)
        return log

    return run


def _entries(log, name):
    return [entry for entry in log if entry[0] == name]


def test_cli_dtype_and_cpu_offload(cli_run):
    default = cli_run()
    assert "dtype" not in _entries(default, "from_pretrained")[0][2]
    assert _entries(default, "to") == [("to", "cpu")] and not _entries(default, "enable_model_cpu_offload")
    chosen = cli_run("--dtype", "bf16", "--cpu-offload")
    assert _entries(chosen, "from_pretrained")[0][2]["dtype"] is torch.bfloat16
    assert _entries(chosen, "enable_model_cpu_offload") == [("enable_model_cpu_offload", "cpu")]
    assert not _entries(chosen, "to")
    for flags in (["--cpu-offload"], ["--dtype", "fp32"]):  # each flag alone has its own effect
        alone = cli_run(*flags)
        assert bool(_entries(alone, "enable_model_cpu_offload")) == ("--cpu-offload" in flags)
        assert ("dtype" in _entries(alone, "from_pretrained")[0][2]) == ("--dtype" in flags)


def test_cli_lora_scale_and_allow_unmatched(cli_run, tmp_path):
    from safetensors.torch import save_file

    lora = tmp_path / "style.safetensors"
    save_file({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 32)}, str(lora))
    default = cli_run("--lora", str(lora))
    assert _entries(default, "set_adapters") == [("set_adapters", ["cli"], [1.0])]
    assert _entries(default, "load_lora_weights") == [("load_lora_weights", "cli", False, False)]
    chosen = cli_run("--lora", str(lora), "--lora-scale", "0.25", "--lora-allow-unmatched")
    assert _entries(chosen, "set_adapters") == [("set_adapters", ["cli"], [0.25])]
    assert _entries(chosen, "load_lora_weights") == [("load_lora_weights", "cli", True, False)]
    stacked = cli_run("--lora", str(lora), "--allow-step-recipe-stacking")
    assert _entries(stacked, "load_lora_weights") == [("load_lora_weights", "cli", False, True)]


def test_cli_vsa_dense_first_steps_and_v100(cli_run):
    assert not _entries(cli_run(), "enable_vsa") and not _entries(cli_run(), "enable_v100_mode")
    vsa = cli_run("--vsa", "0.5", "--dense-first-steps", "2", "--attention-precision", "int8")
    assert _entries(vsa, "enable_vsa") == [("enable_vsa", {"sparsity": 0.5, "precision": "int8", "dense_first_steps": 2})]
    assert _entries(cli_run("--v100"), "enable_v100_mode") == [("enable_v100_mode", {})]


def test_cli_attention_precision_alone_installs_dense_low_precision(cli_run, monkeypatch):
    import diffusers_h3.attention_processors as processors

    seen = []
    monkeypatch.setattr(processors, "enable_low_precision_attention", lambda pipe, config: seen.append(config.precision))
    cli_run("--attention-precision", "fp8")
    cli_run("--attention-precision", "bf16")  # the default path: nothing installed
    assert seen == ["fp8"]


def test_cli_request_flags_reach_the_call(cli_run):
    call = _entries(cli_run("--seed", "7", "--steps", "4", "--frames", "130"), "call")[0][1]
    default = _entries(cli_run(), "call")[0][1]
    assert call["generator"].initial_seed() == 7 and default["generator"].initial_seed() == 0
    assert call["num_inference_steps"] == 4 and default["num_inference_steps"] is None
    assert call["num_frames"] == 130 and default["num_frames"] == 124


def test_cli_reference_short_edge_is_registered(cli_run):
    reference = argparse.Namespace()
    log = cli_run("--reference-short-edge", "200", conditioning={"references": [reference]})
    assert ("register_to_config", {"reference_image_short_edge": 200}) in log
    assert _entries(log, "call")[0][1]["references"] == [reference]
    assert not _entries(cli_run(conditioning={}), "register_to_config")


# -- behaviours the planted-bug round found unguarded -----------------------------------------------------------------


def test_t2va_fl2va_layout_on_a_non_square_canvas_matches_the_hand_built_plan():
    from diffusers_h3.packing import t2va_fl2va_layout

    # 2 latent frames of 6 x 10 latents, patch (1, 2, 2): keyframe grid (1, 3, 5), target grid (2, 3, 5)
    layout = t2va_fl2va_layout(7, 2, 2, 6, 10, 11, (1, 2, 2), 2)
    got = [(s.kind, s.role, s.start, s.stop, s.grid, s.channels) for s in layout.segments]
    layout_order = sorted(got, key=lambda s: s[2])
    expected = [
        ("text", "prompt", 0, 7, None, 1),
        ("video", "keyframe", 7, 22, (1, 3, 5), 1),
        ("video", "keyframe", 22, 37, (1, 3, 5), 1),
        ("audio", "target", 37, 59, None, 2),  # 11 latents x 2 channels
        ("video", "target", 59, 89, (2, 3, 5), 1),
    ]
    normalised = [(k, r, a, b, tuple(g) if g else None, c) for k, r, a, b, g, c in layout_order]
    assert normalised == expected and layout.seq_len == 89


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_per_token_8bit_quantization_rounds_to_nearest_even(dtype):
    from diffusers_h3.kernels.numerics import quantize_fp8_per_token

    qmax = 127.0 if dtype == torch.int8 else 448.0
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    x8, scale = quantize_fp8_per_token(x, dtype=dtype)
    expected_scale = x.abs().amax(-1, keepdim=True) * (1.0 / qmax)
    torch.testing.assert_close(scale, expected_scale.squeeze(-1), atol=0, rtol=0)
    y = (x / expected_scale).clamp(-qmax, qmax)
    if dtype == torch.int8:
        import numpy as np

        expected = torch.from_numpy(np.rint(y.numpy()))  # numpy's rint: nearest, ties to even
        assert torch.equal(x8.float(), expected)
        # exact ties on the scaled grid: the row's amax maps to 127, the others to k + 0.5
        ties = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 3.5]]) * (1.0 / 127.0)
        tied, _ = quantize_fp8_per_token(ties * 127.0 / 127.0, dtype=dtype)
        y_ties = ties / (ties.abs().amax(-1, keepdim=True) * (1.0 / 127.0))
        assert torch.equal(tied.float(), torch.from_numpy(np.rint(y_ties.numpy())))
    else:
        assert torch.equal(x8.float(), y.to(torch.float8_e4m3fn).float())


@pytest.mark.parametrize(
    "modular, root, native_folders, kind",
    [
        (None, {"_class_name": "MiniMaxH3Pipeline"}, False, "ours"),
        (None, {"_class_name": "MiniMaxH3ModularPipeline"}, False, "hub"),
        ({"_blocks_class_name": "MiniMaxH3Blocks"}, None, False, "hub"),
        ({"_class_name": "MiniMaxH3ModularPipeline"}, {"_class_name": "MiniMaxH3ModularPipeline"}, False, "hub"),
        ({"_class_name": "WanModularPipeline"}, None, False, "foreign"),
        (None, {"_class_name": "WanPipeline"}, False, "foreign"),
        (None, {"_class_name": "MiniMaxH3Pipeline", "_minimax_h3": {}}, False, "native"),
        (None, None, True, "native"),
        (None, None, False, "foreign"),
    ],
)
def test_classify_index_kinds(modular, root, native_folders, kind):
    from diffusers_h3.pipelines.loading import classify_index

    assert classify_index(modular, root, native_folders) == kind


def test_pipeline_card_tags_name_the_quantization_of_each_partition(tmp_path):
    from diffusers_h3 import W8A16Config, quantize
    from diffusers_h3._model_card import pipeline_model_card, quantization_method

    pipe = tiny_pipeline(with_transformer_ref=False)
    plain_tags = pipeline_model_card(pipe).data.to_dict()["tags"]
    quantize(pipe.transformer, W8A16Config())
    method = quantization_method(pipe.transformer)
    assert method
    card = pipeline_model_card(pipe, repo_id="me/h3-w8a16")
    path = tmp_path / "README.md"
    card.save(path)
    from huggingface_hub import ModelCard

    tags = ModelCard.load(path).data.to_dict()["tags"]
    assert f"quantized-{method}" in tags and f"quantized-{method}" not in plain_tags
    assert method in card.text


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--reference-short-edge", "200"], "--reference-short-edge without --reference"),
        (["--lora-allow-unmatched"], "--lora-allow-unmatched without --lora"),
        (["--allow-step-recipe-stacking"], "--allow-step-recipe-stacking without --lora"),
        (["--v100", "--vsa", "0.5"], "--v100 installs the FA-V100 attention"),
        (["--v100", "--attention-precision", "fp8"], "--v100 installs the FA-V100 attention"),
        (["--gpus", "0"], "--gpus 0"),
    ],
)
def test_cli_flag_combinations_are_refused_before_loading(flags, expected, capsys, monkeypatch, tmp_path):
    from diffusers_h3 import MiniMaxH3Pipeline, cli

    monkeypatch.setattr(MiniMaxH3Pipeline, "from_pretrained", staticmethod(lambda *a, **k: pytest.fail("loaded")))
    out = tmp_path / "o.mp4"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--prompt", "a cat", "--out", str(out), "--device", "cpu", *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("diffusers-h3: error:") and expected in err[0]
    assert not out.exists()


@pytest.mark.triton_interpreter
def test_int8_dense_attention_quantizes_q_k_to_int8_not_e4m3():
    from diffusers_h3.attention_processors import MiniMaxH3LowPrecisionAttnProcessor
    from diffusers_h3.kernels.attention import fp8_attention

    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 70, 2, 16, generator=g) for _ in range(3))
    oracle = torch.nn.functional.scaled_dot_product_attention(
        q.double().transpose(1, 2), k.double().transpose(1, 2), v.double().transpose(1, 2)
    ).transpose(1, 2)
    int8 = MiniMaxH3LowPrecisionAttnProcessor("int8").core(q, k, v)
    fp8 = MiniMaxH3LowPrecisionAttnProcessor("fp8").core(q, k, v)
    assert torch.equal(int8, fp8_attention(q, k, v, qk_dtype=torch.int8))

    def err(x):
        return ((x.double() - oracle).norm() / oracle.norm()).item()

    assert not torch.equal(int8, fp8) and err(int8) < 0.5 * err(fp8)  # INT8's finer grid: well below E4M3's error


def test_describe_counts_every_attention_module_and_quantized_layer():
    from diffusers_h3 import W8A16Config, describe, enable_vsa, quantize
    from diffusers_h3.quantizers import describe_layer
    from diffusers_h3.testing.tiny import tiny_transformer

    model = tiny_transformer()
    attention_modules = [m for m in model.modules() if hasattr(m, "set_processor") and hasattr(m, "processor")]
    blocks = len(model.transformer_blocks)
    assert sum(describe(model)["model"]["attention"].values()) == len(attention_modules)
    enable_vsa(model, sparsity=0.5)
    attention = describe(model)["model"]["attention"]
    vsa = {path: count for path, count in attention.items() if "VSA" in path}
    assert sum(vsa.values()) == blocks and sum(attention.values()) == len(attention_modules)
    quantize(model, W8A16Config())
    quantized = [m for m in model.modules() if describe_layer(m) is not None]
    assert len(quantized) > 1
    assert sum(describe(model)["model"]["quantized_layers"].values()) == len(quantized)
