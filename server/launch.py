"""Starting and stopping Flower processes on loopback, for ``fedsparse simulate`` and tests.

``fedsparse simulate`` runs the real Flower path: a simulation-mode ``flower-superlink``
(Ray backend, clients in subprocess isolation) that this module starts on free 127.0.0.1
ports with a private ``FLWR_HOME``, then ``flwr run <app> <connection> --stream`` against
it. Every process started here is stopped by PID (its whole process group) on exit.

``run_deployment`` runs the same app on a loopback *deployment*: a non-simulation SuperLink
and N ``flower-supernode`` processes (partition ``i`` of N each), then ``flwr run <app>
deploy --stream``. ``deploy/`` and ``docker-compose.yml`` start the same commands in containers.
By default each SuperNode reaches the SuperLink's Fleet API through its own ``ByteRelay``
(``server/relay.py``), which counts the bytes on the wire; ``run_deployment`` then writes
``wire.json`` (see ``server/wire.py``). With ``tls=True`` the SuperLink serves TLS with a
throwaway CA (``<out>/certs``) and the relays count ciphertext, TLS framing included.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from fedsparse.common.config import FederatedConfig
from fedsparse.server.relay import ByteRelay
from fedsparse.server.wire import capture_summary

__all__ = [
    "APP_DIR",
    "app_bundle_dir",
    "TlsFiles",
    "deployment_args",
    "generate_tls_files",
    "flwr_env",
    "format_run_config",
    "fab_size",
    "free_port",
    "managed_process",
    "run_deployment",
    "descendants",
    "stop_process",
    "tool",
    "wait_for_port",
    "write_flwr_config",
]

#: The Flower app directory (holds ``pyproject.toml`` with ``[tool.flwr.app]``).
APP_DIR = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
#: Seconds between the SuperNodes' first contact and the idle measurement.
IDLE_SETTLE_SECONDS = 1.0


def tool(name: str) -> str:
    """Path of a console script installed next to this Python (the venv's Flower)."""
    candidate = BIN / name
    return str(candidate) if candidate.exists() else (shutil.which(name) or name)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, *, timeout: float, process: subprocess.Popen | None = None) -> None:
    """Waits until 127.0.0.1:port accepts TCP connections.

    Raises:
        RuntimeError: if ``process`` exits first, or on timeout.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited with code {process.returncode}")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.settimeout(0.5)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"nothing listened on 127.0.0.1:{port} within {timeout:.0f} s")


def write_flwr_config(
    flwr_home: Path, *, name: str, control_port: int, root_certificates: Path | None = None
) -> None:
    """Writes ``$FLWR_HOME/config.toml`` with one SuperLink connection ``name``."""
    flwr_home.mkdir(parents=True, exist_ok=True)
    lines = [
        "[superlink]",
        f'default = "{name}"',
        "",
        f"[superlink.{name}]",
        f'address = "127.0.0.1:{control_port}"',
    ]
    if root_certificates is None:
        lines.append("insecure = true")
    else:
        lines.append(f'root-certificates = "{root_certificates}"')
    (flwr_home / "config.toml").write_text("\n".join(lines) + "\n")


def flwr_env(flwr_home: Path) -> dict[str, str]:
    """Environment for Flower processes: private FLWR_HOME, no update checks, no telemetry."""
    env = dict(os.environ)
    # Flower's processes spawn their helpers (flower-superexec, flwr-serverapp, ...) from PATH.
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(
        FLWR_HOME=str(flwr_home),
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def format_run_config(values: Mapping[str, Any]) -> list[str]:
    """``--run-config`` arguments, one ``key=value`` each, values in TOML syntax."""
    args = []
    for key, value in values.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, str):
            text = json.dumps(value)
        else:
            text = repr(value)
        args += ["--run-config", f"{key}={text}"]
    return args


def descendants(pid: int) -> list[int]:
    """PIDs of every live descendant of ``pid`` (Linux ``/proc``; empty elsewhere).

    Flower starts some helpers (``flower-superexec``) in new sessions, so a process-group
    kill does not reach them; stopping by PID walks the tree instead.
    """
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.parent.name))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _signal_all(pids: Sequence[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def stop_process(process: subprocess.Popen, *, grace: float = 10.0) -> None:
    """Stops ``process`` and all its descendants by PID: SIGTERM, then SIGKILL after ``grace``."""
    tree = descendants(process.pid)
    if process.poll() is None:
        _signal_all([process.pid], signal.SIGTERM)
    _signal_all(tree, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        alive = [p for p in tree if Path(f"/proc/{p}").exists() and not _is_zombie(p)]
        if process.poll() is not None and not alive:
            return
        time.sleep(0.2)
    _signal_all([p for p in [process.pid, *tree] if Path(f"/proc/{p}").exists()], signal.SIGKILL)
    process.wait(timeout=grace)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@contextmanager
def managed_process(
    args: Sequence[str], *, env: Mapping[str, str], log: IO[bytes], cwd: Path | None = None
) -> Iterator[subprocess.Popen]:
    """Starts ``args`` in its own process group; stops the group by PID on exit."""
    process = subprocess.Popen(
        list(args),
        env=dict(env),
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        yield process
    finally:
        stop_process(process)


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a throwaway CA and a SuperLink server certificate it signed."""

    ca_cert: Path
    server_cert: Path
    server_key: Path


