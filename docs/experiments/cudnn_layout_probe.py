"""Probe (GPU): does cuDNN attention run slower on the strided views diffusers passes than on contiguous tensors?

The `exact` forward's profile puts 3.86 s in cuDNN attention (50 layers, 77 ms each) while the attention suite times
cuDNN at 72.3 ms on the same shape with contiguous ``(B, H, S, D)`` inputs. diffusers' ``_native_cudnn`` backend
passes ``(B, S, H, D)`` projections permuted to ``(B, H, S, D)`` views. This times, at the H3 shape (38,222 rows,
56 heads x 128, bf16), the cuDNN SDPA call on (a) those views, (b) contiguous copies (the copies not timed), (c) the
copies plus the call: if (c) beats (a), an exact processor that lays Q/K/V out first would speed up `exact`.

    PYTHONPATH=.:benchmarks python docs/experiments/cudnn_layout_probe.py OUT.json
"""

import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from _common import cuda_median_ms


ROWS, HEADS, DIM = 38222, 56, 128


def main(out):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, ROWS, HEADS, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    views = [t.permute(0, 2, 1, 3) for t in (q, k, v)]  # what diffusers' _native_cudnn hands to SDPA
    copies = [t.contiguous() for t in views]

    def attend(tensors):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(*tensors)

    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": {"rows": ROWS, "heads": HEADS, "head_dim": DIM},
        "strided_views_ms": round(cuda_median_ms(lambda: attend(views)), 3),
        "contiguous_ms": round(cuda_median_ms(lambda: attend(copies)), 3),
        "copy_then_contiguous_ms": round(cuda_median_ms(lambda: attend([t.contiguous() for t in views])), 3),
        "same_output": bool(torch.equal(attend(views), attend(copies))),
    }
    print(json.dumps(result, indent=1))
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
