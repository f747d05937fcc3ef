"""PDD Acc-LoRAs: tiny files in the published layouts load (backbone through PEFT, head bank onto the heads), every
step mixes the heads its sigma interval spans, the schedule is the published one, unloading restores the base bit for
bit, and broken files are refused in one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from diffusers_h3.layout import LayoutSegment, PackedLayout, use_packed_layout
from diffusers_h3.loaders import pdd

from ._lora_helpers import TinyLoraPipeline, canonical_lora, loaded_delta, save_lora, tiny_transformer, write_layout


NUM_HEADS, BLOCK = 32, 4
TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2", "adaln_proj.linear")
METADATA = {
    "lora_rank": "4",
    "lora_alpha": "8.0",
    "pdd_num_steps": str(NUM_HEADS),
    "pdd_block_size": str(BLOCK),
    "lora_targets": ",".join(TARGETS),
}
FL2VA_FILE = "MiniMax-H3-FL2VA-Acc-8Step.safetensors"


def published_sigmas(shift: float, points: int):
    """The sampling schedule in plain floats: ``linspace(1, 0, points)`` through ``shift * t / (1 + (shift - 1) t)``."""
    ts = [1 - i / (points - 1) for i in range(points)]
    return [shift * t / (1 + (shift - 1) * t) for t in ts]


def alibaba_state_dict(model: nn.Module, rank: int = 4, seed: int = 0):
    """A PDD file in alibaba-pai's layout for ``model``: ``<module>.lora_down`` / ``.lora_up`` on the published targets
    (diffusers names, transformer blocks and token refiner) and the ``[N, out, in]`` / ``[N, out]`` head bank."""
    g = torch.Generator().manual_seed(seed)
    sd, factors = {}, {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or not name.endswith(TARGETS):
            continue
        if not name.startswith(("transformer_blocks.", "token_refiner.refiner_blocks.")):
            continue
        down = torch.randn(rank, module.in_features, generator=g) * 0.3
        up = torch.randn(module.out_features, rank, generator=g) * 0.3
        sd[f"{name}.lora_down"], sd[f"{name}.lora_up"] = down, up
        factors[name] = (down, up)
    for head in ("proj_out", "audio_proj_out"):
        linear = getattr(model, head)
        sd[f"{head}.weight"] = torch.randn(NUM_HEADS, linear.out_features, linear.in_features, generator=g)
        sd[f"{head}.bias"] = torch.randn(NUM_HEADS, linear.out_features, generator=g)
    return sd, factors


def _layout(interval=None, audio_interval=None, step=0):
    return PackedLayout((LayoutSegment("text", "prompt", 0, 1),), 1).at_step(step, 8, interval, audio_interval)


def _snapshot(model: nn.Module):
    """Every parameter and buffer (non-persistent ones included), by name."""
    tensors = {**dict(model.named_parameters()), **{f"buffer:{n}": b for n, b in model.named_buffers()}}
    return {name: (t.detach().clone(), t.dtype, t.device) for name, t in tensors.items()}


def _model_inputs(model: nn.Module, seed: int = 0):
    """Packed inputs for one tiny transformer call (3 text, 2 audio, 4 video rows)."""
    g = torch.Generator().manual_seed(seed)
    config = model.config
    n_text, n_audio, n_video = 3, 2, 4
    seq = n_text + n_audio + n_video
    tags = torch.tensor([1] * n_text + [2] * n_audio + [0] * n_video)  # 0 video, 1 text, 2 audio
    return {
        "hidden_states": torch.randn(1, n_video, model.proj_in.in_features, generator=g),
        "audio_hidden_states": torch.randn(1, n_audio, config.audio_in_channels, generator=g),
        "encoder_hidden_states": torch.randn(1, n_text, config.text_dim, generator=g),
        "timestep": torch.tensor([0.3, 0.6]),
        "timestep_indices": torch.tensor([0] * (n_text + n_audio) + [1] * n_video),
        "text_indices": torch.arange(n_text),
        "audio_indices": torch.arange(n_text, n_text + n_audio),
        "video_indices": torch.arange(n_text + n_audio, seq),
        "token_tags": tags,
        "position_ids": torch.zeros(seq, 3, dtype=torch.long),
        "return_dict": False,
    }


# ---------------------------------------------------------------------------------------------------------------------
# Schedule and mixing math
# ---------------------------------------------------------------------------------------------------------------------
def test_the_trained_schedule_is_the_published_one():
    # 9 sigma points at shift 12 land on every 4th point of the 32-interval grid (the boundaries ComfyUI's `simple`
    # schedule hits); the values as published for the video shift.
    published_video = [1.0, 0.9882352941, 0.9729729730, 0.9523809524, 0.9230769231, 0.8780487805, 0.8, 0.6315789474, 0.0]
    published_audio = [3 * t / (1 + 2 * t) for t in (1, 7 / 8, 6 / 8, 5 / 8, 4 / 8, 3 / 8, 2 / 8, 1 / 8, 0)]
    from diffusers import MiniMaxH3Scheduler

    for shift, published in ((12.0, published_video), (3.0, published_audio)):
        grid = pdd.shifted_grid(NUM_HEADS, shift)
        assert grid[::BLOCK].tolist() == pytest.approx(published, abs=1e-9)
        scheduler = MiniMaxH3Scheduler(shift=shift)
        scheduler.set_timesteps(9)
        assert scheduler.sigmas.double().tolist() == pytest.approx(published, abs=1e-6)

    schedule = pdd.read_schedule(METADATA, "test")
    assert (schedule.forwards, schedule.sigma_points, schedule.flow_shift, schedule.audio_flow_shift) == (8, 9, 12, 3)
    assert schedule.shift_source == "published"
    recorded = pdd.read_schedule({**METADATA, "pdd_shift_video": "10", "pdd_shift_audio": "2.5"}, "test")
    assert (recorded.flow_shift, recorded.audio_flow_shift, recorded.shift_source) == (10.0, 2.5, "metadata")


@pytest.mark.parametrize("shift", [12.0, 3.0])
def test_a_trained_step_mixes_its_block_by_delta_sigma(shift):
    sigmas = published_sigmas(shift, 9)
    fine = published_sigmas(shift, NUM_HEADS + 1)
    for step in range(8):
        weights = pdd.head_weights(sigmas[step], sigmas[step + 1], NUM_HEADS, shift)
        block = range(BLOCK * step, BLOCK * (step + 1))
        span = fine[block[0]] - fine[block[-1] + 1]
        expected = [(fine[k] - fine[k + 1]) / span if k in block else 0.0 for k in range(NUM_HEADS)]
        assert weights.tolist() == pytest.approx(expected, abs=1e-12)


def test_a_step_off_the_grid_weights_the_parts_it_spans():
    shift = 12.0
    fine = published_sigmas(shift, NUM_HEADS + 1)
    middle = (fine[5] + fine[6]) / 2  # half of interval 5
    weights = pdd.head_weights(fine[2], middle, NUM_HEADS, shift)
    parts = {2: fine[2] - fine[3], 3: fine[3] - fine[4], 4: fine[4] - fine[5], 5: fine[5] - middle}
    total = sum(parts.values())
    assert weights.tolist() == pytest.approx([parts.get(k, 0.0) / total for k in range(NUM_HEADS)], abs=1e-12)
    with pytest.raises(ValueError, match="strictly decreasing"):
        pdd.head_weights(0.5, 0.6, NUM_HEADS, shift)


# ---------------------------------------------------------------------------------------------------------------------
# Loading, mixing in the model, unloading
# ---------------------------------------------------------------------------------------------------------------------
def test_load_mixes_the_heads_and_unload_restores_the_base_bitwise(tmp_path):
    model = tiny_transformer(seed=3)
    pipe = TinyLoraPipeline(transformer=model)
    inputs = _model_inputs(model)
    before = _snapshot(model)
    names_before = [n for n, _ in model.named_parameters()]
    video_sigmas, audio_sigmas = published_sigmas(12.0, 9), published_sigmas(3.0, 9)
    step = 2
    interval, audio_interval = (video_sigmas[step], video_sigmas[step + 1]), (audio_sigmas[step], audio_sigmas[step + 1])
    with torch.no_grad(), use_packed_layout(_layout(interval, audio_interval, step)):
        base_out = model(**inputs)

    sd, factors = alibaba_state_dict(model)
    path = save_lora(tmp_path / FL2VA_FILE, sd, METADATA)
    report = pipe.load_lora_weights(path, adapter_name="pdd")

    # what loaded
    assert report.layout.startswith("PDD Acc-LoRA, alibaba-pai")
    assert report.components["transformer"].ranks == {4: len(factors)}
    assert report.alpha_source.startswith("file __metadata__ lora_alpha=8")
    assert "backbone rank 4" in report.pdd and "32 interval heads" in report.pdd and "8 forwards" in report.pdd
    preset = pipe.get_lora_distillation_presets()["pdd"]
    assert (preset.num_inference_steps, preset.flow_shift, preset.audio_flow_shift) == (9, 12.0, 3.0)
    assert preset.tasks == ("t2va", "fl2va")
    for name, (down, up) in factors.items():  # alpha 8 / rank 4 from the metadata
        torch.testing.assert_close(loaded_delta(model, name, "pdd"), up @ down * 2.0)
    assert model.proj_out.weight.shape == (NUM_HEADS * model.proj_out.out_features, model.proj_out.in_features)
    assert model.audio_proj_out.bias.shape == (NUM_HEADS * model.audio_proj_out.out_features,)
    summary = "\n".join(pipe.lora_summary())
    assert "PDD head bank of adapter 'pdd' (backbone rank 4): 32 video heads" in summary and "32 audio heads" in summary

    # the heads of one step: the Δσ-weighted mean of its block, computed here from the file's tensors
    hidden = torch.randn(5, model.proj_out.in_features)
    for head, shift, span in (("proj_out", 12.0, interval), ("audio_proj_out", 3.0, audio_interval)):
        fine = published_sigmas(shift, NUM_HEADS + 1)
        block = range(BLOCK * step, BLOCK * (step + 1))
        total = fine[block[0]] - fine[block[-1] + 1]
        weight = sum((fine[k] - fine[k + 1]) / total * sd[f"{head}.weight"][k].double() for k in block)
        bias = sum((fine[k] - fine[k + 1]) / total * sd[f"{head}.bias"][k].double() for k in block)
        with torch.no_grad(), use_packed_layout(_layout(interval, audio_interval, step)):
            got = getattr(model, head)(hidden)
        torch.testing.assert_close(got.double(), hidden.double() @ weight.T + bias, atol=1e-5, rtol=1e-5)

    with torch.no_grad(), use_packed_layout(_layout(interval, audio_interval, step)):
        pdd_out = model(**inputs)
    assert not torch.allclose(pdd_out[0], base_out[0]) and not torch.allclose(pdd_out[1], base_out[1])
    with torch.no_grad(), pytest.raises(RuntimeError, match="sigma interval"):
        model(**inputs)  # no interval published: refused, never a silent fallback

    pipe.unload_lora_weights()
    after = _snapshot(model)
    assert [n for n, _ in model.named_parameters()] == names_before
    assert after.keys() == before.keys()
    for name, (tensor, dtype, device) in before.items():
        assert after[name][1] == dtype and after[name][2] == device, name
        assert torch.equal(after[name][0], tensor), name
    with torch.no_grad(), use_packed_layout(_layout(interval, audio_interval, step)):
        restored = model(**inputs)
    assert torch.equal(restored[0], base_out[0]) and torch.equal(restored[1], base_out[1])
    assert pipe.lora_summary() == [] and pipe.get_lora_distillation_presets() == {}


def test_adapter_weight_and_delete(tmp_path):
    model = tiny_transformer(seed=4)
    pipe = TinyLoraPipeline(transformer=model)
    sd, _ = alibaba_state_dict(model, seed=1)
    pipe.load_lora_weights(save_lora(tmp_path / FL2VA_FILE, sd, METADATA), adapter_name="pdd")
    hidden = torch.randn(3, model.proj_out.in_features)
    base = hidden @ pipe.transformer.proj_out._diffusers_hook.get_hook(pdd.H3_PDD_HEAD_BANK_HOOK).record.base_weight.T
    base = base + model.proj_out._diffusers_hook.get_hook(pdd.H3_PDD_HEAD_BANK_HOOK).record.base_bias
    layout = _layout((1.0, 0.9882352941176471), (1.0, 3 * 0.875 / (1 + 2 * 0.875)))
    with torch.no_grad(), use_packed_layout(layout):
        full = model.proj_out(hidden)
        pipe.set_adapters("pdd", 0.5)
        half = model.proj_out(hidden)
        pipe.set_adapters("pdd", 0.0)
        off = model.proj_out(hidden)
        pipe.disable_lora()
        disabled = model.proj_out(hidden)
    torch.testing.assert_close(half, base + 0.5 * (full - base))
    torch.testing.assert_close(off, base)
    torch.testing.assert_close(disabled, base)
    pipe.enable_lora()
    pipe.delete_adapters("pdd")
    assert model.proj_out.weight.shape == (model.proj_out.out_features, model.proj_out.in_features)
    assert pdd.head_bank_records(model) == []


def test_comfyui_conversion_loads_the_same(tmp_path):
    model = tiny_transformer(seed=5)
    pipe = TinyLoraPipeline(transformer=model)
    lora = canonical_lora(model, seed=6, skip=("proj_out", "proj_in", "context_embedder", "time_embedder", "norm_out"))
    sd = write_layout(lora, "ai_toolkit")
    g = torch.Generator().manual_seed(7)
    for head, native in (("proj_out", "video_out"), ("audio_proj_out", "audio_out")):
        linear = getattr(model, head)
        sd[f"diffusion_model.final_layer.{native}.set_weight"] = torch.randn(
            NUM_HEADS * linear.out_features, linear.in_features, generator=g
        )
        sd[f"diffusion_model.final_layer.{native}.set_bias"] = torch.randn(NUM_HEADS * linear.out_features, generator=g)
    report = pipe.load_lora_weights(save_lora(tmp_path / "pdd_comfy.safetensors", sd, METADATA), adapter_name="c")
    assert report.layout.startswith("PDD Acc-LoRA, ComfyUI")
    bank = sd["diffusion_model.final_layer.video_out.set_weight"]
    torch.testing.assert_close(model.proj_out.weight, bank)  # head k at rows [k * out, (k + 1) * out)
    assert pipe.get_lora_distillation_presets()["c"].num_inference_steps == 9


# ---------------------------------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------------------------------
def _refused(tmp_path, sd, metadata, match, name=FL2VA_FILE):
    model = tiny_transformer(seed=8)
    pipe = TinyLoraPipeline(transformer=model)
    before = _snapshot(model)
    with pytest.raises(ValueError, match=match) as error:
        pipe.load_lora_weights(save_lora(tmp_path / name, sd, metadata), adapter_name="bad")
    assert "\n" not in str(error.value)
    assert all(not adapters for adapters in pipe.get_list_adapters().values())  # nothing loaded
    assert all(torch.equal(_snapshot(model)[k][0], v[0]) for k, v in before.items())


def test_broken_files_are_refused_in_one_line(tmp_path):
    model = tiny_transformer(seed=8)
    sd, _ = alibaba_state_dict(model)
    partial = {k: v for k, v in sd.items() if k != "audio_proj_out.bias"}
    _refused(tmp_path, partial, METADATA, "partial PDD file: 'audio_proj_out.bias' is missing")
    half = dict(sd)
    half.pop(next(k for k in sd if k.endswith(".lora_up")))
    _refused(tmp_path, half, METADATA, "partial PDD file: .* has lora_down or lora_up but not both")
    _refused(tmp_path, sd, {**METADATA, "pdd_num_steps": "16"}, "is not 16 heads")
    _refused(tmp_path, sd, {k: v for k, v in METADATA.items() if k != "pdd_block_size"}, "records no `pdd_block_size`")
    _refused(tmp_path, sd, {**METADATA, "pdd_block_size": "5"}, "not a whole number of pdd_block_size=5 blocks")
    _refused(tmp_path, {**sd, "extra.thing": torch.zeros(1)}, METADATA, "neither backbone LoRA factors")
    heads_only = {k: v for k, v in sd.items() if "proj_out" in k}
    _refused(tmp_path, heads_only, METADATA, "a head bank but no backbone LoRA")
    wide = dict(sd, **{"proj_out.weight": torch.zeros(NUM_HEADS, 7, model.proj_out.in_features),
                       "proj_out.bias": torch.zeros(NUM_HEADS, 7)})  # fmt: skip
    _refused(tmp_path, wide, METADATA, r"heads of shape \(7, 32\) but `transformer.proj_out` is \(16, 32\)")


def test_hotswap_and_a_second_bank_are_refused(tmp_path):
    model = tiny_transformer(seed=9)
    pipe = TinyLoraPipeline(transformer=model)
    sd, _ = alibaba_state_dict(model)
    path = save_lora(tmp_path / FL2VA_FILE, sd, METADATA)
    pipe.load_lora_weights(path, adapter_name="one")
    with pytest.raises(ValueError, match="hotswap cannot swap a PDD head bank"):
        pipe.load_lora_weights(path, adapter_name="one", hotswap=True)
    with pytest.raises(ValueError, match="already holds the PDD head bank of adapter 'one'"):
        pipe.load_lora_weights(path, adapter_name="two", allow_step_recipe_stacking=True)


# ---------------------------------------------------------------------------------------------------------------------
# Through the pipeline
# ---------------------------------------------------------------------------------------------------------------------
CALL = {"prompt": "a fox in the snow", "height": 32, "width": 64, "num_frames": 22, "output_type": "latent"}


def test_the_pipeline_runs_the_file_schedule_and_mixes_each_steps_block(tmp_path, monkeypatch):
    from diffusers_h3 import describe
    from diffusers_h3.testing.tiny import tiny_pipeline

    pipe = tiny_pipeline(seed=0, with_transformer_ref=False)
    schedule = {"num_inference_steps": 9, "flow_shift": 12.0, "audio_flow_shift": 3.0}

    def run(**kwargs):
        out = pipe(**CALL, **kwargs, generator=torch.Generator().manual_seed(0))
        return out.frames, out.audio

    base = run(**schedule)
    sd, _ = alibaba_state_dict(pipe.transformer, seed=11)
    pipe.load_lora_weights(save_lora(tmp_path / FL2VA_FILE, sd, METADATA), adapter_name="pdd")

    calls = []
    original = pdd.head_weights

    def spy(sigma, next_sigma, num_heads, shift):
        weights = original(sigma, next_sigma, num_heads, shift)
        calls.append((shift, sigma, next_sigma, torch.nonzero(weights).flatten().tolist()))
        return weights

    monkeypatch.setattr(pdd, "head_weights", spy)
    run()  # the schedule comes from the file: 9 sigma points, shifts 12 / 3
    assert len(calls) == 16  # 8 forwards x (video head, audio head)
    for shift in (12.0, 3.0):
        expected = published_sigmas(shift, 9)
        steps = [c for c in calls if c[0] == shift]
        assert [c[1:3] for c in steps] == [pytest.approx((expected[i], expected[i + 1]), abs=1e-6) for i in range(8)]
        assert [c[3] for c in steps] == [list(range(BLOCK * i, BLOCK * (i + 1))) for i in range(8)]

    text = "\n".join(describe(pipe)["pipeline"]["lora"])
    assert "PDD head bank of adapter 'pdd' (backbone rank 4): 32 video heads" in text and "8 forwards of 4 heads" in text

    pipe.unload_lora_weights()
    frames, audio = run(**schedule)
    assert torch.equal(frames, base[0]) and torch.equal(audio, base[1])


def test_pdd_under_the_low_memory_offload_equals_the_plain_pipeline(tmp_path):
    from diffusers_h3.parallel.placement import enable_low_memory_offload
    from diffusers_h3.testing.tiny import tiny_pipeline

    sd, _ = alibaba_state_dict(tiny_transformer(seed=1), seed=12)
    path = save_lora(tmp_path / FL2VA_FILE, sd, METADATA)

    def run(pipe):
        out = pipe(**CALL, generator=torch.Generator().manual_seed(0))
        return out.frames, out.audio

    plain = tiny_pipeline(seed=2, with_transformer_ref=False)
    base = run(plain)
    plain.load_lora_weights(path, adapter_name="pdd")
    expected = run(plain)
    offloaded = tiny_pipeline(seed=2, with_transformer_ref=False)
    enable_low_memory_offload(offloaded, "cpu")
    offloaded.load_lora_weights(path, adapter_name="pdd")
    got = run(offloaded)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    offloaded.unload_lora_weights()
    restored = run(offloaded)
    assert torch.equal(restored[0], base[0]) and torch.equal(restored[1], base[1])


def test_a_head_with_hooks_the_bank_would_bypass_is_refused(tmp_path):
    from diffusers.hooks import HookRegistry, ModelHook

    model = tiny_transformer(seed=8)
    pipe = TinyLoraPipeline(transformer=model)
    HookRegistry.check_if_exists_or_initialize(model.audio_proj_out).register_hook(ModelHook(), "gather_output")
    sd, _ = alibaba_state_dict(tiny_transformer(seed=8))
    with pytest.raises(ValueError, match=r"`transformer.audio_proj_out` carries \['gather_output'\], which the head "
                                         "bank's forward would bypass"):  # fmt: skip
        pipe.load_lora_weights(save_lora(tmp_path / FL2VA_FILE, sd, METADATA), adapter_name="pdd")
    assert pipe.get_list_adapters() in ({}, {"transformer": []})


def test_cli_generate_with_a_pdd_file(tmp_path, monkeypatch, capsys):
    from diffusers_h3.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    sd, _ = alibaba_state_dict(tiny_transformer(seed=1), seed=13)
    path = save_lora(tmp_path / FL2VA_FILE, sd, METADATA)
    calls = []
    original = pdd.head_weights
    monkeypatch.setattr(pdd, "head_weights", lambda *a: calls.append(a) or original(*a))
    out = tmp_path / "pdd.mp4"
    assert main(["generate", "--prompt", "a cat", "--out", str(out), "--device", "cpu", "--lora", path]) == 0
    assert out.is_file()
    printed = capsys.readouterr()
    assert "PDD Acc-LoRA, alibaba-pai" in printed.err and "backbone rank 4" in printed.err
    assert "8 forwards of 4 heads (9 sigma points), shifts 12 / 3" in printed.err  # the load report
    assert len(calls) == 16  # the file's schedule: 8 forwards, each mixing its video and its audio heads
