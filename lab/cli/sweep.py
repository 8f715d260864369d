"""``fedsparse sweep``: a grid of runs x seeds (optionally tuned per arm), with its report.

Planning, running and the outputs are ``lab/experiments/sweep_plan.py``,
``lab/experiments/sweep.py`` (each run on its backend: ``lab/experiments/sweep_backends.py``),
``lab/experiments/tuning.py`` and ``lab/experiments/report.py``; here are the options and the
command line the report records.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fedsparse.lab.cli.simulate import RAY_ADDRESS_HELP
from fedsparse.lab.cli.utils import (
    DEFAULT_EXTEND_CORNERS,
    Opt,
    OverwriteRuns,
    ResumeRuns,
    check_grid_values,
    check_run_config,
    choice,
    console,
    parse_sets,
    rate,
)
from fedsparse.lab.launch.backends import (
    AUTO,
    BACKEND_ALIASES,
    BACKEND_CHOICE_HELP,
    BACKEND_CHOICES,
)

__all__ = ["sweep"]


def sweep(
    out: Annotated[Path, Opt(help="output: CSVs, plots, report.md")] = Path("runs/sweep"),
    grid: Annotated[
        list[str] | None, Opt("--grid", help="key=v1,v2,... (repeat for a cartesian product)")
    ] = None,
    set_: Annotated[list[str] | None, Opt("--set", help="fixed override key=value")] = None,
    seeds: Annotated[int, Opt(help="seeds per config: base+0..N-1 (base: --set seed)")] = 1,
    clients: Annotated[int, Opt(help="clients (SuperNodes) per run")] = 10,
    backend: Annotated[str, Opt(help=BACKEND_CHOICE_HELP)] = AUTO,
    jobs: Annotated[int, Opt(help="runs at a time")] = 1,
    timeout: Annotated[float, Opt(help="seconds per simulation run")] = 3600.0,
    cpus_per_client: Annotated[float, Opt(help="Ray CPUs per virtual client")] = 1.0,
    gpus_per_client: Annotated[
        float, Opt(help="Ray GPUs per virtual client (flower, ray, ray-population), e.g. 0.25")
    ] = 0.0,
    runs_dir: Annotated[Path | None, Opt(help="per-run directories (default OUT/runs)")] = None,
    uplink_rate: Annotated[
        str | None, Opt(help="deploy: shape each node's uplink, e.g. 1mbit")
    ] = None,
    downlink_rate: Annotated[
        str | None, Opt(help="deploy: shape each node's downlink, e.g. 8mbit")
    ] = None,
    tune: Annotated[
        list[str] | None,
        Opt("--tune", help="key=v1,v2,...: tune each grid point (arm) over these, on validation"),
    ] = None,
    tune_seeds: Annotated[int, Opt(help="--tune: seeds per tuning combination")] = 2,
    extend_corners: Annotated[
        int | None,
        Opt(
            help="--tune: extend a numeric axis past a pick at its end (x2 or /2), up to N "
            "times an arm; a pick still at an end is 'at the cap' (no verdict); default 2 "
            "with --tune (0: the grid as given)",
            show_default=False,
        ),
    ] = None,
    ray_address: Annotated[str | None, Opt(help=RAY_ADDRESS_HELP)] = None,
    scale_clip: Annotated[
        bool,
        Opt(
            help="scaling rule (RS App. H): max-grad-norm = C (1 - momentum) per run, C the "
            "--set max-grad-norm tuned at momentum 0, along a --grid momentum=..."
        ),
    ] = False,
    resume: ResumeRuns = False,
    overwrite: OverwriteRuns = False,
) -> None:
    """Bandwidth vs accuracy: a grid of runs x seeds; results/summary CSVs, plots, report.md.

    With --tune, every grid point (arm) is first tuned over the --tune grid on a validation
    split (20% of the training split held out; seeds from base + 1000), then each arm runs at
    its own best on the test split with --seeds paired seeds, and the report compares every
    arm with the first, best vs best, with 95% intervals (lab/experiments/tuning.py).

    --backend auto (the default) trains each new run on population (in process, each round
    vectorised across the clients; ray-population with --ray-address or GPUs) and keeps a
    run folder's finished run on the backend that ran it, so a recorded sweep is reused as
    it ran. --backend ray runs every run on one local Ray cluster and one set of workers
    (lab/simulation/raygrid.py), one run at a time (--jobs 1): each run uses every worker;
    --backend ray-population alike, each worker's share of a round trained vectorised.
    A runs-dir that holds runs is refused unless --resume (finished runs with the same config,
    clients and backend are reused; a finished run of another config is refused by name, not
    rerun over) or --overwrite (start over). Failed runs are recorded and the sweep goes on
    (exit code 1 at the end if any failed). Each run's summary.json records, as its command,
    the fedsparse simulate (or deploy) line that reruns that run alone.
    """
    import shlex

    fixed = parse_sets(set_ or [])
    try:
        check_run_config(fixed)  # before the imports below: they take seconds
        check_grid_values([*(grid or []), *(tune or [])], fixed)
        if extend_corners is not None and (extend_corners < 0 or not tune):
            raise ValueError(
                f"--extend-corners {extend_corners}: expected an integer >= 0, with --tune"
            )
        if extend_corners is None:
            extend_corners = DEFAULT_EXTEND_CORNERS if tune else 0
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    from fedsparse.lab.experiments.report import write_outputs
    from fedsparse.lab.experiments.sweep import SweepInterrupted, check_jobs, run_sweep
    from fedsparse.lab.experiments.sweep_backends import RunSettings
    from fedsparse.lab.experiments.sweep_plan import parse_grid, plan_sweep
    from fedsparse.lab.experiments.tuning import check_tuned_sweep, render_tuning, run_tuned_sweep
    from fedsparse.lab.launch.run_dir import claim_runs

    try:
        settings = RunSettings(
            backend=choice("backend", backend, BACKEND_CHOICES, aliases=BACKEND_ALIASES),
            clients=clients,
            cpus_per_client=cpus_per_client,
            gpus_per_client=gpus_per_client,
            timeout=timeout,
            uplink_bps=rate("uplink-rate", uplink_rate),
            downlink_bps=rate("downlink-rate", downlink_rate),
            ray_address=ray_address,
        )
        check_jobs(settings, jobs)
        if not tune:
            plan = plan_sweep(
                parse_grid(grid or []), fixed, seeds=seeds, clients=clients, scale_clip=scale_clip
            )
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    args = ["fedsparse", "sweep", "--out", str(out)]
    args += [a for g in grid or [] for a in ("--grid", g)]
    args += [a for s in set_ or [] for a in ("--set", s)]
    args += ["--seeds", str(seeds), "--clients", str(clients), "--backend", backend]
    args += ["--jobs", str(jobs)] + (["--runs-dir", str(runs_dir)] if runs_dir else [])
    args += ["--gpus-per-client", str(gpus_per_client)] if gpus_per_client else []
    args += ["--uplink-rate", uplink_rate] if uplink_rate else []
    args += ["--downlink-rate", downlink_rate] if downlink_rate else []
    args += [a for t in tune or [] for a in ("--tune", t)]
    args += ["--tune-seeds", str(tune_seeds)] if tune else []
    args += ["--extend-corners", str(extend_corners)] if tune else []  # 0 too: explicit
    args += ["--scale-clip"] if scale_clip else []
    args += ["--ray-address", ray_address] if ray_address else []
    runs_dir = runs_dir or out / "runs"
    try:  # every value checked first: an overwrite then removes the earlier runs
        if tune:
            check_tuned_sweep(
                parse_grid(grid or []),
                parse_grid(tune),
                fixed,
                seeds=seeds,
                tune_seeds=tune_seeds,
                clients=clients,
                scale_clip=scale_clip,
            )
        claim_runs(runs_dir, resume=resume, overwrite=overwrite)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    extra: list[str] = []
    try:
        if tune:
            try:
                result = run_tuned_sweep(
                    parse_grid(grid or []),
                    parse_grid(tune),
                    fixed,
                    tune_seeds=tune_seeds,
                    seeds=seeds,
                    settings=settings,
                    runs_dir=runs_dir,
                    jobs=jobs,
                    scale_clip=scale_clip,
                    console=console,
                    tuning_csv=out / "tuning.csv",
                    extend=extend_corners,
                )
            except ValueError as err:
                raise typer.BadParameter(str(err)) from err
            plan, rows = result.plan, result.rows
            extra = render_tuning(
                result.choices, result.differences, tune=parse_grid(tune), tune_seeds=tune_seeds
            )
        else:
            console.print(
                f"[bold]{len(plan.runs)} runs[/] ({len(plan.runs) // seeds} configs x {seeds} "
                f"seeds, {clients} clients, {backend}); run directories under {runs_dir}"
            )
            rows = run_sweep(plan, runs_dir=runs_dir, settings=settings, jobs=jobs, console=console)
    except SweepInterrupted as stop:  # the CSVs and report of what finished, then the exit
        if stop.plan is None and tune:  # stopped while tuning: tuning.csv is not written
            raise
        stopped = stop.plan or plan
        paths = write_outputs(out, stopped, settings, stop.rows, command=shlex.join(args))
        done = sum(r["status"] == "ok" for r in stop.rows)
        console.print(
            f"[bold red]sweep interrupted[/]: {done} of {len(stop.rows)} runs finished; "
            f"wrote {paths['results.csv']} and {paths['report.md']}"
        )
        raise
    paths = write_outputs(out, plan, settings, rows, command=shlex.join(args), extra=extra)
    failed = sum(r["status"] != "ok" for r in rows)
    reused = sum(bool(r["reused"]) for r in rows)
    console.print(
        f"[bold]{len(rows) - failed} ok[/] ({reused} reused), [bold]{failed} failed[/]; "
        f"wrote {paths['results.csv']}, {paths['summary.csv']} and {paths['report.md']}"
    )
    if failed:
        raise typer.Exit(1)
