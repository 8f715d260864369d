"""The plan of a sweep: a grid of run configs (configs x seeds), parsed and validated.

A sweep is the cartesian product of ``--grid key=v1,v2,...`` lists on top of fixed ``--set``
overrides, each point repeated over seeds ``base..base+N-1`` (run-config key ``seed``).
``plan_sweep`` expands it into ``SweepRun``s, each with a filesystem-safe slug naming its
directory, and validates every run config with ``FederatedConfig.from_run_config`` before
anything runs; nothing here runs a federation (that is ``fedsparse.lab.experiments.sweep``).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from fedsparse.common.config import FederatedConfig
from fedsparse.common.dp.scaling import rescale_max_grad_norm

__all__ = [
    "RESERVED",
    "SweepPlan",
    "SweepRun",
    "parse_grid",
    "plan_sweep",
    "point_label",
    "run_slug",
]

RESERVED = {"seed": "use --seeds N (and --set seed=BASE)", "out-dir": "the sweep sets it per run"}
_UNSAFE = re.compile(r"[^A-Za-z0-9.+-]")


@dataclass(frozen=True, kw_only=True)
class SweepRun:
    """One run of a sweep: a grid point, a seed, and the run-config overrides they make."""

    slug: str
    point: tuple[tuple[str, str], ...]  # (grid key, value) in grid order
    seed: int
    overrides: Mapping[str, str]

    @property
    def label(self) -> str:
        """The grid point as ``key=value, ...`` (``default`` for an empty grid)."""
        return point_label(self.point)


@dataclass(frozen=True, kw_only=True)
class SweepPlan:
    """Every run of a sweep, in order (grid points in product order, seeds innermost)."""

    grid: Mapping[str, Sequence[str]]
    fixed: Mapping[str, str]
    seeds: tuple[int, ...]
    runs: tuple[SweepRun, ...]


def point_label(point: Iterable[tuple[str, str]]) -> str:
    """``key=value, ...`` for a grid point; ``default`` when the grid is empty."""
    return ", ".join(f"{k}={v}" for k, v in point) or "default"


def parse_grid(items: Iterable[str]) -> dict[str, list[str]]:
    """Parses ``key=v1,v2,...`` items (``--grid``), keeping order.

    Raises:
        ValueError: no ``=``, an empty key or value, a duplicate value, a key given twice.
    """
    grid: dict[str, list[str]] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--grid {item!r}: expected key=v1,v2,...")
        if key in grid:
            raise ValueError(f"--grid {key}: given twice; list all values in one --grid")
        values = [v.strip() for v in raw.split(",")]
        if not raw.strip() or any(not v for v in values):
            raise ValueError(f"--grid {key}={raw!r}: empty value; expected {key}=v1,v2,...")
        dupes = sorted({v for v in values if values.count(v) > 1})
        if dupes:
            raise ValueError(f"--grid {key}={raw!r}: duplicate value {', '.join(dupes)}")
        grid[key] = values
    return grid


def _slug_part(key: str, value: str) -> str:
    text = f"{key}-{value}"
    safe = _UNSAFE.sub("-", text)[:60]
    if safe != text:  # keep sanitized slugs unique: tag them with a hash of the raw text
        safe += "-" + hashlib.sha1(text.encode()).hexdigest()[:6]
    return safe


def run_slug(point: Iterable[tuple[str, str]], seed: int) -> str:
    """Filesystem-safe directory name for a run, e.g. ``final-rate-0.5_seed-1``."""
    return "_".join([*(_slug_part(k, v) for k, v in point), f"seed-{seed}"])


def _check_keys(grid: Mapping[str, Sequence[str]], fixed: Mapping[str, str]) -> None:
    for key in grid:
        if key in fixed:
            raise ValueError(f"{key!r} is in both --grid and --set; give it in one of them")
        if key in RESERVED:
            raise ValueError(f"--grid {key}: not allowed here ({RESERVED[key]})")
        if not grid[key]:
            raise ValueError(f"--grid {key}: empty value list")
    if "out-dir" in fixed:
        raise ValueError(f"--set out-dir: not allowed here ({RESERVED['out-dir']})")


def plan_sweep(
    grid: Mapping[str, Sequence[str]],
    fixed: Mapping[str, str],
    *,
    seeds: int,
    clients: int | None = None,
    scale_clip: bool = False,
) -> SweepPlan:
    """Expands and validates a sweep; nothing runs.

    Args:
        grid: key -> values (cartesian product over keys, in order).
        fixed: overrides common to every run (``--set``); ``seed`` here is the base seed.
        seeds: runs per grid point, with seeds ``base + 0 .. base + seeds - 1``.
        clients: if given, every run's ``min-clients`` must not exceed it.
        scale_clip: the scaling rule (``common/dp/scaling.py``; RS App. H): every run's
            ``max-grad-norm`` is ``C (1 - momentum)``, where ``C`` is the fixed
            ``max-grad-norm`` (tuned at momentum 0), so that ``C / (1 - mu)`` stays that of
            the tuned setting along a grid over ``momentum``.

    Raises:
        ValueError: naming the key and value (and the grid point) that is wrong.
    """
    if seeds < 1:
        raise ValueError(f"seeds={seeds}: expected >= 1")
    _check_keys(grid, fixed)
    if scale_clip and "max-grad-norm" in grid:
        raise ValueError("--scale-clip: max-grad-norm is set by the rule; do not grid it")
    base_clip = FederatedConfig.from_run_config(fixed).max_grad_norm if scale_clip else 0.0
    base = FederatedConfig.from_run_config({"seed": fixed.get("seed", "0")}).seed
    runs: list[SweepRun] = []
    seen: dict[str, str] = {}  # run config (JSON) -> where it was first planned
    for values in itertools.product(*grid.values()):
        point = tuple(zip(grid, values, strict=True))
        for seed in range(base, base + seeds):
            overrides = {**fixed, **dict(point), "seed": str(seed)}
            where = f"grid point {point_label(point)}, seed {seed}"
            if scale_clip:
                try:
                    momentum = float(overrides.get("momentum", "0"))
                    clip = rescale_max_grad_norm(
                        max_grad_norm=base_clip, momentum=0.0, new_momentum=momentum
                    )
                except ValueError as err:
                    raise ValueError(f"{where}: --scale-clip: {err}") from None
                overrides["max-grad-norm"] = repr(clip)
            try:
                cfg = FederatedConfig.from_run_config(overrides)
            except ValueError as err:
                raise ValueError(f"{where}: {err}") from None
            if clients is not None and cfg.min_clients > clients:
                raise ValueError(f"{where}: min-clients={cfg.min_clients} > clients={clients}")
            key = json.dumps(cfg.to_run_config(), sort_keys=True)
            if key in seen:
                raise ValueError(f"{where}: the same run config as {seen[key]} (duplicate value)")
            seen[key] = where
            runs.append(
                SweepRun(slug=run_slug(point, seed), point=point, seed=seed, overrides=overrides)
            )
    return SweepPlan(
        grid={k: list(v) for k, v in grid.items()},
        fixed=dict(fixed),
        seeds=tuple(range(base, base + seeds)),
        runs=tuple(runs),
    )
