"""The inversely proportional scaling rule between the clipping bound C and SGD momentum mu.

Rule (random-freeze paper, Sec. 3.4 and App. F, Figs. 4 and 7; RS paper, App. H, eqs. 117-118,
Fig. 10). With heavy-ball momentum ``v <- mu v + a g~`` (PyTorch: ``a = 1``; TensorFlow:
``a = -lr``), the DP noise a step adds to ``g~``, ``N(0, C^2 sigma^2 I)``, stays in the
velocity, which after ``t + 1`` steps holds (eq. 117)::

    v - v^ = (1 + mu + ... + mu^t) a N(0, C^2 sigma^2 I)  ~  C / (1 - mu) * a N(0, sigma^2 I)

(eq. 118, the series summed). Hence, with every other hyperparameter fixed (sigma, learning
rate, batch size, epochs, and the sparsification rate), settings with the same ``C / (1 - mu)``
inject the same noise and train alike, and the best settings lie on that diagonal; tuning
becomes a line search (App. H, last paragraph). Worked example, the papers' own (RF Sec. 4,
Tables 5 and 9): Tramer & Boneh's ``C = 0.1, mu = 0.9`` has ``C / (1 - mu) = 1`` and was
moved to ``C = 1, mu = 0``, which trained better.

What mu is: the SGD momentum, not the sparsification (freeze) rate. The rule does not involve
the rate: it is "general and amenable to no freeze and random freeze" (RF Sec. 3.4), and both
papers switch RS on with the rate-0 tuning unchanged, C, learning rate, sigma and mu alike
(RF Sec. 2.1 after Thm. 2: "with the same learning rate ... adapted for DP-SGD without random
freeze" the bound still vanishes; RF Sec. 4 and RS Sec. 5.2: the previous works' best
hyperparameters, then a search over the final rate). So under gradual cooling, where the rate
``r(e)`` changes every epoch, C and mu stay what they were at rate 0: a rate-0 tuning's
rate-r equivalent is itself, and this module only moves along the (C, mu) diagonal.

Limits, from the papers and from fedsparse:
  * The rule is an empirical finding with a heuristic derivation: eq. 117 treats the summed
    noise as one draw times ``1 + mu + ...``; independent draws add in variance, to a std of
    ``C sigma / sqrt(1 - mu^2)``. The functions below implement the rule as published.
  * Adam-style velocities ``v <- mu v + (1 - mu) g~`` (RS eqs. 119-123) decouple C and mu:
    no rescaling applies. Nor does the rule hold for projected DP-SGD (RS App. H).
  * The series reaches ``1 / (1 - mu)`` only after ``t >> 1 / (1 - mu)`` steps. A federated
    client builds a fresh optimizer every round (``fedsparse.common.dp.optimizer``), so its velocity
    restarts and holds only ``steps`` terms: pass ``steps`` (local steps per round) to use
    eq. 117's partial sum instead of eq. 118's limit. That is our reading of eq. 117, not a
    rule the papers tested.
"""

from __future__ import annotations

import math

__all__ = [
    "clip_momentum_ratio",
    "momentum_noise_gain",
    "rescale_max_grad_norm",
    "rescale_momentum",
]


def _check_momentum(momentum: float, field: str = "momentum") -> float:
    if not 0.0 <= momentum < 1.0:  # also rejects NaN
        raise ValueError(f"{field}={momentum}: expected 0 <= {field} < 1")
    return float(momentum)


def _check_norm(max_grad_norm: float, field: str = "max_grad_norm") -> float:
    if not (math.isfinite(max_grad_norm) and max_grad_norm > 0):
        raise ValueError(f"{field}={max_grad_norm}: expected a finite value > 0")
    return float(max_grad_norm)


def momentum_noise_gain(momentum: float, *, steps: int | None = None) -> float:
    """How much a velocity amplifies the per-step noise: ``1 / (1 - mu)`` (RS eq. 118).

    Args:
        momentum: ``mu`` in [0, 1).
        steps: ``None`` for the long-run limit; else the number of steps since the velocity
            was zero, giving eq. 117's ``1 + mu + ... + mu^(steps - 1)`` (PyTorch's SGD
            velocity after ``steps`` equal gradients).

    Returns:
        The gain, ``>= 1``; exactly 1 without momentum.
    """
    mu = _check_momentum(momentum)
    if steps is None:
        return 1.0 / (1.0 - mu)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r}: expected an integer >= 1 (or None)")
    return -math.expm1(steps * math.log(mu)) / (1.0 - mu) if mu else 1.0


def clip_momentum_ratio(
    *, max_grad_norm: float, momentum: float, steps: int | None = None
) -> float:
    """The rule's invariant, ``C / (1 - mu)`` (``C`` times :func:`momentum_noise_gain`):
    the noise scale the velocity carries, in units of ``sigma``."""
    return _check_norm(max_grad_norm) * momentum_noise_gain(momentum, steps=steps)


def rescale_max_grad_norm(
    *, max_grad_norm: float, momentum: float, new_momentum: float, steps: int | None = None
) -> float:
    """The clipping bound that keeps ``C / (1 - mu)`` when the momentum changes.

    ``C' = C (1 - mu') / (1 - mu)`` (RF Sec. 3.4; RS App. H); e.g. ``C = 0.1, mu = 0.9`` to
    ``mu' = 0`` gives ``C' = 1``. Decreasing in ``new_momentum``.

    Args:
        max_grad_norm: The tuned ``C``.
        momentum: The tuned ``mu``.
        new_momentum: ``mu'`` in [0, 1).
        steps: As in :func:`momentum_noise_gain` (``None``: the papers' rule).
    """
    ratio = clip_momentum_ratio(max_grad_norm=max_grad_norm, momentum=momentum, steps=steps)
    _check_momentum(new_momentum, "new_momentum")
    return ratio / momentum_noise_gain(new_momentum, steps=steps)


def rescale_momentum(*, max_grad_norm: float, momentum: float, new_max_grad_norm: float) -> float:
    """The momentum that keeps ``C / (1 - mu)`` when the clipping bound changes.

    ``mu' = 1 - (1 - mu) C' / C`` (RF Sec. 3.4; RS App. H). Decreasing in
    ``new_max_grad_norm``; a bound above ``C / (1 - mu)`` would need negative momentum.

    Raises:
        ValueError: A value out of range, or ``new_max_grad_norm > C / (1 - mu)``.
    """
    ratio = clip_momentum_ratio(max_grad_norm=max_grad_norm, momentum=momentum)
    new_norm = _check_norm(new_max_grad_norm, "new_max_grad_norm")
    if new_norm > ratio * (1 + 1e-12):
        raise ValueError(
            f"new_max_grad_norm={new_max_grad_norm}: expected <= C / (1 - mu) = {ratio:g} "
            "(a larger bound would need negative momentum)"
        )
    return max(0.0, 1.0 - new_norm / ratio)
