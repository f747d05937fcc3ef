"""FastH3 stacks: the contract and its schedule, `.diff` / `.set_weight` payloads, the trained gates, the light VAE's
exported NVFP4 decoder, and a whole stack loaded with `from_pretrained` and run on the tiny pipeline.

Every file is written here in the published layouts (docs/checkpoints.md, "FastH3 stacks"), with the tiny model's
module names."""

from __future__ import annotations

import json
import logging
import re
import shutil

import pytest
import torch
from diffusers import AutoencoderKLMiniMaxH3, MiniMaxH3Transformer3DModel
from safetensors.torch import save_file

from diffusers_h3 import MiniMaxH3Pipeline, describe
from diffusers_h3.attention_processors import add_gate_compress, enable_vsa, vsa_state
from diffusers_h3.kernels.gemm import nvfp4_dequantize, nvfp4_quantize
from diffusers_h3.loaders.fasth3 import (
    CONTRACT_FILE,
    KNOWN_FASTH3_PRESETS,
    apply_fasth3_payload,
    preset_from_contract,
    read_contract,
    split_fasth3_state_dict,
)
from diffusers_h3.loaders.fasth3_vae import (
    DECODER_BLOCK_LINEAR,
    load_nvfp4_decoder,
)
from diffusers_h3.pipelines.fasth3 import (
    disable_fasth3_preset,
    enable_fasth3_preset,
    fasth3_report,
    load_fasth3_adapter,
)
from diffusers_h3.quantizers import NVFP4Tensor
from diffusers_h3.quantizers.layers import quantize_linear_
from diffusers_h3.quantizers.registry import weight_class_for
from diffusers_h3.testing.fasth3 import (
    EIGHT_STEP_V2_CONTRACT,
    FOUR_STEP_CONTRACT,
    nvfp4_decoder_export,
    write_fasth3_stack,
)
from diffusers_h3.testing.tiny import (
    TINY_DURATION_LIMITS,
    TINY_NUM_FRAMES,
    TINY_VAE_CONFIG,
    tiny_components,
    tiny_pipeline,
    tiny_transformer,
    tiny_transformer_inputs,
    tiny_vae,
)


FOUR_STEP = FOUR_STEP_CONTRACT
SHIFTS = {"video": 12.0, "audio": 3.0}
CALL = {"prompt": "a cat", "height": 64, "width": 96, "num_frames": TINY_NUM_FRAMES, "output_type": "latent"}


# ---- contract and schedule ------------------------------------------------------------------------------------------
def test_contract_gives_the_trained_sigmas():
    preset = preset_from_contract(FOUR_STEP, SHIFTS)
    assert (preset.rungs, preset.vsa_sparsity, preset.sigma_points) == ((999, 749, 500, 250), 0.9, 5)
    video, audio = preset.sigmas()
    for sigmas, shift in ((video, 12.0), (audio, 3.0)):
        base = torch.tensor([0.999, 0.749, 0.5, 0.25, 0.0], dtype=torch.float32)
        assert sigmas == (shift * base / (1 + (shift - 1) * base)).tolist()
    assert video[0] < 1.0 and video[-1] == 0.0  # rung 999, not the uniform grid's 1.0
    assert preset == KNOWN_FASTH3_PRESETS["fasth3-4step-preview-vsa"].replace(
        name=preset.name, source=preset.source
    )


