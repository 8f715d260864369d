"""``all_finite``: whether a tensor holds no NaN or infinity, at the cost of one sum.

``torch.isfinite(t).all()`` writes a boolean tensor and reduces it: about 165 µs for 38k
float32 values on one core, where their sum takes about 30 µs. Under IEEE 754 a sum with a
NaN or an infinity among its terms is NaN or infinite whatever the order it adds them in (an
infinity plus a finite value stays infinite, opposite infinities give NaN, NaN stays NaN), so
a finite sum proves every term finite. The sum runs in float64: float32 (and narrower) values
cannot make it overflow (at most 3.4e38 per term, far below float64's 1.8e308 for any tensor
that fits in memory), so for them the element check runs only when a value is not finite.
A float64 tensor whose sum overflows falls back to the element check too, so the answer is
always exact; other dtypes (integer, complex) take the element check directly.

Its time depends on the values only through that: a non-finite float32 value (every caller
then refuses the tensor, with an error anyone who sees the outcome sees anyway), or an
overflowing float64 sum (the server's own data). It is not for a DP step's private per-sample
values, whose handling is branch-free (``common/dp/optimizer.py``, "Non-finite per-sample
gradients").
"""

from __future__ import annotations

import math

import torch

__all__ = ["all_finite"]

_SUMMED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def all_finite(values: torch.Tensor) -> bool:
    """Whether every entry of ``values`` is finite (exact, any dtype)."""
    if values.numel() == 0:
        return True
    if values.dtype in _SUMMED and math.isfinite(float(values.sum(dtype=torch.float64))):
        return True
    return bool(torch.isfinite(values).all())  # a NaN or infinity, or a float64 sum's overflow
