"""Running the reproduction's parts: the centralized studies (tune on validation, run each
arm at its best on test), the federated tuned sweeps, the ablations and the scaling grid
(``run_reproduction``; finished runs are reused).
"""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedsparse.lab.experiments.sweep_plan import SweepPlan, SweepRun, point_label
from fedsparse.lab.experiments.tuning import (
    TUNE_SEED_OFFSET,
    check_final_seeds,
    choose_best,
)
from fedsparse.lab.research.reproduction.central_runs import run_specs
from fedsparse.lab.research.reproduction.comparison import Comparison, _comparison_arms
from fedsparse.lab.research.reproduction.noise import measure_noise_ratio
from fedsparse.lab.research.reproduction.plan import (
    PARTS,
    CentralSpec,
    CentralStudy,
    FederatedStudy,
    Log,
    ReproductionPlan,
    _ablation_specs,
    _scaling_specs,
)

__all__ = ["Reproduction", "run_central_study", "run_federated_study", "run_reproduction"]


def _central_spec(
    study: CentralStudy, rate: float, lr: float, epochs: int, **kw: Any
) -> CentralSpec:
    return CentralSpec(
        dataset=study.dataset,
        model=study.model,
        rate=rate,
        lr=lr,
        epochs=epochs,
        batch_size=study.batch_size,
        target_epsilon=study.epsilon,
        split_seed=0,
        **kw,
    )


def _plan(specs: Sequence[tuple[tuple[tuple[str, str], ...], CentralSpec]]) -> SweepPlan:
    """A ``SweepPlan`` view of centralized runs, for ``fedsparse.lab.experiments.tuning``'s
    choice and statistics."""
    runs = tuple(
        SweepRun(slug=spec.slug, point=point, seed=spec.seed, overrides={}) for point, spec in specs
    )
    grid: dict[str, list[str]] = {}
    for point, _ in specs:
        for key, value in point:
            if value not in grid.setdefault(key, []):
                grid[key].append(value)
    seeds = tuple(sorted({spec.seed for _, spec in specs}))
    return SweepPlan(grid=grid, fixed={}, seeds=seeds, runs=runs)


def run_central_study(
    study: CentralStudy, root: Path, *, jobs: int = 1, log: Log | None = None
) -> Comparison:
    """Tunes every arm on validation, runs each at its best on test; optionally every arm
    also at the baseline's best (``untuned``). Run directories under ``root / study.name``."""
    check_final_seeds(study.seeds)
    root = root / study.name

    def point(rate: float, lr: float, epochs: int) -> tuple[tuple[str, str], ...]:
        return (("final-rate", f"{rate:g}"), ("lr", f"{lr:g}"), ("epochs", str(epochs)))

    tuning = [
        (
            point(rate, lr, e),
            _central_spec(study, rate, lr, e, seed=TUNE_SEED_OFFSET + i, eval_split="validation"),
        )
        for rate in study.rates
        for lr in study.lrs
        for e in study.epochs
        for i in range(study.tune_seeds)
    ]
    if log:
        log(f"{study.name}: tuning, {len(tuning)} runs on the validation split")
    tune_plan = _plan(tuning)
    tune_rows = run_specs([s for _, s in tuning], root / "tune", jobs=jobs, log=log)
    choices = choose_best(tune_plan, tune_rows, ["final-rate"])
    final: list[tuple[tuple[tuple[str, str], ...], CentralSpec]] = []
    for choice in choices:
        best = dict(choice.best)
        rate = float(dict(choice.arm)["final-rate"])
        final += [
            (
                (*choice.arm, *choice.best),
                _central_spec(study, rate, float(best["lr"]), int(best["epochs"]), seed=s),
            )
            for s in range(study.seeds)
        ]
    if log:
        picks = "; ".join(f"{c.label}: {point_label(c.best)}" for c in choices)
        log(f"{study.name}: best per arm: {picks}; {len(final)} final runs on the test split")
    final_plan = _plan(final)
    final_rows = run_specs([s for _, s in final], root, jobs=jobs, log=log)
    arms = _comparison_arms(final_plan, final_rows, choices, lambda row: list(row["curve"]))
    if study.untuned:
        base = dict(choices[0].best)
        untuned = [
            _central_spec(study, arm.rate, float(base["lr"]), int(base["epochs"]), seed=s)
            for arm in arms[1:]
            for s in range(study.seeds)
        ]
        for spec, row in zip(untuned, run_specs(untuned, root, jobs=jobs, log=log), strict=True):
            if row["status"] == "ok":
                arm = next(a for a in arms if a.rate == spec.rate)
                arm.untuned[spec.seed] = float(row["final_test_accuracy"])
    grid = f"lr ∈ {{{', '.join(f'{x:g}' for x in study.lrs)}}}"
    if len(study.epochs) > 1:
        grid += f" × epochs ∈ {{{', '.join(map(str, study.epochs))}}}"
    else:
        grid += f" (epochs {study.epochs[0]})"
    model = study.model or _default_model(study.dataset)
    return Comparison(
        name=study.name,
        setting="centralized",
        dataset=study.dataset,
        model=model,
        epsilon=study.epsilon,
        tuned_over=grid,
        arms=arms,
        tune_seeds=study.tune_seeds,
        seeds=study.seeds,
        grid={"lr": tuple(f"{x:g}" for x in study.lrs), "epochs": tuple(map(str, study.epochs))},
    )


