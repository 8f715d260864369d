"""``fedsparse deploy``: a loopback deployment with on-the-wire byte counts, and its report.

The deployment is ``lab/launch/deploy.py:run_deployment``; afterwards the bytes per round
(``wire-report``'s table) and the time to each accuracy are printed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from fedsparse.lab.cli.utils import (
    Opt,
    check_run_config,
    console,
    parse_sets,
    rate,
    removed_on_failed_start,
)
from fedsparse.lab.cli.wire import print_wire_report

__all__ = ["ACCURACY_TARGETS", "deploy"]


def deploy(
    out: Annotated[Path, Opt(help="output directory")] = Path("runs/deploy"),
    nodes: Annotated[int, Opt(help="flower-supernode processes")] = 2,
    set_: Annotated[list[str] | None, Opt("--set", help="run-config override key=value")] = None,
    insecure: Annotated[
        bool, Opt(help="no TLS and no SuperNode authentication (explicit opt-in)")
    ] = False,
    node_auth: Annotated[
        bool, Opt(help="SuperNode authentication: registered keys only (needs TLS)")
    ] = True,
    tls: Annotated[
        bool, Opt("--tls", hidden=True, help="TLS (the default now; kept for old commands)")
    ] = True,
    uplink_rate: Annotated[
        str | None, Opt(help="shape each node's uplink, e.g. 1mbit, 500kbit, 2000000 (bit/s)")
    ] = None,
    downlink_rate: Annotated[str | None, Opt(help="shape each node's downlink, e.g. 8mbit")] = None,
    idle_seconds: Annotated[float, Opt(help="idle polling measurement before the run")] = 6.0,
    timeout: Annotated[float, Opt(help="seconds before the run is stopped")] = 3600.0,
    overwrite: Annotated[
        bool, Opt(help="replace the run OUT holds (its files are removed first)")
    ] = False,
) -> None:
    """Loopback deployment (SuperLink + SuperNodes over gRPC) with on-the-wire byte counts.

    Secure by default: TLS with a throwaway CA and SuperNode authentication (a registered key
    per node). A SuperNode that dies costs its replies, not the run. With --uplink-rate or
    --downlink-rate each node sits in its own network namespace behind a tbf-shaped veth pair
    (root; else the byte relays shape, labelled) and the time to each accuracy is reported.
    """
    overrides = parse_sets(set_ or [])
    try:
        check_run_config(overrides)  # before the import below: it takes seconds
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    from fedsparse.common.wire.run_log import command_line
    from fedsparse.lab.launch.deploy import run_deployment

    try:
        up, down = rate("uplink-rate", uplink_rate), rate("downlink-rate", downlink_rate)
        with removed_on_failed_start(out):
            run_deployment(
                out=out,
                overrides=overrides,
                num_nodes=nodes,
                timeout=timeout,
                tls=not insecure,
                node_auth=node_auth and not insecure,
                idle_seconds=idle_seconds,
                uplink_bps=up,
                downlink_bps=down,
                on_event=lambda line: console.print(f"[yellow]{line}[/]"),
                command=command_line(sys.argv),
                overwrite=overwrite,
            )
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    except RuntimeError as err:
        console.print(f"[bold red]deployment failed:[/] {err}")
        raise typer.Exit(1) from err
    print_wire_report(out)
    _print_time_to_accuracy(out)


#: Accuracies whose time-to-accuracy ``deploy`` prints (those the run reached).
ACCURACY_TARGETS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


def _print_time_to_accuracy(run_dir: Path) -> None:
    from fedsparse.common.wire.run_log import read_rounds
    from fedsparse.lab.experiments.timing import time_to_accuracy

    rounds = read_rounds(run_dir / "rounds.jsonl")
    wire = run_dir / "wire.json"
    shaping = json.loads(wire.read_text()).get("shaping") if wire.exists() else None
    link = "unshaped loopback"
    if shaping:
        rates = [
            f"{name} {shaping[f'{name}_bps'] / 1e6:g} Mbit/s"
            for name in ("uplink", "downlink")
            if shaping.get(f"{name}_bps")
        ]
        link = f"{', '.join(rates)} per node ({shaping['mode']})"
    reached = [
        f"{target:.2f} in {seconds:.1f} s"
        for target in ACCURACY_TARGETS
        if (seconds := time_to_accuracy(rounds, target)) is not None
    ]
    per_round = ", ".join(f"{r.wall_seconds:.1f}" for r in rounds)
    console.print(
        f"time to accuracy ({link}; round wall-clock, rounds.jsonl wall_seconds): "
        f"{'; '.join(reached) or 'no target reached'}; seconds per round: {per_round}"
    )
