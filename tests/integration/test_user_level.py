"""DP-FedAvg federated (dp-level=user, ServerApp and ClientApp in process): the server's
user-level accountant per round, seeded central noise reproducible."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from fedsparse.client.app import app as client_app
from fedsparse.client.node_policy import SIMULATION_NODE_POLICY
from fedsparse.common.config import FederatedConfig
from fedsparse.common.dp.accounting import compute_epsilon_of_history
from fedsparse.common.dp.central import calibrate_central_noise, poisson_sample
from fedsparse.lab.simulation.inprocess import InProcessGrid
from fedsparse.server.app import run_federated
from fedsparse.server.round_stats import RoundStats
from fedsparse.server.strategy import SparseFedAvg


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
        assert r["central_noise_multiplier"] == 0.8  # the run config's, recorded each round
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["user_epsilon"] == rounds[-1]["user_epsilon"]
    # Seeded central noise: the same run twice is the same run.
    again = _run(tmp_path / "b")
    assert [r["test_accuracy"] for r in again] == [r["test_accuracy"] for r in rounds]


@pytest.mark.slow
def test_a_central_target_epsilon_is_spent_within_a_tenth_of_a_percent(tmp_path: Path) -> None:
    # sigma calibrated by the server for 3 rounds at q = 4/8 (the given
    # central-noise-multiplier, 0.8, is not used): the last round's user epsilon is the target
    rounds = _run(tmp_path / "t", central_target_epsilon=2.0)
    spent = [r["user_epsilon"] for r in rounds]
    assert spent == sorted(spent) and 2.0 * (1 - 1e-3) <= spent[-1] <= 2.0
    sigma = calibrate_central_noise(target_epsilon=2.0, sample_rate=0.5, rounds=3, delta=1e-5)
    assert sigma != 0.8
    assert [r["central_noise_multiplier"] for r in rounds] == [sigma] * 3  # the calibrated one
    for r in rounds:
        expected = compute_epsilon_of_history(
            [(sigma, 4 / 8, r["round"])], delta=1e-5, accountant="rdp"
        )
        assert r["user_epsilon"] == pytest.approx(expected, rel=1e-12)


class _Nodes:
    """A grid of ``n`` connected nodes, as ``_sample`` sees one."""

    def __init__(self, n: int) -> None:
        self.n = n

    def get_node_ids(self) -> list[int]:
        return list(range(1, self.n + 1))


def _round(strategy: SparseFedAvg, nodes: int) -> None:
    """One user-level round at ``nodes`` connected nodes, nobody's update accepted."""
    strategy._sample(_Nodes(nodes))  # type: ignore[arg-type]
    strategy._aggregate_central(_stats([]), torch.zeros(50), [])


def _spent(strategy: SparseFedAvg) -> float:
    return compute_epsilon_of_history(strategy.users.history, delta=1e-5, accountant="rdp")


def test_nodes_that_leave_after_round_1_cannot_push_the_run_past_its_target() -> None:
    # 1,000 nodes in round 1 make q small and sigma small; with 10 left q = 1/5 each round:
    # the server raises sigma for the rounds left, and the run still spends at most 1.
    strategy = _strategy(central_target_epsilon=1.0, num_rounds=20, central_noise="seeded")
    _round(strategy, 1000)
    first = strategy.central_sigma
    assert first is not None and strategy.users.history == [(first, 2 / 1000, 1)]
    for _ in range(19):
        _round(strategy, 10)
    assert strategy.central_sigma is not None and strategy.central_sigma > first
    assert 1.0 * (1 - 1e-3) <= _spent(strategy) <= 1.0
    # had sigma stayed, the run would have spent far more
    kept = compute_epsilon_of_history(
        [(first, 2 / 1000, 1), (first, 2 / 10, 19)], delta=1e-5, accountant="rdp"
    )
    assert kept > 5


def test_more_nodes_later_keep_sigma_and_spend_less_than_the_target() -> None:
    strategy = _strategy(central_target_epsilon=1.0, num_rounds=5, central_noise="seeded")
    _round(strategy, 20)
    first = strategy.central_sigma
    for _ in range(4):
        _round(strategy, 200)
    assert strategy.central_sigma == first and _spent(strategy) < 1.0


