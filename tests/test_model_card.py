"""Model cards written on save: Hub metadata that huggingface_hub parses, and a snippet that loads this checkpoint."""

from __future__ import annotations

from huggingface_hub import ModelCard

from diffusers_h3._model_card import (
    fused_lora_names,
    pipeline_model_card,
    quantization_method,
    transformer_model_card,
    write_model_card,
)
from diffusers_h3.testing.tiny import tiny_pipeline, tiny_transformer


def _reparse(card: ModelCard, tmp_path, name="README.md") -> ModelCard:
    path = tmp_path / name
    card.save(path)
    return ModelCard.load(path)


def test_pipeline_card_metadata_and_snippet(tmp_path):
    pipe = tiny_pipeline()
    pipe.register_to_config(_name_or_path="MiniMaxAI/MiniMax-H3")
    card = _reparse(pipeline_model_card(pipe, repo_id="me/h3-fast"), tmp_path)
    data = card.data.to_dict()
    assert data["library_name"] == "diffusers"
    assert data["pipeline_tag"] == "text-to-video"
    assert data["base_model"] == "MiniMaxAI/MiniMax-H3"
    assert {"diffusers-h3", "minimax-h3"} <= set(data["tags"])
    assert not any(t.startswith("quantized-") for t in data["tags"])
    assert 'MiniMaxH3Pipeline.from_pretrained("me/h3-fast"' in card.text


def test_local_origin_is_not_a_base_model(tmp_path):
    pipe = tiny_pipeline()
    pipe.register_to_config(_name_or_path=str(tmp_path))
    data = _reparse(pipeline_model_card(pipe), tmp_path, "card.md").data.to_dict()
    assert "base_model" not in data or data["base_model"] is None


def test_quantized_transformer_card_names_the_method(tmp_path):
    from diffusers_h3 import W8A16Config, quantize

    model = tiny_transformer()
    assert quantization_method(model) is None
    quantize(model, W8A16Config())
    method = quantization_method(model)
    assert method == W8A16Config().quant_method.value
    card = _reparse(transformer_model_card(model, repo_id="me/h3-w8a16"), tmp_path)
    assert f"quantized-{method}" in card.data.to_dict()["tags"]
    assert 'MiniMaxH3Transformer3DModel.from_pretrained("me/h3-w8a16"' in card.text


def test_fused_lora_names_are_read_from_merged_layers():
    from peft import LoraConfig

    model = tiny_transformer()
    assert fused_lora_names(model) == []
    model.add_adapter(LoraConfig(r=2, target_modules=["to_q"]), adapter_name="turbo")
    assert fused_lora_names(model) == []  # loaded but not fused: save_pretrained would not keep it
    for module in model.modules():
        if hasattr(module, "merge") and hasattr(module, "merged_adapters") and not module.merged_adapters:
            module.merge(adapter_names=["turbo"])
    assert fused_lora_names(model) == ["turbo"]


def test_write_model_card_keeps_an_existing_card(tmp_path):
    (tmp_path / "README.md").write_text("my own card")
    write_model_card(str(tmp_path), pipeline_model_card(tiny_pipeline()))
    assert (tmp_path / "README.md").read_text() == "my own card"
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    write_model_card(str(fresh), pipeline_model_card(tiny_pipeline()))
    assert ModelCard.load(fresh / "README.md").data.library_name == "diffusers"


def test_pipeline_save_pretrained_writes_a_card_that_loads_this_folder(tmp_path):
    pipe = tiny_pipeline()
    pipe.save_pretrained(tmp_path / "saved")
    card = ModelCard.load(tmp_path / "saved" / "README.md")
    assert card.data.library_name == "diffusers"
    assert f'from_pretrained("{tmp_path / "saved"}"' in card.text


