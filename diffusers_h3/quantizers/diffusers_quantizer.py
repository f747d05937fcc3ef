"""The ``DiffusersQuantizer`` of diffusers-h3's formats: :class:`QuantizerBase`. Each registered format gets a
subclass that fixes its config and layer classes (``register_format`` makes it; diffusers' auto maps point to it).

Loading with ``Model.from_pretrained(..., quantization_config=W8A16Config())`` on a dense checkpoint quantizes each
selected ``nn.Linear`` as its weight arrives (``create_quantized_param``), so the dense model never exists in full.
Loading a checkpoint written by ``save_pretrained`` of a quantized model (``config.json`` holds the config) swaps the
layers on the meta device and installs the packed tensors as they are: no re-quantization, bit-exact.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch
from diffusers.quantizers.base import DiffusersQuantizer
from torch import nn

from ._replace import linears_to_quantize, set_submodule
from .config import QuantizationConfigBase
from .layers import QuantizedLinear


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


class QuantizerBase(DiffusersQuantizer):
    """Shared implementation; a format's subclass only fixes ``config_class`` and ``layer_class``."""

    use_keep_in_fp32_modules = True
    requires_calibration = False
    config_class = QuantizationConfigBase
    layer_class = QuantizedLinear

    def __init__(self, quantization_config, **kwargs):
        if type(self).layer_class is QuantizedLinear:
            raise TypeError(f"{type(self).__name__} has no layer class: use the quantizer of a registered format.")
        if not isinstance(quantization_config, self.config_class):
            raise TypeError(
                f"{type(self).__name__} needs a {self.config_class.__name__}, got {type(quantization_config).__name__}."
            )
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
        self.torch_dtype = torch_dtype
        return torch_dtype

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
            self._swap_to_empty_quantized(model, names)
        else:
            self._to_quantize = set(names)
        return model

    def _swap_to_empty_quantized(self, model, names) -> None:
        """Pre-quantized checkpoint: put empty (meta) quantized layers in place; the loader fills their storage."""
        config = self.quantization_config
        cls = self.layer_class
        self._quantized_names = set(names)
        for name in names:
            linear = model.get_submodule(name)
            with torch.device("meta"):
                layer = cls(
                    linear.in_features, linear.out_features, bias=linear.bias is not None,
                    compute_dtype=self._compute_dtype(), **config.layer_kwargs(),
                )  # fmt: skip
            set_submodule(model, name, layer)

    def maybe_update_state_dict(self, state_dict: Dict[str, Any]) -> Dict[str, Any]:
        """Pre-quantized: protect the tensors of quantized layers from the loader's dtype casts (the scales must stay
        fp32, and a tensor of the wrong dtype must reach :meth:`QuantizedLinear.load_quantized_` to be reported).

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
                self._swap_to_empty_quantized(self._model, sorted(self._to_quantize))
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
            module = model.get_submodule(module_name) if module_name else model
            return isinstance(module, QuantizedLinear) and tensor_name in module._storage_spec()
        return tensor_name == "weight" and module_name in self._to_quantize

    def check_quantized_param_shape(self, param_name, current_param, loaded_param):
        module_name, _, tensor_name = param_name.rpartition(".")
        module = self._model.get_submodule(module_name) if self._model is not None else None
        if isinstance(module, QuantizedLinear):
            # equivalent layouts of other exporters (e.g. a [1] global scale, [N, 1] channel scales) are accepted
            if tuple(module.normalize_loaded(tensor_name, loaded_param).shape) == tuple(current_param.shape):
                return True
        raise ValueError(
            f"{param_name}: the checkpoint holds shape {tuple(loaded_param.shape)} ({loaded_param.dtype}) but a "
            f"{self.quantization_config.quant_method.value} layer of this model expects {tuple(current_param.shape)} "
            f"({current_param.dtype}). The checkpoint was quantized with another method or for another model config; "
            "load it with the config it was saved with (config.json 'quantization_config')."
        )

    def create_quantized_param(self, model, param_value, param_name, target_device, state_dict=None,
                               unexpected_keys=None, **kwargs):  # fmt: skip
        module_name, _, tensor_name = param_name.rpartition(".")
        device = _as_device(target_device)
        if isinstance(param_value, _KeepDtypeTensor):
            param_value = param_value.as_subclass(torch.Tensor)
        if self.pre_quantized:
            module = model.get_submodule(module_name)
            module.load_quantized_({tensor_name: param_value.to(device)})
            return
        linear = model.get_submodule(module_name)
        config = self.quantization_config
        dense = param_value.to(device)
        compute_dtype = config.compute_dtype or dense.dtype
        layer = self.layer_class(
            linear.in_features, linear.out_features, bias=linear.bias is not None, compute_dtype=compute_dtype,
            device=device, **config.layer_kwargs(),
        )  # fmt: skip
        layer.requantize_(dense)
        if linear.bias is not None and linear.bias.device.type != "meta":
            layer.bias.data = linear.bias.detach().to(device, compute_dtype)
        set_submodule(model, module_name, layer)
        self._to_quantize.discard(module_name)

    def _process_model_after_weight_loading(self, model, **kwargs):
        missing = [
            f"{name}.{buf}"
            for name, m in model.named_modules()
            if isinstance(m, QuantizedLinear)
            for buf in m._storage_spec()
            if m.get_buffer(buf).device.type == "meta"
        ]
        if missing or self._to_quantize:
            raise ValueError(
                f"Quantized tensors missing from the checkpoint: {sorted(missing) or sorted(self._to_quantize)}. "
                "The checkpoint does not match this quantization config (another method, or a partial save)."
            )
        model.register_to_config(quantization_config=self.quantization_config)
        self._model = None
        return model

    # -- capabilities ------------------------------------------------------------------------------------------------
    @property
    def supports_parallel_loading(self) -> bool:
        # create_quantized_param swaps modules in place; keep shard loading sequential.
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
        for name, module in list(model.named_modules()):
            if isinstance(module, QuantizedLinear):
                dense = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                                  device=module.weight.device, dtype=module.compute_dtype)  # fmt: skip
                dense.weight.data = module.dequantize()
                if module.bias is not None:
                    dense.bias.data = module.bias.detach().clone()
                set_submodule(model, name, dense)
        return model

