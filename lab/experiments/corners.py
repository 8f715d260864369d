"""Tuning past grid corners: where a tuned pick sits at an end of a numeric axis, the next value
beyond it.

A pick at the lowest or highest value of its tuning grid says only that the optimum may lie
beyond the grid; a comparison against such a pick is not best against best. ``run_tuned_sweep``
(``extend=N``) therefore extends, arm by arm, every numeric axis whose pick sits at an end by
one geometric step (``beyond``: the highest value x2, the lowest /2; an integer axis stays
integer and >= 1), runs the new combinations with every value of the other axes on the same
tuning seeds, and picks again, until every pick is interior or the axis has been extended
``N`` times (its *cap*). A pick still at an end of an axis extended ``N`` times is *at the cap*
(``ArmChoice.capped``), and its comparisons state that instead of a verdict. An axis that
cannot go further (its next value is one the run config refuses, such as ``momentum=1.8``, or
an integer axis at 1) ends at its *bound*: a pick there is reported (``ArmChoice.edges``) but
keeps its verdict. An axis whose values are not all numbers (a method name) has no order, and
no end. Whether an axis is one of integers is its run-config key's type (``lr=1,2,4`` is a
float axis), else whether every value is written as an integer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from fedsparse.common.config import run_config_fields
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


def _integers(key: str, values: Sequence[str]) -> bool:
    kinds = {f.name.replace("_", "-"): type(f.default) for f in run_config_fields()}
    if key in kinds:
        return kinds[key] is int
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


def beyond(values: Sequence[str], side: Side, key: str = "") -> str | None:
    """The next value past ``side`` of the numeric axis ``key``: the highest x ``STEP`` or the
    lowest / ``STEP``; an integer axis stays integer and >= 1. None: no such value (not
    numeric, an integer axis already at 1, 0 to scale, or a value <= 0 whose step would not
    move outwards)."""
    numbers = _numbers(values)
    if numbers is None or not numbers:
        return None
    end = max(numbers) if side == "highest" else min(numbers)
    if end <= 0:  # x2 of a negative end moves inwards, /2 of 0 stays
        return None
    if _integers(key, values):
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
    bound: dict[tuple[tuple[str, str], ...], set[tuple[str, Side]]] = {
        c.arm: set() for c in choices
    }
    runs, rows = list(tuning.runs), list(rows)
    while True:
        extra: list[SweepRun] = []
        for choice in choices:
            mine = axes[choice.arm]
            for key, _, side in corners(choice.best, mine):
                if used[choice.arm][key] >= extend or (key, side) in bound[choice.arm]:
                    continue
                new = beyond(mine[key], side, key)
                if new is None or new in mine[key]:  # an integer axis at 1, say: a bound
                    bound[choice.arm].add((key, side))
                    continue
                # the new value with every value of the other axes, on the same tuning seeds
                along = {k: [new] if k == key else v for k, v in mine.items()}
                try:
                    plan = line(choice.arm, along)
                except ValueError:  # the run config refuses it (momentum=1.8): a bound
                    bound[choice.arm].add((key, side))
                    continue
                used[choice.arm][key] += 1
                extra += plan.runs
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
    marked = []
    for c in choices:
        ends = corners(c.best, axes[c.arm])
        capped = [e for e in ends if (e[0], e[2]) not in bound[c.arm]]
        marked.append(dataclasses.replace(c, capped=corner_label(capped), edges=corner_label(ends)))
    return tuning, rows, marked
