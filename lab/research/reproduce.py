"""``fedsparse reproduce``: the RS paper's claims re-run by our engine, beside its numbers.

One command runs every part below (resumable: a finished run is reused, not rerun) and writes
``report.md``, CSVs and plots into one folder (``docs/reproduction``):

- **noise** (Fig. 1c): the norm of the DP noise a sparsified step adds over the dense one's, at
  the paper's d = 5.5e5, measured through ``SparseDPEngine`` against ``sqrt(1 - r)``.
- **central** (Table 2, Fig. 4): centralized DP-SGD, best vs best. Every arm (final rate r*,
  0 = the baseline) is tuned on a validation split (``eval_split="validation"``, one fixed
  train/test split for every run), then runs at its own best on the test split with paired
  seeds; "RS" is the rate among r* > 0 of highest validation accuracy, as the paper searches
  r* per row. ``untuned``: each r* also runs at the baseline's best (Fig. 4's protocol:
  RS plugged into the no-sparsification hyperparameters).
- **federated**: the same comparison on the federated app (``run_tuned_sweep``, in-process).
- **ablations** (Fig. 3): clipped SGD without noise and noisy SGD without clipping
  (Algorithms 3 and 2) against r*; the paper: RS only slows them down.
- **scaling** (App. H): a (C, momentum) grid; the paper: the best C of every momentum, and
  the best momentum of every C, lie on the diagonal C / (1 - mu) = C* / (1 - mu*).

Verdicts are rules written down before the runs (``gain_verdict`` and the others below), not
judgement calls. Where our data or models differ from the paper's, the report says so: the
paper's Table 2 has no MNIST row; its nearest rows are FMNIST's small models (DP-CNN/S, 26K
parameters; H-CNN/S, 33K), which is what ours (digits-cnn, dpcnn-mnist) are compared with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Final, cast

import numpy as np
import torch

from fedsparse.lab.experiments.stats import mean_se, paired_t_interval
from fedsparse.lab.experiments.sweep import stop_pool
from fedsparse.lab.experiments.sweep_plan import SweepPlan, SweepRun, point_label
from fedsparse.lab.experiments.tuning import (
    CONFIDENCE,
    TUNE_SEED_OFFSET,
    ArmChoice,
    PairedDifference,
    check_final_seeds,
    choose_best,
)

__all__ = [
    "PAPER_TABLE2",
    "CentralSpec",
    "CentralStudy",
    "Comparison",
    "FederatedStudy",
    "ReproductionPlan",
    "gain_verdict",
    "measure_noise_ratio",
    "run_reproduction",
    "run_specs",
    "still_rising",
]

Log = Callable[[str], None]

#: RS paper, Table 2 (lines 277-291 of the text): (dataset, model, epsilon) -> (baseline %,
#: RS %, gain in points). Mean over 5 seeds, best-vs-best over C, E and (RS) r*.
PAPER_TABLE2: Final[dict[tuple[str, str, float], tuple[float, float, float]]] = {
    ("CIFAR10", "H-CNN", 3.0): (69.7, 70.0, 0.3),
    ("CIFAR10", "H-CNN", 1.0): (62.4, 63.2, 0.8),
    ("CIFAR10", "DP-CNN", 3.0): (62.8, 64.3, 1.5),
    ("CIFAR10", "DP-CNN", 1.0): (52.5, 55.1, 2.6),
    ("SVHN", "H-CNN", 3.0): (85.9, 86.8, 0.9),
    ("SVHN", "H-CNN", 1.0): (80.7, 82.2, 1.5),
    ("SVHN", "DP-CNN", 3.0): (83.4, 84.5, 1.1),
    ("SVHN", "DP-CNN", 1.0): (76.0, 79.1, 3.1),
    ("FMNIST", "H-CNN/S", 3.0): (88.9, 89.2, 0.3),
    ("FMNIST", "H-CNN/S", 1.0): (85.8, 87.0, 1.2),
    ("FMNIST", "DP-CNN/S", 3.0): (86.6, 87.4, 0.8),
    ("FMNIST", "DP-CNN/S", 1.0): (83.2, 84.5, 1.3),
}
#: Our model -> the paper's nearest Table 2 model (FMNIST rows: 28x28 grey, small CNNs).
PAPER_MODEL: Final[dict[str, str]] = {
    "digits-cnn": "DP-CNN/S",
    "dpcnn-mnist": "DP-CNN/S",
    "mnist-hcnn": "H-CNN/S",
}
#: Fig. 1c's dimension: DP-CNN's parameter count (caption, line 30).
PAPER_NOISE_DIM: Final = 550_000
#: A curve is still rising when its last fifth gains more than this over the fifth before
#: (and more than 2 standard errors over seeds).
RISING_TOLERANCE: Final = 0.01
#: Fig. 4: "the same performance" up to r* 0.7-0.9 read as: the paired interval of r* minus
#: the baseline (same hyperparameters) lies above -EQUIVALENCE_MARGIN.
EQUIVALENCE_MARGIN: Final = 0.01


# ---------------------------------------------------------------------------------------------
# Centralized runs


@dataclass(frozen=True, kw_only=True)
class CentralSpec:
    """One centralized run (``fedsparse train``): everything that decides its result."""

    dataset: str = "digits"
    model: str | None = None
    rate: float = 0.0
    lr: float = 0.25
    epochs: int = 15
    batch_size: int = 64
    target_epsilon: float | None = 3.0
    noise_multiplier: float | None = None
    mechanism: str = "dpsgd"
    max_grad_norm: float = 1.0
    momentum: float = 0.0
    seed: int = 0
    eval_split: str = "test"
    split_seed: int = 0

    @property
    def slug(self) -> str:
        privacy = (
            f"eps{self.target_epsilon:g}"
            if self.target_epsilon is not None
            else f"sigma{self.noise_multiplier:g}"
            if self.noise_multiplier is not None
            else "sigmaNone"
        )
        parts = [
            self.dataset,
            self.model or "default",
            self.mechanism,
            privacy,
            f"r{self.rate:g}",
            f"lr{self.lr:g}",
            f"E{self.epochs}",
            f"B{self.batch_size}",
            f"C{self.max_grad_norm:g}",
            f"mu{self.momentum:g}",
            self.eval_split,
            f"split{self.split_seed}",
            f"seed{self.seed}",
        ]
        return "_".join(parts)


def _execute(spec_json: str, run_dir: str, threads: int) -> dict[str, Any]:
    """Runs one spec into ``run_dir`` (in a worker process when ``jobs > 1``)."""
    from fedsparse.common.known_warnings import quiet_known_warnings
    from fedsparse.common.seeds import Stream, stream_seed
    from fedsparse.common.training.local import PrivacyConfig, SparsityConfig, TrainConfig
    from fedsparse.lab.experiments.train import run_train

    if threads > 0:
        torch.set_num_threads(threads)
    spec = CentralSpec(**json.loads(spec_json))
    out = Path(run_dir)
    with (
        quiet_known_warnings(),
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),
    ):
        run_train(
            out=out,
            dataset=spec.dataset,  # type: ignore[arg-type]
            data_dir=None,
            model_name=spec.model,  # type: ignore[arg-type]
            privacy=PrivacyConfig(
                mechanism=spec.mechanism,  # type: ignore[arg-type]
                noise_multiplier=spec.noise_multiplier,
                target_epsilon=spec.target_epsilon,
                max_grad_norm=spec.max_grad_norm,
            ),
            sparsity=SparsityConfig(
                schedule="gradual",
                final_rate=spec.rate,
                mask_seed=stream_seed(spec.seed, Stream.EPOCH_MASKS),
            ),
            train=TrainConfig(
                epochs=spec.epochs,
                batch_size=spec.batch_size,
                lr=spec.lr,
                momentum=spec.momentum,
                seed=spec.seed,
            ),
            eval_split=spec.eval_split,  # type: ignore[arg-type]
            split_seed=spec.split_seed,
        )
    (out / "spec.json").write_text(json.dumps(_recorded_spec(spec)) + "\n")
    return _read_row(spec, out, reused=False)


def _recorded_spec(spec: CentralSpec) -> dict[str, Any]:
    """``spec.json``: the spec and the engine that trains it here (``TrainConfig``'s "auto":
    engines agree only to float rounding, so a run by another engine is not this run)."""
    from fedsparse.common.data.datasets import DatasetName
    from fedsparse.common.models.classifiers import DEFAULT_MODELS, ModelName
    from fedsparse.common.training.local import planned_engine

    model = spec.model or DEFAULT_MODELS[cast(DatasetName, spec.dataset)]
    engine = planned_engine("auto", cast(ModelName, model))
    return {**dataclasses.asdict(spec), "engine": engine}


def _read_row(spec: CentralSpec, run_dir: Path, *, reused: bool) -> dict[str, Any]:
    summary = json.loads((run_dir / "summary.json").read_text())
    epochs = [json.loads(line) for line in (run_dir / "epochs.jsonl").read_text().splitlines()]
    return {
        "slug": spec.slug,
        "status": "ok",
        "reused": reused,
        "final_test_accuracy": summary["final_test_accuracy"],
        "final_train_loss": epochs[-1]["train_loss"],
        "epsilon": summary["epsilon"],
        "curve": [e["test_accuracy"] for e in epochs],
        "loss_curve": [e["train_loss"] for e in epochs],
        "wall_seconds": summary["wall_seconds"],
        "run_dir": str(run_dir),
        "error": "",
    }


def _finished(spec: CentralSpec, run_dir: Path) -> bool:
    try:
        saved = json.loads((run_dir / "spec.json").read_text())
    except (OSError, ValueError):
        return False
    # A spec.json older than its "engine" key ran on Opacus (the CPU's "auto" until
    # 2026-11-25): no longer this run.
    return saved == _recorded_spec(spec) and (run_dir / "summary.json").is_file()


def run_specs(
    specs: Sequence[CentralSpec], root: Path, *, jobs: int = 1, log: Log | None = None
) -> list[dict[str, Any]]:
    """Every spec's row, in order; finished runs (``spec.json`` equal) are reused, the others
    run ``jobs`` at a time (worker processes with one torch thread each when ``jobs > 1``).
    A run that raises is a row with ``status="failed"`` and its error; the others go on."""
    if jobs < 1:
        raise ValueError(f"jobs={jobs}: expected >= 1")
    rows: dict[str, dict[str, Any]] = {}
    pending: dict[str, CentralSpec] = {}
    seen: dict[str, CentralSpec] = {}
    for spec in specs:
        if seen.setdefault(spec.slug, spec) != spec:  # a slug rounds values (``:g``)
            raise ValueError(
                f"run_specs: {seen[spec.slug]} and {spec} share the directory {spec.slug!r}"
            )
    for spec in specs:
        run_dir = root / spec.slug
        if spec.slug in rows or spec.slug in pending:
            continue
        if _finished(spec, run_dir):
            rows[spec.slug] = _read_row(spec, run_dir, reused=True)
        else:
            pending[spec.slug] = spec

    def failed(spec: CentralSpec, err: BaseException) -> dict[str, Any]:
        return {
            "slug": spec.slug,
            "status": "failed",
            "reused": False,
            "run_dir": str(root / spec.slug),
            "error": f"{type(err).__name__}: {err}",
        }

    total, done = len(pending), 0
    if jobs == 1 or total <= 1:
        for slug, spec in pending.items():
            try:
                rows[slug] = _execute(json.dumps(dataclasses.asdict(spec)), str(root / slug), 0)
            except Exception as err:  # noqa: BLE001 - recorded, the others go on
                rows[slug] = failed(spec, err)
            done += 1
            if log:
                log(f"  [{done}/{total}] {slug}: {_row_text(rows[slug])}")
    else:
        pool = ProcessPoolExecutor(jobs, mp_context=get_context("spawn"))
        try:
            futures = {
                pool.submit(
                    _execute, json.dumps(dataclasses.asdict(spec)), str(root / slug), 1
                ): spec
                for slug, spec in pending.items()
            }
            for future in as_completed(futures):
                spec = futures[future]
                try:
                    rows[spec.slug] = future.result()
                except Exception as err:  # noqa: BLE001 - recorded, the others go on
                    rows[spec.slug] = failed(spec, err)
                done += 1
                if log:
                    log(f"  [{done}/{total}] {spec.slug}: {_row_text(rows[spec.slug])}")
        except BaseException:  # a stop: cancel what is queued, stop the workers by PID
            stop_pool(pool)
            raise
        pool.shutdown(wait=True)
    return [rows[spec.slug] for spec in specs]


def _row_text(row: Mapping[str, Any]) -> str:
    if row["status"] != "ok":
        return f"FAILED {row['error']}"
    return f"acc {row['final_test_accuracy']:.4f}"


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


@dataclass(frozen=True, kw_only=True)
class CentralStudy:
    """A centralized best-vs-best comparison: arms ``rates`` (the first is the baseline),
    each tuned over ``lrs`` x ``epochs``."""

    name: str
    dataset: str
    model: str | None
    epsilon: float
    rates: tuple[float, ...] = (0.0, 0.5, 0.7, 0.9)
    lrs: tuple[float, ...] = (0.1, 0.25, 0.5, 1.0)
    epochs: tuple[int, ...] = (15,)
    batch_size: int = 64
    tune_seeds: int = 2
    seeds: int = 5
    untuned: bool = False


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
    """A ``SweepPlan`` view of centralized runs, for ``lab.tuning``'s choice and statistics."""
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


