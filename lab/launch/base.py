"""The launch skeleton shared by ``fedsparse simulate`` and ``fedsparse deploy``.

``run_simulation`` (``lab/launch/simulate.py``) and ``run_deployment`` (``lab/launch/deploy.py``)
go through
the same steps; the steps live here, and each launcher keeps only what differs (the SuperLink's
flags, the SuperNodes and relays or the simulation's federation config, the live table):

1. ``prepare_run``: validate the run config (and that its dataset's files are there) before
   anything starts, claim ``out`` (an earlier run there is refused unless resumed or
   overwritten: ``run_dir.claim``), create it, replace ``FLWR_HOME``, write the app bundle
   ``flwr run`` packs; ``read_summary`` takes only a ``summary.json`` written after
   ``PreparedRun.started``;
2. ``connect``: free loopback ports for the SuperLink, a private ``FLWR_HOME`` whose
   ``config.toml`` names the one SuperLink connection, the Flower processes' environment;
3. ``start_process``: the SuperLink (``superlink_args``) and any SuperNodes, each logging to a
   file in ``out``, waited on until it listens, stopped by PID however the run ends;
4. ``flwr_run``: ``flwr run <bundle> <connection> --run-config ... --stream``, polled by
   ``wait_for_exit`` against a deadline (and ``processes.request_stop``, a signal's stop);
5. ``read_summary``: ``summary.json`` as a ``RunSummary``, or an error with the logs' tails.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedsparse.common.atomic import SHARED, write_atomically
from fedsparse.common.config import METHOD_OPTIONS, FederatedConfig
from fedsparse.common.data.datasets import load_dataset
from fedsparse.common.data.readers import DatasetFormatError
from fedsparse.common.wire.run_log import FAILURE_FILE, RunSummary
from fedsparse.lab.launch.flower import (
    app_bundle_dir,
    flwr_env,
    format_run_config,
    tool,
    write_flwr_config,
)
from fedsparse.lab.launch.processes import (
    Process,
    check_running,
    free_port,
    managed_process,
    program,
    raise_if_stopping,
    wait_for_port,
    watch_run_dir,
)
from fedsparse.lab.launch.run_dir import claim, data_digest

__all__ = [
    "PORT_TIMEOUT",
    "RUN_OUTPUTS",
    "PreparedRun",
    "SuperLinkConnection",
    "connect",
    "describe_exit",
    "flwr_run",
    "log_tail",
    "log_tails",
    "prepare_run",
    "read_summary",
    "start_process",
    "superlink_args",
    "wait_for_exit",
]

#: What the ServerApp writes into ``out`` (and replaces when a new run starts).
RUN_OUTPUTS = ("rounds.jsonl", "summary.json", "checkpoint.pt")
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
    started: float  # ``time.time()`` when prepared: older files in ``out`` are an earlier run's
    data: str = ""  # the dataset's digest (``run_dir.data_digest``; "" unchecked)

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
    out: Path,
    overrides: Mapping[str, Any],
    *,
    check_data: bool = True,
    resume: bool = False,
    overwrite: bool = False,
    clients: tuple[str, int] | None = None,
    resumable: bool = True,
) -> PreparedRun:
    """Validates ``overrides`` (plus ``out-dir=<out>``), then readies ``out`` for a run.

    Nothing is created or removed when the run config is invalid. An ``out`` that holds a
    run is refused unless ``resume`` (continue it) or ``overwrite`` (its files are removed
    now, after the checks: ``run_dir.claim``).

    Args:
        out: the run directory (created; made absolute).
        overrides: run-config values (keys as in ``[tool.flwr.app.config]``).
        check_data: load the dataset once here, so that missing or corrupt files are a
            config error before any process starts (the ServerApp and every client load it).
        clients: (the option's name, the number of nodes the run will have): refused below
            ``min-clients``, where the run could never start.
        resumable: the command has a ``--resume`` (named in a refusal).

    Raises:
        ValueError: a bad run-config override (named key and value), a dataset whose files
            are missing or corrupt, an ``out`` that is not a directory, or one that holds a
            run (``RunFolderError``).
    """
    out = Path(out).resolve()
    requested = {**overrides, "out-dir": str(out)}
    config = FederatedConfig.from_run_config(requested)  # validate before starting anything
    if not overwrite:  # an occupied folder is refused before the data loads (seconds)
        claim(out, resume=resume, resumable=resumable)
    typed = {
        k: v
        for k, v in config.to_run_config().items()
        if k in requested or (k == METHOD_OPTIONS and v)  # a plug-in's keys, in their carrier
    }
    digest = ""
    if check_data:
        try:
            splits = load_dataset(
                config.dataset, data_dir=config.data_dir or None, seed=config.seed
            )
            digest = data_digest(*splits)
        except (OSError, DatasetFormatError, ValueError) as err:
            where = f"dataset={config.dataset!r}"
            if config.data_dir:
                where += f" data-dir={config.data_dir!r}"
            raise ValueError(f"{where}: {err}") from None
    if out.exists() and not out.is_dir():
        raise ValueError(f"out={out}: exists and is not a directory")
    if clients is not None and config.min_clients > clients[1]:
        name, count = clients
        raise ValueError(
            f"{name}={count}: below min-clients={config.min_clients}, the run could never "
            f"start (lower --set min-clients or add {name if name == 'nodes' else 'clients'})"
        )
    claim(out, resume=resume, overwrite=overwrite, resumable=resumable)  # last: nothing touched
    started = time.time()
    out.mkdir(parents=True, exist_ok=True)
    if not os.access(out, os.W_OK):
        raise ValueError(f"out={out}: not writable")
    shutil.rmtree(out / _FLWR_HOME, ignore_errors=True)
    watch_run_dir(out)  # a stop request now reaches this run's ServerApp first
    return PreparedRun(
        out=out,
        config=config,
        run_config=typed,
        app=app_bundle_dir(out),
        started=started,
        data=digest,
    )


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


def superlink_args(
    flags: Sequence[str], *, http_port: int, fleet_port: int, fleet_host: str = "127.0.0.1"
) -> list[str]:
    """``flower-superlink`` on 127.0.0.1: ``flags``, then the ports; no runtime installs.

    Args:
        fleet_host: the address the Fleet API (the SuperNodes' side) listens on; the Control
            and Runtime HTTP API stays on 127.0.0.1.
    """
    return [
        tool("flower-superlink"),
        *flags,
        "--host",
        "127.0.0.1",
        "--port",
        str(http_port),
        "--fleet-api-address",
        f"{fleet_host}:{fleet_port}",
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
    try:
        with (
            log.open("wb") as sink,
            managed_process(args, env=env, log=sink, cwd=cwd) as process,
        ):
            if pids is not None:
                pids.append(process.pid)
            for port in ports:
                wait_for_port(port, timeout=PORT_TIMEOUT, process=process)
            yield process
    finally:
        _strip_ansi_file(log)


#: An ANSI escape sequence: Flower's processes color their level names whatever their output.
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _strip_ansi_file(path: Path) -> None:
    """``path`` without ANSI escape sequences (a log file, once its process has exited)."""
    try:
        text = path.read_bytes()
    except OSError:
        return
    plain = _ANSI.sub("", text.decode(errors="surrogateescape")).encode(errors="surrogateescape")
    if plain != text:
        write_atomically(path, plain, mode=SHARED)


@contextmanager
def flwr_run(
    run: PreparedRun,
    connection: SuperLinkConnection,
    *extra: str,
    pids: list[int] | None = None,
    prefix: Sequence[str] = (),
) -> Iterator[Process]:
    """``flwr run <bundle> <connection> --run-config ... <extra> --stream``, into ``flwr.log``.

    Args:
        prefix: what runs the command (e.g. ``ip netns exec <namespace>``); default nothing.
    """
    args = [
        *prefix,
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
    expendable: Iterable[Process] = (),
    on_lost: Callable[[Process], None] | None = None,
    on_poll: Callable[[], None] | None = None,
    timeout_hint: str = "",
) -> int:
    """Polls ``process`` until it exits; returns its exit code.

    Args:
        timeout: seconds allowed.
        watch: processes the run cannot go on without (the SuperLink).
        expendable: processes the run survives losing (the SuperNodes: the ServerApp counts
            their missing replies); ``on_lost`` is called once for each that exits.
        on_poll: called at every poll, and once more after the exit (e.g. to show new rounds).
        timeout_hint: appended to the timeout's message.

    Raises:
        RuntimeError: a ``watch`` process exited first, or the timeout passed.
        KeyboardInterrupt: a stop was requested (``processes.request_stop``: a signal).
    """
    watched, spare = list(watch), list(expendable)
    lost: set[int] = set()
    deadline = time.monotonic() + timeout
    while True:
        returncode = process.poll()
        if on_poll is not None:
            on_poll()
        if returncode is not None:
            return returncode
        raise_if_stopping()
        check_running(watched)
        for node in spare:
            if node.pid not in lost and node.poll() is not None:
                lost.add(node.pid)
                if on_lost is not None:
                    on_lost(node)
        if time.monotonic() > deadline:
            raise RuntimeError(f"timeout={timeout:.0f} s reached{timeout_hint}")
        time.sleep(POLL_SECONDS)


def describe_exit(process: Process) -> str:
    """``"<program> (pid N) exited with code C"``, for logs of a lost process."""
    return f"{program(process)} (pid {process.pid}) exited with code {process.returncode}"


def read_summary(run: PreparedRun, returncode: int, *, logs: Callable[[], str]) -> RunSummary:
    """``summary.json`` of a finished run.

    Args:
        returncode: ``flwr run``'s exit code.
        logs: what to show of the logs if the run failed.

    Raises:
        RuntimeError: the run trained nothing or stopped at ``max-failed-rounds`` (the one
            line of its ``FAILURE_FILE``), ``flwr run`` failed, or it left no (or an
            unreadable) ``summary.json``.
    """
    failure = run.out / FAILURE_FILE
    if failure.exists() and failure.stat().st_mtime >= math.floor(run.started):
        raise RuntimeError(failure.read_text().strip())
    path = run.out / "summary.json"
    fresh = path.exists() and path.stat().st_mtime >= math.floor(run.started)  # coarse mtimes
    if returncode != 0 or not fresh:
        raise RuntimeError(
            f"flwr run exited with code {returncode} and "
            f"{'a' if fresh else 'no'} summary.json of this run:\n{logs()}"
        )
    try:
        return RunSummary.from_json(path.read_text())
    except ValueError as err:  # a summary of another schema is a failed run, not a bad option
        raise RuntimeError(f"{path}: {err}\n{logs()}") from err


def log_tail(path: Path, *, lines: int) -> str:
    """The last ``lines`` lines of the log at ``path``, without ANSI escape sequences."""
    text = _ANSI.sub("", path.read_text(errors="replace"))
    return "\n".join(text.splitlines()[-lines:])


def log_tails(paths: Iterable[Path], *, lines: int = 20) -> str:
    """The last ``lines`` lines of each log in ``paths`` that exists, each under its name."""
    return "\n".join(
        f"--- {path.name} ---\n{log_tail(path, lines=lines)}" for path in paths if path.exists()
    )
