"""The transformers ``HfQuantizer`` of diffusers-h3's formats: :class:`TransformersQuantizerBase`. Each registered
format gets a subclass (``register_format`` makes it; ``register_quantizers`` adds it to transformers' auto maps with
``register_quantizer`` / ``register_quantization_config``), so a transformers model -- the Qwen3-VL text encoder --
takes our configs like any transformers quantization method:

- ``Model.from_pretrained(dense_folder, quantization_config=W8A16Config())`` gives the selected ``nn.Linear`` layers
  empty packed tensors and quantizes each weight into them as it arrives (transformers loads sequentially when it
  quantizes on the fly): the dense model never exists in full, in RAM or on the GPU;
- ``save_pretrained`` writes the packed tensors and ``config.json`` carries ``quantization_config``;
- ``from_pretrained(saved_folder)`` loads the packed tensors as stored (no cast, no re-quantization: bit-exact). A
  tensor of the wrong shape or dtype, or one that is missing, fails with one line.

After loading, each layer's packed tensors become its quantized weight. Layer selection, the staged layout, the
checks and dequantization are those of the diffusers quantizer
(:mod:`._replace`).
"""

from __future__ import annotations

from typing import Dict

import torch
from transformers.core_model_loading import ConversionOps
from transformers.quantizers.base import HfQuantizer

from .._utils import SAFETENSORS_DTYPES
from ._replace import (
    dequantize_layers,
    finish_loading,
    linears_to_quantize,
    match_bias_dtype,
    raise_if_missing,
    stage_for_loading,
)
from .config import QuantizationConfigBase
from .diffusers_quantizer import check_quantizer_config, default_dtype
from .layers import register_packed_state_dict
from .tensors import QuantizedTensor


def _shape_and_dtype(tensor):
    """Shape and dtype of a checkpoint tensor, without reading it when it is a lazy safetensors slice."""
    if isinstance(tensor, torch.Tensor):
        return tuple(tensor.shape), tensor.dtype
    name = tensor.get_dtype()
    return tuple(tensor.get_shape()), SAFETENSORS_DTYPES.get(name, name)


class QuantizeOnLoad(ConversionOps):
    """transformers' quantization op: turns one dense ``weight`` into the packed tensors of its (staged) layer."""

    def __init__(self, quantizer: "TransformersQuantizerBase"):
        self.quantizer = quantizer

    @torch.no_grad()
    def convert(self, input_dict: Dict[str, object], model=None, **kwargs) -> Dict[str, torch.Tensor]:
        out = {}
        for key, value in input_dict.items():
            dense = value[0] if isinstance(value, list) else value
            module_name = key.rpartition(".")[0]
            weight_cls = self.quantizer.weight_class
            options = weight_cls.full_options(self.quantizer.quantization_config.layer_kwargs())
            packed = weight_cls.pack(dense, options)
            out.update({f"{module_name}.{name}": tensor for name, tensor in packed.items()})
            self.quantizer._to_quantize.discard(module_name)
        return out


class TransformersQuantizerBase(HfQuantizer):
    """Shared implementation; a format's subclass only fixes ``config_class`` and ``weight_class``."""

    requires_calibration = False
    config_class = QuantizationConfigBase
    weight_class = QuantizedTensor

    def __init__(self, quantization_config, **kwargs):
        check_quantizer_config(self, quantization_config)
        super().__init__(quantization_config, **kwargs)
        self.dtype = None
        self.modules_to_not_convert = []
        self._to_quantize = set()  # on the fly: layers whose dense weight has not arrived yet
        self._expected = {}  # pre-quantized: storage key -> its layer, until the key arrives
        self._staged = []  # the layers given packed tensors to fill
        self._compute_dtype = None

    def update_dtype(self, dtype):
        self.dtype = default_dtype(dtype, self.quantization_config.quant_method)
        return self.dtype

    def validate_environment(self, *args, device_map=None, **kwargs):
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError("Disk offload of diffusers-h3 quantized models is not supported; use cpu or cuda.")

    def _process_model_before_weight_loading(self, model, dtype=None, **kwargs):
        config = self.quantization_config
        keep = list(getattr(model, "_keep_in_fp32_modules", None) or [])
        keep += list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
        names = linears_to_quantize(model, config, keep)
        chosen = set(names)
        self.modules_to_not_convert = [
            n for n, m in model.named_modules() if type(m) is torch.nn.Linear and n not in chosen
        ]
        self._compute_dtype = config.compute_dtype or dtype or self.dtype or torch.get_default_dtype()
        stage_for_loading(model, names, self.weight_class, config, self._compute_dtype)
        self._staged = names
        if self.pre_quantized:
            options = self.weight_class.full_options(config.layer_kwargs())
            self._expected = {
                f"{name}.{key}": model.get_submodule(name)
                for name in names
                for key in self.weight_class.storage_spec(model.get_submodule(name).out_features,
                                                          model.get_submodule(name).in_features, options)
            }  # fmt: skip
        else:
            self._to_quantize = chosen
        return model

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        module_name, _, tensor_name = param_name.rpartition(".")
        return not self.pre_quantized and tensor_name == "weight" and module_name in self._to_quantize

    def get_quantize_ops(self):
        return QuantizeOnLoad(self)

    def get_new_dtype(self, converter, param, dtype):
        """Pre-quantized: a packed tensor keeps its stored dtype (no cast: bit-exact) after its shape and dtype are
        checked against its layer, before anything is read."""
        targets = getattr(converter, "target_patterns", None) or [None]
        key = targets[0]
        layer = self._expected.pop(key, None) if self.pre_quantized else None
        if layer is None:
            return super().get_new_dtype(converter, param, dtype)
        shape, stored_dtype = _shape_and_dtype(param)
        options = self.weight_class.full_options(self.quantization_config.layer_kwargs())
        problem = self.weight_class.storage_mismatch(layer.out_features, layer.in_features, options,
                                                     key.rpartition(".")[2], shape, stored_dtype)  # fmt: skip
        if problem:
            raise ValueError(f"{key}: {problem}")
        return None

    def _process_model_after_weight_loading(self, model, **kwargs):
        raise_if_missing(list(self._expected) + [f"{name}.weight" for name in self._to_quantize])
        raise_if_missing(finish_loading(model, self._staged, self.weight_class, self.quantization_config,
                                        self._compute_dtype))  # fmt: skip
        match_bias_dtype(model)
        register_packed_state_dict(model)
        return model

    def _dequantize(self, model, dtype=None):
        return dequantize_layers(model, dtype)

    def is_serializable(self):
        return True

    @property
    def is_trainable(self):
        return False

    @property
    def is_compileable(self) -> bool:
        return False