def test_a_calibrated_central_sigma_is_kept_on_resume_and_checked() -> None:
    a = _strategy(central_target_epsilon=2.0, central_noise="seeded", num_rounds=4)
    assert a.central_sigma is None  # calibrated in round 1, at its rate
    _round(a, 40)
    b = _strategy(central_target_epsilon=2.0, central_noise="seeded", num_rounds=4)
    b.load_state_dict(a.state_dict(), resumed_from=1)
    assert b.central_sigma == a.central_sigma and b.users.history == a.users.history
    _round(b, 40)  # the same nodes: not recalibrated
    assert b.central_sigma == a.central_sigma
    for bad in ("0.3", True, math.nan, -1.0, 0.0):
        state = {**a.state_dict(), "central-sigma": bad}
        with pytest.raises(ValueError, match="central-sigma="):
            _strategy(central_target_epsilon=2.0).load_state_dict(state, resumed_from=1)
    given = _strategy(central_noise_multiplier=0.7)
    assert given.central_sigma == 0.7
    with pytest.raises(ValueError, match="central-noise-multiplier is 0.7"):
        given.load_state_dict({**a.state_dict(), "central-sigma": 0.9}, resumed_from=1)


def test_an_unreachable_target_is_named() -> None:
    strategy = _strategy(central_target_epsilon=1e-9, num_rounds=3)
    with pytest.raises(ValueError, match="central-target-epsilon=1e-09: unreachable"):
        strategy._sample(_Nodes(4))  # type: ignore[arg-type]


def _strategy(**kwargs: object) -> SparseFedAvg:
    cfg = FederatedConfig(dp_level="user", clients_per_round=2, seed=3, **kwargs)  # type: ignore[arg-type]
    return SparseFedAvg(cfg, num_parameters=50)


def _stats(selected: list[int]) -> RoundStats:
    return RoundStats(
        server_round=1,
        rate=0.0,
        keep=50,
        mask_seed=0,
        selected=selected,
        started=0.0,
        started_at=0.0,
    )


def test_a_round_without_updates_still_releases_the_noise() -> None:
    """Nobody sampled, or nobody accepted: the model moves by z / (q N) and the round is
    accounted; releasing w unchanged would not be the accounted mechanism."""
    strategy = _strategy(central_noise="seeded")
    weights = torch.zeros(50)
    for selected in ([], [7]):
        stats = _stats(selected)
        new, touched = strategy._aggregate_central(stats, weights, [])
        assert bool(touched.all()) and torch.count_nonzero(new) == 50
        assert (stats.failure != "") == bool(selected)  # a sampled user who never answered
        assert stats.user_epsilon > 0
    assert strategy.users.history == [(1.0, 1.0, 2)]


def test_seeded_central_noise_and_sampling_resume_exactly() -> None:
    a = _strategy(central_noise="seeded")
    a._aggregate_central(_stats([]), torch.zeros(50), [])
    b = _strategy(central_noise="seeded")
    b.load_state_dict(a.state_dict(), resumed_from=1)
    nodes = list(range(40))
    assert poisson_sample(nodes, 0.5, a._user_rng) == poisson_sample(nodes, 0.5, b._user_rng)
    next_a, _ = a._aggregate_central(_stats([]), torch.zeros(50), [])
    next_b, _ = b._aggregate_central(_stats([]), torch.zeros(50), [])
    assert torch.equal(next_a, next_b)


def test_fresh_sampling_is_not_the_run_seeds() -> None:
    """With fresh central noise, who joins cannot be recomputed from the run config."""
    nodes = list(range(64))
    one, two = _strategy(), _strategy()
    assert poisson_sample(nodes, 0.5, one._user_rng) != poisson_sample(nodes, 0.5, two._user_rng)


def test_secure_mode_hardens_the_servers_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    """secure-mode=true reaches the central aggregate (hardened noise, OS entropy)."""
    import fedsparse.server.round_updates as round_updates

    seen: list[bool] = []
    real = round_updates.central_aggregate

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(bool(kwargs.get("secure")))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(round_updates, "central_aggregate", spy)
    for secure in (True, False):
        strategy = _strategy(secure_mode=secure)
        new, _ = strategy._aggregate_central(_stats([]), torch.zeros(50), [])
        assert torch.count_nonzero(new) == 50
    assert seen == [True, False]
