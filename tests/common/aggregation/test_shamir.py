"""Shamir's sharing over GF(P) (common/aggregation/shamir.py): the field, any t shares
rebuild the secret, fewer say nothing of it, and malformed shares are refused."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import sympy
from scipy import stats

from fedsparse.common.aggregation import shamir
from fedsparse.common.aggregation.shamir import (
    PRIME,
    SHARE_BYTES,
    combine,
    from_bytes,
    outliers,
    split,
    to_bytes,
)


def test_the_field_is_the_smallest_prime_above_2_to_the_384() -> None:
    assert sympy.isprime(PRIME) and PRIME > 2**384
    assert sympy.nextprime(2**384) == PRIME
    assert all(pow(a, PRIME - 1, PRIME) == 1 for a in (2, 3, 5, 7, 11, 13, 17, 19, 23))
    assert (PRIME.bit_length() + 7) // 8 == SHARE_BYTES


@pytest.mark.parametrize(("threshold", "holders"), [(1, 1), (2, 3), (5, 9), (12, 17)])
def test_any_t_shares_rebuild_the_secret_and_t_minus_1_do_not(threshold: int, holders: int) -> None:
    rng = random.Random(threshold)
    for secret in (0, 1, 2**256 - 1, 2**384 - 1, rng.randrange(PRIME)):
        shares = split(secret, threshold, holders)
        assert len(shares) == holders
        points = list(enumerate(shares, start=1))
        for subset in itertools.islice(itertools.combinations(points, threshold), 40):
            assert combine(list(subset)) == secret
        assert combine(points) == secret  # more than t: the same polynomial
        if threshold > 1:
            assert combine(points[: threshold - 1]) != secret  # 1 in P of failing


def test_fewer_than_t_shares_are_uniform_whatever_the_secret(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """2 shares of a threshold-3 sharing, 4,000 sharings of 0 and of P - 1: their low 4
    bits are uniform (chi-square) and the two secrets' shares are alike (two-sample KS).
    The coefficients come from a seeded stream here (``secrets`` has no seed)."""
    stream = random.Random(20261202)
    monkeypatch.setattr(shamir.secrets, "randbelow", stream.randrange)
    lows = {}
    for secret in (0, PRIME - 1):
        values = np.array([split(secret, 3, 5)[:2] for _ in range(4000)], dtype=object)
        low = np.array([int(v) & 15 for v in values.ravel()])
        assert stats.chisquare(np.bincount(low, minlength=16)).pvalue > 1e-4
        lows[secret] = np.array([int(v) / PRIME for v in values[:, 0]], dtype=float)
    assert stats.ks_2samp(lows[0], lows[PRIME - 1]).pvalue > 1e-4


def test_a_share_is_49_big_endian_bytes_of_a_field_element() -> None:
    assert to_bytes(PRIME - 1) == (PRIME - 1).to_bytes(49, "big")
    assert from_bytes(to_bytes(12345)) == 12345
    with pytest.raises(ValueError, match="a share is 49 bytes, got 48"):
        from_bytes(bytes(48))
    with pytest.raises(ValueError, match="not an element of the field"):
        from_bytes(PRIME.to_bytes(49, "big"))
    with pytest.raises(ValueError, match="not an element"):
        to_bytes(PRIME)


def test_bad_sharings_and_points_are_refused() -> None:
    with pytest.raises(ValueError, match="threshold must be in"):
        split(5, 4, 3)
    with pytest.raises(ValueError, match="secret is not an element"):
        split(PRIME, 2, 3)
    shares = split(7, 2, 3)
    with pytest.raises(ValueError, match="distinct nonzero"):
        combine([(1, shares[0]), (1, shares[1])])
    with pytest.raises(ValueError, match="distinct nonzero"):
        combine([(0, shares[0]), (2, shares[1])])
    with pytest.raises(ValueError, match="distinct nonzero"):
        combine([])


def test_the_outliers_are_the_shares_off_the_polynomial_most_lie_on() -> None:
    shares = split(99, 4, 12)
    points = list(enumerate(shares, start=1))
    assert outliers(points, 4) == []
    bad = [(x, (y + 1) % PRIME) if x in (3, 7, 11) else (x, y) for x, y in points]
    assert outliers(bad, 4) == [2, 6, 10]
    assert combine([p for i, p in enumerate(bad) if i not in (2, 6, 10)]) == 99
    # too many bad for the bound (12 + 4) / 2 = 8 on it: none named
    worse = [(x, (y + x) % PRIME) if x <= 5 else (x, y) for x, y in points]
    assert outliers(worse, 4) is None
    assert outliers(points[:4], 4) is None  # exactly t: nothing to tell
    many = list(enumerate(split(5, 20, 40), start=1))  # C(40, 20) subsets: drawn at random
    many[0] = (1, (many[0][1] + 3) % PRIME)
    assert outliers(many, 20) == [0]
