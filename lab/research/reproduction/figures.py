"""The plots of the reproduction's report: the noise ratio, accuracy against r*, the
learning curves, the tuned run lengths, the ablations and the scaling grid.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from fedsparse.common.dp.mechanisms import mechanism_of
from fedsparse.lab.research.reproduction.comparison import Comparison, _mean_se
from fedsparse.lab.research.reproduction.plan import PAPER_NOISE_DIM
from fedsparse.lab.research.reproduction.sections import _length_unit, _num, _ok

# ---------------------------------------------------------------------------------------------
# Plots


def _save(fig: Figure, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot_noise(rows: Sequence[Mapping[str, float]], path: Path) -> None:
    fig = Figure(figsize=(5, 3.5))
    ax = fig.add_subplot()
    grid = np.linspace(0, 0.99, 100)
    ax.plot(grid, np.sqrt(1 - grid), color="grey", label="sqrt(1 - r)")
    ax.errorbar(
        [r["rate"] for r in rows],
        [r["measured"] for r in rows],
        yerr=[3 * r["se"] for r in rows],
        fmt="o",
        label="measured (±3 SE)",
    )
    ax.set_xlabel("sparsification rate r")
    ax.set_ylabel("||m ⊙ ξ|| / ||ξ||")
    ax.set_title(f"Fig. 1c: noise norm ratio, d = {PAPER_NOISE_DIM:,}")
    ax.legend()
    _save(fig, path)


def _grid(n: int) -> tuple[int, int]:
    cols = min(n, 2)
    return math.ceil(n / cols), cols


def _plot_rates(comparisons: Sequence[Comparison], path: Path) -> None:
    rows, cols = _grid(len(comparisons))
    fig = Figure(figsize=(5 * cols, 3.4 * rows))
    for i, c in enumerate(comparisons):
        ax = fig.add_subplot(rows, cols, i + 1)
        stats = [a.mean_se for a in c.arms]
        ax.errorbar(
            [a.rate for a in c.arms],
            [100 * m for m, _ in stats],
            yerr=[0 if math.isnan(s) else 100 * s for _, s in stats],
            fmt="o-",
            capsize=3,
            label="each r* at its own best",
        )
        untuned = [(a.rate, _mean_se(list(a.untuned.values()))) for a in c.arms[1:] if a.untuned]
        if untuned:
            ax.errorbar(
                [0.0] + [r for r, _ in untuned],
                [100 * stats[0][0]] + [100 * m for _, (m, _) in untuned],
                yerr=[0 if math.isnan(stats[0][1]) else 100 * stats[0][1]]
                + [0 if math.isnan(s) else 100 * s for _, (_, s) in untuned],
                fmt="s--",
                capsize=3,
                label="at the baseline's best",
            )
        ax.set_title(
            f"{c.name}: {c.setting}, {c.dataset} ({c.model}), ε = {c.epsilon:g}", fontsize=9
        )
        ax.set_xlabel("final sparsification rate r*")
        ax.set_ylabel("test accuracy (%)")
        ax.legend(fontsize=7)
    _save(fig, path)


def _plot_curves(comparisons: Sequence[Comparison], path: Path) -> None:
    rows, cols = _grid(len(comparisons))
    fig = Figure(figsize=(5 * cols, 3.4 * rows))
    for i, c in enumerate(comparisons):
        ax = fig.add_subplot(rows, cols, i + 1)
        for arm in c.arms:
            length = min((len(x) for x in arm.curves), default=0)
            if not length:
                continue
            mean = np.mean([x[:length] for x in arm.curves], axis=0)
            ax.plot(range(1, length + 1), 100 * mean, label=f"r* = {arm.rate:g} ({arm.best})")
        unit = "epoch" if c.setting == "centralized" else "round"
        ax.set_title(f"{c.name}: {c.setting}, {c.dataset}, ε = {c.epsilon:g}", fontsize=9)
        ax.set_xlabel(unit)
        ax.set_ylabel("test accuracy (%)")
        ax.legend(fontsize=6)
    _save(fig, path)


def _plot_lengths(comparisons: Sequence[Comparison], path: Path) -> bool:
    """Each arm's best validation accuracy per run length tried; False when none was tuned."""
    tuned = [c for c in comparisons if any(len(a.by_length) > 1 for a in c.arms)]
    if not tuned:
        return False
    rows, cols = _grid(len(tuned))
    fig = Figure(figsize=(5 * cols, 3.4 * rows))
    for i, c in enumerate(tuned):
        ax = fig.add_subplot(rows, cols, i + 1)
        for arm in c.arms:
            points = sorted(arm.by_length.items(), key=_num)
            if len(points) > 1:
                ax.plot(
                    [float(n) for n, _ in points],
                    [100 * v for _, v in points],
                    "o-",
                    label=arm.name,
                )
        ax.set_xscale("log", base=2)
        ax.set_title(f"{c.name}: best validation per length, ε = {c.epsilon:g}", fontsize=9)
        ax.set_xlabel(_length_unit(c))
        ax.set_ylabel("validation accuracy (%)")
        ax.legend(fontsize=6)
    _save(fig, path)
    return True