@dataclass(frozen=True, kw_only=True)
class FederatedStudy:
    """A federated best-vs-best comparison (``fedsparse sweep --tune``, in-process)."""

    name: str
    dataset: str
    epsilon: float
    rates: tuple[float, ...] = (0.0, 0.5, 0.7, 0.9)
    lrs: tuple[float, ...] = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
    #: num-rounds: fixed if one value, else tuned with lr (under a fixed ε, length is a
    #: hyperparameter: more rounds, more noise per round)
    rounds: tuple[int, ...] = (40,)
    clients: int = 10
    tune_seeds: int = 2
    seeds: int = 5
    extra: tuple[tuple[str, str], ...] = ()  # more fixed run-config overrides
    #: compare against this study's baseline arm (same seeds and split) instead of its own
    #: first arm: for a study whose arms are all sparse (``rates`` without 0)
    baseline_from: str | None = None

    @property
    def tune(self) -> dict[str, list[str]]:
        """The tuning grid: lr, and num-rounds when several."""
        tune = {"lr": [f"{x:g}" for x in self.lrs]}
        if len(self.rounds) > 1:
            tune["num-rounds"] = [str(n) for n in self.rounds]
        return tune

    @property
    def command(self) -> str:
        sets = [f"dataset={self.dataset}", f"target-epsilon={self.epsilon:g}"]
        if len(self.rounds) == 1:
            sets.append(f"num-rounds={self.rounds[0]}")
        sets += [f"{k}={v}" for k, v in self.extra]
        return " ".join(
            [
                "fedsparse sweep",
                f"--grid final-rate={','.join(f'{r:g}' for r in self.rates)}",
                *(f"--set {s}" for s in sets),
                f"--seeds {self.seeds} --clients {self.clients} --backend inprocess",
                *(f"--tune {k}={','.join(v)}" for k, v in self.tune.items()),
                f"--tune-seeds {self.tune_seeds}",
            ]
        )


