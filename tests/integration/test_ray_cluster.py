"""Ray clusters: attaching to one on purpose (``--ray-address``), never by accident.

Every test runs ``fedsparse`` as a child process with a private ``RAY_TMPDIR`` (short: Ray's
socket paths live under it), so a cluster address that one leaves in Ray's temp folder
(``ray_current_cluster``) reaches no other run. The two-node test starts a Ray head and a
second Ray node, each in a session of its own with its own CPU count and a custom resource
(the recipe of the platform notes), and stops each one by its process group (TERM, then
KILL): never ``ray stop``, which stops every Ray process on the machine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedsparse.common.wire.run_log import read_rounds

pytestmark = pytest.mark.slow

RAY = str(Path(sys.executable).with_name("ray"))
#: A small run: the embedded digits, the run's smallest useful settings.
QUICK = ["--set", "dataset=digits", "--set", "min-clients=2", "--set", "clients-per-round=0"]
#: Fields of a round's record that are times, not results.
TIMES = ("wall_seconds", "started_at", "ended_at")


@pytest.fixture
def ray_tmpdir() -> Iterator[Path]:
    """A private ``RAY_TMPDIR``, short enough for Ray's unix socket paths."""
    path = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _env(ray_tmpdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "FEDSPARSE_RAY_ADDRESS")}
    return {**env, "RAY_TMPDIR": str(ray_tmpdir), "PYTHONUNBUFFERED": "1"}


