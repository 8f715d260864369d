"""``all_finite``: whether a tensor holds no NaN or infinity, at the cost of one sum.

``torch.isfinite(t).all()`` writes a boolean tensor and reduces it: about 165 µs for 38k
float32 values on one core, where their sum takes about 7 µs. Under IEEE 754 a sum with a
NaN or an infinity among its terms is NaN or infinite whatever the order it adds them in (an
infinity plus a finite value stays infinite, opposite infinities give NaN, NaN stays NaN), so
a finite sum proves every term finite. float32 and float64 tensors are summed in their own
dtype, float16 and bfloat16 in float32; a sum that is not finite (a NaN or an infinity, or
finite values whose total passes the dtype's largest) falls back to the element check, so the
answer is always exact; other dtypes (integer, complex) take the element check directly.

Its time depends on the values only through that: a non-finite value (every caller then
refuses the tensor, with an error anyone who sees the outcome sees anyway), or a finite
tensor whose sum overflows (values within a factor of its length of the dtype's largest). It
is not for a DP step's private per-sample values on a deployed node, whose handling is
branch-free (``common/dp/optimizer.py``, "Non-finite per-sample gradients").
"""

from __future__ import annotations

import math

import torch

__all__ = ["all_finite"]

#: The dtype each floating dtype is summed in.
_SUMMED = {
    torch.float16: torch.float32,
    torch.bfloat16: torch.float32,
    torch.float32: torch.float32,
    torch.float64: torch.float64,
}


def all_finite(values: torch.Tensor) -> bool:
    """Whether every entry of ``values`` is finite (exact, any dtype)."""
    if values.numel() == 0:
        return True
    dtype = _SUMMED.get(values.dtype)
    if dtype is not None and math.isfinite(float(values.sum(dtype=dtype))):
        return True
    return bool(torch.isfinite(values).all())  # a NaN or infinity, or a sum's overflow
