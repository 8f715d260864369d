"""``fedsparse sweep``: runs a plan of federated runs, resumable, one row per run.

The plan (configs x seeds, ``fedsparse.lab.experiments.sweep_plan``) runs on one of the
backends of ``fedsparse.lab.experiments.sweep_backends``, each run in its own directory
``<runs_dir>/<slug>/``; ``jobs > 1`` runs several at a time in a pool of threads (of processes
for ``inprocess``). A ``deploy`` sweep may shape the links (``uplink_bps``/``downlink_bps``),
for accuracy against wall-clock time under a rate limit (``accuracy_vs_time.png``).

A run that fails is recorded (``status=failed`` and the error) and the others go on. A run
directory holding ``summary.json`` whose config, client count and backend match is reused,
not rerun. ``fedsparse.lab.experiments.report`` turns the rows into CSVs, plots and ``report.md``.

A stop (SIGINT, SIGTERM, SIGHUP) stops every run in flight, its processes included, and
raises ``SweepInterrupted`` with the finished rows (the others ``interrupted``), so the
command line still writes the CSVs and report of what finished.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fedsparse.common.config import FederatedConfig, with_added_keys
from fedsparse.common.data.datasets import load_dataset
from fedsparse.common.training.configs import planned_engine
from fedsparse.common.wire.run_log import RunSummary, record_command, summary_metrics
from fedsparse.lab.experiments.sweep_backends import (
    RunSettings,
    ray_session,
    run_backend,
    share_cpus,
    standalone_command,
)
from fedsparse.lab.experiments.sweep_plan import SweepPlan, SweepRun
from fedsparse.lab.launch.backends import backend_name
from fedsparse.lab.launch.processes import request_stop
from fedsparse.lab.launch.run_dir import RunInputs, claim, data_digest

__all__ = [
    "METRICS",
    "SweepInterrupted",
    "check_jobs",
    "execute_run",
    "run_sweep",
    "stop_pool",
]

#: Per-run numbers copied from ``summary.json`` into ``results.csv`` (and aggregated): the
#: ``RunSummary`` fields tagged ``metric``.
METRICS = summary_metrics()


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
        # the data's content and the plug-ins' code (RunInputs); a record older than these
        # keys is compared on the others only (``_LATER_KEYS``)
        "data": _data_digest(cfg.dataset, cfg.data_dir, cfg.seed),
        "plugins": RunInputs.of_run(clients=0, backend="", data="", run_config=config).plugins,
    }
    if settings.backend_traits.shaped_links:  # part of what a deployed run measured
        identity |= {"uplink_bps": settings.uplink_bps, "downlink_bps": settings.downlink_bps}
    return identity


#: Identity keys added after sweeps were recorded: a record without one is not compared on it.
_LATER_KEYS = ("data", "plugins")


@functools.lru_cache(maxsize=8)
def _data_digest(dataset: str, data_dir: str, seed: int) -> str:
    """``run_dir.data_digest`` of the dataset a run loads ("" where it cannot be loaded here:
    the run fails with its own message)."""
    try:
        return data_digest(*load_dataset(dataset, data_dir=data_dir or None, seed=seed))  # type: ignore[arg-type]
    except (OSError, ValueError):
        return ""


def _reusable(run_dir: Path, identity: dict[str, Any]) -> tuple[dict[str, Any], RunSummary] | None:
    """The finished run's record and summary if ``run_dir`` holds this very run, else None."""
    try:
        record = json.loads((run_dir / "sweep-run.json").read_text())
        summary = RunSummary.from_json((run_dir / "summary.json").read_text())
    except (OSError, ValueError, TypeError):  # missing, unreadable or of another schema
        return None
    if not isinstance(record, dict):
        return None
    config = with_added_keys(summary.config)  # a run older than a key ran at its old behaviour
    for key in ("out-dir", "resume"):
        config.pop(key, None)
    if isinstance(record.get("config"), dict):
        record["config"] = with_added_keys(record["config"])
        # A record older than this key names no engine: an explicit one ran as named; "auto"
        # ran as auto resolved then, which need not be what it resolves to now, so it is rerun.
        record.setdefault("engine", record["config"].get("engine"))
    if isinstance(record.get("backend"), str):  # a record may name a backend by an older name
        record["backend"] = backend_name(record["backend"])
    same = all(
        record.get(k) == v for k, v in identity.items() if k in record or k not in _LATER_KEYS
    )
    same = same and config == identity["config"]
    return (record, summary) if same and record.get("status") == "ok" else None


