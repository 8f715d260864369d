"""Tests for fedsparse.common.aggregation.sparse: sparse-aware FedAvg against independent numpy
oracles.

The oracles below never touch ``SparseAggregator``'s internals: they loop over clients and
coordinates in float64 numpy, ``mean_i = sum_{c covers i} n_c v_c[i] / sum_{c covers i} n_c``.
Comparisons allow one float32 rounding of the result plus a float64 rounding bound
(``k * eps64 * sum_c n_c |v_c[i]| / W_i``); ``exact_mean`` is the exact contract, by rationals
(the sums exact, rounded once to float64, divided, rounded to float32).
"""

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsparse.common.aggregation.sparse import (
    RobustAggregator,
    SparseAggregator,
    make_aggregator,
)

_EPS32 = 2.0**-23  # float32 rounding of the float64 mean: <= 2**-24 relative; doubled margin
_EPS64 = 2.0**-52
_TINY32 = float(np.finfo(np.float32).smallest_subnormal)


@dataclass(frozen=True)
class Update:
    weight: float
    support: np.ndarray | None  # sorted unique int64 indices, or None for dense
    values: np.ndarray  # float32, one per support entry (dense_size if support is None)


# --- strategies and oracles -------------------------------------------------------------------

_values = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, width=32)
_weights = st.one_of(
    st.integers(1, 10_000).map(float),  # example counts, as the server passes them
    st.floats(min_value=1e-3, max_value=1e4, allow_nan=False, allow_infinity=False),
)


@st.composite
def updates(
    draw: st.DrawFn, *, dense_size: int, shared_support: np.ndarray | None | str = "free"
) -> Update:
    """One client's update; ``shared_support`` fixes the support (``"free"``: drawn here)."""
    if isinstance(shared_support, str):
        if draw(st.booleans()):
            support = None
        else:
            chosen = draw(st.sets(st.integers(0, max(dense_size - 1, 0)), max_size=dense_size))
            support = np.array(sorted(chosen), dtype=np.int64)
    else:
        support = shared_support
    n = dense_size if support is None else len(support)
    values = np.array(draw(st.lists(_values, min_size=n, max_size=n)), dtype=np.float32)
    return Update(weight=draw(_weights), support=support, values=values)


@st.composite
def rounds(draw: st.DrawFn, *, max_size: int = 24, max_clients: int = 6) -> tuple[int, list]:
    """(dense_size, updates) with supports drawn independently per client."""
    dense_size = draw(st.integers(0, max_size))
    clients = draw(st.lists(updates(dense_size=dense_size), min_size=1, max_size=max_clients))
    return dense_size, clients


def aggregate(dense_size: int, clients: list[Update]) -> SparseAggregator:
    agg = SparseAggregator(dense_size)
    for u in clients:
        support = None if u.support is None else torch.from_numpy(u.support)
        agg.add(torch.from_numpy(u.values), support=support, weight=u.weight)
    return agg


def value_at(u: Update, i: int) -> float | None:
    """``u``'s value at coordinate ``i`` (None: its support does not cover it)."""
    if u.support is None:
        return float(u.values[i])
    if i in u.support:
        return float(u.values[list(u.support).index(i)])
    return None