def run_federated_study(
    study: FederatedStudy, root: Path, out: Path, *, jobs: int = 1, log: Log | None = None
) -> Comparison:
    """Runs the tuned sweep (runs under ``root / study.name``, ``jobs`` at a time), writes its
    own sweep report into ``out / study.name`` and returns the comparison."""
    from rich.console import Console

    from fedsparse.lab.experiments.report import write_outputs
    from fedsparse.lab.experiments.sweep_backends import RunSettings
    from fedsparse.lab.experiments.tuning import render_tuning, run_tuned_sweep

    fixed = {
        "dataset": study.dataset,
        "target-epsilon": f"{study.epsilon:g}",
        **({"num-rounds": str(study.rounds[0])} if len(study.rounds) == 1 else {}),
        **dict(study.extra),
    }
    tune = study.tune
    settings = RunSettings(backend="inprocess", clients=study.clients)
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
# Fig. 1c: the noise norm ratio


class _ZeroGrad(torch.nn.Module):
    """A model whose loss gradient is zero: a DP step's update is its noise alone."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(d, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * 0.0


def _noise(d: int, keep: int | None, seed: int) -> torch.Tensor:
    """The noise one ``SparseDPEngine`` step adds (sigma 1, C 1, batch 4), ``keep`` kept."""
    from torch.utils.data import DataLoader, TensorDataset

    from fedsparse.common.dp.optimizer import SparseDPEngine
    from fedsparse.common.known_warnings import quiet_known_warnings
    from fedsparse.common.masks import sample_mask

    model = _ZeroGrad(d)
    x = torch.zeros(4, d)
    engine = SparseDPEngine()
    with quiet_known_warnings():
        module, optimizer, _ = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
            data_loader=DataLoader(TensorDataset(x, torch.zeros(4)), batch_size=4),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            poisson_sampling=False,
            noise_generator=torch.Generator().manual_seed(seed),
        )
        engine.set_mask(None if keep is None else sample_mask(d, keep=keep, seed=seed))
        optimizer.zero_grad()
        module(x).sum().backward()
        optimizer.step()
    assert model.fc.weight.grad is not None
    return model.fc.weight.grad.reshape(-1).clone()


def measure_noise_ratio(
    rates: Sequence[float], *, d: int = PAPER_NOISE_DIM, trials: int = 3
) -> list[dict[str, float]]:
    """Per rate: ``||m * xi|| / ||xi||`` (independent draws) over ``trials``, against
    ``sqrt(1 - r)``, with a 3-SE verdict."""
    from fedsparse.common.masks import keep_count

    out = []
    for rate in rates:
        ratios = [
            float(
                _noise(d, keep_count(d, rate=rate), 2 * t + 1).norm()
                / _noise(d, None, 2 * t).norm()
            )
            for t in range(trials)
        ]
        mean, se = mean_se(ratios)
        predicted = math.sqrt(keep_count(d, rate=rate) / d)
        # relative s.e. of a chi norm with k dof ~ 1/sqrt(2k), quadrature sum for the ratio
        keep = keep_count(d, rate=rate)
        theory_se = predicted * math.sqrt(1 / (2 * keep) + 1 / (2 * d)) / math.sqrt(trials)
        out.append(
            {
                "rate": rate,
                "measured": mean,
                "se": se,
                "predicted": predicted,
                "relative_error": mean / predicted - 1,
                "within_3se": float(abs(mean - predicted) <= 3 * max(theory_se, se)),
            }
        )
    return out


# ---------------------------------------------------------------------------------------------
# The whole reproduction


@dataclass(frozen=True, kw_only=True)
class ReproductionPlan:
    """What ``fedsparse reproduce`` runs; ``full()`` is the committed report's plan."""

    noise_rates: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9, 0.95)
    noise_dim: int = PAPER_NOISE_DIM
    central: tuple[CentralStudy, ...] = ()
    federated: tuple[FederatedStudy, ...] = ()
    ablation_rates: tuple[float, ...] = (0.0, 0.5, 0.7, 0.9)
    ablation_seeds: int = 3
    ablation: CentralSpec | None = None  # the base run of the ablations (mechanism replaced)
    noisy_sigma: float = 1.0
    scaling_clips: tuple[float, ...] = (0.1, 0.2, 0.5, 1.0)
    scaling_momenta: tuple[float, ...] = (0.0, 0.5, 0.8, 0.9)
    scaling_seeds: int = 3
    scaling: CentralSpec | None = None  # the base run of the scaling grid

    @classmethod
    def full(cls) -> ReproductionPlan:
        digits = CentralStudy(
            name="central-digits-eps1",
            dataset="digits",
            model=None,
            epsilon=1.0,
            lrs=(0.05, 0.1, 0.25, 0.5, 1.0),
            epochs=(15, 22, 30, 40, 60),
            batch_size=64,
            untuned=True,
        )
        mnist = CentralStudy(
            name="central-mnist5k-eps1",
            dataset="mnist-5k",
            model="dpcnn-mnist",
            epsilon=1.0,
            rates=(0.0, 0.7, 0.9),
            lrs=(0.1, 0.25, 0.5, 1.0),
            epochs=(30,),
            batch_size=256,
        )
        return cls(
            central=(
                # ε = 1: RS at r* = 0.9 picked the grid's corner (lr 0.05, 60 epochs) with its
                # curve still rising, so this study's grid goes one step further both ways
                dataclasses.replace(digits, lrs=(0.025, *digits.lrs), epochs=(*digits.epochs, 90)),
                dataclasses.replace(digits, name="central-digits-eps3", epsilon=3.0),
                # ε = 1: the sparse arms were still rising at 30 epochs, the only length tried
                dataclasses.replace(mnist, epochs=(30, 45)),
                dataclasses.replace(mnist, name="central-mnist5k-eps3", epsilon=3.0),
            ),
            federated=(
                FederatedStudy(
                    name="digits-eps3",
                    dataset="digits",
                    epsilon=3.0,
                    rates=(0.0, 0.7, 0.9),
                    lrs=(0.025, 0.05, 0.1),
                    # the sparse arms were still rising at 320 rounds, the longest then tried
                    rounds=(40, 80, 160, 320, 640),
                ),
                FederatedStudy(
                    name="digits-eps1",
                    dataset="digits",
                    epsilon=1.0,
                    rates=(0.0, 0.7, 0.9),
                    lrs=(0.01, 0.025, 0.05),
                    rounds=(40, 80, 160),
                ),
                FederatedStudy(
                    name="digits-eps3-int8",
                    dataset="digits",
                    epsilon=3.0,
                    rates=(0.9,),
                    lrs=(0.05, 0.1, 0.25),
                    rounds=(40, 80, 160, 320),
                    extra=(("value-dtype", "int8"),),
                    baseline_from="digits-eps3",
                ),
            ),
            ablation=CentralSpec(dataset="digits", lr=0.25, epochs=15, batch_size=64),
            scaling=CentralSpec(
                dataset="digits", rate=0.7, lr=0.25, epochs=15, batch_size=64, target_epsilon=3.0
            ),
        )

    @classmethod
    def quick(cls) -> ReproductionPlan:
        """Every part, minutes on 2 cores: to try the command, not to conclude anything."""
        return cls(
            noise_rates=(0.5, 0.9),
            noise_dim=20_000,
            central=(
                CentralStudy(
                    name="central-digits-eps3",
                    dataset="digits",
                    model=None,
                    epsilon=3.0,
                    rates=(0.0, 0.9),
                    lrs=(0.25, 0.5),
                    epochs=(3,),
                    seeds=2,
                    untuned=True,
                ),
            ),
            federated=(
                FederatedStudy(
                    name="digits-eps3",
                    dataset="digits",
                    epsilon=3.0,
                    rates=(0.0, 0.9),
                    lrs=(0.5,),
                    rounds=(3,),
                    clients=3,
                    tune_seeds=1,
                    seeds=2,
                ),
            ),
            ablation_rates=(0.0, 0.9),
            ablation_seeds=2,
            ablation=CentralSpec(dataset="digits", lr=0.25, epochs=2, batch_size=64),
            scaling_clips=(0.5, 1.0),
            scaling_momenta=(0.0, 0.5),
            scaling_seeds=2,
            scaling=CentralSpec(
                dataset="digits", rate=0.7, lr=0.25, epochs=2, batch_size=64, target_epsilon=3.0
            ),
        )


