"""The accounting memos of fedsparse.common.dp.accounting: same values as Opacus, bit for bit."""

import random

import numpy as np
import pytest
from opacus.accountants import RDPAccountant, create_accountant
from opacus.accountants.analysis import rdp as rdp_analysis

from fedsparse.common.dp import accounting as privacy
from fedsparse.common.dp.accounting import (
    accountant_epsilon,
    accounting_cache,
    calibrate_noise_multiplier,
    clear_accounting_caches,
    compute_epsilon,
    compute_epsilon_of_history,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha:UserWarning"),
    pytest.mark.filterwarnings("ignore:Optimal order is the smallest alpha:UserWarning"),
    pytest.mark.filterwarnings("ignore:GDP accounting is experimental:UserWarning"),
]

DELTA = 1e-5
RATES = (0.01, 0.05, 0.2, 1 / 3, 1 / 92, 1.0)


@pytest.fixture(autouse=True)
def _fresh_caches():
    clear_accounting_caches()
    yield
    clear_accounting_caches()


def opacus_epsilon(history, *, delta: float = DELTA, accountant: str = "rdp") -> float:
    """The reference: a fresh Opacus accountant with ``history``."""
    acc = create_accountant(mechanism=accountant)
    acc.history = list(history)
    return float(acc.get_epsilon(delta=delta))


def random_history(rng: random.Random, length: int) -> list[tuple[float, float, int]]:
    return [(rng.uniform(0.4, 6.0), rng.choice(RATES), rng.randint(1, 500)) for _ in range(length)]


CALIBRATIONS = [
    dict(target_epsilon=3.0, delta=1e-5, sample_rate=0.2, steps=50, accountant="rdp"),
    dict(target_epsilon=1.0, delta=1e-6, sample_rate=1 / 92, steps=920, accountant="rdp"),
    dict(target_epsilon=8.0, delta=1e-5, sample_rate=0.05, steps=300, accountant="rdp"),
    dict(
        target_epsilon=3.0,
        delta=1e-5,
        sample_rate=0.2,
        steps=50,
        accountant="rdp",
        epsilon_tolerance=0.001,
    ),
    dict(target_epsilon=2.0, delta=1e-5, sample_rate=0.1, steps=30, accountant="gdp"),
]


@pytest.mark.parametrize("args", CALIBRATIONS)
def test_memoized_calibration_is_the_fresh_search_bit_for_bit(args) -> None:
    with accounting_cache(enabled=False):
        fresh = calibrate_noise_multiplier(**args)
    cold = calibrate_noise_multiplier(**args)
    warm = calibrate_noise_multiplier(**args)
    assert cold == fresh and warm == fresh
    assert privacy._calibrate.cache_info().hits == 1


def test_prv_calibration_memoized_bit_for_bit() -> None:
    args = dict(target_epsilon=2.0, delta=1e-5, sample_rate=0.1, steps=30, accountant="prv")
    with accounting_cache(enabled=False):
        fresh = calibrate_noise_multiplier(**args)
    assert calibrate_noise_multiplier(**args) == fresh == calibrate_noise_multiplier(**args)


def test_calibration_key_holds_every_argument() -> None:
    """Changing any one argument is a different key, with the fresh value for it."""
    base = CALIBRATIONS[0]
    variants = [
        {**base, "target_epsilon": 2.0},
        {**base, "delta": 1e-6},
        {**base, "sample_rate": 0.1},
        {**base, "steps": 40},
        {**base, "accountant": "gdp"},
        {**base, "epsilon_tolerance": 0.001},
    ]
    sigma = calibrate_noise_multiplier(**base)
    for args in variants:
        got = calibrate_noise_multiplier(**args)
        with accounting_cache(enabled=False):
            assert got == calibrate_noise_multiplier(**args), args
        assert got != sigma, args
    assert privacy._calibrate.cache_info().currsize == 1 + len(variants)


def test_calibration_key_normalizes_numeric_types() -> None:
    """An int target and its float are one key; the value is the float's, bit for bit."""
    sigma = calibrate_noise_multiplier(
        target_epsilon=3, delta=1e-5, sample_rate=0.2, steps=np.int64(50), accountant="rdp"
    )
    with accounting_cache(enabled=False):
        assert sigma == calibrate_noise_multiplier(**CALIBRATIONS[0])
    assert calibrate_noise_multiplier(**CALIBRATIONS[0]) == sigma
    assert privacy._calibrate.cache_info().currsize == 1


def test_calibration_errors_are_not_memoized() -> None:
    args = dict(target_epsilon=1e-9, delta=1e-5, sample_rate=1.0, steps=10**6, accountant="gdp")
    for _ in range(2):
        with pytest.raises(ValueError, match="unreachable"):
            calibrate_noise_multiplier(**args)
    with pytest.raises(ValueError, match="steps=0"):
        calibrate_noise_multiplier(**{**CALIBRATIONS[0], "steps": 0})


@pytest.mark.parametrize("seed", range(6))
def test_rdp_epsilon_of_random_histories_is_opacus_bit_for_bit(seed: int) -> None:
    """Grown one entry at a time (the prefix path) and cold (every term), as Opacus sums."""
    rng = random.Random(seed)
    history = random_history(rng, rng.randint(1, 8))
    for end in range(1, len(history) + 1):
        expected = opacus_epsilon(history[:end])
        got = accountant_epsilon(history[:end], delta=DELTA, accountant="rdp")
        assert got == expected
        assert abs(got - expected) <= 1e-12 * abs(expected)
    clear_accounting_caches()
    assert accountant_epsilon(history, delta=DELTA, accountant="rdp") == opacus_epsilon(history)
    for delta in (1e-3, 1e-7):  # δ is not in the RDP memo: it enters only the conversion
        assert accountant_epsilon(history, delta=delta, accountant="rdp") == opacus_epsilon(
            history, delta=delta
        )


