"""``fedsparse sweep``: a grid of federated runs (configs x seeds), resumable, one row per run.

A sweep is the cartesian product of ``--grid key=v1,v2,...`` lists on top of fixed ``--set``
overrides, each point repeated over seeds ``base..base+N-1`` (run-config key ``seed``). Every
run config is validated with ``FederatedConfig.from_run_config`` before anything runs. Each run
writes into its own directory ``<runs_dir>/<slug>/`` on one of these backends:

- ``simulation``: Flower's simulation engine (``run_simulation``: SuperLink + ``flwr run``);
- ``inprocess``: ``run_federated`` on ``InProcessGrid`` with the real ClientApp (fast);
- ``ray``: ``run_federated`` on ``RayGrid`` (``lab/simulation/raygrid.py``): one local Ray cluster
and
  one set of workers, each holding many virtual clients, serve every run of the sweep, one
  run at a time (each run uses every worker);
- ``deploy``: a loopback deployment (``run_deployment``: TLS, authenticated SuperNodes),
  optionally on shaped links (``uplink_bps``/``downlink_bps``), for accuracy against
  wall-clock time under a rate limit (``accuracy_vs_time.png``).

A run that fails is recorded (``status=failed`` and the error) and the others go on. A run
directory holding ``summary.json`` whose config, client count and backend match is reused,
not rerun. ``fedsparse.lab.experiments.report`` turns the rows into CSVs, plots and ``report.md``.

A stop (SIGINT, SIGTERM, SIGHUP) stops every run in flight, its processes included, and
raises ``SweepInterrupted`` with the finished rows (the others ``interrupted``), so the
command line still writes the CSVs and report of what finished.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import json
import logging
import math
import os
import re
import signal
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from contextvars import ContextVar
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fedsparse.common.config import FederatedConfig, with_added_keys
from fedsparse.common.dp.scaling import rescale_max_grad_norm
from fedsparse.common.training.configs import planned_engine
from fedsparse.common.wire.run_log import RunSummary, summary_metrics
from fedsparse.lab.launch.processes import request_stop

if TYPE_CHECKING:
    from fedsparse.lab.simulation.raygrid import RayWorkers

__all__ = [
    "BACKENDS",
    "METRICS",
    "Backend",
    "RunSettings",
    "SweepPlan",
    "check_jobs",
    "SweepInterrupted",
    "SweepRun",
    "execute_run",
    "parse_grid",
    "plan_sweep",
    "run_sweep",
    "stop_pool",
]

Backend = Literal["simulation", "inprocess", "deploy", "ray"]
BACKENDS: tuple[Backend, ...] = ("simulation", "inprocess", "deploy", "ray")
#: Per-run numbers copied from ``summary.json`` into ``results.csv`` (and aggregated): the
#: ``RunSummary`` fields tagged ``metric``.
METRICS = summary_metrics()
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


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """How each run executes (not part of the run config; ``clients`` is part of a run's id)."""

    backend: Backend = "simulation"
    clients: int = 10
    cpus_per_client: float = 1.0
    gpus_per_client: float = 0.0  # simulation and ray only: Ray GPUs per client trained
    timeout: float = 3600.0
    uplink_bps: float | None = None  # deploy only: each node's shaped uplink (bit/s)
    downlink_bps: float | None = None  # deploy only: each node's shaped downlink (bit/s)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}: expected one of {', '.join(BACKENDS)}")
        for name in ("uplink_bps", "downlink_bps"):
            value = getattr(self, name)
            if value is not None and self.backend != "deploy":
                raise ValueError(
                    f"{name.replace('_bps', '-rate')}: shaped links need --backend deploy "
                    f"(backend={self.backend!r})"
                )
        if self.clients < 1:
            raise ValueError(f"clients={self.clients}: expected >= 1")
        if not self.cpus_per_client > 0:
            raise ValueError(f"cpus_per_client={self.cpus_per_client}: expected > 0")
        if not (math.isfinite(self.gpus_per_client) and self.gpus_per_client >= 0):
            raise ValueError(f"gpus_per_client={self.gpus_per_client}: expected >= 0")
        if self.gpus_per_client > 0 and self.backend not in ("simulation", "ray"):
            raise ValueError(
                f"gpus-per-client: GPUs need --backend simulation or ray (backend={self.backend!r})"
            )
        if not self.timeout > 0:
            raise ValueError(f"timeout={self.timeout}: expected > 0")


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


def _identity(run: SweepRun, settings: RunSettings) -> dict[str, Any]:
    """What must match for a finished run directory to be reused."""
    cfg = FederatedConfig.from_run_config(run.overrides)
    config = cfg.to_run_config()
    for key in ("out-dir", "resume"):  # where it ran and whether it was resumed: not its result
        config.pop(key, None)
    try:  # the engine the clients will pick here ("auto" resolves by device and model)
        engine = planned_engine(cfg.engine, cfg.model_name, cfg.device)
    except ValueError:  # the run fails with its own message; nothing to reuse
        engine = cfg.engine
    identity = {
        "config": config,
        "clients": settings.clients,
        "backend": settings.backend,
        "engine": engine,
    }
    if settings.backend == "deploy":  # the links are part of what a deployed run measured
        identity |= {"uplink_bps": settings.uplink_bps, "downlink_bps": settings.downlink_bps}
    return identity


def _reusable(run_dir: Path, identity: dict[str, Any]) -> tuple[dict[str, Any], RunSummary] | None:
    """The finished run's record and summary if ``run_dir`` holds this very run, else None."""
    try:
        record = json.loads((run_dir / "sweep-run.json").read_text())
        summary = RunSummary.from_json((run_dir / "summary.json").read_text())
    except (OSError, ValueError, TypeError):  # missing, unreadable or of another schema
        return None
    config = with_added_keys(summary.config)  # a run older than a key ran at its old behaviour
    for key in ("out-dir", "resume"):
        config.pop(key, None)
    if isinstance(record.get("config"), dict):
        record["config"] = with_added_keys(record["config"])
        # A record older than this key names no engine: an explicit one ran as named; "auto"
        # ran as auto resolved then (Opacus on the CPU until 2026-11-25), so it is rerun.
        record.setdefault("engine", record["config"].get("engine"))
    same = all(record.get(k) == v for k, v in identity.items()) and config == identity["config"]
    return (record, summary) if same and record.get("status") == "ok" else None


def _run_inprocess(overrides: Mapping[str, str], out: Path, settings: RunSettings) -> RunSummary:
    from fedsparse.client.app import app as client_app
    from fedsparse.lab.simulation.inprocess import InProcessGrid
    from fedsparse.server.app import run_federated

    cfg = FederatedConfig.from_run_config({**overrides, "out-dir": str(out)})
    grid = InProcessGrid(client_app, num_nodes=settings.clients, run_config=cfg.to_run_config())
    with _quiet_flwr():
        return run_federated(grid, cfg)


@dataclass
class _RaySession:
    """The Ray cluster and workers of the runs inside ``ray_session``, started on first use."""

    settings: RunSettings
    stack: contextlib.ExitStack
    workers: RayWorkers | None = None

    def get_workers(self) -> RayWorkers:
        if self.workers is None:
            from fedsparse.client.app import app as client_app
            from fedsparse.lab.simulation.raygrid import RayWorkers, ray_cluster

            self.stack.enter_context(ray_cluster())
            self.workers = self.stack.enter_context(
                RayWorkers(
                    client_app,
                    cpus_per_client=self.settings.cpus_per_client,
                    gpus_per_client=self.settings.gpus_per_client,
                )
            )
        return self.workers


#: The session of the sweep under way (``ray_session``); a run outside one starts its own.
_RAY_SESSION: ContextVar[_RaySession | None] = ContextVar("ray_session", default=None)


@contextlib.contextmanager
def ray_session(settings: RunSettings) -> Iterator[None]:
    """One Ray cluster and one set of workers for every ``ray`` run inside (nothing else).

    Started by the first run that needs them (a sweep of reused runs starts nothing); the
    cluster is this process's running one, else a new one that ends with the session, and
    the workers end with it.
    """
    with contextlib.ExitStack() as stack:
        token = _RAY_SESSION.set(_RaySession(settings, stack))
        try:
            yield
        finally:
            _RAY_SESSION.reset(token)


def _run_ray(overrides: Mapping[str, str], out: Path, settings: RunSettings) -> RunSummary:
    from fedsparse.lab.simulation.raygrid import RayGrid
    from fedsparse.server.app import run_federated

    session = _RAY_SESSION.get()
    if session is None:  # a run outside a sweep's session: a cluster of its own
        with ray_session(settings):
            return _run_ray(overrides, out, settings)
    cfg = FederatedConfig.from_run_config({**overrides, "out-dir": str(out)})
    grid = RayGrid(
        session.get_workers(),
        num_nodes=settings.clients,
        run_config=cfg.to_run_config(),
        stop_at=time.monotonic() + settings.timeout,
    )
    with _quiet_flwr():
        return run_federated(grid, cfg)


@contextlib.contextmanager
def _quiet_flwr() -> Iterator[None]:
    """Flower's logger at WARNING: the progress bar replaces per-round INFO lines."""
    flwr_logger = logging.getLogger("flwr")
    level = flwr_logger.level
    flwr_logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        flwr_logger.setLevel(level)


def _run_simulation(overrides: Mapping[str, str], out: Path, settings: RunSettings) -> RunSummary:
    from fedsparse.lab.launch.simulate import run_simulation

    return run_simulation(
        out=out,
        overrides=dict(overrides),
        clients=settings.clients,
        cpus_per_client=settings.cpus_per_client,
        gpus_per_client=settings.gpus_per_client,
        timeout=settings.timeout,
        console=Console(file=io.StringIO(), width=140),  # no live table under the progress bar
    )


def _run_deployment(overrides: Mapping[str, str], out: Path, settings: RunSettings) -> RunSummary:
    from fedsparse.lab.launch.deploy import run_deployment

    return run_deployment(
        out=out,
        overrides=dict(overrides),
        num_nodes=settings.clients,
        timeout=settings.timeout,
        idle_seconds=0,
        uplink_bps=settings.uplink_bps,
        downlink_bps=settings.downlink_bps,
    )


def run_backend(overrides: Mapping[str, str], out: Path, settings: RunSettings) -> RunSummary:
    """Runs one federation on ``settings.backend``; returns its summary (``summary.json``)."""
    runners = {
        "inprocess": _run_inprocess,
        "simulation": _run_simulation,
        "deploy": _run_deployment,
        "ray": _run_ray,
    }
    return runners[settings.backend](overrides, out, settings)


def _metrics(summary: RunSummary) -> dict[str, Any]:
    """The ``METRICS`` of one run, by name."""
    return {name: getattr(summary, name) for name in METRICS}


def _row(run: SweepRun, run_dir: Path, **fields: Any) -> dict[str, Any]:
    return {
        "slug": run.slug,
        "config": run.label,
        **dict(run.point),
        "seed": run.seed,
        "reused": False,
        **dict.fromkeys(METRICS),
        "wall_seconds": None,
        "run_dir": str(run_dir),
        "error": "",
        **fields,
    }


def execute_run(run: SweepRun, run_dir: Path, settings: RunSettings) -> dict[str, Any]:
    """Runs (or reuses) one run; returns its ``results.csv`` row. Never raises for a run error.

    The row has ``status`` ``ok`` or ``failed``; a failure's message is in ``error`` (one
    line) and in full in ``<run_dir>/error.txt``.
    """
    identity = _identity(run, settings)
    found = _reusable(run_dir, identity)
    if found is not None:
        record, summary = found
        metrics = _metrics(summary)
        return _row(run, run_dir, status="ok", reused=True, **metrics, wall_seconds=record["wall"])
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("summary.json", "sweep-run.json", "error.txt"):
        (run_dir / stale).unlink(missing_ok=True)
    started = time.perf_counter()
    try:
        summary = run_backend(run.overrides, run_dir, settings)
    except Exception as err:  # a failed run is a result; the sweep goes on
        message = f"{type(err).__name__}: {err}"
        (run_dir / "error.txt").write_text(message + "\n")
        line = " | ".join(s for s in message.splitlines() if s.strip())
        return _row(run, run_dir, status="failed", error=line[:300])
    wall = time.perf_counter() - started
    record = {**identity, "status": "ok", "wall": wall}
    (run_dir / "sweep-run.json").write_text(json.dumps(record, indent=2) + "\n")
    return _row(run, run_dir, status="ok", **_metrics(summary), wall_seconds=wall)


def check_jobs(settings: RunSettings, jobs: int) -> None:
    """Checks ``jobs`` (runs at a time) for ``settings``' backend.

    Raises:
        ValueError: ``jobs`` < 1, or > 1 on the ray backend (a run uses every worker).
    """
    if jobs < 1:
        raise ValueError(f"jobs={jobs}: expected >= 1")
    if jobs > 1 and settings.backend == "ray":
        raise ValueError(
            f"jobs={jobs}: expected 1 with backend='ray' (each run trains on every Ray worker)"
        )


def _executor(settings: RunSettings, jobs: int) -> Executor:
    if settings.backend == "inprocess":  # Flower/torch process globals: one process per job
        return ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn"))
    return ThreadPoolExecutor(max_workers=jobs)  # each run already lives in subprocesses


class SweepInterrupted(KeyboardInterrupt):
    """A stop (SIGINT/SIGTERM/SIGHUP) ended the sweep; ``rows`` has every run it finished.

    The unfinished runs are rows with status ``interrupted``; their directories hold what
    the run wrote until it was stopped (a valid, partial ``rounds.jsonl``).
    """

    def __init__(self, rows: list[dict[str, Any]], plan: SweepPlan | None = None) -> None:
        super().__init__("sweep interrupted")
        self.rows = rows
        self.plan = plan  # the plan whose rows these are, where the raiser knows it


def stop_pool(pool: Executor) -> None:
    """Cancels what has not started and stops what runs: worker threads see ``request_stop``
    (their launchers stop every process they started); worker processes are stopped by PID.
    """
    request_stop()
    workers = list(getattr(pool, "_processes", None) or {})  # ProcessPoolExecutor's PIDs
    pool.shutdown(wait=False, cancel_futures=True)
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    pool.shutdown(wait=True)


def _describe(row: Mapping[str, Any]) -> str:
    if row["status"] != "ok":
        return f"[red]failed[/] {row['slug']}: {row['error'][:160]}"
    acc, up = row["final_test_accuracy"], row["total_uplink_payload_bytes"] / 1e6
    note = " [dim](reused: summary.json with the same config)[/]" if row["reused"] else ""
    return f"[green]ok[/] {row['slug']}: acc {acc:.4f}, uplink {up:.3f} MB{note}"


def run_sweep(
    plan: SweepPlan,
    *,
    runs_dir: Path,
    settings: RunSettings,
    jobs: int = 1,
    console: Console | None = None,
    execute: Callable[[SweepRun, Path, RunSettings], dict[str, Any]] = execute_run,
) -> list[dict[str, Any]]:
    """Runs every run of ``plan`` (``jobs`` at a time) under a progress bar.

    Returns:
        The ``results.csv`` rows, in plan order.
    """
    check_jobs(settings, jobs)
    console = console or Console()
    rows: dict[str, dict[str, Any]] = {}
    columns = (
        TextColumn("[bold]sweep"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
    )
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("", total=len(plan.runs))

        def done(row: dict[str, Any]) -> None:
            rows[row["slug"]] = row
            progress.console.print(_describe(row))
            progress.update(task, advance=1, description=row["slug"])

        try:
            if jobs == 1:
                with ray_session(settings):  # ray: one cluster and its workers for every run
                    for run in plan.runs:
                        progress.update(task, description=f"running {run.slug}")
                        done(execute(run, runs_dir / run.slug, settings))
            else:
                pool = _executor(settings, jobs)
                try:
                    futures = [
                        pool.submit(execute, r, runs_dir / r.slug, settings) for r in plan.runs
                    ]
                    for future in as_completed(futures):
                        done(future.result())
                except BaseException:
                    stop_pool(pool)
                    raise
                pool.shutdown()
        except KeyboardInterrupt:
            interrupted = [
                rows.get(run.slug)
                or _row(run, runs_dir / run.slug, status="interrupted", error="interrupted")
                for run in plan.runs
            ]
            raise SweepInterrupted(interrupted) from None
    return [rows[run.slug] for run in plan.runs]
