"""``fedsparse frontier``: accuracy against bits per parameter, every arm tuned, best vs best.

An *arm* is a set of run-config values (``final-rate=0.9,value-dtype=int2,schedule=constant``);
``DEFAULT_ARMS`` spans dense fp32 DP-SGD (the baseline, always first), the RS paper's setting
(gradual cooling to ``r*``, fp32 values) and sparse-from-round-1 arms (a constant rate) with
low-bit values. Each arm is a tuned sweep of its own (``tuning.run_tuned_sweep``, empty grid):
tuned over ``tune`` (learning rate and rounds by default) on a validation split, then run at its
best on the test split over the same final seeds as every other arm, so arms pair by seed.

Per arm the report gives the run's average uplink and downlink payload bits per parameter per
client-round (payload bytes x 8 over the dense fp32 bytes x 32), the payload bytes per client
over the whole run, the final test accuracy, and the paired difference from the dense arm
with its Student-t 95% interval. The verdict against the target "within 1 point of tuned dense
fp32": ``within`` where the whole interval lies above -1 point, ``not within`` where it lies
below, ``inconclusive`` where it holds -1 point (more seeds would settle it).

Everything a run computes is post-processing or part of the accounted mechanism: the value
codecs quantize already-noised values (``common/wire/payload/``), and sigma is calibrated to
the target epsilon for each run's own number of rounds (``target-epsilon``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from fedsparse.common.wire.run_log import BITS_PER_PARAM_REFERENCES
from fedsparse.lab.experiments.report import write_csv
from fedsparse.lab.experiments.stats import CONFIDENCE, mean_se, paired_t_interval
from fedsparse.lab.experiments.sweep_plan import RESERVED, point_label, run_slug
from fedsparse.lab.experiments.tuning import TunedSweep, plan_tuning, run_tuned_sweep

if TYPE_CHECKING:
    from rich.console import Console

    from fedsparse.lab.experiments.sweep_backends import RunSettings

__all__ = [
    "DEFAULT_ARMS",
    "DEFAULT_TUNE",
    "grid_edges",
    "TARGET_POINTS",
    "ArmOutcome",
    "check_frontier",
    "parse_arm",
    "run_frontier",
    "verdict",
    "write_frontier",
]

#: The baseline first: dense fp32 DP-SGD (``final-rate=0``: no sparsification). Then dense int8
#: (quantization alone), the RS paper's gradual cooling to r* = 0.9 (fp32, int8), and arms
#: sparse from round 1 (``schedule=constant``) whose uplink is at most 1 bit per parameter:
#: a kept fraction ``1 - r`` of ``b``-bit values costs about ``(1 - r) b`` bits per parameter;
#: the last two compress the downlink as well (``downlink-dtype``).
DEFAULT_ARMS: Final[tuple[Mapping[str, str], ...]] = (
    {"final-rate": "0", "value-dtype": "fp32"},
    {"final-rate": "0", "value-dtype": "int8"},
    {"final-rate": "0.9", "value-dtype": "fp32"},
    {"final-rate": "0.9", "value-dtype": "int8"},
    {"final-rate": "0.9", "value-dtype": "int8", "schedule": "constant"},
    {"final-rate": "0.8", "value-dtype": "int4", "schedule": "constant"},
    {"final-rate": "0.9", "value-dtype": "int4", "schedule": "constant"},
    {"final-rate": "0.7", "value-dtype": "int2", "schedule": "constant"},
    {"final-rate": "0.9", "value-dtype": "int2", "schedule": "constant"},
    # (int2 with error-feedback, recorded in docs/frontier/report.md at 0.36, is refused: its
    # rounding does not contract, common/config_values.py: NO_ERROR_FEEDBACK)
    {"final-rate": "0.9", "value-dtype": "int1", "schedule": "constant"},
    # the downlink in the same codecs (the server adopts the decoded change)
    {"final-rate": "0.9", "value-dtype": "int8", "schedule": "constant", "downlink-dtype": "int8"},
    {"final-rate": "0.9", "value-dtype": "int4", "schedule": "constant", "downlink-dtype": "int4"},
)
#: Each arm's tuning grid: learning rate and rounds.
DEFAULT_TUNE: Final[Mapping[str, Sequence[str]]] = {
    "lr": ("0.05", "0.1", "0.25", "0.5", "1.0"),
    "num-rounds": ("20", "40", "80"),
}
#: "At the accuracy of dense DP-SGD": within this many points of the tuned dense arm.
TARGET_POINTS: Final = 1.0


def parse_arm(text: str) -> dict[str, str]:
    """``key=value,key=value`` (``--arm``) as a dict, keys in order.

    Raises:
        ValueError: an item without ``=``, an empty key or value, a key given twice, a key the
            sweep sets itself.
    """
    arm: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not key or not value:
            raise ValueError(f"--arm {text!r}: expected key=value,key=value (got {item!r})")
        if key in arm:
            raise ValueError(f"--arm {text!r}: {key} given twice")
        if key in RESERVED:
            raise ValueError(f"--arm {text!r}: {key} is not allowed here ({RESERVED[key]})")
        arm[key] = value
    return arm


def verdict(low: float, high: float, *, points: float = TARGET_POINTS) -> str:
    """Where the interval of ``arm - dense`` (accuracy, fractions) lies against ``-points``."""
    if math.isnan(low) or math.isnan(high):
        return "inconclusive (too few pairs)"
    if low > -points / 100:
        return "within"
    if high < -points / 100:
        return "not within"
    return "inconclusive"


@dataclass(frozen=True, kw_only=True)
class ArmOutcome:
    """One arm at its best: its pick, its final runs' numbers, its comparison with dense."""

    label: str
    arm: Mapping[str, str]
    best: str  # the tuned combination, ``lr=0.25, num-rounds=40``
    seeds: int  # final runs that finished
    accuracy: float
    accuracy_se: float
    uplink_bits: float  # payload bits per parameter per client-round, mean over seeds
    downlink_bits: float
    client_megabytes: float  # uplink + downlink payload per client over the run
    difference: float  # arm - dense, paired by seed (fraction)
    low: float
    high: float
    verdict: str
    by_seed: Mapping[int, float]
    edge: str = ""  # the tuned values at an end of their grid (``lr=0.05 (lowest)``)
    #: ``edge`` is after extending the grid past its corners (``extend`` > 0): at the cap
    capped: bool = False


