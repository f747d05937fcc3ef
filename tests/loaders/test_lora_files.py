"""LoRA files by header: FP8-stored factors (ComfyUI ``weight_scale`` and LightX2V ``__fp8_scale`` layouts) load to the
dequantized factors, LightX2V Turbo v1.1 / v1.2 files carry their presets, Turbo-SLA adapters and full DiTs passed as a
LoRA are refused in one line."""

from __future__ import annotations

import pytest
import torch

from diffusers_h3.loaders.lora_files import LoraFileError, check_lora_file, read_fp8_lora

from ._lora_helpers import TinyLoraPipeline, assert_deltas, canonical_lora, save_lora, tiny_transformer, write_layout


E4M3_MAX = 448.0


def _quantize_rows(x: torch.Tensor):
    """Per-row symmetric E4M3 quantization: (codes, per-row float32 scale)."""
    scale = x.float().abs().amax(dim=1).clamp(min=1e-12) / E4M3_MAX
    codes = (x.float() / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def _reference(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Hand dequantization: each code times its row's scale, in float32, rounded once to bfloat16."""
    return (codes.float() * scale.float().reshape(-1, 1)).to(torch.bfloat16)


def _fp8_file(state_dict, layout: str):
    """``state_dict`` (bf16/float factors) rewritten with FP8 factors in ``layout``; also the hand-dequantized dict."""
    out, expected = {}, {}
    for key, value in state_dict.items():
        if value.ndim != 2:
            out[key] = value
            continue
        codes, scale = _quantize_rows(value)
        expected[key] = _reference(codes, scale)
        if layout == "comfy":
            out[key], out[key.rsplit(".", 1)[0] + ".weight_scale"] = codes, scale
        elif layout == "comfy_scalar":
            scalar = value.float().abs().max() / E4M3_MAX
            codes = (value.float() / scalar).to(torch.float8_e4m3fn)
            expected[key] = (codes.float() * scalar).to(torch.bfloat16)
            out[key], out[key.rsplit(".", 1)[0] + ".scale_weight"] = codes, scalar.reshape(1)
        elif layout == "lightx2v":
            out[key], out[key + "__fp8_scale"] = codes.view(torch.uint8), scale.reshape(-1, 1)
        elif layout == "plain":
            out[key] = value.to(torch.float8_e4m3fn)
            expected[key] = out[key].float().to(torch.bfloat16)
        else:
            raise AssertionError(layout)
    return out, expected


@pytest.mark.parametrize("layout", ["comfy", "comfy_scalar", "lightx2v", "plain"])
def test_fp8_factors_dequantize_to_the_hand_computation(tmp_path, layout):
    model = tiny_transformer()
    lora = canonical_lora(model, seed=3)
    sd = {k: v.to(torch.bfloat16) for k, v in write_layout(lora, "peft_dump").items()}
    fp8_sd, expected = _fp8_file(sd, layout)
    path = save_lora(tmp_path / "f.safetensors", fp8_sd)

    fp8 = read_fp8_lora(path)
    assert fp8 is not None and fp8.dequantized == len(expected)
    assert set(fp8.state_dict) == set(sd)  # scale sidecars are consumed
    for key, value in expected.items():
        assert fp8.state_dict[key].dtype == torch.bfloat16
        torch.testing.assert_close(fp8.state_dict[key], value, atol=0, rtol=0, msg=key)
        # ... and close to the bf16 factors they were quantized from (E4M3: 3 mantissa bits)
        torch.testing.assert_close(fp8.state_dict[key].float(), sd[key].float(), rtol=0.07, atol=0.03)


def test_a_file_without_fp8_is_left_to_diffusers(tmp_path):
    lora = canonical_lora(tiny_transformer(), seed=3)
    assert read_fp8_lora(save_lora(tmp_path / "b.safetensors", write_layout(lora, "peft_dump"))) is None


def test_fp8_lora_loads_like_its_dequantized_bf16_twin(tmp_path):
    """The v1.1-style FP8 file and a bf16 file holding the dequantized factors give the same adapter and alpha."""
    model = tiny_transformer()
    lora = canonical_lora(model, seed=4)
    sd = {k: v.to(torch.bfloat16) for k, v in write_layout(lora, "peft_dump").items()}
    fp8_sd, expected = _fp8_file(sd, "comfy")
    name = "minimax_h3_fl2v_turbo_4step_v1.1_768p_fp8.safetensors"
    fp8_path = save_lora(tmp_path / name, fp8_sd, {"alpha": "2"})
    twin = {k: expected.get(k, v) for k, v in sd.items()}
    twin_path = save_lora(tmp_path / "minimax_h3_fl2v_turbo_4step_v1.1_768p_bf16.safetensors", twin, {"alpha": "2"})

    pipe = TinyLoraPipeline(transformer=tiny_transformer())
    report = pipe.load_lora_weights(fp8_path, "fp8")
    reference = TinyLoraPipeline(transformer=tiny_transformer())
    reference.load_lora_weights(twin_path, "bf16")
    assert "FP8 factors" in report.layout and "ComfyUI weight_scale" in report.layout
    assert "alpha=2" in report.alpha_source
    assert report.preset is not None and report.preset.num_inference_steps == 5 and report.preset.flow_shift == 6.0
    for module in lora:
        a = pipe.transformer.get_submodule(module)
        b = reference.transformer.get_submodule(module)
        torch.testing.assert_close(a.lora_A["fp8"].weight, b.lora_A["bf16"].weight, atol=0, rtol=0)
        torch.testing.assert_close(a.lora_B["fp8"].weight, b.lora_B["bf16"].weight, atol=0, rtol=0)
        assert a.scaling["fp8"] == b.scaling["bf16"]


def test_v1_2_file_loads_with_its_preset_and_metadata_alpha(tmp_path):
    model = tiny_transformer()
    lora = canonical_lora(model, seed=5)
    path = save_lora(tmp_path / "minimax_h3_fl2v_turbo_4step_v1.2_768p.safetensors", write_layout(lora, "peft_dump"),
                     {"alpha": "8"})  # fmt: skip
    pipe = TinyLoraPipeline(transformer=tiny_transformer())
    report = pipe.load_lora_weights(path, "turbo")
    preset = report.preset
    assert (preset.num_inference_steps, preset.flow_shift, preset.audio_flow_shift) == (5, 6.0, 3.0)
    rank = next(iter(report.components["transformer"].ranks))
    assert_deltas(pipe.transformer, {k: v for k, v in lora.items() if v[0].shape[0] == rank}, "turbo", scale=8 / rank)


@pytest.mark.parametrize(
    "name, metadata",
    [
        ("minimax_h3_fl2v_turbo_4step_v0.1_768p_sla_bf16.safetensors", {}),
        ("minimax_h3_fl2v_turbo_4step_v0.1_768p_sla_comfyui_bf16.safetensors", {}),
        ("lightx2v/Minimax-h3-Turbo-SLA/turbo.safetensors", {}),
        ("my_lora.safetensors", {"sparse_attention": "sla"}),
    ],
)
def test_turbo_sla_is_refused_in_one_line(name, metadata):
    with pytest.raises(LoraFileError) as error:
        check_lora_file(name, ["a.lora_A.weight"], metadata)
    message = str(error.value)
    assert "\n" not in message and "sparse-linear attention" in message and "dense Turbo file" in message


def test_turbo_sla_is_refused_before_loading(tmp_path):
    lora = canonical_lora(tiny_transformer(), seed=6)
    path = save_lora(tmp_path / "minimax_h3_fl2v_turbo_4step_v0.1_768p_sla_bf16.safetensors",
                     write_layout(lora, "peft_dump"))  # fmt: skip
    pipe = TinyLoraPipeline(transformer=tiny_transformer())
    with pytest.raises(LoraFileError, match="Turbo-SLA"):
        pipe.load_lora_weights(path, "sla")
    assert not pipe.get_list_adapters().get("transformer")


def test_names_that_merely_contain_sla_letters_are_not_refused():
    check_lora_file("minimax_h3_slapstick_style.safetensors", ["a.lora_A.weight"], {})
    check_lora_file("minimax_h3_fl2v_turbo_4step_v1.2_768p.safetensors", ["a.lora_A.weight"], {})


def test_a_full_dit_passed_as_a_lora_is_refused_with_the_way_to_load_it(tmp_path):
    sd = {"blocks.0.attn.qkv_proj.weight": torch.zeros(12, 4).to(torch.float8_e4m3fn),
          "blocks.0.attn.qkv_proj.weight_scale": torch.ones(())}  # fmt: skip
    path = save_lora(tmp_path / "minimax_h3_fl2v_turbo_4step_v1.1_768p_fp8.safetensors", sd)
    pipe = TinyLoraPipeline(transformer=tiny_transformer())
    with pytest.raises(LoraFileError, match="--transformer-file") as error:
        pipe.load_lora_weights(path, "merged")
    assert "\n" not in str(error.value)


def test_damaged_fp8_files_are_refused(tmp_path):
    codes = torch.zeros(4, 8).to(torch.float8_e4m3fn)
    bad_shape = {"m.lora_A.weight": codes, "m.lora_A.weight_scale": torch.ones(3)}
    with pytest.raises(LoraFileError, match="has shape"):
        read_fp8_lora(save_lora(tmp_path / "a.safetensors", bad_shape))
    orphan = {"m.lora_A.weight": codes, "n.lora_B.weight_scale": torch.ones(1)}
    with pytest.raises(LoraFileError, match="without the factor"):
        read_fp8_lora(save_lora(tmp_path / "b.safetensors", orphan))
    scaled_bf16 = {"m.lora_A.weight": torch.zeros(4, 8, dtype=torch.bfloat16), "m.lora_A.weight_scale": torch.ones(1)}
    with pytest.raises(LoraFileError, match="not FP8"):
        read_fp8_lora(save_lora(tmp_path / "c.safetensors", scaled_bf16))