def test_quantized_transformer_of_a_saved_pipeline_carries_its_card(tmp_path):
    from diffusers import MiniMaxH3Transformer3DModel

    from diffusers_h3 import FP8Config, quantize

    pipe = tiny_pipeline(with_transformer_ref=False)
    quantize(pipe.transformer, FP8Config())
    pipe.save_pretrained(tmp_path / "pipe")
    card = ModelCard.load(tmp_path / "pipe" / "transformer" / "README.md")
    assert f"quantized-{FP8Config().quant_method.value}" in card.data.tags
    # The snippet's loader reads the subfolder back.
    assert f'from_pretrained("{tmp_path / "pipe" / "transformer"}"' in card.text
    reloaded = MiniMaxH3Transformer3DModel.from_pretrained(tmp_path / "pipe" / "transformer")
    assert quantization_method(reloaded) == FP8Config().quant_method.value
    # Saved on its own through diffusers' `save_pretrained` (no patch of it), a DiT gets no card from this package.
    reloaded.save_pretrained(tmp_path / "dit")
    assert not (tmp_path / "dit" / "README.md").exists()


def test_push_to_hub_uploads_once_with_our_card(tmp_path, monkeypatch):
    import huggingface_hub

    uploads = []
    monkeypatch.setattr(huggingface_hub, "create_repo", lambda name, **kw: type("R", (), {"repo_id": f"me/{name}"}))
    pipe = tiny_pipeline()

    def upload(repo_id, folder_path, **kwargs):
        uploads.append((repo_id, ModelCard.load(f"{folder_path}/README.md").text))

    monkeypatch.setattr(huggingface_hub, "upload_folder", upload)
    pipe.save_pretrained(tmp_path / "h3-push", push_to_hub=True, repo_id="h3-push")
    assert len(uploads) == 1
    repo_id, text = uploads[0]
    assert repo_id == "me/h3-push"
    assert 'from_pretrained("me/h3-push"' in text


SOURCE_CARD = (
    "---\nlicense: other\nlicense_name: minimax-h3-community-license\nlicense_link: LICENSE\n---\n\n# MiniMax-H3\n"
)
LICENSE = {"license": "other", "license_name": "minimax-h3-community-license", "license_link": "LICENSE"}


def test_cards_of_a_pipeline_loaded_by_repo_id_name_it_and_keep_its_license(tmp_path, monkeypatch):
    import huggingface_hub

    from diffusers_h3 import MiniMaxH3Pipeline
    from diffusers_h3.testing.tiny import HUB_REPO_ID, save_to_hub_cache, tiny_components

    snapshot = save_to_hub_cache(tiny_components(with_transformer_ref=False), tmp_path / "cache", HUB_REPO_ID)
    (snapshot / "README.md").write_text(SOURCE_CARD)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))

    pipe = MiniMaxH3Pipeline.from_pretrained(HUB_REPO_ID, task="t2va")
    for card in (pipeline_model_card(pipe), transformer_model_card(pipe.transformer)):
        data = _reparse(card, tmp_path).data.to_dict()
        assert data["base_model"] == HUB_REPO_ID
        assert {key: data.get(key) for key in LICENSE} == LICENSE
    # Saved, the cards carry both; a model later loaded from that folder (diffusers records the subfolder as its
    # `_name_or_path`) takes them from our card.
    saved = tmp_path / "saved"
    pipe.save_pretrained(saved)
    for card_path in (saved / "README.md", saved / "transformer" / "README.md"):
        data = ModelCard.load(card_path).data.to_dict()
        assert data["base_model"] == HUB_REPO_ID and {key: data.get(key) for key in LICENSE} == LICENSE
    pipe.transformer.register_to_config(_name_or_path=str(saved / "transformer"))
    data = _reparse(transformer_model_card(pipe.transformer), tmp_path).data.to_dict()
    assert data["base_model"] == HUB_REPO_ID and {key: data.get(key) for key in LICENSE} == LICENSE


def test_source_without_a_license_gives_a_card_without_one(tmp_path):
    (tmp_path / "README.md").write_text("# no metadata\n")
    pipe = tiny_pipeline()
    pipe.register_to_config(_name_or_path=str(tmp_path))
    assert _reparse(pipeline_model_card(pipe), tmp_path, "card.md").data.to_dict().get("license") is None


def test_model_card_doc_installs_as_the_readme_does():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    doc, readme = (root / "docs" / "model_card.md").read_text(), (root / "README.md").read_text()
    assert "not published on PyPI" in readme  # while the README says so, the doc must not `pip install` the name
    assert "pip install diffusers-h3" not in doc
    assert 'pip install -e "' in doc or "pip install -e ." in doc
