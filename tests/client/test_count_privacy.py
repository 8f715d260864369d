"""A node's example count is not observable: nodes that differ only in how many examples they
hold, under one declared ``nominal-size``, answer every message a server can send alike (the
same refusals, the same reported numbers, replies of the same shape and size), and the count
probe that decoded ``n`` from calibration refusals recovers only the public nominal size."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from flwr.app import ConfigRecord, Message, MessageType, RecordDict

from fedsparse.common.aggregation.secure import choose_ring, smallest_threshold
from fedsparse.common.config import FederatedConfig
from fedsparse.common.layout import ParamLayout
from fedsparse.common.models.classifiers import build_model
from fedsparse.common.wire.payload import encode_update
from fedsparse.common.wire.protocol import (
    CONFIG_RECORD,
    METRICS_RECORD,
    EvaluateInstruction,
    TrainReply,
)
from fedsparse.common.wire.secagg import RING_FIELDS, SECAGG_RECORD, SETUP, STAGE
from fedsparse.lab.research.count_probe import count_candidates
from fedsparse.lab.simulation.inprocess import InProcessGrid
from fedsparse.server.strategy import SparseFedAvg, flat_array
from tests.client.node_helpers import grid as _grid
from tests.client.sized_data import REFERENCE, declared_folder

NOMINAL = 300
#: n, n + 1 and n + 50, all under NOMINAL.
COUNTS = (205, 206, 255)
BASE = {"dataset": REFERENCE, "model": "digits-cnn", "min_clients": 1, "dp_norm_bound": "off"}


def _node(tmp_path: Path, count: int, nominal: int = NOMINAL, **policy: Any) -> dict[str, Any]:
    """A deployed node's config (fresh noise, its own ledger, budget 10) holding ``count``."""
    return {
        "dataset": REFERENCE,
        "data-dir": declared_folder(tmp_path, count),
        "nominal-size": nominal,
        "ledger-dir": str(tmp_path / f"ledger-{count}-{nominal}"),
        **policy,
    }


def _messages(cfg: FederatedConfig, grid: InProcessGrid, server_round: int) -> list[Message]:
    """What the server's strategy sends this round (with secure aggregation: its setup)."""
    model = build_model(cfg.model_name, seed=cfg.seed)
    layout = ParamLayout.from_module(model)
    strategy = SparseFedAvg(
        cfg,
        num_parameters=layout.numel,
        frozen_prefix=cfg.make_method().frozen_prefix(layout),
        layout=layout,
        train_examples=1437,
    )
    weights = flat_array(layout.flatten_module(model))
    messages = list(strategy.configure_train(server_round, weights, ConfigRecord(), grid))
    if cfg.secure_aggregation:
        stats = strategy.last_round
        assert stats is not None
        params = choose_ring(
            clip=cfg.central_clip,
            sigma=cfg.central_noise_multiplier,
            clients=2,
            threshold=smallest_threshold(2, 0),
            kept=stats.keep,
        )
        ring = {name: getattr(params, name) for name in RING_FIELDS}
        for message in messages:
            setup = {STAGE: SETUP, **ring, "round_id": server_round, "nonce": b"n" * 16}
            message.content.config_records[SECAGG_RECORD] = ConfigRecord(setup)
    return messages


def _first_round(cfg: FederatedConfig, node_config: dict[str, Any], run_id: int = 1) -> Message:
    """The node's reply to round 1 of a run of ``cfg``."""
    grid = _grid(cfg, node_config, run_id)
    (reply,) = grid.send_and_receive(_messages(cfg, grid, 1))
    return reply


