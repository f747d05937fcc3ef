"""The ``DiffusersQuantizer`` of diffusers-h3's formats: :class:`QuantizerBase`. Each registered format gets a
subclass that fixes its config and layer classes (``register_format`` makes it; diffusers' auto maps point to it).

Loading with ``Model.from_pretrained(..., quantization_config=W8A16Config())`` on a dense checkpoint quantizes each
selected ``nn.Linear`` as its weight arrives (``create_quantized_param``), so the dense model never exists in full.
Loading a checkpoint written by ``save_pretrained`` of a quantized model (``config.json`` holds the config) gives the
selected layers empty packed tensors in the checkpoint's names, fills them as they are (no re-quantization,
bit-exact) and folds each layer's tensors into its quantized weight after loading.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch
from diffusers.quantizers.base import DiffusersQuantizer
from diffusers.utils import logging
from torch import nn

from ._replace import (
    dequantize_layers,
    finish_loading,
    linears_to_quantize,
    match_bias_dtype,
    raise_if_missing,
    stage_for_loading,
)
from .config import QuantizationConfigBase
from .layers import install_quantized_weight, register_packed_state_dict
from .tensors import QuantizedTensor


logger = logging.get_logger(__name__)


_SCALE_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale")


class _KeepDtypeTensor(torch.Tensor):
    """A checkpoint scale that ignores the loader's cast to ``torch_dtype`` (fp32 scales must stay bit-exact).

    Only ``Tensor.to`` is intercepted (device moves pass, dtype changes are dropped); every other op returns a plain
    tensor, so the wrapper disappears right after the cast.
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            if func is torch.Tensor.to:
                device, _dtype, non_blocking, _fmt = torch._C._nn._parse_to(*args[1:], **kwargs)
                plain = args[0].as_subclass(torch.Tensor)
                if device is not None:
                    plain = plain.to(device=device, non_blocking=non_blocking)
                return plain.as_subclass(cls)
            result = func(*args, **kwargs)
        if isinstance(result, cls):
            return result.as_subclass(torch.Tensor)
        return result


def _as_device(device) -> torch.device:
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device if device is not None else "cpu")


def check_quantizer_config(quantizer, quantization_config) -> None:
    """A format's quantizer (diffusers' or transformers') takes the config of its own format only."""
    if type(quantizer).weight_class is QuantizedTensor:
        raise TypeError(f"{type(quantizer).__name__} has no weight class: use the quantizer of a registered format.")
    if not isinstance(quantization_config, quantizer.config_class):
        raise TypeError(
            f"{type(quantizer).__name__} needs a {quantizer.config_class.__name__}, got "
            f"{type(quantization_config).__name__}."
        )


def default_dtype(dtype, what: str) -> torch.dtype:
    """The dtype the unquantized tensors load in when none was passed: the one a dense model loads in (torch's default
    dtype), as transformers does for its quantizers."""
    if dtype is not None:
        return dtype
    dtype = torch.get_default_dtype()
    logger.info(
        f"No dtype passed with a {what} quantization_config: the unquantized layers load in {dtype} (torch's default "
        "dtype, as for a dense model). Pass dtype=torch.bfloat16 to keep them in 16-bit."
    )
    return dtype