def _plot_ablations(
    ablations: Mapping[str, Mapping[float, list[dict[str, Any]]]], path: Path
) -> None:
    fig = Figure(figsize=(10, 3.5))
    for i, (mechanism, by_rate) in enumerate(ablations.items()):
        ax = fig.add_subplot(1, len(ablations), i + 1)
        rates = list(by_rate)
        for key, label, scale in (
            ("final_train_loss", "final train loss", 1.0),
            ("final_test_accuracy", "test accuracy", 1.0),
        ):
            stats = [_mean_se(_ok(by_rate[r], key)) for r in rates]
            ax.errorbar(
                rates,
                [scale * m for m, _ in stats],
                yerr=[0 if math.isnan(s) else scale * s for _, s in stats],
                fmt="o-",
                capsize=3,
                label=label,
            )
        lacks = "noise" if mechanism_of(mechanism).clips else "clipping"
        ax.set_title(f"Fig. 3: {mechanism} SGD (no {lacks})")
        ax.set_xlabel("final sparsification rate r*")
        ax.legend(fontsize=7)
    _save(fig, path)


def _plot_scaling(
    table: Mapping[tuple[float, float], tuple[float, float]],
    clips: Sequence[float],
    momenta: Sequence[float],
    path: Path,
) -> None:
    fig = Figure(figsize=(5, 4))
    ax = fig.add_subplot()
    values = np.array([[100 * table[(c, m)][0] for m in momenta] for c in clips])
    image = ax.imshow(values, origin="lower", cmap="viridis")
    fig.colorbar(image, ax=ax, label="test accuracy (%)")
    ax.set_xticks(range(len(momenta)), [f"{m:g}" for m in momenta])
    ax.set_yticks(range(len(clips)), [f"{c:g}" for c in clips])
    ax.set_xlabel("momentum μ")
    ax.set_ylabel("clipping bound C")
    finished = {cell: v for cell, v in table.items() if not math.isnan(v[0])}
    best = max(finished, key=lambda cell: finished[cell][0]) if finished else (1.0, 0.0)
    rho = best[0] / (1 - best[1])
    for i, c in enumerate(clips):
        for j, m in enumerate(momenta):
            on = abs(math.log2(c / (1 - m) / rho)) <= 1 + 1e-9
            ax.text(
                j,
                i,
                f"{values[i, j]:.1f}",
                ha="center",
                va="center",
                fontsize=7,
                color="red" if on else "white",
                fontweight="bold" if on else "normal",
            )
    ax.set_title(f"App. H: C / (1 - μ) within 2x of {rho:.3g} in red")
    _save(fig, path)