def grid_edges(best: Sequence[tuple[str, str]], tune: Mapping[str, Sequence[str]]) -> str:
    """The picked values that are the first or last of their tuning list (of 2 or more): the
    optimum may lie beyond the grid, and the report says so."""
    edges = []
    for key, value in best:
        values = list(tune.get(key, ()))
        if len(values) > 1 and value in (values[0], values[-1]):
            edges.append(f"{key}={value} ({'lowest' if value == values[0] else 'highest'})")
    return ", ".join(edges)


def _bits(rows: Sequence[Mapping[str, Any]], payload: str, dense: str) -> float:
    values = [32.0 * float(r[payload]) / float(r[dense]) for r in rows if float(r[dense]) > 0]
    return float(np.mean(values)) if values else math.nan


def _outcome(
    arm: Mapping[str, str],
    tuned: TunedSweep,
    *,
    clients: int,
    baseline: Mapping[int, float] | None,
    tune: Mapping[str, Sequence[str]],
    extended: bool = False,
    baseline_capped: bool = False,
) -> ArmOutcome:
    rows = [r for r in tuned.rows if r["status"] == "ok"]
    by_seed = {int(r["seed"]): float(r["final_test_accuracy"]) for r in rows}
    accuracy, se = mean_se(list(by_seed.values()))
    if baseline is None:
        difference, low, high = 0.0, 0.0, 0.0
    else:
        _, difference, low, high = paired_t_interval(by_seed, baseline, confidence=CONFIDENCE)
    payload = [
        (float(r["total_uplink_payload_bytes"]) + float(r["total_downlink_payload_bytes"]))
        / clients
        / 1e6
        for r in rows
    ]
    return ArmOutcome(
        label=point_label(arm.items()),
        arm=dict(arm),
        best=point_label(tuned.choices[0].best),
        seeds=len(rows),
        accuracy=accuracy,
        accuracy_se=se,
        uplink_bits=_bits(rows, "total_uplink_payload_bytes", "total_dense_uplink_bytes"),
        downlink_bits=_bits(rows, "total_downlink_payload_bytes", "total_dense_downlink_bytes"),
        client_megabytes=float(np.mean(payload)) if payload else math.nan,
        difference=difference,
        low=low,
        high=high,
        verdict=(
            "baseline"
            if baseline is None
            else "at the cap"
            if extended and (tuned.choices[0].capped or baseline_capped)
            else verdict(low, high)
        ),
        by_seed=by_seed,
        edge=tuned.choices[0].edges if extended else grid_edges(tuned.choices[0].best, tune),
        capped=extended and bool(tuned.choices[0].capped),
    )