def generate_tls_files(directory: Path, *, days: int = 2) -> TlsFiles:
    """Writes a throwaway CA and a server certificate for ``127.0.0.1``/``localhost``.

    For loopback tests only (unencrypted keys, short validity). Same recipe as
    ``deploy/certs/generate.sh``, which writes next to itself; this writes to ``directory``.

    Raises:
        RuntimeError: ``openssl`` is missing or failed (with its output).
    """
    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    files = TlsFiles(
        ca_cert=directory / "ca.crt",
        server_cert=directory / "server.pem",
        server_key=directory / "server.key",
    )
    ca_key, csr, ext = directory / "ca.key", directory / "server.csr", directory / "san.ext"
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    key = ["-newkey", "rsa:2048", "-sha256", "-nodes"]
    commands = [
        ["req", "-x509", *key, "-days", str(days), "-keyout", ca_key, "-out", files.ca_cert]
        + ["-subj", "/CN=fedsparse-test-ca"],
        ["req", *key, "-keyout", files.server_key, "-out", csr, "-subj", "/CN=localhost"],
        ["x509", "-req", "-in", csr, "-CA", files.ca_cert, "-CAkey", ca_key, "-CAcreateserial"]
        + ["-out", files.server_cert, "-days", str(days), "-sha256", "-extfile", ext],
    ]
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("tls=True needs the openssl command line tool")
    for command in commands:
        result = subprocess.run(
            [openssl, *map(str, command)], capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            raise RuntimeError(f"openssl {command[0]} failed:\n{result.stderr}")
    for leftover in (csr, ext, directory / "ca.srl"):
        leftover.unlink(missing_ok=True)
    return files


def _security_args(tls: TlsFiles | None, *, server: bool) -> list[str]:
    if tls is None:
        return ["--insecure"]
    if not server:
        return ["--root-certificates", str(tls.ca_cert)]
    return [
        "--ssl-ca-certfile",
        str(tls.ca_cert),
        "--ssl-certfile",
        str(tls.server_cert),
        "--ssl-keyfile",
        str(tls.server_key),
    ]


def deployment_args(
    *,
    http_port: int,
    fleet_port: int,
    num_nodes: int,
    node_ports: Sequence[int],
    superlink_ports: Sequence[int] | None = None,
    tls: TlsFiles | None = None,
) -> tuple[list[str], list[list[str]]]:
    """``flower-superlink`` and ``flower-supernode`` argument lists for a loopback deployment.

    The SuperLink serves the Runtime and Control HTTP APIs on ``http_port`` and the gRPC
    (grpc-rere) Fleet API on ``fleet_port``; SuperNode ``i`` serves its ClientAppIo (Runtime
    HTTP API) on ``node_ports[i]`` and holds partition ``i`` of ``num_nodes``. Everything
    listens on 127.0.0.1 only. (SuperNodes install no runtime dependencies unless asked.)

    Args:
        superlink_ports: port SuperNode ``i`` dials for the Fleet API (a relay in front of
            ``fleet_port``); default ``fleet_port`` for all.
        tls: serve TLS with these files (SuperNodes trust its CA); default ``--insecure``.
    """
    targets = list(superlink_ports) if superlink_ports is not None else [fleet_port] * num_nodes
    if len(targets) != num_nodes:
        raise ValueError(f"superlink_ports has {len(targets)} ports: expected {num_nodes}")
    superlink = [
        tool("flower-superlink"),
        *_security_args(tls, server=True),
        "--host",
        "127.0.0.1",
        "--port",
        str(http_port),
        "--fleet-api-address",
        f"127.0.0.1:{fleet_port}",
        "--disable-runtime-dependency-installation",
    ]
    supernodes = [
        [
            tool("flower-supernode"),
            *_security_args(tls, server=False),
            "--superlink",
            f"127.0.0.1:{targets[i]}",
            "--host",
            "127.0.0.1",
            "--port",
            str(node_ports[i]),
            "--node-config",
            f"partition-id={i} num-partitions={num_nodes}",
        ]
        for i in range(num_nodes)
    ]
    return superlink, supernodes


def _log_tails(paths: Sequence[Path], *, lines: int = 20) -> str:
    parts = []
    for path in paths:
        if path.exists():
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name} ---\n" + "\n".join(tail))
    return "\n".join(parts)


