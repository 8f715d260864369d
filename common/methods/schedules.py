"""Sparsification-rate schedules over epochs (centralized) or rounds (federated).

A schedule maps step ``e`` in ``0..E-1`` (an epoch in Algorithm 1 of the RS paper, a
communication round in the federated loop) to a sparsification rate ``r(e)`` in ``[0, 1)``;
the number of kept coordinates is ``keep = d - floor(r * d)`` (``masks.keep_count``).

- ``gradual``: gradual cooling, ``r(e) = r* * e / (E - 1)`` (RS paper, Alg. 1 line 3). With
  ``E = 1`` the single epoch uses ``r*`` (the last epoch always reaches ``r*``).
- ``cooling``: cooling time ``e*``, ``r(e) = r* * min(e / e*, 1)`` (random-freeze paper).
- ``constant``: ``r(e) = r*``.
- ``linear-keep`` / ``exp-keep``: the GIP paper's decays of the keep ratio ``k`` from ``k0`` to
  ``k_final`` over ``E`` steps, linear ``k(e) = k0 + (k_final - k0) * e/(E-1)`` or
  exponential ``k(e) = k0 * (k_final/k0) ** (e/(E-1))``; ``r(e) = 1 - k(e)``.
- ``steps``: an explicit list, ``r(e) = steps[min(e, len(steps) - 1)]`` (sweeps and
  benchmarks that visit given rates round by round).

Schedules are data-independent: they are public and do not affect privacy accounting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedsparse.common.names import SCHEDULES, ScheduleName

__all__ = ["SCHEDULES", "RateSchedule", "ScheduleName"]


@dataclass(frozen=True, kw_only=True)
class RateSchedule:
    """A sparsification-rate schedule.

    Attributes:
        kind: one of ``SCHEDULES``.
        final_rate: ``r*`` for ``gradual``/``cooling``/``constant``, in ``[0, 1)``.
        total_steps: ``E``, the number of epochs or rounds, ``>= 1``.
        cooling_steps: ``e*`` for ``cooling``, ``>= 1``.
        initial_keep: ``k0`` for the keep-ratio decays, in ``(0, 1]``.
        final_keep: ``k_final`` for the keep-ratio decays, in ``(0, 1]``.
        steps: the rates for ``steps`` (the last one repeats), each in ``[0, 1)``.
    """

    kind: ScheduleName = "gradual"
    final_rate: float = 0.0
    total_steps: int = 1
    cooling_steps: int = 1
    initial_keep: float = 1.0
    final_keep: float = 1.0
    steps: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"kind={self.kind!r}: expected one of {', '.join(SCHEDULES)}")
        if not 0.0 <= self.final_rate < 1.0:
            raise ValueError(f"final_rate={self.final_rate}: expected 0 <= r < 1")
        if self.total_steps < 1:
            raise ValueError(f"total_steps={self.total_steps}: expected >= 1")
        if self.cooling_steps < 1:
            raise ValueError(f"cooling_steps={self.cooling_steps}: expected >= 1")
        for field in ("initial_keep", "final_keep"):
            value = getattr(self, field)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{field}={value}: expected 0 < k <= 1")
        if self.kind == "steps" and not self.steps:
            raise ValueError("steps=(): the 'steps' schedule needs at least one rate")
        for rate in self.steps:
            if not 0.0 <= rate < 1.0:
                raise ValueError(f"steps={self.steps}: each rate must satisfy 0 <= r < 1")

    def rate(self, step: int) -> float:
        """Sparsification rate ``r(step)`` for ``step`` in ``[0, total_steps)``.

        Raises:
            ValueError: if ``step`` is out of range.
        """
        if not 0 <= step < self.total_steps:
            raise ValueError(f"step={step}: expected 0 <= step < total_steps={self.total_steps}")
        progress = 1.0 if self.total_steps == 1 else step / (self.total_steps - 1)
        if self.kind == "gradual":
            return self.final_rate * progress
        if self.kind == "cooling":
            return self.final_rate * min(step / self.cooling_steps, 1.0)
        if self.kind == "constant":
            return self.final_rate
        if self.kind == "steps":
            return self.steps[min(step, len(self.steps) - 1)]
        k0, k1 = self.initial_keep, self.final_keep
        if self.kind == "linear-keep":
            keep = k0 + (k1 - k0) * progress
        else:
            keep = k0 * math.exp(math.log(k1 / k0) * progress)
        return min(max(1.0 - keep, 0.0), 1.0)

    def rates(self) -> list[float]:
        """All rates ``[r(0), ..., r(E-1)]``."""
        return [self.rate(e) for e in range(self.total_steps)]

    def mean_density(self) -> float:
        """Average kept fraction over the schedule (the random-freeze paper's total density)."""
        return sum(1.0 - r for r in self.rates()) / self.total_steps
