"""Decision of the quantization configs that must not flip: `modules_to_not_convert` names match whole dotted
components or dotted sub-paths of a module's name, never a substring (`transformer_blocks.1` keeps block 1, not
blocks 10 and 11; `to_q` keeps `to_q`, not `to_qkv`)."""

import torch
from torch import nn

from diffusers_h3.quantizers import W8A16Config, quantize
from diffusers_h3.quantizers.layers import QuantizedLinear


def _blocks(count):
    def block():
        return nn.ModuleDict({"to_q": nn.Linear(16, 16), "to_qkv": nn.Linear(16, 48),
                              "ff": nn.ModuleDict({"net": nn.Linear(16, 16)}), "ff_context": nn.Linear(16, 16)})  # fmt: skip

    return nn.ModuleDict({"transformer_blocks": nn.ModuleList([block() for _ in range(count)])})


def test_modules_to_not_convert_matches_whole_dotted_components():
    torch.manual_seed(0)
    model = _blocks(12)
    quantize(model, W8A16Config(modules_to_not_convert=["transformer_blocks.1", "to_q", "ff"]))
    kept = {name for name, m in model.named_modules() if type(m) is nn.Linear}
    quantized = {name for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}

    block_1 = {f"transformer_blocks.1.{leaf}" for leaf in ("to_q", "to_qkv", "ff.net", "ff_context")}
    assert block_1 <= kept  # a dotted sub-path keeps everything under it
    for index in (0, 10, 11):  # "transformer_blocks.1" is a substring of "transformer_blocks.10", not a component
        prefix = f"transformer_blocks.{index}"
        assert {f"{prefix}.to_q", f"{prefix}.ff.net"} <= kept  # a component, at any depth
        assert {f"{prefix}.to_qkv", f"{prefix}.ff_context"} <= quantized  # "to_q" / "ff" are only substrings here
    assert kept | quantized == {name for name, m in _blocks(12).named_modules() if type(m) is nn.Linear}