@pytest.mark.parametrize(
    "change, message",
    [
        ({"schema_version": "v0"}, "schema_version must be"),
        ({"transformer_forwards": 8}, "4 rungs need transformer_forwards=4"),
        ({"dmd_denoising_steps": [999, 999, 500, 250]}, "strictly decreasing"),
        ({"video_scheduler_shift": 10.0}, "video_scheduler_shift=10 disagrees with scheduler/scheduler_config.json shift=12"),
        ({"vsa_tile_size": 128}, "vsa_tile_size=128"),
        ({"vsa_sparsity": 1.0}, "vsa_sparsity must be in [0, 1)"),
        ({"pdd_steps": 32}, "PDD student"),
    ],
)
def test_contract_refusals(change, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        preset_from_contract({**FOUR_STEP, **change}, SHIFTS)


def test_v2_sidecar_gives_shift_10_and_the_explicit_eight_rung_ladder():
    preset = preset_from_contract(EIGHT_STEP_V2_CONTRACT, {"video": 10.0, "audio": 3.0})
    assert (preset.forwards, preset.sigma_points, preset.flow_shift, preset.vsa_sparsity) == (8, 9, 10.0, 0.8)
    video, audio = preset.sigmas()
    ladder = [0.999, 0.874, 0.749, 0.624, 0.5, 0.375, 0.25, 0.125, 0.0]  # the rungs / 1000, by hand
    for sigmas, shift in ((video, 10.0), (audio, 3.0)):
        assert sigmas == pytest.approx([shift * x / (1 + (shift - 1) * x) for x in ladder], abs=2e-7)  # float32
    assert video[0] < 1.0 and video[4] == pytest.approx(10 / 11)  # rung 500 at shift 10: 5 / 5.5
    assert preset == KNOWN_FASTH3_PRESETS["fasth3-8step-v2"].replace(name=preset.name, source=preset.source)
    # the sidecar alone is enough when the schedulers carry no shift; a base H3 scheduler (12) contradicts it
    assert preset_from_contract(EIGHT_STEP_V2_CONTRACT, {}).flow_shift == 10.0
    with pytest.raises(ValueError, match="video_scheduler_shift=10 disagrees"):
        preset_from_contract(EIGHT_STEP_V2_CONTRACT, {"video": 12.0, "audio": 3.0})


@pytest.mark.parametrize(
    "change, message",
    [
        ({"transformer_forwards": 8.0}, "transformer_forwards must be an integer"),
        ({"num_inference_steps": True}, "num_inference_steps must be an integer"),
        ({"schema": "fasth3-inference-contract-v2"}, "disagrees with schema_version"),
        ({"transformer_component": "transformer_ref"}, "transformer_component='transformer_ref'"),
        ({"attention_backend": "FLASH_ATTN"}, "vsa_sparsity is set but attention_backend is 'FLASH_ATTN'"),
        ({"dmd_denoising_steps": [999, 874, 749, 624, 500, 375, 250]}, "7 rungs need transformer_forwards=7"),
        ({"dmd_denoising_steps": [999.0, 874, 749, 624, 500, 375, 250, 125]}, "strictly decreasing integers"),
        ({"audio_scheduler_shift": 0}, "audio_scheduler_shift must be a positive finite number"),
    ],
)
def test_v2_sidecar_fields_are_checked_strictly(change, message):
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        preset_from_contract({**EIGHT_STEP_V2_CONTRACT, **change}, {"video": 10.0, "audio": 3.0})
    assert "\n" not in str(error.value)


def test_dense_student_contract_has_no_vsa():
    dense = {**FOUR_STEP, "attention_backend": "FLASH_ATTN"}
    del dense["vsa_sparsity"], dense["vsa_tile_size"]
    assert preset_from_contract(dense, SHIFTS).vsa_sparsity is None


# ---- payloads -------------------------------------------------------------------------------------------------------
def _payload(model, seed=1, prefix=""):
    """A FastH3 payload for `model` in the published key names: deltas, a bias delta, gates set per block."""
    gen = torch.Generator().manual_seed(seed)
    blocks = model.transformer_blocks
    payload = {
        f"{prefix}proj_in.diff": torch.randn(model.proj_in.weight.shape, generator=gen) * 0.1,
        f"{prefix}proj_in.diff_b": torch.randn(model.proj_in.bias.shape, generator=gen) * 0.1,
        f"{prefix}transformer_blocks.0.attn.to_q.diff": torch.randn(blocks[0].attn.to_q.weight.shape, generator=gen) * 0.1,
        f"{prefix}transformer_blocks.1.attn.norm_q.diff": torch.randn(blocks[1].attn.norm_q.weight.shape, generator=gen),
    }
    gate_shape = (blocks[0].attn.heads * blocks[0].attn.head_dim, model.proj_in.out_features)
    for i in range(len(blocks)):
        payload[f"{prefix}transformer_blocks.{i}.attn.to_gate_compress.set_weight"] = torch.randn(gate_shape, generator=gen)
    return payload


def test_payload_equals_the_manually_patched_weights():
    torch.manual_seed(0)
    model, reference = tiny_transformer(), tiny_transformer()
    reference.load_state_dict(model.state_dict())
    raw = _payload(model, prefix="diffusion_model.")
    payload, rest = split_fasth3_state_dict({**raw, "transformer_blocks.0.attn.to_q.lora_A.weight": torch.ones(2, 32)})
    assert list(rest) == ["transformer_blocks.0.attn.to_q.lora_A.weight"]  # LoRA factors are not payload
    report = apply_fasth3_payload(model, payload)
    assert (report.added, report.replaced, report.gates_created) == (4, 2, (0, 1))

    gates = {}
    with torch.no_grad():  # the same patch written out by hand
        for key, tensor in raw.items():
            name = key.removeprefix("diffusion_model.")
            if name.endswith(".set_weight"):
                gates[name.replace(".set_weight", ".weight")] = tensor
            else:
                param = reference.get_parameter(name.replace(".diff_b", ".bias").replace(".diff", ".weight"))
                param.copy_((param.float() + tensor.float()).to(param.dtype))
    add_gate_compress(reference, gates)
    patched, expected = model.state_dict(), reference.state_dict()
    assert patched.keys() == expected.keys() and all(torch.equal(patched[k], expected[k]) for k in expected)


def test_payload_strength_scales_deltas_and_new_gates():
    model = tiny_transformer()
    base = model.proj_in.weight.detach().clone()
    raw = _payload(model)
    apply_fasth3_payload(model, split_fasth3_state_dict(raw)[0], strength=0.5)
    assert torch.equal(model.proj_in.weight, (base + raw["proj_in.diff"] * 0.5).to(base.dtype))
    gate = model.transformer_blocks[1].attn.to_gate_compress.weight
    assert torch.equal(gate, raw["transformer_blocks.1.attn.to_gate_compress.set_weight"] * 0.5)


@pytest.mark.parametrize("strength", [0.0, 0.5, 1.5])
def test_set_weight_at_a_strength_moves_the_base_weight_towards_the_set_one(strength):
    """`.set_weight` on a weight the DiT already has (not a gate created at zero, where both readings agree):
    strength s writes base + s·(w − base), so 0 keeps the base and 1 gives w, not s·w."""
    model = tiny_transformer()
    target = model.transformer_blocks[0].attn.to_k
    base = target.weight.detach().double().clone()
    assert base.abs().max() > 0.01  # a real base: s·w and the interpolation differ
    w = torch.randn(target.weight.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    payload, _ = split_fasth3_state_dict({"transformer_blocks.0.attn.to_k.set_weight": w.float()})
    report = apply_fasth3_payload(model, payload, strength=strength)
    assert (report.replaced, report.gates_created) == (1, ())
    expected = base + strength * (w.float().double() - base)
    got = target.weight.detach().double()
    assert torch.allclose(got, expected, rtol=0, atol=1e-5), (got - expected).abs().max()
    assert not torch.allclose(got, strength * w.float().double(), rtol=0, atol=1e-3)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda raw: raw.update({"proj_in.diff": torch.zeros(3, 3)}), r"proj_in.diff has shape \(3, 3\)"),
        (lambda raw: raw.update({"transformer_blocks.7.attn.to_q.diff": torch.zeros(64, 32)}), "names no parameter"),
        (lambda raw: raw["proj_in.diff_b"].fill_(float("nan")), "NaN or Inf"),
    ],
)
def test_mismatched_payload_is_refused_and_changes_nothing(corrupt, message):
    model = tiny_transformer()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    raw = _payload(model)
    corrupt(raw)
    with pytest.raises(ValueError, match=f"FastH3 payload does not fit this DiT: 1 of .*{message}") as error:
        apply_fasth3_payload(model, split_fasth3_state_dict(raw)[0])
    assert "\n" not in str(error.value)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)  # no gate added


