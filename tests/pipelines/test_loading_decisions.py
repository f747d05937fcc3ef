"""Decision of the hub-layout loader that must not flip: with a dtype dict, a component it does not name loads in its
`"default"` entry, and without one in float32 (diffusers' rule in `DiffusionPipeline.from_pretrained`), not in
whatever dtype its files were saved in (`dtype=None` would let transformers keep a bf16 checkpoint in bf16).

The components are stand-ins that record what the loader passes to their `from_pretrained`."""

import sys
import types

import pytest
import torch

from diffusers_h3.pipelines.loading import _load_hub_layout


class _RecordsKwargs(torch.nn.Module):
    @classmethod
    def from_pretrained(cls, folder, **kwargs):
        component = cls()
        component.load_kwargs = kwargs
        return component


class _Pipeline:
    def __init__(self, text_encoder=None, vae=None, transformer=None, transformer_ref=None):
        self.components = {"text_encoder": text_encoder, "vae": vae, "transformer": transformer}


@pytest.fixture
def stand_in_checkpoint(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "h3_stand_in_library", types.SimpleNamespace(RecordsKwargs=_RecordsKwargs))
    index = {}
    for name in ("text_encoder", "vae", "transformer"):
        (tmp_path / name).mkdir()
        index[name] = ["h3_stand_in_library", "RecordsKwargs", {"subfolder": name}]
    return tmp_path, index


@pytest.mark.parametrize(
    "dtype, expected",
    [
        ({"vae": torch.float16}, {"vae": torch.float16, "text_encoder": torch.float32, "transformer": torch.float32}),
        ({"vae": torch.float16, "default": torch.bfloat16},
         {"vae": torch.float16, "text_encoder": torch.bfloat16, "transformer": torch.bfloat16}),
    ],
    ids=["without_default", "with_default"],
)
def test_components_missing_from_a_dtype_dict(stand_in_checkpoint, dtype, expected):
    directory, index = stand_in_checkpoint
    pipe = _load_hub_layout(_Pipeline, directory, index, "t2va", {"dtype": dtype})
    assert {name: c.load_kwargs.get("dtype") for name, c in pipe.components.items()} == expected
