"""Decision of the low-precision attention that must not flip: INT8 Q/K runs natively from SM80 (A100, whose
tensor cores have INT8 MMA), FP8 from SM89 (Ada / Hopper); older GPUs emulate. The GPU is faked through
`torch.cuda.get_device_capability`."""

import pytest
import torch

from diffusers_h3.attention_processors import low_precision
from diffusers_h3.attention_processors.low_precision import MiniMaxH3LowPrecisionAttnProcessor


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the one-time "emulated here" warning
@pytest.mark.parametrize(
    "capability, int8_native, fp8_native",
    [((7, 0), False, False), ((7, 5), False, False), ((8, 0), True, False), ((8, 6), True, False),
     ((8, 9), True, True), ((9, 0), True, True), ((10, 0), True, True)],
)  # fmt: skip
def test_native_qk_thresholds(monkeypatch, capability, int8_native, fp8_native):
    monkeypatch.setattr(low_precision, "HAS_TRITON", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    device = torch.device("cuda:0")
    assert MiniMaxH3LowPrecisionAttnProcessor("int8").emulated(device) is not int8_native
    assert MiniMaxH3LowPrecisionAttnProcessor("fp8").emulated(device) is not fp8_native
