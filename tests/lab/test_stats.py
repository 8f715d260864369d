"""The shared statistics (``fedsparse.lab.experiments.stats``), against scipy and values worked by
hand."""

from __future__ import annotations

import ast
import math
import random
import statistics
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as scipy_stats

from fedsparse.lab.experiments.stats import (
    CONFIDENCE,
    column_standard_errors,
    mean_se,
    paired_t_interval,
    ratio_interval,
    standard_error,
    t_interval,
)

ROOT = Path(__file__).resolve().parents[2]


def test_mean_se_by_hand() -> None:
    mean, se = mean_se([1, 2, 3, 4])  # var = (2.25 + .25 + .25 + 2.25) / 3 = 5/3
    assert mean == 2.5
    assert se == pytest.approx(math.sqrt(5 / 3 / 4), rel=1e-15)
    assert mean_se([0.7, 0.9])[1] == pytest.approx(0.1, rel=1e-12)  # |a - b| / 2
    mean, se = mean_se(iter([5.0]))  # any iterable; one value: no spread
    assert mean == 5.0 and math.isnan(se)
    assert all(math.isnan(x) for x in mean_se([]))
    assert all(type(x) is float for x in mean_se(np.array([1.0, 2.0])))


@pytest.mark.parametrize("n", [2, 3, 7, 30])
def test_standard_error_is_scipys_sem(n: int) -> None:
    x = np.random.default_rng(n).normal(3.0, 2.0, size=n)
    assert standard_error(x) == pytest.approx(float(scipy_stats.sem(x)), rel=1e-13)
    assert standard_error(list(x)) == standard_error(x)
    assert mean_se(x) == (float(np.mean(x)), standard_error(x))


def test_column_standard_errors_are_each_columns() -> None:
    rows = np.random.default_rng(5).normal(size=(4, 6))
    got = column_standard_errors(rows)
    assert got.shape == (6,)
    assert got == pytest.approx([standard_error(c) for c in rows.T], rel=1e-13)
    assert got == pytest.approx(scipy_stats.sem(rows, axis=0), rel=1e-13)
    assert np.isnan(column_standard_errors(rows[:1])).all()


def test_standard_error_needs_two_values() -> None:
    assert math.isnan(standard_error([]))
    assert math.isnan(standard_error([1.0]))
    assert standard_error([2.0, 2.0]) == 0.0


@pytest.mark.parametrize(("n", "confidence"), [(2, 0.95), (5, 0.95), (12, 0.9), (40, 0.99)])
def test_t_interval_is_scipys(n: int, confidence: float) -> None:
    x = np.random.default_rng(100 + n).normal(-1.0, 0.5, size=n)
    expected = scipy_stats.ttest_1samp(x, 0.0).confidence_interval(confidence)
    got = t_interval(x, confidence=confidence)
    assert got.n == n
    assert got.mean == pytest.approx(float(np.mean(x)), rel=1e-15)
    assert got.low == pytest.approx(expected.low, rel=1e-12)
    assert got.high == pytest.approx(expected.high, rel=1e-12)


def test_t_interval_known_value() -> None:
    # (0.19, 0.2, 0.21): mean 0.2, sd 0.01; t_{0.975, 2} = 4.302652729749464
    got = t_interval([0.19, 0.2, 0.21])
    half = 4.302652729749464 * 0.01 / math.sqrt(3)
    assert CONFIDENCE == 0.95
    assert got.mean == pytest.approx(0.2, rel=1e-14)
    assert (got.low, got.high) == pytest.approx((0.2 - half, 0.2 + half), rel=1e-12)


def test_t_interval_below_two_values() -> None:
    one = t_interval([0.3])
    assert (one.n, one.mean) == (1, 0.3) and math.isnan(one.low) and math.isnan(one.high)
    none = t_interval([])
    assert none.n == 0 and all(math.isnan(v) for v in none[1:])


@pytest.mark.parametrize("confidence", [0.0, 1.0, 95.0, -0.5])
def test_t_interval_refuses_a_confidence_outside_0_1(confidence: float) -> None:
    with pytest.raises(ValueError, match=f"confidence={confidence!r}"):
        t_interval([1.0, 2.0], confidence=confidence)


