"""``fedsparse wire-report``: payload, message and wire bytes per round of a finished run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fedsparse.lab.cli.utils import console

__all__ = ["print_wire_report", "wire_report_command"]


def print_wire_report(run_dir: Path) -> None:
    """Prints ``run_dir``'s bytes per round and writes them to ``wire_report.csv``."""
    from fedsparse.lab.launch.wire import capture_lines, wire_report, wire_table, write_wire_csv

    rows = wire_report(run_dir)
    console.print(wire_table(rows, title=f"bytes per round: {run_dir}"))
    for line in capture_lines(run_dir):
        console.print(line)
    console.print(f"wrote {write_wire_csv(rows, run_dir / 'wire_report.csv')}")


def wire_report_command(
    run_dir: Annotated[Path, typer.Argument(help="run directory with rounds.jsonl")],
) -> None:
    """Payload, message and wire bytes per round (wire.json if captured); writes a CSV."""
    if not (run_dir / "rounds.jsonl").exists():
        raise typer.BadParameter(f"run_dir={run_dir}: no rounds.jsonl")
    print_wire_report(run_dir)
