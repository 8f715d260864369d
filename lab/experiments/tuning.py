"""``fedsparse sweep --tune``: each arm at its own best hyperparameters, compared best vs best.

An *arm* is a grid point (``--grid method=rs,gip`` or ``--grid final-rate=0,0.9``); ``--tune
lr=0.1,0.5,1 --tune local-epochs=1,2`` are the hyperparameters each arm is tuned over. Two
phases, both ordinary sweep runs (resumable, reused when finished):

1. **Tuning**, on a validation split: every (arm, tune combination) runs ``tune_seeds`` seeds
   with ``eval-split=validation`` (a stratified 20% of the training split held out; the test
   split is never read) and seeds ``base + TUNE_SEED_OFFSET + i``, disjoint from the final
   seeds. Each arm keeps the combination with the highest mean final validation accuracy
   (ties: the first in grid order).
2. **Final**, on the test split: each arm at its own best combination over ``seeds`` seeds
   ``base .. base + seeds - 1``, the same seeds for every arm, so the comparison is paired.

With ``extend=N`` the tuning phase goes on past grid corners (``corners.py``): an arm whose pick
sits at an end of a numeric axis gets that axis extended (x2 / /2) and is picked again, until its
picks are interior or the axis was extended ``N`` times; a pick still at an end is *at the cap*
(``ArmChoice.capped``), and a comparison with such an arm gets no verdict.

``paired_differences`` compares every arm with the first (the baseline): per seed, the
difference of final test accuracies; its mean, a Student-t 95% confidence interval over the
paired seeds (``fedsparse.lab.experiments.stats.paired_t_interval``), and whether the interval
excludes
0. A difference whose interval holds 0 is reported as not significant, in words.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from fedsparse.lab.experiments.corners import past_corners
from fedsparse.lab.experiments.report import write_csv
from fedsparse.lab.experiments.stats import CONFIDENCE, mean_se, paired_t_interval
from fedsparse.lab.experiments.sweep import SweepInterrupted, run_sweep
from fedsparse.lab.experiments.sweep_backends import RunSettings
from fedsparse.lab.experiments.sweep_plan import (
    RESERVED,
    SweepPlan,
    SweepRun,
    plan_sweep,
    point_label,
)

if TYPE_CHECKING:
    from rich.console import Console

__all__ = [
    "CONFIDENCE",
    "TUNE_SEED_OFFSET",
    "ArmChoice",
    "PairedDifference",
    "TunedSweep",
    "check_final_seeds",
    "check_tuned_sweep",
    "choose_best",
    "paired_differences",
    "plan_final",
    "plan_tuning",
    "render_tuning",
    "run_tuned_sweep",
    "write_tuning_csv",
]

#: Tuning seeds start here above the base seed: never the seeds the final comparison uses.
TUNE_SEED_OFFSET: Final = 1000
#: What tuning maximizes (under ``eval-split=validation`` the run's accuracy is on validation).
METRIC: Final = "final_test_accuracy"


@dataclass(frozen=True)
class ArmChoice:
    """One arm's tuning outcome: its best combination and every candidate's mean score."""

    arm: tuple[tuple[str, str], ...]
    best: tuple[tuple[str, str], ...]  # (tune key, value)
    score: float  # mean validation accuracy of ``best``
    candidates: tuple[tuple[str, float, float, int], ...]  # (label, mean, se, n ok)
    #: the picks at an end of an axis extended to its cap (``extend`` > 0 only):
    #: ``lr=0.0125 (lowest)``; empty: none (its comparisons get a verdict)
    capped: str = ""
    #: every pick at an end after the extensions, at the cap or at a bound the run config
    #: sets (``momentum=0.9 (highest)``: 1.8 is refused), ``extend`` > 0 only
    edges: str = ""

    @property
    def label(self) -> str:
        return point_label(self.arm)


@dataclass(frozen=True)
class PairedDifference:
    """Arm minus baseline, final test accuracy, paired by seed."""

    arm: str
    baseline: str
    n: int
    mean: float
    low: float
    high: float

    @property
    def significant(self) -> bool:
        """Whether the interval excludes 0 (``False`` for fewer than 2 pairs)."""
        return self.n >= 2 and (self.low > 0 or self.high < 0)


def _check_tune_keys(
    grid: Mapping[str, Sequence[str]], tune: Mapping[str, Sequence[str]], fixed: Mapping[str, str]
) -> None:
    if not tune:
        raise ValueError("--tune: expected at least one key=v1,v2,... to tune over")
    for key in tune:
        if key in grid or key in fixed:
            where = "--grid" if key in grid else "--set"
            raise ValueError(f"--tune {key}: also given in {where}; a key is an arm or tuned")
        if key in RESERVED or key in ("eval-split", "split-seed"):
            raise ValueError(f"--tune {key}: not tunable (the sweep sets it)")
    for key in ("eval-split", "split-seed"):
        if key in fixed:
            raise ValueError(f"--set {key}: the tuned sweep sets it")


def plan_tuning(
    grid: Mapping[str, Sequence[str]],
    tune: Mapping[str, Sequence[str]],
    fixed: Mapping[str, str],
    *,
    tune_seeds: int,
    clients: int | None = None,
    scale_clip: bool = False,
) -> SweepPlan:
    """Phase 1: every arm x tune combination x tuning seed, on the validation split.

    Raises:
        ValueError: a tune key that is also an arm key or fixed, or anything ``plan_sweep``
            refuses.
    """
    _check_tune_keys(grid, tune, fixed)
    base = int(fixed.get("seed", "0"))
    # One train/test split (digits') for every run of both phases: no tuning seed may train
    # or validate on a final seed's test examples.
    tuning_fixed = {
        **fixed,
        "eval-split": "validation",
        "split-seed": str(base),
        "seed": str(base + TUNE_SEED_OFFSET),
    }
    return plan_sweep(
        {**grid, **tune}, tuning_fixed, seeds=tune_seeds, clients=clients, scale_clip=scale_clip
    )


def choose_best(
    plan: SweepPlan, rows: Sequence[Mapping[str, Any]], arm_keys: Sequence[str]
) -> list[ArmChoice]:
    """Each arm's combination of highest mean validation accuracy (plan order).

    Only combinations that finished on every tuning seed compete: one scored on the seeds it
    survived would beat steadier ones by its failures (a diverging learning rate).

    Raises:
        ValueError: an arm none of whose combinations finished on every seed.
    """
    by_arm: dict[tuple[tuple[str, str], ...], dict[tuple[tuple[str, str], ...], list[float]]] = {}
    for run, row in zip(plan.runs, rows, strict=True):
        arm = tuple((k, v) for k, v in run.point if k in arm_keys)
        combo = tuple((k, v) for k, v in run.point if k not in arm_keys)
        scores = by_arm.setdefault(arm, {}).setdefault(combo, [])
        ok = row["status"] == "ok" and row.get(METRIC) is not None
        scores.append(float(row[METRIC]) if ok else math.nan)
    choices = []
    for arm, combos in by_arm.items():
        candidates = []
        for combo, scores in combos.items():
            done = [s for s in scores if not math.isnan(s)]
            mean, se = mean_se(done)
            if len(done) < len(scores):  # only combinations finished on every seed compete
                mean = math.nan
            candidates.append((combo, mean, se, len(done)))
        finished = [c for c in candidates if not math.isnan(c[1])]
        if not finished:
            raise ValueError(
                f"arm {point_label(arm)}: no tuning combination finished on every seed"
            )
        best = max(finished, key=lambda c: c[1])  # first maximum: grid order breaks ties
        choices.append(
            ArmChoice(
                arm=arm,
                best=best[0],
                score=best[1],
                candidates=tuple((point_label(c[0]), c[1], c[2], c[3]) for c in candidates),
            )
        )
    return choices


def check_final_seeds(seeds: int) -> None:
    """Refuses more final seeds than ``TUNE_SEED_OFFSET``: a final seed would then repeat a
    tuning seed (its noise and sampling draws), coupling the test runs to the tuning.

    Raises:
        ValueError: ``seeds`` > ``TUNE_SEED_OFFSET``, naming ``--seeds``.
    """
    if seeds > TUNE_SEED_OFFSET:
        raise ValueError(
            f"--seeds {seeds}: at most {TUNE_SEED_OFFSET} with --tune (tuning seeds start at "
            f"base + {TUNE_SEED_OFFSET} and must not repeat a final seed)"
        )


def plan_final(
    choices: Sequence[ArmChoice],
    fixed: Mapping[str, str],
    *,
    seeds: int,
    clients: int | None = None,
    scale_clip: bool = False,
) -> SweepPlan:
    """Phase 2: each arm at its best combination, the same ``seeds`` for all, on the test split."""
    if not choices:
        raise ValueError("plan_final: no arm to run")
    check_final_seeds(seeds)
    base = int(fixed.get("seed", "0"))
    final_fixed = {**fixed, "eval-split": "test", "split-seed": str(base)}
    runs: list[SweepRun] = []
    grid: dict[str, list[str]] = {}
    for choice in choices:
        point = {k: [v] for k, v in (*choice.arm, *choice.best)}
        plan = plan_sweep(point, final_fixed, seeds=seeds, clients=clients, scale_clip=scale_clip)
        runs.extend(plan.runs)
        for key, (value,) in point.items():
            grid.setdefault(key, [])
            if value not in grid[key]:
                grid[key].append(value)
    return SweepPlan(grid=grid, fixed=final_fixed, seeds=plan.seeds, runs=tuple(runs))


def paired_differences(
    plan: SweepPlan,
    rows: Sequence[Mapping[str, Any]],
    choices: Sequence[ArmChoice],
    *,
    confidence: float = CONFIDENCE,
) -> list[PairedDifference]:
    """Every arm after the first minus the first (the baseline), paired by seed."""
    arm_keys = {k for choice in choices for k, _ in choice.arm}
    accuracy: dict[str, dict[int, float]] = {}
    for run, row in zip(plan.runs, rows, strict=True):
        arm = point_label(tuple((k, v) for k, v in run.point if k in arm_keys))
        if row["status"] == "ok" and row.get(METRIC) is not None:
            accuracy.setdefault(arm, {})[run.seed] = float(row[METRIC])
    if not choices:
        return []
    baseline = choices[0].label
    base = accuracy.get(baseline, {})
    out = []
    for choice in choices[1:]:
        mine = accuracy.get(choice.label, {})
        n, mean, low, high = paired_t_interval(mine, base, confidence=confidence)
        out.append(
            PairedDifference(
                arm=choice.label,
                baseline=baseline,
                n=n,
                mean=mean,
                low=low,
                high=high,
            )
        )
    return out


def write_tuning_csv(path: Path, plan: SweepPlan, rows: Sequence[Mapping[str, Any]]) -> None:
    """Every tuning run: its point, seed, status and validation accuracy."""
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = list(plan.grid)
    shown = [{**dict(run.point), **row} for run, row in zip(plan.runs, rows, strict=True)]
    columns = ["slug", *keys, "seed", "status", "reused", METRIC, "run_dir", "error"]
    write_csv(path, shown, columns)


def render_tuning(
    choices: Sequence[ArmChoice],
    differences: Sequence[PairedDifference],
    *,
    tune: Mapping[str, Sequence[str]],
    tune_seeds: int,
    confidence: float = CONFIDENCE,
) -> list[str]:
    """The report's tuning section: what was tuned, each arm's pick, best-vs-best verdicts."""
    grid = ", ".join(f"{k} ∈ {{{', '.join(v)}}}" for k, v in tune.items())
    lines = ["## Tuned per arm, compared best vs best", ""]
    lines += [
        f"Each arm was tuned over {grid} on a validation split (20% of the training split "
        f"held out, stratified; {tune_seeds} seed(s) from base + {TUNE_SEED_OFFSET}), keeping "
        "the highest mean validation accuracy. The results above are each arm at its own best, "
        "on the test split, with the same seeds for every arm.",
        "",
        "| arm | best | validation acc | candidates (mean validation acc, n) |",
        "|---|---|---:|---|",
    ]
    for c in choices:
        cands = "; ".join(
            f"{label}: {mean:.4f} ({n})"
            if not math.isnan(mean)
            else f"{label}: excluded ({n} of {tune_seeds} finished)"
            for label, mean, _, n in c.candidates
        )
        lines.append(f"| {c.label} | {point_label(c.best)} | {c.score:.4f} | {cands} |")
    if differences:
        pct = f"{confidence:.0%}"
        lines += ["", f"Paired differences in final test accuracy ({pct} t-intervals):", ""]
        lines += ["| arm − baseline | pairs | difference | interval | verdict |"]
        lines += ["|---|---:|---:|---|---|"]
        capped = {c.label: c.capped for c in choices if c.capped}
        for d in differences:
            at_cap = [f"{arm}: {capped[arm]}" for arm in (d.arm, d.baseline) if arm in capped]
            if at_cap:
                verdict = "at the cap (" + "; ".join(at_cap) + ")"
            elif d.n < 2:
                verdict = "too few pairs for an interval"
            elif d.significant:
                verdict = "better" if d.mean > 0 else "worse"
            else:
                verdict = "not significant"
            lines.append(
                f"| {d.arm} − {d.baseline} | {d.n} | {d.mean:+.4f} | "
                f"[{d.low:+.4f}, {d.high:+.4f}] | {verdict} |"
            )
        lines.append("")
        for d in differences:
            if d.n >= 2 and not d.significant and not {d.arm, d.baseline} & set(capped):
                lines.append(
                    f"- {d.arm} vs {d.baseline}: the difference ({d.mean:+.4f}) is not "
                    f"significant: its {pct} interval [{d.low:+.4f}, {d.high:+.4f}] holds 0."
                )
    return lines


@dataclass(frozen=True)
class TunedSweep:
    """Both phases of a tuned sweep: the plans, their rows, each arm's pick, the verdicts."""

    tuning: SweepPlan
    tuning_rows: list[dict[str, Any]]
    choices: list[ArmChoice]
    plan: SweepPlan  # the final phase
    rows: list[dict[str, Any]]
    differences: list[PairedDifference]


