"""A deployment across two "hosts": the SuperLink in one network namespace, two SuperNodes in
another, over TLS with SuperNode authentication, set up by the README's own commands.

Host A and host B are network namespaces joined by one veth pair (``lab/launch/hosts.py``):
B reaches A only at A's address, and the machine's own namespace reaches neither. The test
follows deploy/README.md's "Across hosts" step by step, running each documented command as
written, on the host it belongs to (``ip netns exec``), from that host's own folder: host A
makes the CA and a server certificate naming its address; the CA certificate is copied to
host B (and its fingerprint compared); host B makes each node's key pair and hands over only
the public keys; host A registers them. The processes are the loopback deployment's
(``deployment_args``, with the Fleet API on A's address and the nodes dialing it), the same
commands the two-host compose files run (``tests/test_deploy_files.py``). Then ``flwr run``
on host A runs two rounds of digits, and the records show both nodes' replies in each round.
Everything started is stopped by PID, and both namespaces are deleted, however it ends.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

from fedsparse.client.data import run_declaration
from fedsparse.common.wire.run_log import read_rounds
from fedsparse.lab.launch.base import (
    PORT_TIMEOUT,
    connect,
    flwr_run,
    log_tails,
    prepare_run,
    read_summary,
    start_process,
    wait_for_exit,
)
from fedsparse.lab.launch.deploy import deployment_args
from fedsparse.lab.launch.flower import flwr_env
from fedsparse.lab.launch.hosts import NetnsHost, host_pair
from fedsparse.lab.launch.netns import shaping_unavailable, socket_in, wait_for_port_in
from fedsparse.lab.launch.processes import free_port, is_zombie
from fedsparse.lab.launch.tls import TlsFiles

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "deploy" / "README.md"
RUN_CONFIG = {
    "num-rounds": 2,
    "clients-per-round": 0,  # all nodes
    "min-clients": 2,
    "dataset": "digits",
    "final-rate": 0.5,
    "batch-size": 128,  # a quarter of the default's steps: the network is under test
}
NODE_NAMES = ("clinic-0", "clinic-1")
APP_UID = 49999  # the image's user `app`, who reads the keys in a container

# deploy/README.md, "Across hosts": each command as written there.
MAKE_CERTIFICATES = (
    'SUPERLINK_SAN="IP:$SUPERLINK_IP" deploy/certs/generate.sh deploy/certs 0',
    "openssl x509 -in deploy/certs/server.pem -noout -ext subjectAltName",
)
FINGERPRINT = "openssl x509 -in deploy/certs/ca.crt -noout -fingerprint -sha256"
MAKE_NODE_KEY = (
    "mkdir -p -m 700 deploy/certs/nodes",
    'ssh-keygen -q -t ecdsa -b 384 -N "" -C "$NODE_NAME" -f "deploy/certs/nodes/$NODE_NAME"',
    'chown 49999:49999 "deploy/certs/nodes/$NODE_NAME"',
)
REGISTER = 'flwr supernode register "received/$NODE_NAME.pub" docker'
LIST = "flwr supernode list docker"
DOCUMENTED = (*MAKE_CERTIFICATES, FINGERPRINT, *MAKE_NODE_KEY, REGISTER, LIST)


def test_the_readme_documents_every_command_run_here() -> None:
    text = README.read_text()
    section = text[text.index("\n## Across hosts\n") :]
    section = section[: section.index("\n## ", 1)]
    for command in DOCUMENTED:
        assert f"\n{command}\n" in section, command


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def test_host_pair_joins_two_namespaces_to_each_other_only() -> None:
    if (reason := shaping_unavailable()) is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    with pytest.raises(KeyboardInterrupt), host_pair() as (a, b):
        made = {a.namespace, b.namespace}
        assert made <= _namespaces() and a.address != b.address
        with socket_in(a.namespace) as server:
            server.bind((a.address, 0))
            server.listen()
            port = server.getsockname()[1]
            with socket_in(b.namespace) as client:  # B reaches A at A's address
                client.settimeout(5)
                assert client.connect_ex((a.address, port)) == 0
            with socket_in(b.namespace) as client:  # not on its own loopback
                assert client.connect_ex(("127.0.0.1", port)) != 0
            with socket.socket() as outside:  # and the machine's namespace reaches neither
                outside.settimeout(1)
                assert outside.connect_ex((a.address, port)) != 0
        raise KeyboardInterrupt  # deleted however the block ends
    assert not made & _namespaces()


def _sh(host: NetnsHost, command: str, *, cwd: Path, env: Mapping[str, str]) -> str:
    """``command`` in bash on ``host``, from ``cwd``; its output (it must succeed)."""
    result = subprocess.run(
        host.command(["bash", "-euo", "pipefail", "-c", command]),
        cwd=cwd,
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, f"{command}\n{result.stdout}{result.stderr}"
    return result.stdout


def _connections(host: NetnsHost, port: int) -> list[tuple[str, str]]:
    """(local, peer) addresses of the established TCP connections to ``port`` on ``host``."""
    output = subprocess.run(
        host.command(["ss", "-tnH", "state", "established"]),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    pairs = []
    for line in output.splitlines():
        local, peer = re.findall(r"(\S+):(\d+)", line)[-2:]
        if int(local[1]) == port:
            pairs.append((_ipv4(local[0]), _ipv4(peer[0])))
    return pairs


def _ipv4(text: str) -> str:
    """``10.0.0.1`` of ``10.0.0.1`` or ``[::ffff:10.0.0.1]`` (a dual-stack socket's view)."""
    address = ipaddress.ip_address(text.strip("[]"))
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


def _wait_online(host: NetnsHost, *, cwd: Path, env: Mapping[str, str], count: int) -> str:
    """``flwr supernode list`` on ``host`` until ``count`` nodes are online; its last table."""
    deadline = time.monotonic() + 60
    while True:
        table = _sh(host, LIST, cwd=cwd, env=env)
        if table.count("online") >= count or time.monotonic() > deadline:
            return table
        time.sleep(1)


@pytest.mark.slow
def test_superlink_and_supernodes_on_two_hosts(tmp_path: Path) -> None:
    if (reason := shaping_unavailable()) is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    for program in ("openssl", "ssh-keygen", "ss"):
        if shutil.which(program) is None:
            pytest.skip(f"{program} not found")
    home_a, home_b = tmp_path / "host-a", tmp_path / "host-b"  # each host's checkout
    (home_a / "deploy" / "certs").mkdir(parents=True)
    shutil.copy(ROOT / "deploy" / "certs" / "generate.sh", home_a / "deploy" / "certs")
    run = prepare_run(tmp_path / "run", RUN_CONFIG)
    certs_a, certs_b = home_a / "deploy" / "certs", home_b / "deploy" / "certs"
    link = connect(run, name="docker", root_certificates=certs_a / "ca.crt")
    logs = [run.superlink_log, *(run.out / f"{n}.log" for n in NODE_NAMES), run.flwr_log]
    pids: list[int] = []
    namespaces: tuple[str, str] = ("", "")
    with host_pair() as (a, b):
        namespaces = (a.namespace, b.namespace)
        try:
            with contextlib.ExitStack() as stack:
                # 1. Host A: the CA and a server certificate naming A's address.
                env_a = {**link.env, "SUPERLINK_IP": a.address}
                names = _sh(a, "\n".join(MAKE_CERTIFICATES), cwd=home_a, env=env_a)
                assert f"IP Address:{a.address}" in names
                # 2. The CA certificate to host B, the same on both.
                certs_b.mkdir(parents=True)
                shutil.copy(certs_a / "ca.crt", certs_b / "ca.crt")
                fingerprint = _sh(a, FINGERPRINT, cwd=home_a, env=env_a)
                assert fingerprint == _sh(b, FINGERPRINT, cwd=home_b, env=os.environ)
                # 4. Host B: a key pair per node; only the public keys go to host A.
                (home_a / "received").mkdir()
                keys = []
                for name in NODE_NAMES:
                    _sh(
                        b,
                        "\n".join(MAKE_NODE_KEY),
                        cwd=home_b,
                        env={**os.environ, "NODE_NAME": name},
                    )
                    key = certs_b / "nodes" / name
                    assert (key.stat().st_mode & 0o777, key.stat().st_uid) == (0o600, APP_UID)
                    shutil.copy(key.with_name(f"{name}.pub"), home_a / "received")
                    keys.append(key)
                on_a = {p.name for p in home_a.rglob("*")}
                assert not on_a & set(NODE_NAMES)  # no node's private key on host A
                assert not (certs_b / "ca").exists()  # nor the CA key on host B

                # 3. Host A: the SuperLink, its Fleet API on A's address only.
                tls = TlsFiles(
                    ca_cert=certs_a / "ca.crt",
                    server_cert=certs_a / "server.pem",
                    server_key=certs_a / "server.key",
                )
                node_ports = [free_port() for _ in NODE_NAMES]
                superlink_args, node_args = deployment_args(
                    http_port=link.http_port,
                    fleet_port=link.fleet_port,
                    num_nodes=len(NODE_NAMES),
                    node_ports=node_ports,
                    tls=tls,
                    auth_keys=keys,
                    fleet_host=a.address,
                    superlink_hosts=[a.address] * len(NODE_NAMES),
                    ledger_dirs=[str(run.out / "ledgers" / n) for n in NODE_NAMES],
                    data=[run_declaration(run.config, i, len(NODE_NAMES)) for i in range(2)],
                )
                # each node host trusts its own copy of the CA certificate
                node_args = [
                    [str(certs_b / "ca.crt") if arg == str(tls.ca_cert) else arg for arg in args]
                    for args in node_args
                ]
                assert all(str(certs_a) not in " ".join(args) for args in node_args)
                superlink = stack.enter_context(
                    start_process(
                        a.command(superlink_args), env=link.env, log=run.superlink_log, pids=pids
                    )
                )
                wait_for_port_in(a, link.http_port, timeout=PORT_TIMEOUT, process=superlink)
                wait_for_port_in(
                    a, link.fleet_port, timeout=PORT_TIMEOUT, process=superlink, host=a.address
                )
                # 5. Host A: register the public keys.
                for name in NODE_NAMES:
                    _sh(a, REGISTER, cwd=home_a, env={**link.env, "NODE_NAME": name})
                # 6. Host B: the SuperNodes, dialing A's address.
                env_b = flwr_env(home_b / ".flwr")
                nodes = [
                    stack.enter_context(
                        start_process(
                            b.command(args), env=env_b, log=run.out / f"{name}.log", pids=pids
                        )
                    )
                    for args, name in zip(node_args, NODE_NAMES, strict=True)
                ]
                for node, port in zip(nodes, node_ports, strict=True):
                    wait_for_port_in(b, port, timeout=PORT_TIMEOUT, process=node)
                # 7. Host A: both nodes online, then the run.
                table = _wait_online(a, cwd=home_a, env=link.env, count=len(NODE_NAMES))
                assert table.count("online") == len(NODE_NAMES), table

                # The nodes' connections crossed from B to A's address: the Fleet API is
                # not on A's loopback, and the machine's own namespace reaches neither host.
                crossing = _connections(a, link.fleet_port)
                assert len(crossing) >= len(NODE_NAMES), crossing
                assert set(crossing) == {(a.address, b.address)}, crossing
                with socket_in(a.namespace) as probe:
                    assert probe.connect_ex(("127.0.0.1", link.fleet_port)) != 0
                with socket.socket() as probe:
                    probe.settimeout(1)
                    assert probe.connect_ex((a.address, link.fleet_port)) != 0

                flwr = stack.enter_context(flwr_run(run, link, pids=pids, prefix=a.command([])))
                returncode = wait_for_exit(flwr, timeout=180, watch=[superlink, *nodes])
        except (RuntimeError, AssertionError) as error:
            raise AssertionError(f"{error}\n{log_tails(logs)}") from error
    summary = read_summary(run, returncode, logs=lambda: log_tails(logs))

    assert summary.rounds == 2
    rounds = read_rounds(run.out / "rounds.jsonl")
    assert [r.round for r in rounds] == [1, 2]
    for entry in rounds:  # both nodes answered, and both answers were aggregated
        assert (entry.num_clients, entry.num_replies, entry.num_rejected) == (2, 2, 0)
        assert not entry.failed and entry.uplink_payload_bytes > 0
    for name in NODE_NAMES:  # each node kept its own privacy ledger of what it released
        assert any((run.out / "ledgers" / name).iterdir()), name

    # nothing left: no process, no namespace
    assert len(pids) == 1 + len(NODE_NAMES) + 1
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or is_zombie(pid), pid
    assert not _namespaces() & set(namespaces)
