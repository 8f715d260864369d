"""User-level DP with a trusted server: DP-FedAvg (McMahan et al. 2018), sparse-aware.

With ``dp-level=user`` the clients add no noise (they train plain SGD on the round's support,
run-config mechanism ``noisy`` at sigma 0) and the server makes each round's aggregate a
Gaussian mechanism over *users*:

1. **Poisson sampling of users**: every connected node joins the round independently with
   probability ``q = clients-per-round / N`` (:func:`poisson_sample`), so the RDP accountant's
   subsampled-Gaussian analysis applies exactly (fixed-size sampling would not). The draw is
   as secret as the noise (OS entropy unless ``central-noise=seeded``).
2. **Clip each update** to L2 norm ``S`` (``central-clip``).
3. **Fixed denominator**: the new model is ``w + (sum_i clip(u_i) + z) / (q N)``, where ``z``
   is ``N(0, sigma_c^2 S^2)`` on the round's *public* support only (the RS mask, the unfrozen
   layers, or the server-chosen support) and ``q N`` is the expected number of users. One
   user's data moves the sum by at most ``S`` whether or not it was sampled (add/remove
   adjacency), so the round is the subsampled Gaussian mechanism with multiplier ``sigma_c``.
4. **Accounting over rounds**: ``(sigma_c, q, rounds)`` through the run's accountant gives the
   user-level epsilon at ``delta`` (:func:`user_level_epsilon`); every round counts and every
   round releases the mechanism's output, also one in which nobody was sampled or answered
   (the model then moves by the noise alone).
5. **A target instead of a multiplier** (``central-target-epsilon``): before each round the
   server checks that the rounds so far plus the rounds left at this round's ``q`` spend at
   most the target; in round 1 it picks the smallest ``sigma_c`` that does (within 0.1% of the
   target), and it raises ``sigma_c`` in a later round whose ``q`` grew (fewer nodes), so
   nodes that connect for round 1 only cannot push the run past its target
   (:func:`calibrate_central_noise`). Every input is public (the target, ``delta``,
   ``num-rounds``, ``clients-per-round``, ``N``), and the history records each round's own
   ``sigma_c``.

Coordinates off the support get neither signal nor noise, as in RS: the support is public, so
restricting the mechanism to it changes no privacy argument. Methods whose supports the
clients choose (``gip``, ``random-k``) and per-client masks (``mask-scope=client``, whose union
depends on who was sampled) are refused: the noise must cover every coordinate a user could
have touched.

Trust: this is *central* DP. The server sees every clipped update in the clear and must be
trusted to add ``z`` and to keep it secret (``central-noise=fresh``: OS entropy; ``seeded``
only for reproducible simulations, where the seed is public and the noise is not secret).
With ``secure-mode=true`` the server's noise is hardened as the clients' is (Opacus's
``_generate_noise(secure_mode=True)``: each coordinate the scaled sum of 4 Gaussian draws,
against floating-point attacks that recover a Gaussian sample's generator state), and
``central-noise`` must be ``fresh``. A
deployed node that does not trust its server keeps sample-level local DP (``dp-level=sample``,
the default); its policy refuses to train without local noise unless its owner allows the
``noisy`` mechanism.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence

import numpy as np
import torch
from opacus.optimizers.optimizer import _generate_noise

from fedsparse.common.aggregation.exact_sum import ExactSum
from fedsparse.common.aggregation.robust import clip_to_norm
from fedsparse.common.dp.accounting import AccountantName, compute_epsilon_of_history
from fedsparse.common.names import CENTRAL_NOISE_SOURCES, DP_LEVELS, CentralNoise, DPLevel

__all__ = [
    "CENTRAL_NOISE_SOURCES",
    "DP_LEVELS",
    "CentralNoise",
    "DPLevel",
    "calibrate_central_noise",
    "central_aggregate",
    "central_noise_generator",
    "poisson_sample",
    "user_level_epsilon",
    "user_sample_rate",
]


def user_sample_rate(clients_per_round: int, num_nodes: int) -> float:
    """``q = min(1, clients-per-round / N)`` over the ``N`` connected nodes.

    The denominator stays ``clients-per-round`` (the expected number of users when ``N`` is
    at least that): with fewer nodes every one joins (``q = 1``) and one user still moves the
    round by at most ``S / clients-per-round``. ``N`` is treated as public, as in DP-FedAvg.

    Raises:
        ValueError: no nodes, or ``clients-per-round`` < 1.
    """
    if num_nodes < 1:
        raise ValueError(f"num_nodes={num_nodes}: expected >= 1")
    if clients_per_round < 1:
        raise ValueError(
            f"clients-per-round={clients_per_round}: expected >= 1 (DP-FedAvg's expected "
            "number of users per round)"
        )
    return min(1.0, clients_per_round / num_nodes)


def poisson_sample(nodes: list[int], rate: float, rng: np.random.Generator) -> list[int]:
    """The nodes that join the round: each independently with probability ``rate``."""
    if not 0.0 < rate <= 1.0:
        raise ValueError(f"rate={rate}: expected 0 < rate <= 1")
    keep = rng.random(len(nodes)) < rate
    return [node for node, k in zip(nodes, keep, strict=True) if k]


def central_noise_generator(source: CentralNoise, *, seed: int) -> torch.Generator:
    """The server's noise generator: ``seed`` for ``seeded``, else 63 bits of OS entropy."""
    if source not in CENTRAL_NOISE_SOURCES:
        raise ValueError(
            f"central-noise={source!r}: expected one of {', '.join(CENTRAL_NOISE_SOURCES)}"
        )
    return torch.Generator().manual_seed(seed if source == "seeded" else secrets.randbits(63))