def test_payload_for_a_wider_base_is_refused():
    """A payload made for another DiT (here: wider blocks) fails on its shapes before anything changes."""
    other = tiny_transformer(attention_head_dim=16, hidden_size=48, ffn_dim=96)
    with pytest.raises(ValueError, match="it was made for another base"):
        apply_fasth3_payload(tiny_transformer(), split_fasth3_state_dict(_payload(other))[0])


def test_payload_gates_reach_the_vsa_processor():
    """The gates a payload sets are the ones the VSA processor adds the coarse branch through."""
    from diffusers_h3.layout import use_packed_layout
    from diffusers_h3.packing import build_layout

    torch.manual_seed(0)
    model, by_hand, zero = tiny_transformer(), tiny_transformer(), tiny_transformer()
    by_hand.load_state_dict(model.state_dict())
    zero.load_state_dict(model.state_dict())
    raw = {k: v for k, v in _payload(model).items() if k.endswith(".set_weight")}
    apply_fasth3_payload(model, split_fasth3_state_dict(raw)[0])
    add_gate_compress(by_hand, {k.replace(".set_weight", ".weight"): v for k, v in raw.items()})
    add_gate_compress(zero)  # zero gates: pure sparse
    inputs = tiny_transformer_inputs(seed=2, grid=(4, 8, 8))
    outs = []
    for m in (model, by_hand, zero):
        enable_vsa(m, sparsity=0.75)
        with torch.no_grad(), use_packed_layout(build_layout(5, [], 4, (4, 8, 8), 1)):
            outs.append(m(**inputs, return_dict=False)[0])
    assert vsa_state(model)["gated_blocks"] == 2
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


# ---- preset on the pipeline -----------------------------------------------------------------------------------------
def _forward_count(pipe):
    calls = []
    handle = pipe.transformer.register_forward_pre_hook(lambda *a: calls.append(1))
    return calls, handle


