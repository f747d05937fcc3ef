"""Decision of the quantization configs that must not flip: `modules_to_not_convert` names match whole dotted
components or dotted sub-paths of a module's name, never a substring (`transformer_blocks.1` keeps block 1, not
blocks 10 and 11; `to_q` keeps `to_q`, not `to_qkv`)."""

import torch
from torch import nn

from diffusers_h3.quantizers import W8A16Config, is_quantized_linear, quantize


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
    quantized = {name for name, m in model.named_modules() if is_quantized_linear(m)}

    block_1 = {f"transformer_blocks.1.{leaf}" for leaf in ("to_q", "to_qkv", "ff.net", "ff_context")}
    assert block_1 <= kept  # a dotted sub-path keeps everything under it
    for index in (0, 10, 11):  # "transformer_blocks.1" is a substring of "transformer_blocks.10", not a component
        prefix = f"transformer_blocks.{index}"
        assert {f"{prefix}.to_q", f"{prefix}.ff.net"} <= kept  # a component, at any depth
        assert {f"{prefix}.to_qkv", f"{prefix}.ff_context"} <= quantized  # "to_q" / "ff" are only substrings here
    assert kept | quantized == {name for name, m in _blocks(12).named_modules() if type(m) is nn.Linear}


def test_an_explicit_list_still_keeps_the_fp32_modules_and_shapes_the_format_cannot_hold():
    """diffusers' quantizers always keep a model's `_keep_in_fp32_modules`: so does an explicit
    `modules_to_not_convert` (the docs' own `["adaln_proj"]`), and a layer whose shape the format cannot hold stays
    dense instead of failing."""
    from diffusers_h3.quantizers import NVFP4Config
    from diffusers_h3.testing.tiny import tiny_transformer

    torch.manual_seed(0)
    model = tiny_transformer()
    keep = model._keep_in_fp32_modules
    fp32_linears = {name for name, m in model.named_modules() if type(m) is nn.Linear and
                    any(part in keep for part in name.split("."))}  # fmt: skip
    assert fp32_linears  # proj_in, time_embedder.linear_1, proj_out, ...
    quantize(model, W8A16Config(modules_to_not_convert=["adaln_proj"]))
    quantized = {name for name, m in model.named_modules() if is_quantized_linear(m)}
    assert not quantized & fp32_linears, sorted(quantized & fp32_linears)
    assert not any("adaln_proj" in name for name in quantized) and any(".to_q" in name for name in quantized)
    # NVFP4 packs 16-value blocks: an 8-feature layer is left dense, as without a list.
    model = nn.ModuleDict({"narrow": nn.Linear(8, 8), "wide": nn.Linear(64, 64)})
    quantize(model, NVFP4Config(modules_to_not_convert=["other"]))
    assert not is_quantized_linear(model["narrow"]) and is_quantized_linear(model["wide"])
