"""Every LoRA layout loads onto both partitions with the right deltas; key report, strictness and alpha handling."""

from __future__ import annotations

import pytest
import torch

from diffusers_h3.loaders.lora import detect_lora_layout

from ._lora_helpers import (
    LAYOUTS,
    TinyLoraPipeline,
    assert_deltas,
    canonical_lora,
    save_lora,
    tiny_transformer,
    write_layout,
)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_reproduces_the_canonical_deltas(tmp_path, layout):
    model = tiny_transformer()
    pipe = TinyLoraPipeline(transformer=model)
    lora = canonical_lora(model, seed=LAYOUTS.index(layout))
    path = save_lora(tmp_path / f"{layout}.safetensors", write_layout(lora, layout))

    report = pipe.load_lora_weights(path, adapter_name="a")

    assert report.adapter_name == "a"
    assert report.unmatched_keys == []
    assert report.components["transformer"].matched_modules == sorted(lora)
    assert report.components["transformer"].ranks == {4: len(lora) - 3, 2: 3}  # 2 blocks + norm_out at rank 2
    assert_deltas(model, lora, "a")
    if layout in ("kohya", "musubi"):
        assert "per-module .alpha" in report.alpha_source
    else:
        assert "alpha == rank" in report.alpha_source


def test_diffsynth_layout_is_deinterleaved(tmp_path):
    # DiffSynth files carry the raw checkpoint's per-head interleaved QKV; diffusers de-interleaves with head_dim 128.
    model = tiny_transformer(attention_head_dim=128)
    pipe = TinyLoraPipeline(transformer=model)
    lora = canonical_lora(model, seed=3)
    path = save_lora(tmp_path / "diffsynth.safetensors", write_layout(lora, "diffsynth", head_dim=128))
    report = pipe.load_lora_weights(path)
    assert "DiffSynth" in report.layout
    assert_deltas(model, lora, report.adapter_name)


def test_partition_routing(tmp_path):
    fl2v, ref = tiny_transformer(0), tiny_transformer(1)
    pipe = TinyLoraPipeline(transformer=fl2v, transformer_ref=ref)
    lora = canonical_lora(fl2v, seed=5)

    # transformer_ref-prefixed file -> transformer_ref only.
    report = pipe.load_lora_weights(save_lora(tmp_path / "r.safetensors", write_layout(lora, "diffusers_ref")), "r")
    assert list(report.components) == ["transformer_ref"]
    assert_deltas(ref, lora, "r")
    assert "r" not in getattr(fl2v, "peft_config", {})

    # Unlabelled file with load_into_transformer_ref=True -> transformer_ref.
    path = save_lora(tmp_path / "n.safetensors", write_layout(lora, "native"))
    report = pipe.load_lora_weights(path, "n", load_into_transformer_ref=True)
    assert list(report.components) == ["transformer_ref"]
    assert_deltas(ref, lora, "n")

    # Unlabelled file, both partitions present -> transformer (diffusers' rule).
    report = pipe.load_lora_weights(path, "n2")
    assert list(report.components) == ["transformer"]
    assert_deltas(fl2v, lora, "n2")

    # A pipeline holding transformer_ref alone routes unlabelled files there.
    only_ref = TinyLoraPipeline(transformer_ref=tiny_transformer(2))
    report = only_ref.load_lora_weights(path, "x")
    assert list(report.components) == ["transformer_ref"]


def test_unmatched_keys_are_an_error_unless_allowed(tmp_path):
    model = tiny_transformer()
    pipe = TinyLoraPipeline(transformer=model)
    lora = canonical_lora(model, seed=7)
    sd = write_layout(lora, "diffusers")
    sd["transformer.transformer_blocks.9.attn.to_q.lora_A.weight"] = torch.randn(4, 32)
    sd["transformer.transformer_blocks.9.attn.to_q.lora_B.weight"] = torch.randn(64, 4)
    sd["text_encoder.layers.0.q_proj.lora_A.weight"] = torch.randn(4, 8)
    sd["transformer.proj_out.base_layer.lora_A.weight"] = torch.randn(4, 32)  # inside a PEFT wrapper: no target
    path = save_lora(tmp_path / "extra.safetensors", sd)

    with pytest.raises(ValueError, match="allow_unmatched_keys=True"):
        pipe.load_lora_weights(path, "strict")
    assert not hasattr(model, "peft_config") or "strict" not in model.peft_config

    pipe.load_lora_weights(write_layout(canonical_lora(model, seed=8), "diffusers"), "first")
    report = pipe.load_lora_weights(path, "lenient", allow_unmatched_keys=True)
    assert report.unmatched_keys == sorted(
        [
            "text_encoder.layers.0.q_proj.lora_A.weight",
            "transformer.proj_out.base_layer.lora_A.weight",
            "transformer.transformer_blocks.9.attn.to_q.lora_A.weight",
            "transformer.transformer_blocks.9.attn.to_q.lora_B.weight",
        ]
    )
    assert report.num_matched_modules == len(lora)
    assert_deltas(model, lora, "lenient")
    assert "unmatched keys (4" in str(report)


