"""The registry of quantization formats: the built-in table, what derives from it (diffusers' auto maps, the CLI,
the exports), and a throwaway format registered in the test that every entry point picks up."""

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel
from diffusers.quantizers import auto as diffusers_auto

import diffusers_h3
from diffusers_h3 import cli
from diffusers_h3.kernels.gemm import w8a16_dequantize, w8a16_linear, w8a16_quantize
from diffusers_h3.quantizers import (
    FP8Config,
    FP8Tensor,
    NVFP4Config,
    NVFP4Tensor,
    QuantizationConfigBase,
    QuantizedTensor,
    QuantizerBase,
    W8A16Config,
    W8A16Tensor,
    format_names,
    formats,
    get_format,
    quantize,
    register_format,
    register_quantizers,
    unregister_format,
)
from diffusers_h3.quantizers.registry import format_for_config, quantizer_for

from ._helpers import rel, run_transformer


register_quantizers()

BUILTIN = {
    "fp8": ("h3_fp8", FP8Config, FP8Tensor),
    "w8a16": ("h3_w8a16", W8A16Config, W8A16Tensor),
    "nvfp4": ("h3_nvfp4", NVFP4Config, NVFP4Tensor),
}


def test_builtin_formats_table():
    assert format_names()[:3] == ("fp8", "w8a16", "nvfp4")
    for name, (method, config_cls, weight_cls) in BUILTIN.items():
        fmt = get_format(name)
        assert (fmt.method, fmt.config_cls, fmt.weight_cls) == (method, config_cls, weight_cls)
        assert issubclass(fmt.quantizer_cls, QuantizerBase)
        assert fmt.quantizer_cls.__name__ == config_cls.__name__.replace("Config", "Quantizer")
        assert (fmt.quantizer_cls.config_class, fmt.quantizer_cls.weight_class) == (config_cls, weight_cls)
        # the registration is the one place that names the method: config and layer read it from there
        assert config_cls().quant_method == method and config_cls().quant_method.value == method
        assert weight_cls.quant_method == method
        assert format_for_config(config_cls()) is fmt
    with pytest.raises(KeyError, match="registered formats"):
        get_format("int3")


def test_registered_with_diffusers_and_no_name_clash():
    for fmt in formats():
        assert diffusers_auto.AUTO_QUANTIZER_MAPPING[fmt.method] is fmt.quantizer_cls
        assert diffusers_auto.AUTO_QUANTIZATION_CONFIG_MAPPING[fmt.method] is fmt.config_cls
    from transformers.quantizers import auto as transformers_auto

    for fmt in formats():  # transformers knows them too (the text encoder), under the same prefixed methods
        assert transformers_auto.AUTO_QUANTIZER_MAPPING[fmt.method] is fmt.transformers_quantizer_cls
        assert transformers_auto.AUTO_QUANTIZATION_CONFIG_MAPPING[fmt.method] is fmt.config_cls
    assert {"fp8", "nvfp4"} <= set(transformers_auto.AUTO_QUANTIZER_MAPPING)  # why the methods carry a prefix
    # diffusers reads `quant_method.value` (an enum member for its own methods)
    assert W8A16Config().quant_method.value == "h3_w8a16"


def test_exports_and_cli_follow_the_registry():
    for fmt in formats():
        for cls in (fmt.config_cls, fmt.weight_cls):
            assert getattr(diffusers_h3.quantizers, cls.__name__) is cls
            assert cls.__name__ in diffusers_h3.quantizers.__all__
        assert getattr(diffusers_h3, fmt.config_cls.__name__) is fmt.config_cls
        assert type(cli._quant_config(fmt.name)) is fmt.config_cls
    # The CLI takes any name at parse time (--help imports no library) and checks it against the registry after.
    for name in format_names():
        cli._check_choices(_generate_parser().parse_args(["--prompt", "a cat", "--quantize", name]))
    with pytest.raises(cli.UsageError, match="unknown quantization format"):
        cli._check_choices(_generate_parser().parse_args(["--prompt", "a cat", "--quantize", "int3"]))


def test_register_format_refuses_bad_registrations():
    class LooseConfig(QuantizationConfigBase):
        pass

    with pytest.raises(ValueError, match="already registered"):
        register_format(name="w8a16", method="h3_other", config_cls=LooseConfig, weight_cls=W8A16Tensor)
    with pytest.raises(ValueError, match="already belongs to format 'w8a16'"):
        register_format(name="other", method="h3_w8a16", config_cls=LooseConfig, weight_cls=W8A16Tensor)
    with pytest.raises(ValueError, match="diffusers' own"):
        register_format(name="other", method="torchao", config_cls=LooseConfig, weight_cls=W8A16Tensor)
    with pytest.raises(ValueError, match="lowercase identifier"):
        register_format(name="Other-Format", method="h3_other", config_cls=LooseConfig, weight_cls=W8A16Tensor)
    with pytest.raises(TypeError, match="config_cls must subclass"):
        register_format(name="other", method="h3_other", config_cls=dict, weight_cls=W8A16Tensor)
    with pytest.raises(ValueError, match="W8A16Tensor already serves format 'w8a16'"):
        register_format(name="other", method="h3_other", config_cls=LooseConfig, weight_cls=W8A16Tensor)
    # an unregistered config class has no method: one clear error, no half-made config
    with pytest.raises(TypeError, match="register its format"):
        LooseConfig()
    assert "other" not in format_names()


