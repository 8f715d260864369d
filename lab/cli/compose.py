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
    out: Annotated[
        Path | None,
        Opt(help="compose file to write (docker-compose.yml; with --host, deploy/HOST-host.yml)"),
    ] = None,
    nodes: Annotated[int, Opt(help="SuperNodes (partition i of N each)")] = 3,
    overlay: Annotated[str | None, Opt(help="write an overlay instead: insecure | gpu")] = None,
    certs: Annotated[str, Opt(help="folder of deploy/certs/generate.sh's files")] = (
        "./deploy/certs"
    ),
    dataset: Annotated[str, Opt(help="the dataset the SuperNodes declare")] = "digits",
    host: Annotated[
        str | None,
        Opt(help="write one host's file of a deployment across machines: superlink | node"),
    ] = None,
) -> None:
    """Writes the compose file for N SuperNodes (TLS + SuperNode auth), an overlay, or the file
    of one host of a deployment across machines (deploy/README.md, "Across hosts")."""
    from fedsparse.lab.launch.compose import Overlay, write_compose
    from fedsparse.lab.launch.compose_hosts import HOST_FILES, Host, write_host_compose

    overlays: tuple[Overlay, ...] = ("insecure", "gpu")
    try:
        if host is not None:
            role: Host = choice("host", host, tuple(HOST_FILES))
            path = write_host_compose(out or Path(HOST_FILES[role]), role, dataset=dataset)
            console.print(f"wrote {path} ({host} host)")
            return
        kind = None if overlay is None else choice("overlay", overlay, overlays)
        path = write_compose(
            out or Path("docker-compose.yml"), nodes, overlay=kind, certs=certs, dataset=dataset
        )
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
    import os

    from fedsparse.client.node_policy import POLICY_ENV, check_node_config, node_config_text

    try:  # before the imports below (seconds): a bad policy or declaration fails at once
        check_node_config(node_config_text(ctx.args), os.environ.get(POLICY_ENV, ""))
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    from fedsparse.client.node import run_node
    from fedsparse.lab.launch.flower import tool

    try:
        code = run_node(ctx.args, supernode=tool("flower-supernode"))
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    raise typer.Exit(code)
