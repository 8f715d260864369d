"""Exact, order-free sums of float64 vectors: ``ExactSum``.

``ExactSum(size)`` accumulates float64 vectors (dense, or on int64 indices) and returns, at
each coordinate, the float64 nearest to the exact real sum of everything added there (ties to
even): the same number whatever the order of the additions, so a server can sum updates as
they arrive, without holding them, and its model does not depend on arrival order.

Each addition is Knuth's TwoSum, ``t = fl(s + v)`` and its exact error
``e = (s - (t - b)) + (v - b)`` with ``b = t - s``, so that ``s + v = t + e`` exactly
(round-to-nearest, no overflow). The errors are rare and small (an addition rounds only where
a coordinate's addends span more than 53 bits): they go into a second accumulator the same
way, that one's errors into a third, and so on (a few levels at most carry anything; memory
``levels x size`` float64 and three ``size`` buffers for dense additions, whatever was
added). The exact sum at a coordinate is the sum of its levels: ``fl(s + c)`` is its
correctly rounded value where only two carry anything (one IEEE addition of the two terms
whose exact sum it is), ``math.fsum`` (exactly rounded) where more do. Honest updates stay
within two levels; addends built to round at every level (a client sending values like
``2**-70`` and ``2**-149`` beside others near 1: tiny norms, so no norm bound stops them)
reach ``fsum`` at most coordinates, about 1 us each: 35 ms a round for a 38k-parameter
model, 9 s for 10 million (measured by a reviewer), and a few levels of memory.

Edge cases: nothing added gives zeros; a non-finite addend, or a sum past float64's range,
breaks the error terms' exactness: it stays in the sums (inf and NaN do) and ``value``
refuses it (``ValueError``) rather than return a number that depends on the order. Cost:
six passes over the added coordinates (about six plain float64 additions; a gather and a
scatter more for indexed ones), against the 32-byte SHA-256 a canonical order would need.
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["ExactSum", "exact_partials"]


#: More levels than any float64 sum needs: an error of an addition into a level is at most
#: 2**-53 of that level's sum, itself at most the number of additions into it times the level
#: above's largest error, and sums of subnormals are exact; from 2**1024 down to 2**-1074 that
#: is about 40 levels for a few additions (measured: 38, adversarially ordered) and under 100
#: for 2**30 additions a coordinate. Memory: ``levels x size`` float64, whatever is added.
MAX_LEVELS = 128


class ExactSum:
    """Exact, order-free sums of float64 addends at ``size`` coordinates."""

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"size={size}: expected >= 0")
        self.size = size
        # levels[0]: the sums; levels[k + 1]: the errors of the additions into levels[k],
        # summed the same way (allocated when an addition first rounds there)
        self._levels: list[np.ndarray] = [np.zeros(size)]
        self._scratch: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # dense adds'

    def add_(self, values: torch.Tensor, index: torch.Tensor | None = None) -> None:
        """Adds ``values`` (float64, on the CPU) at every coordinate, or at the distinct int64
        ``index``.

        Raises:
            ValueError: a length other than ``size`` (or ``index``'s), or another dtype.
        """
        expected = self.size if index is None else index.numel()
        if values.dtype != torch.float64 or values.shape != (expected,):
            raise ValueError(
                f"values has dtype {values.dtype} and shape {tuple(values.shape)}: expected "
                f"float64 ({expected},)"
            )
        where = None if index is None else index.numpy()
        with np.errstate(over="ignore", invalid="ignore"):  # value() refuses what they flag
            v = values.detach().numpy()
            errors = self._dense(v) if where is None else _two_sum(self._levels[0], v, where)
            level = 1
            while errors is not None:
                at, error = errors
                if level == MAX_LEVELS or not np.isfinite(error).all():
                    self._levels[0][at] = math.nan  # a non-finite sum: value() refuses it
                    return
                if level == len(self._levels):
                    self._levels.append(np.zeros(self.size))
                errors = _two_sum(self._levels[level], error, at)
                level += 1

    def _dense(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """``levels[0] += values``; (coordinates, exact errors) where it rounded."""
        if self._scratch is None:
            self._scratch = (np.empty(self.size), np.empty(self.size), np.empty(self.size))
        t, b, e = self._scratch
        s = self._levels[0]
        np.add(s, values, out=t)
        np.subtract(t, s, out=b)
        np.subtract(t, b, out=e)
        np.subtract(s, e, out=e)  # s - (t - b)
        np.subtract(values, b, out=b)
        np.add(e, b, out=e)  # the error: s + values = t + e exactly
        self._levels[0], self._scratch = t, (s, b, e)  # t is the sum now: no copy
        if not e.any():
            return None
        at = np.flatnonzero(e)
        return at, e[at]

    def merge_into(self, other: ExactSum, index: torch.Tensor | None = None) -> None:
        """Adds this accumulator's exact sums into ``other`` (at ``index``, distinct int64
        indices of ``other``, one per coordinate of this one; None: the same coordinates)."""
        covers = other.size if index is None else index.numel()
        if covers != self.size:
            raise ValueError(f"index covers {covers} coordinates: expected {self.size}")
        for level in self._levels:
            other.add_(torch.from_numpy(level), index)

    def value(self) -> torch.Tensor:
        """The correctly rounded exact sums (float64, ``size``).

        Raises:
            ValueError: a value added was not finite, or a sum passed float64's range (both
                stay in the sums: they are checked here, once, not at every addition).
        """
        levels = self._levels
        with np.errstate(over="ignore", invalid="ignore"):
            out = levels[0].copy() if len(levels) == 1 else levels[0] + levels[1]
            if len(levels) > 2:  # s + c rounds once, correctly, where nothing more is left
                more = levels[2] != 0
                for level in levels[3:]:
                    more |= level != 0
                for i in np.flatnonzero(more).tolist():  # about 1 us each (measured)
                    out[i] = math.fsum(float(level[i]) for level in levels)
            finite = bool(np.isfinite(out).all())
        if not finite:
            raise ValueError("sums: a non-finite value was added, or a sum past float64's range")
        return torch.from_numpy(out)


def _two_sum(
    total: np.ndarray, values: np.ndarray, index: np.ndarray
) -> tuple[np.ndarray, np.ndarray] | None:
    """``total[index] += values`` (distinct indices); (coordinates, exact errors) where it
    rounded."""
    s = total[index]
    t = s + values
    b = t - s
    e = (s - (t - b)) + (values - b)
    total[index] = t
    if not e.any():
        return None
    at = np.flatnonzero(e)
    return index[at], e[at]


def exact_partials(values: list[float]) -> list[float]:
    """Non-overlapping floats whose exact sum is the exact sum of ``values`` (Shewchuk's
    partials, as ``math.fsum`` keeps them; usually one): scalars summed without rounding."""
    partials: list[float] = []
    for x in values:
        i = 0
        for y in partials:
            if abs(x) < abs(y):
                x, y = y, x
            high = x + y
            low = y - (high - x)
            if low:
                partials[i] = low
                i += 1
            x = high
        partials[i:] = [x]
    return [p for p in partials if p]
