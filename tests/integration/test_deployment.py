"""Loopback deployment == simulation: the same run config, the same bytes per round.

Runs the app twice with one run config: on Flower's simulation engine
(``run_simulation``, 2 virtual SuperNodes) and on a real loopback deployment
(``run_deployment``: a non-simulation SuperLink and 2 ``flower-supernode`` processes talking
gRPC). Payload sizes are deterministic functions of ``d``, ``keep``, the round and the seeds,
so they must agree exactly; Flower message sizes carry node/run ids and metadata, so they may
differ by a few bytes; accuracy depends on which node holds which partition, so it is only
checked loosely.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fedsparse.common.wire.run_log import RunSummary
from fedsparse.lab.launch.deploy import run_deployment
from fedsparse.lab.launch.processes import is_zombie
from fedsparse.lab.launch.simulate import run_simulation

pytestmark = pytest.mark.slow

RUN_CONFIG = {
    "num-rounds": 2,
    "clients-per-round": 0,  # all nodes
    "min-clients": 2,
    "dataset": "digits",
    "final-rate": 0.5,
}
EXACT = ("round", "num_replies", "keep", "uplink_payload_bytes", "downlink_payload_bytes")


def _rounds(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists() and not is_zombie(pid)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("deployment")
    pids: list[int] = []

    def timed(function: Callable[[], RunSummary]) -> tuple[RunSummary, float]:
        start = time.monotonic()
        return function(), time.monotonic() - start

    # Side by side: the deployment spends most of its time in Flower's polls (idle CPU), so the
    # simulation's start-up overlaps them. No idle measurement: nothing here reads it.
    with ThreadPoolExecutor(max_workers=2) as pool:
        deploying = pool.submit(
            timed,
            lambda: run_deployment(
                out=base / "deploy",
                overrides=RUN_CONFIG,
                num_nodes=2,
                timeout=240,
                pids=pids,
                idle_seconds=0,
            ),
        )
        simulating = pool.submit(
            timed,
            lambda: run_simulation(
                out=base / "sim", overrides=dict(RUN_CONFIG), clients=2, timeout=240
            ),
        )
        (deploy, deploy_s), (sim, sim_s) = deploying.result(), simulating.result()
    print(f"\ndeployment {deploy_s:.1f} s, simulation {sim_s:.1f} s (side by side)")
    return {
        "out": base,
        "deploy": deploy,
        "sim": sim,
        "deploy_rounds": _rounds(base / "deploy"),
        "sim_rounds": _rounds(base / "sim"),
        "pids": pids,
    }


def test_both_run_two_rounds_with_all_clients(runs: dict) -> None:
    for kind in ("deploy", "sim"):
        assert runs[kind].rounds == 2
        assert [r["round"] for r in runs[f"{kind}_rounds"]] == [1, 2]
        assert all(r["num_replies"] == 2 and r["num_rejected"] == 0 for r in runs[f"{kind}_rounds"])


def test_payload_bytes_identical(runs: dict) -> None:
    for sim, dep in zip(runs["sim_rounds"], runs["deploy_rounds"], strict=True):
        print(
            f"round {sim['round']}: up payload {sim['uplink_payload_bytes']} / "
            f"{dep['uplink_payload_bytes']}, up message {sim['uplink_message_bytes']} / "
            f"{dep['uplink_message_bytes']}, down payload {sim['downlink_payload_bytes']} / "
            f"{dep['downlink_payload_bytes']}, down message {sim['downlink_message_bytes']} / "
            f"{dep['downlink_message_bytes']} (sim / deploy)"
        )
        assert {k: sim[k] for k in EXACT} == {k: dep[k] for k in EXACT}
    # round 2 is sparse (rate 0.5): the uplink really shrank in both
    first, second = runs["deploy_rounds"]
    assert second["keep"] < first["keep"]
    assert second["uplink_payload_bytes"] < 0.6 * first["uplink_payload_bytes"]


def test_message_bytes_agree_within_one_percent(runs: dict) -> None:
    # Flower messages carry node ids, run ids and metadata whose encodings vary in length
    # between runs (varint node ids, timestamps), so the serialized message differs by a few
    # bytes per message; measured here: uplink +27 B per reply, downlink -3 B per round.
    for sim, dep in zip(runs["sim_rounds"], runs["deploy_rounds"], strict=True):
        for key in ("uplink_message_bytes", "downlink_message_bytes"):
            assert dep[key] == pytest.approx(sim[key], rel=0.01), key
            assert abs(dep[key] - sim[key]) <= 100 * dep["num_replies"], key
            assert dep[key] >= dep[key.replace("message", "payload")]


def test_accuracy_and_epsilon(runs: dict) -> None:
    assert runs["deploy"].final_test_accuracy > 0.2
    assert runs["sim"].final_test_accuracy > 0.2
    assert abs(runs["deploy"].epsilon_max - runs["sim"].epsilon_max) < 1e-9
    for sim, dep in zip(runs["sim_rounds"], runs["deploy_rounds"], strict=True):
        assert abs(sim["epsilon_max"] - dep["epsilon_max"]) < 1e-9


def test_no_process_left_alive(runs: dict) -> None:
    assert len(runs["pids"]) == 4  # superlink, 2 supernodes, flwr run
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in runs["pids"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [pid for pid in runs["pids"] if _alive(pid)] == []


def test_the_deployment_is_tls_with_registered_node_keys(runs: dict) -> None:
    out = runs["out"]
    for i in range(2):
        key = out / "deploy" / "keys" / f"node-{i}"
        assert key.stat().st_mode & 0o777 == 0o600
        assert (key.parent / f"node-{i}.pub").read_text().startswith("ecdsa-sha2-nistp384 ")
    assert (out / "deploy" / "certs" / "server.key").stat().st_mode & 0o777 == 0o600
    assert (out / "deploy" / "certs" / "ca.key").stat().st_mode & 0o777 == 0o600
    registered = (out / "deploy" / "register.log").read_text()
    assert registered.count("registered successfully") == 2, registered