def test_rdp_prefix_memo_extends_by_one_entry() -> None:
    """The sum of a history is taken from its memoized prefix plus the last term."""
    history = random_history(random.Random(1), 6)
    accountant_epsilon(history[:5], delta=DELTA, accountant="rdp")
    curves = privacy._rdp_curve.cache_info()
    accountant_epsilon(history, delta=DELTA, accountant="rdp")
    after = privacy._rdp_curve.cache_info()
    assert after.hits + after.misses == curves.hits + curves.misses + 1  # one new term
    expected = sum(
        rdp_analysis.compute_rdp(
            q=q, noise_multiplier=s, steps=n, orders=RDPAccountant.DEFAULT_ALPHAS
        )
        for s, q, n in history
    )
    np.testing.assert_array_equal(privacy._rdp_of_history(tuple(history)), expected)


def test_rdp_memo_arrays_are_read_only() -> None:
    history = ((1.1, 0.2, 5), (1.1, 0.2, 10))
    rdp = privacy._rdp_of_history(history)
    with pytest.raises(ValueError, match="read-only"):
        rdp[0] = 0.0
    with pytest.raises(ValueError, match="read-only"):
        privacy._rdp_curve(0.2, 1.1)[0] = 0.0


def test_rdp_merged_and_split_histories_keep_opacus_rounding() -> None:
    """One merged entry (the engine's) and the same steps split in rounds (the ledger's)."""
    sigma, q = 1.37, 0.2
    merged, split = [(sigma, q, 50)], [(sigma, q, 5)] * 10
    for history in (merged, split):
        assert accountant_epsilon(history, delta=DELTA, accountant="rdp") == opacus_epsilon(history)


def test_rdp_edge_entries_match_opacus() -> None:
    """σ = 0 (infinite RDP), q = 1 (no amplification), and a zero-step entry."""
    for history in ([(0.0, 0.2, 5)], [(2.0, 1.0, 10)], [(1.5, 0.1, 0), (1.5, 0.1, 7)]):
        assert accountant_epsilon(history, delta=DELTA, accountant="rdp") == opacus_epsilon(history)


@pytest.mark.parametrize("accountant", ["prv", "gdp"])
def test_prv_gdp_epsilon_memoized_on_history(accountant: str) -> None:
    histories = [[(1.5, 0.1, 20)], [(2.0, 0.2, 10)]]
    if accountant == "prv":  # GDP keeps one entry (Opacus's uses only the last)
        histories.append([(2.0, 0.2, 10), (1.2, 0.05, 30)])
    for history in histories:
        expected = opacus_epsilon(history, accountant=accountant)
        assert accountant_epsilon(history, delta=DELTA, accountant=accountant) == expected
        assert accountant_epsilon(history, delta=DELTA, accountant=accountant) == expected
        assert accountant_epsilon(history, delta=1e-3, accountant=accountant) == opacus_epsilon(
            history, delta=1e-3, accountant=accountant
        )
    assert privacy._memo_epsilon.cache_info().hits == len(histories)
    assert privacy._memo_epsilon.cache_info().currsize == 2 * len(histories)


def test_empty_history_spends_nothing() -> None:
    for accountant in ("rdp", "prv", "gdp"):
        assert accountant_epsilon([], delta=DELTA, accountant=accountant) == 0.0


@pytest.mark.parametrize("seed", range(4))
def test_history_functions_agree_with_the_memos_off(seed: int) -> None:
    rng = random.Random(100 + seed)
    history = random_history(rng, rng.randint(1, 5))
    entry = history[0]
    with accounting_cache(enabled=False):
        expected = compute_epsilon_of_history(history, delta=DELTA, accountant="rdp")
        single = compute_epsilon(
            noise_multiplier=entry[0],
            sample_rate=entry[1],
            steps=entry[2],
            delta=DELTA,
            accountant="rdp",
        )
    assert compute_epsilon_of_history(history, delta=DELTA, accountant="rdp") == expected
    assert (
        compute_epsilon(
            noise_multiplier=entry[0],
            sample_rate=entry[1],
            steps=entry[2],
            delta=DELTA,
            accountant="rdp",
        )
        == single
    )


def test_accounting_cache_switch_bypasses_and_restores() -> None:
    with accounting_cache(enabled=False):
        calibrate_noise_multiplier(**CALIBRATIONS[2])
        accountant_epsilon([(1.0, 0.2, 5)], delta=DELTA, accountant="rdp")
        with accounting_cache(enabled=True):
            assert privacy._memo_enabled
        assert not privacy._memo_enabled
    assert privacy._memo_enabled
    assert privacy._calibrate.cache_info().currsize == 0
    assert privacy._rdp_curve.cache_info().currsize == 0


def test_prefix_memo_is_bounded() -> None:
    sums = privacy._PrefixSums(3)
    for i in range(5):
        sums.put(((1.0, 0.1, i + 1),), np.zeros(2))
    assert sums.get(((1.0, 0.1, 1),)) is None and sums.get(((1.0, 0.1, 2),)) is None
    assert sums.get(((1.0, 0.1, 3),)) is not None
    sums.put(((1.0, 0.1, 9),), np.zeros(2))  # evicts the least recently used: entry 4
    assert sums.get(((1.0, 0.1, 4),)) is None and sums.get(((1.0, 0.1, 3),)) is not None