def check_frontier(
    arms: Sequence[Mapping[str, str]],
    tune: Mapping[str, Sequence[str]],
    fixed: Mapping[str, str],
    *,
    tune_seeds: int,
    clients: int,
) -> None:
    """Every arm's plans checked, before the first run (and before a command replaces the runs
    an earlier one left: ``run_dir.claim_runs``).

    Raises:
        ValueError: no arms, an arm key also fixed or tuned, or what the tuned sweep refuses.
    """
    if not arms:
        raise ValueError("arms: expected at least one (the baseline first)")
    for arm in arms:
        for key in arm:
            if key in fixed or key in tune:
                raise ValueError(f"arm {point_label(arm.items())}: {key} is also set or tuned")
        plan_tuning({}, tune, {**fixed, **arm}, tune_seeds=tune_seeds, clients=clients)


def run_frontier(
    arms: Sequence[Mapping[str, str]],
    tune: Mapping[str, Sequence[str]],
    fixed: Mapping[str, str],
    *,
    tune_seeds: int,
    seeds: int,
    settings: RunSettings,
    runs_dir: Path,
    jobs: int = 1,
    console: Console | None = None,
    extend: int = 0,
) -> list[ArmOutcome]:
    """Tunes and runs every arm (each under ``runs_dir/<arm>``), the first being the baseline.

    ``extend``: each arm's tuning goes on past a pick at an end of a numeric axis, up to
    ``extend`` steps an axis (``run_tuned_sweep``); an arm, or a baseline, still at an end is
    ``at the cap`` and gets that instead of a verdict.

    Finished runs are reused (the sweep's rule), so an interrupted frontier resumes.

    Raises:
        ValueError: no arms, an arm key also fixed or tuned, or what the tuned sweep refuses.
    """
    check_frontier(arms, tune, fixed, tune_seeds=tune_seeds, clients=settings.clients)
    outcomes: list[ArmOutcome] = []
    baseline: Mapping[int, float] | None = None
    for arm in arms:
        label = point_label(arm.items())
        if console is not None:
            console.print(f"[bold]arm {len(outcomes) + 1}/{len(arms)}[/]: {label}")
        tuned = run_tuned_sweep(
            {},
            tune,
            {**fixed, **arm},
            tune_seeds=tune_seeds,
            seeds=seeds,
            settings=settings,
            runs_dir=runs_dir / run_slug(arm.items(), 0).removesuffix("_seed-0"),
            jobs=jobs,
            console=console,
            extend=extend,
        )
        outcome = _outcome(
            arm,
            tuned,
            clients=settings.clients,
            baseline=baseline,
            tune=tune,
            extended=extend > 0,
            baseline_capped=bool(outcomes) and outcomes[0].capped,
        )
        outcomes.append(outcome)
        if baseline is None:
            baseline = outcome.by_seed
    return outcomes


_COLUMNS: Final = (
    "arm",
    "best",
    "seeds",
    "final_test_accuracy_mean",
    "final_test_accuracy_se",
    "uplink_bits_per_param",
    "downlink_bits_per_param",
    "payload_mb_per_client",
    "difference_vs_dense",
    "difference_low",
    "difference_high",
    "verdict",
    "tuned_at_grid_edge",
)


def _row(o: ArmOutcome) -> dict[str, Any]:
    values: list[Any] = [o.label, o.best, o.seeds, o.accuracy, o.accuracy_se, o.uplink_bits]
    values += [o.downlink_bits, o.client_megabytes, o.difference, o.low, o.high, o.verdict]
    values.append(o.edge)
    return dict(zip(_COLUMNS, values, strict=True))


