"""Secure aggregation on a real loopback deployment: a SuperLink and three ``flower-supernode``
processes over TLS gRPC, each stage of the protocol (setup, key sharing, masked input, unmask)
a real message. The same run config in this process (``InProcessGrid``) gives the same bytes
per stage, the same payloads and the same user and central ε, and every node's masked input is
summed; every process the deployment started is stopped. Twice: over the complete graph in
the exact ring (three nodes), and over a sparse ring (SecAgg+, four nodes of two neighbours
each) in a 12-bit small ring, bit-packed."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from fedsparse.lab.launch.deploy import run_deployment
from fedsparse.lab.launch.processes import is_zombie
from fedsparse.lab.launch.simulate import run_simulation

pytestmark = pytest.mark.slow

NODES = 3
#: Distributed DP-FedAvg: every node every round (q = 1); each node checks its own noise share
#: against its policy's min-noise-multiplier (0.5, twice that on its share alone: central σ 4
#: over three nodes passes), then masks its ring input.
RUN_CONFIG = {
    "num-rounds": 1,
    "dataset": "digits",
    "dp-level": "user",
    "clients-per-round": NODES,
    "min-clients": NODES,
    "central-noise-multiplier": 4.0,
    "central-clip": 0.5,
    "secure-aggregation": "true",
    "final-rate": 0.9,
    "schedule": "constant",
    "lr": 0.5,
}
EXACT = ("num_replies", "num_accepted", "keep", "uplink_payload_bytes", "secagg_bytes")
#: name -> (nodes, run-config keys over RUN_CONFIG)
SHAPES = {
    "complete-exact": (NODES, {}),
    "sparse-small": (4, {"secagg-neighbours": 2, "secagg-ring-bits": 12}),
}


def _rounds(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module", params=list(SHAPES))
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    nodes, extra = SHAPES[request.param]
    config = {**RUN_CONFIG, "clients-per-round": nodes, "min-clients": nodes, **extra}
    base = tmp_path_factory.mktemp("secure-deployment")
    pids: list[int] = []
    deployed = run_deployment(
        out=base / "deploy",
        overrides=dict(config),
        num_nodes=nodes,
        timeout=300,
        pids=pids,
        idle_seconds=0,
    )
    simulated = run_simulation(
        out=base / "sim",
        overrides=dict(config),
        clients=nodes,
        timeout=300,
        backend="inprocess",
    )
    return {
        "deploy": deployed,
        "sim": simulated,
        "deploy_rounds": _rounds(base / "deploy"),
        "sim_rounds": _rounds(base / "sim"),
        "pids": pids,
        "nodes": nodes,
        "small": bool(extra),
    }


def test_every_stage_runs_as_messages_and_sums_every_node(runs: dict) -> None:
    (deployed,) = runs["deploy_rounds"]
    nodes = runs["nodes"]
    assert not deployed["failed"], deployed["failure"]
    assert deployed["num_accepted"] == nodes and deployed["num_missing"] == 0
    stages = deployed["secagg_bytes"]
    assert list(stages) == ["setup", "share_keys", "collect_masked_vectors", "unmask"]
    assert all(sizes["down"] > 0 and sizes["up"] > 0 for sizes in stages.values())
    # the survivors' shares give at least the configured central σ (each node adds its share
    # for the worst case: fewer survivors than all of them)
    assert deployed["central_noise_multiplier"] >= 4.0
    if runs["small"]:  # 12 bits a value, bit-packed, and a round id and nonce a reply
        masked = stages["collect_masked_vectors"]["up"]
        packed = nodes * math.ceil(deployed["keep"] * 12 / 8)
        assert packed < masked < packed + nodes * 200


def test_the_deployment_sends_what_the_simulation_sends(runs: dict) -> None:
    (deployed,), (simulated,) = runs["deploy_rounds"], runs["sim_rounds"]
    assert {k: deployed[k] for k in EXACT} == {k: simulated[k] for k in EXACT}
    for key in ("user_epsilon", "central_epsilon", "central_noise_multiplier"):
        assert deployed[key] == pytest.approx(simulated[key], rel=1e-12), key
    assert runs["deploy"].rounds == runs["sim"].rounds == 1


def test_no_process_left_alive(runs: dict) -> None:
    assert len(runs["pids"]) == runs["nodes"] + 2  # superlink, the supernodes, flwr run
    deadline = time.monotonic() + 10

    def alive(pid: int) -> bool:
        return Path(f"/proc/{pid}").exists() and not is_zombie(pid)

    while any(alive(pid) for pid in runs["pids"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [pid for pid in runs["pids"] if alive(pid)] == []
