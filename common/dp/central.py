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
5. **A target instead of a multiplier** (``central-target-epsilon``): ``sigma_c`` is the
   smallest the search finds whose ``num-rounds`` rounds at round 1's ``q`` spend at most the
   target, within 0.1% of it (:func:`calibrate_central_noise`). It depends only on public
   numbers (the target, ``delta``, ``num-rounds``, ``clients-per-round`` and ``N``), is fixed
   for the run (a resumed run keeps it) and is accounted like a given one: with fewer nodes
   later ``q`` grows and the run spends more than the target, which ``user_epsilon`` shows.

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

import numpy as np
import torch
from opacus.optimizers.optimizer import _generate_noise

from fedsparse.common.aggregation.robust import clip_to_norm
from fedsparse.common.dp.accounting import (
    AccountantName,
    calibrate_noise_multiplier,
    compute_epsilon_of_history,
)
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
    total = torch.zeros(d, dtype=torch.float64)
    for values, where in updates:
        clipped = clip_to_norm(values, bound=clip).to(torch.float64)
        if where is None:
            if support is not None:
                raise ValueError("a dense update in a round with a sparse public support")
            total += clipped
        else:
            if not bool(allowed[where].all()):
                raise ValueError("an update touches coordinates off the round's public support")
            total.index_add_(0, where, clipped)
    if secure:
        noise = _generate_noise(
            std=noise_multiplier * clip,
            reference=torch.zeros(d),
            generator=generator,
            secure_mode=True,
        )
    else:
        noise = torch.normal(0.0, noise_multiplier * clip, size=(d,), generator=generator)
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


def calibrate_central_noise(
    *,
    target_epsilon: float,
    sample_rate: float,
    rounds: int,
    delta: float,
    accountant: AccountantName = "rdp",
) -> float:
    """``sigma_c`` whose ``rounds`` DP-FedAvg rounds at users' rate ``sample_rate`` spend at most
    ``target_epsilon`` at ``delta``, and at least ``target_epsilon`` less 0.1% of it (Opacus's
    search: ``calibrate_noise_multiplier``).

    Raises:
        ValueError: an argument out of range, named with its value.
    """
    return calibrate_noise_multiplier(
        target_epsilon=target_epsilon,
        delta=delta,
        sample_rate=sample_rate,
        steps=rounds,
        accountant=accountant,
        epsilon_tolerance=CENTRAL_TARGET_TOLERANCE * target_epsilon,
    )
