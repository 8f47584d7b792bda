"""Device-side numeric helpers shared by the kernels.

``round_to``: the store-side cast of an fp32 accumulator to the output dtype, round to nearest
even. Triton 3.9.0's interpreter truncates float32 -> bfloat16 casts (its ``rtne`` rounding mode
drops the mantissa carry: half of random values come out one ulp low), so under the interpreter
bf16 outputs are rounded by integer arithmetic instead; the compiled GPU path always uses the
hardware's round-to-nearest-even cast. The host picks the flag with
:func:`mqnc.triton_kernels._core.execution.bf16_rne_in_software`.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(y, dtype: tl.constexpr, BF16_RNE: tl.constexpr):
    """Round fp32 ``y`` to ``dtype``, to nearest even; with ``BF16_RNE`` in software (a NaN
    stays a NaN: the carry would move some NaN payloads into the exponent or sign, 0x7F800001
    to inf and 0x7FFFFFFF to -0.0, so NaNs are stored as the quiet NaN 0x7FC0)."""
    if BF16_RNE:
        u = y.to(tl.uint32, bitcast=True)
        u = u + 0x7FFF + ((u >> 16) & 1)
        u = tl.where(y != y, 0x7FC00000, u)
        return (u >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return y.to(dtype)
