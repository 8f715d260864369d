"""Tests for fedsparse.common.aggregation.robust: coordinate-wise trimmed mean and median, L2
norm and clipping.

Oracles: ``scipy.stats.trim_mean`` and ``numpy.median`` on float64 copies (so a float32-max
pair averages without overflow, as the code under test does), column by column over the
covering rows. The code sums in float64 in another order and rounds once to float32, so the
comparisons allow one float32 rounding plus a float64 summation bound ``n eps64 max|v|``.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from fedsparse.common.aggregation.robust import (
    clip_to_norm,
    coordinate_median,
    l2_norm,
    trim_count,
    trimmed_mean,
)

F32_MAX = float(np.finfo(np.float32).max)
_EPS64 = 2.0**-52


# --- strategies and oracles -------------------------------------------------------------------

_any_value = st.floats(width=32, allow_nan=False, allow_infinity=False)
_fractions = st.sampled_from([0.0, 0.1, 0.2, 0.25, 1 / 3, 0.4, 0.49])


@st.composite
def matrices(draw: st.DrawFn, *, covered: bool) -> tuple[np.ndarray, np.ndarray]:
    """(n x k float32 values, n x k bool coverage: all True unless ``covered``)."""
    n = draw(st.integers(1, 9))
    k = draw(st.integers(1, 6))
    values = np.array(
        draw(st.lists(_any_value, min_size=n * k, max_size=n * k)), dtype=np.float32
    ).reshape(n, k)
    mask = np.ones((n, k), dtype=bool)
    if covered:
        mask = np.array(
            draw(st.lists(st.booleans(), min_size=n * k, max_size=n * k)), dtype=bool
        ).reshape(n, k)
    return values, mask


def column_oracle(values: np.ndarray, mask: np.ndarray, rule) -> np.ndarray:
    out = np.zeros(values.shape[1], dtype=np.float32)
    for j in range(values.shape[1]):
        column = values[mask[:, j], j].astype(np.float64)
        if column.size:
            out[j] = np.float32(rule(column))
    return out


def assert_close(got: torch.Tensor, want: np.ndarray, values: np.ndarray) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    scale = np.abs(values.astype(np.float64)).max(axis=0)
    atol = values.shape[0] * _EPS64 * scale + float(np.finfo(np.float32).smallest_subnormal)
    err = np.abs(got.numpy().astype(np.float64) - want.astype(np.float64))
    assert (err <= 2.0**-23 * np.abs(want.astype(np.float64)) + atol).all(), (got, want)


# --- oracles ----------------------------------------------------------------------------------


@settings(derandomize=True, max_examples=200, deadline=None)
@given(matrices(covered=False), _fractions)
def test_trimmed_mean_is_scipys_trim_mean_per_coordinate(case, fraction: float) -> None:
    values, mask = case
    got = trimmed_mean(torch.from_numpy(values), trim_fraction=fraction)
    assert_close(got, column_oracle(values, mask, lambda c: stats.trim_mean(c, fraction)), values)


@settings(derandomize=True, max_examples=200, deadline=None)
@given(matrices(covered=True), _fractions)
def test_trimmed_mean_uses_only_the_updates_covering_each_coordinate(case, fraction) -> None:
    values, mask = case
    got = trimmed_mean(
        torch.from_numpy(values), trim_fraction=fraction, covered=torch.from_numpy(mask)
    )
    assert_close(got, column_oracle(values, mask, lambda c: stats.trim_mean(c, fraction)), values)


@settings(derandomize=True, max_examples=200, deadline=None)
@given(matrices(covered=True))
def test_median_is_numpys_median_of_the_covering_updates(case) -> None:
    values, mask = case
    got = coordinate_median(torch.from_numpy(values), covered=torch.from_numpy(mask))
    # The mean of two float32 values in float64 is exact: one rounding to float32, equal.
    np.testing.assert_array_equal(got.numpy(), column_oracle(values, mask, np.median))


@settings(derandomize=True, max_examples=100, deadline=None)
@given(matrices(covered=False), st.integers(0, 2**32 - 1))
def test_the_order_of_the_updates_does_not_matter(case, seed: int) -> None:
    values, _ = case
    perm = np.random.default_rng(seed).permutation(values.shape[0])
    x, y = torch.from_numpy(values), torch.from_numpy(values[perm])
    assert torch.equal(coordinate_median(x), coordinate_median(y))
    assert_close(
        trimmed_mean(y, trim_fraction=0.2),
        trimmed_mean(x, trim_fraction=0.2).numpy(),
        values,
    )


# --- robustness -------------------------------------------------------------------------------


@pytest.mark.parametrize("attack", [1e30, -1e30, F32_MAX, -F32_MAX])
def test_one_arbitrary_update_of_five_stays_within_the_honest_range(attack: float) -> None:
    honest = torch.tensor(
        [[0.1, -0.2, 0.3], [0.2, -0.1, 0.1], [0.15, -0.3, 0.2], [0.05, -0.25, 0.4]]
    )
    values = torch.cat([honest, torch.full((1, 3), attack)])
    low, high = honest.min(dim=0).values, honest.max(dim=0).values
    for robust in (trimmed_mean(values, trim_fraction=0.2), coordinate_median(values)):
        assert torch.isfinite(robust).all()
        assert (low <= robust).all() and (robust <= high).all()
    # Exactly: 5 values, t = 1 dropped at each end, so the attacker and one extreme honest
    # value go; the median is the 3rd of 5.
    side = 0 if attack > 0 else -1  # which honest extreme survives
    sorted_honest = honest.double().sort(dim=0).values
    kept = sorted_honest[1:] if attack > 0 else sorted_honest[:-1]
    torch.testing.assert_close(
        trimmed_mean(values, trim_fraction=0.2), kept.mean(dim=0).float(), rtol=0, atol=1e-7
    )
    assert torch.equal(coordinate_median(values), sorted_honest[2 + side].float())
    # The plain mean is wrecked (what the default aggregator relies on the norm bound for).
    assert trimmed_mean(values, trim_fraction=0.0).abs().min() > 1e29


def test_float32_max_values_average_without_overflow() -> None:
    values = torch.full((3, 2), F32_MAX)
    values[:, 1] = -F32_MAX
    assert torch.equal(trimmed_mean(values, trim_fraction=0.0), torch.tensor([F32_MAX, -F32_MAX]))
    assert torch.equal(coordinate_median(values[:2]), torch.tensor([F32_MAX, -F32_MAX]))


# --- trim-fraction edge cases -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("count", "fraction", "trimmed"),
    [
        (1, 0.49, 0),
        (2, 0.49, 0),
        (3, 0.49, 1),
        (4, 0.2, 0),  # 0.8 rounds down: nothing trimmed, the plain mean
        (5, 0.2, 1),
        (9, 0.2, 1),
        (10, 0.2, 2),
        (10, 0.1, 1),  # 0.1 * 10 is exactly 1.0 in float64
        (7, 0.0, 0),
    ],
)
def test_trim_count_is_floor_of_fraction_times_count(count, fraction, trimmed) -> None:
    assert trim_count(count, fraction) == trimmed
    values = torch.arange(count, dtype=torch.float32).unsqueeze(1) ** 2  # skewed
    expected = float(np.mean(np.arange(count, dtype=np.float64)[trimmed : count - trimmed] ** 2))
    assert float(trimmed_mean(values, trim_fraction=fraction)[0]) == pytest.approx(expected)


def test_near_half_trimming_of_an_odd_count_is_the_median() -> None:
    values = torch.tensor([[5.0], [-1.0], [1e30]])
    assert float(trimmed_mean(values, trim_fraction=0.49)[0]) == 5.0
    assert float(coordinate_median(values)[0]) == 5.0


def test_even_count_median_is_the_mean_of_the_middle_two() -> None:
    values = torch.tensor([[1.0, 0.0], [2.0, 0.0], [10.0, 0.0], [-4.0, 1.0]])
    assert coordinate_median(values).tolist() == [1.5, 0.0]


def test_uncovered_coordinates_are_zero_and_ignore_their_values() -> None:
    values = torch.tensor([[1.0, 7.0, 1e30], [3.0, 9.0, 2.0]])
    covered = torch.tensor([[True, False, False], [True, False, True]])
    assert trimmed_mean(values, trim_fraction=0.2, covered=covered).tolist() == [2.0, 0.0, 2.0]
    assert coordinate_median(values, covered=covered).tolist() == [2.0, 0.0, 2.0]
    assert coordinate_median(torch.zeros(0, 3)).tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("fraction", [0.5, -0.1, math.nan, 1.0])
def test_a_trim_fraction_outside_0_to_half_is_an_error(fraction: float) -> None:
    with pytest.raises(ValueError, match=r"trim_fraction=.*expected 0 <= f < 0.5"):
        trimmed_mean(torch.zeros(3, 2), trim_fraction=fraction)


def test_bad_inputs_are_named() -> None:
    with pytest.raises(ValueError, match=r"values has shape \(3,\): expected \(n, k\)"):
        coordinate_median(torch.zeros(3))
    with pytest.raises(ValueError, match="covered has shape"):
        coordinate_median(torch.zeros(3, 2), covered=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="values: non-finite"):
        trimmed_mean(torch.tensor([[1.0], [math.inf]]), trim_fraction=0.2)
    # a non-finite value where nobody covers the coordinate is ignored
    nan_uncovered = coordinate_median(
        torch.tensor([[1.0], [math.nan]]), covered=torch.tensor([[True], [False]])
    )
    assert nan_uncovered.tolist() == [1.0]


# --- norm and clipping ----------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [2.5, 1e30, F32_MAX])
def test_clip_scales_down_to_exactly_the_bound_and_keeps_the_direction(scale: float) -> None:
    direction = torch.tensor([3.0, -4.0, 0.0, 12.0]) / 13.0
    values = (direction.double() * scale).float()
    clipped = clip_to_norm(values, bound=2.0)
    assert math.isclose(l2_norm(clipped), 2.0, rel_tol=1e-6)
    torch.testing.assert_close(clipped / 2.0, direction, rtol=1e-6, atol=0)


def test_clip_leaves_updates_at_or_under_the_bound_untouched() -> None:
    values = torch.tensor([3.0, 4.0])
    assert clip_to_norm(values, bound=5.0) is values  # exactly at the bound
    assert clip_to_norm(values, bound=6.0) is values
    assert clip_to_norm(values, bound=0.0).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="bound=nan"):
        clip_to_norm(values, bound=math.nan)


def test_norm_of_float32_max_values_does_not_overflow() -> None:
    values = torch.full((38_282,), F32_MAX)
    assert l2_norm(values) == pytest.approx(F32_MAX * math.sqrt(38_282), rel=1e-12)