def test_zero_matched_modules_is_an_error(tmp_path):
    pipe = TinyLoraPipeline(transformer=tiny_transformer())
    sd = {
        "transformer.not_a_module.lora_A.weight": torch.randn(4, 32),
        "transformer.not_a_module.lora_B.weight": torch.randn(32, 4),
    }
    with pytest.raises(ValueError, match="matched no module"):
        pipe.load_lora_weights(save_lora(tmp_path / "none.safetensors", sd), allow_unmatched_keys=True)


def test_shape_mismatch_names_the_module(tmp_path):
    pipe = TinyLoraPipeline(transformer=tiny_transformer())
    sd = {
        "transformer.proj_out.lora_A.weight": torch.randn(4, 33),
        "transformer.proj_out.lora_B.weight": torch.randn(16, 4),
    }
    with pytest.raises(ValueError, match="proj_out.lora_A.weight"):
        pipe.load_lora_weights(sd)


def test_alpha_from_file_metadata_and_argument(tmp_path, h3_logs):
    model = tiny_transformer()
    pipe = TinyLoraPipeline(transformer=model)
    lora = canonical_lora(model, seed=11)
    sd = write_layout(lora, "peft_dump")

    # __metadata__ alpha: uniform network alpha, scale alpha / rank per module (rank 4 -> 0.5, rank 2 -> 1.0).
    report = pipe.load_lora_weights(save_lora(tmp_path / "m.safetensors", sd, {"alpha": "2"}), "m")
    assert "__metadata__ alpha=2" in report.alpha_source
    assert report.components["transformer"].alphas == {2.0: len(lora)}
    rank4 = {k: v for k, v in lora.items() if v[0].shape[0] == 4}
    rank2 = {k: v for k, v in lora.items() if v[0].shape[0] == 2}
    assert_deltas(model, rank4, "m", scale=0.5)
    assert_deltas(model, rank2, "m", scale=1.0)

    # network_alpha argument overrides the file.
    report = pipe.load_lora_weights(save_lora(tmp_path / "a.safetensors", sd, {"alpha": "2"}), "a", network_alpha=8)
    assert "network_alpha=8" in report.alpha_source
    assert_deltas(model, rank4, "a", scale=2.0)
    assert_deltas(model, rank2, "a", scale=4.0)

    # No alpha anywhere: documented default, and it says so.
    with h3_logs.expect("alpha == rank"):
        report = pipe.load_lora_weights(save_lora(tmp_path / "d.safetensors", sd), "d")
    assert "alpha == rank" in report.alpha_source
    assert_deltas(model, lora, "d")

    # Per-module .alpha tensors are folded already; a network alpha on top would apply twice.
    kohya = save_lora(tmp_path / "k.safetensors", write_layout(lora, "kohya"))
    with pytest.raises(ValueError, match="apply twice"):
        pipe.load_lora_weights(kohya, "k", network_alpha=4)


def test_in_memory_dict_and_repeated_adapter_name():
    model = tiny_transformer()
    pipe = TinyLoraPipeline(transformer=model)
    lora = canonical_lora(model, seed=13)
    sd = write_layout(lora, "native")
    report = pipe.load_lora_weights(sd)
    assert report.adapter_name == "default_0"
    assert "native" in report.layout
    assert set(sd) == set(write_layout(lora, "native"))  # the caller's dict is not modified
    assert_deltas(model, lora, "default_0")
    with pytest.raises(ValueError, match="already in use"):
        pipe.load_lora_weights(sd, adapter_name="default_0")