def _answer(reply: Message, *, drawn_support: bool = False) -> tuple[Any, ...]:
    """What a server observes of a reply, but the noisy values themselves (and, with
    ``drawn_support``, gip's and random-k's union of step supports: a fresh random draw each
    time, DP-accounted under gip, whose size and bytes vary from call to call)."""
    if reply.has_error():
        return ("error", reply.error.reason)
    shape = {
        kind: sorted((name, sorted(record)) for name, record in records.items())
        for kind, records in (
            ("config", reply.content.config_records),
            ("metrics", reply.content.metric_records),
        )
    }
    metrics = dict(reply.content.metric_records[METRICS_RECORD])
    numbers = {
        k: ("nan" if isinstance(v, float) and math.isnan(v) else v) for k, v in metrics.items()
    }
    sizes = {}
    for name, record in reply.content.config_records.items():
        sizes[name] = {k: len(v) if isinstance(v, bytes) else v for k, v in record.items()}
        if name == CONFIG_RECORD:  # a TrainReply: its own reading of the numbers too
            parsed = TrainReply.from_records(record, reply.content.metric_records[METRICS_RECORD])
            numbers["update-bytes"] = len(parsed.update)
            if drawn_support:
                numbers["keep"] = numbers["update-bytes"] = "drawn"
                sizes[name]["update"] = "drawn"
    return ("reply", repr(shape), repr(sorted(numbers.items())), repr(sorted(sizes.items())))


def _evaluate(cfg: FederatedConfig, grid: InProcessGrid) -> Message:
    layout = ParamLayout.from_module(build_model(cfg.model_name, seed=cfg.seed))
    model = build_model(cfg.model_name, seed=cfg.seed)
    flat = layout.flatten_module(model)
    task = EvaluateInstruction(model=encode_update(flat, dense_size=flat.numel(), round=1))
    message = Message(
        content=RecordDict({CONFIG_RECORD: ConfigRecord(task.to_record())}),
        dst_node_id=next(iter(grid.get_node_ids())),
        message_type=MessageType.EVALUATE,
    )
    (reply,) = grid.send_and_receive([message])
    return reply


#: Runs a server may start (run config overrides, the rounds it asks for): calibration at the
#: edge of reach (huge num-rounds, tiny targets, several batch sizes), fixed sigma, epochs,
#: methods, batch sizes the policy refuses, secure aggregation, and a budget spent to refusal.
RUNS: list[tuple[dict[str, Any], tuple[int, ...]]] = [
    *(
        ({"num_rounds": 10**7, "target_epsilon": eps, "batch_size": b}, (1,))
        for eps in (0.1029, 0.102915, 0.102925, 0.1031)
        for b in (16, 23, 64)
    ),
    ({"num_rounds": 3, "target_epsilon": 3.0}, (1, 2, 3)),
    ({"num_rounds": 2, "target_epsilon": 0.0, "noise_multiplier": 1.2, "local_epochs": 2}, (1, 2)),
    ({"num_rounds": 2, "method": "gip", "final_rate": 0.9, "schedule": "constant"}, (1, 2)),
    ({"num_rounds": 2, "method": "random-k", "final_rate": 0.5}, (2,)),
    ({"num_rounds": 2, "method": "lf", "freeze_after": 0}, (1,)),
    ({"num_rounds": 2, "batch_size": 8}, (1,)),
    ({"num_rounds": 2, "mechanism": "clipped", "target_epsilon": 0.0}, (1,)),
    (
        {
            "num_rounds": 2,
            "dp_level": "user",
            "secure_aggregation": True,
            "clients_per_round": 1,
            "central_noise_multiplier": 3.0,
        },
        (1,),
    ),
    ({"num_rounds": 2, "target_epsilon": 6.0}, (1, 2)),  # with the rest: past the budget
    ({"num_rounds": 1, "target_epsilon": 5.0}, (1,)),
]


def _answers(node_config: dict[str, Any]) -> list[tuple[Any, ...]]:
    """The node's answers to every message of ``RUNS``, then to an evaluate message."""
    answers = []
    for run_id, (overrides, rounds) in enumerate(RUNS, start=1):
        try:
            cfg = FederatedConfig(**{**BASE, **overrides})
        except ValueError as err:  # the server's own config check: not the node's answer
            raise AssertionError(f"{overrides}: {err}") from err
        grid = _grid(cfg, node_config, run_id)
        for server_round in rounds:
            (reply,) = grid.send_and_receive(_messages(cfg, grid, server_round))
            drawn = cfg.method in ("gip", "random-k")
            answers.append((run_id, server_round, *_answer(reply, drawn_support=drawn)))
        if run_id == len(RUNS):
            answers.append(("evaluate", *_answer(_evaluate(cfg, grid))))
    return answers


