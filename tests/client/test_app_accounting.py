"""The client's memoized accounting changes no number a federation reports."""

import json
from pathlib import Path

import pytest

from fedsparse.client.app import app as client_app
from fedsparse.common.config import FederatedConfig
from fedsparse.common.dp import accounting as privacy
from fedsparse.lab.simulation.inprocess import InProcessGrid
from fedsparse.server.app import run_federated

# What the clock decides; everything else in rounds.jsonl must be equal.
TIMING_KEYS = {"wall_seconds", "started_at", "ended_at"}


def federate(tmp_path: Path, *, memo: bool, **kwargs) -> list[dict]:
    cfg = FederatedConfig(out_dir=str(tmp_path), **kwargs)
    grid = InProcessGrid(client_app, num_nodes=3, run_config=cfg.to_run_config())
    privacy.clear_accounting_caches()
    with privacy.accounting_cache(enabled=memo):
        run_federated(grid, cfg)
    lines = (tmp_path / "rounds.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS} for line in lines]


@pytest.mark.slow
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_rounds=3, final_rate=0.7, target_epsilon=3.0),
        dict(num_rounds=2, final_rate=0.5, target_epsilon=2.0, local_epochs=2, batch_size=64),
    ],
)
def test_federation_rounds_equal_with_and_without_memos(tmp_path: Path, kwargs) -> None:
    """Accuracy, ε, σ-dependent losses and bytes of every round, compared exactly."""
    off = federate(tmp_path / "off", memo=False, **kwargs)
    on = federate(tmp_path / "on", memo=True, **kwargs)
    assert len(on) == kwargs["num_rounds"]
    assert on == off
    assert all(r["epsilon_max"] > 0 for r in on)  # DP rounds: ε really was computed
    assert privacy._calibrate.cache_info().hits > 0  # later rounds did hit the memo


def charges(ledger_dir: Path, *, memo: bool) -> list[float | str]:
    """ε after each round a ledger charges, then the refusal once the budget is spent."""
    from fedsparse.client.guard import authorize
    from fedsparse.client.ledger import PrivacyLedger
    from fedsparse.client.node_policy import NodePolicy, PrivacyRefusal, TrainingRequest

    policy = NodePolicy(epsilon_budget=4.0, ledger_dir=str(ledger_dir))
    ledger = PrivacyLedger(ledger_dir / "digits.json")
    spent: list[float | str] = []
    privacy.clear_accounting_caches()
    with privacy.accounting_cache(enabled=memo):
        for rnd in range(1, 30):
            request = TrainingRequest(
                run_id=1 + rnd // 10,  # runs compose in the ledger
                server_round=rnd,
                mechanism="dpsgd",
                noise_multiplier=2.5 if rnd % 3 else 3.0,
                sample_rate=0.2,
                steps=5,
                local_epochs=1,
            )
            try:
                spent.append(authorize(policy, ledger, request, history=[], last_round=0))
            except PrivacyRefusal as refusal:
                spent.append(f"{refusal} | {refusal.detail.rsplit(' (', 1)[0]}")
                break
        spent.append(ledger.epsilon(policy.delta))
    return spent


@pytest.mark.slow
def test_ledger_charges_and_refusal_equal_with_and_without_memos(tmp_path: Path) -> None:
    on = charges(tmp_path / "on", memo=True)
    off = charges(tmp_path / "off", memo=False)
    assert on == off
    refusal, detail = str(on[-2]).split(" | ")  # the budget ran out: a refusal
    assert refusal == "this round would take the node's data past its privacy budget"
    assert "budget 4," in detail  # the numbers go to the node's log only
    assert all(isinstance(e, float) and 0 < e <= 4.0 for e in on[:-2])
    assert len(on) > 10  # several rounds fit before it