def test_preset_runs_the_trained_schedule(caplog):
    pipe = tiny_pipeline(seed=1, with_transformer_ref=False)
    preset = KNOWN_FASTH3_PRESETS["fasth3-4step-preview-vsa"]
    with pytest.raises(ValueError, match="0 of 2 blocks have one"):
        enable_fasth3_preset(pipe, preset)  # no trained gates
    add_gate_compress(pipe.transformer)
    enable_fasth3_preset(pipe, preset)
    assert vsa_state(pipe.transformer)["sparsity"] == 0.9 and vsa_state(pipe.transformer)["precision"] == "bf16"
    calls, handle = _forward_count(pipe)
    pipe(**CALL, generator=torch.Generator().manual_seed(0))
    video, audio = preset.sigmas()
    assert len(calls) == 4
    assert pipe.scheduler.sigmas.tolist() == video and pipe.audio_scheduler.sigmas.tolist() == audio
    assert describe(pipe)["fasth3"]["preset"].startswith("fasth3-4step-preview-vsa: 4 forwards")

    calls.clear()
    with caplog.at_level(logging.WARNING):
        pipe(**CALL, num_inference_steps=3, generator=torch.Generator().manual_seed(0))
    handle.remove()
    assert len(calls) == 2 and "num_inference_steps=3 (trained: 5)" in caplog.text
    assert pipe.scheduler.sigmas[0] == 1.0  # the call's own grid (uniform, shift 12)
    # describe() reports what runs, also after the attention changed under the preset
    enable_vsa(pipe.transformer, sparsity=0.9, precision="int8")
    assert describe(pipe)["fasth3"]["attention"].startswith("VSA sparsity=0.9 int8 (changed after the preset")
    # the 8-step V2 preset sets its shifts on the schedulers; removing the preset gives the pipeline's back
    enable_fasth3_preset(pipe, "fasth3-8step-v2")
    assert (pipe.scheduler.config.shift, pipe.audio_scheduler.config.shift) == (10.0, 3.0)
    disable_fasth3_preset(pipe)
    assert (pipe.scheduler.config.shift, pipe.audio_scheduler.config.shift) == (12.0, 3.0) and "fasth3" not in describe(pipe)


# ---- light VAE ------------------------------------------------------------------------------------------------------
def _vae(layers, seed=0):
    """The tiny VAE with `layers` decoder blocks."""
    torch.manual_seed(seed)
    reference = tiny_vae().config
    return AutoencoderKLMiniMaxH3(**{**TINY_VAE_CONFIG, "decoder_num_layers": layers},
                                  latents_mean=reference.latents_mean, latents_std=reference.latents_std).eval()


def _export(teacher, student_layers=3):
    return nvfp4_decoder_export(teacher, student_layers, seed=5)


def _latents(seed=0):
    return torch.randn(1, TINY_VAE_CONFIG["latent_channels"], 7, 4, 6, generator=torch.Generator().manual_seed(seed))


def test_light_vae_decode_matches_dense_within_nvfp4(tmp_path):
    teacher = _vae(6)
    export = _export(teacher)
    torch.save(export, tmp_path / "decoder.pt")
    light = _vae(6)
    light.load_state_dict(teacher.state_dict())
    record = load_nvfp4_decoder(light, tmp_path / "decoder.pt")
    assert record.blocks_kept == (0, 2, 5) and record.nvfp4_linears == 18
    assert light.config.decoder_num_layers == 3 and len(light.decoder.transformer_blocks) == 3
    assert sum(isinstance(getattr(m, "weight", None), NVFP4Tensor) for m in light.modules()) == 18

    # The dense reference: the same student with each linear's weight = NVFP4 dequantization of its bf16 master.
    dense, exact = _vae(3), _vae(3)
    for model in (dense, exact):
        model.decoder.load_state_dict({k: v.float() for k, v in export["decoder"].items() if "input_amax" not in k},
                                      strict=True)  # fmt: skip
        model.post_quant_conv.load_state_dict(export["post_quant_conv"])
        model.load_state_dict({**light.state_dict(), **{k: v for k, v in model.state_dict().items()
                                                        if "decoder." in k or "post_quant_conv" in k}},
                              strict=False)  # fmt: skip
    with torch.no_grad():
        for name, module in dense.decoder.named_modules():
            if DECODER_BLOCK_LINEAR.match(name):
                module.weight.copy_(nvfp4_dequantize(*nvfp4_quantize(module.weight)))
        out = light.decode(_latents(), return_dict=False)[0]
        ref = dense.decode(_latents(), return_dict=False)[0]
        unquantized = exact.decode(_latents(), return_dict=False)[0]
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    rel = ((out - unquantized).norm() / unquantized.norm()).item()
    assert 0 < rel < 0.2  # NVFP4's own error against the bf16 masters: present, bounded


