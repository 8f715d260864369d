"""``rs`` and ``random-freeze``: a uniformly random public mask of the schedule's ``keep``.

- ``rs``: random sparsification ("Improving Differentially Private SGD via Randomly
  Sparsified Gradients", arXiv:2112.00845, Algorithm 1): a uniformly random mask of ``keep``
  coordinates per round (federated) or epoch (centralized), ``r(e)`` from the run's
  ``schedule`` (gradual cooling by default). The mask comes from the round's public seed:
  every party regenerates it and the wire carries no index.
- ``random-freeze``: random freeze (the same paper's earlier version, Algorithm 1): the same
  random mask, with the freeze rate ramped linearly to ``r*`` at the cooling time ``e*`` and
  constant after, ``r(e) = r* min(e / e*, 1)`` (schedule ``cooling``, ``e*`` =
  ``cooling-rounds`` or ``--cooling-steps``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from fedsparse.common.methods.base import Method

if TYPE_CHECKING:
    from fedsparse.common.methods.schedules import ScheduleName

__all__ = ["RandomFreeze", "RandomSparsification"]


class RandomSparsification(Method):
    """``rs``: the base class's behaviour, under its name."""

    name: ClassVar[str] = "rs"


class RandomFreeze(Method):
    """``random-freeze``: RS on the cooling schedule."""

    name: ClassVar[str] = "random-freeze"

    @classmethod
    def resolve_schedule(cls, schedule: ScheduleName, field: str = "schedule") -> ScheduleName:
        """``cooling`` (random freeze *is* the cooling schedule).

        Raises:
            ValueError: a schedule other than the default ``gradual`` or ``cooling``.
        """
        if schedule not in ("gradual", "cooling"):
            raise ValueError(
                f"{field}={schedule!r}: method='random-freeze' ramps the rate to r* at the "
                "cooling time e* (schedule 'cooling'); leave the schedule unset or set 'cooling'"
            )
        return "cooling"
