"""``method=lf`` and ``method=random-freeze`` federated (ServerApp and ClientApp in process).

Layer freezing: from round ``freeze-after + 1`` on the first ``freeze-layers`` layers move by
exactly 0, each client sends the other ``d - s`` values only (``4 s`` bytes fewer), and a reply
that touches the frozen layers cannot be aggregated.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message

from fedsparse.client.app import app as client_app
from fedsparse.client.data import _partitions
from fedsparse.client.node_policy import SIMULATION_NODE_POLICY
from fedsparse.client.train_message import _server_support
from fedsparse.common.config import FederatedConfig
from fedsparse.common.data.datasets import load_dataset
from fedsparse.common.layout import ParamLayout
from fedsparse.common.masks import keep_count
from fedsparse.common.methods import (
    federated_ranking_scores,
    frozen_prefix,
    layerwise_keep,
    layerwise_mask,
    public_split,
    ranked_mask,
)
from fedsparse.common.models.classifiers import build_model
from fedsparse.common.seeds import Stream, stream_seed
from fedsparse.common.training.centralized import pretrain_public
from fedsparse.common.wire.payload import decode_update, encode_update
from fedsparse.common.wire.payload.indices import indices_from_bytes, indices_to_bytes
from fedsparse.common.wire.protocol import (
    CONFIG_RECORD,
    SERVER_SUPPORT,
    ProtocolError,
    TrainInstruction,
)
from fedsparse.lab.simulation.inprocess import InProcessGrid
from fedsparse.server.app import run_federated

NODES = 3
LAYOUT = ParamLayout.from_module(build_model("digits-cnn", seed=0))
#: A fixed sigma: round 1 is then the same whatever num-rounds is.
LF: dict[str, Any] = dict(
    method="lf",
    freeze_layers=1,
    freeze_after=1,
    target_epsilon=0.0,
    noise_multiplier=1.0,
    seed=4,
)


def _run(out: Path, overrides: dict[int, Any] | None = None, **kwargs: Any) -> list[dict]:
    cfg = FederatedConfig(out_dir=str(out), **kwargs)
    grid = InProcessGrid(
        client_app,
        num_nodes=NODES,
        run_config=cfg.to_run_config(),
        node_config=SIMULATION_NODE_POLICY,
        overrides=overrides,
    )
    run_federated(grid, cfg)
    return [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]


def _weights(out: Path) -> torch.Tensor:
    return torch.load(out / "checkpoint.pt")["weights"]


def test_frozen_layers_move_by_zero_and_cost_no_uplink_bytes(tmp_path: Path) -> None:
    layout = ParamLayout.from_module(build_model("digits-cnn", seed=4))
    d, s = layout.numel, frozen_prefix(layout, 1)
    initial = layout.flatten_module(build_model("digits-cnn", seed=4))
    _run(tmp_path / "one", num_rounds=1, **LF)
    rounds = _run(tmp_path / "three", num_rounds=3, **LF)
    after_1, after_3 = _weights(tmp_path / "one"), _weights(tmp_path / "three")
    assert not torch.equal(initial[:s], after_1[:s])  # round 1: plain DP-SGD, every layer
    assert torch.equal(after_1[:s], after_3[:s])  # rounds 2 and 3: frozen, bit for bit
    assert not torch.equal(after_1[s:], after_3[s:])
    assert [r["keep"] for r in rounds] == [d, d - s, d - s]
    assert [r["rate"] for r in rounds] == [0.0, s / d, s / d]
    answered = [r["num_accepted"] for r in rounds]
    assert answered == [NODES] * 3
    # The same dense payload, less the frozen layers' 4 s bytes per client.
    up = [r["uplink_payload_bytes"] for r in rounds]
    assert up[1] == up[2] == up[0] - NODES * 4 * s
    summary = json.loads((tmp_path / "three" / "summary.json").read_text())
    assert summary["total_density"] == (d + 2 * (d - s)) / (3 * d)


def _touches_frozen(msg: Message, ctx: Context) -> Message:
    """Trains honestly, then sends all d coordinates, the frozen layers moved by 1."""
    reply = client_app(msg, ctx)
    update = decode_update(bytes(reply.content.config_records[CONFIG_RECORD]["update"]))
    d = update.dense_size + 160
    full = torch.ones(d)
    full[160:] = update.values
    payload = encode_update(full, dense_size=d, round=update.round, encoding="dense")
    reply.content.config_records[CONFIG_RECORD] = ConfigRecord({"update": payload})
    return reply


def test_a_reply_that_moves_a_frozen_layer_is_rejected(tmp_path: Path) -> None:
    layout = ParamLayout.from_module(build_model("digits-cnn", seed=4))
    assert frozen_prefix(layout, 1) == 160  # _touches_frozen's offset
    honest = _run(tmp_path / "honest", num_rounds=2, **{**LF, "freeze_after": 0})
    hostile = _run(
        tmp_path / "hostile", {1001: _touches_frozen}, num_rounds=2, **{**LF, "freeze_after": 0}
    )
    for entry in hostile:
        assert entry["num_accepted"] == NODES - 1 and entry["num_rejected"] == 1
        # d values where d - s are expected: over the payload bound, or of the wrong size
        assert re.match(r"node 1001: payload: .*(exceeds max_bytes|dense)", entry["rejected"][0])
    frozen = _weights(tmp_path / "hostile")[:160]
    assert torch.equal(frozen, layout.flatten_module(build_model("digits-cnn", seed=4))[:160])
    assert honest[0]["num_accepted"] == NODES


def test_random_freeze_runs_the_cooling_schedule_federated(tmp_path: Path) -> None:
    rounds = _run(
        tmp_path / "rf",
        num_rounds=4,
        method="random-freeze",
        final_rate=0.8,
        cooling_rounds=2,
        target_epsilon=0.0,
        noise_multiplier=1.0,
    )
    d = rounds[0]["keep"]
    rates = [0.8 * min(e / 2, 1) for e in range(4)]
    assert [r["rate"] for r in rounds] == rates
    assert [r["keep"] for r in rounds] == [keep_count(d, rate=r) for r in rates]


# --- method=ranked ------------------------------------------------------------------------------

RANKED: dict[str, Any] = dict(
    method="ranked",
    schedule="constant",  # the same rate every round: round r of any run is the same
    final_rate=0.5,
    target_epsilon=0.0,
    noise_multiplier=1.0,
    seed=6,
)


class SupportGrid(InProcessGrid):
    """Records each round's ranked support (as sent) and can stop after round ``kill``."""

    def __init__(self, *args: Any, kill: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kill, self.supports = kill, {}

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> Any:
        messages = list(messages)
        record = messages[0].content.config_records[CONFIG_RECORD]
        server_round = int(record["round"])
        sent = {
            bytes(m.content.config_records[CONFIG_RECORD].get(SERVER_SUPPORT, b""))
            for m in messages
        }
        assert len(sent) == 1  # one support per round, the same for every client
        self.supports[server_round] = sent.pop()
        replies = super().send_and_receive(messages, timeout=timeout)
        if server_round == self.kill:
            raise KeyboardInterrupt
        return replies


def _ranked_run(out: Path, rounds: int, **kwargs: Any) -> SupportGrid:
    cfg = FederatedConfig(out_dir=str(out), num_rounds=rounds, **{**RANKED, **kwargs})
    grid = SupportGrid(
        client_app,
        num_nodes=NODES,
        run_config=cfg.to_run_config(),
        node_config=SIMULATION_NODE_POLICY,
    )
    run_federated(grid, cfg)
    return grid


def test_ranked_masks_are_the_top_of_the_last_aggregate(tmp_path: Path) -> None:
    model = build_model("digits-cnn", seed=6)
    w0 = ParamLayout.from_module(model).flatten_module(model)
    d = w0.numel()
    keep = keep_count(d, rate=0.5)
    weights = [w0]
    for rounds in (1, 2, 3):
        grid = _ranked_run(tmp_path / f"r{rounds}", rounds)
        weights.append(_weights(tmp_path / f"r{rounds}"))
    supports = grid.supports
    assert supports[1] == b""  # round 1: nothing to rank yet, every coordinate trains
    lines = [json.loads(x) for x in (tmp_path / "r3" / "rounds.jsonl").read_text().splitlines()]
    assert [x["keep"] for x in lines] == [d, keep, keep]
    covered = torch.ones(d, dtype=torch.bool)
    for r in (2, 3):
        seed = stream_seed(6, Stream.RANKING_NOISE, r)
        scores = federated_ranking_scores(weights[r - 1] - weights[r - 2], covered, seed=seed)
        expected = ranked_mask(scores, keep)
        sent = indices_from_bytes(supports[r], "bitmap", keep=keep, dense_size=d)
        assert torch.equal(torch.nonzero(expected).flatten(), sent)
        moved = weights[r] != weights[r - 1]
        assert not (moved & ~expected).any()  # round r moves its ranked coordinates only
        covered = expected
        # Values only on the uplink: each reply is keep float32 values plus a fixed header.
        assert lines[r - 1]["uplink_payload_bytes"] < NODES * (4 * keep + 64)
        assert lines[r - 1]["downlink_payload_bytes"] >= NODES * (d // 8)  # the bitmap


def test_a_killed_ranked_run_resumes_to_the_uninterrupted_model(tmp_path: Path) -> None:
    _ranked_run(tmp_path / "whole", 4)
    cfg = FederatedConfig(out_dir=str(tmp_path / "cut"), num_rounds=4, **RANKED)
    grid = SupportGrid(
        client_app,
        num_nodes=NODES,
        run_config=cfg.to_run_config(),
        node_config={**SIMULATION_NODE_POLICY, "state-dir": str(tmp_path / "cut" / "state")},
        kill=3,
    )
    with pytest.raises(KeyboardInterrupt):
        run_federated(grid, cfg)
    resumed = FederatedConfig(out_dir=str(tmp_path / "cut"), num_rounds=4, resume=True, **RANKED)
    run_federated(
        InProcessGrid(
            client_app,
            num_nodes=NODES,
            run_config=resumed.to_run_config(),
            node_config={**SIMULATION_NODE_POLICY, "state-dir": str(tmp_path / "cut" / "state")},
            run_id=2,
        ),
        resumed,
    )
    assert torch.equal(_weights(tmp_path / "whole"), _weights(tmp_path / "cut"))


def test_a_client_refuses_a_ranked_keep_off_the_public_schedule() -> None:
    cfg = FederatedConfig(num_rounds=3, **RANKED)
    task = TrainInstruction(
        server_round=2,
        num_rounds=3,
        mask_seed=1,
        keep=10,
        mask_scope="round",
        local_epochs=1,
        batch_size=32,
        lr=0.5,
        momentum=0.0,
        base_version=-1,
        model_version=1,
        model=b"",
    )
    bitmap = indices_to_bytes(np.arange(10), "bitmap", 38_282)
    with pytest.raises(ProtocolError, match="keep=10: expected 19141 \\(method='ranked'"):
        _server_support(cfg, task, {SERVER_SUPPORT: bitmap}, LAYOUT)
    rs = FederatedConfig(num_rounds=3, method="rs")
    with pytest.raises(
        ProtocolError, match="server-support: only with method='ranked' or 'dpssgd'"
    ):
        _server_support(rs, task, {SERVER_SUPPORT: bitmap}, LAYOUT)


# --- method=dpssgd ------------------------------------------------------------------------------

DPSSGD: dict[str, Any] = dict(
    method="dpssgd",
    final_rate=0.8,
    public_fraction=0.1,
    public_epochs=2,
    target_epsilon=0.0,
    noise_multiplier=1.0,
    seed=8,
)


def _pretrained(cfg: FederatedConfig) -> torch.Tensor:
    """The server's initial model: the seed's model pretrained on the public slice."""
    train, _ = load_dataset("digits", seed=cfg.seed)
    public, _ = public_split(len(train), cfg.public_fraction, run_seed=cfg.seed)
    model = build_model("digits-cnn", seed=cfg.seed)
    index = torch.from_numpy(public)
    pretrain_public(
        model, train.x[index], train.y[index], epochs=2, batch_size=32, lr=cfg.lr, seed=cfg.seed
    )
    return ParamLayout.from_module(model).flatten_module(model)


def test_dpssgd_freezes_the_public_selection_and_trains_on_private_data(tmp_path: Path) -> None:
    cfg = FederatedConfig(out_dir=str(tmp_path), num_rounds=3, **DPSSGD)
    grid = SupportGrid(
        client_app,
        num_nodes=NODES,
        run_config=cfg.to_run_config(),
        node_config=SIMULATION_NODE_POLICY,
    )
    run_federated(grid, cfg)
    pretrained = _pretrained(cfg)
    expected = layerwise_mask(pretrained, LAYOUT, rate=0.8, selection="magnitude", seed=0)
    d, keep = LAYOUT.numel, layerwise_keep(LAYOUT, 0.8)
    for r in (1, 2, 3):  # selection-mode=freeze: the same support every round
        sent = indices_from_bytes(grid.supports[r], "bitmap", keep=keep, dense_size=d)
        assert torch.equal(sent, torch.nonzero(expected).flatten())
    final = _weights(tmp_path)
    assert torch.equal(final[~expected], pretrained[~expected])  # never trained: exactly 0
    assert not torch.equal(final[expected], pretrained[expected])
    # The clients' partitions hold private examples only.
    train, _ = load_dataset("digits", seed=8)
    public, _ = public_split(len(train), 0.1, run_seed=8)
    parts = _partitions("digits", "", 8, NODES, "iid", 0.5, 0.1)
    held = np.concatenate(parts)
    assert len(np.intersect1d(held, public)) == 0 and len(held) == len(train) - len(public)


def test_dpssgd_reselects_by_magnitude_each_round(tmp_path: Path) -> None:
    weights = []
    for rounds in (1, 2):
        cfg = FederatedConfig(
            out_dir=str(tmp_path / f"r{rounds}"),
            num_rounds=rounds,
            **{**DPSSGD, "selection_mode": "reselect"},
        )
        grid = SupportGrid(
            client_app,
            num_nodes=NODES,
            run_config=cfg.to_run_config(),
            node_config=SIMULATION_NODE_POLICY,
        )
        run_federated(grid, cfg)
        weights.append(_weights(tmp_path / f"r{rounds}"))
    d, keep = LAYOUT.numel, layerwise_keep(LAYOUT, 0.8)
    second = indices_from_bytes(grid.supports[2], "bitmap", keep=keep, dense_size=d)
    expected = layerwise_mask(weights[0], LAYOUT, rate=0.8, selection="magnitude", seed=0)
    assert torch.equal(second, torch.nonzero(expected).flatten())  # from round 1's model
    first = indices_from_bytes(grid.supports[1], "bitmap", keep=keep, dense_size=d)
    assert not torch.equal(first, second)
