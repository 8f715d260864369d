"""A sweep's outputs: ``results.csv``, ``summary.csv``, ``rounds.csv``, PNG plots, ``report.md``.

``results.csv`` has one row per run (``fedsparse.lab.experiments.sweep``); ``summary.csv`` one row
per
grid point with the mean and standard error over its successful seeds
(``fedsparse.lab.experiments.stats.mean_se``: SE = sample std / sqrt(n), blank for n = 1);
``rounds.csv``
every run's ``rounds.jsonl`` lines, so the plots can be redrawn without the run directories.
Plots are drawn on matplotlib ``Figure`` objects, without pyplot: no display, and no change to
the process's matplotlib backend.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from fedsparse.common.wire.run_log import (
    BITS_PER_PARAM_REFERENCES,
    RoundLog,
    per_round_fields,
    read_rounds,
)
from fedsparse.lab.experiments.stats import column_standard_errors, mean_se
from fedsparse.lab.experiments.sweep import METRICS
from fedsparse.lab.experiments.sweep_backends import RunSettings
from fedsparse.lab.experiments.sweep_plan import SweepPlan, point_label

__all__ = [
    "PLOTS",
    "ROUND_KEYS",
    "mean_se",  # re-exported from fedsparse.lab.experiments.stats, where it is defined
    "summarize",
    "write_csv",
    "write_outputs",
]

#: Per-run numbers of ``results.csv`` and ``summary.csv``: the run's ``METRICS`` and the
#: sweep's wall time for the run (``wall_seconds``, not the summary's sum over rounds).
SUMMARY_METRICS = (*METRICS, "wall_seconds")
#: ``RoundLog`` fields kept in ``rounds.csv`` (those tagged ``per_round``).
ROUND_KEYS = per_round_fields()
PLOTS = {
    "accuracy_vs_uplink.png": "Test accuracy vs cumulative uplink payload",
    "final_accuracy.png": "Final test accuracy",
    "uplink_per_round.png": "Uplink bytes per round",
    "accuracy_vs_time.png": "Test accuracy vs wall-clock time",
}


@dataclass
class ConfigRuns:
    """One grid point's rows (all seeds) and its successful runs' rounds."""

    label: str
    point: dict[str, str]
    rows: list[dict[str, Any]] = field(default_factory=list)
    rounds: dict[str, list[RoundLog]] = field(default_factory=dict)  # slug -> rounds

    @property
    def ok(self) -> list[dict[str, Any]]:
        """Rows of the successful runs."""
        return [r for r in self.rows if r["status"] == "ok"]


def group_configs(plan: SweepPlan, rows: Sequence[Mapping[str, Any]]) -> list[ConfigRuns]:
    """Rows grouped by grid point (plan order), with each successful run's rounds loaded."""
    groups: dict[str, ConfigRuns] = {}
    for run, row in zip(plan.runs, rows, strict=True):
        group = groups.setdefault(run.label, ConfigRuns(label=run.label, point=dict(run.point)))
        group.rows.append(dict(row))
        path = Path(row["run_dir"]) / "rounds.jsonl"
        if row["status"] == "ok" and path.exists():
            group.rounds[row["slug"]] = read_rounds(path)
    return list(groups.values())


def summarize(groups: Sequence[ConfigRuns]) -> list[dict[str, Any]]:
    """One ``summary.csv`` row per grid point: n, failures, mean and SE of every metric."""
    out = []
    for group in groups:
        row: dict[str, Any] = {"config": group.label, **group.point}
        row["n"], row["n_failed"] = len(group.ok), len(group.rows) - len(group.ok)
        for metric in SUMMARY_METRICS:
            row[f"{metric}_mean"], row[f"{metric}_se"] = mean_se(r[metric] for r in group.ok)
        out.append(row)
    return out


def _cell(value: Any) -> Any:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return value


def write_csv(path: Path, rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> None:
    """Writes ``rows`` (floats as ``repr``, exact; None/NaN as blank cells)."""
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _cell(row.get(k)) for k in columns})


