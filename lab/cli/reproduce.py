"""``fedsparse reproduce``: the RS paper's claims re-run beside the paper's numbers.

The plan, the runs, the verdicts and the report are ``lab/research/reproduction/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Final

import typer

from fedsparse.lab.cli.utils import Opt, OverwriteRuns, ResumeRuns, choice, console

__all__ = ["PARTS_ALL", "reproduce"]

PARTS_ALL: Final = "noise,central,federated,ablations,scaling"


def reproduce(
    out: Annotated[Path, Opt(help="output: report.md, CSVs, plots")] = Path(
        "runs/reproduction/report"
    ),
    runs_dir: Annotated[
        Path, Opt(help="per-run directories (--resume reuses finished runs)")
    ] = Path("runs/reproduction"),
    parts: Annotated[
        str, Opt(help="comma list of noise, central, federated, ablations, scaling")
    ] = PARTS_ALL,
    jobs: Annotated[int, Opt(help="centralized runs at a time (one torch thread each)")] = 2,
    quick: Annotated[
        bool, Opt(help="a minutes-long plan to try the command (too small to conclude)")
    ] = False,
    resume: ResumeRuns = False,
    overwrite: OverwriteRuns = False,
) -> None:
    """The RS paper's claims re-run (Fig. 1c, Table 2 / Fig. 4 best vs best, Fig. 3, App. H),
    beside the paper's numbers, with verdicts (lab/research/reproduction/). The committed report:
    docs/reproduction (about 2 hours on 2 cores). A runs-dir that holds runs is refused unless
    --resume (finished runs of the same inputs are reused) or --overwrite (start over)."""
    from fedsparse.lab.launch.run_dir import claim_runs
    from fedsparse.lab.research.reproduction.plan import PARTS, ReproductionPlan
    from fedsparse.lab.research.reproduction.report import reproduce_and_report

    chosen = [p.strip() for p in parts.split(",") if p.strip()]
    try:
        for part in chosen:
            choice("parts", part, PARTS)
        if jobs < 1:
            raise ValueError(f"jobs={jobs}: expected >= 1")
        claim_runs(runs_dir, resume=resume, overwrite=overwrite)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    plan = ReproductionPlan.quick() if quick else ReproductionPlan.full()
    command = f"fedsparse reproduce --out {out} --runs-dir {runs_dir} --jobs {jobs}"
    command += (" --quick" if quick else "") + (f" --parts {parts}" if parts != PARTS_ALL else "")
    result = reproduce_and_report(
        plan,
        out=out,
        runs_dir=runs_dir,
        parts=chosen,
        jobs=jobs,
        log=lambda line: console.print(line, markup=False, highlight=False),
        command=command,
    )
    console.print(f"[bold green]wrote {out / 'report.md'}[/]")
    if result.failures:  # the report lists them; a failed study is not a result
        console.print(f"[bold red]{len(result.failures)} studies failed[/]: see the report")
        raise typer.Exit(1)