def test_set_adapters_unload_and_delete(tmp_path):
    model = tiny_transformer()
    pipe = TinyLoraPipeline(transformer=model)
    l1, l2 = canonical_lora(model, seed=21), canonical_lora(model, seed=22)
    pipe.load_lora_weights(write_layout(l1, "diffusers"), "one")
    pipe.load_lora_weights(write_layout(l2, "diffusers"), "two")
    pipe.set_adapters(["one", "two"], [1.0, 0.25])
    assert_deltas(model, l2, "two", scale=0.25)
    pipe.delete_adapters("two")
    assert pipe.get_list_adapters() == {"transformer": ["one"]}
    pipe.unload_lora_weights()
    assert isinstance(model.transformer_blocks[0].attn.to_q, torch.nn.Linear)
    assert not any("lora" in name for name, _ in model.named_modules())


def test_save_lora_weights_round_trip_keeps_alpha_and_partition(tmp_path):
    from peft.utils import get_peft_model_state_dict

    model = tiny_transformer()
    pipe = TinyLoraPipeline(transformer=model, transformer_ref=tiny_transformer(1))
    lora = canonical_lora(model, seed=17)
    pipe.load_lora_weights(save_lora(tmp_path / "m.safetensors", write_layout(lora, "peft_dump"), {"alpha": "2"}), "m")
    pipe.save_lora_weights(
        tmp_path / "saved",
        transformer_ref_lora_layers=get_peft_model_state_dict(model, adapter_name="m"),
        transformer_ref_lora_adapter_metadata=model.peft_config["m"].to_dict(),
    )

    other = TinyLoraPipeline(transformer=tiny_transformer(2), transformer_ref=tiny_transformer(3))
    report = other.load_lora_weights(tmp_path / "saved", "back")
    assert list(report.components) == ["transformer_ref"]
    assert "saved with the file" in report.alpha_source
    rank4 = {k: v for k, v in lora.items() if v[0].shape[0] == 4}
    assert_deltas(other.transformer_ref, rank4, "back", scale=0.5)


def test_bf16_model_and_prefixed_peft_dump(tmp_path):
    model = tiny_transformer(5).to(torch.bfloat16)
    pipe = TinyLoraPipeline(transformer=model)
    lora = canonical_lora(model, seed=19)
    # a PEFT dump that does carry the component prefix: `.default.` is normalized away
    sd = {k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v.to(torch.bfloat16)
          for k, v in write_layout(lora, "diffusers").items()}
    report = pipe.load_lora_weights(save_lora(tmp_path / "p.safetensors", sd), "p")
    assert report.num_matched_modules == len(lora) and report.unmatched_keys == []
    assert model.transformer_blocks[0].attn.to_q.lora_A["p"].weight.dtype == torch.bfloat16
    assert_deltas(model, {k: (A.bfloat16(), B.bfloat16()) for k, (A, B) in lora.items()}, "p", atol=2e-2)


def test_unapplied_alpha_tensors_are_reported(tmp_path):
    pipe = TinyLoraPipeline(transformer=tiny_transformer())
    lora = canonical_lora(pipe.transformer, seed=23)
    sd = write_layout(lora, "diffusers")
    sd["transformer.proj_out.alpha"] = torch.tensor(2.0)  # diffusers names + kohya alpha: nobody folds it
    with pytest.raises(ValueError, match=r"transformer\.proj_out\.alpha"):
        pipe.load_lora_weights(sd)
    report = pipe.load_lora_weights(sd, allow_unmatched_keys=True)
    assert report.unmatched_keys == ["transformer.proj_out.alpha"]
    assert "alpha == rank" in report.alpha_source


@pytest.mark.parametrize(
    "layout, expected",
    [
        ("diffusers", "diffusers / PEFT"),
        ("peft_dump", "PEFT dump"),
        ("native", "native module names"),
        ("ai_toolkit", "ai-toolkit"),
        ("kohya", "kohya"),
        ("musubi", "musubi-tuner"),
        ("diffsynth", "DiffSynth"),
    ],
)
def test_detect_lora_layout(layout, expected):
    model = tiny_transformer(**({"attention_head_dim": 128} if layout == "diffsynth" else {}))
    sd = write_layout(canonical_lora(model), layout, head_dim=128)
    assert expected in detect_lora_layout(list(sd))
    assert detect_lora_layout(["foo.bar"]) == "unknown"