def test_paired_t_interval_is_scipys_paired_test() -> None:
    rng = np.random.default_rng(7)
    base = rng.normal(0.8, 0.05, size=6)
    arm = base + rng.normal(0.02, 0.01, size=6)
    seeds = [5, 1, 4, 0, 3, 2]  # dict order is not seed order
    a = {s: float(v) for s, v in zip(seeds, arm, strict=True)}
    b = {s: float(v) for s, v in zip(reversed(seeds), base[::-1], strict=True)}
    expected = scipy_stats.ttest_rel(arm, base).confidence_interval(0.95)
    got = paired_t_interval(a, b)
    assert got.n == 6
    assert got.low == pytest.approx(expected.low, rel=1e-12)
    assert got.high == pytest.approx(expected.high, rel=1e-12)
    assert got.low > 0  # a steady gain of 0.02 against a seed spread of 0.05: paired, it shows


def test_paired_t_interval_pairs_shared_keys_only() -> None:
    a = {0: 0.9, 1: 0.8, 2: 0.7, 9: 0.1}
    b = {0: 0.8, 1: 0.8, 2: 0.5, 7: 0.0}
    got = paired_t_interval(a, b)
    assert got.n == 3
    assert got.mean == pytest.approx(0.1, rel=1e-12)  # (0.1, 0.0, 0.2)
    assert got == t_interval([a[k] - b[k] for k in (0, 1, 2)])
    assert paired_t_interval({0: 1.0}, {1: 1.0}).n == 0


def _old_ratio_interval(num: list[float], den: list[float]) -> tuple[float, float, float]:
    """The estimator the benchmarks carried, written out independently (seed 0, 2000 draws)."""
    ratios = [a / b for a, b in zip(num, den, strict=True)]
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    return statistics.median(ratios), medians[50], medians[1950]


def test_ratio_interval_is_the_benchmarks_estimator() -> None:
    rng = random.Random(3)
    num = [1.0 + rng.random() for _ in range(15)]
    den = [1.0 + rng.random() for _ in range(15)]
    got = ratio_interval(num, den)
    assert got == _old_ratio_interval(num, den)  # exactly: the reports reprint the same
    median, low, high = got
    ratios = sorted(a / b for a, b in zip(num, den, strict=True))
    assert median == ratios[7]
    assert ratios[0] <= low < median < high <= ratios[-1]


def test_ratio_interval_seeded() -> None:
    num, den = [3.0, 2.0, 5.0, 4.0, 1.5], [1.0, 1.0, 2.0, 2.0, 1.0]  # ratios 3, 2, 2.5, 2, 1.5
    assert ratio_interval(num, den) == ratio_interval(num, den)
    assert ratio_interval(num, den)[0] == 2.0
    draws = {ratio_interval(num, den, seed=s, draws=40)[1:] for s in range(20)}
    assert len(draws) > 1  # the seed moves the resamples
    assert ratio_interval([2.0] * 4, [1.0] * 4) == (2.0, 2.0, 2.0)  # no spread: no width


def test_ratio_interval_covers_the_true_median_ratio() -> None:
    # Log-normal ratios of median exactly 2: the 95% interval holds 2 in most trials.
    rng = np.random.default_rng(11)
    covered = 0
    for seed in range(100):
        ratios = 2.0 * np.exp(rng.normal(0.0, 0.3, size=25))
        _, low, high = ratio_interval(list(ratios), [1.0] * 25, seed=seed, draws=400)
        covered += low <= 2.0 <= high
    assert covered >= 85  # binomial(100, ~0.95): 85 is about 4.5 SE below


@pytest.mark.parametrize(("num", "den"), [([1.0], [1.0, 2.0]), ([], [])])
def test_ratio_interval_refuses_unpaired_or_empty(num: list[float], den: list[float]) -> None:
    with pytest.raises(ValueError, match=f"len\\(num\\)={len(num)}, len\\(den\\)={len(den)}"):
        ratio_interval(num, den)


# The helpers above are the only copies: the modules that used to carry their own now import
# them (a copy that drifts would print a different number for the same data).
_COPIES = {"ratio_interval", "mean_se", "_se", "_mean_se", "standard_error", "t_interval"}


def test_no_module_defines_its_own_copy() -> None:
    paths = [*sorted((ROOT / "lab").glob("*.py")), *sorted((ROOT / "benchmarks").rglob("*.py"))]
    found = []
    for path in paths:
        if path.name == "stats.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name in _COPIES:
                if path.name == "reproduce.py" and node.name == "mean_se":
                    continue  # ArmResult.mean_se: a property calling stats.mean_se
                found.append(f"{path.relative_to(ROOT)}: {node.name}")
        if ".ppf(" in path.read_text():  # a t-interval computed by hand
            found.append(f"{path.relative_to(ROOT)}: .ppf(")
    assert found == []