@dataclass
class Reproduction:
    """Everything ``run_reproduction`` measured (``None``/empty: the part was not run)."""

    noise: list[dict[str, float]] = field(default_factory=list)
    comparisons: list[Comparison] = field(default_factory=list)
    ablations: dict[str, dict[float, list[dict[str, Any]]]] = field(default_factory=dict)
    scaling: dict[tuple[float, float], list[dict[str, Any]]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # studies that could not conclude


PARTS: Final = ("noise", "central", "federated", "ablations", "scaling")


def _ablation_specs(plan: ReproductionPlan) -> dict[str, dict[float, list[CentralSpec]]]:
    assert plan.ablation is not None
    base = plan.ablation
    out: dict[str, dict[float, list[CentralSpec]]] = {}
    for mechanism, sigma in (("clipped", 0.0), ("noisy", plan.noisy_sigma)):
        out[mechanism] = {
            rate: [
                dataclasses.replace(
                    base,
                    mechanism=mechanism,
                    target_epsilon=None,
                    noise_multiplier=sigma,
                    rate=rate,
                    seed=s,
                )
                for s in range(plan.ablation_seeds)
            ]
            for rate in plan.ablation_rates
        }
    return out


def _scaling_specs(plan: ReproductionPlan) -> dict[tuple[float, float], list[CentralSpec]]:
    assert plan.scaling is not None
    return {
        (clip, mu): [
            dataclasses.replace(plan.scaling, max_grad_norm=clip, momentum=mu, seed=s)
            for s in range(plan.scaling_seeds)
        ]
        for clip in plan.scaling_clips
        for mu in plan.scaling_momenta
    }


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

    ``lab/research/reproduce_report.py:reproduce_and_report`` runs them and writes ``out``'s report,
    CSVs and plots."""
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
