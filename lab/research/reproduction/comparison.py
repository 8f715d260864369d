"""Best-vs-best comparisons of the reproduction: the result of one arm and of one study
(``ArmResult``, ``Comparison``; centralized and federated share them), the statistics they
rest on, and the verdict rules that are not the report's (``gain_verdict``, ``still_rising``,
whether a run was cut short).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedsparse.lab.experiments.stats import mean_se, paired_t_interval
from fedsparse.lab.experiments.sweep_plan import SweepPlan, point_label
from fedsparse.lab.experiments.tuning import (
    CONFIDENCE,
    ArmChoice,
    PairedDifference,
)
from fedsparse.lab.research.reproduction.plan import PAPER_MODEL, PAPER_TABLE2, RISING_TOLERANCE

__all__ = [
    "ArmResult",
    "Comparison",
    "Convergence",
    "LengthProfile",
    "gain_verdict",
    "still_rising",
]


# ---------------------------------------------------------------------------------------------
# Statistics and verdicts


#: The report's names for the shared statistics (``fedsparse.lab.experiments.stats``).
_mean_se = mean_se


def _paired(a: Mapping[int, float], b: Mapping[int, float]) -> PairedDifference:
    """``a - b`` paired by seed, with a Student-t interval at ``CONFIDENCE``."""
    n, mean, low, high = paired_t_interval(a, b, confidence=CONFIDENCE)
    return PairedDifference(arm="", baseline="", n=n, mean=mean, low=low, high=high)


def gain_verdict(diff: PairedDifference, paper_gain_points: float) -> str:
    """Table 2's claim (RS beats the tuned baseline) against ours, both best vs best.

    ``reproduced``: our interval lies above 0 (a significant gain); ``not reproduced``: it
    lies below the paper's gain (which it excludes) and does not show a gain; otherwise
    ``inconclusive`` (the interval holds both 0 and the paper's gain)."""
    if diff.n < 2 or math.isnan(diff.low):
        return "inconclusive (too few pairs)"
    if diff.low > 0:
        return "reproduced"
    if diff.high < paper_gain_points / 100:
        return "not reproduced"
    return "inconclusive"


def still_rising(curves: Sequence[Sequence[float]]) -> tuple[float, float, bool]:
    """(mean gain of the last fifth over the fifth before, its SE over runs, still rising?).

    Still rising: the mean gain exceeds ``RISING_TOLERANCE`` and 2 standard errors."""
    gains = []
    for curve in curves:
        w = max(1, len(curve) // 5)
        if len(curve) < 2 * w:
            continue
        gains.append(float(np.mean(curve[-w:]) - np.mean(curve[-2 * w : -w])))
    mean, se = mean_se(gains)
    rising = bool(gains) and mean > RISING_TOLERANCE and (math.isnan(se) or mean > 2 * se)
    return mean, se, rising


# ---------------------------------------------------------------------------------------------
# Best-vs-best comparisons (centralized and federated share the result type)


@dataclass
class ArmResult:
    """One arm (final rate) of a comparison at its own best hyperparameters, on test."""

    rate: float
    best: str  # its tuned hyperparameters
    validation: float  # their mean validation accuracy
    accuracy: dict[int, float]  # seed -> final test accuracy
    curves: list[list[float]]  # per seed: test accuracy per epoch or round
    untuned: dict[int, float] = field(default_factory=dict)  # at the baseline's best
    best_values: dict[str, str] = field(default_factory=dict)  # tune key -> value
    bits: list[float] = field(default_factory=list)  # federated: uplink bits/param per run
    label: str = ""  # how the report names the arm (default: its rate)
    grid: dict[str, tuple[str, ...]] | None = None  # what it was tuned over, if not its study's
    #: run length (epochs or rounds) -> the best mean validation accuracy at that length
    by_length: dict[str, float] = field(default_factory=dict)
    #: the standard error of a difference of two tuning candidates' mean validation accuracies
    #: (per-run variance pooled over the arm's candidates; NaN with one tuning seed)
    tuning_se: float = math.nan

    @property
    def name(self) -> str:
        return self.label or f"r* = {self.rate:g}"

    @property
    def mean_se(self) -> tuple[float, float]:
        return mean_se(self.accuracy.values())


@dataclass
class Comparison:
    """A best-vs-best comparison: the baseline (rate 0) and every r* at their own best."""

    name: str
    setting: str  # "centralized" | "federated"
    dataset: str
    model: str
    epsilon: float
    tuned_over: str
    arms: list[ArmResult]
    tune_seeds: int
    seeds: int
    grid: dict[str, tuple[str, ...]] = field(default_factory=dict)  # what was tuned
    table2: bool = True  # False: not a Table 2 comparison (another codec, say)
    length_key: str = "epochs"  # the grid key of the run length ("num-rounds" federated)

    def convergence(self, arm: ArmResult) -> Convergence:
        """Whether ``arm``'s curves still rise, and if so whether its run was cut short.

        Under a fixed ε the run length is a hyperparameter: a longer run spends the same budget
        over more steps, so each step is noisier. A curve still rising at the end of its tuned
        length was not cut short when every longer length tried scored lower on validation.
        At the longest length tried it was cut short unless the length profile has levelled
        off: when the best validation accuracy at that length beats the best at every shorter
        length by no more than 2 standard errors (``LengthProfile``). A fixed ε makes the
        learning rate and the length trade along a ridge (T steps at rate η add signal ∝ ηT
        and noise ∝ ησ√T with σ ∝ √T), so a small-η run rises to its end by construction;
        whether a longer one would help is what the profile shows. With one length only
        (not tuned), a rising curve is cut short."""
        gain, se, rising = still_rising(arm.curves)
        lengths = (arm.grid or self.grid).get(self.length_key, ())
        pick = arm.best_values.get(self.length_key)
        if pick is None and len(lengths) == 1:
            pick = lengths[0]
        longer = {
            n: v for n, v in arm.by_length.items() if pick is not None and float(n) > float(pick)
        }
        longest = pick is None or not lengths or float(pick) >= max(float(n) for n in lengths)
        profile = None
        shorter = [v for n, v in arm.by_length.items() if pick is not None and n != pick]
        if longest and pick in arm.by_length and shorter:
            profile = LengthProfile(arm.by_length[pick] - max(shorter), arm.tuning_se)
        levelled = profile is not None and profile.levelled
        return Convergence(
            gain,
            se,
            rising,
            pick,
            longer,
            cut_short=rising and longest and not levelled,
            profile=profile,
        )

    def at_edge(self, arm: ArmResult) -> list[str]:
        """The tuned keys whose pick is the grid's smallest or largest value (of several):
        the best may lie outside the grid."""
        edges = []
        for key, values in (arm.grid or self.grid).items():
            numbers = sorted(float(v) for v in values)
            pick = arm.best_values.get(key)
            if len(numbers) > 1 and pick is not None and float(pick) in (numbers[0], numbers[-1]):
                edges.append(f"{key}={pick}")
        return edges

    @property
    def baseline(self) -> ArmResult:
        return self.arms[0]

    @property
    def rs(self) -> ArmResult:
        """The RS arm of highest validation accuracy (the paper searches r* per row)."""
        return max(self.arms[1:], key=lambda a: a.validation)

    def difference(self, arm: ArmResult) -> PairedDifference:
        return _paired(arm.accuracy, self.baseline.accuracy)

    def untuned_difference(self, arm: ArmResult) -> PairedDifference:
        return _paired(arm.untuned, self.baseline.accuracy)

    @property
    def paper(self) -> tuple[str, tuple[float, float, float]]:
        name = PAPER_MODEL.get(self.model, "DP-CNN/S")
        return f"FMNIST {name}", PAPER_TABLE2[("FMNIST", name, float(self.epsilon))]


@dataclass(frozen=True)
class Convergence:
    """An arm's curves at the end of its run (``Comparison.convergence``)."""

    gain: float  # mean test accuracy of the last fifth minus the fifth before
    se: float  # its standard error over runs
    rising: bool  # ``still_rising``
    length: str | None  # the arm's run length (epochs or rounds)
    longer: dict[str, float]  # each longer length tried -> its best mean validation accuracy
    cut_short: bool  # rising at the longest length tried: a longer run might do better
    #: at the longest length tried: its gain on validation over the shorter lengths
    profile: LengthProfile | None = None


@dataclass(frozen=True)
class LengthProfile:
    """The longest length's best mean validation accuracy minus the best at any shorter
    length (each over the other tuned keys), and the standard error of that difference."""

    gain: float
    se: float

    @property
    def levelled(self) -> bool:
        """No longer significantly climbing: the gain is within 2 standard errors (never
        without an error estimate)."""
        return not math.isnan(self.se) and self.gain <= 2 * self.se


def _by_length(choice: ArmChoice, key: str) -> dict[str, float]:
    """Length value -> the best mean validation accuracy over the other tuned keys."""
    best: dict[str, float] = {}
    for label, mean, _, _ in choice.candidates:
        values = dict(part.split("=", 1) for part in label.split(", ") if "=" in part)
        if key in values and not math.isnan(mean):
            best[values[key]] = max(mean, best.get(values[key], -math.inf))
    return best


def _tuning_se(choice: ArmChoice) -> float:
    """The standard error of the difference of two candidates' means: the per-run variance
    pooled over the arm's candidates (each ``se² n``, ``n`` runs), times ``2 / n``."""
    cells = [(se, n) for _, _, se, n in choice.candidates if n >= 2 and math.isfinite(se)]
    if not cells:
        return math.nan
    variance = float(np.mean([se**2 * n for se, n in cells]))
    n = min(n for _, n in cells)
    return math.sqrt(2 * variance / n)


def _comparison_arms(
    plan: SweepPlan,
    rows: Sequence[Mapping[str, Any]],
    choices: Sequence[ArmChoice],
    curve: Callable[[Mapping[str, Any]], list[float]],
    length_key: str = "epochs",
) -> list[ArmResult]:
    arms: dict[str, ArmResult] = {}
    for choice in choices:
        rate = float(dict(choice.arm)["final-rate"])
        arms[choice.label] = ArmResult(
            rate=rate,
            best=point_label(choice.best),
            validation=choice.score,
            accuracy={},
            curves=[],
            best_values=dict(choice.best),
            by_length=_by_length(choice, length_key),
            tuning_se=_tuning_se(choice),
        )
    keys = {k for c in choices for k, _ in c.arm}
    for run, row in zip(plan.runs, rows, strict=True):
        if row["status"] != "ok":
            continue
        arm = arms[point_label(tuple((k, v) for k, v in run.point if k in keys))]
        arm.accuracy[run.seed] = float(row["final_test_accuracy"])
        if row.get("uplink_bits_per_param") not in (None, ""):
            arm.bits.append(float(row["uplink_bits_per_param"]))
        arm.curves.append(curve(row))
    return list(arms.values())