def test_light_vae_w4a4_option_runs_the_w4a4_layers():
    teacher = _vae(6)
    light = _vae(6)
    light.load_state_dict(teacher.state_dict())
    record = load_nvfp4_decoder(light, _export(teacher), activation="nvfp4")
    layers = [m for m in light.modules() if isinstance(getattr(m, "weight", None), NVFP4Tensor)]
    assert len(layers) == 18 and all(m.weight.options["activation"] == "nvfp4" for m in layers)
    assert record.describe()["nvfp4_linears"].startswith("18 decoder block linears, W4A4 NVFP4")
    with torch.no_grad():
        assert torch.isfinite(light.decode(_latents(), return_dict=False)[0]).all()


@pytest.mark.parametrize(
    "export_change, message",
    [
        (lambda e: e["metadata"].update(student_layers=8), "needs 8 decoder blocks, this VAE has 6"),
        (lambda e: e["metadata"].update(rotation_group=64), "Hadamard-rotated"),
        (lambda e: e.update(format="fastvideo_h3_decoder_nvfp4_packed_v1"), "pre-packed NVFP4 decoder"),
        (lambda e: e["decoder"].pop("transformer_blocks.1.ff.net.2.weight"), "missing transformer_blocks.1.ff.net.2.weight"),
        (lambda e: e["metadata"].update(num_linears=24), "24 NVFP4 linears in the export, 18 in this VAE"),
    ],
)
def test_light_vae_refusals_leave_the_vae_alone(tmp_path, export_change, message):
    teacher = _vae(6)
    export = _export(teacher)
    export_change(export)
    torch.save(export, tmp_path / "decoder.pt")
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        load_nvfp4_decoder(teacher, tmp_path / "decoder.pt")
    after = teacher.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