def test_nodes_with_other_counts_answer_every_message_alike(tmp_path: Path) -> None:
    answers = {n: _answers(_node(tmp_path, n)) for n in COUNTS}
    reference = answers[COUNTS[0]]
    for n in COUNTS[1:]:
        for mine, theirs in zip(reference, answers[n], strict=True):
            assert mine == theirs, (COUNTS[0], n)
    kinds = [a[2] for a in reference]
    # the sequence exercised both sides: refusals and trained rounds
    assert kinds.count("error") >= 5 and kinds.count("reply") >= 8, kinds
    reasons = " | ".join(a[3] for a in reference if a[2] == "error")
    for expected in ("no noise multiplier", "batch", "past its privacy budget", "clipped"):
        assert expected in reasons, (expected, reasons)


def test_a_node_holding_more_than_its_nominal_size_refuses_with_one_fixed_line(
    tmp_path: Path,
) -> None:
    cfg = FederatedConfig(**{**BASE, "num_rounds": 2})
    reasons = set()
    for count in (NOMINAL + 1, NOMINAL + 200):
        reply = _first_round(cfg, _node(tmp_path, count))
        assert reply.has_error()
        reasons.add(reply.error.reason)
    assert reasons == {
        "PrivacyRefusal: this node holds more examples than its declared nominal-size"
    }


def test_a_deployed_node_without_a_nominal_size_refuses_before_reading_data(
    tmp_path: Path,
) -> None:
    cfg = FederatedConfig(**{**BASE, "num_rounds": 2})
    node = _node(tmp_path, COUNTS[0])
    del node["nominal-size"]
    reply = _first_round(cfg, node)
    assert reply.has_error() and "declares no nominal-size" in reply.error.reason
    assert not list(tmp_path.glob("ledger-*/*.json"))  # no data read: no ledger opened


class _Prober:
    """The count probe's oracle against one node: each probe is a fresh run (round 1) whose
    train message carries the probe's target and batch size; True when calibration refused."""

    def __init__(self, node_config: dict[str, Any]) -> None:
        self.node_config, self.sent = node_config, 0

    def __call__(self, target_epsilon: float, batch_size: int) -> bool:
        self.sent += 1
        cfg = FederatedConfig(
            **BASE, num_rounds=PROBE_ROUNDS, target_epsilon=target_epsilon, batch_size=batch_size
        )
        reply = _first_round(cfg, self.node_config, run_id=self.sent)
        if reply.has_error():
            assert "no noise multiplier reaches it" in reply.error.reason, reply.error.reason
            return True
        return False


PROBE_ROUNDS = 10**7


@pytest.mark.slow
def test_the_count_probe_recovers_the_nominal_size_never_the_count(tmp_path: Path) -> None:
    """Before: the probe decoded n exactly from ~10 refusals (the control: a node whose
    nominal size is its own count, which is what every node computed from then). Now two
    nodes of 205 and 255 examples under nominal-size 300 both give it {300}."""
    probe = {"batch_sizes": range(16, NOMINAL + 1), "max_count": NOMINAL}
    control = _Prober(_node(tmp_path, COUNTS[0], nominal=COUNTS[0]))
    assert count_candidates(control, num_rounds=PROBE_ROUNDS, **probe) == {COUNTS[0]}
    assert control.sent <= 15
    for count in (COUNTS[0], COUNTS[2]):
        prober = _Prober(_node(tmp_path, count))
        assert count_candidates(prober, num_rounds=PROBE_ROUNDS, **probe) == {NOMINAL}


def test_a_node_holding_nothing_answers_as_one_holding_one_example(tmp_path: Path) -> None:
    """n = 0 trains on its padding alone: a reply like any other, never an error."""
    cfg = FederatedConfig(**{**BASE, "num_rounds": 2, "target_epsilon": 3.0})
    answers = []
    for count in (0, 1):
        answers.append(_answer(_first_round(cfg, _node(tmp_path, count))))
    assert answers[0] == answers[1] and answers[0][0] == "reply"


def test_evaluation_where_the_policy_allows_it_does_not_depend_on_the_count(
    tmp_path: Path,
) -> None:
    cfg = FederatedConfig(**{**BASE, "num_rounds": 2})
    answers = {
        count: _answer(_evaluate(cfg, _grid(cfg, _node(tmp_path, count, evaluate=True))))
        for count in (COUNTS[0], COUNTS[2])
    }
    assert answers[COUNTS[0]] == answers[COUNTS[2]] and answers[COUNTS[0]][0] == "reply"
