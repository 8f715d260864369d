"""Accuracy against time: how long a run takes to reach a test accuracy.

A ``RoundLog``'s ``wall_seconds`` is per round, not cumulative: ``server/loop.py`` measures it
with ``time.perf_counter()`` from the round's ``configure_train`` (sampling, downlink) to the
end of its server-side evaluation, so it covers the downlink, local training, the uplink,
aggregation and evaluation. It leaves out what the ServerApp does between rounds (writing the
round's line and checkpoint, logging) and before the first round (model, data set, waiting for
nodes). ``RunSummary.wall_seconds`` is the sum over rounds.

Two clocks, both starting when the first round starts:

* ``"rounds"`` (default): the running sum of ``wall_seconds``, the time spent in rounds, the
  same total as ``RunSummary.wall_seconds``;
* ``"wall"``: unix time, ``ended_at`` of a round minus ``started_at`` of the first, which adds
  the gaps between rounds.

A round's time is taken at its end, since its accuracy is measured after it. Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from fedsparse.common.wire.run_log import RoundLog

__all__ = ["CLOCKS", "Clock", "accuracy_vs_time", "elapsed_seconds", "time_to_accuracy"]

Clock = Literal["rounds", "wall"]
CLOCKS: tuple[Clock, ...] = ("rounds", "wall")


def elapsed_seconds(rounds: Sequence[RoundLog], *, clock: Clock = "rounds") -> list[float]:
    """Seconds from the start of the first round to the end of each round, in order.

    Raises:
        ValueError: round numbers not strictly increasing, or an unknown ``clock``.
    """
    if clock not in CLOCKS:
        raise ValueError(f"clock={clock!r}: expected one of {', '.join(CLOCKS)}")
    for before, after in zip(rounds, rounds[1:], strict=False):
        if after.round <= before.round:
            raise ValueError(
                f"rounds: round {after.round} after round {before.round}, expected increasing"
            )
    if not rounds:
        return []
    if clock == "wall":
        start = rounds[0].started_at
        return [entry.ended_at - start for entry in rounds]
    total, elapsed = 0.0, []
    for entry in rounds:
        total += entry.wall_seconds
        elapsed.append(total)
    return elapsed


def accuracy_vs_time(
    rounds: Sequence[RoundLog], *, clock: Clock = "rounds"
) -> list[tuple[float, float]]:
    """``(elapsed_seconds, test_accuracy)`` at the end of each round, in order."""
    return list(
        zip(elapsed_seconds(rounds, clock=clock), (r.test_accuracy for r in rounds), strict=True)
    )


def time_to_accuracy(
    rounds: Sequence[RoundLog], target: float, *, clock: Clock = "rounds"
) -> float | None:
    """Seconds until the end of the first round whose ``test_accuracy >= target``.

    None if no round reaches ``target`` (a NaN accuracy reaches nothing), or ``rounds`` is
    empty. A failed round (model unchanged) still counts with its time and accuracy.

    Raises:
        ValueError: ``target`` outside ``[0, 1]``, or as ``elapsed_seconds``.
    """
    if not (0.0 <= target <= 1.0):  # NaN fails too
        raise ValueError(f"target={target}: expected 0 <= target <= 1")
    for seconds, accuracy in accuracy_vs_time(rounds, clock=clock):
        if accuracy >= target:  # False for NaN
            return seconds
    return None
