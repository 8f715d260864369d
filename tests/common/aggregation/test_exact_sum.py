"""Tests for fedsparse.common.aggregation.exact_sum: sums equal ``math.fsum``'s (the exactly
rounded sum), bit for bit, in every order, through every level of error terms."""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsparse.common.aggregation.exact_sum import ExactSum, exact_partials

_wide = st.builds(  # float64 values over 2**-200 .. 2**200, half of them cancelled later
    lambda m, e: m * 2.0**e,
    st.floats(min_value=-1.0, max_value=1.0, allow_nan=False),
    st.integers(-200, 200),
)


def _additions(
    rng: np.random.Generator, size: int, count: int
) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """``count`` (values, index or None) with exponents over 240 bits and exact cancellations."""
    out = []
    for _ in range(count):
        index = (
            None
            if rng.random() < 0.4
            else np.sort(rng.choice(size, rng.integers(0, size + 1), replace=False))
        )
        n = size if index is None else len(index)
        values = rng.standard_normal(n) * np.exp2(rng.integers(-120, 120, n))
        out.append((values, index))
        if rng.random() < 0.5:
            out.append((-values, index))
    return out


def _fsum(size: int, additions: list[tuple[np.ndarray, np.ndarray | None]]) -> torch.Tensor:
    terms: list[list[float]] = [[] for _ in range(size)]
    for values, index in additions:
        for i, v in zip(
            range(size) if index is None else index.tolist(), values.tolist(), strict=True
        ):
            terms[i].append(v)
    return torch.tensor([math.fsum(t) for t in terms], dtype=torch.float64)


def _summed(size: int, additions: list[tuple[np.ndarray, np.ndarray | None]]) -> ExactSum:
    acc = ExactSum(size)
    for values, index in additions:
        acc.add_(torch.from_numpy(values), None if index is None else torch.from_numpy(index))
    return acc


@pytest.mark.parametrize("seed", range(20))
def test_sums_are_fsums_bit_for_bit_in_any_order(seed: int) -> None:
    rng = np.random.default_rng(seed)
    size = int(rng.integers(1, 9))
    additions = _additions(rng, size, int(rng.integers(1, 30)))
    want = _fsum(size, additions)
    assert torch.equal(_summed(size, additions).value(), want)
    order = rng.permutation(len(additions))
    assert torch.equal(_summed(size, [additions[k] for k in order]).value(), want)


def test_plain_float64_sums_would_differ_and_every_error_level_is_used() -> None:
    """The second level's own errors (the third level) decide the result here."""
    big, one, tiny = 2.0**110, 1.0, 2.0**-60
    acc = ExactSum(1)
    for v in (big, one, tiny, -big, tiny * 2.0**-60):
        acc.add_(torch.tensor([v], dtype=torch.float64))
    assert len(acc._levels) == 3  # noqa: SLF001 - the third level was reached
    assert float(acc.value()[0]) == math.fsum([big, one, tiny, -big, tiny * 2.0**-60])
    assert ((big + one) + tiny) - big != math.fsum([big, one, tiny, -big])  # what it saves


def test_a_half_way_sum_rounds_to_even_like_fsum() -> None:
    acc = ExactSum(2)
    acc.add_(torch.tensor([1.0, 1.0 + 2.0**-52], dtype=torch.float64))
    acc.add_(torch.tensor([2.0**-53, 2.0**-53], dtype=torch.float64))
    acc.add_(torch.tensor([2.0**-120, -(2.0**-120)], dtype=torch.float64))  # off the half way
    want = [
        math.fsum([1.0, 2.0**-53, 2.0**-120]),
        math.fsum([1.0 + 2.0**-52, 2.0**-53, -(2.0**-120)]),
    ]
    assert acc.value().tolist() == want


@settings(derandomize=True, max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(_wide, _wide, _wide), min_size=1, max_size=20),
    st.randoms(use_true_random=False),
)
def test_merging_equals_adding_directly(rows: list[tuple[float, float, float]], rnd) -> None:
    index = torch.tensor([4, 0, 2])
    direct, part = ExactSum(5), ExactSum(3)
    for row in rows:
        direct.add_(torch.tensor(row, dtype=torch.float64), index)
        part.add_(torch.tensor(row, dtype=torch.float64))
    merged = ExactSum(5)
    merged.add_(torch.tensor([1.0, -3.0, 2.0**-80, 0.0, 7.0], dtype=torch.float64))
    direct.add_(torch.tensor([1.0, -3.0, 2.0**-80, 0.0, 7.0], dtype=torch.float64))
    part.merge_into(merged, index)
    assert torch.equal(merged.value(), direct.value())


