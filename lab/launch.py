"""The launch skeleton shared by ``fedsparse simulate`` and ``fedsparse deploy``.

``run_simulation`` (``lab/simulate.py``) and ``run_deployment`` (``lab/deploy.py``) go through
the same steps; the steps live here, and each launcher keeps only what differs (the SuperLink's
flags, the SuperNodes and relays or the simulation's federation config, the live table):

1. ``prepare_run``: validate the run config before anything starts, create ``out``, remove
   an earlier run's outputs and ``FLWR_HOME``, write the app bundle ``flwr run`` packs;
2. ``connect``: free loopback ports for the SuperLink, a private ``FLWR_HOME`` whose
   ``config.toml`` names the one SuperLink connection, the Flower processes' environment;
3. ``start_process``: the SuperLink (``superlink_args``) and any SuperNodes, each logging to a
   file in ``out``, waited on until it listens, stopped by PID however the run ends;
4. ``flwr_run``: ``flwr run <bundle> <connection> --run-config ... --stream``, polled by
   ``wait_for_exit`` against a deadline;
5. ``read_summary``: ``summary.json`` as a ``RunSummary``, or an error with the logs' tails.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedsparse.common.config import FederatedConfig
from fedsparse.common.records import RunSummary
from fedsparse.lab.flower import (
    app_bundle_dir,
    flwr_env,
    format_run_config,
    tool,
    write_flwr_config,
)
from fedsparse.lab.processes import (
    Process,
    check_running,
    free_port,
    managed_process,
    wait_for_port,
)

__all__ = [
    "PORT_TIMEOUT",
    "RUN_OUTPUTS",
    "PreparedRun",
    "SuperLinkConnection",
    "connect",
    "flwr_run",
    "log_tail",
    "log_tails",
    "prepare_run",
    "read_summary",
    "start_process",
    "superlink_args",
    "wait_for_exit",
]

#: What the ServerApp writes into ``out``; removed first, so that an earlier run's file is
#: never taken for this run's.
RUN_OUTPUTS = ("rounds.jsonl", "summary.json")
#: The run's private ``FLWR_HOME``, inside ``out``.
_FLWR_HOME = ".flwr"
#: Seconds a started Flower process gets to listen on its ports.
PORT_TIMEOUT = 60.0
#: Seconds between two polls of a running ``flwr run``.
POLL_SECONDS = 0.5


@dataclass(frozen=True, kw_only=True)
class PreparedRun:
    """A validated run config and its output directory, ready for Flower processes."""

    out: Path  # absolute
    config: FederatedConfig
    run_config: dict[str, Any]  # the overrides, typed, and ``out-dir``: ``flwr run``'s values
    app: Path  # the directory ``flwr run`` bundles (``flower.app_bundle_dir``)

    @property
    def flwr_home(self) -> Path:
        """The run's private ``FLWR_HOME``."""
        return self.out / _FLWR_HOME

    @property
    def superlink_log(self) -> Path:
        """The SuperLink's output."""
        return self.out / "superlink.log"

    @property
    def flwr_log(self) -> Path:
        """``flwr run``'s output (the streamed ServerApp log)."""
        return self.out / "flwr.log"


def prepare_run(
    out: Path, overrides: Mapping[str, Any], *, stale: Iterable[str] = RUN_OUTPUTS
) -> PreparedRun:
    """Validates ``overrides`` (plus ``out-dir=<out>``), then cleans ``out`` for a new run.

    Nothing is created or removed when the run config is invalid.

    Args:
        out: the run directory (created; made absolute).
        overrides: run-config values (keys as in ``[tool.flwr.app.config]``).
        stale: files in ``out`` an earlier run left that this run writes anew.

    Raises:
        ValueError: a bad run-config override (named key and value).
    """
    out = Path(out).resolve()
    requested = {**overrides, "out-dir": str(out)}
    config = FederatedConfig.from_run_config(requested)  # validate before starting anything
    typed = {k: v for k, v in config.to_run_config().items() if k in requested}
    out.mkdir(parents=True, exist_ok=True)
    for name in stale:
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / _FLWR_HOME, ignore_errors=True)
    return PreparedRun(out=out, config=config, run_config=typed, app=app_bundle_dir(out))


@dataclass(frozen=True, kw_only=True)
class SuperLinkConnection:
    """How ``flwr`` and the SuperNodes reach the SuperLink, and the Flower processes' env."""

    name: str  # the connection in ``$FLWR_HOME/config.toml``: ``flwr run``'s second argument
    http_port: int  # Runtime and Control HTTP APIs
    fleet_port: int  # Fleet API (grpc-rere)
    env: dict[str, str]


