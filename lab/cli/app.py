"""The ``fedsparse`` app: its options and its commands, registered here and written one
module per command (or small family) beside this one, as Flower's ``flwr/cli/app.py`` does.

Importing this loads typer and rich only: each command imports what it runs (torch, Flower,
Opacus, Ray) when it runs, so ``--help`` and usage errors answer at once.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Annotated, Any

import typer

from fedsparse.lab.cli.compose import compose, node
from fedsparse.lab.cli.deploy import deploy
from fedsparse.lab.cli.export import export
from fedsparse.lab.cli.frontier import frontier
from fedsparse.lab.cli.reconstruct import reconstruct
from fedsparse.lab.cli.reproduce import reproduce
from fedsparse.lab.cli.simulate import demo, simulate
from fedsparse.lab.cli.sweep import sweep
from fedsparse.lab.cli.train import train
from fedsparse.lab.cli.utils import STATE, Opt, console
from fedsparse.lab.cli.wire import wire_report_command

__all__ = ["HELP", "app", "help_text"]


def help_text(doc: str) -> str:
    """A docstring as ``--help`` shows it: RST's ``name`` as `name` (typer prints the double
    backticks as they are), and each paragraph's lines joined into one (typer keeps a
    paragraph's line breaks, which then fall mid-sentence once it rewraps the lines)."""
    paragraphs = inspect.cleandoc(doc).split("\n\n")
    joined = "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paragraphs)
    return re.sub(r"``(.+?)``", r"`\1`", joined)


#: ``fedsparse --help``'s text.
HELP = help_text(
    """The `fedsparse` command line.

    `fedsparse simulate` runs the federated app on Flower's simulation engine (Ray backend),
    or with `--backend ray` on Ray workers that each hold many virtual clients
    (`lab/simulation/raygrid.py`), and writes `rounds.jsonl` and `summary.json`;
    `fedsparse demo` is `simulate` on the embedded digits; `fedsparse train` runs centralized
    DP-SGD with random sparsification (RS paper, Algorithm 1) and writes `epochs.jsonl` and
    `summary.json`.
    """
)

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    suggest_commands=False,  # click suggests already: once is enough
    help=HELP,
    pretty_exceptions_show_locals=False,  # locals can hold keys and data; --debug shows frames
)


def _command(function: Callable[..., Any], name: str | None = None, **settings: Any) -> None:
    """Registers ``function`` as a command, its docstring as its help (``help_text``)."""
    app.command(name, help=help_text(inspect.getdoc(function) or ""), **settings)(function)


_command(train)
_command(simulate)
_command(sweep)
_command(frontier)
_command(reproduce)
_command(reconstruct)
_command(demo)
_command(deploy)
_command(compose)
_command(node, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
_command(wire_report_command, "wire-report")
_command(export)


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
