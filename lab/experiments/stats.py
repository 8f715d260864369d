"""The statistics every report shares: mean and standard error, Student-t intervals, and the
bootstrap interval of a median ratio.

- ``mean_se``, ``standard_error`` and ``column_standard_errors`` (per column, for curves over
  runs): the standard error of the mean is the sample standard deviation (``ddof=1``) over
  ``sqrt(n)``; it is NaN for fewer than 2 values (one value says nothing about the spread),
  and the mean is NaN for none.
- ``t_interval`` and ``paired_t_interval``: the two-sided Student-t confidence interval of a
  mean, ``mean ± t_{(1+c)/2, n-1} · SE``, as ``scipy.stats.ttest_1samp(...).confidence_interval``
  computes it. Paired, the values are the differences ``a[k] - b[k]`` over the keys (seeds)
  both sides share, so the spread between seeds cancels. Below 2 values the bounds are NaN.
- ``ratio_interval``: the median of paired time ratios ``num[i] / den[i]`` (the two
  configurations timed in the same repetition, so drift of the machine cancels) and a 95%
  percentile-bootstrap interval of that median, from a seeded ``random.Random`` so a report
  reprints the same interval for the same timings.

Means are numpy's (pairwise summation); below 8 values that is the left-to-right sum, bit for
bit. Numbers come back as plain Python floats (``column_standard_errors``: a numpy array). The
module imports numpy and scipy, not torch: the benchmarks that do not load torch import it too.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Final, NamedTuple

import numpy as np
from scipy import stats

__all__ = [
    "BOOTSTRAP_DRAWS",
    "CONFIDENCE",
    "Interval",
    "column_standard_errors",
    "mean_se",
    "paired_t_interval",
    "ratio_interval",
    "standard_error",
    "t_interval",
]

#: The two-sided confidence level of the t-intervals unless a caller asks for another.
CONFIDENCE: Final = 0.95
#: Bootstrap resamples behind ``ratio_interval``.
BOOTSTRAP_DRAWS: Final = 2000


class Interval(NamedTuple):
    """A mean over ``n`` values and its confidence interval ``[low, high]``."""

    n: int
    mean: float
    low: float
    high: float


def mean_se(values: Iterable[float]) -> tuple[float, float]:
    """Mean and standard error (sample std / sqrt(n)); SE is NaN for n = 1, both for n = 0."""
    x = np.asarray([float(v) for v in values], dtype=np.float64)
    if x.size == 0:
        return math.nan, math.nan
    return float(x.mean()), standard_error(x)


def standard_error(values: Sequence[float] | np.ndarray) -> float:
    """Standard error of the mean: sample std (ddof 1) / sqrt(n); NaN below 2 values."""
    n = len(values)
    if n < 2:
        return math.nan
    return float(np.std(values, ddof=1)) / math.sqrt(n)


def column_standard_errors(rows: np.ndarray) -> np.ndarray:
    """``standard_error`` of every column of ``rows`` (runs x rounds, say); NaN below 2 rows."""
    n = rows.shape[0]
    if n < 2:
        return np.full(rows.shape[1:], math.nan)
    return np.asarray(rows.std(axis=0, ddof=1) / math.sqrt(n), dtype=np.float64)


def t_interval(values: Iterable[float], *, confidence: float = CONFIDENCE) -> Interval:
    """The mean of ``values`` and its two-sided Student-t interval at ``confidence``.

    Raises:
        ValueError: ``confidence`` outside (0, 1).
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence!r}: expected 0 < confidence < 1")
    x = [float(v) for v in values]
    mean, se = mean_se(x)
    n = len(x)
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * se if n >= 2 else math.nan
    return Interval(n=n, mean=mean, low=mean - half, high=mean + half)


def paired_t_interval(
    a: Mapping[int, float], b: Mapping[int, float], *, confidence: float = CONFIDENCE
) -> Interval:
    """``a - b`` paired by seed: the t-interval of the differences over the shared seeds.

    Seeds only one side has are left out (a failed run drops its seed from the pair). The
    differences are taken in seed order, so the result does not depend on dict order.
    """
    shared = sorted(set(a) & set(b))
    return t_interval([a[seed] - b[seed] for seed in shared], confidence=confidence)


def ratio_interval(
    num: Sequence[float], den: Sequence[float], *, draws: int = BOOTSTRAP_DRAWS, seed: int = 0
) -> tuple[float, float, float]:
    """Median of the paired ratios ``num[i] / den[i]`` and its 95% bootstrap interval.

    Each of ``draws`` resamples draws ``n`` ratios with replacement and takes their median;
    the interval is the 2.5th and 97.5th percentile of those medians (by rank, no
    interpolation). The ratio of two medians would pair nothing; the median of per-repetition
    ratios lets a slow moment of the machine cancel within its repetition.

    Raises:
        ValueError: ``num`` and ``den`` of different lengths, or empty.
    """
    if len(num) != len(den) or len(num) == 0:
        raise ValueError(f"len(num)={len(num)}, len(den)={len(den)}: expected equal, above 0")
    ratios = [x / y for x, y in zip(num, den, strict=True)]
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return statistics.median(ratios), medians[int(0.025 * draws)], medians[int(0.975 * draws)]
