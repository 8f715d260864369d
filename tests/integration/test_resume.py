"""``resume=true``: a killed run continued from its checkpoint ends with the uninterrupted model.

The kill is modelled in process: a grid that raises ``KeyboardInterrupt`` in round 3 after its
clients trained (so their state files of round 3 exist and must be ignored). The resumed run
gets a fresh ``InProcessGrid``: empty Contexts, as in a restarted simulation.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import Message

from fedsparse.client.app import app as client_app
from fedsparse.client.data import local_data
from fedsparse.client.ledger import PrivacyLedger, ledger_path
from fedsparse.client.node_data import data_identity
from fedsparse.client.node_policy import SIMULATION_NODE_POLICY
from fedsparse.common.config import FederatedConfig
from fedsparse.common.dp.accounting import compute_epsilon_of_history
from fedsparse.lab.simulation.inprocess import InProcessGrid
from fedsparse.server.app import run_federated
from fedsparse.server.checkpoint import CHECKPOINT_FORMAT, CheckpointError

NODES = 3
#: Per-round fields that depend on the clock, not on what the run computed.
CLOCK = ("wall_seconds", "started_at", "ended_at")
#: Per-round downlink fields: a resumed run sends each node the dense model once.
DOWNLINK = ("downlink_payload_bytes", "downlink_message_bytes", "downlink_bits_per_param")

BASE: dict[str, Any] = dict(
    num_rounds=4,
    clients_per_round=2,  # sampling draws from the strategy's generator every round
    final_rate=0.7,
    target_epsilon=3.0,
    seed=7,
)


class KilledInRound(InProcessGrid):
    """Runs the clients of round ``kill``, then raises ``KeyboardInterrupt`` (the kill)."""

    def __init__(self, *args: Any, kill: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kill = kill

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        messages = list(messages)
        replies = super().send_and_receive(messages, timeout=timeout)
        if messages and int(messages[0].metadata.group_id) == self.kill:
            raise KeyboardInterrupt
        return replies


def _cfg(out: Path, **kwargs: Any) -> FederatedConfig:
    return FederatedConfig(out_dir=str(out), **{**BASE, **kwargs})


def _ledger(ledgers: Path, partition: int) -> Path:
    """The ledger file of a node holding ``partition`` (keyed on its examples' content)."""
    return ledger_path(ledgers, data_identity(local_data(_cfg(ledgers), partition, NODES)))


def _grid(
    cfg: FederatedConfig,
    node_config: dict[str, Any],
    *,
    kill: int = 0,
    run_id: int = 1,
) -> InProcessGrid:
    kwargs: dict[str, Any] = dict(
        num_nodes=NODES, run_config=cfg.to_run_config(), node_config=node_config, run_id=run_id
    )
    if kill:
        return KilledInRound(client_app, kill=kill, **kwargs)
    return InProcessGrid(client_app, **kwargs)


def _sim_policy(out: Path) -> dict[str, Any]:
    return {**SIMULATION_NODE_POLICY, "state-dir": str(out / "node-state")}


def _lines(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]


def _weights(out: Path) -> torch.Tensor:
    return torch.load(out / "checkpoint.pt")["weights"]


def _killed_then_resumed(out: Path, node_config: dict[str, Any], **kwargs: Any) -> None:
    """Round 3 killed after its clients trained; then resumed on a fresh grid."""
    cfg = _cfg(out, **kwargs)
    with pytest.raises(KeyboardInterrupt):
        run_federated(_grid(cfg, node_config, kill=3), cfg)
    assert torch.load(out / "checkpoint.pt")["round"] == 2
    assert [r["round"] for r in _lines(out)] == [1, 2]
    resumed = _cfg(out, resume=True, **kwargs)
    run_federated(_grid(resumed, node_config, run_id=2), resumed)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted")
    cfg = _cfg(out)
    run_federated(_grid(cfg, _sim_policy(out)), cfg)
    return out


def _assert_same_run(resumed: Path, reference: Path) -> None:
    assert torch.equal(_weights(resumed), _weights(reference))
    ours, theirs = _lines(resumed), _lines(reference)
    assert [r["round"] for r in ours] == [1, 2, 3, 4]
    for a, b in zip(ours, theirs, strict=True):
        skip = CLOCK + (DOWNLINK if a["round"] >= 3 else ())
        assert {k: v for k, v in a.items() if k not in skip} == {
            k: v for k, v in b.items() if k not in skip
        }
    # The first resumed round sends each selected node the dense model.
    assert ours[2]["downlink_payload_bytes"] > theirs[2]["downlink_payload_bytes"]
    summary = json.loads((resumed / "summary.json").read_text())
    expected = json.loads((reference / "summary.json").read_text())
    downlink = ("total_downlink_payload_bytes", "total_downlink_message_bytes")
    for key in ("wall_seconds", *downlink, "downlink_bits_per_param"):
        summary.pop(key), expected.pop(key)
    summary["config"].pop("out-dir"), expected["config"].pop("out-dir")
    assert summary == expected


@pytest.mark.slow
def test_a_killed_simulation_resumes_to_the_uninterrupted_model(
    uninterrupted: Path, tmp_path: Path
) -> None:
    _killed_then_resumed(tmp_path, _sim_policy(tmp_path))
    _assert_same_run(tmp_path, uninterrupted)
    assert torch.load(tmp_path / "checkpoint.pt")["format"] == CHECKPOINT_FORMAT
    # Every node's last state file is its last round; round 3 of the killed run was replaced.
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("round-*.json"))
    assert files and all(p.startswith("node-state/node-") for p in files)