# -- a throwaway format: a trivial config + layer on the existing W8A16 kernel ---------------------------------------


class ToyInt8Config(QuantizationConfigBase):
    """Per-channel int8 weights, run by the W8A16 torch reference."""


class ToyInt8Linear(QuantizedTensor):
    """The toy format's weight: per-channel int8 codes + fp32 scales."""

    layer_label = "ToyInt8Linear"

    @classmethod
    def storage_spec(cls, out_features, in_features, options):
        return {"weight": ((out_features, in_features), torch.int8), "weight_scale": ((out_features,), torch.float32)}

    @classmethod
    def pack(cls, dense, options):
        q, s = w8a16_quantize(dense)
        return {"weight": q, "weight_scale": s}

    def dequantize(self, dtype=None):
        return w8a16_dequantize(self.qdata, self.scale, dtype or self.dtype)

    def _select(self, device):
        return "torch", "toy format: the W8A16 torch reference"

    def _run(self, x, bias):
        return w8a16_linear(x, self.qdata, self.scale, bias, backend="torch")


@pytest.fixture
def toy_format():
    fmt = register_format(name="toyint8", method="h3test_toy_int8", config_cls=ToyInt8Config, weight_cls=ToyInt8Linear)
    try:
        yield fmt
    finally:
        unregister_format("toyint8")


def _generate_parser():
    parser = cli.build_parser()
    return next(a for a in parser._actions if a.dest == "command").choices["generate"]


def test_a_registered_format_reaches_every_entry_point(toy_format, dense_dir, tmp_path):
    # quantize(): the layer comes from the registry
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 16))
    x = torch.randn(5, 32)
    ref = net(x)
    quantize(net, ToyInt8Config())
    assert isinstance(net[0].weight, ToyInt8Linear) and isinstance(net[2].weight, ToyInt8Linear)
    assert net[0].weight.quant_method == "h3test_toy_int8" and "toy format" in net[0].weight.describe_path()
    assert rel(net(x), ref) < 0.02

    # the diffusers quantizer: on-the-fly quantization while loading, then save / reload through config.json
    assert diffusers_auto.AUTO_QUANTIZER_MAPPING["h3test_toy_int8"] is toy_format.quantizer_cls
    assert type(quantizer_for(ToyInt8Config())) is toy_format.quantizer_cls
    model = MiniMaxH3Transformer3DModel.from_pretrained(dense_dir, quantization_config=ToyInt8Config())
    assert isinstance(model.transformer_blocks[0].attn.to_q.weight, ToyInt8Linear)
    model.save_pretrained(tmp_path)
    reloaded = MiniMaxH3Transformer3DModel.from_pretrained(tmp_path)
    assert isinstance(reloaded.transformer_blocks[0].attn.to_q.weight, ToyInt8Linear)
    assert type(reloaded.config.quantization_config) is ToyInt8Config
    assert torch.equal(run_transformer(reloaded), run_transformer(model))

    # the transformers quantizer: the same format for a transformers model
    from transformers.quantizers import auto as transformers_auto

    assert transformers_auto.AUTO_QUANTIZER_MAPPING["h3test_toy_int8"] is toy_format.transformers_quantizer_cls

    # the CLI: a choice of --quantize, mapped to the format's config
    args = _generate_parser().parse_args(["--prompt", "a cat", "--quantize", "toyint8"])
    assert args.quantize == "toyint8" and type(cli._quant_config(args.quantize)) is ToyInt8Config


def test_unregistered_format_leaves_no_trace():
    register_format(name="toyint8", method="h3test_toy_int8", config_cls=ToyInt8Config, weight_cls=ToyInt8Linear)
    unregister_format("toyint8")
    assert "toyint8" not in format_names()
    assert "h3test_toy_int8" not in diffusers_auto.AUTO_QUANTIZER_MAPPING
    assert "h3test_toy_int8" not in diffusers_auto.AUTO_QUANTIZATION_CONFIG_MAPPING
    from transformers.quantizers import auto as transformers_auto

    assert "h3test_toy_int8" not in transformers_auto.AUTO_QUANTIZER_MAPPING
    assert "h3test_toy_int8" not in transformers_auto.AUTO_QUANTIZATION_CONFIG_MAPPING
    with pytest.raises(TypeError, match="register its format"):
        ToyInt8Config()
    with pytest.raises(cli.UsageError, match="toyint8: unknown quantization format"):
        cli._check_choices(_generate_parser().parse_args(["--prompt", "a cat", "--quantize", "toyint8"]))
