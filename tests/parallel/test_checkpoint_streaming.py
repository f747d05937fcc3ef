"""Streaming a model's weights from its own checkpoint files: same outputs, no weights left in memory, nothing
written, and a model that does not match its files is refused before anything is released."""

import pytest
import torch

from diffusers_h3.parallel import memory_budget as mb
from diffusers_h3.parallel.checkpoint_streaming import (
    STREAM_HOOK_NAME,
    CheckpointMismatchError,
    stream_from_checkpoint,
    streamed_bytes,
)
from diffusers_h3.pipelines import MiniMaxH3Pipeline
from diffusers_h3.quantizers import W8A16Config
from diffusers_h3.testing import tiny


def _saved_w8a16_text_encoder(folder):
    te = tiny.tiny_text_encoder(num_hidden_layers=3, hidden_size=32)
    te.save_pretrained(folder / "dense")
    cls = type(te)
    quantized = cls.from_pretrained(folder / "dense", quantization_config=W8A16Config(), dtype=torch.bfloat16)
    quantized.save_pretrained(folder / "w8a16", max_shard_size="20KB")  # several shards: an index and many files
    return cls


def _hidden(te, ids):
    with torch.no_grad():
        return te.model(input_ids=ids, output_hidden_states=True).hidden_states[-1]


def test_streamed_model_gives_the_same_output_and_holds_no_weights(tmp_path):
    cls = _saved_w8a16_text_encoder(tmp_path)
    assert len(list((tmp_path / "w8a16").glob("*.safetensors"))) > 1
    reference = cls.from_pretrained(tmp_path / "w8a16", dtype=torch.bfloat16).eval()
    streamed = cls.from_pretrained(tmp_path / "w8a16", dtype=torch.bfloat16).eval()
    files_before = sorted(p.name for p in (tmp_path / "w8a16").iterdir())
    sizes = stream_from_checkpoint(streamed, tmp_path / "w8a16", "cpu", resident_below_bytes=1024)
    held = sum(t.numel() * t.element_size() for t in streamed.state_dict().values())
    total = sum(t.numel() * t.element_size() for t in reference.state_dict().values())
    assert sizes["streamed_bytes_per_forward"] > 0.5 * total
    assert streamed_bytes(streamed) == sizes["streamed_bytes_per_forward"] and streamed_bytes(reference) == 0
    assert held <= total - sizes["streamed_bytes_per_forward"]
    ids = torch.randint(0, 200, (1, 7), generator=torch.Generator().manual_seed(1))
    expected = _hidden(reference, ids)
    for _ in range(2):  # the tensors are released after each forward and read again
        assert torch.equal(_hidden(streamed, ids), expected)
    assert streamed.model.language_model.layers[0].mlp.up_proj.weight.numel() == 0  # released again
    assert sorted(p.name for p in (tmp_path / "w8a16").iterdir()) == files_before  # nothing written


def test_a_model_that_does_not_match_its_files_is_refused_before_anything_changes(tmp_path):
    cls = _saved_w8a16_text_encoder(tmp_path)
    # quantized while loading from the dense files: the int8 codes are not what those files store
    quantized = cls.from_pretrained(tmp_path / "dense", quantization_config=W8A16Config(), dtype=torch.bfloat16)
    before = {k: v.clone() for k, v in quantized.state_dict().items()}
    with pytest.raises(CheckpointMismatchError, match="in the model but"):
        stream_from_checkpoint(quantized, tmp_path / "dense", "cpu")
    after = quantized.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert not any(hasattr(m, "_diffusers_hook") for m in quantized.modules())
    with pytest.raises(CheckpointMismatchError, match="no safetensors files"):
        stream_from_checkpoint(quantized, tmp_path / "empty", "cpu")


def test_streamed_text_encoder_encodes_the_prompt_as_the_resident_one(tmp_path, monkeypatch):
    from diffusers_h3.parallel import checkpoint_streaming

    monkeypatch.setattr(checkpoint_streaming, "RESIDENT_BELOW_BYTES", 1024)  # the tiny model streams too
    components = tiny.tiny_components(seed=0, with_transformer_ref=False)
    components.pop("transformer_ref")
    pipe = MiniMaxH3Pipeline(**components)
    expected, tags = pipe.encode_prompt("a red fox runs through snow", device="cpu")
    pipe.text_encoder.save_pretrained(tmp_path / "te")
    where = mb.stream_text_encoder_from_disk(pipe, "cpu", checkpoint_folder=tmp_path / "te")
    assert where == str(tmp_path / "te")
    assert pipe._diffusers_h3_placement["text_encoder"].startswith("streamed from its checkpoint files")
    hooked = [m for m in pipe.text_encoder.modules() if getattr(m, "_diffusers_hook", None) is not None
              and m._diffusers_hook.get_hook(STREAM_HOOK_NAME) is not None]  # fmt: skip
    assert hooked
    got, got_tags = pipe.encode_prompt("a red fox runs through snow", device="cpu")
    assert torch.equal(got, expected) and torch.equal(got_tags, tags)


@pytest.mark.gpu
def test_streaming_to_the_gpu_reads_each_tensor_onto_it(tmp_path):
    cls = _saved_w8a16_text_encoder(tmp_path)
    reference = cls.from_pretrained(tmp_path / "w8a16", dtype=torch.bfloat16).eval().to("cuda")
    streamed = cls.from_pretrained(tmp_path / "w8a16", dtype=torch.bfloat16).eval()
    stream_from_checkpoint(streamed, tmp_path / "w8a16", "cuda", resident_below_bytes=1024)
    ids = torch.randint(0, 200, (1, 9), generator=torch.Generator().manual_seed(2)).cuda()
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    got = _hidden(streamed, ids)
    assert got.device.type == "cuda" and torch.equal(got, _hidden(reference, ids))
    del got
    assert torch.cuda.memory_allocated() <= allocated  # the streamed tensors are released after the forward