def central_aggregate(
    weights: torch.Tensor,
    updates: list[tuple[torch.Tensor, torch.Tensor | None]],
    *,
    support: torch.Tensor | None,
    clip: float,
    noise_multiplier: float,
    expected_users: float,
    generator: torch.Generator,
    secure: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One DP-FedAvg round: ``w + (sum_i clip(u_i, S) + N(0, sigma^2 S^2)) / (q N)`` on ``support``.

    Args:
        weights: the global model, flat float32.
        updates: ``(values, support_i)`` per accepted user; ``support_i`` int64 indices (None:
            dense). Every ``support_i`` must lie within ``support``.
        support: the round's public support (int64 indices; None: every coordinate).
        clip: ``S``, the per-user L2 bound.
        noise_multiplier: ``sigma_c``.
        expected_users: ``q N``, the fixed denominator.
        generator: the noise stream.
        secure: hardened noise (Opacus's secure mode: 4 draws per coordinate, 1 discarded
            first), at the same standard deviation.

    Returns:
        ``(new weights, the bool mask of coordinates that changed)``.

    Raises:
        ValueError: a bad parameter, or an update off the public support.
    """
    if not (math.isfinite(clip) and clip > 0):
        raise ValueError(f"central-clip={clip}: expected a finite value > 0")
    if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise ValueError(f"central-noise-multiplier={noise_multiplier}: expected finite >= 0")
    if not expected_users > 0:
        raise ValueError(f"expected_users={expected_users}: expected > 0")
    d = weights.numel()
    allowed = torch.ones(d, dtype=torch.bool)
    if support is not None:
        allowed = torch.zeros(d, dtype=torch.bool)
        allowed[support] = True
    summed = ExactSum(d)  # exact: the same sum in whatever order the updates arrive
    for values, where in updates:
        clipped = clip_to_norm(values, bound=clip).to(torch.float64)
        if where is None:
            if support is not None:
                raise ValueError("a dense update in a round with a sparse public support")
            summed.add_(clipped)
        else:
            if not bool(allowed[where].all()):
                raise ValueError("an update touches coordinates off the round's public support")
            if where.numel() > 1 and not bool((where[1:] > where[:-1]).all()):
                raise ValueError("an update's support is not strictly increasing")
            summed.add_(clipped, where)
    if secure:
        noise = _generate_noise(
            std=noise_multiplier * clip,
            reference=torch.zeros(d),
            generator=generator,
            secure_mode=True,
        )
    else:
        noise = torch.normal(0.0, noise_multiplier * clip, size=(d,), generator=generator)
    total = summed.value()
    total += noise.to(torch.float64) * allowed
    new = (weights.to(torch.float64) + total / expected_users).to(torch.float32)
    return new, allowed


def user_level_epsilon(
    *,
    noise_multiplier: float,
    sample_rate: float,
    rounds: int,
    delta: float,
    accountant: AccountantName = "rdp",
) -> float:
    """User-level epsilon after ``rounds`` DP-FedAvg rounds (inf without noise; 0 before any)."""
    if rounds <= 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    return compute_epsilon_of_history(
        [(noise_multiplier, sample_rate, rounds)], delta=delta, accountant=accountant
    )


#: How far below its target a calibrated user-level epsilon may land, relative to the target.
CENTRAL_TARGET_TOLERANCE = 1e-3
#: The largest central sigma searched: the accountant's epsilon there is within 0.1% of its
#: floor at delta (about 0.103 at delta = 1e-5 over Opacus's orders), below which no sigma goes.
_MAX_CENTRAL_SIGMA = 1e3


def calibrate_central_noise(
    *,
    target_epsilon: float,
    sample_rate: float,
    rounds: int,
    delta: float,
    accountant: AccountantName = "rdp",
    history: Sequence[tuple[float, float, int]] = (),
    sigma: float | None = None,
) -> float:
    """``sigma_c`` for the next ``rounds`` DP-FedAvg rounds at users' rate ``sample_rate``,
    after the rounds of ``history`` (``(sigma, q, rounds)`` entries), so that the whole run
    spends at most ``target_epsilon`` at ``delta``: ``sigma`` (the run's so far) where it
    still does, else the smallest sigma a bisection finds that does, within 0.1% of the
    target (``CENTRAL_TARGET_TOLERANCE``). The inputs are public (the rate follows from
    ``clients-per-round`` and the connected nodes), so choosing sigma by them each round is
    accounted like a fixed one: the history records each round's own.

    Raises:
        ValueError: an argument out of range, or a target the history leaves no room for
            (no sigma <= 1e3 reaches it), named with its value.
    """
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"central-target-epsilon={target_epsilon!r}: expected a finite value > 0")
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate={sample_rate!r}: expected 0 < q <= 1")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds={rounds!r}: expected an integer >= 1")
    past = list(history)

    def spent(s: float) -> float:
        entries = [*past, (s, sample_rate, rounds)]
        return compute_epsilon_of_history(entries, delta=delta, accountant=accountant)

    if sigma is not None and sigma > 0 and spent(sigma) <= target_epsilon:
        return sigma
    low, high = 0.0, 10.0
    while spent(high) > target_epsilon:
        if high >= _MAX_CENTRAL_SIGMA:  # near the accountant's floor at delta
            before = compute_epsilon_of_history(past, delta=delta, accountant=accountant)
            raise ValueError(
                f"central-target-epsilon={target_epsilon!r}: unreachable with sigma <= "
                f"{_MAX_CENTRAL_SIGMA:g} for {rounds} more rounds at q={sample_rate:.6g} and "
                f"delta={delta:g} (the rounds so far spent {before:.6g})"
            )
        low, high = high, min(2 * high, _MAX_CENTRAL_SIGMA)
    while target_epsilon - spent(high) > CENTRAL_TARGET_TOLERANCE * target_epsilon:
        mid = (low + high) / 2
        if spent(mid) <= target_epsilon:
            high = mid
        else:
            low = mid
    return high