def _per_round(
    group: ConfigRuns, values: Callable[[list[RoundLog]], Sequence[float] | np.ndarray]
) -> np.ndarray:
    """(runs x rounds) array of ``values(rounds)`` over the group's runs, cut to the shortest."""
    runs = list(group.rounds.values())
    length = min(len(r) for r in runs)
    return np.asarray([np.asarray(values(r), dtype=np.float64)[:length] for r in runs])


def _band(ax: Axes, x: np.ndarray, y: np.ndarray, label: str) -> None:
    """Mean curve over runs (rows of y) with a shaded +-SE band when there are several."""
    mean = y.mean(axis=0)
    (line,) = ax.plot(x, mean, marker="o", markersize=3, label=label)
    if y.shape[0] > 1:
        se = column_standard_errors(y)
        ax.fill_between(x, mean - se, mean + se, color=line.get_color(), alpha=0.2)


def plot_accuracy_vs_uplink(groups: Sequence[ConfigRuns], path: Path) -> None:
    """(a) Test accuracy vs cumulative uplink payload MB, one curve per grid point."""
    fig, ax = _figure()
    for group in (g for g in groups if g.rounds):
        up = _per_round(group, lambda r: np.cumsum([e.uplink_payload_bytes for e in r]))
        acc = _per_round(group, lambda r: [e.test_accuracy for e in r])
        _band(ax, up.mean(axis=0) / 1e6, acc, group.label)
    ax.set(xlabel="cumulative uplink payload (MB)", ylabel="test accuracy")
    ax.set_title(PLOTS[path.name] + " (mean ± SE over seeds)")
    _finish(fig, ax, path)


def plot_accuracy_vs_time(groups: Sequence[ConfigRuns], settings: RunSettings, path: Path) -> None:
    """(d) Test accuracy vs wall-clock seconds (sum of the rounds' ``wall_seconds``), one curve
    per grid point: on a shaped deployment, what a rate limit costs each config in time.
    """
    fig, ax = _figure()
    for group in (g for g in groups if g.rounds):
        seconds = _per_round(group, lambda r: np.cumsum([e.wall_seconds for e in r]))
        acc = _per_round(group, lambda r: [e.test_accuracy for e in r])
        _band(ax, seconds.mean(axis=0), acc, group.label)
    ax.set(xlabel="wall-clock seconds (sum of rounds)", ylabel="test accuracy")
    ax.set_title(f"{PLOTS[path.name]} (mean ± SE over seeds)\n{link_label(settings)}")
    _finish(fig, ax, path)


def link_label(settings: RunSettings) -> str:
    """How the runs' links were: the backend, and the shaped rates of a deployment."""
    rates = [
        f"{name} {bps / 1e6:g} Mbit/s"
        for name, bps in (("up", settings.uplink_bps), ("down", settings.downlink_bps))
        if bps is not None
    ]
    return settings.label + (f", {', '.join(rates)} per node" if rates else "")


def plot_final_accuracy(plan: SweepPlan, summary: Sequence[Mapping[str, Any]], path: Path) -> None:
    """(b) Final accuracy vs final rate, a line per other grid point; else a bar per config."""
    fig, ax = _figure()
    ok = [s for s in summary if s["n"] > 0]
    if "final-rate" in plan.grid:
        others = [k for k in plan.grid if k != "final-rate"]
        lines: dict[str, list[Mapping[str, Any]]] = {}
        for row in ok:
            lines.setdefault(point_label((k, row[k]) for k in others), []).append(row)
        for label, members in lines.items():
            members = sorted(members, key=lambda r: float(r["final-rate"]))
            x = [float(r["final-rate"]) for r in members]
            y = [r["final_test_accuracy_mean"] for r in members]
            err = np.nan_to_num([r["final_test_accuracy_se"] for r in members])
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=label if others else None)
        ax.set(xlabel="final sparsification rate r*", ylabel="final test accuracy")
    else:
        labels = [r["config"] for r in ok]
        err = np.nan_to_num([r["final_test_accuracy_se"] for r in ok])
        ax.bar(labels, [r["final_test_accuracy_mean"] for r in ok], yerr=err, capsize=3)
        ax.set(ylabel="final test accuracy")
        ax.tick_params(axis="x", labelrotation=20)
    ax.set_title(PLOTS[path.name] + " (error bars: SE over seeds)")
    _finish(fig, ax, path)