def _default_model(dataset: str) -> str:
    from fedsparse.common.models.classifiers import DEFAULT_MODELS

    return str(DEFAULT_MODELS[dataset])  # type: ignore[index]


def run_federated_study(
    study: FederatedStudy, root: Path, out: Path, *, jobs: int = 1, log: Log | None = None
) -> Comparison:
    """Runs the tuned sweep (runs under ``root / study.name``, ``jobs`` at a time), writes its
    own sweep report into ``out / study.name`` and returns the comparison."""
    from rich.console import Console

    from fedsparse.lab.experiments.report import write_outputs
    from fedsparse.lab.experiments.sweep_backends import RunSettings
    from fedsparse.lab.experiments.tuning import render_tuning, run_tuned_sweep
    from fedsparse.lab.launch.backends import AUTO

    fixed = {
        "dataset": study.dataset,
        "target-epsilon": f"{study.epsilon:g}",
        **({"num-rounds": str(study.rounds[0])} if len(study.rounds) == 1 else {}),
        **dict(study.extra),
    }
    tune = study.tune
    # auto: population for a new run; a recorded run folder keeps the backend that ran it
    settings = RunSettings(backend=AUTO, clients=study.clients)
    sweep_out = out / study.name
    if log:
        log(f"{study.name}: federated tuned sweep ({study.command})")
    result = run_tuned_sweep(
        {"final-rate": [f"{r:g}" for r in study.rates]},
        tune,
        fixed,
        tune_seeds=study.tune_seeds,
        seeds=study.seeds,
        settings=settings,
        runs_dir=root / study.name,
        jobs=jobs,
        console=Console(file=io.StringIO()),
        tuning_csv=sweep_out / "tuning.csv",
    )
    extra = render_tuning(
        result.choices, result.differences, tune=tune, tune_seeds=study.tune_seeds
    )
    write_outputs(sweep_out, result.plan, settings, result.rows, command=study.command, extra=extra)

    def curve(row: Mapping[str, Any]) -> list[float]:
        lines = (Path(row["run_dir"]) / "rounds.jsonl").read_text().splitlines()
        return [float(json.loads(line)["test_accuracy"]) for line in lines]

    arms = _comparison_arms(result.plan, result.rows, result.choices, curve, "num-rounds")
    rounds_note = f"{study.rounds[0]} rounds, " if len(study.rounds) == 1 else ""
    for arm in arms:
        if study.extra:
            arm.label = f"r* = {arm.rate:g}, " + ", ".join(f"{k}={v}" for k, v in study.extra)
    return Comparison(
        name=study.name,
        setting="federated",
        dataset=study.dataset,
        model=_default_model(study.dataset),
        epsilon=study.epsilon,
        tuned_over=" × ".join(f"{k} ∈ {{{', '.join(v)}}}" for k, v in tune.items())
        + f" ({rounds_note}{study.clients} clients)",
        arms=arms,
        table2=not study.extra,
        tune_seeds=study.tune_seeds,
        seeds=study.seeds,
        grid={"lr": tuple(tune["lr"]), "num-rounds": tuple(str(n) for n in study.rounds)},
        length_key="num-rounds",
    )


# ---------------------------------------------------------------------------------------------
# The whole reproduction


