"""Triton twins of :mod:`diffusers_h3.kernels.numerics`: the number-format constants as ``tl.constexpr`` and the
round-to-nearest-even helpers that every Triton kernel of this package shares (one copy each).

The rounding helpers exist because the Triton interpreter's float32 -> float8 cast truncates instead of rounding to
nearest: kernels round on the E4M3 grid with integer exponent arithmetic first, so that the following cast is exact and
the interpreter, the GPU and the torch references (:func:`~diffusers_h3.kernels.numerics.round_to_e4m3`,
:func:`~diffusers_h3.kernels.numerics.round_to_e2m1`) agree bit for bit.
"""

from __future__ import annotations

from . import numerics
from ._triton_utils import HAS_TRITON


if HAS_TRITON:
    import triton
    import triton.language as tl

    E4M3_MAX = tl.constexpr(numerics.E4M3_MAX)
    E2M1_MAX = tl.constexpr(numerics.E2M1_MAX)
    INT8_MAX = tl.constexpr(numerics.INT8_MAX)
    LOG2E = tl.constexpr(numerics.LOG2E)

    @triton.jit
    def round_to_e4m3(y):
        """Round float32 ``|y| <= 448`` to the nearest E4M3 value (ties to even), as float32.

        Integer exponent arithmetic and the ``1.5 * 2**23`` trick: the quantum is ``2**(max(e, -6) - 3)`` for
        ``|y|`` in ``[2**e, 2**(e+1))`` (below ``2**-6`` E4M3 is subnormal with a fixed ``2**-9`` step). Values that
        round to zero (and -0.0) keep their sign, as torch's cast does.
        """
        signed_bits = y.to(tl.int32, bitcast=True)
        bits = signed_bits & 0x7FFFFFFF
        e = tl.maximum((bits >> 23) - 127, -6)
        step = ((e + 124) << 23).to(tl.float32, bitcast=True)  # 2**(e - 3)
        inv = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2**(3 - e)
        r = ((tl.abs(y) * inv + 12582912.0) - 12582912.0) * step
        # y's sign bit on the magnitude, so that a negative value that rounds to zero stays -0.0 (a select of -r / r
        # lost it when compiled for a GPU)
        return (r.to(tl.int32, bitcast=True) | (signed_bits & -2147483648)).to(tl.float32, bitcast=True)

    @triton.jit
    def round_to_e2m1(a):
        """Nearest E2M1 magnitude of ``0 <= a`` (ties to even, saturating at 6), as float32."""
        r = tl.where(a <= 0.25, 0.0, tl.where(a < 0.75, 0.5, tl.where(a <= 1.25, 1.0, tl.where(a < 1.75, 1.5, 2.0))))
        return tl.where(a <= 2.5, r, tl.where(a < 3.5, 3.0, tl.where(a <= 5.0, 4.0, E2M1_MAX)))

    @triton.jit
    def scale_to_e4m3(x, scale, SOFT_ROUND: tl.constexpr):
        """``x / scale`` (a true division, as torch's), saturated to ``±448``: float32 values that cast exactly to
        E4M3. ``SOFT_ROUND`` rounds on the E4M3 grid first (the interpreter's float8 cast truncates; GPUs round)."""
        y = tl.math.div_rn(x, scale)
        y = tl.minimum(tl.maximum(y, -E4M3_MAX), E4M3_MAX)
        if SOFT_ROUND:
            y = round_to_e4m3(y)
        return y
