"""Time to accuracy: cumulative per-round seconds (or unix time), first round at the target."""

from __future__ import annotations

import math

import pytest

from fedsparse.common.wire.run_log import RoundLog
from fedsparse.lab.experiments.timing import accuracy_vs_time, elapsed_seconds, time_to_accuracy

T0 = 1_700_000_000.0


def round_log(number: int, *, accuracy: float, seconds: float, start: float) -> RoundLog:
    return RoundLog(
        round=number,
        num_clients=2,
        num_replies=2,
        num_rejected=0,
        rate=0.9,
        keep=10,
        keep_fraction=0.1,
        test_accuracy=accuracy,
        test_loss=1.0,
        epsilon_max=1.0,
        epsilon_median=1.0,
        train_loss=1.0,
        uplink_payload_bytes=0,
        uplink_message_bytes=0,
        downlink_payload_bytes=0,
        downlink_message_bytes=0,
        dense_uplink_bytes=0,
        dense_downlink_bytes=0,
        wall_seconds=seconds,
        started_at=start,
        ended_at=start + seconds,
        rejected=[],
    )


def run(accuracies: list[float], seconds: list[float], gap: float = 0.5) -> list[RoundLog]:
    """Rounds back to back, ``gap`` seconds of bookkeeping between them."""
    logs, start = [], T0
    for number, (accuracy, length) in enumerate(zip(accuracies, seconds, strict=True), 1):
        logs.append(round_log(number, accuracy=accuracy, seconds=length, start=start))
        start += length + gap
    return logs


RUN = run([0.3, 0.6, 0.55, 0.8], [2.0, 3.0, 1.0, 4.0])


def test_rounds_clock_is_the_running_sum_of_per_round_seconds() -> None:
    assert elapsed_seconds(RUN) == [2.0, 5.0, 6.0, 10.0]
    assert accuracy_vs_time(RUN) == [(2.0, 0.3), (5.0, 0.6), (6.0, 0.55), (10.0, 0.8)]


def test_wall_clock_adds_the_gaps_between_rounds() -> None:
    assert elapsed_seconds(RUN, clock="wall") == pytest.approx([2.0, 5.5, 7.0, 11.5])


def test_time_to_accuracy_is_the_end_of_the_first_round_at_or_above_target() -> None:
    assert time_to_accuracy(RUN, 0.6) == 5.0  # reached exactly, at round 2
    assert time_to_accuracy(RUN, 0.55) == 5.0  # not round 3: round 2 got there first
    assert time_to_accuracy(RUN, 0.61) == 10.0
    assert time_to_accuracy(RUN, 0.0) == 2.0
    assert time_to_accuracy(RUN, 0.61, clock="wall") == pytest.approx(11.5)
    assert time_to_accuracy(RUN, 0.81) is None
    assert time_to_accuracy([], 0.5) is None


def test_nan_accuracy_reaches_nothing() -> None:
    logs = run([math.nan, 0.7], [1.0, 1.0])
    assert time_to_accuracy(logs, 0.0) == 2.0


def test_bad_target_clock_and_order_are_refused() -> None:
    for target in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match=r"target=.*expected 0 <= target <= 1"):
            time_to_accuracy(RUN, target)
    with pytest.raises(ValueError, match=r"clock='cpu'"):
        elapsed_seconds(RUN, clock="cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"round 2 after round 3"):
        time_to_accuracy([RUN[0], RUN[2], RUN[1]], 0.5)
