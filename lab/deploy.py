"""Loopback deployments: a SuperLink and N SuperNodes as real processes, ``flwr run`` against them.

``run_deployment`` runs the app on a loopback *deployment*: a non-simulation SuperLink and N
``flower-supernode`` processes (partition ``i`` of N each), then ``flwr run <app> deploy
--stream``. ``deploy/`` and ``docker-compose.yml`` start the same commands in containers
(``deployment_args`` is what both mirror). By default each SuperNode reaches the SuperLink's
Fleet API through its own ``ByteRelay`` (``lab/relay.py``), which counts the bytes on the
wire; ``run_deployment`` then writes ``wire.json`` (see ``lab/wire.py``). With ``tls=True``
the SuperLink serves TLS with a throwaway CA (``<out>/certs``) and the relays count
ciphertext, TLS framing included. Every process started here is stopped by PID
(``lab/processes.py``) however the run ends.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedsparse.common.config import FederatedConfig
from fedsparse.lab.flower import (
    app_bundle_dir,
    fab_size,
    flwr_env,
    format_run_config,
    tool,
    write_flwr_config,
)
from fedsparse.lab.processes import free_port, managed_process, wait_for_port
from fedsparse.lab.relay import ByteRelay
from fedsparse.lab.tls import TlsFiles, generate_tls_files, security_args
from fedsparse.lab.wire import capture_summary

__all__ = ["deployment_args", "run_deployment"]

#: Seconds between the SuperNodes' first contact and the idle measurement.
IDLE_SETTLE_SECONDS = 1.0


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
        *security_args(tls, server=True),
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
            *security_args(tls, server=False),
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
    ``<out>/wire.json`` is written (``lab/wire.py:capture_summary`` documents it). Only
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
