"""Seed-shared random masks for random sparsification (RS).

A mask is a flat boolean vector over a model's trainable coordinates with exactly ``keep``
True entries, chosen uniformly at random among all ``C(numel, keep)`` subsets. It depends on
``(numel, keep, seed)`` alone, and the algorithm is specified bit for bit here rather than
delegated to a library RNG, so every party (server, clients, on any machine, any numpy/torch
version, CPU or GPU host) regenerates the same mask from a broadcast seed. That is what lets
sparse updates travel as values only, with no indices (RS paper, Sec. 5; Algorithm 1, line 4).

Algorithm. Coordinate ``i`` gets the score ``h_i = mix64(offset + i * GOLDEN) (mod 2**64)``,
where ``offset = mix64(seed + GOLDEN)`` and ``mix64`` is the SplitMix64 finalizer (Steele et
al., 2014). For a fixed seed, ``i -> h_i`` is a bijection on 64-bit integers, so the scores are
distinct and the mask is "the ``keep`` coordinates with the smallest scores", uniquely
defined. Under the standard model of SplitMix64 outputs as i.i.d. uniform, that set is a
uniform random ``keep``-subset. The mask is data-independent by construction: privacy
accounting is unchanged by it (the mask is public; see ``fedsparse.common.dp.optimizer``).

Speed. Scores are computed in cache-sized chunks; coordinates far below the expected
``keep``-th order statistic are kept immediately, and only a window of ``O(sqrt(numel))``
candidates around it is sorted. If the window happens not to contain the threshold (a
~1e-15 event) an exact full pass runs instead; both paths define the same set.

Shared masks. A round's public mask is needed by several parties of one process (the server's
downlink, its reply checks and aggregation; every virtual client a worker serves, to train on
it and to patch its model with the next downlink): ``seeded_mask`` and ``seeded_support``
regenerate it once per process (one cache of the ``SHARED_MASKS`` latest ``(numel, keep,
seed)``) and return the same tensor to every caller, which must only read it (index with it,
compare it); a caller that writes into it takes a ``clone()``.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Final

import numpy as np
import torch

__all__ = [
    "SHARED_MASKS",
    "derive_seed",
    "keep_count",
    "mask_scores",
    "sample_mask",
    "seeded_mask",
    "seeded_support",
]

#: How many ``(numel, keep, seed)`` masks ``seeded_mask``/``seeded_support`` keep per process.
SHARED_MASKS: Final = 8

_U64 = np.uint64
_GOLDEN = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1
_CHUNK = 1 << 16
_WINDOW_SIGMAS = 8.0


def _mix64_int(z: int) -> int:
    """SplitMix64 finalizer on a Python int (mod 2**64)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _MUL1) & _MASK64
    z = ((z ^ (z >> 27)) * _MUL2) & _MASK64
    return z ^ (z >> 31)