def _fedsparse(
    args: list[str], *, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """``fedsparse ARGS`` in a session of its own; killed with its group past ``timeout``."""
    process = subprocess.Popen(
        [sys.executable, "-m", "fedsparse.lab.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop_group(process)
        out, _ = process.communicate()
        pytest.fail(f"fedsparse {' '.join(args)} still ran after {timeout:g} s:\n{out[-3000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, out, "")


def _stop_group(process: subprocess.Popen[str]) -> None:
    """Stops ``process``'s process group: TERM, then KILL after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        # The leader ended; what else the group holds (raylet, workers) gets the same.
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return


def _records(out: Path) -> list[str]:
    """Each round's record as canonical JSON (floats exact), without its times."""
    return [
        json.dumps(
            {k: v for k, v in dataclasses.asdict(e).items() if k not in TIMES}, sort_keys=True
        )
        for e in read_rounds(out / "rounds.jsonl")
    ]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stale_cluster(ray_tmpdir: Path) -> None:
    """Leaves what ``ray start`` leaves: the address of a cluster, here one that is gone."""
    (ray_tmpdir / "ray").mkdir(parents=True, exist_ok=True)
    (ray_tmpdir / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{_free_port()}")


@pytest.mark.parametrize("backend", ["ray", "flower"])
def test_a_stale_cluster_address_does_not_hang_a_run(
    backend: str, ray_tmpdir: Path, tmp_path: Path
) -> None:
    _stale_cluster(ray_tmpdir)
    out = tmp_path / backend
    args = ["simulate", "--backend", backend, "--clients", "2", "--rounds", "1", *QUICK]
    done = _fedsparse([*args, "--out", str(out)], env=_env(ray_tmpdir), timeout=90)
    assert done.returncode == 0, done.stdout[-3000:]
    assert len(read_rounds(out / "rounds.jsonl")) == 1


def test_an_unreachable_ray_address_is_one_error_within_seconds(
    ray_tmpdir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    args = ["simulate", "--backend", "ray", "--clients", "2", "--rounds", "1", *QUICK]
    started = time.monotonic()
    done = _fedsparse(
        [*args, "--out", str(out), "--ray-address", "127.0.0.1:1"],
        env={**_env(ray_tmpdir), "COLUMNS": "400"},
        timeout=60,
    )
    assert time.monotonic() - started < 30
    assert done.returncode == 1
    errors = [line for line in done.stdout.splitlines() if "simulation failed" in line]
    assert len(errors) == 1 and "ray_address=127.0.0.1:1" in errors[0], done.stdout[-2000:]
    assert "Traceback" not in done.stdout
    # The environment names the address as well; the option wins over it.
    env = {**_env(ray_tmpdir), "FEDSPARSE_RAY_ADDRESS": "127.0.0.1:1", "COLUMNS": "400"}
    done = _fedsparse([*args, "--out", str(tmp_path / "env")], env=env, timeout=60)
    assert done.returncode == 1 and "ray_address=127.0.0.1:1" in done.stdout
    # ... and a cluster address needs the ray backend.
    done = _fedsparse(
        ["simulate", "--backend", "inprocess", "--ray-address", "auto", "--out", str(out)],
        env={**_env(ray_tmpdir), "COLUMNS": "400"},
        timeout=60,
    )
    assert done.returncode == 2 and "needs backend ray" in done.stdout


def _ray_node(args: list[str], *, env: dict[str, str], log: Path) -> subprocess.Popen[str]:
    """``ray start --block ARGS``: one Ray node in the foreground, in a session of its own."""
    with log.open("w") as sink:
        return subprocess.Popen(
            [RAY, "start", "--block", "--node-ip-address", "127.0.0.1", *args],
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )


_NODES_UP = """
import sys, time, ray
ray.init(address=sys.argv[1], log_to_driver=False)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) == 2 and {"hostA", "hostB"} <= set(ray.cluster_resources()):
        print("up", ray.cluster_resources())
        sys.exit(0)
    time.sleep(0.5)
sys.exit(1)
"""


@dataclasses.dataclass
class _Cluster:
    address: str
    head: subprocess.Popen[str]
    node: subprocess.Popen[str]


@pytest.fixture
def two_nodes(ray_tmpdir: Path, tmp_path: Path) -> Iterator[_Cluster]:
    """A Ray head (1 CPU, resource hostA) and a second node (1 CPU, hostB)."""
    port = _free_port()
    address = f"127.0.0.1:{port}"
    env = _env(ray_tmpdir)
    head = _ray_node(
        ["--head", "--port", str(port), "--num-cpus", "1", "--resources", '{"hostA": 1}']
        + ["--include-dashboard", "false"],
        env=env,
        log=tmp_path / "head.log",
    )
    nodes = [head]
    try:
        up = False
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and head.poll() is None:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    up = True
                    break
            time.sleep(0.5)
        assert up, (tmp_path / "head.log").read_text()[-2000:]
        nodes.append(
            _ray_node(
                ["--address", address, "--num-cpus", "1", "--resources", '{"hostB": 1}'],
                env=env,
                log=tmp_path / "node.log",
            )
        )
        check = subprocess.run(
            [sys.executable, "-c", _NODES_UP, address],
            env=env,
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert check.returncode == 0, (
            check.stdout + check.stderr + (tmp_path / "node.log").read_text()
        )[-3000:]
        yield _Cluster(address, head, nodes[1])
    finally:
        for node in reversed(nodes):
            _stop_group(node)


def test_a_simulation_on_a_two_node_cluster_equals_one_node(
    two_nodes: _Cluster, ray_tmpdir: Path, tmp_path: Path
) -> None:
    args = ["simulate", "--backend", "ray", "--clients", "100", "--rounds", "2", *QUICK]
    env = _env(ray_tmpdir)
    on_cluster = _fedsparse(
        [*args, "--out", str(tmp_path / "cluster"), "--ray-address", two_nodes.address],
        env=env,
        timeout=120,
    )
    assert on_cluster.returncode == 0, on_cluster.stdout[-3000:]
    # Its two workers (one CPU on each node) ran on both nodes, 50 clients each.
    assert "100 clients on 2 workers, 2 Ray nodes" in on_cluster.stdout, on_cluster.stdout
    # Without an address the run starts a Ray of its own, though `ray start` left the live
    # cluster's address in this RAY_TMPDIR.
    alone = _fedsparse([*args, "--out", str(tmp_path / "alone")], env=env, timeout=120)
    assert alone.returncode == 0, alone.stdout[-3000:]
    assert "1 Ray node)" in alone.stdout, alone.stdout
    records = _records(tmp_path / "cluster")
    assert len(records) == 2 and records == _records(tmp_path / "alone")


def test_losing_a_node_mid_run_costs_its_clients_not_the_run(
    two_nodes: _Cluster, ray_tmpdir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    # Rounds of some seconds each (8 local epochs), so the node is surely gone before the last
    # round however late this test sees round 1's record on a loaded machine.
    args = ["simulate", "--backend", "ray", "--clients", "20", "--rounds", "5", *QUICK]
    args += ["--set", "local-epochs=8", "--out", str(out), "--ray-address", two_nodes.address]
    process = subprocess.Popen(
        [sys.executable, "-m", "fedsparse.lab.cli", *args],
        env={**_env(ray_tmpdir), "COLUMNS": "200"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while process.poll() is None and time.monotonic() < deadline:
            rounds = out / "rounds.jsonl"
            if rounds.exists() and rounds.read_text().count("\n") >= 1:
                break
            time.sleep(0.1)
        # The second node crashes (KILL at once, raylet and worker together): a graceful TERM
        # lets its worker serve a round or two more while it shuts down.
        os.killpg(two_nodes.node.pid, signal.SIGKILL)
        stdout, _ = process.communicate(timeout=180)
    finally:
        _stop_group(process)
    assert process.returncode == 0, stdout[-3000:]
    clients = [entry.num_clients for entry in read_rounds(out / "rounds.jsonl")]
    # Round 1 had both workers' 10 clients each; the rounds after the loss the head's 10 alone.
    # The round under way when the node went may still have all 20: a Ray task already running
    # on the lost node's worker returns its result to the driver without that node's raylet.
    assert len(clients) == 5 and clients[0] == 20 and clients[-1] == 10, clients
    assert clients == sorted(clients, reverse=True) and set(clients) <= {10, 20}, clients
