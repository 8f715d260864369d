"""``fedsparse simulate`` and ``fedsparse demo``: one federation on this machine.

The run itself is ``lab/launch/simulate.py:run_simulation`` (Flower's simulation engine, or
another backend of ``lab/launch/backends.py``: RayGrid with ``--backend ray``, this process
with ``--backend inprocess``, a loopback deployment with ``--backend deploy``); here are its
options, the checks that need no heavy import, and the closing line.
"""

from __future__ import annotations

import math
import shlex
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

from fedsparse.lab.cli.utils import (
    Opt,
    check_run_config,
    choice,
    console,
    parse_sets,
    removed_on_failed_start,
)
from fedsparse.lab.launch.backends import BACKEND_ALIASES, BACKEND_HELP, BACKENDS, backend_args

#: ``--ray-address``'s help (``fedsparse simulate`` and ``fedsparse sweep``).
RAY_ADDRESS_HELP = (
    "--backend ray or ray-population: run on an existing Ray cluster, auto or HOST:PORT (its head; "
    "default $FEDSPARSE_RAY_ADDRESS, else a local Ray of the run's own)"
)

__all__ = ["RAY_ADDRESS_HELP", "SHORTCUTS", "demo", "resume_command", "shortcuts", "simulate"]


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
    overwrite: Annotated[
        bool, Opt(help="replace the run OUT holds (its files are removed first)")
    ] = False,
    backend: Annotated[
        str, Opt(help=f"{BACKEND_HELP} | package.module:spec (a BackendSpec, in process)")
    ] = "flower",
    rounds: Annotated[int | None, Opt(help="rounds: --set num-rounds=N in short")] = None,
    seed: Annotated[int | None, Opt(help="base seed: --set seed=S in short")] = None,
    log: Annotated[
        str | None,
        Opt(help="tensorboard, mlflow or both: per-round metrics in OUT (--set log=...)"),
    ] = None,
    ray_address: Annotated[str | None, Opt(help=RAY_ADDRESS_HELP)] = None,
) -> None:
    """Federated DP-SGD + RS on Flower's simulation engine (Ray backend).

    --backend ray runs the same server loop and ClientApp on a local Ray cluster whose
    workers (one per CPU, or per --gpus-per-client share of a GPU) each hold many virtual
    clients and train a batch of them per Ray task: for 1000+ clients. With the same seeds
    and full participation it ends with the same model as --backend flower, bit for bit.
    --ray-address auto|HOST:PORT runs --backend ray on an existing Ray cluster (started with
    `ray start --head`; FEDSPARSE_RAY_ADDRESS alike); without it every backend starts a local
    Ray of its own, never one that an earlier `ray start` left behind.
    --backend inprocess runs the clients in this process (quick looks); --backend deploy on
    a loopback deployment (TLS, authenticated SuperNodes; no --resume, no GPUs).
    --backend population trains each round's clients together in this process (their DP-SGD
    steps vectorised, client/population.py; equal to the others to float32 rounding), and
    --backend ray-population does so on each Ray worker for its share of the clients.

    An OUT that holds a run (finished or not) is refused: --resume continues it, --overwrite
    replaces it (the old run's files, logs included, are removed first). With --resume, a
    run that was stopped (signal, crash, timeout) continues from its last checkpoint
    (OUT/checkpoint.pt, the nodes' states in OUT/node-state) and ends with the same model as
    the run that was never stopped; any other --set value, client count, data or plug-in
    code than it started with is refused, by name. A run stopped by Ctrl-C (or another
    signal) prints the command that resumes it.
    """
    overrides = parse_sets(set_ or [])
    try:
        overrides |= shortcuts(overrides, rounds=rounds, seed=seed, log=log)
        check_run_config(overrides)  # before the imports below: they take seconds
        check_trackers(overrides.get("log", ""))
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    from fedsparse.common.wire.run_log import command_line
    from fedsparse.lab.launch.simulate import run_simulation

    again = resume_command(
        out=out,
        clients=clients,
        sets=set_ or [],
        rounds=rounds,
        seed=seed,
        log=log,
        cpus_per_client=cpus_per_client,
        gpus_per_client=gpus_per_client,
        timeout=timeout,
        backend=backend,
        ray_address=ray_address,
    )
    try:
        with removed_on_failed_start(out), stop_hint(out, again, resume=resume):
            summary = run_simulation(
                out=out,
                overrides=overrides,
                clients=clients,
                cpus_per_client=cpus_per_client,
                gpus_per_client=gpus_per_client,
                timeout=timeout,
                console=console,
                resume=resume,
                backend=choice("backend", backend, BACKENDS, aliases=BACKEND_ALIASES, plugin=True),
                command=command_line(sys.argv),
                ray_address=ray_address,
                overwrite=overwrite,
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


def demo(
    out: Annotated[Path, Opt(help="output directory")] = Path("runs/demo"),
    overwrite: Annotated[
        bool, Opt(help="replace the run OUT holds (its files are removed first)")
    ] = False,
) -> None:
    """10 clients on the embedded digits: epsilon=3, gradual cooling to r*=0.7, 10 rounds."""
    simulate(
        out=out,
        overwrite=overwrite,
        clients=10,
        set_=None,
        cpus_per_client=1.0,
        gpus_per_client=0.0,
        timeout=3600.0,
        resume=False,
        backend="flower",
        rounds=None,
        seed=None,
        log=None,
        ray_address=None,
    )


#: ``simulate``'s shortcut options and the run-config key each one sets.
SHORTCUTS = {"rounds": "num-rounds", "seed": "seed", "log": "log"}


def shortcuts(overrides: Mapping[str, str], **values: int | str | None) -> dict[str, str]:
    """The run-config overrides of the shortcut options given (``SHORTCUTS``).

    Raises:
        ValueError: a shortcut whose key ``--set`` sets too (dashes or underscores alike).
    """
    given = {key.replace("_", "-"): (key, value) for key, value in overrides.items()}
    out = {}
    for option, value in values.items():
        if value is None:
            continue
        key = SHORTCUTS[option]
        if key in given:
            set_key, set_value = given[key]
            raise ValueError(
                f"--{option} {value}: --set {set_key}={set_value} sets {key} too; give one"
            )
        out[key] = str(value)
    return out


def resume_command(
    *,
    out: Path,
    clients: int,
    sets: Sequence[str],
    rounds: int | None,
    seed: int | None,
    cpus_per_client: float,
    log: str | None = None,
    gpus_per_client: float,
    timeout: float,
    backend: str,
    ray_address: str | None = None,
) -> str:
    """The ``fedsparse simulate ... --resume`` line that continues this run (options at their
    defaults left out)."""
    args = ["fedsparse", "simulate", "--out", str(out), "--clients", str(clients)]
    args += [a for item in sets for a in ("--set", item)]
    args += ["--rounds", str(rounds)] if rounds is not None else []
    args += ["--seed", str(seed)] if seed is not None else []
    args += ["--log", log] if log else []
    args += backend_args(backend)
    args += ["--cpus-per-client", f"{cpus_per_client:g}"] if cpus_per_client != 1.0 else []
    args += ["--gpus-per-client", f"{gpus_per_client:g}"] if gpus_per_client else []
    args += ["--timeout", f"{timeout:g}"] if timeout != 3600.0 else []
    args += ["--ray-address", ray_address] if ray_address else []
    return shlex.join([*args, "--resume"])


def check_trackers(log: str) -> None:
    """``log``'s trackers' packages installed (nothing imported; their names are
    ``check_run_config``'s).

    Raises:
        ValueError: a tracker whose package is missing (one line).
    """
    import importlib.util

    for name in (n.strip() for n in log.split(",") if n.strip()):
        if name in ("tensorboard", "mlflow") and importlib.util.find_spec(name) is None:
            raise ValueError(
                f"log={name}: the {name} package is not installed; install the tracking "
                "extra (pip install 'fedsparse[tracking]')"
            )


@contextmanager
def stop_hint(out: Path, command: str, *, resume: bool) -> Iterator[None]:
    """On a stop (Ctrl-C, a signal: ``KeyboardInterrupt``), prints how to go on: ``command``
    when ``out`` holds this run's checkpoint (written since the command started, or the one
    a ``--resume`` started from), else that there is nothing to resume yet."""
    started = math.floor(time.time())  # file times may be whole seconds
    try:
        yield
    except KeyboardInterrupt:
        checkpoint = out / "checkpoint.pt"
        if checkpoint.exists() and (resume or checkpoint.stat().st_mtime >= started):
            console.print(
                f"stopped; to continue from the last checkpoint: {command}",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
        else:
            console.print("stopped before the first checkpoint: nothing to resume", markup=False)
        raise