def _wait_for_traffic(
    relays: Sequence[ByteRelay], nodes: Sequence[subprocess.Popen], *, timeout: float
) -> None:
    """Waits until every relay has carried bytes both ways (its SuperNode is connected)."""
    deadline = time.monotonic() + timeout
    while not all(min(r.totals().values()) > 0 for r in relays):
        for node in nodes:
            if node.poll() is not None:
                raise RuntimeError(f"{node.args[0]} exited with code {node.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"a SuperNode did not reach the SuperLink within {timeout:.0f} s")
        time.sleep(0.2)


def _measure_idle(
    relays: Sequence[ByteRelay], nodes: Sequence[subprocess.Popen], *, seconds: float
) -> tuple[float, float] | None:
    """Sleeps through the idle window (connected SuperNodes, no run yet); returns it."""
    if not relays or seconds <= 0:
        return None
    _wait_for_traffic(relays, nodes, timeout=60)
    time.sleep(IDLE_SETTLE_SECONDS)  # let registration and the first pull finish
    started = time.time()
    time.sleep(seconds)
    return started, time.time()


def _read_rounds(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def app_bundle_dir(out: Path, app_dir: Path = APP_DIR) -> Path:
    """A directory holding only the app's ``pyproject.toml``, for ``flwr run`` to bundle.

    ``flwr run`` packs the app directory into the bundle (FAB) that every SuperNode downloads
    when a run starts; from the repository root that is every ``.py``/``.md``/``.toml`` file,
    tests and docs included (~300 KB, twice the digits model). The ServerApp and ClientApp
    import the installed ``fedsparse`` package, so the bundle needs the run config and the
    components from ``pyproject.toml`` only (~3 KB). Flower 1.39's ``fab-exclude`` cannot do
    this: with any user pattern it rejects our ``.gitignore``.
    """
    bundle = Path(out) / ".app"
    bundle.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(app_dir) / "pyproject.toml", bundle / "pyproject.toml")
    return bundle


def fab_size(app_dir: Path = APP_DIR) -> int | None:
    """Bytes of the app bundle (FAB) ``flwr run`` would build now, or None if it cannot.

    Each SuperNode downloads the FAB once, when it pulls the run's first message (round 1).
    """
    try:
        from flwr.cli.build import build_fab_from_disk

        with warnings.catch_warnings():  # pathspec deprecations, once per ignore pattern
            warnings.simplefilter("ignore", DeprecationWarning)
            return len(build_fab_from_disk(Path(app_dir)))
    except Exception:  # informational only: a Flower API change must not fail the run
        return None


def _write_wire(
    out: Path,
    relays: Sequence[ByteRelay],
    idle: tuple[float, float] | None,
    *,
    tls: bool,
    fab_bytes: int | None,
) -> None:
    capture = capture_summary(
        [relay.records() for relay in relays],
        _read_rounds(out / "rounds.jsonl"),
        idle=idle,
        capture=(
            min(r.started_at or 0.0 for r in relays),
            max(r.stopped_at or time.time() for r in relays),
        ),
        tls=tls,
        relays=[relay.address for relay in relays],
        connections=[relay.connection_count() for relay in relays],
        fab_bytes=fab_bytes,
    )
    (out / "wire.json").write_text(json.dumps(capture, indent=2) + "\n")


def run_deployment(
    *,
    out: Path,
    overrides: Mapping[str, Any],
    num_nodes: int,
    timeout: float = 600.0,
    pids: list[int] | None = None,
    relay: bool = True,
    idle_seconds: float = 6.0,
    tls: bool = False,
) -> dict:
    """Runs the app on a loopback deployment; returns ``summary.json``'s content.

    Starts a non-simulation SuperLink and ``num_nodes`` SuperNodes on free 127.0.0.1 ports
    with a private ``FLWR_HOME`` (``<out>/.flwr``), submits the app with ``flwr run <app>
    deploy --stream`` and the run config ``overrides`` (plus ``out-dir=<out>``), and stops
    every process by PID, descendants included, however the run ends. Logs go to
    ``<out>/superlink.log``, ``<out>/supernode-<i>.log`` and ``<out>/flwr.log``.

    With ``relay`` (default), SuperNode ``i`` dials its own ``ByteRelay`` in front of the
    Fleet API; once every SuperNode is connected and before ``flwr run``, the idle polling
    traffic is measured for ``idle_seconds``; all relays are stopped with the processes and
    ``<out>/wire.json`` is written (``server/wire.py:capture_summary`` documents it). Only
    Fleet API traffic (SuperNode <-> SuperLink) goes through the relays; ``flwr`` and the
    ServerApp talk to the SuperLink directly.

    Args:
        out: run directory (created); the ServerApp writes ``rounds.jsonl`` and
            ``summary.json`` there.
        overrides: run-config values (keys as in ``[tool.flwr.app.config]``).
        num_nodes: SuperNodes to start; node ``i`` holds partition ``i`` of ``num_nodes``.
        timeout: seconds allowed for ``flwr run``.
        pids: if given, the PID of every process started here is appended to it.
        relay: put a byte-counting relay between each SuperNode and the SuperLink.
        idle_seconds: length of the idle measurement (0: none); only with ``relay``. The
            SuperNodes poll every 3 s, so use a multiple of 3 for a fair rate.
        tls: serve TLS (Fleet, Control and Runtime APIs) with a throwaway CA written to
            ``<out>/certs``, instead of ``--insecure``.

    Raises:
        ValueError: a bad run-config override, ``num_nodes`` or ``idle_seconds``.
        RuntimeError: a process failed, the run timed out or left no ``summary.json``
            (with the tails of the logs).
    """
    if num_nodes < 1:
        raise ValueError(f"num_nodes={num_nodes}: expected >= 1")
    if not 0 <= idle_seconds < math.inf:
        raise ValueError(f"idle_seconds={idle_seconds}: expected a finite value >= 0")
    out = Path(out).resolve()
    run_config = {**overrides, "out-dir": str(out)}
    config = FederatedConfig.from_run_config(run_config)  # validate before starting anything
    typed = {k: v for k, v in config.to_run_config().items() if k in run_config}
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("rounds.jsonl", "summary.json", "wire.json"):
        (out / stale).unlink(missing_ok=True)
    flwr_home = out / ".flwr"
    shutil.rmtree(flwr_home, ignore_errors=True)
    tls_files = generate_tls_files(out / "certs") if tls else None
    app = app_bundle_dir(out)
    fab_bytes = fab_size(app) if relay else None  # the bundle `flwr run` builds from these files
    http, fleet = free_port(), free_port()
    node_ports = [free_port() for _ in range(num_nodes)]
    write_flwr_config(
        flwr_home,
        name="deploy",
        control_port=http,
        root_certificates=tls_files.ca_cert if tls_files else None,
    )
    env = flwr_env(flwr_home)
    run_args = [
        tool("flwr"),
        "run",
        str(app),
        "deploy",
        *format_run_config(typed),
        "--stream",
    ]
    logs = [out / "superlink.log", *(out / f"supernode-{i}.log" for i in range(num_nodes))]
    logs.append(out / "flwr.log")
    recorded = pids if pids is not None else []
    relays: list[ByteRelay] = []
    idle = None
    try:
        with contextlib.ExitStack() as stack:
            relays = [
                stack.enter_context(ByteRelay(("127.0.0.1", fleet)))
                for _ in range(num_nodes if relay else 0)
            ]
            superlink_args, supernode_args = deployment_args(
                http_port=http,
                fleet_port=fleet,
                num_nodes=num_nodes,
                node_ports=node_ports,
                superlink_ports=[r.port for r in relays] if relays else None,
                tls=tls_files,
            )
            link_log = stack.enter_context(logs[0].open("wb"))
            superlink = stack.enter_context(managed_process(superlink_args, env=env, log=link_log))
            recorded.append(superlink.pid)
            wait_for_port(http, timeout=60, process=superlink)
            wait_for_port(fleet, timeout=60, process=superlink)
            nodes = []
            for i, args in enumerate(supernode_args):
                node_log = stack.enter_context(logs[1 + i].open("wb"))
                nodes.append(stack.enter_context(managed_process(args, env=env, log=node_log)))
                recorded.append(nodes[-1].pid)
            for node, port in zip(nodes, node_ports, strict=True):
                wait_for_port(port, timeout=60, process=node)
            idle = _measure_idle(relays, nodes, seconds=idle_seconds)
            run_log = stack.enter_context(logs[-1].open("wb"))
            run = stack.enter_context(managed_process(run_args, env=env, log=run_log, cwd=app))
            recorded.append(run.pid)
            deadline = time.monotonic() + timeout
            while run.poll() is None:
                for process in (superlink, *nodes):
                    if process.poll() is not None:
                        raise RuntimeError(
                            f"{process.args[0]} exited with code {process.returncode}"
                        )
                if time.monotonic() > deadline:
                    raise RuntimeError(f"timeout={timeout:.0f} s reached")
                time.sleep(0.5)
    except RuntimeError as error:
        if relays:  # what was captured up to the failure, best effort
            with contextlib.suppress(OSError, ValueError, KeyError):
                _write_wire(out, relays, idle, tls=tls, fab_bytes=fab_bytes)
        raise RuntimeError(f"{error}\n{_log_tails(logs)}") from error
    if relays:  # stopped by now (LIFO: the processes first, then the relays)
        _write_wire(out, relays, idle, tls=tls, fab_bytes=fab_bytes)
    summary_path = out / "summary.json"
    if run.returncode != 0 or not summary_path.exists():
        raise RuntimeError(
            f"flwr run exited with code {run.returncode} and "
            f"{'no' if not summary_path.exists() else 'a'} summary.json:\n{_log_tails(logs)}"
        )
    return json.loads(summary_path.read_text())