@pytest.mark.slow
def test_a_sparse_downlink_run_resumes_identically(tmp_path: Path) -> None:
    """Full participation with auto-coded downlinks: rounds 3 and 4 send sparse patches."""
    kwargs = dict(clients_per_round=0, codec="auto", noise_multiplier=1.0, target_epsilon=0.0)
    reference = tmp_path / "reference"
    cfg = _cfg(reference, **kwargs)
    run_federated(_grid(cfg, _sim_policy(reference)), cfg)
    lines = _lines(reference)
    # Round 1 is dense (rate 0), so round 2's patch is the whole model; round 3's is sparse.
    assert lines[2]["downlink_payload_bytes"] < lines[0]["downlink_payload_bytes"]
    out = tmp_path / "resumed"
    _killed_then_resumed(out, _sim_policy(out), **kwargs)
    _assert_same_run(out, reference)
    # After the dense round 3, round 4 patches sparsely again, as the reference does.
    assert _lines(out)[3]["downlink_payload_bytes"] == lines[3]["downlink_payload_bytes"]


@pytest.mark.slow
def test_a_lossy_downlink_run_resumes_identically(uninterrupted: Path, tmp_path: Path) -> None:
    """downlink-dtype=int4: the server's rounding of each round's change is seeded by the run
    and the round, so the resumed run adopts the same decoded models as the uninterrupted one
    (its first resumed round sends exact dense values, which equal them)."""
    kwargs = dict(downlink_dtype="int4", value_block=64)
    reference = tmp_path / "reference"
    cfg = _cfg(reference, **kwargs)
    run_federated(_grid(cfg, _sim_policy(reference)), cfg)
    # the same nodes sampled as in the fp32 run: the int4 changes cost fewer bytes
    ours, fp32 = _lines(reference), _lines(uninterrupted)
    assert sum(r["downlink_payload_bytes"] for r in ours) < sum(
        r["downlink_payload_bytes"] for r in fp32
    )
    out = tmp_path / "resumed"
    _killed_then_resumed(out, _sim_policy(out), **kwargs)
    _assert_same_run(out, reference)
    # the rounding was applied: the model is not the fp32 downlink's
    assert not torch.equal(_weights(out), _weights(uninterrupted))


@pytest.mark.slow
def test_without_state_files_a_resumed_node_restarts_its_accountant(tmp_path: Path) -> None:
    """No ``state-dir``: the same model path is not promised; the accountant restarts."""
    _killed_then_resumed(tmp_path, dict(SIMULATION_NODE_POLICY), clients_per_round=0)
    lines = _lines(tmp_path)
    assert [r["round"] for r in lines] == [1, 2, 3, 4]
    assert lines[2]["epsilon_max"] < lines[1]["epsilon_max"]