def test_nothing_added_is_zero_and_the_empty_size_is_valid() -> None:
    assert torch.equal(ExactSum(3).value(), torch.zeros(3, dtype=torch.float64))
    assert ExactSum(0).value().shape == (0,)


@pytest.mark.parametrize(
    ("values", "index", "match"),
    [
        (torch.tensor([1.0, 2.0]), None, r"dtype torch.float32 .* expected float64 \(2,\)"),
        (torch.tensor([1.0], dtype=torch.float64), None, r"shape \(1,\): expected float64 \(2,\)"),
        (torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([1]), r"float64 \(1,\)"),
    ],
)
def test_a_wrong_dtype_or_length_is_refused_and_adds_nothing(
    values: torch.Tensor, index, match: str
) -> None:
    acc = ExactSum(2)
    acc.add_(torch.tensor([1.5, 0.0], dtype=torch.float64))
    with pytest.raises(ValueError, match=match):
        acc.add_(values, index)
    assert acc.value().tolist() == [1.5, 0.0]


@pytest.mark.parametrize(
    "values",
    [[1.0, math.nan], [math.inf, 1.0], [-math.inf, 0.0], [1e308, 0.0]],
    ids=["nan", "inf", "-inf", "overflow"],
)
@pytest.mark.parametrize("indexed", [False, True])
def test_a_non_finite_sum_is_refused_when_read(values: list[float], indexed: bool) -> None:
    """Sticky: a later addition cannot bring it back (inf - inf is NaN)."""
    acc = ExactSum(2)
    acc.add_(torch.tensor([1e308, 0.0], dtype=torch.float64))
    index = torch.tensor([0, 1]) if indexed else None
    acc.add_(torch.tensor(values, dtype=torch.float64), index)
    acc.add_(torch.tensor([-math.inf, 1.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="non-finite value was added, or a sum past"):
        acc.value()


def test_a_negative_size_and_a_mismatched_merge_are_refused() -> None:
    with pytest.raises(ValueError, match="size=-1: expected >= 0"):
        ExactSum(-1)
    with pytest.raises(ValueError, match="index covers 2 coordinates: expected 3"):
        ExactSum(3).merge_into(ExactSum(5), torch.tensor([0, 1]))


@settings(derandomize=True, max_examples=200, deadline=None)
@given(st.lists(_wide, max_size=30))
def test_partials_sum_exactly(values: list[float]) -> None:
    parts = exact_partials(values)
    assert sum(map(Fraction, parts), Fraction(0)) == sum(map(Fraction, values), Fraction(0))
    assert math.fsum(parts) == math.fsum(values)


def test_levels_stay_few_whatever_is_added() -> None:
    """Adversarial addends (every power of two from 2**-1000 to 2**1000, in an order that
    makes each addition round): memory stays ``levels x size``, the sum exact."""
    values = [2.0**e for e in range(1000, -1001, -37)] + [-(2.0**1000), 2.0**-1074]
    acc = ExactSum(3)
    for v in values:
        acc.add_(torch.tensor([v, -v, v / 3], dtype=torch.float64))
    assert 10 < len(acc._levels) <= 41  # noqa: SLF001 - 53 bits a level, 2,098 in all
    want = [math.fsum(values), math.fsum(-v for v in values), math.fsum(v / 3 for v in values)]
    assert acc.value().tolist() == want


def test_a_nan_does_not_grow_the_levels() -> None:
    acc = ExactSum(4)
    acc.add_(torch.tensor([1.0, 2.0**-80, 3.0, 4.0], dtype=torch.float64))
    for _ in range(5):
        acc.add_(torch.tensor([math.nan, 1.0, math.inf, 2.0**60], dtype=torch.float64))
    assert len(acc._levels) <= 2  # noqa: SLF001
    with pytest.raises(ValueError, match="non-finite"):
        acc.value()
