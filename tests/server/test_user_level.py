"""DP-FedAvg federated (dp-level=user, ServerApp and ClientApp in process): the server's
user-level accountant per round, seeded central noise reproducible."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fedsparse.client.app import app as client_app
from fedsparse.common.config import FederatedConfig
from fedsparse.common.privacy import compute_epsilon_of_history
from fedsparse.lab.flower import SIMULATION_NODE_POLICY
from fedsparse.lab.inprocess import InProcessGrid
from fedsparse.server.app import run_federated


def _run(out: Path, **kwargs: object) -> list[dict]:
    cfg = FederatedConfig(
        out_dir=str(out),
        num_rounds=3,
        dp_level="user",
        clients_per_round=4,
        central_noise_multiplier=0.8,
        central_noise="seeded",
        seed=5,
        **kwargs,  # type: ignore[arg-type]
    )
    grid = InProcessGrid(
        client_app, num_nodes=8, run_config=cfg.to_run_config(), node_config=SIMULATION_NODE_POLICY
    )
    run_federated(grid, cfg)
    return [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_user_level_federation_accounts_users_per_round(tmp_path: Path) -> None:
    rounds = _run(tmp_path / "a")
    for r in rounds:
        expected = compute_epsilon_of_history(
            [(0.8, 4 / 8, r["round"])], delta=1e-5, accountant="rdp"
        )
        assert r["user_epsilon"] == pytest.approx(expected, rel=1e-12)
        assert r["epsilon_max"] == math.inf  # the clients add no noise: no sample-level DP
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["user_epsilon"] == rounds[-1]["user_epsilon"]
    # Seeded central noise: the same run twice is the same run.
    again = _run(tmp_path / "b")
    assert [r["test_accuracy"] for r in again] == [r["test_accuracy"] for r in rounds]
