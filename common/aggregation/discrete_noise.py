"""Secure aggregation's noise shares and rounding (``secure.py`` re-exports them).

Distributed DP, "The Distributed Discrete Gaussian Mechanism for Federated
Learning with Secure Aggregation", arXiv:2102.06387): each client adds discrete Gaussian
noise ``N_Z(0, (s sigma C)^2 / t)`` in ring units (``sigma C / sqrt(t)`` in value units),
sampled by Canonne-Kamath-Steinke's rejection from the discrete Laplace, in floating point.
Any ``m >= t`` survivors' shares sum to variance ``m/t (s sigma C)^2 >= (s sigma C)^2``. The
noise is integer, so it adds no rounding of its own; the rounding of ``x`` enters through the
sensitivity ``sC + sqrt(k)``. The sum of discrete Gaussians is not exactly one: Kairouz et al.'s
bound adds ``tau`` per coordinate, ``k tau`` in all, with
``tau = 10 sum_{j=1}^{m-1} exp(-2 pi^2 v j/(j+1))`` (:func:`sum_divergence_tau`); the
accounting leaves it out, so ``secure.check_ring`` refuses a noisy ring where ``k tau`` exceeds
``secure.TAU_LIMIT`` (shares of a few ring units and more make it underflow to 0).
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = [
    "discrete_gaussian",
    "discrete_gaussian_variance",
    "stochastic_round",
    "sum_divergence_tau",
]


def sum_divergence_tau(share_std: float, survivors: int) -> float:
    """Kairouz et al.'s ``tau`` for a sum of ``survivors`` discrete Gaussians of parameter
    ``share_std`` (ring units): the sum's distance from one discrete Gaussian."""
    v = share_std**2
    return 10 * sum(math.exp(-2 * math.pi**2 * v * j / (j + 1)) for j in range(1, survivors))


def stochastic_round(values: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Unbiased rounding to ``int64``: ``floor(v) + 1`` with probability ``v - floor(v)``."""
    v = values.to(torch.float64)
    low = torch.floor(v)
    up = torch.rand(v.shape, generator=generator, dtype=torch.float64) < (v - low)
    return low.to(torch.int64) + up.to(torch.int64)


def _discrete_laplace(count: int, scale: int, generator: torch.Generator) -> torch.Tensor:
    """``P(y) ~ exp(-|y|/scale)``: the difference of two geometrics ``floor(scale * Exp(1))``."""
    e = torch.empty(2, count, dtype=torch.float64).exponential_(generator=generator)
    g = torch.floor(e * scale).to(torch.int64)
    return g[0] - g[1]


def discrete_gaussian(count: int, sigma: float, generator: torch.Generator) -> torch.Tensor:
    """``count`` draws of ``N_Z(0, sigma^2)``: ``P(y) ~ exp(-y^2 / (2 sigma^2))`` on the integers.

    Canonne, Kamath and Steinke's algorithm with ``t = floor(sigma) + 1``: draw ``Y`` from the
    discrete Laplace of scale ``t``, keep it with probability
    ``exp(-(|Y| - sigma^2/t)^2 / (2 sigma^2))``. Floating point, not their exact arithmetic.
    """
    if sigma < 0 or not math.isfinite(sigma):
        raise ValueError(f"sigma must be >= 0 and finite, got {sigma}")
    out = torch.zeros(count, dtype=torch.int64)
    if sigma == 0 or count == 0:
        return out
    t = math.floor(sigma) + 1
    pending = torch.arange(count)
    while pending.numel():
        y = _discrete_laplace(pending.numel(), t, generator)
        keep = torch.exp(-((y.abs().to(torch.float64) - sigma**2 / t) ** 2) / (2 * sigma**2))
        ok = torch.rand(pending.numel(), generator=generator, dtype=torch.float64) < keep
        out[pending[ok]] = y[ok]
        pending = pending[~ok]
    return out


def discrete_gaussian_variance(sigma: float) -> float:
    """The variance of ``N_Z(0, sigma^2)`` (a little below ``sigma^2`` for small ``sigma``)."""
    if sigma == 0:
        return 0.0
    y = np.arange(-math.ceil(40 * sigma + 10), math.ceil(40 * sigma + 10) + 1, dtype=np.float64)
    w = np.exp(-(y**2) / (2 * sigma**2))
    return float((w * y**2).sum() / w.sum())