# ---- a whole stack --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A FastH3 stack in the published layout: the hub layout + gates in transformer/ + fastvideo_inference.json, a
    6-block light VAE with vae/decoder.pt (3-block student)."""
    components = tiny_components(seed=4, with_transformer_ref=False)
    components["vae"] = _vae(6, seed=3)
    root = write_fasth3_stack(tmp_path_factory.mktemp("fasth3_stack"), components, decoder_student_layers=3)
    gates = {i: b.attn.to_gate_compress.weight.clone() for i, b in enumerate(components["transformer"].transformer_blocks)}
    return root, gates


def test_stack_loads_with_gates_preset_and_light_vae_and_runs(stack):
    root, gates = stack
    assert read_contract(root).vsa_sparsity == 0.9
    pipe = MiniMaxH3Pipeline.from_pretrained(root, **TINY_DURATION_LIMITS)
    blocks = pipe.transformer.transformer_blocks
    assert all(torch.equal(blocks[i].attn.to_gate_compress.weight, w) for i, w in gates.items())
    assert vsa_state(pipe.transformer)["gated_blocks"] == 2 and vsa_state(pipe.transformer)["sparsity"] == 0.9
    report = fasth3_report(pipe)
    assert report["gates"] == "2 of 2 blocks (trained to_gate_compress)"
    assert report["light_vae"]["decoder_blocks"] == "3 of 6 (kept [0, 2, 5])"
    calls, handle = _forward_count(pipe)
    out = pipe(**{**CALL, "output_type": "pt"}, generator=torch.Generator().manual_seed(0))
    handle.remove()
    assert len(calls) == 4 and out.frames.shape[:3] == (1, TINY_NUM_FRAMES, 3) and torch.isfinite(out.frames).all()
    assert pipe.scheduler.sigmas.tolist() == KNOWN_FASTH3_PRESETS["fasth3-4step-preview-vsa"].sigmas()[0]


def test_v2_stack_runs_eight_forwards_on_its_sidecar_schedule(tmp_path):
    components = tiny_components(seed=4, with_transformer_ref=False)
    root = write_fasth3_stack(tmp_path / "v2", components, contract=EIGHT_STEP_V2_CONTRACT)
    assert json.loads((root / "scheduler" / "scheduler_config.json").read_text())["shift"] == 10.0
    pipe = MiniMaxH3Pipeline.from_pretrained(root, **TINY_DURATION_LIMITS)
    assert (pipe.scheduler.config.shift, pipe.audio_scheduler.config.shift) == (10.0, 3.0)
    assert vsa_state(pipe.transformer)["sparsity"] == 0.8
    calls, handle = _forward_count(pipe)
    pipe(**CALL, generator=torch.Generator().manual_seed(0))
    handle.remove()
    video, audio = KNOWN_FASTH3_PRESETS["fasth3-8step-v2"].sigmas()
    assert len(calls) == 8
    assert pipe.scheduler.sigmas.tolist() == video and pipe.audio_scheduler.sigmas.tolist() == audio


def test_stack_loaded_quantized_gets_gates_in_the_dit_format(stack):
    """A stack loaded with its DiT quantized while loading (what fits one 80 GB card) gets its trained gates in the
    same format, one block at a time: the codes of quantizing the file's gates, and the stack still runs."""
    from diffusers.quantizers import PipelineQuantizationConfig

    from diffusers_h3.quantizers import FP8Config, is_quantized_linear

    root, gates = stack
    config = PipelineQuantizationConfig(quant_mapping={"transformer": FP8Config()})
    pipe = MiniMaxH3Pipeline.from_pretrained(root, quantization_config=config, **TINY_DURATION_LIMITS)
    blocks = pipe.transformer.transformer_blocks
    assert all(is_quantized_linear(b.attn.to_q) and is_quantized_linear(b.attn.to_gate_compress) for b in blocks)
    for i, weight in gates.items():
        expected = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        expected.weight.data.copy_(weight)
        quantize_linear_(expected, weight_class_for(FP8Config()), None)
        got = blocks[i].attn.to_gate_compress.weight.storage()
        assert all(torch.equal(got[k], v) for k, v in expected.weight.storage().items())
    assert vsa_state(pipe.transformer)["gated_blocks"] == 2
    out = pipe(**CALL, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(out.frames).all()


def test_stack_without_gates_is_refused_before_the_preset(stack, tmp_path):
    root, _ = stack
    copy = tmp_path / "stack"
    shutil.copytree(root, copy)
    MiniMaxH3Transformer3DModel.from_pretrained(root / "transformer").save_pretrained(copy / "transformer")  # no gates
    with pytest.raises(ValueError, match=r"gates \(to_gate_compress.weight\) for 0 of 2 blocks, none for blocks 0-1: "):
        MiniMaxH3Pipeline.from_pretrained(copy)


@pytest.mark.parametrize("with_bias", [False, True], ids=["weights", "weights-and-biases"])
def test_stack_with_gates_for_only_some_blocks_is_refused_naming_them(stack, tmp_path, with_bias):
    """A VSA stack needs a trained gate in every block: one with gates for block 0 only is refused, naming block 1,
    however many tensors each gate has."""
    root, gates = stack
    copy = tmp_path / "stack"
    shutil.copytree(root, copy)
    dit = MiniMaxH3Transformer3DModel.from_pretrained(root / "transformer")  # the class drops the gates
    partial = {"transformer_blocks.0.attn.to_gate_compress.weight": gates[0]}
    if with_bias:  # two tensors for one block: as many as the stack has blocks
        partial["transformer_blocks.0.attn.to_gate_compress.bias"] = torch.ones(gates[0].shape[0])
    assert add_gate_compress(dit, partial) == (0,)
    dit.save_pretrained(copy / "transformer")
    with pytest.raises(ValueError, match=r"for 1 of 2 blocks, none for block 1: a VSA-distilled FastH3 DiT carries "
                                         r"one per block"):  # fmt: skip
        MiniMaxH3Pipeline.from_pretrained(copy)


def test_nvfp4_decoder_argument_needs_a_stack(stack, tmp_path):
    root, _ = stack
    shutil.copytree(root, tmp_path / "h3", ignore=shutil.ignore_patterns(CONTRACT_FILE))
    with pytest.raises(ValueError, match="nvfp4_decoder= is for FastH3 stacks"):
        MiniMaxH3Pipeline.from_pretrained(tmp_path / "h3", nvfp4_decoder="decoder.pt")


def test_adapter_loads_lora_payload_and_preset(tmp_path):
    pipe = tiny_pipeline(seed=2, with_transformer_ref=False)
    model = pipe.transformer
    state = _payload(model)
    attn = model.transformer_blocks[0].attn
    lora_a, lora_b = torch.randn(4, attn.to_k.in_features) * 0.1, torch.randn(attn.to_k.out_features, 4) * 0.1
    state["transformer_blocks.0.attn.to_k.lora_A.weight"] = lora_a
    state["transformer_blocks.0.attn.to_k.lora_B.weight"] = lora_b
    folder = tmp_path / "vsa-datafree"  # the published adapter repo's folder for the VSA variant
    folder.mkdir()
    save_file(state, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"lora_alpha": 4, "r": 4}))
    base_k = attn.to_k.weight.detach().clone()
    x = torch.randn(3, attn.to_k.in_features)

    report = load_fasth3_adapter(pipe, folder / "adapter_model.safetensors")
    assert report.num_matched_modules == 1
    with torch.no_grad():
        assert torch.allclose(attn.to_k(x), x @ (base_k + lora_b @ lora_a).T, atol=1e-5)
    assert torch.equal(attn.to_gate_compress.weight, state["transformer_blocks.0.attn.to_gate_compress.set_weight"])
    info = fasth3_report(pipe)
    assert info["preset"].startswith("fasth3-4step-preview-vsa") and "adapter folder 'vsa-datafree'" in info["preset"]
    assert "4 deltas added, 2 tensors set, 2 gates created" in info["payload"]
    assert vsa_state(model)["sparsity"] == 0.9


