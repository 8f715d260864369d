"""Loopback deployments: a SuperLink and N SuperNodes as real processes, ``flwr run`` against them.

``run_deployment`` runs the app on a loopback *deployment*: a non-simulation SuperLink and N
``flower-supernode`` processes (partition ``i`` of N each), then ``flwr run <app> deploy
--stream``. ``deploy/`` and ``docker-compose.yml`` start the same commands in containers
(``deployment_args`` is what both mirror). By default each SuperNode reaches the SuperLink's
Fleet API through its own ``ByteRelay`` (``lab/launch/relay.py``), which counts the bytes on the
wire; ``run_deployment`` then writes ``wire.json`` (see ``lab/launch/wire.py``). With ``tls=True``
the SuperLink serves TLS with a throwaway CA (``<out>/certs``) and the relays count
ciphertext, TLS framing included. Every process started here is stopped by PID
(``lab/launch/processes.py``) however the run ends. The steps shared with ``fedsparse simulate``
(run directory, ``FLWR_HOME``, SuperLink, ``flwr run``, summary) are in ``lab/launch/base.py``.
"""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fedsparse.client.data import run_declaration, with_nominal_size
from fedsparse.client.node_data import NodeData, format_node_config
from fedsparse.common.config import FederatedConfig
from fedsparse.common.wire.run_log import RunSummary, read_rounds, record_command
from fedsparse.lab.launch.base import (
    PORT_TIMEOUT,
    SuperLinkConnection,
    connect,
    describe_exit,
    flwr_run,
    log_tails,
    prepare_run,
    read_summary,
    start_process,
    superlink_args,
    wait_for_exit,
)
from fedsparse.lab.launch.flower import fab_size, tool
from fedsparse.lab.launch.netns import NodeLink, shaped_links, shaping_unavailable, wait_for_port_in
from fedsparse.lab.launch.processes import Process, check_running, free_port, wait_for_port
from fedsparse.lab.launch.relay import ByteRelay
from fedsparse.lab.launch.tls import TlsFiles, generate_node_keys, generate_tls_files, security_args
from fedsparse.lab.launch.wire import capture_summary

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
    auth_keys: Sequence[Path] | None = None,
    ledger_dirs: Sequence[str] | None = None,
    superlink_hosts: Sequence[str] | None = None,
    data: Sequence[NodeData] | None = None,
    fleet_host: str = "127.0.0.1",
) -> tuple[list[str], list[list[str]]]:
    """``flower-superlink`` and ``fedsparse node`` argument lists for a loopback deployment.

    The SuperLink serves the Runtime and Control HTTP APIs on ``http_port`` and the gRPC
    (grpc-rere) Fleet API on ``fleet_port``; SuperNode ``i`` (``fedsparse node``:
    ``flower-supernode`` running only the node's own ClientApp, ``client/node.py``) serves its
    Runtime API on ``node_ports[i]`` and holds ``data[i]``. Everything listens on 127.0.0.1
    only, unless ``fleet_host`` moves the Fleet API. (SuperNodes install no runtime
    dependencies.)

    Args:
        superlink_ports: port SuperNode ``i`` dials for the Fleet API (a relay in front of
            ``fleet_port``); default ``fleet_port`` for all.
        tls: serve TLS with these files (SuperNodes trust its CA); default ``--insecure``.
        auth_keys: SuperNode authentication: the SuperLink admits only registered keys
            (``--enable-supernode-auth``) and node ``i`` signs with private key
            ``auth_keys[i]``; needs ``tls``. Default: no node authentication.
        superlink_hosts: the address SuperNode ``i`` dials (the host side of its shaped
            link); default 127.0.0.1 for all.
        ledger_dirs: SuperNode ``i``'s privacy-ledger directory (node config ``ledger-dir``);
            default: the node policy's own default.
        data: what SuperNode ``i`` declares it holds (``client/node_data.py``); default:
            partition ``i`` of ``num_nodes`` of digits. A declaration without a
            ``nominal-size`` gets its partitioning's largest part (``with_nominal_size``).
        fleet_host: the address the SuperLink's Fleet API listens on (another host's nodes
            dial it); the HTTP API that starts runs stays on 127.0.0.1.
    """
    targets = list(superlink_ports) if superlink_ports is not None else [fleet_port] * num_nodes
    if len(targets) != num_nodes:
        raise ValueError(f"superlink_ports has {len(targets)} ports: expected {num_nodes}")
    if auth_keys is not None and (tls is None or len(auth_keys) != num_nodes):
        raise ValueError(
            f"auth_keys: {len(auth_keys)} keys with tls={tls is not None}: expected "
            f"{num_nodes} keys and TLS (Flower refuses SuperNode authentication without TLS)"
        )
    hosts = list(superlink_hosts) if superlink_hosts is not None else ["127.0.0.1"] * num_nodes
    if len(hosts) != num_nodes:
        raise ValueError(f"superlink_hosts has {len(hosts)} addresses: expected {num_nodes}")
    declared = (
        list(data)
        if data is not None
        else [
            NodeData(dataset="digits", partition_id=i, num_partitions=num_nodes)
            for i in range(num_nodes)
        ]
    )
    if len(declared) != num_nodes:
        raise ValueError(f"data has {len(declared)} declarations: expected {num_nodes}")
    # The launcher owns every node: one without a nominal size declares the largest partition's.
    declared = [with_nominal_size(d) for d in declared]
    auth = ["--enable-supernode-auth"] if auth_keys is not None else []
    superlink = superlink_args(
        [*security_args(tls, server=True), *auth],
        http_port=http_port,
        fleet_port=fleet_port,
        fleet_host=fleet_host,
    )
    supernodes = [
        [
            tool("fedsparse"),
            "node",
            *security_args(tls, server=False),
            *(["--auth-supernode-private-key", str(auth_keys[i])] if auth_keys else []),
            "--superlink",
            f"{hosts[i]}:{targets[i]}",
            "--host",
            "127.0.0.1",
            "--port",
            str(node_ports[i]),
            "--node-config",
            format_node_config(
                declared[i], ledger_dir=None if ledger_dirs is None else ledger_dirs[i]
            ),
        ]
        for i in range(num_nodes)
    ]
    return superlink, supernodes


