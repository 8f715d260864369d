"""Accounting glue: Opacus's sampling rate and step count, σ calibration, history records.

The privacy of DP-SGD (with or without a public RS mask) is fixed by three numbers: the
Poisson sampling rate ``q``, the noise multiplier ``σ`` and the number of noisy steps ``T``;
Opacus's accountants (RDP, PRV, GDP) turn a history of ``(σ, q, T)`` entries into ``ε`` at a
given ``δ``. This module holds the arithmetic around them that both the federated client and
the centralized trainer need, as plain functions:

* ``steps_per_epoch`` and ``sample_rate``: the per-epoch ``T`` and the ``q`` that Opacus
  really uses for an in-memory loader of ``n`` examples and batch size ``b``
  (``training.make_private`` builds it with ``batch_size=min(b, n)``, so ``k = ceil(n /
  min(b, n))`` batches). With Poisson sampling the ``DPDataLoader`` samples each example with
  probability ``1 / k`` and yields ``T = int(1 / (1 / k))`` batches per epoch (Opacus's
  ``UniformWithReplacementSampler``), and the accountant charges ``q = 1 / T`` per step: both
  are ``k`` and ``1 / k`` except where ``1 / (1 / k)`` rounds below ``k`` in floating point
  (``k = 93, 99, 105, ...``: 92 steps charged at ``q = 1/92``, a conservative rate).
* ``calibrate_noise_multiplier``: the smallest ``σ`` (to a tolerance) whose ``ε`` after exactly
  ``steps`` steps is at most the target. Opacus's ``get_noise_multiplier(epochs=E)`` calibrates
  for ``int(E / q)`` steps, which can be one short of the ``E * int(1 / q)`` that run
  (``q = 1/75``, ``E = 3``: 224 calibrated, 225 run, ``ε = 3.0018`` for a target of 3).
* ``history_to_record`` / ``history_from_record``: the accountant history as the lists a
  Flower ``ConfigRecord`` holds between rounds (``Context.state``).

Memos. Every client calibrates ``σ`` and computes ``ε`` of its history in every round; done
afresh, that is most of a round's time (one calibration evaluates ``ε`` some 20 times, and
one RDP evaluation sums a series per order). So, process-wide and bounded:

* ``calibrate_noise_multiplier`` is memoized on all its arguments (the search depends on
  nothing else: one ``(σ, q, steps)`` entry, no prior history, Opacus's fixed orders);
* the RDP accountant's per-step curve ``RDP_α(q, σ)`` over Opacus's orders is memoized on
  ``(q, σ)``, and the composed RDP of a history on the history itself, extended by one
  entry in ``O(orders)`` (Opacus's sum, same terms in the same order);
* PRV and GDP ``ε`` are memoized on ``(history, δ, accountant)``.

Each memo returns the value computed by the same floating-point operations as Opacus's
accountant would, bit for bit (tests pin it); ``accounting_cache(enabled=False)`` switches
them off, leaving the plain Opacus calls (for tests and ``benchmarks/client_round.py``).

References:
    M. Abadi et al. "Deep Learning with Differential Privacy". CCS 2016. arXiv:1607.00133.
    I. Mironov, K. Talwar, L. Zhang. "Rényi Differential Privacy of the Sampled Gaussian
    Mechanism". 2019. arXiv:1908.10530.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

import numpy as np
from opacus.accountants import RDPAccountant, create_accountant
from opacus.accountants.analysis import rdp as rdp_analysis
from opacus.accountants.analysis.gdp import compute_mu_poisson, delta_eps_mu, eps_from_mu

from fedsparse.common.names import ACCOUNTANTS, AccountantName

__all__ = [
    "ACCOUNTANTS",
    "HISTORY_KEYS",
    "AccountantName",
    "accountant_epsilon",
    "accounting_cache",
    "calibrate_noise_multiplier",
    "clear_accounting_caches",
    "compute_epsilon",
    "compute_epsilon_of_history",
    "history_from_record",
    "history_to_record",
    "sample_rate",
    "steps_per_epoch",
]


HISTORY_KEYS: Final = ("acc-sigma", "acc-q", "acc-steps")
"""Record keys of the accountant history: σ, q and step count of each entry."""

_MAX_SIGMA: Final = 1e6  # Opacus's bound (accountants.utils.MAX_SIGMA)
# The GDP accountant solves for ε in [0, 500] and fails outside; these bound the answer.
_GDP_EPS_RANGE: Final = (0.0, 500.0)

Entry = tuple[float, float, int]
"""One accountant history entry: ``(σ, q, steps)``."""

# Memo bounds: entries kept, least recently used dropped first. A calibration adds ~20
# per-step curves (one per σ it tries); a history memo holds one key per node and round.
_CALIBRATIONS: Final = 256
_CURVES: Final = 4096
_HISTORIES: Final = 1024
_RDP_ORDERS: Final = tuple(RDPAccountant.DEFAULT_ALPHAS)
_memo_enabled = True


def steps_per_epoch(num_examples: int, batch_size: int, *, poisson_sampling: bool = True) -> int:
    """Optimizer steps (accountant steps) in one epoch of ``training.train_one_epoch``.

    The loader has ``k = ceil(n / min(b, n))`` batches. With Poisson sampling Opacus's
    ``DPDataLoader`` yields ``int(1 / (1 / k))`` batches per epoch (empty ones included; each
    still takes a noisy step): ``k``, except where floating point makes ``1 / (1 / k)`` fall
    just below ``k`` (``k = 93``: 92 steps). Without Poisson sampling, the plain loader's ``k``.
    Physical batching (``BatchMemoryManager``) does not change the count.
    """
    n, b = _check_sizes(num_examples, batch_size)
    batches = -(-n // min(b, n))
    if poisson_sampling:
        return int(1 / (1 / batches))  # opacus.utils.uniform_sampler.UniformWithReplacementSampler
    return batches


def sample_rate(num_examples: int, batch_size: int, *, poisson_sampling: bool = True) -> float:
    """The sampling rate ``q`` the accountant charges per step (Opacus's, not ``b / n``).

    ``PrivacyEngine.make_private`` charges ``1 / len(loader)`` with the loader it returns, so
    ``1 / steps_per_epoch(...)``: ``1 / ceil(n / min(b, n))`` except in ``steps_per_epoch``'s
    floating-point cases, where it is ``1 / (k - 1)``, above the rate examples are really
    sampled with (Opacus's accounting is conservative there, and so is ours).
    """
    return 1 / steps_per_epoch(num_examples, batch_size, poisson_sampling=poisson_sampling)


def compute_epsilon(
    *,
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    accountant: AccountantName,
) -> float:
    """``ε`` at ``delta`` of ``steps`` DP-SGD steps with ``(noise_multiplier, sample_rate)``.

    Opacus's accountant with history ``[(noise_multiplier, sample_rate, steps)]``. For
    ``"gdp"``, where Opacus's root search fails outside ``ε`` in [0, 500], returns 0 when ``ε =
    0`` already meets ``delta`` and ``inf`` when no ``ε <= 500`` does.
    """
    try:
        return accountant_epsilon(
            [(noise_multiplier, sample_rate, steps)], delta=delta, accountant=accountant
        )
    except ValueError:
        if accountant != "gdp":
            raise
        mu = compute_mu_poisson(
            steps=steps, noise_multiplier=noise_multiplier, sample_rate=sample_rate
        )
        low, high = _GDP_EPS_RANGE
        if delta_eps_mu(eps=low, mu=mu) <= delta:
            return 0.0
        if not delta_eps_mu(eps=high, mu=mu) <= delta:
            return math.inf
        raise


def compute_epsilon_of_history(
    history: Sequence[tuple[float, float, int]], *, delta: float, accountant: AccountantName
) -> float:
    """``ε`` at ``delta`` of a composed history of ``(σ, q, steps)`` entries (0 if empty).

    The node ledger's sum over rounds and runs. RDP and PRV compose heterogeneous entries;
    a history of one entry equals ``compute_epsilon`` of it. GDP (whose Opacus accountant
    reads the last entry alone) composes entries of one ``(σ, q)`` as one, and of several by
    the central limit theorem's ``μ² = Σ q² T (e^{1/σ²} - 1)`` ("Deep Learning with Gaussian
    Differential Privacy", arXiv:1911.11607).
    """
    entries = [(float(s), float(q), int(n)) for s, q, n in history if int(n) > 0]
    if not entries:
        return 0.0
    if accountant == "gdp":
        merged: dict[tuple[float, float], int] = {}
        for sigma, q, n in entries:
            merged[(sigma, q)] = merged.get((sigma, q), 0) + n
        entries = [(sigma, q, n) for (sigma, q), n in merged.items()]
        if len(entries) > 1:
            if any(sigma == 0 for sigma, _, _ in entries):
                return math.inf
            mu = math.sqrt(
                sum(
                    compute_mu_poisson(steps=n, noise_multiplier=sigma, sample_rate=q) ** 2
                    for sigma, q, n in entries
                )
            )
            return _gdp_epsilon(mu, delta)
    if len(entries) == 1:
        sigma, q, steps = entries[0]
        return compute_epsilon(
            noise_multiplier=sigma, sample_rate=q, steps=steps, delta=delta, accountant=accountant
        )
    return accountant_epsilon(entries, delta=delta, accountant=accountant)


def _gdp_epsilon(mu: float, delta: float) -> float:
    """``ε`` at ``delta`` of ``μ``-GDP, as ``compute_epsilon``'s GDP branch finds it."""
    if mu == 0:
        return 0.0
    if not math.isfinite(mu):
        return math.inf
    low, high = _GDP_EPS_RANGE
    if delta_eps_mu(eps=low, mu=mu) <= delta:
        return 0.0
    if not delta_eps_mu(eps=high, mu=mu) <= delta:
        return math.inf
    return float(eps_from_mu(mu=mu, delta=delta))


def accountant_epsilon(
    history: Sequence[tuple[float, float, int]], *, delta: float, accountant: AccountantName
) -> float:
    """Opacus's ``accountant.get_epsilon(delta)`` with ``accountant.history = history``, memoized.

    What ``SparseDPEngine.get_epsilon`` returns for DP-SGD: 0 for an empty history, else the
    accountant's value as it computes it (no GDP range fallback: its errors propagate). The
    RDP value is Opacus's sum over entries of ``steps * RDP_α(q, σ)``, with the per-step
    curves and the history's prefix sums memoized; PRV and GDP values are memoized on
    ``(history, delta, accountant)``. Equal to the unmemoized call bit for bit.
    """
    if not history:
        return 0.0
    entries = tuple((float(s), float(q), int(n)) for s, q, n in history)
    if not _memo_enabled:
        return _opacus_epsilon(entries, delta, accountant)
    if accountant == "rdp":
        eps, _ = rdp_analysis.get_privacy_spent(
            orders=list(_RDP_ORDERS), rdp=_rdp_of_history(entries), delta=delta
        )
        return float(eps)
    return _memo_epsilon(entries, float(delta), accountant)


def _opacus_epsilon(entries: tuple[Entry, ...], delta: float, accountant: AccountantName) -> float:
    acc = create_accountant(mechanism=accountant)
    acc.history = list(entries)
    return float(acc.get_epsilon(delta=delta))


_memo_epsilon = functools.lru_cache(maxsize=_HISTORIES)(_opacus_epsilon)


@functools.lru_cache(maxsize=_CURVES)
def _rdp_curve(sample_rate: float, noise_multiplier: float) -> np.ndarray:
    """``RDP_α`` of one step at Opacus's orders (``compute_rdp``'s array; ``* 1`` is exact)."""
    curve = np.asarray(
        rdp_analysis.compute_rdp(
            q=sample_rate, noise_multiplier=noise_multiplier, steps=1, orders=list(_RDP_ORDERS)
        )
    )
    curve.flags.writeable = False
    return curve


class _PrefixSums:
    """Composed RDP of histories, least recently used first out; thread-safe."""

    def __init__(self, maxsize: int) -> None:
        self._sums: OrderedDict[tuple[Entry, ...], np.ndarray] = OrderedDict()
        self._maxsize = maxsize
        self._lock = threading.Lock()

    def get(self, key: tuple[Entry, ...]) -> np.ndarray | None:
        with self._lock:
            value = self._sums.get(key)
            if value is not None:
                self._sums.move_to_end(key)
            return value

    def put(self, key: tuple[Entry, ...], value: np.ndarray) -> None:
        value.flags.writeable = False
        with self._lock:
            self._sums[key] = value
            self._sums.move_to_end(key)
            while len(self._sums) > self._maxsize:
                self._sums.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._sums.clear()


_rdp_sums = _PrefixSums(_HISTORIES)


def _rdp_of_history(entries: tuple[Entry, ...]) -> np.ndarray:
    """Opacus's ``sum([compute_rdp(q, σ, steps, orders) for each entry])``, bit for bit.

    ``compute_rdp`` is ``steps * curve``; Python's ``sum`` adds the terms left to right from
    0, so the sum of a history is the sum of its prefix plus the last term: one step when the
    prefix (last round's history) is memoized, otherwise every term from 0.
    """
    cached = _rdp_sums.get(entries)
    if cached is not None:
        return cached
    prefix = _rdp_sums.get(entries[:-1]) if len(entries) > 1 else None
    if prefix is None:
        total: Any = 0
        for sigma, q, steps in entries:
            total = total + _rdp_curve(q, sigma) * steps
    else:
        sigma, q, steps = entries[-1]
        total = prefix + _rdp_curve(q, sigma) * steps
    _rdp_sums.put(entries, total)
    return total


@contextlib.contextmanager
def accounting_cache(*, enabled: bool) -> Iterator[None]:
    """Within the block, the memos are used (``True``) or bypassed (``False``: plain Opacus).

    Process-wide (not per thread); restores the previous setting on exit. For equality
    tests and benchmarks: the results are the same either way, only slower without.
    """
    global _memo_enabled
    previous, _memo_enabled = _memo_enabled, enabled
    try:
        yield
    finally:
        _memo_enabled = previous


def clear_accounting_caches() -> None:
    """Empties every memo of this module (the next calls compute afresh)."""
    _calibrate.cache_clear()
    _rdp_curve.cache_clear()
    _memo_epsilon.cache_clear()
    _rdp_sums.clear()


def calibrate_noise_multiplier(
    *,
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: AccountantName,
    epsilon_tolerance: float = 0.01,
) -> float:
    """The noise multiplier ``σ`` that spends at most ``target_epsilon`` in exactly ``steps``.

    Opacus's search (``opacus.accountants.utils.get_noise_multiplier``), on the exact step
    count: double ``σ`` from 20 until ``ε(σ) <= target``, then bisect until ``target - ε(σ) <=
    epsilon_tolerance``. With the steps Opacus would derive from epochs, the result is
    Opacus's, bit for bit.

    Guarantee: ``compute_epsilon(σ, sample_rate, steps, delta, accountant) <= target_epsilon``
    (and within ``epsilon_tolerance`` of it). Running fewer steps spends less; running more
    (e.g. a client that trains more rounds than planned) spends more.

    Raises:
        ValueError: an argument out of range (the message names it and its value), or no
            ``σ <= 1e6`` reaches the target.
    """
    _check_positive("target_epsilon", target_epsilon)
    _check_positive("epsilon_tolerance", epsilon_tolerance)
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta={delta!r}: expected 0 < delta < 1")
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate={sample_rate!r}: expected 0 < q <= 1")
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
        raise ValueError(f"steps={steps!r}: expected an integer >= 1")
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant={accountant!r}: expected one of {', '.join(ACCOUNTANTS)}")
    # The key is every input of the search, as the exact types it computes with.
    args = (float(target_epsilon), float(delta), float(sample_rate), int(steps), accountant)
    search = _calibrate if _memo_enabled else _calibrate.__wrapped__
    return search(*args, float(epsilon_tolerance))


@functools.lru_cache(maxsize=_CALIBRATIONS)
def _calibrate(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: AccountantName,
    epsilon_tolerance: float,
) -> float:
    def epsilon(sigma: float) -> float:
        return compute_epsilon(
            noise_multiplier=sigma,
            sample_rate=sample_rate,
            steps=steps,
            delta=delta,
            accountant=accountant,
        )

    sigma_low, sigma_high, eps_high = 0.0, 10.0, math.inf
    while eps_high > target_epsilon:
        sigma_high *= 2
        eps_high = epsilon(sigma_high)
        if sigma_high > _MAX_SIGMA:
            raise ValueError(
                f"target_epsilon={target_epsilon!r}: unreachable with noise_multiplier <= "
                f"{_MAX_SIGMA:g} at delta={delta}, sample_rate={sample_rate}, steps={steps}"
            )
    while target_epsilon - eps_high > epsilon_tolerance:
        sigma = (sigma_low + sigma_high) / 2
        eps = epsilon(sigma)
        if eps < target_epsilon:
            sigma_high, eps_high = sigma, eps
        else:
            sigma_low = sigma
    return sigma_high


def history_to_record(
    history: Sequence[tuple[float, float, int]],
) -> dict[str, list[float] | list[int]]:
    """The accountant history as record lists ``{"acc-sigma", "acc-q", "acc-steps"}``.

    Layout (what the client has always stored in ``Context.state``): one list per key, a
    leading ``(0.0, 0.0, 0)`` entry (a ``ConfigRecord`` list cannot be empty), then one entry
    per history entry; σ and q as ``float``, steps as ``int``. Every real entry has at least
    one step, so ``history_from_record`` (which skips zero-step entries) inverts this exactly.

    Raises:
        ValueError: a malformed entry (non-finite or negative σ, q outside [0, 1], steps not
            an integer >= 1); the message names the key and the entry.
    """
    entries: list[tuple[float, float, int]] = [(0.0, 0.0, 0)]
    for i, entry in enumerate(history):
        if len(entry) != 3:
            raise ValueError(f"history[{i}]={entry!r}: expected (sigma, q, steps)")
        sigma, q, steps = entry
        entries.append(_check_entry(i, sigma, q, steps, min_steps=1))
    return {
        "acc-sigma": [s for s, _, _ in entries],
        "acc-q": [q for _, q, _ in entries],
        "acc-steps": [n for _, _, n in entries],
    }


def history_from_record(record: Mapping[str, Any]) -> list[tuple[float, float, int]]:
    """The accountant history stored by ``history_to_record`` (other keys are ignored).

    Entries with zero steps (the leading placeholder) are skipped: they spend nothing.

    Raises:
        ValueError: a key missing or not a list, lists of different lengths, or a malformed
            entry; the message names the key.
    """
    columns: list[Sequence[Any]] = []
    for key in HISTORY_KEYS:
        if key not in record:
            raise ValueError(f"{key}: missing from the accountant-history record")
        value = record[key]
        if isinstance(value, str | bytes) or not isinstance(value, Sequence):
            raise ValueError(f"{key}={value!r}: expected a list")
        columns.append(value)
    length = len(columns[0])
    for key, column in zip(HISTORY_KEYS[1:], columns[1:], strict=True):
        if len(column) != length:
            raise ValueError(
                f"{key}: {len(column)} entries, expected {length} (as many as {HISTORY_KEYS[0]})"
            )
    history = []
    for i, (sigma, q, steps) in enumerate(zip(*columns, strict=True)):
        entry = _check_entry(i, sigma, q, steps, min_steps=0)
        if entry[2] > 0:
            history.append(entry)
    return history


def _check_entry(
    i: int, sigma: Any, q: Any, steps: Any, *, min_steps: int
) -> tuple[float, float, int]:
    sigma_key, q_key, steps_key = HISTORY_KEYS
    if not (_is_real(sigma) and math.isfinite(sigma) and sigma >= 0):
        raise ValueError(f"{sigma_key}[{i}]={sigma!r}: expected a finite value >= 0")
    if not (_is_real(q) and 0.0 <= q <= 1.0):
        raise ValueError(f"{q_key}[{i}]={q!r}: expected 0 <= q <= 1")
    if not _is_integer(steps) or steps < min_steps:
        raise ValueError(f"{steps_key}[{i}]={steps!r}: expected an integer >= {min_steps}")
    return float(sigma), float(q), int(steps)


def _is_real(value: Any) -> bool:
    kind = type(value)  # float and int first: an ABC check is ~10x slower (a history a round)
    if kind is float or kind is int:
        return True
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_integer(value: Any) -> bool:
    if type(value) is int:  # as _is_real
        return True
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_positive(field: str, value: float) -> None:
    if not (_is_real(value) and math.isfinite(value) and value > 0):
        raise ValueError(f"{field}={value!r}: expected a finite value > 0")


def _check_sizes(num_examples: int, batch_size: int) -> tuple[int, int]:
    for field, value in (("num_examples", num_examples), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{field}={value!r}: expected an integer >= 1")
    return int(num_examples), int(batch_size)