def test_adapter_with_a_wrong_payload_loads_nothing(tmp_path):
    pipe = tiny_pipeline(seed=2, with_transformer_ref=False)
    state = _payload(pipe.transformer)
    state["proj_in.diff"] = torch.zeros(2, 2)
    state["transformer_blocks.0.attn.to_k.lora_A.weight"] = torch.randn(4, 32)
    state["transformer_blocks.0.attn.to_k.lora_B.weight"] = torch.randn(64, 4)
    with pytest.raises(ValueError, match="FastH3 payload does not fit"):
        load_fasth3_adapter(pipe, state, preset="fasth3-4step-preview-vsa")
    assert not getattr(pipe.transformer, "peft_config", None) and fasth3_report(pipe) is None


# ---- NVFP4 text encoder ---------------------------------------------------------------------------------------------
def _nvfp4_sized_text_encoder(layers=2):
    """A Qwen3-VL conditioner whose language projections fit the serialized layout (out % 128, in % 64)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen3VLConfig(
        text_config={"vocab_size": 261, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": layers,
                     "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 5e5, "mrope_section": [12, 10, 10],
                                         "mrope_interleaved": True}},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "patch_size": 16,
                       "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 128,
                       "num_position_embeddings": 64, "deepstack_visual_indexes": [0]},
    )  # fmt: skip
    return Qwen3VLForConditionalGeneration(config).eval()


def test_unswizzle_follows_flashinfer_128x4_order():
    """Element (r, c) of the row-major scales sits at ((r // 128 * C/4 + c // 4) * 32 + r % 32) * 16 +
    (r % 128) // 32 * 4 + c % 4 in the swizzled buffer (FlashInfer's layout_128x4)."""
    from diffusers_h3.loaders.fasth3_text_encoder import unswizzle_128x4

    rows, cols = 256, 8
    buffer = torch.arange(rows * cols)
    out = unswizzle_128x4(buffer, rows, cols)
    for r, c in [(0, 0), (1, 0), (31, 3), (32, 0), (127, 7), (128, 4), (255, 5)]:
        index = ((r // 128 * (cols // 4) + c // 4) * 32 + r % 32) * 16 + (r % 128) // 32 * 4 + c % 4
        assert out[r, c] == index


def test_nvfp4_text_encoder_loads_within_its_dequantization(tmp_path):
    from diffusers_h3.loaders.fasth3_text_encoder import load_nvfp4_text_encoder
    from diffusers_h3.testing.fasth3 import write_nvfp4_text_encoder

    dense = _nvfp4_sized_text_encoder()
    write_nvfp4_text_encoder(dense, tmp_path / "text_encoder", keep_bf16=("mlp.down_proj",))
    loaded = load_nvfp4_text_encoder(tmp_path / "text_encoder", dtype=torch.float32)
    layers = {n: m for n, m in loaded.named_modules() if isinstance(getattr(m, "weight", None), NVFP4Tensor)}
    assert len(layers) == 2 * 6 and not any(n.endswith("down_proj") or "visual" in n for n in layers)
    assert loaded.config.quantization_config.modules_to_not_convert == ["visual", "lm_head", "mlp.down_proj"]
    reference = _nvfp4_sized_text_encoder()
    reference.load_state_dict(dense.state_dict())
    with torch.no_grad():
        for name, layer in layers.items():
            expected = nvfp4_dequantize(*nvfp4_quantize(dense.get_submodule(name).weight))
            assert torch.allclose(layer.weight.dequantize(torch.float32), expected, rtol=1e-6, atol=0)
            reference.get_submodule(name).weight.copy_(expected)
        ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
        out = loaded(input_ids=ids, output_hidden_states=True).hidden_states[-1]
        ref = reference(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4)

    # It saves in this package's NVFP4 format and reloads through transformers bit for bit.
    loaded.save_pretrained(tmp_path / "saved")
    again = type(loaded).from_pretrained(tmp_path / "saved")
    for name, layer in layers.items():
        other = again.get_submodule(name)
        assert isinstance(getattr(other, "weight", None), NVFP4Tensor)
        packed, packed_again = layer.weight.storage(), other.weight.storage()
        assert all(torch.equal(packed_again[b].reshape(-1).view(torch.uint8), packed[b].reshape(-1).view(torch.uint8))
                   for b in packed)


def test_nvfp4_text_encoder_refusals(tmp_path):
    from diffusers_h3.loaders.fasth3_text_encoder import load_nvfp4_text_encoder
    from diffusers_h3.testing.fasth3 import write_nvfp4_text_encoder

    folder = write_nvfp4_text_encoder(_nvfp4_sized_text_encoder(layers=1), tmp_path / "te")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["scale_layout"] = "8x4"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="scale_layout='8x4', only '128x4' is read"):
        load_nvfp4_text_encoder(folder)
    config["quantization_config"]["scale_layout"] = "128x4"
    (folder / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.language_model.layers.0.mlp.up_proj.weight_global_scale"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"mlp.up_proj lacks \['model.language_model.layers.0.mlp.up_proj.weight_global"):
        load_nvfp4_text_encoder(folder)


def test_stack_with_an_nvfp4_text_encoder_loads_it_through_from_pretrained(tmp_path):
    from diffusers_h3.testing.fasth3 import write_nvfp4_text_encoder

    components = tiny_components(seed=1, with_transformer_ref=False)
    components["text_encoder"] = _nvfp4_sized_text_encoder()
    components["transformer"] = tiny_transformer(text_dim=128)
    root = write_fasth3_stack(tmp_path / "stack", components)
    shutil.rmtree(root / "text_encoder")
    write_nvfp4_text_encoder(components["text_encoder"], root / "text_encoder")
    pipe = MiniMaxH3Pipeline.from_pretrained(root, text_encoder_layer=1, **TINY_DURATION_LIMITS)
    assert sum(isinstance(getattr(m, "weight", None), NVFP4Tensor) for m in pipe.text_encoder.modules()) == 2 * 7
    embeds, _ = pipe.encode_prompt("a cat")
    assert embeds.shape[-1] == 128 and torch.isfinite(embeds).all()


def test_cli_describes_a_stack(stack, capsys):
    from diffusers_h3.cli import main

    root, _ = stack
    assert main(["describe", "--model", str(root), "--json", "--device", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fasth3"]["preset"].startswith("FastVideo-FastH3-4-step-Preview-v1-VSA-DataFree: 4 forwards")
    assert report["fasth3"]["gates"] == "2 of 2 blocks (trained to_gate_compress)"
    assert any("VSA sparsity=0.9" in path for path in report["components"]["transformer"]["attention"])


def test_saved_stack_reloads_as_the_same_stack(stack, tmp_path, caplog):
    root, gates = stack
    pipe = MiniMaxH3Pipeline.from_pretrained(root, **TINY_DURATION_LIMITS)
    pipe.save_pretrained(tmp_path / "saved")
    assert read_contract(tmp_path / "saved") == read_contract(root).replace(source=str(tmp_path / "saved" / CONTRACT_FILE))
    again = MiniMaxH3Pipeline.from_pretrained(tmp_path / "saved")
    blocks = again.transformer.transformer_blocks
    assert all(torch.equal(blocks[i].attn.to_gate_compress.weight, w) for i, w in gates.items())
    assert vsa_state(again.transformer)["sparsity"] == 0.9 and fasth3_report(again)["preset"].startswith("FastVideo")
    assert len(again.vae.decoder.transformer_blocks) == 3
    assert sum(isinstance(getattr(m, "weight", None), NVFP4Tensor) for m in again.vae.modules()) == 18  # the light decoder, as saved

    (tmp_path / "saved" / CONTRACT_FILE).unlink()  # gates without a contract: loaded, and said
    with caplog.at_level(logging.WARNING):
        plain = MiniMaxH3Pipeline.from_pretrained(tmp_path / "saved")
    assert all(torch.equal(plain.transformer.transformer_blocks[i].attn.to_gate_compress.weight, w)
               for i, w in gates.items())  # fmt: skip
    assert "carries FastH3 VSA gates" in caplog.text and fasth3_report(plain) is None


def test_gates_on_a_quantized_dit_take_its_widths_and_compute_dtype():
    """A DiT quantized before its FastH3 payload (W8A16: packed int8 storage) gets gates of the real widths."""
    from diffusers_h3.quantizers import W8A16Config, quantize

    model = tiny_transformer().to(torch.bfloat16)
    quantize(model, W8A16Config())
    raw = {k: v for k, v in _payload(tiny_transformer()).items() if k.endswith(".set_weight")}
    apply_fasth3_payload(model, split_fasth3_state_dict(raw)[0])
    gate = model.transformer_blocks[0].attn.to_gate_compress
    assert (gate.in_features, gate.out_features, gate.weight.dtype) == (32, 64, torch.bfloat16)
    expected = raw["transformer_blocks.0.attn.to_gate_compress.set_weight"].to(torch.bfloat16)
    assert torch.equal(gate.weight, expected)
