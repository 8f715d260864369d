"""The client's privacy against the server: fresh noise, its own policy and ledger, releases."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict

from fedsparse.client.data import local_data, public_test_data
from fedsparse.client.guard import CLIENT_FAILURE, released_error
from fedsparse.client.ledger import ledger_path
from fedsparse.client.node_data import data_identity
from fedsparse.client.node_policy import PrivacyRefusal
from fedsparse.common.config import FederatedConfig
from fedsparse.common.dp.accounting import sample_rate, steps_per_epoch
from fedsparse.common.layout import ParamLayout
from fedsparse.common.masks import keep_count, sample_mask
from fedsparse.common.models.classifiers import build_model
from fedsparse.common.wire.payload import encode_update
from fedsparse.common.wire.protocol import (
    CONFIG_RECORD,
    METRICS_RECORD,
    EvaluateInstruction,
    EvaluateReply,
    TrainReply,
    round_seed,
)
from fedsparse.lab.research.attacks import rebuild_seeded_noise
from tests.client.node_helpers import DEPLOYED, NODE, RATE
from tests.client.node_helpers import ask as _ask
from tests.client.node_helpers import cfg as _cfg
from tests.client.node_helpers import grid as _grid
from tests.client.node_helpers import parse as _parse
from tests.client.node_helpers import weights as _weights


def _rebuilt_noise(cfg: FederatedConfig, reply: TrainReply) -> torch.Tensor:
    """The curious server's rebuild of round 1's noise from the run config
    (lab/research/attacks.py)."""
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
        (dict(batch_size=1), {}, "batch-size=1: this node requires >= 16"),
        (
            dict(target_epsilon=8.0),
            {"epsilon-budget": 5.0},
            r"^PrivacyRefusal: this round would take the node's data past its privacy budget$",
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
    node = {**DEPLOYED, "ledger-dir": str(tmp_path), "epsilon-budget": 3.2}
    grid = _grid(cfg, node, run_id=1)
    first = [_parse(_ask(grid, cfg, _weights(cfg), rnd=r))[0] for r in (1, 2)]
    assert first[-1].epsilon == pytest.approx(3.0, abs=0.02)
    (ledger,) = tmp_path.glob("*.json")
    assert ledger == ledger_path(tmp_path, data_identity(local_data(cfg, 0, 1)))
    assert oct(ledger.stat().st_mode & 0o777) == "0o600"
    # A restarted SuperNode (a fresh Context) in a new run: the ledger still has run 1. The
    # refusal names the limit, not the spend (3.318 after the round, 2.994 before it).
    again = _ask(_grid(cfg, node, run_id=2), cfg, _weights(cfg), rnd=1)
    assert again.has_error() and "past its privacy budget" in again.error.reason
    assert not re.search(r"[0-9]", again.error.reason), again.error.reason
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


def _evaluate(cfg: FederatedConfig, node_config) -> Message:
    d = _weights(cfg).numel()
    task = EvaluateInstruction(model=encode_update(_weights(cfg), dense_size=d, round=1))
    msg = Message(
        content=RecordDict({CONFIG_RECORD: ConfigRecord(task.to_record())}),
        dst_node_id=NODE,
        message_type=MessageType.EVALUATE,
    )
    (reply,) = _grid(cfg, node_config).send_and_receive([msg])
    return reply


def test_a_deployed_node_evaluates_nothing_unless_its_owner_allows_it() -> None:
    cfg = _cfg()
    refused = _evaluate(cfg, DEPLOYED)
    assert refused.has_error() and "evaluate=false" in refused.error.reason
    assert _evaluate(cfg, None).has_error()  # the simulation policy does not evaluate either


def test_evaluation_uses_the_public_test_split_never_the_partition() -> None:
    cfg = _cfg()
    reply = _evaluate(cfg, {**DEPLOYED, "evaluate": True})
    result = EvaluateReply.from_record(reply.content.metric_records[METRICS_RECORD])
    assert result.num_examples == len(public_test_data(cfg)) != len(local_data(cfg, 0, 1))


def test_the_server_cannot_point_evaluation_at_other_files(tmp_path: Path) -> None:
    """The run config's data-dir and eval-split choose nothing on a node that declares data."""
    cfg = _cfg(eval_split="validation", data_dir=str(tmp_path))
    reply = _evaluate(cfg, {**DEPLOYED, "evaluate": True})
    result = EvaluateReply.from_record(reply.content.metric_records[METRICS_RECORD])
    assert result.num_examples == len(public_test_data(_cfg()))


def test_errors_from_private_work_are_one_fixed_line() -> None:
    withheld = released_error(ValueError("partition has 143 examples of class 7"))
    assert str(withheld) == CLIENT_FAILURE == "client error (details in the node's log)"
    refusal = PrivacyRefusal("this node allows only dpsgd")
    assert released_error(refusal) is refusal  # before the data is read: the limit, by name
    assert str(released_error(refusal, data_read=True)) == CLIENT_FAILURE
    assert str(released_error(FloatingPointError("x"), data_read=True)) == CLIENT_FAILURE


def test_a_deployed_node_trains_only_on_data_its_owner_declares() -> None:
    cfg = _cfg()
    undeclared = _ask(_grid(cfg, {"ledger-dir": ""}), cfg, _weights(cfg))
    assert undeclared.has_error() and "this node declares no data" in undeclared.error.reason
    other = _ask(_grid(cfg, {**DEPLOYED, "dataset": "mnist-5k"}), cfg, _weights(cfg))
    assert other.has_error()
    assert "dataset='digits': this node holds 'mnist-5k'" in other.error.reason


def test_no_run_config_opens_a_second_budget_for_the_same_examples(tmp_path: Path) -> None:
    """The split attack: once the node's budget is spent, no other seed, partitioner,
    data-dir, eval-split or split-seed in the run config reaches the same examples under a
    fresh ledger: the node's declaration alone chooses them, and the ledger is their hash."""
    node = {**DEPLOYED, "ledger-dir": str(tmp_path), "epsilon-budget": 2.0}
    cfg = _cfg(num_rounds=2, target_epsilon=1.9)
    grid = _grid(cfg, node, run_id=1)
    for rnd in (1, 2):
        _parse(_ask(grid, cfg, _weights(cfg), rnd=rnd))
    aliases = [
        dict(seed=5),
        dict(partitioner="dirichlet"),
        dict(data_dir=str(tmp_path)),
        dict(eval_split="validation"),
        dict(split_seed=3),
    ]
    for run_id, alias in enumerate(aliases, start=2):
        other = _cfg(num_rounds=2, target_epsilon=1.9, **alias)
        reply = _ask(_grid(other, node, run_id=run_id), other, _weights(other))
        assert reply.has_error(), alias
        assert "past its privacy budget" in reply.error.reason, (alias, reply.error.reason)
    (ledger,) = tmp_path.glob("data-*.json")
    assert [e["run_id"] for e in json.loads(ledger.read_text())["entries"]] == [1, 1]


def test_an_unreadable_ledger_is_refused_without_naming_the_data(tmp_path: Path) -> None:
    """The ledger's file name is the digest of the node's examples: never in a reply."""
    cfg = _cfg()
    digest = data_identity(local_data(cfg, 0, 1))
    ledger_path(tmp_path, digest).mkdir(parents=True)  # a folder where the file belongs
    reply = _ask(_grid(cfg, {**DEPLOYED, "ledger-dir": str(tmp_path)}), cfg, _weights(cfg))
    assert reply.has_error() and "privacy ledger is unreadable" in reply.error.reason
    assert digest not in reply.error.reason and str(tmp_path) not in reply.error.reason