def connect(
    run: PreparedRun, *, name: str, root_certificates: Path | None = None
) -> SuperLinkConnection:
    """Picks free loopback ports and writes ``run``'s ``FLWR_HOME`` to reach them as ``name``.

    Args:
        root_certificates: the CA ``flwr`` trusts (TLS); default an insecure connection.
    """
    http, fleet = free_port(), free_port()  # the Control API shares the Runtime HTTP port
    write_flwr_config(
        run.flwr_home, name=name, control_port=http, root_certificates=root_certificates
    )
    return SuperLinkConnection(
        name=name, http_port=http, fleet_port=fleet, env=flwr_env(run.flwr_home)
    )


def superlink_args(flags: Sequence[str], *, http_port: int, fleet_port: int) -> list[str]:
    """``flower-superlink`` on 127.0.0.1: ``flags``, then the ports; no runtime installs."""
    return [
        tool("flower-superlink"),
        *flags,
        "--host",
        "127.0.0.1",
        "--port",
        str(http_port),
        "--fleet-api-address",
        f"127.0.0.1:{fleet_port}",
        "--disable-runtime-dependency-installation",
    ]


@contextmanager
def start_process(
    args: Sequence[str],
    *,
    env: Mapping[str, str],
    log: Path,
    cwd: Path | None = None,
    ports: Sequence[int] = (),
    pids: list[int] | None = None,
) -> Iterator[Process]:
    """Starts ``args`` with its output in ``log``; stops it (by PID, tree included) on exit.

    Args:
        ports: loopback ports to wait for (``PORT_TIMEOUT`` each) before yielding.
        pids: if given, the process's PID is appended to it.

    Raises:
        RuntimeError: the process exited, or a port stayed closed, before it listened.
    """
    with log.open("wb") as sink, managed_process(args, env=env, log=sink, cwd=cwd) as process:
        if pids is not None:
            pids.append(process.pid)
        for port in ports:
            wait_for_port(port, timeout=PORT_TIMEOUT, process=process)
        yield process


@contextmanager
def flwr_run(
    run: PreparedRun,
    connection: SuperLinkConnection,
    *extra: str,
    pids: list[int] | None = None,
) -> Iterator[Process]:
    """``flwr run <bundle> <connection> --run-config ... <extra> --stream``, into ``flwr.log``."""
    args = [
        tool("flwr"),
        "run",
        str(run.app),
        connection.name,
        *format_run_config(run.run_config),
        *extra,
        "--stream",
    ]
    with start_process(
        args, env=connection.env, log=run.flwr_log, cwd=run.app, pids=pids
    ) as process:
        yield process


def wait_for_exit(
    process: Process,
    *,
    timeout: float,
    watch: Iterable[Process] = (),
    on_poll: Callable[[], None] | None = None,
    timeout_hint: str = "",
) -> int:
    """Polls ``process`` until it exits; returns its exit code.

    Args:
        timeout: seconds allowed.
        watch: processes that must keep running meanwhile (the SuperLink, the SuperNodes).
        on_poll: called at every poll, and once more after the exit (e.g. to show new rounds).
        timeout_hint: appended to the timeout's message.

    Raises:
        RuntimeError: a ``watch`` process exited first, or the timeout passed.
    """
    watched = list(watch)
    deadline = time.monotonic() + timeout
    while True:
        returncode = process.poll()
        if on_poll is not None:
            on_poll()
        if returncode is not None:
            return returncode
        check_running(watched)
        if time.monotonic() > deadline:
            raise RuntimeError(f"timeout={timeout:.0f} s reached{timeout_hint}")
        time.sleep(POLL_SECONDS)


def read_summary(run: PreparedRun, returncode: int, *, logs: Callable[[], str]) -> RunSummary:
    """``summary.json`` of a finished run.

    Args:
        returncode: ``flwr run``'s exit code.
        logs: what to show of the logs if the run failed.

    Raises:
        RuntimeError: ``flwr run`` failed, or left no (or an unreadable) ``summary.json``.
    """
    path = run.out / "summary.json"
    if returncode != 0 or not path.exists():
        raise RuntimeError(
            f"flwr run exited with code {returncode} and "
            f"{'no' if not path.exists() else 'a'} summary.json:\n{logs()}"
        )
    try:
        return RunSummary.from_json(path.read_text())
    except ValueError as err:  # a summary of another schema is a failed run, not a bad option
        raise RuntimeError(f"{path}: {err}\n{logs()}") from err


def log_tail(path: Path, *, lines: int) -> str:
    """The last ``lines`` lines of the log at ``path``."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def log_tails(paths: Iterable[Path], *, lines: int = 20) -> str:
    """The last ``lines`` lines of each log in ``paths`` that exists, each under its name."""
    return "\n".join(
        f"--- {path.name} ---\n{log_tail(path, lines=lines)}" for path in paths if path.exists()
    )