def check_tuned_sweep(
    grid: Mapping[str, Sequence[str]],
    tune: Mapping[str, Sequence[str]],
    fixed: Mapping[str, str],
    *,
    seeds: int,
    tune_seeds: int,
    clients: int,
    scale_clip: bool = False,
) -> SweepPlan:
    """The tuning plan of ``run_tuned_sweep``, every value checked, before any run (and before
    a command replaces the runs an earlier one left: ``run_dir.claim_runs``).

    Raises:
        ValueError: a bad grid, tune key or value, or seed count.
    """
    check_final_seeds(seeds)
    return plan_tuning(
        grid, tune, fixed, tune_seeds=tune_seeds, clients=clients, scale_clip=scale_clip
    )


def run_tuned_sweep(
    grid: Mapping[str, Sequence[str]],
    tune: Mapping[str, Sequence[str]],
    fixed: Mapping[str, str],
    *,
    tune_seeds: int,
    seeds: int,
    settings: RunSettings,
    runs_dir: Path,
    jobs: int = 1,
    scale_clip: bool = False,
    console: Console | None = None,
    tuning_csv: Path | None = None,
    extend: int = 0,
) -> TunedSweep:
    """Tunes every arm on validation (runs under ``runs_dir/tune``), then runs each at its best
    on the test split (under ``runs_dir``) and compares them with the first arm, paired by seed.

    ``extend``: how many times each arm's numeric axis may be extended past a pick at its end
    (``corners.py``; 0: the grid as given, no pick marked at the cap).

    Raises:
        ValueError: a bad grid or tune key, or an arm none of whose combinations finished.
        SweepInterrupted: a stop during the final phase (with its rows).
    """
    if isinstance(extend, bool) or not isinstance(extend, int) or extend < 0:
        raise ValueError(f"extend={extend!r}: expected an integer >= 0")
    clients = settings.clients
    tuning = check_tuned_sweep(
        grid,
        tune,
        fixed,
        seeds=seeds,
        tune_seeds=tune_seeds,
        clients=clients,
        scale_clip=scale_clip,
    )
    if console is not None:
        console.print(
            f"[bold]tuning: {len(tuning.runs)} runs[/] on the validation split; run "
            f"directories under {runs_dir / 'tune'}"
        )
    tuned = run_sweep(
        tuning, runs_dir=runs_dir / "tune", settings=settings, jobs=jobs, console=console
    )
    choices = choose_best(tuning, tuned, list(grid))
    if extend > 0:
        tuning, tuned, choices = past_corners(
            tuning,
            tuned,
            choices,
            tune=tune,
            extend=extend,
            run=lambda plan: run_sweep(
                plan, runs_dir=runs_dir / "tune", settings=settings, jobs=jobs, console=console
            ),
            line=lambda arm, axes: plan_tuning(
                {k: [v] for k, v in arm},
                axes,
                fixed,
                tune_seeds=tune_seeds,
                clients=clients,
                scale_clip=scale_clip,
            ),
            choose=lambda plan, rows: choose_best(plan, rows, list(grid)),
        )
    if tuning_csv is not None:
        write_tuning_csv(tuning_csv, tuning, tuned)
    plan = plan_final(choices, fixed, seeds=seeds, clients=clients, scale_clip=scale_clip)
    if console is not None:
        for choice in choices:
            console.print(f"{choice.label or 'default'}: best {point_label(choice.best)}")
        console.print(
            f"[bold]{len(plan.runs)} runs[/] ({len(plan.runs) // seeds} configs x {seeds} "
            f"seeds, {clients} clients, {settings.label}); run directories under {runs_dir}"
        )
    try:
        rows = run_sweep(plan, runs_dir=runs_dir, settings=settings, jobs=jobs, console=console)
    except SweepInterrupted as stop:
        raise SweepInterrupted(stop.rows, plan) from stop
    return TunedSweep(
        tuning=tuning,
        tuning_rows=tuned,
        choices=choices,
        plan=plan,
        rows=rows,
        differences=paired_differences(plan, rows, choices),
    )