@pytest.mark.slow
def test_a_deployed_node_counts_its_ledger_across_the_resume(tmp_path: Path) -> None:
    """Deployment: no state files; the node's ledger keeps every round it trained."""
    ledgers = tmp_path / "ledgers"
    policy = {**SIMULATION_NODE_POLICY, "ledger-dir": str(ledgers)}
    _killed_then_resumed(tmp_path / "run", policy)
    per_node = []
    for partition in range(NODES):
        ledger = PrivacyLedger(_ledger(ledgers, partition))
        per_node.append([(e.run_id, e.server_round) for e in ledger.entries()])
    # 2 of 3 nodes a round; the killed run's round 3 stays charged (the data was used).
    assert sum(len(entries) for entries in per_node) == 2 * (3 + 2)
    assert sum(run == 1 for entries in per_node for run, _ in entries) == 2 * 3
    assert all(
        [r for run, r in entries if run == 2] == sorted(r for run, r in entries if run == 2)
        for entries in per_node
    )


@pytest.mark.slow
def test_a_deployed_node_refuses_a_resume_past_its_budget(tmp_path: Path) -> None:
    """The killed run's round 3 stays charged: the node's ledger, not the server, decides."""
    ledgers = tmp_path / "ledgers"
    policy = {**SIMULATION_NODE_POLICY, "ledger-dir": str(ledgers)}
    kwargs = dict(clients_per_round=0, max_failed_rounds=1)
    out = tmp_path / "run"
    cfg = _cfg(out, **kwargs)
    with pytest.raises(KeyboardInterrupt):
        run_federated(_grid(cfg, policy, kill=3), cfg)
    # The owners now allow just what the checkpointed rounds 1-2 spent plus one round: the
    # resumed round 3 would be each node's 4th charge, over the budget.
    ledger = PrivacyLedger(_ledger(ledgers, 0))
    entries = ledger.entries()
    assert len(entries) == 3
    history = [(e.noise_multiplier, e.sample_rate, e.steps) for e in entries]
    delta = float(SIMULATION_NODE_POLICY.get("delta", 1e-5))
    budget = compute_epsilon_of_history(history, delta=delta, accountant="rdp") + 1e-6
    resumed = _cfg(out, resume=True, **kwargs)
    spent = {**policy, "epsilon-budget": budget}
    with pytest.raises(RuntimeError, match="max-failed-rounds"):
        run_federated(_grid(resumed, spent, run_id=2), resumed)
    failed = _lines(out)[2]
    assert failed["round"] == 3 and failed["failed"] and failed["num_rejected"] == NODES
    assert all("past its privacy budget" in reason for reason in failed["rejected"])


def test_a_config_mismatch_is_refused_naming_the_key(uninterrupted: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    for name in ("checkpoint.pt", "rounds.jsonl"):
        (out / name).write_bytes((uninterrupted / name).read_bytes())
    before = (out / "rounds.jsonl").read_text()
    for key, value, shown in (("lr", 0.1, "lr=0.1"), ("num_rounds", 5, "num-rounds=5")):
        cfg = _cfg(out, resume=True, **{key: value})
        with pytest.raises(CheckpointError, match=shown) as err:
            run_federated(_grid(cfg, _sim_policy(out)), cfg)
        old = getattr(_cfg(out), key)
        assert f"{key.replace('_', '-')}={old!r}" in str(err.value)
    assert (out / "rounds.jsonl").read_text() == before  # nothing touched
    # Keys that change no number may differ: a finished run resumes to its summary.
    cfg = _cfg(out, resume=True, round_timeout=30.0)
    run_federated(_grid(cfg, _sim_policy(out)), cfg)
    assert [r["round"] for r in _lines(out)] == [1, 2, 3, 4]
    assert (out / "summary.json").exists()


def test_a_missing_checkpoint_is_refused(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, resume=True)
    with pytest.raises(CheckpointError, match="no checkpoint at .*start without resume"):
        run_federated(_grid(cfg, _sim_policy(tmp_path)), cfg)


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda p: p.write_bytes(p.read_bytes()[:1000]), "unreadable"),
        (lambda p: p.write_bytes(b"not a checkpoint"), "unreadable"),
        (lambda p: torch.save({**torch.load(p), "format": 99}, p), "format=99: expected"),
        (lambda p: torch.save({**torch.load(p), "format": 1}, p), "format=1: expected"),
        (lambda p: torch.save({**torch.load(p), "round": "2"}, p), "round: expected int"),
        (
            lambda p: torch.save({**torch.load(p), "weights": torch.zeros(3)}, p),
            "weights: .*expected float32",
        ),
        (
            lambda p: torch.save({**torch.load(p), "strategy": {"epsilons": {}}}, p),
            "strategy state: missing key 'sampling-rng'",
        ),
    ],
)
def test_a_damaged_checkpoint_is_refused(
    uninterrupted: Path, tmp_path: Path, damage: Any, match: str
) -> None:
    for name in ("checkpoint.pt", "rounds.jsonl"):
        (tmp_path / name).write_bytes((uninterrupted / name).read_bytes())
    damage(tmp_path / "checkpoint.pt")
    cfg = _cfg(tmp_path, resume=True)
    with pytest.raises(CheckpointError, match=match):
        run_federated(_grid(cfg, _sim_policy(tmp_path)), cfg)
    assert len(_lines(tmp_path)) == 4  # nothing touched


