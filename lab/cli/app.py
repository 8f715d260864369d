"""The ``fedsparse`` app: its options and its commands, registered here and written one
module per command (or small family) beside this one, as Flower's ``flwr/cli/app.py`` does.

Importing this loads typer and rich only: each command imports what it runs (torch, Flower,
Opacus, Ray) when it runs, so ``--help`` and usage errors answer at once.
"""

from __future__ import annotations

from typing import Annotated

import typer

from fedsparse.lab.cli.compose import compose, node
from fedsparse.lab.cli.deploy import deploy
from fedsparse.lab.cli.export import export
from fedsparse.lab.cli.reconstruct import reconstruct
from fedsparse.lab.cli.reproduce import reproduce
from fedsparse.lab.cli.simulate import demo, simulate
from fedsparse.lab.cli.sweep import sweep
from fedsparse.lab.cli.train import train
from fedsparse.lab.cli.utils import STATE, Opt, console
from fedsparse.lab.cli.wire import wire_report_command

__all__ = ["HELP", "app"]

#: ``fedsparse --help``'s text.
HELP = """The ``fedsparse`` command line.

``fedsparse simulate`` runs the federated app on Flower's simulation engine (Ray backend), or
with ``--backend ray`` on Ray workers that each hold many virtual clients
(``lab/simulation/raygrid.py``),
and writes ``rounds.jsonl`` and ``summary.json``; ``fedsparse demo`` is ``simulate`` on the
embedded digits; ``fedsparse train`` runs centralized DP-SGD with random sparsification (RS
paper, Algorithm 1) and writes ``epochs.jsonl`` and ``summary.json``.
"""

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    suggest_commands=False,  # click suggests already: once is enough
    help=HELP,
    pretty_exceptions_show_locals=False,  # locals can hold keys and data; --debug shows frames
)
app.command()(train)
app.command()(simulate)
app.command()(sweep)
app.command()(reproduce)
app.command()(reconstruct)
app.command()(demo)
app.command()(deploy)
app.command()(compose)
app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(node)
app.command("wire-report")(wire_report_command)
app.command()(export)


def _print_version(value: bool) -> None:
    if not value:
        return
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    parts = ", ".join(f"{name} {of(name)}" for name in ("flwr", "opacus", "torch"))
    console.print(f"fedsparse {of('fedsparse')} ({parts})")
    raise typer.Exit()


def _options(
    debug: Annotated[bool, Opt(help="show full tracebacks of errors")] = False,
    version: Annotated[
        bool,
        Opt(
            "--version",
            help="print the versions of fedsparse, Flower, Opacus and torch, and exit",
            callback=_print_version,
            is_eager=True,
        ),
    ] = False,
) -> None:
    """Options of every command."""
    STATE["debug"] = debug


app.callback()(_options)
