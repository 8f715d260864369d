"""``all_finite``: whether a tensor holds no NaN or infinity, at the cost of one sum.

``torch.isfinite(t).all()`` writes a boolean tensor and reduces it: about 165 µs for 38k
float32 values on one core, where their sum takes about 30 µs. Under IEEE 754 a sum with a
NaN or an infinity among its terms is NaN or infinite whatever the order it adds them in (an
infinity plus a finite value stays infinite, opposite infinities give NaN, NaN stays NaN), so
a finite sum proves every term finite. A non-finite sum of finite terms (an overflow) falls
back to the element check, so the answer is always exact.

Its time depends on the values (the fallback runs only for a non-finite value or an overflowing
sum): use it on what is released anyway (an encoded update) or on the server's own data, never
inside a DP step on private per-sample values, whose handling is branch-free
(``common/dp/optimizer.py``, "Non-finite per-sample gradients").
"""

from __future__ import annotations

import math

import torch

__all__ = ["all_finite"]


def all_finite(values: torch.Tensor) -> bool:
    """Whether every entry of the floating-point tensor ``values`` is finite (exact)."""
    if values.numel() == 0:
        return True
    if math.isfinite(float(values.sum())):  # ~15 µs; torch.isfinite of the 0-d sum ~40
        return True
    return bool(torch.isfinite(values).all())  # an infinity or NaN, or the sum overflowed
