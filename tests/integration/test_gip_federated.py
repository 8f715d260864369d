"""``method=gip`` and ``method=random-k`` federated (ServerApp and ClientApp in process).

Each client chooses a support at every DP step; the union of those supports travels with the
update explicitly, the server aggregates each reply on its own support, and the client's
ledger charges GIP's index epsilon next to the accountant's, before it trains.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from fedsparse.client.app import app as client_app
from fedsparse.client.data import local_data
from fedsparse.client.ledger import PrivacyLedger, ledger_path
from fedsparse.client.node_data import data_identity
from fedsparse.client.node_policy import SIMULATION_NODE_POLICY
from fedsparse.client.train_message import _index_charge
from fedsparse.common.config import FederatedConfig
from fedsparse.common.dp.accounting import (
    calibrate_noise_multiplier,
    compute_epsilon_of_history,
    sample_rate,
    steps_per_epoch,
)
from fedsparse.common.layout import ParamLayout
from fedsparse.common.masks import keep_count
from fedsparse.common.methods.index_selection import IndexBudget
from fedsparse.common.models.classifiers import build_model
from fedsparse.common.wire.payload import EXPLICIT_ENCODINGS, decode_update
from fedsparse.common.wire.protocol import ProtocolError, TrainInstruction
from fedsparse.lab.simulation.inprocess import InProcessGrid
from fedsparse.server.app import run_federated

NODES, ROUNDS = 3, 3
D = ParamLayout.from_module(build_model("digits-cnn", seed=0)).numel


def _run(out: Path, **kwargs: Any) -> tuple[FederatedConfig, list[dict]]:
    cfg = FederatedConfig(
        out_dir=str(out), num_rounds=ROUNDS, final_rate=0.9, seed=2, save_updates=True, **kwargs
    )
    policy = {**SIMULATION_NODE_POLICY, "ledger-dir": str(out / "ledger"), "epsilon-budget": 3.0}
    grid = InProcessGrid(
        client_app, num_nodes=NODES, run_config=cfg.to_run_config(), node_config=policy
    )
    run_federated(grid, cfg)
    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    return cfg, rounds


def _payloads(out: Path, server_round: int) -> list[bytes]:
    return [p.read_bytes() for p in sorted((out / "updates").glob(f"round-{server_round}-*"))]


@pytest.mark.slow
def test_gip_federated_supports_bytes_and_ledger(tmp_path: Path) -> None:
    cfg, rounds = _run(tmp_path, method="gip")
    assert [r["num_accepted"] for r in rounds] == [NODES] * ROUNDS
    # Round 3 keeps k = 0.1 per step: each payload is the union of its steps' supports,
    # explicit, and the bytes recorded are those payloads' bytes.
    payloads = _payloads(tmp_path, 3)
    assert len(payloads) == NODES
    for raw in payloads:
        update = decode_update(raw, expected_dense_size=D)
        assert update.encoding in EXPLICIT_ENCODINGS
        assert keep_count(D, rate=0.9) < update.keep < D  # more than one step's support
    assert rounds[2]["uplink_payload_bytes"] == sum(len(p) for p in payloads)
    # The ledger of every node: sigma calibrated for 0.99 * 3 over the planned steps, and
    # eps2 = 0.03 spread over them; round 1 (k = 1) chooses nothing and costs 0.
    for pid in range(NODES):
        n = len(local_data(cfg, pid, NODES))
        q, per_round = sample_rate(n, cfg.batch_size), steps_per_epoch(n, cfg.batch_size)
        planned = ROUNDS * per_round
        ledger = PrivacyLedger(
            ledger_path(tmp_path / "ledger", data_identity(local_data(cfg, pid, NODES)))
        )
        entries = ledger.entries()
        assert [e.index_epsilon for e in entries] == pytest.approx(
            [0.0, 0.03 * per_round / planned, 0.03 * per_round / planned], rel=1e-12
        )
        sigma = calibrate_noise_multiplier(
            target_epsilon=2.97, delta=1e-5, sample_rate=q, steps=planned, accountant="rdp"
        )
        eps1 = compute_epsilon_of_history([(sigma, q, planned)], delta=1e-5, accountant="rdp")
        assert ledger.epsilon(1e-5) == pytest.approx(eps1 + 0.02, rel=1e-9)
        assert ledger.epsilon(1e-5) <= 3.0
    # What the clients reported is what their ledgers hold (the same on every node here).
    assert rounds[-1]["epsilon_max"] <= 3.0
    assert rounds[-1]["epsilon_max"] == pytest.approx(
        max(
            PrivacyLedger(
                ledger_path(tmp_path / "ledger", data_identity(local_data(cfg, p, NODES)))
            ).epsilon(1e-5)
            for p in range(NODES)
        ),
        rel=1e-9,
    )


@pytest.mark.slow
def test_random_k_federated_costs_nothing_and_is_explicit(tmp_path: Path) -> None:
    _, rounds = _run(tmp_path, method="random-k")
    _, rs = _run(tmp_path / "rs", method="rs")
    assert [r["num_accepted"] for r in rounds] == [NODES] * ROUNDS
    assert rounds[-1]["epsilon_max"] == rs[-1]["epsilon_max"]  # the full budget, no split
    for raw in _payloads(tmp_path, 3):
        assert decode_update(raw, expected_dense_size=D).encoding in EXPLICIT_ENCODINGS
    # RS's support is regenerated from the seed; random-k's union must travel.
    assert rounds[-1]["uplink_payload_bytes"] > rs[-1]["uplink_payload_bytes"]


def test_the_client_refuses_another_keep_and_charges_the_public_cost() -> None:
    cfg = FederatedConfig(method="gip", num_rounds=3, final_rate=0.9)
    task = TrainInstruction(
        server_round=3,
        num_rounds=3,
        mask_seed=1,
        keep=keep_count(D, rate=0.9),
        mask_scope="round",
        local_epochs=1,
        batch_size=32,
        lr=0.5,
        momentum=0.0,
        base_version=-1,
        model_version=2,
        model=b"",
    )
    budget = IndexBudget(epsilon=0.03, planned_steps=30)
    k, cost = _index_charge(cfg, task, D, budget, steps=10)
    assert k == pytest.approx(0.1) and cost == pytest.approx(0.01, rel=1e-12)
    bad = dataclasses.replace(task, keep=task.keep - 1)
    with pytest.raises(ProtocolError, match=f"keep={task.keep - 1}: expected {task.keep}"):
        _index_charge(cfg, bad, D, budget, steps=10)


def test_gip_needs_a_target_epsilon_in_the_run_config() -> None:
    with pytest.raises(ValueError, match="method='gip'"):
        FederatedConfig(method="gip", target_epsilon=0.0, noise_multiplier=1.0)
    assert FederatedConfig(method="random-k", target_epsilon=0.0, noise_multiplier=1.0)


def test_old_ledgers_read_with_no_index_epsilon(tmp_path: Path) -> None:
    path = tmp_path / "old.json"
    entry = dict(
        run_id=1, server_round=1, mechanism="dpsgd", noise_multiplier=1.0, sample_rate=0.1, steps=5
    )
    path.write_text(json.dumps({"format": 1, "entries": [entry]}))
    ledger = PrivacyLedger(path)
    assert ledger.entries()[0].index_epsilon == 0.0
    expected = compute_epsilon_of_history([(1.0, 0.1, 5)], delta=1e-5, accountant="rdp")
    assert ledger.epsilon(1e-5) == pytest.approx(expected, rel=1e-12)