@dataclass
class Reproduction:
    """Everything ``run_reproduction`` measured (``None``/empty: the part was not run)."""

    noise: list[dict[str, float]] = field(default_factory=list)
    comparisons: list[Comparison] = field(default_factory=list)
    ablations: dict[str, dict[float, list[dict[str, Any]]]] = field(default_factory=dict)
    scaling: dict[tuple[float, float], list[dict[str, Any]]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # studies that could not conclude


def _baseline_source(
    fed: FederatedStudy, studies: Mapping[str, FederatedStudy], done: Sequence[Comparison]
) -> Comparison:
    """The finished comparison whose baseline ``fed`` borrows: same data, ε, clients and
    seeds, so its runs pair with ``fed``'s by seed, and every length ``fed`` tries tried
    there too (the baseline may have had more: its tuning is then only the stronger).

    Raises:
        ValueError: no such study, not run before ``fed``, or one that does not pair.
    """
    name = fed.baseline_from
    source = studies.get(name or "")
    if source is None:
        raise ValueError(f"baseline_from={name!r}: no federated study of that name")
    for key in ("dataset", "epsilon", "clients", "seeds"):
        if getattr(source, key) != getattr(fed, key):
            raise ValueError(
                f"baseline_from={name!r}: {key} {getattr(source, key)!r} != "
                f"{getattr(fed, key)!r}; its runs would not pair by seed"
            )
    if not set(fed.rounds) <= set(source.rounds):
        raise ValueError(
            f"baseline_from={name!r}: rounds {fed.rounds!r} tries lengths its baseline's "
            f"{source.rounds!r} did not"
        )
    if source.rates[0] != 0.0:
        raise ValueError(f"baseline_from={name!r}: its first arm is not the baseline (r* = 0)")
    for comparison in done:
        if comparison.name == name:
            return comparison
    raise ValueError(f"baseline_from={name!r}: that study must run (and finish) first")


def run_reproduction(
    plan: ReproductionPlan,
    *,
    out: Path,
    runs_dir: Path,
    parts: Sequence[str] = PARTS,
    jobs: int = 1,
    log: Log | None = None,
) -> Reproduction:
    """Runs the chosen ``parts`` of ``plan`` (finished runs reused); returns the measurements.

    ``report.reproduce_and_report`` runs them and writes ``out``'s report, CSVs and plots."""
    for part in parts:
        if part not in PARTS:
            raise ValueError(f"parts: {part!r}: expected some of {', '.join(PARTS)}")
    result = Reproduction()
    if "noise" in parts:
        if log:
            log(f"noise: Fig. 1c at d = {plan.noise_dim:,}")
        result.noise = measure_noise_ratio(plan.noise_rates, d=plan.noise_dim)
    if "central" in parts:
        for study in plan.central:
            try:
                result.comparisons.append(
                    run_central_study(study, runs_dir / "central", jobs=jobs, log=log)
                )
            except ValueError as err:  # e.g. an arm none of whose combinations finished
                result.failures.append(f"{study.name}: {err}")
                if log:
                    log(f"{study.name}: FAILED {err}")
    if "federated" in parts:
        studies = {fed.name: fed for fed in plan.federated}
        for fed in plan.federated:
            try:
                source = None
                if fed.baseline_from is not None:
                    source = _baseline_source(fed, studies, result.comparisons)
                comparison = run_federated_study(
                    fed, runs_dir / "federated", out / "federated", jobs=jobs, log=log
                )
            except ValueError as err:
                result.failures.append(f"{fed.name}: {err}")
                if log:
                    log(f"{fed.name}: FAILED {err}")
                continue
            if source is not None:
                borrowed = dataclasses.replace(
                    source.baseline,
                    label=f"r* = 0 (the baseline of {source.name})",
                    grid=source.grid,
                )
                comparison.arms.insert(0, borrowed)
            result.comparisons.append(comparison)
    if "ablations" in parts and plan.ablation is not None:
        for mechanism, by_rate in _ablation_specs(plan).items():
            specs = [s for group in by_rate.values() for s in group]
            if log:
                log(f"ablation {mechanism}: {len(specs)} runs")
            rows = iter(run_specs(specs, runs_dir / "ablations", jobs=jobs, log=log))
            result.ablations[mechanism] = {
                rate: [next(rows) for _ in group] for rate, group in by_rate.items()
            }
    if "scaling" in parts and plan.scaling is not None:
        by_cell = _scaling_specs(plan)
        specs = [s for group in by_cell.values() for s in group]
        if log:
            log(f"scaling rule: {len(specs)} runs")
        rows = iter(run_specs(specs, runs_dir / "scaling", jobs=jobs, log=log))
        result.scaling = {cell: [next(rows) for _ in group] for cell, group in by_cell.items()}
    return result
