"""The client's privacy against the server: fresh noise, its own policy and ledger, releases."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict

from fedsparse.client.app import app as client_app
from fedsparse.client.data import local_data, public_test_data
from fedsparse.client.guard import released_error
from fedsparse.common.config import FederatedConfig
from fedsparse.common.layout import ParamLayout
from fedsparse.common.masks import keep_count, sample_mask
from fedsparse.common.models import build_model
from fedsparse.common.payload import decode_update, encode_update
from fedsparse.common.privacy import sample_rate, steps_per_epoch
from fedsparse.common.protocol import (
    CONFIG_RECORD,
    METRICS_RECORD,
    EvaluateInstruction,
    EvaluateReply,
    TrainInstruction,
    TrainReply,
    round_seed,
)
from fedsparse.lab.attacks import rebuild_seeded_noise
from fedsparse.lab.inprocess import InProcessGrid
from fedsparse.server.messages import train_message

NODE = 1001
RATE = 0.5
DEPLOYED = {"ledger-dir": ""}  # a deployed node's defaults (fresh noise), without a ledger


def _cfg(**kwargs) -> FederatedConfig:
    return FederatedConfig(**{"num_rounds": 3, "final_rate": RATE, **kwargs})


def _weights(cfg: FederatedConfig, shift: float = 0.0) -> torch.Tensor:
    model = build_model(cfg.model_name, seed=cfg.seed)
    return ParamLayout.from_module(model).flatten_module(model) + shift


def _ask(grid: InProcessGrid, cfg: FederatedConfig, weights: torch.Tensor, rnd: int = 1):
    """Sends one dense-model train instruction for round ``rnd``; returns the reply message."""
    d = weights.numel()
    task = TrainInstruction(
        server_round=rnd,
        num_rounds=cfg.num_rounds,
        mask_seed=round_seed(cfg.seed, rnd),
        keep=keep_count(d, rate=RATE),
        mask_scope="round",
        local_epochs=cfg.local_epochs,
        batch_size=cfg.batch_size,
        lr=cfg.lr,
        momentum=0.0,
        base_version=-1,
        model_version=rnd - 1,
        model=encode_update(weights, dense_size=d, round=rnd),
    )
    (reply,) = grid.send_and_receive([train_message(task, node=NODE)])
    return reply


def _parse(reply: Message) -> tuple[TrainReply, torch.Tensor]:
    assert not reply.has_error(), reply.error.reason
    parsed = TrainReply.from_records(
        reply.content.config_records[CONFIG_RECORD], reply.content.metric_records[METRICS_RECORD]
    )
    return parsed, decode_update(parsed.update).to_dense()


def _grid(cfg: FederatedConfig, node_config=None, run_id: int = 1) -> InProcessGrid:
    return InProcessGrid(
        client_app,
        num_nodes=1,
        run_config=cfg.to_run_config(),
        node_config=node_config,
        run_id=run_id,
    )


def _rebuilt_noise(cfg: FederatedConfig, reply: TrainReply) -> torch.Tensor:
    """The curious server's rebuild of round 1's noise from the run config (lab/attacks.py)."""
    layout = ParamLayout.from_module(build_model(cfg.model_name, seed=0))
    n = len(local_data(cfg, 0, 1))
    q = sample_rate(n, cfg.batch_size)
    mask = sample_mask(
        layout.numel, keep=keep_count(layout.numel, rate=RATE), seed=round_seed(0, 1)
    )
    noise = rebuild_seeded_noise(
        layout,
        run_seed=cfg.seed,
        server_round=1,
        partition_id=0,
        steps=cfg.local_epochs * steps_per_epoch(n, cfg.batch_size),
        noise_multiplier=reply.noise_multiplier,
        max_grad_norm=cfg.max_grad_norm,
        expected_batch_size=int(n * q),
        lr=cfg.lr,
        mask=mask,
    )
    return noise


def test_the_server_rebuilds_seeded_noise_but_not_fresh_noise() -> None:
    """The reconstruction attack: exact in seeded simulation, useless against a deployed node.

    Subtracting the rebuilt noise from a seeded update leaves its noise-free update (same
    batches: Poisson sampling has its own stream); from a deployed node's update it leaves a
    second, independent noise draw. A small learning rate keeps the noisy and the noise-free
    trajectories together, so "noise-free" has one meaning up to O(lr) terms.
    """
    cfg = _cfg(target_epsilon=0.0, noise_multiplier=2.0, lr=1e-4)
    quiet = _cfg(target_epsilon=0.0, noise_multiplier=0.0, lr=1e-4)
    noise_free = _parse(_ask(_grid(quiet), quiet, _weights(quiet)))[1]
    seeded, update = _parse(_ask(_grid(cfg), cfg, _weights(cfg)))
    assert seeded.seeded_noise == 1
    residual = update - _rebuilt_noise(cfg, seeded)
    assert float((update - noise_free).norm()) > 5 * float(noise_free.norm())  # noise dominates
    assert float((residual - noise_free).norm()) < 0.01 * float(noise_free.norm())

    fresh, update = _parse(_ask(_grid(cfg, DEPLOYED), cfg, _weights(cfg)))
    assert fresh.seeded_noise == 0
    residual = update - _rebuilt_noise(cfg, fresh)
    assert float((residual - noise_free).norm()) > 1.2 * float(update.norm())  # ~sqrt(2)
    assert float((residual - noise_free).norm()) > 5 * float(noise_free.norm())


def test_replay_reveals_the_noise_free_difference_only_with_seeded_noise() -> None:
    """Round 1 asked twice with two models (a new Context each time: a replay across runs)."""

    def difference(node_config, noise_multiplier: float) -> torch.Tensor:
        cfg = _cfg(target_epsilon=0.0, noise_multiplier=noise_multiplier, lr=1e-4)
        a = _parse(_ask(_grid(cfg, node_config, run_id=1), cfg, _weights(cfg)))[1]
        b = _parse(_ask(_grid(cfg, node_config, run_id=2), cfg, _weights(cfg, 0.01)))[1]
        return a - b

    noise_free = difference(None, 0.0)
    seeded = difference(None, 2.0)
    assert float((seeded - noise_free).norm()) < 0.01 * float(noise_free.norm())
    fresh = difference(DEPLOYED, 2.0)
    assert float((fresh - noise_free).norm()) > 0.9 * float(fresh.norm())
    assert float((fresh - noise_free).norm()) > 5 * float(noise_free.norm())


def test_a_repeated_round_is_refused_and_nothing_is_released() -> None:
    cfg = _cfg()
    grid = _grid(cfg, DEPLOYED)
    _parse(_ask(grid, cfg, _weights(cfg), rnd=1))
    again = _ask(grid, cfg, _weights(cfg, 0.01), rnd=1)
    assert again.has_error()
    assert "round=1: this node already trained round 1" in again.error.reason
    _parse(_ask(grid, cfg, _weights(cfg), rnd=2))  # the next round is fine


@pytest.mark.parametrize(
    ("run", "policy", "reason"),
    [
        (
            dict(target_epsilon=0.0, noise_multiplier=0.0),
            {},
            "noise-multiplier=0: this node requires >= 0.5",
        ),
        (
            dict(target_epsilon=0.0, noise_multiplier=0.3),
            {},
            "noise-multiplier=0.3: this node requires >= 0.5",
        ),
        (
            dict(mechanism="clipped", target_epsilon=0.0),
            {},
            "mechanism='clipped': this node allows only dpsgd",
        ),
        (dict(local_epochs=3), {"max-local-epochs": 2}, "local-epochs=3: this node allows <= 2"),
        (
            dict(target_epsilon=8.0),
            {"epsilon-budget": 5.0},
            r"epsilon=.* at delta=1e-05 after this round: over this node's budget 5",
        ),
    ],
)
def test_the_node_policy_refuses_what_its_owner_does_not_allow(run, policy, reason) -> None:
    cfg = _cfg(**run)
    reply = _ask(_grid(cfg, {**DEPLOYED, **policy}), cfg, _weights(cfg))
    assert reply.has_error()
    assert re.search(reason, reply.error.reason), reply.error.reason


def test_the_ledger_spans_runs_and_restarts(tmp_path: Path) -> None:
    """Budget 3.2 at delta 1e-5; a run spends 3 over its 2 rounds (a third: 3.32); on disk."""
    cfg = _cfg(num_rounds=2, target_epsilon=3.0)
    node = {"ledger-dir": str(tmp_path), "epsilon-budget": 3.2}
    grid = _grid(cfg, node, run_id=1)
    first = [_parse(_ask(grid, cfg, _weights(cfg), rnd=r))[0] for r in (1, 2)]
    assert first[-1].epsilon == pytest.approx(3.0, abs=0.02)
    (ledger,) = tmp_path.glob("*.json")
    assert ledger.name == "digits-partition-0-of-1.json"
    assert oct(ledger.stat().st_mode & 0o777) == "0o600"
    # A restarted SuperNode (a fresh Context) in a new run: the ledger still has run 1.
    again = _ask(_grid(cfg, node, run_id=2), cfg, _weights(cfg), rnd=1)
    assert again.has_error() and "over this node's budget 3.2" in again.error.reason
    assert "epsilon=3.318 " in again.error.reason and "spent so far 2.994" in again.error.reason
    # Its owner raises the budget: run 2 trains, and the ledger has all three rounds.
    more = _parse(_ask(_grid(cfg, {**node, "epsilon-budget": 10.0}, run_id=2), cfg, _weights(cfg)))
    assert more[0].epsilon == pytest.approx(first[0].epsilon)  # the reply reports this run's ε
    entries = json.loads(ledger.read_text())["entries"]
    assert [(e["run_id"], e["server_round"]) for e in entries] == [(1, 1), (1, 2), (2, 1)]


def test_secure_mode_trains_privately_with_fresh_noise() -> None:
    cfg = _cfg(secure_mode=True)
    one, a = _parse(_ask(_grid(cfg), cfg, _weights(cfg)))  # even under the simulation policy
    two, b = _parse(_ask(_grid(cfg), cfg, _weights(cfg)))
    assert one.seeded_noise == 0 and 0 < one.epsilon < math.inf
    assert torch.isfinite(a).all() and not torch.equal(a, b)


def test_a_deployed_node_releases_no_loss_and_no_exact_counts() -> None:
    cfg = _cfg()
    n = len(local_data(cfg, 0, 1))
    deployed = _parse(_ask(_grid(cfg, DEPLOYED), cfg, _weights(cfg)))[0]
    assert math.isnan(deployed.train_loss)
    assert (deployed.num_examples, deployed.examples_seen) == (1, 0)
    simulated = _parse(_ask(_grid(cfg), cfg, _weights(cfg)))[0]
    assert simulated.num_examples == n and simulated.examples_seen > 0
    assert 0 < simulated.train_loss < 10


def test_evaluation_uses_the_public_test_split_never_the_partition() -> None:
    cfg = _cfg()
    grid = _grid(cfg, DEPLOYED)
    d = _weights(cfg).numel()
    task = EvaluateInstruction(model=encode_update(_weights(cfg), dense_size=d, round=1))
    msg = Message(
        content=RecordDict({CONFIG_RECORD: ConfigRecord(task.to_record())}),
        dst_node_id=NODE,
        message_type=MessageType.EVALUATE,
    )
    (reply,) = grid.send_and_receive([msg])
    result = EvaluateReply.from_record(reply.content.metric_records[METRICS_RECORD])
    assert result.num_examples == len(public_test_data(cfg)) != len(local_data(cfg, 0, 1))


def test_errors_from_private_work_are_reported_by_type_only() -> None:
    withheld = released_error(ValueError("partition has 143 examples of class 7"))
    assert str(withheld) == "client error: ValueError (details in the node's log)"
    assert "143" not in str(withheld)