def _mix64_inplace(z: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer on a uint64 array, in place (numpy wraps mod 2**64)."""
    z ^= z >> _U64(30)
    z *= _U64(_MUL1)
    z ^= z >> _U64(27)
    z *= _U64(_MUL2)
    z ^= z >> _U64(31)
    return z


def _check_seed(seed: int, name: str = "seed") -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"{name}={seed!r}: expected an integer")
    seed = int(seed)
    if not 0 <= seed <= _MASK64:
        raise ValueError(f"{name}={seed}: expected 0 <= {name} < 2**64")
    return seed


def derive_seed(seed: int, *keys: int) -> int:
    """Derives an independent 63-bit seed from ``seed`` and integer keys (e.g. round, node id).

    Deterministic on every machine; used to give each round (and, for per-client masks, each
    client) its own mask seed from one broadcast seed.

    Args:
        seed: base seed, ``0 <= seed < 2**64``.
        *keys: non-negative integers ``< 2**64``, mixed in order.

    Returns:
        A seed in ``[0, 2**63)`` (fits a signed int64 field on the wire).
    """
    z = _mix64_int(_check_seed(seed) + _GOLDEN)
    for i, key in enumerate(keys):
        z = _mix64_int(z ^ _mix64_int(_check_seed(key, f"keys[{i}]") + (i + 1) * _GOLDEN))
    return z >> 1


def keep_count(numel: int, *, rate: float) -> int:
    """Number of kept coordinates for sparsification rate ``rate``: ``numel - floor(rate*numel)``.

    Raises:
        ValueError: if ``rate`` is not in ``[0, 1]`` or ``numel < 0``.
    """
    if numel < 0:
        raise ValueError(f"numel={numel}: expected numel >= 0")
    if not (0.0 <= rate <= 1.0) or math.isnan(rate):
        raise ValueError(f"rate={rate}: expected 0 <= rate <= 1")
    return numel - math.floor(rate * numel)


def _offset(seed: int) -> int:
    return _mix64_int(_check_seed(seed) + _GOLDEN)


def mask_scores(numel: int, *, seed: int, start: int = 0) -> np.ndarray:
    """The 64-bit scores ``h_start, ..., h_{numel-1}`` that define masks for ``seed``.

    Exposed for tests and for callers that need ranks (e.g. a reference implementation);
    ``sample_mask`` keeps the ``keep`` smallest.
    """
    x = np.arange(start, numel, dtype=np.uint64)
    x *= _U64(_GOLDEN)
    x += _U64(_offset(seed))
    return _mix64_inplace(x)


def _validate(numel: int, keep: int) -> None:
    if isinstance(numel, bool) or not isinstance(numel, (int, np.integer)) or numel < 0:
        raise ValueError(f"numel={numel!r}: expected a non-negative integer")
    if isinstance(keep, bool) or not isinstance(keep, (int, np.integer)):
        raise ValueError(f"keep={keep!r}: expected an integer")
    if not 0 <= keep <= numel:
        raise ValueError(f"keep={keep}: expected 0 <= keep <= numel={numel}")


def _exact_mask(numel: int, keep: int, seed: int) -> np.ndarray:
    """Reference path: keep the ``keep`` smallest of all scores (full pass, O(numel) memory)."""
    out = np.zeros(numel, dtype=bool)
    if keep:
        scores = mask_scores(numel, seed=seed)
        out[np.argpartition(scores, keep - 1)[:keep]] = True
    return out


def _window_mask(numel: int, keep: int, seed: int, chunk: int) -> np.ndarray | None:
    """Fast path: one chunked pass; returns None if the threshold fell outside the window."""
    sigma = math.sqrt(keep * (numel - keep) / numel) + 1.0
    scale = float(2**64) / numel
    lo = int(max(0.0, (keep - _WINDOW_SIGMAS * sigma) * scale))
    hi = int(min(float(_MASK64), (keep + _WINDOW_SIGMAS * sigma) * scale))
    lo_u, hi_u = _U64(min(lo, _MASK64)), _U64(min(hi, _MASK64))
    out = np.empty(numel, dtype=bool)
    base = np.arange(chunk, dtype=np.uint64) * _U64(_GOLDEN)
    offset = _offset(seed)
    cand_idx: list[np.ndarray] = []
    cand_score: list[np.ndarray] = []
    below = 0
    buf = np.empty(chunk, dtype=np.uint64)
    for start in range(0, numel, chunk):
        n = min(chunk, numel - start)
        x = buf[:n]
        np.add(base[:n], _U64((offset + start * _GOLDEN) & _MASK64), out=x)
        _mix64_inplace(x)
        block = out[start : start + n]
        np.less(x, lo_u, out=block)
        below += int(np.count_nonzero(block))
        in_window = np.flatnonzero((x >= lo_u) & (x < hi_u))
        if in_window.size:
            cand_idx.append(in_window + start)
            cand_score.append(x[in_window].copy())
    need = keep - below
    idx = np.concatenate(cand_idx) if cand_idx else np.empty(0, dtype=np.int64)
    if need < 0 or need > idx.size:
        return None
    if need:
        scores = np.concatenate(cand_score)
        out[idx[np.argpartition(scores, need - 1)[:need]]] = True
    return out


def sample_mask(numel: int, *, keep: int, seed: int) -> torch.Tensor:
    """Samples a uniformly random flat boolean mask with exactly ``keep`` True entries.

    Identical for the same ``(numel, keep, seed)`` on every machine and process; independent
    (as SplitMix64 streams are) across seeds. Nested in ``keep``: for a fixed seed the mask
    with ``keep=k`` is contained in the one with ``keep=k+1``.

    Args:
        numel: mask length ``d`` (number of trainable coordinates), ``>= 0``.
        keep: number of kept coordinates, ``0 <= keep <= numel``. ``keep=numel`` is the
            identity mask (r = 0); ``keep=0`` drops everything.
        seed: mask seed, ``0 <= seed < 2**64`` (broadcast by the server each round).

    Returns:
        A CPU ``torch.bool`` tensor of shape ``(numel,)``.

    Raises:
        ValueError: on negative ``numel``, ``keep`` outside ``[0, numel]`` or a bad seed.
    """
    _validate(numel, keep)
    _check_seed(seed)
    numel, keep = int(numel), int(keep)
    if keep == numel:
        return torch.ones(numel, dtype=torch.bool)
    if keep == 0:
        return torch.zeros(numel, dtype=torch.bool)
    mask = None if numel <= 4 * _CHUNK else _window_mask(numel, keep, int(seed), _CHUNK)
    if mask is None:
        mask = _exact_mask(numel, keep, int(seed))
    return torch.from_numpy(mask)


class _SharedMask:
    """One ``(numel, keep, seed)``'s mask, and its support once asked for."""

    __slots__ = ("mask", "_support")

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask
        self._support: torch.Tensor | None = None

    def support(self) -> torch.Tensor:
        if self._support is None:
            self._support = torch.nonzero(self.mask).flatten()
        return self._support


def _entry(numel: int, keep: int, seed: int) -> _SharedMask:
    """The cache entry, after the arguments are checked: a hit never skips a check, and
    ``keep=100.0`` is refused as it is cold (``lru_cache`` alone would call it ``100``)."""
    ints = []
    for name, value in (("numel", numel), ("keep", keep), ("seed", seed)):
        try:
            if isinstance(value, bool):
                raise TypeError
            ints.append(operator.index(value))  # ints and numpy ints; never a float
        except TypeError:
            raise ValueError(f"{name}={value!r}: expected an int") from None
    _validate(ints[0], ints[1])
    _check_seed(ints[2])
    return _shared(*ints)


@functools.lru_cache(maxsize=SHARED_MASKS)
def _shared(numel: int, keep: int, seed: int) -> _SharedMask:
    return _SharedMask(sample_mask(numel, keep=keep, seed=seed))


def seeded_mask(numel: int, keep: int, seed: int) -> torch.Tensor:
    """``sample_mask(numel, keep=keep, seed=seed)``, regenerated once per process.

    The tensor is shared by every caller asking for the same ``(numel, keep, seed)`` while it
    is among the ``SHARED_MASKS`` latest: read it only (a caller that writes takes a
    ``clone()``).

    Raises:
        ValueError: as ``sample_mask``.
    """
    return _entry(numel, keep, seed).mask


def seeded_support(numel: int, keep: int, seed: int) -> torch.Tensor:
    """The mask's support: the ``keep`` coordinates of ``seeded_mask(numel, keep, seed)``,
    int64 and increasing (``torch.nonzero(mask).flatten()``), computed once per process.

    Shared like ``seeded_mask``'s tensor: read it only.

    Raises:
        ValueError: as ``sample_mask``.
    """
    return _entry(numel, keep, seed).support()