class QuantizerBase(DiffusersQuantizer):
    """Shared implementation; a format's subclass only fixes ``config_class`` and ``weight_class``."""

    use_keep_in_fp32_modules = True
    requires_calibration = False
    config_class = QuantizationConfigBase
    weight_class = QuantizedTensor

    def __init__(self, quantization_config, **kwargs):
        check_quantizer_config(self, quantization_config)
        super().__init__(quantization_config, **kwargs)
        self.torch_dtype = None
        self.keep_in_fp32_modules: List[str] = []
        self._to_quantize = set()
        self._quantized_names = set()
        self._model = None

    # -- loader hooks ------------------------------------------------------------------------------------------------
    def validate_environment(self, *args, **kwargs):
        device_map = kwargs.get("device_map")
        if isinstance(device_map, dict) and self.pre_quantized and "disk" in device_map.values():
            raise ValueError("Disk offload of diffusers-h3 quantized checkpoints is not supported; use cpu or cuda.")

    def update_torch_dtype(self, torch_dtype):
        # diffusers sizes the model with this dtype (device_map="auto"): never leave it None
        self.torch_dtype = default_dtype(torch_dtype, self.quantization_config.quant_method)
        return self.torch_dtype

    def adjust_target_dtype(self, target_dtype):
        return torch.int8

    def _compute_dtype(self) -> torch.dtype:
        return self.quantization_config.compute_dtype or self.torch_dtype or torch.get_default_dtype()

    def _process_model_before_weight_loading(self, model, device_map=None, keep_in_fp32_modules=(), **kwargs):
        config = self.quantization_config
        self.keep_in_fp32_modules = [m for m in (keep_in_fp32_modules or []) if m]
        names = linears_to_quantize(model, config, self.keep_in_fp32_modules)
        self.modules_to_not_convert = [
            n for n, m in model.named_modules() if type(m) is nn.Linear and n not in set(names)
        ]
        self._model = model
        if self.pre_quantized:
            self._stage_packed_tensors(model, names)
        else:
            self._to_quantize = set(names)
        return model

    def _stage_packed_tensors(self, model, names) -> None:
        """Pre-quantized checkpoint: empty (meta) packed tensors on the selected layers; the loader fills them."""
        self._quantized_names = set(names)
        stage_for_loading(model, names, self.weight_class, self.quantization_config, self._compute_dtype())

    def maybe_update_state_dict(self, state_dict: Dict[str, Any]) -> Dict[str, Any]:
        """Pre-quantized: protect the tensors of quantized layers from the loader's dtype casts (the scales must stay
        fp32, and a tensor of the wrong dtype must reach :meth:`create_quantized_param` to be reported).

        A checkpoint without our ``quantization_config`` whose layers already carry ``weight_scale`` tensors (a
        ModelOpt-style export: ``weight``, ``weight_scale``, ``weight_scale_2``, ``input_scale``) is read as
        pre-quantized in the layout of the requested config, without re-quantizing; ``input_scale`` is unused."""
        if not self.pre_quantized and self._to_quantize:
            exported = {k.rpartition(".")[0] for k in state_dict if k.endswith(".weight_scale")}
            if exported & self._to_quantize:
                if not exported >= self._to_quantize and self._model is not None:
                    missing = sorted(self._to_quantize - exported)[:5]
                    raise ValueError(
                        f"The checkpoint holds pre-quantized layers (with `weight_scale`) but not for every layer "
                        f"{type(self.quantization_config).__name__} selects (e.g. {missing}); pass "
                        "modules_to_not_convert to match the export."
                    )
                self.pre_quantized = True
                self._stage_packed_tensors(self._model, sorted(self._to_quantize))
                self._to_quantize = set()
        if not self.pre_quantized:
            return state_dict
        storage = ("weight",) + tuple(s.lstrip(".") for s in _SCALE_SUFFIXES)
        for key, value in state_dict.items():
            module_name, _, tensor_name = key.rpartition(".")
            if tensor_name in storage and module_name in self._quantized_names:
                state_dict[key] = value.as_subclass(_KeepDtypeTensor)
        return state_dict

    def check_if_quantized_param(self, model, param_value, param_name, state_dict, **kwargs) -> bool:
        module_name, _, tensor_name = param_name.rpartition(".")
        if self.pre_quantized:
            return module_name in self._quantized_names and tensor_name in self._spec(model, module_name)
        return tensor_name == "weight" and module_name in self._to_quantize

    def _spec(self, model, module_name):
        linear = model.get_submodule(module_name)
        options = self.weight_class.full_options(self.quantization_config.layer_kwargs())
        return self.weight_class.storage_spec(linear.out_features, linear.in_features, options)

    def _mismatch(self, model, module_name, tensor_name, value) -> str:
        linear = model.get_submodule(module_name)
        options = self.weight_class.full_options(self.quantization_config.layer_kwargs())
        value = self.weight_class.normalize_loaded(tensor_name, value, linear.out_features)
        return self.weight_class.storage_mismatch(linear.out_features, linear.in_features, options, tensor_name,
                                                  value.shape, value.dtype)  # fmt: skip

    def check_quantized_param_shape(self, param_name, current_param, loaded_param):
        module_name, _, tensor_name = param_name.rpartition(".")
        if self._model is not None and module_name in self._quantized_names:
            # equivalent layouts of other exporters (e.g. a [1] global scale, [N, 1] channel scales) are accepted
            linear = self._model.get_submodule(module_name)
            normalized = self.weight_class.normalize_loaded(tensor_name, loaded_param, linear.out_features)
            if tuple(normalized.shape) == tuple(current_param.shape):
                return True
            problem = self._mismatch(self._model, module_name, tensor_name, loaded_param)
            raise ValueError(f"{param_name}: {problem}")
        raise ValueError(
            f"{param_name}: the checkpoint holds shape {tuple(loaded_param.shape)} but this model expects "
            f"{tuple(current_param.shape)}; the checkpoint was saved for another model config."
        )

    def create_quantized_param(self, model, param_value, param_name, target_device, state_dict=None,
                               unexpected_keys=None, **kwargs):  # fmt: skip
        module_name, _, tensor_name = param_name.rpartition(".")
        device = _as_device(target_device)
        if isinstance(param_value, _KeepDtypeTensor):
            param_value = param_value.as_subclass(torch.Tensor)
        linear = model.get_submodule(module_name)
        if self.pre_quantized:
            problem = self._mismatch(model, module_name, tensor_name, param_value)
            if problem:
                raise ValueError(f"{param_name}: {problem}")
            value = self.weight_class.normalize_loaded(tensor_name, param_value, linear.out_features).to(device)
            if tensor_name == "weight":
                linear.weight = nn.Parameter(value, requires_grad=False)
            else:
                linear._buffers[tensor_name] = value
            return
        config = self.quantization_config
        dense = param_value.to(device)
        weight = self.weight_class.from_float(dense, config.compute_dtype or dense.dtype, **config.layer_kwargs())
        install_quantized_weight(linear, weight)
        self._to_quantize.discard(module_name)

    def _process_model_after_weight_loading(self, model, **kwargs):
        missing = finish_loading(model, sorted(self._quantized_names), self.weight_class, self.quantization_config,
                                 self._compute_dtype())  # fmt: skip
        raise_if_missing(missing or [f"{name}.weight" for name in self._to_quantize])
        match_bias_dtype(model)
        register_packed_state_dict(model)
        model.register_to_config(quantization_config=self.quantization_config)
        self._model = None
        return model

    # -- capabilities ------------------------------------------------------------------------------------------------
    @property
    def supports_parallel_loading(self) -> bool:
        # create_quantized_param sets the weights of shared layers one tensor at a time and folds them at the end
        # (finish_loading); keep shard loading sequential.
        return False

    @property
    def is_serializable(self):
        return True

    @property
    def is_trainable(self):
        return False

    @property
    def is_compileable(self) -> bool:
        return False

    def _dequantize(self, model):
        return dequantize_layers(model)