def plot_uplink_per_round(groups: Sequence[ConfigRuns], path: Path) -> None:
    """(c) Uplink MB per round: payload solid, Flower message dashed, one color per config."""
    fig, ax = _figure()
    for group in (g for g in groups if g.rounds):
        rounds = _per_round(group, lambda r: [e.round for e in r])[0]
        payload = _per_round(group, lambda r: [e.uplink_payload_bytes for e in r])
        message = _per_round(group, lambda r: [e.uplink_message_bytes for e in r])
        (line,) = ax.plot(rounds, payload.mean(axis=0) / 1e6, marker="o", label=group.label)
        ax.plot(rounds, message.mean(axis=0) / 1e6, "--", color=line.get_color())
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="round", ylabel="uplink MB per round (all clients)")
    ax.set_title(PLOTS[path.name] + " (solid: payload, dashed: Flower message)")
    _finish(fig, ax, path)


def _figure() -> tuple[Figure, Axes]:
    """A figure with one axes, not registered with pyplot (nothing to close, no backend)."""
    fig = Figure(figsize=(7, 4.5))
    return fig, fig.subplots()


def _finish(fig: Figure, ax: Axes, path: Path) -> None:
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _pm(mean: float, se: float, digits: int, scale: float = 1.0) -> str:
    if math.isnan(mean):
        return "—"
    text = f"{mean / scale:.{digits}f}"
    return text if math.isnan(se) else f"{text} ± {se / scale:.{digits}f}"


TABLE = (  # (header, metric, digits, scale)
    ("final test acc", "final_test_accuracy", 4, 1.0),
    ("ε max", "epsilon_max", 3, 1.0),
    ("uplink payload MB", "total_uplink_payload_bytes", 3, 1e6),
    ("uplink message MB", "total_uplink_message_bytes", 3, 1e6),
    ("downlink payload MB", "total_downlink_payload_bytes", 3, 1e6),
    ("dense uplink MB", "total_dense_uplink_bytes", 3, 1e6),
    ("uplink savings ×", "uplink_savings", 2, 1.0),
    ("uplink bits/param", "uplink_bits_per_param", 3, 1.0),
    ("downlink bits/param", "downlink_bits_per_param", 3, 1.0),
    ("total density", "total_density", 3, 1.0),
    ("wall s", "wall_seconds", 1, 1.0),
)


def render_report(
    plan: SweepPlan,
    settings: RunSettings,
    summary: Sequence[Mapping[str, Any]],
    rows: Sequence[Mapping[str, Any]],
    command: str,
    extra: Sequence[str] = (),
) -> str:
    """The markdown report: command, fixed settings, mean ± SE table, ``extra`` lines (the
    tuning section of a tuned sweep), bits per parameter, failures, plots."""
    lines = ["# fedsparse sweep", "", "Produced by:", "", "```", command, "```", ""]
    lines += ["## Fixed settings", "", "| setting | value |", "|---|---|"]
    lines += [f"| backend | {link_label(settings)} |", f"| clients | {settings.clients} |"]
    lines += [f"| seeds | {', '.join(map(str, plan.seeds))} |"]
    lines += [f"| {k} | {v} |" for k, v in plan.fixed.items() if k != "seed"]
    lines += ["", "Every other run-config key has its `pyproject.toml` default.", ""]
    lines += ["## Results (mean ± SE over seeds; SE = sample std / √n)", ""]
    lines += ["| config | n | " + " | ".join(h for h, *_ in TABLE) + " |"]
    lines += ["|---|---:|" + "---:|" * len(TABLE)]
    for row in summary:
        cells = [_pm(row[f"{m}_mean"], row[f"{m}_se"], d, s) for _, m, d, s in TABLE]
        lines.append(f"| {row['config']} | {row['n']} | " + " | ".join(cells) + " |")
    lines += ["", *extra, *([""] if extra else []), *bits_per_param_section(summary)]
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        lines += ["", "## Failed runs", ""]
        lines += [f"- `{r['slug']}`: {r['error']}" for r in failed]
    lines += ["", "## Plots", ""]
    lines += [f"![{title}]({name})\n" for name, title in PLOTS.items()]
    return "\n".join(lines)