def _plot(outcomes: Sequence[ArmOutcome], x: str, label: str, path: Path, refs: bool) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.4))
    ax = fig.add_subplot()
    for o in outcomes:
        value = getattr(o, x)
        ax.errorbar(value, o.accuracy, yerr=1.96 * np.nan_to_num(o.accuracy_se), fmt="o")
        ax.annotate(
            o.label, (value, o.accuracy), fontsize=6, xytext=(3, 3), textcoords="offset points"
        )
    if refs:
        for name, bits in BITS_PER_PARAM_REFERENCES.items():
            ax.axvline(bits, color="grey", linestyle=":", linewidth=1)
            ax.annotate(
                name,
                (bits, 0.02),
                xycoords=("data", "axes fraction"),
                rotation=90,
                fontsize=6,
                color="grey",
            )
    if outcomes:
        dense = outcomes[0].accuracy
        ax.axhline(dense - TARGET_POINTS / 100, color="red", linestyle="--", linewidth=1)
    ax.set(xscale="log", xlabel=label, ylabel="final test accuracy (mean, 95% bars)")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


#: The plots: file -> (ArmOutcome field, x label, draw the published bits/param anchors).
PLOTS: Final = {
    "accuracy_vs_uplink_bits.png": ("uplink_bits", "uplink bits per parameter per round", True),
    "accuracy_vs_downlink_bits.png": (
        "downlink_bits",
        "downlink bits per parameter per round",
        False,
    ),
    "accuracy_vs_client_bytes.png": ("client_megabytes", "payload MB per client (run)", False),
}


def _pm(mean: float, se: float, digits: int) -> str:
    return f"{mean:.{digits}f}" + ("" if math.isnan(se) else f" ± {se:.{digits}f}")


def write_frontier(
    out: Path,
    outcomes: Sequence[ArmOutcome],
    *,
    command: str,
    fixed: Mapping[str, str],
    tune: Mapping[str, Sequence[str]],
    tune_seeds: int,
) -> None:
    """``out/frontier.csv``, the three plots and ``out/report.md``."""
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "frontier.csv", [_row(o) for o in outcomes], _COLUMNS)
    for name, (x, label, anchors) in PLOTS.items():
        _plot(outcomes, x, label, out / name, anchors)
    tuned = "; ".join(f"{k} ∈ {{{', '.join(v)}}}" for k, v in tune.items())
    lines = ["# The bandwidth frontier", "", "Produced by:", "", "```", command, "```", ""]
    lines += ["Fixed: " + (", ".join(f"`{k}={v}`" for k, v in fixed.items()) or "defaults")]
    lines += [
        "",
        f"Each arm was tuned over {tuned} on a validation split ({tune_seeds} seeds), then run "
        "at its best on the test split with the same seeds as every other arm. Bits are "
        "payload bits per parameter per client and round, averaged over the run (uplink: the "
        "clients' updates; downlink: the server's broadcasts). The verdict compares each arm "
        f"with the tuned dense fp32 arm, paired by seed: `within` {TARGET_POINTS:g} point "
        f"where the whole {CONFIDENCE:.0%} interval of the difference lies above "
        f"-{TARGET_POINTS:g} point, `not within` where it lies below, `inconclusive` "
        "otherwise.",
        "",
        "| arm | best | n | final test acc | uplink bits/param | downlink bits/param | "
        "payload MB/client | vs dense (points) | 95% interval | verdict |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for o in outcomes:
        interval = f"[{100 * o.low:+.1f}, {100 * o.high:+.1f}]"
        lines.append(
            f"| {o.label} | {o.best} | {o.seeds} | {_pm(o.accuracy, o.accuracy_se, 4)} | "
            f"{o.uplink_bits:.3f} | {o.downlink_bits:.3f} | {o.client_megabytes:.2f} | "
            f"{100 * o.difference:+.1f} | {interval} | {o.verdict} |"
        )
    capped = [f"{o.label}: {o.edge}" for o in outcomes if o.capped]
    if capped:
        lines += [
            "",
            "Still at an end of its tuning grid after the grid was extended to its cap (no "
            "verdict against it: `at the cap`; an end the run config bounds, such as momentum "
            "below 1, keeps its verdict): " + "; ".join(capped) + ".",
        ]
    edges = [f"{o.label}: {o.edge}" for o in outcomes if o.edge and not o.capped]
    if edges:
        lines += [
            "",
            "Picked at an end of its tuning grid (the optimum may lie beyond it): "
            + "; ".join(edges)
            + ".",
        ]
    refs = "; ".join(f"{k} ≈ {v:g}" for k, v in BITS_PER_PARAM_REFERENCES.items())
    lines += ["", f"Published reference points (bits/param at no accuracy loss): {refs}.", ""]
    lines += [f"![{x}]({name})" for name, (x, _, _) in PLOTS.items()]
    (out / "report.md").write_text("\n".join(lines) + "\n")