def oracle(dense_size: int, clients: list[Update]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(weighted mean, covered mask, per-coordinate error scale), coordinate by coordinate."""
    mean = np.zeros(dense_size, dtype=np.float64)
    covered = np.zeros(dense_size, dtype=bool)
    scale = np.zeros(dense_size, dtype=np.float64)
    for i in range(dense_size):
        num = den = mag = 0.0
        for u in clients:
            v = value_at(u, i)
            if v is None:
                continue
            num += u.weight * v
            den += u.weight
            mag += u.weight * abs(v)
        if den > 0:
            covered[i] = True
            mean[i] = num / den
            scale[i] = mag / den
    return mean, covered, scale


def assert_mean_close(
    actual: torch.Tensor, expected: np.ndarray, scale: np.ndarray, *, terms: int
) -> None:
    """|actual - expected| <= one float32 rounding + float64 summation error of ``terms``."""
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    got = actual.numpy().astype(np.float64)
    bound = _EPS32 * np.abs(expected) + 4 * terms * _EPS64 * scale + _TINY32
    bad = np.abs(got - expected) > bound
    assert not bad.any(), (got[bad], expected[bad], bound[bad])


# --- (a) order invariance ---------------------------------------------------------------------


@settings(derandomize=True, max_examples=100, deadline=None)
@given(rounds(), st.randoms(use_true_random=False))
def test_order_of_arrival_does_not_matter(round_: tuple[int, list], rnd) -> None:
    """Bit for bit: the sums are exact, so no order rounds them differently."""
    dense_size, clients = round_
    shuffled = list(clients)
    rnd.shuffle(shuffled)
    a = aggregate(dense_size, clients).mean_update()
    b = aggregate(dense_size, shuffled).mean_update()
    assert torch.equal(a, b)
    _, covered, _ = oracle(dense_size, clients)
    assert torch.equal(a[torch.from_numpy(~covered)], torch.zeros(int((~covered).sum())))


def exact_mean(dense_size: int, clients: list[Update]) -> torch.Tensor:
    """The aggregator's result by exact rationals: at each coordinate, the float64 nearest
    the exact sum of the products ``fl(v x w)`` over that nearest the exact sum of ``w``,
    divided once in float64 and rounded to float32 (``SparseAggregator``'s contract)."""
    out = np.zeros(dense_size, dtype=np.float64)
    for i in range(dense_size):
        num, den = Fraction(0), Fraction(0)
        for u in clients:
            v = value_at(u, i)
            if v is None:
                continue
            num += Fraction(v * u.weight)  # fl(v x w): one float64 rounding
            den += Fraction(u.weight)
        if den:
            out[i] = float(num) / float(den)  # float(Fraction) rounds correctly
    return torch.from_numpy(out.astype(np.float32))


_wide = st.builds(  # float32 values over 2**-60 .. 2**60: float64 sums of them round
    lambda m, e: float(np.float32(m * 2.0**e)),
    st.floats(min_value=-1.0, max_value=1.0, allow_nan=False, width=32),
    st.integers(-60, 60),
)


@settings(derandomize=True, max_examples=200, deadline=None)
@given(
    st.integers(1, 4),
    st.lists(
        st.tuples(st.lists(_wide, min_size=4, max_size=4), st.integers(1, 10**6)),
        min_size=1,
        max_size=12,
    ),
    st.randoms(use_true_random=False),
)
def test_the_mean_is_the_exactly_summed_one_in_any_order(
    width: int, drawn: list[tuple[list[float], int]], rnd
) -> None:
    """Addends spanning 120 bits that cancel (where float64 sums in arrival order lose the
    small ones in some orders): equal, bit for bit, to exact rationals' result, in the order
    drawn and shuffled."""
    clients = []
    for k, (values, weight) in enumerate(drawn):
        support = None if k % 3 == 0 else np.arange(4 - width, 4, dtype=np.int64)
        chosen = np.array(values if support is None else values[:width], dtype=np.float32)
        clients.append(Update(float(weight), support, chosen))
        if k % 2:  # its negation too: the large terms cancel, the small ones are the mean
            clients.append(Update(float(weight), support, -chosen))
    want = exact_mean(4, clients)
    assert torch.equal(aggregate(4, clients).mean_update(), want)
    rnd.shuffle(clients)
    assert torch.equal(aggregate(4, clients).mean_update(), want)


def test_order_of_arrival_with_cancellation_is_exact_in_float32() -> None:
    # Float32 summation in arrival order would lose the small term (1e8 + 1 - 1e8 = 0 in fp32);
    # the float64 sums keep it in every order.
    vals = [np.float32(1e8), np.float32(1.0), np.float32(-1e8)]
    means = set()
    for order in ([0, 1, 2], [0, 2, 1], [2, 1, 0], [1, 0, 2]):
        agg = SparseAggregator(1)
        for k in order:
            agg.add(torch.tensor([vals[k]]), support=None, weight=1.0)
        means.add(float(agg.mean_update()[0]))
    assert means == {float(np.float32(1.0 / 3.0))}


# --- (b) one shared mask == FedAvg on the mask; (c) dense == FedAvg -------------------------


@st.composite
def shared_mask_rounds(draw: st.DrawFn) -> tuple[int, np.ndarray, list]:
    dense_size = draw(st.integers(1, 24))
    mask = np.array(
        sorted(draw(st.sets(st.integers(0, dense_size - 1), max_size=dense_size))),
        dtype=np.int64,
    )
    clients = draw(
        st.lists(updates(dense_size=dense_size, shared_support=mask), min_size=1, max_size=6)
    )
    return dense_size, mask, clients


def fedavg(dense_vectors: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Dense FedAvg in float64: ``sum_c n_c v_c / sum_c n_c``."""
    return (weights[:, None] * dense_vectors).sum(axis=0) / weights.sum()


@settings(derandomize=True, max_examples=100, deadline=None)
@given(shared_mask_rounds())
def test_shared_mask_is_fedavg_of_zero_filled_updates_on_the_mask(round_) -> None:
    dense_size, mask, clients = round_
    zero_filled = np.zeros((len(clients), dense_size), dtype=np.float64)
    for row, u in zip(zero_filled, clients, strict=True):
        row[mask] = u.values
    weights = np.array([u.weight for u in clients], dtype=np.float64)
    expected = np.zeros(dense_size)
    expected[mask] = fedavg(zero_filled, weights)[mask]
    scale = fedavg(np.abs(zero_filled), weights)

    agg = aggregate(dense_size, clients)
    assert_mean_close(agg.mean_update(), expected, scale, terms=len(clients))
    on_mask = np.zeros(dense_size, dtype=bool)
    on_mask[mask] = True
    assert np.array_equal(agg.touched().numpy(), on_mask)
    assert agg.num_updates == len(clients)
    assert agg.total_weight == pytest.approx(weights.sum(), rel=1e-12)


@st.composite
def dense_rounds(draw: st.DrawFn) -> tuple[int, list]:
    dense_size = draw(st.integers(0, 24))
    clients = draw(
        st.lists(updates(dense_size=dense_size, shared_support=None), min_size=1, max_size=6)
    )
    return dense_size, clients


@settings(derandomize=True, max_examples=100, deadline=None)
@given(dense_rounds())
def test_dense_updates_are_dense_fedavg(round_) -> None:
    dense_size, clients = round_
    vectors = np.stack([u.values.astype(np.float64) for u in clients])
    weights = np.array([u.weight for u in clients], dtype=np.float64)
    agg = aggregate(dense_size, clients)
    assert_mean_close(
        agg.mean_update(),
        fedavg(vectors, weights),
        fedavg(np.abs(vectors), weights),
        terms=len(clients),
    )
    assert bool(agg.touched().all())


def test_dense_fedavg_by_hand() -> None:
    agg = SparseAggregator(3)
    agg.add(torch.tensor([1.0, -2.0, 0.5]), support=None, weight=10)
    agg.add(torch.tensor([3.0, 2.0, 0.5]), support=None, weight=30)
    # (10*1 + 30*3)/40 = 2.5, (10*-2 + 30*2)/40 = 1.0, 0.5
    assert torch.equal(agg.mean_update(), torch.tensor([2.5, 1.0, 0.5]))


# --- (d) apply_ -------------------------------------------------------------------------------


@settings(derandomize=True, max_examples=100, deadline=None)
@given(rounds(), st.integers(0, 2**32 - 1))
def test_apply_moves_exactly_the_union_of_supports(round_, seed: int) -> None:
    dense_size, clients = round_
    rng = np.random.default_rng(seed)
    model = rng.standard_normal(dense_size).astype(np.float32)
    model[::5] = -0.0  # signed zeros must survive bit for bit too
    weights = torch.from_numpy(model.copy())
    agg = aggregate(dense_size, clients)
    mean = agg.mean_update()

    changed = agg.apply_(weights)

    union = np.zeros(dense_size, dtype=bool)
    for u in clients:
        union[slice(None) if u.support is None else u.support] = True
    assert changed.dtype == torch.bool
    assert np.array_equal(changed.numpy(), union)
    before = torch.from_numpy(model)
    untouched = torch.from_numpy(~union)
    assert torch.equal(weights[untouched].view(torch.int32), before[untouched].view(torch.int32))
    touched = torch.from_numpy(union)
    assert torch.equal(weights[touched], before[touched] + mean[touched])


def test_apply_with_no_updates_changes_nothing() -> None:
    weights = torch.tensor([1.0, -0.0, float("nan")])
    agg = SparseAggregator(3)
    changed = agg.apply_(weights)
    assert not bool(changed.any())
    assert torch.equal(
        weights.view(torch.int32), torch.tensor([1.0, -0.0, math.nan]).view(torch.int32)
    )


def test_empty_support_counts_as_an_update_but_touches_nothing() -> None:
    agg = SparseAggregator(4)
    agg.add(torch.zeros(0), support=torch.zeros(0, dtype=torch.int64), weight=5.0)
    assert agg.num_updates == 1 and agg.total_weight == 5.0
    assert not bool(agg.touched().any())
    assert torch.equal(agg.mean_update(), torch.zeros(4))


# --- (e) per-coordinate weighting over different supports -------------------------------------


def test_each_coordinate_averages_only_the_clients_covering_it() -> None:
    agg = SparseAggregator(5)
    agg.add(torch.tensor([1.0, 2.0]), support=torch.tensor([0, 1]), weight=1.0)
    agg.add(torch.tensor([5.0, 7.0]), support=torch.tensor([1, 2]), weight=3.0)
    agg.add(torch.tensor([4.0]), support=torch.tensor([4]), weight=0.5)
    # 0: only client 1 -> 1.  1: (1*2 + 3*5)/(1+3) = 4.25.  2: only client 2 -> 7.
    # 3: nobody -> 0 (and untouched).  4: only client 3 -> 4 whatever its weight.
    assert torch.equal(agg.mean_update(), torch.tensor([1.0, 4.25, 7.0, 0.0, 4.0]))
    assert agg.touched().tolist() == [True, True, True, False, True]
    # Not FedAvg of zero-filled updates: that would give coordinate 0 the value 1/4.5.
    assert agg.total_weight == 4.5


def test_dense_and_sparse_clients_mix_per_coordinate() -> None:
    agg = SparseAggregator(3)
    agg.add(torch.tensor([1.0, 1.0, 1.0]), support=None, weight=2.0)
    agg.add(torch.tensor([4.0]), support=torch.tensor([2]), weight=1.0)
    # 0, 1: only the dense client. 2: (2*1 + 1*4)/3 = 2.
    assert torch.equal(agg.mean_update(), torch.tensor([1.0, 1.0, 2.0]))


@settings(derandomize=True, max_examples=120, deadline=None)
@given(rounds())
def test_mixed_supports_match_the_per_coordinate_oracle(round_) -> None:
    dense_size, clients = round_
    expected, covered, scale = oracle(dense_size, clients)
    agg = aggregate(dense_size, clients)
    assert np.array_equal(agg.touched().numpy(), covered)
    assert_mean_close(agg.mean_update(), expected, scale, terms=len(clients))


# --- (g) scale equivariance -------------------------------------------------------------------


@settings(derandomize=True, max_examples=100, deadline=None)
@given(rounds(), st.floats(min_value=1e-3, max_value=1e3), st.integers(-20, 20))
def test_scaling_every_weight_leaves_the_mean_unchanged(round_, factor: float, exp2: int) -> None:
    dense_size, clients = round_
    base = aggregate(dense_size, clients).mean_update()
    _, _, scale = oracle(dense_size, clients)

    def scaled(c: float) -> list[Update]:
        return [Update(weight=u.weight * c, support=u.support, values=u.values) for u in clients]

    # A power of two scales every float64 product and sum exactly: bit-identical result.
    assert torch.equal(aggregate(dense_size, scaled(2.0**exp2)).mean_update(), base)
    other = aggregate(dense_size, scaled(factor)).mean_update()
    diff = (other.double() - base.double()).abs().numpy()
    bound = 2 * (_EPS32 * base.double().abs().numpy() + 8 * len(clients) * _EPS64 * scale)
    assert (diff <= bound + _TINY32).all()


def test_huge_finite_weights_keep_the_mean_finite() -> None:
    agg = SparseAggregator(2)
    for _ in range(2):
        agg.add(torch.tensor([1e10, 1.0]), support=None, weight=1e300)
    assert torch.equal(agg.mean_update(), torch.tensor([1e10, 1.0]))


# --- (f) validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("weight", "match"),
    [
        (0.0, r"weight=0\.0: expected a finite value > 0"),
        (0, r"weight=0: expected a finite value > 0"),
        (-1.5, r"weight=-1\.5: expected"),
        (math.nan, r"weight=nan: expected"),
        (math.inf, r"weight=inf: expected"),
        (-math.inf, r"weight=-inf: expected"),
    ],
)
def test_bad_weight_is_rejected_and_leaves_no_trace(weight: float, match: str) -> None:
    agg = SparseAggregator(3)
    agg.add(torch.ones(3), support=None, weight=1.0)
    with pytest.raises(ValueError, match=match):
        agg.add(torch.full((3,), 5.0), support=None, weight=weight)
    assert agg.num_updates == 1 and agg.total_weight == 1.0
    assert torch.equal(agg.mean_update(), torch.ones(3))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("weight", [1.0, 2.0, 2.0**600])  # x 1 (no product), x 2, out of range
def test_non_finite_values_are_rejected_and_leave_no_trace(
    bad: float, sparse: bool, weight: float
) -> None:
    """Named as the values' error whatever the weight (an out-of-range one's error second)."""
    agg = SparseAggregator(4)
    agg.add(torch.ones(4), support=None, weight=1.0)
    values = torch.tensor([0.5, bad])
    support = torch.tensor([1, 3]) if sparse else None
    if not sparse:
        values = torch.tensor([0.5, 0.5, 0.5, bad])
    with pytest.raises(ValueError, match=r"^values: non-finite entries$"):
        agg.add(values, support=support, weight=weight)
    assert agg.num_updates == 1 and agg.total_weight == 1.0
    assert torch.equal(agg.mean_update(), torch.ones(4))


@pytest.mark.parametrize(
    ("values", "support", "match"),
    [
        (torch.ones(3), None, r"values has shape \(3,\): expected \(4,\)"),
        (torch.ones(5), None, r"values has shape \(5,\): expected \(4,\)"),
        (torch.ones(2, 2), None, r"values has shape \(2, 2\): expected \(4,\)"),
        (torch.ones(3), torch.tensor([0, 2]), r"values has shape \(3,\): expected \(2,\)"),
        (torch.ones(1), torch.tensor([0, 2]), r"values has shape \(1,\): expected \(2,\)"),
        (torch.ones(1), torch.arange(0), r"values has shape \(1,\): expected \(0,\)"),
        (torch.ones(1, 2), torch.tensor([0, 2]), r"values has shape \(1, 2\): expected \(2,\)"),
    ],
)
def test_length_mismatch_is_rejected(values, support, match: str) -> None:
    agg = SparseAggregator(4)
    with pytest.raises(ValueError, match=match):
        agg.add(values, support=support, weight=1.0)
    assert agg.num_updates == 0 and not bool(agg.touched().any())


@pytest.mark.parametrize("shape", [(3,), (5,), (1, 4), (4, 1), ()])
def test_apply_rejects_wrong_weights_shape(shape: tuple[int, ...]) -> None:
    agg = SparseAggregator(4)
    agg.add(torch.ones(4), support=None, weight=1.0)
    weights = torch.zeros(shape)
    with pytest.raises(ValueError, match=rf"weights has shape {re_shape(shape)}: expected \(4,\)"):
        agg.apply_(weights)
    assert torch.equal(weights, torch.zeros(shape))


def re_shape(shape: tuple[int, ...]) -> str:
    return "\\" + str(tuple(shape)).replace(")", "\\)")


def test_negative_dense_size_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"dense_size=-1: expected >= 0"):
        SparseAggregator(-1)


def test_zero_dense_size_is_a_valid_empty_model() -> None:
    agg = SparseAggregator(0)
    agg.add(torch.zeros(0), support=None, weight=1.0)
    assert agg.mean_update().shape == (0,)
    assert agg.apply_(torch.zeros(0)).shape == (0,)


@pytest.mark.parametrize("support", [[1, 1], [4], [-1]], ids=["duplicate", "too-large", "negative"])
def test_invalid_support_indices_are_rejected(support: list[int]) -> None:
    agg = SparseAggregator(4)
    with pytest.raises(ValueError, match="support"):
        agg.add(torch.ones(len(support)), support=torch.tensor(support), weight=1.0)


def _scatter_each(dense_size: int, updates: list[tuple[torch.Tensor, torch.Tensor | None, float]]):
    """The aggregate as every update scattered on its own (the reference for batching)."""
    sums = torch.zeros(dense_size, dtype=torch.float64)
    weights = torch.zeros(dense_size, dtype=torch.float64)
    unit = updates[0][2]
    for values, support, weight in updates:
        v = values.to(torch.float64) * (weight / unit)
        if support is None:
            sums += v
            weights += weight / unit
        else:
            sums.index_add_(0, support, v)
            weights.index_add_(0, support, torch.full_like(v, weight / unit))
    out = torch.zeros(dense_size, dtype=torch.float64)
    touched = weights > 0
    out[touched] = sums[touched] / weights[touched]
    return out.to(torch.float32)


def test_updates_on_one_shared_support_equal_scattering_each_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(0)
    d, keep = 5000, 1500
    mask = torch.sort(torch.randperm(d, generator=g)[:keep]).values  # one tensor: the round's
    updates = [(torch.randn(keep, generator=g) * 10.0**k, mask, 1.5**k) for k in range(-3, 4)]
    agg = SparseAggregator(d)
    for values, support, weight in updates:
        agg.add(values, support=support, weight=weight)
    assert agg._pending is not None and agg._pending[0] is mask  # batched, not yet scattered
    expected = _scatter_each(d, updates)
    assert torch.equal(agg.mean_update().view(torch.int32), expected.view(torch.int32))
    # Another support in between flushes the batch; the same tensor after it batches again.
    other = torch.arange(0, d, 3)
    mixed = [updates[0], (torch.randn(len(other), generator=g), other, 2.0), *updates[1:]]
    mixed.append((torch.randn(d, generator=g), None, 0.5))
    agg = SparseAggregator(d)
    for values, support, weight in mixed:
        agg.add(values, support=support, weight=weight)
    torch.testing.assert_close(agg.mean_update(), _scatter_each(d, mixed), rtol=2e-7, atol=0)
    assert agg.num_updates == len(mixed)


def test_a_bad_support_after_a_checked_one_is_still_rejected() -> None:
    agg = SparseAggregator(6)
    good = torch.tensor([1, 3, 5])
    agg.add(torch.ones(3), support=good, weight=1.0)
    agg.add(torch.ones(3), support=good, weight=1.0)  # the same tensor: not checked again
    for bad in (torch.tensor([3, 1, 5]), torch.tensor([1, 3, 6])):  # equal length, not good
        with pytest.raises(ValueError, match="support spans"):
            agg.add(torch.ones(3), support=bad, weight=1.0)
    with pytest.raises(ValueError, match=r"values has shape \(2,\): expected \(3,\)"):
        agg.add(torch.ones(2), support=good, weight=1.0)
    assert agg.num_updates == 2
    assert torch.equal(agg.mean_update(), torch.tensor([0.0, 1, 0, 1, 0, 1]))


# --- robust aggregators: the same round, a coordinate-wise rule over the covering clients ----


def robust_oracle(dense_size: int, clients: list[Update], rule) -> tuple[np.ndarray, np.ndarray]:
    """(rule over the covering clients' float64 values, covered mask), coordinate by coordinate."""
    out = np.zeros(dense_size, dtype=np.float64)
    covered = np.zeros(dense_size, dtype=bool)
    for i in range(dense_size):
        column = [
            float(u.values[i] if u.support is None else u.values[list(u.support).index(i)])
            for u in clients
            if u.support is None or i in u.support
        ]
        if column:
            covered[i] = True
            out[i] = rule(np.array(column))
    return out, covered


def trimmed(fraction: float):
    def rule(column: np.ndarray) -> float:
        t = int(fraction * column.size)
        return float(np.mean(np.sort(column)[t : column.size - t]))

    return rule


@settings(derandomize=True, max_examples=120, deadline=None)
@given(rounds(max_clients=7), st.sampled_from(["median", "trimmed-mean"]))
def test_robust_aggregators_match_the_per_coordinate_oracle(round_, rule: str) -> None:
    dense_size, clients = round_
    agg = RobustAggregator(dense_size, rule=rule, trim_fraction=0.2)  # type: ignore[arg-type]
    for u in clients:
        support = None if u.support is None else torch.from_numpy(u.support)
        agg.add(torch.from_numpy(u.values), support=support, weight=u.weight)
    expected, covered = robust_oracle(
        dense_size, clients, np.median if rule == "median" else trimmed(0.2)
    )
    w = torch.zeros(dense_size)
    touched = agg.apply_(w)
    assert np.array_equal(touched.numpy(), covered)
    scale = np.array([max((abs(float(v)) for u in clients for v in u.values), default=0.0)])
    bound = _EPS32 * np.abs(expected) + 8 * len(clients) * _EPS64 * scale + _TINY32
    assert (np.abs(w.numpy().astype(np.float64) - expected) <= bound).all()
    assert not w[~touched].any()


def test_robust_aggregator_on_a_shared_mask_ignores_one_huge_update_and_the_weights() -> None:
    support = torch.tensor([1, 3, 4])
    agg = RobustAggregator(6, rule="trimmed-mean", trim_fraction=0.2)
    for i, value in enumerate([1.0, 2.0, 3.0, 4.0, 1e30]):
        agg.add(torch.full((3,), value), support=support, weight=10.0**i)  # weights unused
    union, update = agg.update()
    assert torch.equal(union, support)
    assert update.tolist() == [3.0, 3.0, 3.0]  # drops 1 and 1e30; mean of 2, 3, 4
    w = torch.ones(6)
    assert agg.apply_(w).tolist() == [False, True, False, True, True, False]
    assert w.tolist() == [1.0, 4.0, 1.0, 4.0, 4.0, 1.0]


def test_robust_aggregator_checks_like_the_mean_and_starts_empty() -> None:
    agg = RobustAggregator(4, rule="median")
    with pytest.raises(ValueError, match="weight=0"):
        agg.add(torch.ones(4), support=None, weight=0.0)
    with pytest.raises(ValueError, match="values: non-finite"):
        agg.add(torch.tensor([1.0, math.nan]), support=torch.tensor([0, 1]), weight=1.0)
    with pytest.raises(ValueError, match="support spans"):
        agg.add(torch.ones(2), support=torch.tensor([1, 1]), weight=1.0)
    assert agg.num_updates == 0
    w = torch.ones(4)
    assert not agg.apply_(w).any() and torch.equal(w, torch.ones(4))
    with pytest.raises(ValueError, match="rule='mean'"):
        RobustAggregator(4, rule="mean")
    with pytest.raises(ValueError, match="trim_fraction=0.5"):
        RobustAggregator(4, rule="trimmed-mean", trim_fraction=0.5)


def test_make_aggregator_picks_the_rule() -> None:
    assert isinstance(make_aggregator("mean", 3), SparseAggregator)
    median = make_aggregator("median", 3)
    assert isinstance(median, RobustAggregator) and median.rule == "median"
    trimmed_agg = make_aggregator("trimmed-mean", 3, trim_fraction=0.1)
    assert isinstance(trimmed_agg, RobustAggregator) and trimmed_agg.trim_fraction == 0.1


@pytest.mark.parametrize(
    "kinds", ["ddd", "dds", "ddsd", "sdd", "dsds", "d", "s"]
)  # d: dense, s: sparse, in arrival order
def test_the_dense_weights_kept_as_a_number_add_exactly_as_per_coordinate(kinds: str) -> None:
    """While every update is dense their summed weight is one number, written into the
    per-coordinate weights at the first sparse update (or the mean): the same float64
    additions in the same order, so the mean is the per-coordinate computation's bit for bit."""
    rng = np.random.default_rng(len(kinds) * 7 + kinds.count("s"))
    d = 50
    agg = SparseAggregator(d)
    sums, weights = np.zeros(d), np.zeros(d)
    unit = 0.0
    for kind in kinds:
        weight = float(rng.uniform(0.1, 3.0))  # relative weights that round in float64
        values = rng.standard_normal(d if kind == "d" else 20).astype(np.float32)
        support = None if kind == "d" else np.sort(rng.choice(d, 20, replace=False))
        agg.add(
            torch.from_numpy(values),
            support=None if support is None else torch.from_numpy(support),
            weight=weight,
        )
        unit = unit or weight
        relative = weight / unit
        where = slice(None) if support is None else support
        sums[where] += values.astype(np.float64) * relative
        weights[where] += relative
    expected = np.zeros(d)
    touched = weights > 0
    expected[touched] = sums[touched] / weights[touched]
    assert np.array_equal(agg.mean_update().numpy(), expected.astype(np.float32))
    assert np.array_equal(agg.touched().numpy(), touched)


def test_the_callers_float64_values_are_never_added_into() -> None:
    """At relative weight 1 a float64 update is not multiplied: the aggregator still keeps a
    copy, as a later update on the same support is added into its pending sum."""
    agg = SparseAggregator(4)
    support = torch.tensor([1, 3])
    first = torch.tensor([1.0, 2.0], dtype=torch.float64)
    agg.add(first, support=support, weight=1.0)
    agg.add(torch.tensor([10.0, 20.0], dtype=torch.float64), support=support, weight=1.0)
    assert first.tolist() == [1.0, 2.0]
    assert agg.mean_update().tolist() == [0.0, 5.5, 0.0, 11.0]


@pytest.mark.parametrize("values", [[1.0, 2.0], [1.0, math.nan]])
def test_a_weight_whose_relative_overflows_is_out_of_range_not_an_overflow(values) -> None:
    """A reviewer's case: 2**600 beside a first weight of 2**-600 (its relative overflows
    ``ldexp``): a ValueError, the values' own error first, and nothing added."""
    agg = SparseAggregator(2)
    agg.add(torch.ones(2), support=None, weight=2.0**-600)
    match = "values: non-finite" if math.isnan(values[1]) else "out of range beside the first"
    with pytest.raises(ValueError, match=match):
        agg.add(torch.tensor(values), support=None, weight=2.0**600)
    assert agg.num_updates == 1 and torch.equal(agg.mean_update(), torch.ones(2))