def bits_per_param_section(summary: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each config's uplink bits per parameter per client-round beside the published points.

    The references (``BITS_PER_PARAM_REFERENCES``) are schemes reported at no accuracy loss;
    a config below one of them is cheaper on the wire, at the accuracy the table above shows
    (compare tuned runs before calling it a gain).
    """
    refs = sorted(BITS_PER_PARAM_REFERENCES.items(), key=lambda kv: -kv[1])
    lines = ["## Uplink bits per parameter", ""]
    lines += ["Payload bits per model parameter per client and round; references: "]
    lines[-1] += "; ".join(f"{name} = {bits:g}" for name, bits in refs) + "."
    lines += ["", "| config | bits/param | final test acc | vs references |", "|---|---:|---:|---|"]
    for row in summary:
        bits = row["uplink_bits_per_param_mean"]
        if math.isnan(bits):
            continue
        place = ", ".join(f"{bits / ref:.2f}× {name.split(' (')[0]}" for name, ref in refs)
        acc = _pm(row["final_test_accuracy_mean"], row["final_test_accuracy_se"], 4)
        lines.append(f"| {row['config']} | {bits:.3f} | {acc} | {place} |")
    return lines


def _round_rows(groups: Sequence[ConfigRuns]) -> list[dict[str, Any]]:
    out = []
    for group in groups:
        for row in group.ok:
            for entry in group.rounds.get(row["slug"], []):
                values = {key: getattr(entry, key) for key in ROUND_KEYS}
                out.append({"slug": row["slug"], **group.point, "seed": row["seed"], **values})
    return out


def write_outputs(
    out: Path,
    plan: SweepPlan,
    settings: RunSettings,
    rows: Sequence[Mapping[str, Any]],
    *,
    command: str,
    extra: Sequence[str] = (),
) -> dict[str, Path]:
    """Writes the CSVs, the PNG plots and ``report.md`` into ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    keys = list(plan.grid)
    shown = [{**r, "run_dir": os.path.relpath(r["run_dir"], out)} for r in rows]
    paths = {name: out / name for name in ("results.csv", "summary.csv", "rounds.csv")}
    result_cols = ["slug", *keys, "seed", "status", "reused", *SUMMARY_METRICS, "run_dir", "error"]
    write_csv(paths["results.csv"], shown, result_cols)
    groups = group_configs(plan, rows)
    summary = summarize(groups)
    stats = [f"{m}_{s}" for m in SUMMARY_METRICS for s in ("mean", "se")]
    write_csv(paths["summary.csv"], summary, ["config", *keys, "n", "n_failed", *stats])
    write_csv(paths["rounds.csv"], _round_rows(groups), ["slug", *keys, "seed", *ROUND_KEYS])
    for name in PLOTS:
        paths[name] = out / name
    plot_accuracy_vs_uplink(groups, paths["accuracy_vs_uplink.png"])
    plot_final_accuracy(plan, summary, paths["final_accuracy.png"])
    plot_uplink_per_round(groups, paths["uplink_per_round.png"])
    plot_accuracy_vs_time(groups, settings, paths["accuracy_vs_time.png"])
    paths["report.md"] = out / "report.md"
    report = render_report(plan, settings, summary, rows, command, extra)
    paths["report.md"].write_text(report + "\n")
    return paths