def _wait_for_traffic(
    relays: Sequence[ByteRelay], nodes: Sequence[Process], *, timeout: float
) -> None:
    """Waits until every relay has carried bytes both ways (its SuperNode is connected)."""
    deadline = time.monotonic() + timeout
    while not all(min(r.totals().values()) > 0 for r in relays):
        check_running(nodes)
        if time.monotonic() > deadline:
            raise RuntimeError(f"a SuperNode did not reach the SuperLink within {timeout:.0f} s")
        time.sleep(0.2)


def _measure_idle(
    relays: Sequence[ByteRelay], nodes: Sequence[Process], *, seconds: float
) -> tuple[float, float] | None:
    """Sleeps through the idle window (connected SuperNodes, no run yet); returns it."""
    if not relays or seconds <= 0:
        return None
    _wait_for_traffic(relays, nodes, timeout=60)
    time.sleep(IDLE_SETTLE_SECONDS)  # let registration and the first pull finish
    started = time.time()
    time.sleep(seconds)
    return started, time.time()


def _write_wire(
    out: Path,
    relays: Sequence[ByteRelay],
    idle: tuple[float, float] | None,
    *,
    tls: bool,
    fab_bytes: int | None,
    shaping: Mapping[str, Any] | None,
) -> None:
    capture = capture_summary(
        [relay.records() for relay in relays],
        read_rounds(out / "rounds.jsonl"),
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
    capture["shaping"] = dict(shaping) if shaping is not None else None
    (out / "wire.json").write_text(json.dumps(capture, indent=2) + "\n")


def _register_nodes(link: SuperLinkConnection, keys: Sequence[Path], *, log: Path) -> None:
    """``flwr supernode register <key>.pub`` for each key, through the Control API.

    Raises:
        RuntimeError: a registration failed (with ``flwr``'s output).
    """
    with log.open("a") as sink:
        for key in keys:
            result = subprocess.run(
                [tool("flwr"), "supernode", "register", f"{key}.pub", link.name],
                env=link.env,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            sink.write(result.stdout + result.stderr)
            if result.returncode != 0:
                raise RuntimeError(
                    f"flwr supernode register {key.name}.pub failed "
                    f"(code {result.returncode}):\n{result.stdout}{result.stderr}"
                )


class _NodeWatch:
    """Which SuperNodes the run lost, when: ``<out>/nodes.json``, and a note per loss."""

    def __init__(self, out: Path, nodes: Sequence[Process], on_event: Callable[[str], None]):
        self._path, self._nodes, self._on_event = out / "nodes.json", list(nodes), on_event
        self._lost: dict[int, float] = {}
        self._write()

    def lost(self, process: Process) -> None:
        index = self._nodes.index(process)
        self._lost[index] = time.time()
        self._on_event(
            f"SuperNode {index} lost: {describe_exit(process)}; the run goes on without it "
            "(its missing replies are counted per round in rounds.jsonl, num_missing)"
        )
        self._write()

    def _write(self) -> None:
        nodes = [
            {
                "partition": i,
                "pid": node.pid,
                "lost_at": self._lost.get(i),
                "returncode": node.returncode if i in self._lost else None,
            }
            for i, node in enumerate(self._nodes)
        ]
        self._path.write_text(json.dumps({"nodes": nodes}, indent=2) + "\n")


def run_deployment(
    *,
    out: Path,
    overrides: Mapping[str, Any],
    num_nodes: int,
    timeout: float = 600.0,
    pids: list[int] | None = None,
    relay: bool = True,
    idle_seconds: float = 6.0,
    tls: bool = True,
    node_auth: bool = True,
    uplink_bps: float | None = None,
    downlink_bps: float | None = None,
    on_event: Callable[[str], None] | None = None,
    command: str | None = None,
    overwrite: bool = False,
) -> RunSummary:
    """Runs the app on a loopback deployment; returns its ``summary.json``.

    Starts a non-simulation SuperLink and ``num_nodes`` SuperNodes on free 127.0.0.1 ports
    with a private ``FLWR_HOME`` (``<out>/.flwr``), submits the app with ``flwr run <app>
    deploy --stream`` and the run config ``overrides`` (plus ``out-dir=<out>``), and stops
    every process by PID, descendants included, however the run ends. Logs go to
    ``<out>/superlink.log``, ``<out>/supernode-<i>.log`` and ``<out>/flwr.log``.

    Secure by default: TLS with a throwaway CA (``<out>/certs``, keys 0600; the CA key is
    given to no process) and SuperNode authentication (a key pair per node in
    ``<out>/keys``, each public key registered with ``flwr supernode register`` before its
    node starts; the SuperLink admits no other node). ``tls=False`` (which needs
    ``node_auth=False``) is the explicit insecure opt-in.

    A SuperNode that dies costs its replies, not the run: the ServerApp closes each round
    when the SuperLink reports the node gone or at ``round-timeout``, counts the missing
    replies (``num_missing``), and goes on; ``<out>/nodes.json`` records which node was
    lost when, and ``on_event`` hears of it. Only the SuperLink's death ends the run.

    Shaped links (``uplink_bps``/``downlink_bps``, bit/s): each SuperNode runs in its own
    network namespace on a veth pair whose two ends are shaped with ``tbf``
    (``lab/launch/netns.py``:
    uplink on the node's end, downlink on the host's), and its relay listens on the host end;
    the SuperLink's certificate covers those addresses. Where namespaces are unavailable (not
    root, not Linux), the relays shape the bytes instead (a token bucket per direction and
    node) and ``wire.json``'s ``shaping.mode`` says ``relay-fallback`` with the reason; it is
    ``tbf`` otherwise. ``rounds.jsonl`` has each round's wall-clock time (``wall_seconds``),
    so time-to-accuracy under the limit is ``lab/experiments/timing.py:time_to_accuracy``.

    With ``relay`` (default), SuperNode ``i`` dials its own ``ByteRelay`` in front of the
    Fleet API; once every SuperNode is connected and before ``flwr run``, the idle polling
    traffic is measured for ``idle_seconds``; all relays are stopped with the processes and
    ``<out>/wire.json`` is written (``lab/launch/wire.py:capture_summary`` documents it). Only
    Fleet API traffic (SuperNode <-> SuperLink) goes through the relays; ``flwr`` and the
    ServerApp talk to the SuperLink directly. With TLS the relays count ciphertext, TLS
    framing included.

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
        tls: serve TLS (Fleet, Control and Runtime APIs); False: ``--insecure``.
        node_auth: SuperNode authentication (needs ``tls``).
        uplink_bps: shape each node's uplink (node -> SuperLink) to this rate (bit/s).
        downlink_bps: shape each node's downlink to this rate (bit/s).
        on_event: told (one line) of events the run survives, e.g. a lost SuperNode.
        command: the command line that started the run, recorded in ``summary.json`` (None:
            the Python API).
        overwrite: replace the run ``out`` holds (its files are removed first); without it,
            such an ``out`` is refused (``run_dir.claim``).

    Raises:
        ValueError: a bad run-config override, ``num_nodes``, ``idle_seconds`` or security
            combination, ``num_nodes`` below ``min-clients``, missing dataset files, an
            ``out`` that holds a run.
        RuntimeError: a process failed, the run timed out or left no ``summary.json``
            (with the tails of the logs).
    """
    if num_nodes < 1:
        raise ValueError(f"nodes={num_nodes}: expected >= 1")
    if not 0 <= idle_seconds < math.inf:
        raise ValueError(f"idle_seconds={idle_seconds}: expected a finite value >= 0")
    if node_auth and not tls:
        raise ValueError(
            "node_auth=True with tls=False: Flower authenticates SuperNodes only over TLS "
            "(use --insecure for neither)"
        )
    shaped = uplink_bps is not None or downlink_bps is not None
    if shaped and not relay:
        raise ValueError("uplink/downlink rates need relay=True (each node's link is its relay's)")
    # the nodes' declarations (and so their nominal sizes) before the folder is claimed
    declarations = [
        with_nominal_size(run_declaration(FederatedConfig.from_run_config(overrides), i, num_nodes))
        for i in range(num_nodes)
    ]
    run = prepare_run(
        out, overrides, overwrite=overwrite, clients=("nodes", num_nodes), resumable=False
    )
    shaping: dict[str, Any] | None = None
    if shaped:
        reason = shaping_unavailable()
        shaping = {
            "mode": "tbf" if reason is None else "relay-fallback",
            "uplink_bps": uplink_bps,
            "downlink_bps": downlink_bps,
            "reason": reason or "",
        }
        if reason is not None and on_event is not None:
            on_event(f"kernel shaping unavailable ({reason}): the relays shape the bytes instead")
    fab_bytes = fab_size(run.app) if relay else None  # the bundle `flwr run` builds from it
    node_ports = [free_port() for _ in range(num_nodes)]
    node_logs = [run.out / f"supernode-{i}.log" for i in range(num_nodes)]
    logs = [run.superlink_log, *node_logs, run.flwr_log]
    recorded = pids if pids is not None else []
    relays: list[ByteRelay] = []
    idle = None
    try:
        with contextlib.ExitStack() as stack:
            links: list[NodeLink] = []
            if shaping is not None and shaping["mode"] == "tbf":  # entered first: exits last
                links = stack.enter_context(
                    shaped_links(num_nodes, uplink_bps=uplink_bps, downlink_bps=downlink_bps)
                )
            addresses = [link.host_address for link in links]
            tls_files = generate_tls_files(run.out / "certs", addresses=addresses) if tls else None
            keys = generate_node_keys(run.out / "keys", num_nodes) if node_auth else None
            link = connect(
                run, name="deploy", root_certificates=tls_files.ca_cert if tls_files else None
            )
            fallback = shaping is not None and shaping["mode"] == "relay-fallback"
            relays = [
                stack.enter_context(
                    ByteRelay(
                        ("127.0.0.1", link.fleet_port),
                        listen_host=links[i].host_address if links else "127.0.0.1",
                        uplink_bps=uplink_bps if fallback else None,
                        downlink_bps=downlink_bps if fallback else None,
                    )
                )
                for i in range(num_nodes if relay else 0)
            ]
            superlink_command, supernode_commands = deployment_args(
                http_port=link.http_port,
                fleet_port=link.fleet_port,
                num_nodes=num_nodes,
                node_ports=node_ports,
                superlink_ports=[r.port for r in relays] if relays else None,
                superlink_hosts=addresses or None,
                tls=tls_files,
                auth_keys=keys,
                # Each node's own ledger, kept with the run: the nodes' budgets span this run.
                ledger_dirs=[str(run.out / "ledgers" / f"node-{i}") for i in range(num_nodes)],
                # The experimenter owns the nodes: they declare the run's own partitions.
                data=declarations,
            )
            if links:
                supernode_commands = [
                    node_link.command(args)
                    for node_link, args in zip(links, supernode_commands, strict=True)
                ]
            superlink = stack.enter_context(
                start_process(
                    superlink_command,
                    env=link.env,
                    log=run.superlink_log,
                    ports=[link.http_port, link.fleet_port],
                    pids=recorded,
                )
            )
            if keys is not None:
                _register_nodes(link, keys, log=run.out / "register.log")
            nodes = [
                stack.enter_context(start_process(args, env=link.env, log=log, pids=recorded))
                for args, log in zip(supernode_commands, node_logs, strict=True)
            ]
            for i, (node, port) in enumerate(zip(nodes, node_ports, strict=True)):
                if links:
                    wait_for_port_in(links[i], port, timeout=PORT_TIMEOUT, process=node)
                else:
                    wait_for_port(port, timeout=PORT_TIMEOUT, process=node)
            idle = _measure_idle(relays, nodes, seconds=idle_seconds)
            watch = _NodeWatch(run.out, nodes, on_event or (lambda line: None))
            flwr = stack.enter_context(flwr_run(run, link, pids=recorded))
            returncode = wait_for_exit(
                flwr, timeout=timeout, watch=[superlink], expendable=nodes, on_lost=watch.lost
            )
    except RuntimeError as error:
        if relays:  # what was captured up to the failure, best effort
            with contextlib.suppress(OSError, ValueError, KeyError):
                _write_wire(run.out, relays, idle, tls=tls, fab_bytes=fab_bytes, shaping=shaping)
        raise RuntimeError(f"{error}\n{log_tails(logs)}") from error
    if relays:  # stopped by now (LIFO: the processes first, then the relays)
        _write_wire(run.out, relays, idle, tls=tls, fab_bytes=fab_bytes, shaping=shaping)
    summary = read_summary(run, returncode, logs=lambda: log_tails(logs))
    return record_command(run.out / "summary.json", summary, command)