def test_missing_round_lines_are_refused(uninterrupted: Path, tmp_path: Path) -> None:
    (tmp_path / "checkpoint.pt").write_bytes((uninterrupted / "checkpoint.pt").read_bytes())
    (tmp_path / "rounds.jsonl").write_text(
        "\n".join((uninterrupted / "rounds.jsonl").read_text().splitlines()[:2]) + "\n"
    )
    cfg = _cfg(tmp_path, resume=True)
    with pytest.raises(CheckpointError, match=r"rounds \[3, 4\] missing"):
        run_federated(_grid(cfg, _sim_policy(tmp_path)), cfg)


def test_later_and_cut_lines_are_dropped_on_resume(uninterrupted: Path, tmp_path: Path) -> None:
    """A kill between the round's line and its checkpoint, or in the middle of a line."""
    checkpoint = torch.load(uninterrupted / "checkpoint.pt")
    torch.save({**checkpoint, "round": 3}, tmp_path / "checkpoint.pt")
    lines = (uninterrupted / "rounds.jsonl").read_text().splitlines()
    (tmp_path / "rounds.jsonl").write_text("\n".join(lines) + "\n" + lines[0][:20])
    cfg = _cfg(tmp_path, resume=True)
    run_federated(_grid(cfg, _sim_policy(tmp_path)), cfg)
    assert [r["round"] for r in _lines(tmp_path)] == [1, 2, 3, 4]
    assert (tmp_path / "rounds.jsonl").read_text().splitlines()[:3] == lines[:3]


def test_a_start_without_enough_nodes_leaves_the_previous_records(tmp_path: Path) -> None:
    old = {"rounds.jsonl": '{"round": 1}\n', "summary.json": "{}"}
    for name, text in old.items():
        (tmp_path / name).write_text(text)
    cfg = _cfg(tmp_path, min_clients=NODES + 1, round_timeout=0.1)
    with pytest.raises(TimeoutError, match="min-clients=4"):
        run_federated(_grid(cfg, _sim_policy(tmp_path)), cfg)
    assert {name: (tmp_path / name).read_text() for name in old} == old


def test_a_checkpoint_older_than_the_engine_and_device_keys_still_resumes(tmp_path: Path) -> None:
    """Keys added later (``ADDED_KEYS``) read as the behaviour the old run had; others don't."""
    from fedsparse.common.config import ADDED_KEYS
    from fedsparse.server.checkpoint import CheckpointError, _check_config

    current = FederatedConfig(num_rounds=2).to_run_config()
    old = {k: v for k, v in current.items() if k not in ADDED_KEYS}
    _check_config(tmp_path / "checkpoint.pt", old, current)  # no error
    with pytest.raises(CheckpointError, match="engine='func'"):
        _check_config(tmp_path / "checkpoint.pt", old, {**current, "engine": "func"})
    with pytest.raises(CheckpointError, match="lr="):
        _check_config(tmp_path / "checkpoint.pt", {**old, "lr": 0.1}, current)