def other_run(run_dir: Path, identity: dict[str, Any]) -> str | None:
    """Where ``run_dir`` holds a finished run (``status`` ok) that is not this one: the first
    differing input, with both values; else None."""
    try:
        record = json.loads((run_dir / "sweep-run.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("status") != "ok":
        return None
    if isinstance(record.get("config"), dict):
        record["config"] = with_added_keys(record["config"])
        for key in ("out-dir", "resume"):
            record["config"].pop(key, None)
    if isinstance(record.get("backend"), str):
        record["backend"] = backend_name(record["backend"])
    for key, value in identity.items():
        if key in _LATER_KEYS and key not in record:
            continue
        old = record.get(key)
        if key == "config" and isinstance(old, dict):
            for name in sorted(set(old) | set(value)):
                if old.get(name) != value.get(name):
                    return _differs(run_dir, name, old.get(name), value.get(name))
        elif old != value:
            return _differs(run_dir, key, old, value)
    return None


def _differs(run_dir: Path, key: str, old: Any, new: Any) -> str:
    if key == "data":  # digests: their heads name them
        old, new = f"sha256 {str(old)[:12]}...", f"sha256 {str(new)[:12]}..."
    return (
        f"{run_dir} holds a finished run with {key}={old!r}, this sweep's has {key}={new!r}: "
        "not rerun over it (--overwrite starts over, or use another --out)"
    )


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
    recorded = settings.for_folder(run_dir)  # auto: the backend of the run the folder holds
    identity = _identity(run, recorded)
    found = _reusable(run_dir, identity)
    if found is not None:
        record, summary = found
        metrics = _metrics(summary)
        return _row(run, run_dir, status="ok", reused=True, **metrics, wall_seconds=record["wall"])
    other = other_run(run_dir, identity)
    if other is not None:  # a finished run of other numbers: never rerun over silently
        return _row(run, run_dir, status="failed", error=f"RunFolderError: {other}")
    settings = settings.fresh()  # a run that trains: on auto's choice, as the sweep set up
    if settings.backend != recorded.backend:
        identity = _identity(run, settings)
    claim(run_dir, overwrite=True)  # an unfinished run's leftovers (the sweep claimed runs-dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        summary = run_backend(run.overrides, run_dir, settings)
    except Exception as err:  # a failed run is a result; the sweep goes on
        message = f"{type(err).__name__}: {err}"
        (run_dir / "error.txt").write_text(message + "\n")
        line = " | ".join(s for s in message.splitlines() if s.strip())
        return _row(run, run_dir, status="failed", error=line[:300])
    wall = time.perf_counter() - started
    # the line that reruns this cell alone (the run itself had no command line of its own)
    command = standalone_command(run.overrides, run_dir, settings)
    summary = record_command(run_dir / "summary.json", summary, command)
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
    if jobs > 1 and settings.backend_traits.cluster:
        raise ValueError(
            f"jobs={jobs}: expected 1 with backend={settings.backend!r} (each run trains on "
            "every Ray worker)"
        )


def _executor(settings: RunSettings, jobs: int) -> Executor:
    if settings.backend_traits.in_process:  # process globals: one process per job
        return ProcessPoolExecutor(
            max_workers=jobs,
            mp_context=get_context("spawn"),
            initializer=share_cpus,  # a vectorised run's threads: its share of the CPUs
            initargs=(jobs,),
        )
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
