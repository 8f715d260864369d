"""``fedsparse frontier``: accuracy against bits per parameter, every arm tuned, best vs best
(``lab/experiments/frontier.py``); here are the options and the command line the report
records."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Final

import typer

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
)
from fedsparse.lab.launch.backends import (
    AUTO,
    BACKEND_ALIASES,
    BACKEND_CHOICE_HELP,
    BACKEND_CHOICES,
)

__all__ = ["frontier"]

#: The fixed settings unless ``--set`` says otherwise: federated digits at epsilon 3.
DEFAULT_FIXED: Final = {"dataset": "digits", "target-epsilon": "3"}


def frontier(
    out: Annotated[Path, Opt(help="output: frontier.csv, plots, report.md")] = Path(
        "runs/frontier"
    ),
    arm: Annotated[
        list[str] | None,
        Opt(
            "--arm",
            help="key=value,key=value: one arm (repeat; the first is the baseline); default "
            "dense fp32 and int8, RS r*=0.9 fp32 and int8, and constant rates 0.7-0.9 with "
            "int8/int4/int2/int1 values (lab/experiments/frontier.py: DEFAULT_ARMS)",
        ),
    ] = None,
    set_: Annotated[
        list[str] | None,
        Opt("--set", help="fixed override key=value (default dataset=digits target-epsilon=3)"),
    ] = None,
    tune: Annotated[
        list[str] | None,
        Opt("--tune", help="key=v1,v2,...: each arm's tuning grid (default lr and num-rounds)"),
    ] = None,
    seeds: Annotated[int, Opt(help="final seeds per arm, paired across arms")] = 10,
    tune_seeds: Annotated[int, Opt(help="seeds per tuning combination")] = 2,
    extend_corners: Annotated[
        int,
        Opt(
            help="extend a numeric tuning axis past a pick at its end (x2 or /2), up to N "
            "times an arm; a pick still at an end is 'at the cap' (no verdict); 0: the grid "
            "as given"
        ),
    ] = DEFAULT_EXTEND_CORNERS,
    clients: Annotated[int, Opt(help="clients (SuperNodes) per run")] = 10,
    backend: Annotated[str, Opt(help=BACKEND_CHOICE_HELP)] = AUTO,
    jobs: Annotated[int, Opt(help="runs at a time")] = 1,
    timeout: Annotated[float, Opt(help="seconds per simulation run")] = 3600.0,
    runs_dir: Annotated[Path | None, Opt(help="per-run directories (default OUT/runs)")] = None,
    resume: ResumeRuns = False,
    overwrite: OverwriteRuns = False,
) -> None:
    """Accuracy against uplink and downlink bits per parameter: each arm (a set of run-config
    values) tuned on validation, then run at its best with paired seeds; each compared with
    the first arm (dense fp32), verdict "within 1 point" from its 95% interval.

    --backend auto (the default) trains each new run on population and keeps a run folder's
    finished run on the backend that ran it (the committed frontier's: inprocess).
    A runs-dir that holds runs is refused unless --resume (an interrupted frontier resumes:
    finished runs of the same inputs are reused) or --overwrite (start over). The committed
    frontier: docs/frontier.
    """
    import shlex

    fixed = {**DEFAULT_FIXED, **parse_sets(set_ or [])}
    try:  # before the imports below: they take seconds
        check_run_config(fixed)
        for text in arm or []:  # a malformed arm is left to parse_arm's own message
            pairs = [p.split("=", 1) for p in text.split(",") if "=" in p]
            check_grid_values([f"{k}={v}" for k, v in pairs], fixed)
        check_grid_values(tune or [], fixed)
        if extend_corners < 0:
            raise ValueError(f"--extend-corners {extend_corners}: expected an integer >= 0")
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    from fedsparse.lab.experiments.frontier import (
        DEFAULT_ARMS,
        DEFAULT_TUNE,
        check_frontier,
        parse_arm,
        run_frontier,
        write_frontier,
    )
    from fedsparse.lab.experiments.sweep import check_jobs
    from fedsparse.lab.experiments.sweep_backends import RunSettings
    from fedsparse.lab.experiments.sweep_plan import parse_grid
    from fedsparse.lab.launch.run_dir import claim_runs

    try:
        arms = [parse_arm(a) for a in arm] if arm else [dict(a) for a in DEFAULT_ARMS]
        tuning = parse_grid(tune) if tune else {k: list(v) for k, v in DEFAULT_TUNE.items()}
        settings = RunSettings(
            backend=choice("backend", backend, BACKEND_CHOICES, aliases=BACKEND_ALIASES),
            clients=clients,
            timeout=timeout,
        )
        check_jobs(settings, jobs)
        check_frontier(arms, tuning, fixed, tune_seeds=tune_seeds, clients=clients)
        claim_runs(runs_dir or out / "runs", resume=resume, overwrite=overwrite)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    args = ["fedsparse", "frontier", "--out", str(out)]
    args += [a for x in arm or [] for a in ("--arm", x)]
    args += [a for s in set_ or [] for a in ("--set", s)]
    args += [a for t in tune or [] for a in ("--tune", t)]
    args += ["--seeds", str(seeds), "--tune-seeds", str(tune_seeds), "--clients", str(clients)]
    args += ["--backend", backend, "--jobs", str(jobs)]
    args += ["--extend-corners", str(extend_corners)]  # 0 too: explicit
    args += ["--runs-dir", str(runs_dir)] if runs_dir else []
    try:
        outcomes = run_frontier(
            arms,
            tuning,
            fixed,
            tune_seeds=tune_seeds,
            seeds=seeds,
            settings=settings,
            runs_dir=runs_dir or out / "runs",
            jobs=jobs,
            console=console,
            extend=extend_corners,
        )
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    write_frontier(
        out, outcomes, command=shlex.join(args), fixed=fixed, tune=tuning, tune_seeds=tune_seeds
    )
    for o in outcomes:
        console.print(
            f"{o.label}: accuracy {o.accuracy:.4f}, uplink {o.uplink_bits:.3f} bits/param, "
            f"downlink {o.downlink_bits:.3f}; {o.verdict}"
        )
    console.print(f"wrote {out / 'report.md'} and {out / 'frontier.csv'}")
    short = [o.label for o in outcomes if o.seeds < seeds]
    if short:  # a failed run (one that trained nothing, say) is not a result
        console.print(f"[bold red]runs failed[/] in {', '.join(short)}: see their error.txt")
        raise typer.Exit(1)
