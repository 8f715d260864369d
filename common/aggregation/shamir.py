"""Shamir's secret sharing over the prime field ``GF(P)``, ``P = 2^384 + 231``: a sparse ring's
shares (``client/secagg.py``; the complete graph keeps Flower's ``create_shares``).

A secret is one field element: a 32-byte self-mask seed or a SECP384R1 private scalar (both
below ``2^384 < P``). :func:`split` evaluates a random polynomial of degree ``t - 1`` whose
constant term is the secret at the holders' ``x`` (1, 2, ...: their places in the owner's
neighbourhood, which every party computes, so a share travels as its ``y`` alone,
:data:`SHARE_BYTES` bytes); :func:`combine` interpolates at 0 from any ``t`` of them. Any
``t - 1`` shares are independent of the secret (the coefficients are uniform in ``GF(P)``,
drawn by :mod:`secrets`), and ``t`` wrong shares rebuild some other element, which the
server checks against what the owner committed to (its seed's commitment, its ``pk1``).

Flower's ``create_shares`` (PyCryptodome's ``GF(2^128)``, 16-byte blocks, the secret padded,
a thread pool per call) shares a PEM private key in 20 blocks; one element here is 49 bytes
and a few big-integer products, not a pure-Python field multiplication per bit.
"""

from __future__ import annotations

import itertools
import math
import random
import secrets
from collections.abc import Iterator, Sequence
from typing import Final

__all__ = ["PRIME", "SHARE_BYTES", "combine", "split", "from_bytes", "outliers", "to_bytes"]

PRIME: Final = 2**384 + 231
"""``P``: the smallest prime above ``2^384`` (tested)."""
SHARE_BYTES: Final = 49
"""Bytes of one field element, big-endian: ``ceil(385 / 8)``."""


def to_bytes(element: int) -> bytes:
    """``element`` of ``GF(P)`` as :data:`SHARE_BYTES` big-endian bytes."""
    if not 0 <= element < PRIME:
        raise ValueError("not an element of the field")
    return element.to_bytes(SHARE_BYTES, "big")


def from_bytes(data: bytes) -> int:
    """The element ``data`` encodes; ``ValueError`` for another length or a value ``>= P``."""
    if len(data) != SHARE_BYTES:
        raise ValueError(f"a share is {SHARE_BYTES} bytes, got {len(data)}")
    element = int.from_bytes(data, "big")
    if element >= PRIME:
        raise ValueError("a share is not an element of the field")
    return element


def split(secret: int, threshold: int, holders: int) -> list[int]:
    """The shares ``f(1), ..., f(holders)`` of ``secret`` (``f(0)``) for ``threshold``."""
    if not 0 <= secret < PRIME:
        raise ValueError("the secret is not an element of the field")
    if not 1 <= threshold <= holders:
        raise ValueError(f"threshold must be in [1, {holders}], got {threshold}")
    coefficients = [secret, *(secrets.randbelow(PRIME) for _ in range(threshold - 1))]
    shares = []
    for x in range(1, holders + 1):
        y = 0
        for c in reversed(coefficients):  # Horner
            y = (y * x + c) % PRIME
        shares.append(y)
    return shares


def combine(points: Sequence[tuple[int, int]]) -> int:
    """``f(0)`` from ``(x, f(x))`` points (Lagrange), ``ValueError`` for repeated or bad ``x``."""
    xs = [x for x, _ in points]
    if not points or len(set(xs)) != len(xs) or any(not 0 < x < PRIME for x in xs):
        raise ValueError("the shares' x must be distinct nonzero field elements")
    secret = 0
    for i, (x_i, y_i) in enumerate(points):
        num, den = 1, 1
        for j, x_j in enumerate(xs):
            if j != i:
                num = num * x_j % PRIME
                den = den * (x_j - x_i) % PRIME
        secret = (secret + y_i * num * pow(den, -1, PRIME)) % PRIME
    return secret


def _newton(points: Sequence[tuple[int, int]]) -> list[int]:
    """The Newton coefficients of the polynomial through ``points`` (divided differences)."""
    xs, coefficients = [x for x, _ in points], [y for _, y in points]
    for j in range(1, len(points)):
        for i in range(len(points) - 1, j - 1, -1):
            step = pow((xs[i] - xs[i - j]) % PRIME, -1, PRIME)
            coefficients[i] = (coefficients[i] - coefficients[i - 1]) * step % PRIME
    return coefficients


def _at(points: Sequence[tuple[int, int]], coefficients: Sequence[int], x: int) -> int:
    value = 0
    for i in range(len(coefficients) - 1, -1, -1):
        value = (value * (x - points[i][0]) + coefficients[i]) % PRIME
    return value


def outliers(
    points: Sequence[tuple[int, int]], threshold: int, tries: int = 256, seed: int = 0
) -> list[int] | None:
    """The places in ``points`` of the shares off the one polynomial of degree below
    ``threshold`` that at least ``(m + t) / 2`` of the ``m`` points lie on (two polynomials
    of that degree share fewer than ``t`` points, so that one is unique: Reed-Solomon's
    bound), found from ``threshold``-subsets (every one when they are few, else ``tries``
    drawn at random); None when none is found. Two colluding holders cannot put their bad
    shares on an honest one this way, as they can with "leave one out" (a linear pair of
    errors that cancels at 0 without the honest share)."""
    m = len(points)
    if m <= threshold or len({x for x, _ in points}) != m:
        return None

    def subsets() -> Iterator[tuple[int, ...]]:
        if math.comb(m, threshold) <= tries:
            yield from itertools.combinations(range(m), threshold)
            return
        draw = random.Random(seed)
        for _ in range(tries):
            yield tuple(sorted(draw.sample(range(m), threshold)))

    for subset in subsets():
        base = [points[i] for i in subset]
        coefficients = _newton(base)
        off = [i for i, (x, y) in enumerate(points) if _at(base, coefficients, x) != y]
        if 2 * (m - len(off)) >= m + threshold:
            return off
    return None
