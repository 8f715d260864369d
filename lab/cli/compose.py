"""``fedsparse compose`` and ``fedsparse node``: containers for a real deployment.

``compose`` writes the compose file (``lab/launch/compose.py``); ``node`` is the SuperNode a
container
runs, launching its own installed ClientApp (``client/node.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fedsparse.lab.cli.utils import Opt, choice, console

__all__ = ["compose", "node"]


def compose(
    out: Annotated[Path, Opt(help="compose file to write")] = Path("docker-compose.yml"),
    nodes: Annotated[int, Opt(help="SuperNodes (partition i of N each)")] = 3,
    overlay: Annotated[str | None, Opt(help="write an overlay instead: insecure | gpu")] = None,
    certs: Annotated[str, Opt(help="folder of deploy/certs/generate.sh's files")] = (
        "./deploy/certs"
    ),
    dataset: Annotated[str, Opt(help="the dataset the SuperNodes declare")] = "digits",
) -> None:
    """Writes the compose file for N SuperNodes (TLS + SuperNode auth), or an overlay."""
    from fedsparse.lab.launch.compose import Overlay, write_compose

    overlays: tuple[Overlay, ...] = ("insecure", "gpu")
    try:
        kind = None if overlay is None else choice("overlay", overlay, overlays)
        path = write_compose(out, nodes, overlay=kind, certs=certs, dataset=dataset)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    console.print(f"wrote {path} ({nodes} SuperNodes{f', {overlay} overlay' if overlay else ''})")


def node(ctx: typer.Context) -> None:
    """A SuperNode that runs only its own installed ClientApp, never the server's code.

    Takes flower-supernode's arguments (--superlink, --root-certificates,
    --auth-supernode-private-key, --node-config, --host/--port of the loopback Runtime API,
    ...) and runs flower-supernode --isolation process with them, launching every ClientApp
    task itself with the fedsparse installed here (client/node.py).
    """
    from fedsparse.client.node import run_node
    from fedsparse.lab.launch.flower import tool

    try:
        code = run_node(ctx.args, supernode=tool("flower-supernode"))
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    raise typer.Exit(code)
