"""Update-norm bounds: the largest L2 norm a server accepts from a client in a round (plain
functions over public parameters, no Flower).

* ``NormBound`` is the per-round bound on an update's L2 norm: an absolute ``max_update_norm``,
  ``max_norm_ratio`` times the median norm of the round's valid updates (from ``min_updates`` (3)
  on: the median is the honest scale only under an honest majority) and/or the bound below;
  ``robust.clip_to_norm`` scales an update down to it.
* ``honest_update_norm_bound`` is the largest L2 norm an honest DP-SGD client's round can have with
  probability ``>= 1 - failure_probability``, from public parameters only;
  ``common/dp/worst_case.py: worst_case_noise_multiplier`` the largest sigma a client calibrates
  for a target epsilon whatever its data size; ``HonestClientBound`` the worst case over the
  clients' unknown data sizes (run-config ``dp-norm-bound``), which needs no honest majority: it
  bounds rounds of one or two updates too.

The honest-update bound
-----------------------
An honest client's round (``client/local_round.py``, ``common/dp/optimizer.py``) runs a fresh SGD
optimizer (lr ``eta``, momentum ``mu``, no weight decay) for ``s`` DP steps. Step ``t``'s gradient
is ``g_t = (S_t + Z_t) / b'``: ``S_t`` sums the per-sample gradients of the Poisson batch ``B_t``
(each example in with probability ``p``), each clipped to L2 norm ``<= C`` (after masking; GIP masks
after the sum, which only shrinks it), so ``||S_t|| <= C |B_t|``; ``Z_t ~ N(0, sigma^2 C^2 I_k)`` on
the ``k`` coordinates the step keeps; ``b'`` is Opacus's expected batch size ``int(n p)``. With
heavy-ball momentum (PyTorch's: ``v_1 = g_1``, ``v_t = mu v_{t-1} + g_t``) the round's delta is
``-eta sum_t v_t = -eta / (1 - mu) sum_t a_t g_t`` with ``a_t = 1 - mu^(s - t + 1)`` in ``[0, 1]``,
so::

    ||delta|| <= eta / (1 - mu) * ( C X + ||sum_t a_t Z_t|| ) / b',   X = sum_t a_t |B_t|

* ``X`` sums independent Bernoullis weighted by ``a_t <= 1``, with mean ``mu_X = m sum_t a_t`` (``m
  = n p``, the mean batch size) and variance ``sum_t a_t^2 n p (1 - p) <= mu_X``. Bernstein: ``P(X
  >= mu_X + u) <= exp(-u^2 / (2 (mu_X + u / 3)))``, so with ``L = ln(2 / P_fail)`` the event ``X <=
  mu_X + L / 3 + sqrt(L^2 / 9 + 2 mu_X L)`` fails with probability ``<= P_fail / 2``.
* Under one mask for the round (``mask-scope``, ``lf``, ``ranked``, ``dpssgd``) ``sum_t a_t Z_t`` is
  exactly ``N(0, sigma^2 C^2 A^2 I_k)``, ``A^2 = sum_t a_t^2``: the weights are fixed and every
  ``Z_t`` is fresh, whatever the data did. Gaussian concentration of the norm, 1-Lipschitz in a
  standard normal ``g`` with ``E||g|| <= sqrt(k)``: ``||sum_t a_t Z_t|| <= sigma C A (sqrt(k) +
  sqrt(2 L))`` fails with probability ``<= P_fail / 2``. random-k's per-step supports (``k``
  coordinates each) come from a stream independent of the noise: given them, the sum is a Gaussian
  with coordinate variances ``<= sigma^2 C^2 A^2`` and trace ``sigma^2 C^2 A^2 k``, and the same
  bound holds.
* GIP chooses each step's support from the data, which the earlier steps' noise moved: the sum is
  then a martingale, not a Gaussian, and the bound falls back to the triangle inequality, ``sum_t
  a_t ||Z_t on I_t||``, each ``<= sigma C (sqrt(k) + sqrt(2 ln(2 s / P_fail)))`` (a union bound over
  the steps): looser by about ``sqrt(s)`` in that term.

So, with probability ``>= 1 - P_fail`` (``mu = 0``: ``sum a = s``, ``A = sqrt(s)``)::

    ||delta|| <= eta / (1 - mu) * C / b' * ( m sum_t a_t + L / 3 + sqrt(L^2 / 9 + 2 m L sum_t a_t)
                                             + sigma A (sqrt(k) + sqrt(2 L)) )

The update travels in ``value-dtype``, whose rounding grows its norm by a factor that holds for
every draw of the rounding (``common/aggregation/quantized_norms.py: quantized_norm``); under
error feedback the carried residual adds ``sqrt(k) E`` first (``feedback_norm``: there each
round's ``V`` is taken at ``P_fail / (R + 1)``, ``R`` the run's rounds, a union bound). float32
arithmetic in training is left out: its errors are orders of magnitude below the slack of the tails
above.

What the server does not know is the client's data size ``n`` (a deployed node's sampling comes
from its public ``nominal-size`` instead, an ``n`` the bound below covers while it is at most
``N``, and its batches hold ``Bin(n_real, p)`` examples, fewer than ``Bin(nominal, p)``): it sets
``s = E ceil(n / b)`` (``E``
local epochs, ``b`` batch size; ``privacy.steps_per_epoch``), ``p = 1 / ceil(n / b)``, ``b' = int(n
p)`` and, under a target epsilon, sigma. ``HonestClientBound`` takes the maximum over every ``K =
ceil(n / b)`` from 1 to ``ceil(N / b)``, where ``N`` caps ``n`` (the size of the training split the
clients' partitions come from, or run-config ``max-client-examples``), of the bound at the smallest
``n`` with that ``K``: ``n = (K - 1) b + 1`` gives the smallest ``b'`` (``>= b / 2``) and ``m <= b'
+ 1``, and the bound falls as ``b'`` grows. Sigma is the largest any ``n`` calibrates
(``worst_case_noise_multiplier``). It covers every client with ``n >= b`` (``min(b, N)``). A client
with ``n < b`` takes one step an epoch on its whole data (``p = 1``, ``b' = n``): its noise term
grows as ``1 / n``, and it is covered only while that stays under the maximum over ``K``, which is
usually much larger because it is taken at the most steps (``smallest_covered_examples`` says from
which ``n`` on; on digits' defaults from 3 or 4 examples). Smaller clients (thousands of clients on
a small dataset) are covered once their size is declared (``min_examples``, run-config
``min-client-examples``): ``K = 1`` is then taken at that ``n``. The bound holds per update with
probability ``1 - HONEST_FAILURE_PROBABILITY`` (1e-9): a run of 10^5 honest updates loses one with
probability about 1e-4. Nothing bounds an update of the ``noisy`` mechanism (no per-sample
clipping), and under ``dp-level=user`` the server clips every update itself
(``common/dp/central.py``): neither gets this bound.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Final

import numpy as np

from fedsparse.common.aggregation.quantized_norms import (
    feedback_contraction,
    feedback_norm,
    quantized_norm,
)
from fedsparse.common.names import DP_NORM_BOUNDS, NORM_ACTIONS, DPNormBound, NormAction
from fedsparse.common.wire.payload import PayloadDType

__all__ = [
    "DP_NORM_BOUNDS",
    "HONEST_FAILURE_PROBABILITY",
    "NORM_ACTIONS",
    "DPNormBound",
    "HonestClientBound",
    "NormAction",
    "NormBound",
    "honest_update_norm_bound",
    "momentum_weights",
]


HONEST_FAILURE_PROBABILITY: Final = 1e-9
"""The probability that one honest update exceeds its ``HonestClientBound``."""


@dataclass(frozen=True, kw_only=True)
class NormBound:
    """The bound on an update's L2 norm in one round (0 disables either part).

    Attributes:
        max_norm_ratio: an update above ``max_norm_ratio`` times the median norm of the
            round's valid updates is out of bound; applies from ``min_updates`` updates on
            and when that median is > 0. Needs an honest majority (the median is theirs).
        max_update_norm: an absolute bound.
        min_updates: fewest updates for the relative bound.
    """

    max_norm_ratio: float = 0.0
    max_update_norm: float = 0.0
    min_updates: int = 3

    def __post_init__(self) -> None:
        for name in ("max_norm_ratio", "max_update_norm"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}={value!r}: expected a finite value >= 0 (0: off)")
        if self.max_norm_ratio and self.max_norm_ratio < 1:
            raise ValueError(
                f"max_norm_ratio={self.max_norm_ratio!r}: expected >= 1 (0: off); below 1 "
                "it rejects the median update itself"
            )

    def bound(
        self, norms: Sequence[float], *, honest: tuple[float, str] | None = None
    ) -> tuple[float, str]:
        """(the round's bound, how it was set) for updates of these norms; ``inf`` if none.

        The smallest of the absolute bound, the relative bound and ``honest``, a bound of
        the round's own with its description (``HonestClientBound``), applies.
        """
        candidates = [(math.inf, "no bound")]
        if honest is not None:
            if not (honest[0] >= 0 and not math.isnan(honest[0])):
                raise ValueError(f"honest={honest!r}: expected a bound >= 0")
            candidates.append(honest)
        if self.max_update_norm > 0:
            candidates.append((self.max_update_norm, f"max-update-norm={self.max_update_norm:g}"))
        if self.max_norm_ratio > 0 and len(norms) >= self.min_updates:
            median = float(statistics.median(norms))
            if median > 0:
                candidates.append(
                    (
                        self.max_norm_ratio * median,
                        f"max-norm-ratio={self.max_norm_ratio:g} x median {median:.4g}",
                    )
                )
        return min(candidates, key=lambda c: c[0])


def momentum_weights(momentum: float, steps: int) -> tuple[float, float]:
    """``(sum_t a_t, sqrt(sum_t a_t^2))`` for ``a_t = 1 - momentum^t``, ``t = 1..steps``.

    ``sum_t v_t = sum_t a_t g_t / (1 - momentum)`` for PyTorch's heavy-ball velocities
    ``v_t``; with ``momentum = 0`` the pair is ``(steps, sqrt(steps))``.
    """
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum={momentum!r}: expected 0 <= momentum < 1")
    if steps < 0:
        raise ValueError(f"steps={steps!r}: expected >= 0")
    if momentum == 0.0:
        return float(steps), math.sqrt(steps)
    t = np.arange(1, steps + 1, dtype=np.float64)
    a = -np.expm1(t * math.log(momentum))  # 1 - momentum^t, exact for small momentum^t
    return float(a.sum()), float(math.sqrt(float((a * a).sum())))


def honest_update_norm_bound(
    *,
    lr: float,
    momentum: float,
    max_grad_norm: float,
    noise_multiplier: float,
    expected_batch_size: float,
    steps: int,
    keep: int,
    failure_probability: float = HONEST_FAILURE_PROBABILITY,
    mean_batch_size: float | None = None,
    adaptive_support: bool = False,
) -> float:
    """The L2 norm an honest client's round stays under with prob. ``>= 1 - failure_probability``.

    The formula and its derivation are in the module docstring: ``eta / (1 - mu) * C / b' * (m sum a
    + L / 3 + sqrt(L^2 / 9 + 2 m L sum a) + sigma A (sqrt(k) + sqrt(2 L)))``, ``L = ln(2 /
    failure_probability)`` (``ln(1 / failure_probability)`` without noise).

    Args:
        lr, momentum: the client's SGD (a fresh optimizer each round, no weight decay).
        max_grad_norm: ``C``, the per-sample clipping norm.
        noise_multiplier: ``sigma`` (0: no noise, the ``clipped`` mechanism).
        expected_batch_size: ``b'``, what the summed gradient is divided by (Opacus's
            ``int(n q)``); > 0.
        steps: ``s``, DP steps in the round.
        keep: ``k``, the coordinates each step's noise covers.
        failure_probability: ``P_fail`` in ``(0, 1)``.
        mean_batch_size: ``m``, the mean Poisson batch size ``n p`` (default
            ``expected_batch_size``).
        adaptive_support: each step's support depends on earlier noise (GIP): the noise
            term by the triangle inequality over the steps.

    Raises:
        ValueError: an argument out of range (named with its value).
    """
    for name, value in (("lr", lr), ("max_grad_norm", max_grad_norm)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name}={value!r}: expected a finite value > 0")
    if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise ValueError(f"noise_multiplier={noise_multiplier!r}: expected a finite value >= 0")
    if not (math.isfinite(expected_batch_size) and expected_batch_size > 0):
        raise ValueError(f"expected_batch_size={expected_batch_size!r}: expected a value > 0")
    mean = expected_batch_size if mean_batch_size is None else mean_batch_size
    if not (math.isfinite(mean) and mean >= 0):
        raise ValueError(f"mean_batch_size={mean_batch_size!r}: expected a finite value >= 0")
    if steps < 1:
        raise ValueError(f"steps={steps!r}: expected >= 1")
    if keep < 0:
        raise ValueError(f"keep={keep!r}: expected >= 0")
    if not 0.0 < failure_probability < 1.0:
        raise ValueError(f"failure_probability={failure_probability!r}: expected 0 < p < 1")
    total, root = momentum_weights(momentum, steps)
    noisy = noise_multiplier > 0 and keep > 0
    log_fail = math.log((2.0 if noisy else 1.0) / failure_probability)
    mean_x = mean * total
    batches = mean_x + log_fail / 3 + math.sqrt(log_fail**2 / 9 + 2 * mean_x * log_fail)
    noise = 0.0
    if noisy and adaptive_support:
        per_step = math.sqrt(keep) + math.sqrt(2 * math.log(2 * steps / failure_probability))
        noise = noise_multiplier * total * per_step
    elif noisy:
        noise = noise_multiplier * root * (math.sqrt(keep) + math.sqrt(2 * log_fail))
    return lr / (1 - momentum) * max_grad_norm * (batches + noise) / expected_batch_size


@dataclass(frozen=True, kw_only=True)
class HonestClientBound:
    """The largest update norm of an honest client of the run, over every data size it may have.

    The public caps (the module docstring's derivation): the client's SGD, clipping norm,
    ``noise_multiplier`` (the fixed sigma, or ``worst_case_noise_multiplier``), batch size, local
    epochs, ``max_examples``, the most examples a client holds, and ``min_examples``, the fewest (0:
    not declared). ``bound(keep)`` is the maximum of ``honest_update_norm_bound`` over ``K = 1 ..
    ceil(max_examples / batch_size)`` batches an epoch at each ``K``'s smallest data size (``K =
    1``: ``smallest_one_batch``), in ``value_dtype``.

    Attributes:
        adaptive_support: GIP (the steps' supports depend on the noise: module docstring).
        min_examples: the fewest examples a client holds (0: not declared).
        value_block: the low-bit dtypes' block (0: one block of every value sent).
        feedback_keep: error feedback (0: off): the most coordinates a round's noise covers
            (the model's ``d``), whose bound bounds every round's values, and so the residual.
        feedback_rounds: error feedback: the run's rounds. A round's bound then leans on every
            earlier round's, so each of those events is taken at ``failure_probability /
            (feedback_rounds + 1)`` (a union bound: still ``failure_probability`` an update).
    """

    lr: float
    momentum: float
    max_grad_norm: float
    noise_multiplier: float
    batch_size: int
    local_epochs: int
    max_examples: int
    value_dtype: PayloadDType = "fp32"
    adaptive_support: bool = False
    failure_probability: float = HONEST_FAILURE_PROBABILITY
    min_examples: int = 0
    value_block: int = 0
    feedback_keep: int = 0
    feedback_rounds: int = 0

    def __post_init__(self) -> None:
        for name in ("batch_size", "local_epochs", "max_examples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected >= 1")
        if not 0 <= self.min_examples <= self.max_examples:
            raise ValueError(
                f"min_examples={self.min_examples!r}: expected 0 (not declared) to "
                f"max_examples={self.max_examples}"
            )
        for name in ("value_block", "feedback_keep", "feedback_rounds"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected >= 0")
        if self.feedback_keep and feedback_contraction(self.value_dtype) is None:
            raise ValueError(
                f"value_dtype={self.value_dtype!r}: its rounding error does not contract under "
                "error feedback, so no update bound holds"
            )
        # the rest is checked where it is used
        self._norm(divisor=1.0, mean=1.0, steps=1, keep=1)
        quantized_norm(1.0, value_dtype=self.value_dtype, keep=1)

    def _norm(self, *, divisor: float, mean: float, steps: int, keep: int) -> float:
        return honest_update_norm_bound(
            lr=self.lr,
            momentum=self.momentum,
            max_grad_norm=self.max_grad_norm,
            noise_multiplier=self.noise_multiplier,
            expected_batch_size=divisor,
            mean_batch_size=mean,
            steps=steps,
            keep=keep,
            failure_probability=self.failure_probability,
            adaptive_support=self.adaptive_support,
        )

    @property
    def max_batches(self) -> int:
        """``ceil(N / b)``: the most batches (steps) an epoch of any client takes."""
        return -(-self.max_examples // min(self.batch_size, self.max_examples))

    @property
    def smallest_one_batch(self) -> int:
        """The ``n`` whose bound ``K = 1`` takes: ``min(b, N)``, or the declared
        ``min_examples`` below it (the noise term grows as ``1 / n``)."""
        top = min(self.batch_size, self.max_examples)
        return min(self.min_examples, top) if self.min_examples else top

    @property
    def max_steps(self) -> int:
        """The most DP steps of a client's round."""
        return self.local_epochs * self.max_batches

    def _at(self, batches: int, keep: int, examples: int | None = None) -> float:
        """The bound before ``value_dtype`` for clients with ``batches`` batches an epoch
        (``examples``: K = 1's n)."""
        b = self.batch_size
        if batches == 1:  # p = 1: every example in every step, b' = |B_t| = n
            n = self.smallest_one_batch if examples is None else examples
            divisor, mean = float(n), float(n)
        else:  # the smallest n with this many batches; Opacus's int(n * (1 / K))
            divisor = float(int(((batches - 1) * b + 1) * (1 / batches)))
            mean = min(float(b), divisor + 1)  # n p < int(n p) + 1, and n p <= b
        return self._norm(divisor=divisor, mean=mean, steps=self.local_epochs * batches, keep=keep)

    def bound(self, keep: int, *, sent: int | None = None) -> float:
        """The bound for a round whose steps keep ``keep`` coordinates (memoized), once the
        update travels as ``sent`` values in ``value_dtype`` (None: ``keep``; gip and
        random-k send the union of their steps' supports, up to ``d``). ``quantized_norm``
        grows with the norm, so it applies to the maximum over data sizes."""
        values = keep if sent is None else sent
        each = self._events
        peak = _client_bound(each, self.feedback_keep) if self.feedback_keep else 0.0
        return self._released(_client_bound(each, keep), peak, values)

    @property
    def _events(self) -> HonestClientBound:
        """The caps each high-probability bound is taken at (``feedback_rounds``)."""
        if not self.feedback_keep:
            return self
        fail = self.failure_probability / (self.feedback_rounds + 1)
        return replace(self, failure_probability=fail, feedback_keep=0, feedback_rounds=0)

    def _released(self, norm: float, peak: float, values: int) -> float:
        """The bound on what travels: ``values`` values of norm ``<= norm`` in
        ``value_dtype``, under error feedback in rounds whose values stayed under ``peak``
        (``feedback_keep``'s bound: ``feedback_norm``)."""
        dtype, block = self.value_dtype, self.value_block
        if self.feedback_keep:
            return feedback_norm(norm, peak=peak, value_dtype=dtype, keep=values, block=block)
        return quantized_norm(norm, value_dtype=dtype, keep=values, block=block)

    def smallest_covered_examples(self, keep: int, *, sent: int | None = None) -> int:
        """The fewest examples ``n`` from which on every honest client is covered (``sent``
        as in ``bound``).

        ``smallest_one_batch`` (``min(b, N)``, or the declared ``min_examples``) by
        construction; a client below it (``K = 1``, its noise term ``~ 1 / n``) is covered
        while its own bound stays under ``bound(keep)``, which falls with ``n``: the first
        such ``n``.
        """
        values = keep if sent is None else sent
        limit, top, each = self.bound(keep, sent=sent), self.smallest_one_batch, self._events
        low, high = 1, top  # the answer lies in [1, top]; _at(1, keep, n) falls with n
        while low < high:
            mid = (low + high) // 2
            peak = each._at(1, self.feedback_keep, mid) if self.feedback_keep else 0.0
            if self._released(each._at(1, keep, mid), peak, values) <= limit:
                high = mid
            else:
                low = mid + 1
        return low


@functools.lru_cache(maxsize=256)
def _client_bound(caps: HonestClientBound, keep: int) -> float:
    if keep < 0:
        raise ValueError(f"keep={keep!r}: expected >= 0")
    return max(caps._at(batches, keep) for batches in range(1, caps.max_batches + 1))
