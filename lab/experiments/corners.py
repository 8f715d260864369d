"""Tuning past grid corners: where a tuned pick sits at an end of a numeric axis, the next value
beyond it.

A pick at the lowest or highest value of its tuning grid says only that the optimum may lie
beyond the grid; a comparison against such a pick is not best against best. ``run_tuned_sweep``
(``extend=N``) therefore extends, arm by arm, every numeric axis whose pick sits at an end by
one geometric step (``beyond``: the highest value x2, the lowest /2; an integer axis stays
integer and >= 1), runs the new combinations with every value of the other axes on the same
tuning seeds, and picks again, until every pick is interior or the axis has been extended
``N`` times (its *cap*). A pick still at an end then is *at the cap* (``corner_label``), and
its comparisons state that instead of a verdict. An axis whose values are not all numbers
(a method name) has no order, and no end.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from fedsparse.lab.experiments.sweep_plan import SweepPlan, SweepRun

if TYPE_CHECKING:
    from fedsparse.lab.experiments.tuning import ArmChoice

__all__ = ["STEP", "Corner", "beyond", "corner_label", "corners", "past_corners"]

#: The geometric step of an extension: x2 past the highest value, /2 past the lowest.
STEP = 2
Side = Literal["lowest", "highest"]
#: ``(key, value, side)``: a pick at an end of its axis.
Corner = tuple[str, str, Side]


def _numbers(values: Sequence[str]) -> list[float] | None:
    try:
        numbers = [float(v) for v in values]
    except ValueError:
        return None
    return numbers if all(math.isfinite(x) for x in numbers) else None


def _integers(values: Sequence[str]) -> bool:
    try:
        return all(str(int(v)) == v.strip() for v in values)
    except ValueError:
        return False


def corners(best: Sequence[tuple[str, str]], grid: Mapping[str, Sequence[str]]) -> list[Corner]:
    """The picked values at the lowest or highest end of their numeric axis of 2 or more
    values (``grid``: each tuned key's values so far)."""
    found: list[Corner] = []
    for key, value in best:
        values = list(grid.get(key, ()))
        numbers = _numbers(values)
        if numbers is None or len(set(numbers)) < 2 or value not in values:
            continue
        x = numbers[values.index(value)]
        if x == min(numbers):
            found.append((key, value, "lowest"))
        elif x == max(numbers):
            found.append((key, value, "highest"))
    return found


def beyond(values: Sequence[str], side: Side) -> str | None:
    """The next value past ``side`` of a numeric axis: the highest x ``STEP`` or the lowest /
    ``STEP``; an integer axis (every value an integer) stays integer and >= 1. None: no such
    value (not numeric, or an integer axis already at 1, or 0 to scale)."""
    numbers = _numbers(values)
    if numbers is None or not numbers:
        return None
    end = max(numbers) if side == "highest" else min(numbers)
    if _integers(values):
        step = int(end) * STEP if side == "highest" else int(end) // STEP
        return str(step) if step >= 1 and step != int(end) else None
    nxt = end * STEP if side == "highest" else end / STEP
    if nxt == end or not math.isfinite(nxt):  # 0, or beyond the floats
        return None
    return f"{nxt:.6g}"


def corner_label(found: Sequence[Corner]) -> str:
    """``lr=0.0125 (lowest), num-rounds=320 (highest)``; empty when none."""
    return ", ".join(f"{key}={value} ({side})" for key, value, side in found)


def past_corners(
    tuning: SweepPlan,
    rows: list[dict[str, Any]],
    choices: list[ArmChoice],
    *,
    tune: Mapping[str, Sequence[str]],
    extend: int,
    run: Callable[[SweepPlan], list[dict[str, Any]]],
    line: Callable[[tuple[tuple[str, str], ...], dict[str, list[str]]], SweepPlan],
    choose: Callable[[SweepPlan, list[dict[str, Any]]], list[ArmChoice]],
) -> tuple[SweepPlan, list[dict[str, Any]], list[ArmChoice]]:
    """The tuning phase extended past its corners, each arm on its own: the tuning plan and
    rows with the new runs, and the picks, those still at an end marked ``capped``.

    Args:
        tuning, rows, choices: the tuning phase so far (its plan, rows, picks).
        tune: the tuned axes as given.
        extend: how many times an arm's axis may be extended.
        run: runs a plan's runs, returning their rows (``run_sweep``).
        line: the tuning plan of an arm over the given axes (``plan_tuning``).
        choose: the picks of a tuning plan and its rows (``choose_best``).
    """
    axes = {c.arm: {k: list(v) for k, v in tune.items()} for c in choices}
    used = {c.arm: dict.fromkeys(tune, 0) for c in choices}
    runs, rows = list(tuning.runs), list(rows)
    while True:
        extra: list[SweepRun] = []
        for choice in choices:
            mine = axes[choice.arm]
            for key, _, side in corners(choice.best, mine):
                new = beyond(mine[key], side)
                if used[choice.arm][key] >= extend or new is None or new in mine[key]:
                    continue
                used[choice.arm][key] += 1
                # the new value with every value of the other axes, on the same tuning seeds
                extra += line(
                    choice.arm, {k: [new] if k == key else v for k, v in mine.items()}
                ).runs
                mine[key] = [*mine[key], new]
        if not extra:
            break
        merged = {k: list(v) for k, v in tuning.grid.items()}
        for mine in axes.values():
            for k, values in mine.items():
                merged[k] += [v for v in values if v not in merged[k]]
        rows += run(dataclasses.replace(tuning, grid=merged, runs=tuple(extra)))
        runs += extra
        tuning = dataclasses.replace(tuning, grid=merged, runs=tuple(runs))
        choices = choose(tuning, rows)
    return (
        tuning,
        rows,
        [
            dataclasses.replace(c, capped=corner_label(corners(c.best, axes[c.arm])))
            for c in choices
        ],
    )
