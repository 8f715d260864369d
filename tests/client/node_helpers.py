"""What the ClientApp tests share: a node in an in-process grid, and one-round requests."""

from __future__ import annotations

import torch
from flwr.app import Message

from fedsparse.client.app import app as client_app
from fedsparse.common.config import FederatedConfig
from fedsparse.common.masks import keep_count
from fedsparse.common.wire.payload import decode_update, encode_update
from fedsparse.common.wire.protocol import (
    CONFIG_RECORD,
    METRICS_RECORD,
    TrainInstruction,
    TrainReply,
    round_seed,
)
from fedsparse.lab.simulation.inprocess import InProcessGrid
from fedsparse.server.messages import train_message
from tests.client.round_helpers import RATE, cfg, first_task, weights

__all__ = ["DEPLOYED", "NODE", "RATE", "ask", "cfg", "first_task", "grid", "parse", "weights"]

NODE = 1001
#: A deployed node's defaults (fresh noise), without a ledger, holding the data the tests'
#: run configs name (digits, one partition, seed 0: the same examples as local_data(cfg, 0, 1)),
#: declaring their count as its nominal size (the numbers a simulated node computes).
DEPLOYED = {"ledger-dir": "", "dataset": "digits", "nominal-size": 1437}


def ask(grid: InProcessGrid, cfg: FederatedConfig, weights: torch.Tensor, rnd: int = 1):
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


def parse(reply: Message) -> tuple[TrainReply, torch.Tensor]:
    """(the reply, its dense update); fails the test on an error reply."""
    assert not reply.has_error(), reply.error.reason
    parsed = TrainReply.from_records(
        reply.content.config_records[CONFIG_RECORD], reply.content.metric_records[METRICS_RECORD]
    )
    return parsed, decode_update(parsed.update).to_dense()


def grid(cfg: FederatedConfig, node_config=None, run_id: int = 1) -> InProcessGrid:
    """One node (partition 0 of 1) with ``node_config``'s policy (default: simulation's)."""
    return InProcessGrid(
        client_app,
        num_nodes=1,
        run_config=cfg.to_run_config(),
        node_config=node_config,
        run_id=run_id,
    )
