"""The largest noise multiplier any client of a federated run calibrates, whatever its data size.

A client calibrates sigma for its target epsilon over ``epochs K`` steps at ``q = 1/K`` (``K =
ceil(n / b)`` batches an epoch), so its sigma depends on its data size ``n``, which the server
does not know; ``worst_case_noise_multiplier`` bounds it over every ``K``, from the RDP curve's
closed-form bound at integer orders (``_uniform_epsilon``). The DP-derived update-norm bound
(``common/aggregation/norm_bounds.py: HonestClientBound``) takes its sigma from here. Pure math
over Opacus's accountants, no Flower.
"""

from __future__ import annotations

import functools
import math
from typing import Final

import numpy as np
from opacus.accountants import RDPAccountant

from fedsparse.common.dp.accounting import ACCOUNTANTS, AccountantName, calibrate_noise_multiplier

__all__ = ["worst_case_noise_multiplier"]

#: Integer orders of Opacus's RDP accountant: those where ``_uniform_epsilon`` bounds its curve.
_INTEGER_ORDERS: Final = np.array(
    [a for a in RDPAccountant.DEFAULT_ALPHAS if float(a).is_integer() and a >= 2], dtype=np.float64
)
#: PRV's ``eps_upper`` (the estimate at ``delta - delta / 1000`` plus ``eps_error``, 0.01, the
#: estimate's own error bound) exceeds the true epsilon by about 0.02 at most.
_PRV_SLACK: Final = 0.02
_MAX_SIGMA: Final = 1e6


def _uniform_epsilon(sigma: float, epochs: int, delta: float) -> float:
    """An epsilon at ``delta`` that bounds ``(q = 1/K, steps = epochs K)`` for EVERY ``K >= 1``.

    At an integer order ``alpha`` the sampled Gaussian's RDP is ``ln(E[exp(c (J^2 - J))]) / (alpha -
    1)`` with ``J ~ Bin(alpha, q)``, ``c = 1 / (2 sigma^2)`` (Mironov, Talwar, Zhang, "Rényi
    Differential Privacy of the Sampled Gaussian Mechanism", arXiv:1908.10530, Sec. 3.3; what Opacus
    computes there). ``J^2 - J <= (alpha - 1) J`` gives ``<= alpha ln(1 + q (e^(c (alpha - 1)) - 1))
    <= alpha q (e^(c (alpha - 1)) - 1)``, so ``epochs K`` steps at ``q = 1/K`` compose to at most
    ``epochs alpha (e^(c (alpha - 1)) - 1) / (alpha - 1)``, free of ``K``. Converted as Opacus
    converts (Balle et al., "Hypothesis Testing Interpretations and Renyi Differential Privacy",
    arXiv:1905.09982, Thm. 21; monotone in the RDP), minimum over the integer orders Opacus has.
    """
    a = _INTEGER_ORDERS
    with np.errstate(over="ignore"):
        rdp = epochs * a * np.expm1((a - 1) / (2 * sigma * sigma)) / (a - 1)
    eps = rdp - (math.log(delta) + np.log(a)) / (a - 1) + np.log((a - 1) / a)
    return float(np.min(eps))


@functools.lru_cache(maxsize=64)
def worst_case_noise_multiplier(
    *,
    target_epsilon: float,
    delta: float,
    epochs: int,
    accountant: AccountantName,
    epsilon_tolerance: float = 0.01,
) -> float:
    """A sigma no client calibrates above, whatever its data size ``n``.

    A client calibrates sigma for ``target_epsilon`` over ``epochs K`` steps at ``q = 1/K`` (``K =
    ceil(n / b)``, ``epochs = num-rounds x local-epochs``: ``client/train_message.py``), to within
    ``epsilon_tolerance`` below the target (``privacy.calibrate_noise_multiplier``). Which ``K``
    needs the most noise depends on the target: ``q = 1`` for the usual targets, but for large ones
    (``epsilon = 30`` over one epoch) ``K = 7`` needs 1.6 times its sigma, so no ``K`` is assumed.
    Returned: the smallest sigma (to ``1e-9`` relative, rounded up) whose ``_uniform_epsilon`` -- a
    bound on the RDP accountant's epsilon at every ``K`` -- is at most ``target_epsilon -
    epsilon_tolerance``; every client's calibrated sigma, whose epsilon is at least that, is then no
    larger. Deployed nodes calibrate with ``rdp``; a simulated node with the run's ``accountant``:
    for ``prv`` the target is lowered by 0.02, what PRV's ``eps_upper`` may exceed the true epsilon
    by (which RDP, and so this bound, bounds), and for ``gdp``, whose ``mu = sqrt(epochs
    (e^(1/sigma^2) - 1) / K)`` falls with ``K``, the ``q = 1`` calibration is taken if larger.
    Within 1-9% of the largest calibrated sigma for epsilon <= 8 (tests), up to 1.9x for epsilon =
    100 over one epoch.

    Raises:
        ValueError: an argument out of range, or the target is unreachable with sigma <= 1e6.
    """
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"target_epsilon={target_epsilon!r}: expected a finite value > 0")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta={delta!r}: expected 0 < delta < 1")
    if epochs < 1:
        raise ValueError(f"epochs={epochs!r}: expected >= 1")
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant={accountant!r}: expected one of {', '.join(ACCOUNTANTS)}")
    target = target_epsilon - epsilon_tolerance - (_PRV_SLACK if accountant == "prv" else 0.0)
    if target <= 0:
        raise ValueError(
            f"target_epsilon={target_epsilon!r}: too small for a worst-case sigma (expected > "
            f"{target_epsilon - target:g})"
        )
    low, high = 0.0, 1.0
    while _uniform_epsilon(high, epochs, delta) > target:
        low, high = high, 2 * high
        if high > _MAX_SIGMA:
            raise ValueError(
                f"target_epsilon={target_epsilon!r}: unreachable with noise_multiplier <= "
                f"{_MAX_SIGMA:g} at delta={delta}, over {epochs} epochs"
            )
    while high - low > 1e-9 * high:
        mid = (low + high) / 2
        if _uniform_epsilon(mid, epochs, delta) <= target:
            high = mid
        else:
            low = mid
    if accountant == "gdp":
        high = max(
            high,
            calibrate_noise_multiplier(
                target_epsilon=target_epsilon - epsilon_tolerance,
                delta=delta,
                sample_rate=1.0,
                steps=epochs,
                accountant="gdp",
            ),
        )
    return high
