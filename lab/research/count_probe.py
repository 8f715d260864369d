"""The count probe: a server that decodes a node's example count from its calibration refusals.

A node calibrates σ for the run's ``target-epsilon`` over ``num-rounds × local-epochs × K``
steps at ``q = 1 / K``, ``K = ceil(n / b)`` (``common/dp/accounting.py``), and refuses when no
``σ <= 1e6`` reaches the target. That outcome is a function of public values and ``K``: a
server that knows the node's accountant can pick a target that one half of the candidate
``K`` reach and the other does not, read one bit from the reply, and repeat; with a few batch
sizes ``b`` the intersection pins ``n``. The targets sit near the ε that ``σ ≈ 6.5 × 10⁵``
spends over a huge ``num-rounds``, so a probe that trains costs its node about nothing.

Before nodes declared a public ``nominal-size`` (``client/node_data.py``) this recovered a
deployed node's exact count in 10-11 train messages (``n = 479`` and ``n = 205`` on two digits
partitions). Now every number behind the refusal comes from the declared ``N``: the probe
recovers ``N``, which is public anyway, and nothing of ``n``
(``tests/client/test_count_privacy.py``). Pure math over the node's public accountant; the
caller sends the probes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from fedsparse.common.dp.accounting import compute_epsilon, steps_per_epoch

__all__ = ["LARGEST_SIGMA", "Probe", "count_candidates", "refuses", "threshold"]

#: The largest σ ``calibrate_noise_multiplier`` tries (it doubles from 20 and stops above 1e6).
LARGEST_SIGMA = 20.0 * 2**15

#: One probe: ``(target_epsilon, batch_size)`` -> whether the node refused to calibrate.
Probe = Callable[[float, int], bool]


def threshold(*, count: int, batch_size: int, num_rounds: int, delta: float) -> float:
    """The smallest target a node holding ``count`` examples calibrates for (below it, it
    refuses): the ε of the largest σ its search tries, ``20 × 2^15 ≈ 6.5 × 10⁵``
    (``calibrate_noise_multiplier`` doubles σ from 20 and gives up above ``10⁶``), over the
    run's steps at ``q = 1 / K``, with the node's public accountant (``rdp``, one local epoch
    a round)."""
    batches = steps_per_epoch(count, batch_size)
    return compute_epsilon(
        noise_multiplier=LARGEST_SIGMA,
        sample_rate=1 / batches,
        steps=num_rounds * batches,
        delta=delta,
        accountant="rdp",
    )


def refuses(
    target_epsilon: float, *, count: int, batch_size: int, num_rounds: int, delta: float
) -> bool:
    """Whether a node holding ``count`` examples refuses ``target_epsilon`` (the server's
    prediction; ``threshold``)."""
    limit = threshold(count=count, batch_size=batch_size, num_rounds=num_rounds, delta=delta)
    return target_epsilon < limit


def count_candidates(
    probe: Probe,
    *,
    batch_sizes: Iterable[int],
    max_count: int,
    num_rounds: int,
    delta: float = 1e-5,
) -> set[int]:
    """The counts ``1..max_count`` consistent with the probe's answers (the attack).

    For each batch size the candidates fall into groups of equal ``K = ceil(n / b)``, whose
    thresholds fall as ``K`` grows; while more than one group remains, the target halfway (in
    log-space) between the middle group's threshold and its neighbour's is sent, and the
    groups the answer rules out are dropped: a binary search over ``K``.
    """
    candidates = set(range(1, max_count + 1))
    for batch_size in batch_sizes:
        while True:
            members = {steps_per_epoch(n, batch_size): n for n in candidates}
            if len(members) < 2:  # one K: this batch size tells the candidates apart no more
                break
            limits = {
                k: threshold(count=n, batch_size=batch_size, num_rounds=num_rounds, delta=delta)
                for k, n in members.items()
            }
            groups = sorted(limits, key=lambda k: limits[k], reverse=True)
            middle = len(groups) // 2
            upper, lower = limits[groups[middle - 1]], limits[groups[middle]]
            if not upper > lower:  # equal thresholds: no target tells these apart
                break
            target = math.sqrt(upper * lower)
            refused = probe(target, batch_size)
            candidates = {
                n
                for n in candidates
                if (target < limits[steps_per_epoch(n, batch_size)]) == refused
            }
    return candidates
