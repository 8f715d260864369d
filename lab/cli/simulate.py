"""``fedsparse simulate`` and ``fedsparse demo``: one federation on this machine.

The run itself is ``lab/simulate.py:run_simulation`` (Flower's simulation engine, or RayGrid
with ``--backend ray``); here are its options, the checks that need no heavy import, and the
closing line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fedsparse.lab.cli.utils import (
    BACKEND_ALIASES,
    Opt,
    check_run_config,
    choice,
    console,
    parse_sets,
)

__all__ = ["demo", "simulate"]


def simulate(
    out: Annotated[Path, Opt(help="output directory")] = Path("runs/simulate"),
    clients: Annotated[int, Opt(help="number of virtual clients (SuperNodes)")] = 10,
    set_: Annotated[list[str] | None, Opt("--set", help="run-config override key=value")] = None,
    cpus_per_client: Annotated[float, Opt(help="Ray CPUs per virtual client")] = 1.0,
    gpus_per_client: Annotated[
        float, Opt(help="Ray GPUs per virtual client, fractional (0.25: 4 share a GPU)")
    ] = 0.0,
    timeout: Annotated[float, Opt(help="seconds before the run is stopped")] = 3600.0,
    resume: Annotated[
        bool, Opt(help="continue the run in OUT from its checkpoint (same --set values)")
    ] = False,
    backend: Annotated[
        str,
        Opt(help="flower (alias simulation): Flower's engine | ray: many clients per worker"),
    ] = "flower",
) -> None:
    """Federated DP-SGD + RS on Flower's simulation engine (Ray backend).

    --backend ray runs the same server loop and ClientApp on a local Ray cluster whose
    workers (one per CPU, or per --gpus-per-client share of a GPU) each hold many virtual
    clients and train a batch of them per Ray task: for 1000+ clients. With the same seeds
    and full participation it ends with the same model as --backend flower, bit for bit.

    With --resume, a run that was stopped (signal, crash, timeout) continues from its last
    checkpoint (OUT/checkpoint.pt, the nodes' states in OUT/node-state) and ends with the
    same model as the run that was never stopped; give it the same --set values.
    """
    overrides = parse_sets(set_ or [])
    try:
        check_run_config(overrides)  # before the imports below: they take seconds
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    from fedsparse.lab.simulate import ENGINES, run_simulation

    try:
        summary = run_simulation(
            out=out,
            overrides=overrides,
            clients=clients,
            cpus_per_client=cpus_per_client,
            gpus_per_client=gpus_per_client,
            timeout=timeout,
            console=console,
            resume=resume,
            backend=choice("backend", backend, ENGINES, aliases=BACKEND_ALIASES),
        )
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    except RuntimeError as err:
        console.print(f"[bold red]simulation failed:[/] {err}")
        raise typer.Exit(1) from err
    up, dense = summary.total_uplink_payload_bytes, summary.total_dense_uplink_bytes
    console.print(
        f"[bold green]final test accuracy {summary.final_test_accuracy:.4f}[/], "
        f"epsilon max {summary.epsilon_max:.3f} (median {summary.epsilon_median:.3f}) at "
        f"delta={summary.delta:g}\nuplink {up / 1e6:.3f} MB vs dense {dense / 1e6:.3f} MB "
        f"({summary.uplink_savings:.2f}x less); Flower messages "
        f"{summary.total_uplink_message_bytes / 1e6:.3f} MB; wrote {out / 'rounds.jsonl'}"
    )


def demo(out: Annotated[Path, Opt(help="output directory")] = Path("runs/demo")) -> None:
    """10 clients on the embedded digits: epsilon=3, gradual cooling to r*=0.7, 10 rounds."""
    simulate(
        out=out,
        clients=10,
        set_=None,
        cpus_per_client=1.0,
        gpus_per_client=0.0,
        timeout=3600.0,
        resume=False,
        backend="flower",
    )
