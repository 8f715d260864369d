"""Fixtures for server tests: a synthetic client that replies like the ClientApp, fast."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedsparse.common.config import FederatedConfig
from fedsparse.common.wire.payload import encode_update
from fedsparse.common.wire.protocol import (
    CONFIG_RECORD,
    METRICS_RECORD,
    TrainInstruction,
    TrainReply,
    client_mask_seed,
)
from fedsparse.common.wire.value_formats import wire_encoding

SyntheticClient = Callable[[Message, Context], Message]


def synthetic_client(cfg: FederatedConfig, d: int) -> SyntheticClient:
    """A ClientApp stand-in: the reply ``client/app.py`` builds, with random values, no training.

    The values are a fixed function of (round, node): the same instruction gets the same reply.
    """

    def handler(msg: Message, context: Context) -> Message:
        task = TrainInstruction.from_record(msg.content.config_records[CONFIG_RECORD])
        node = context.node_id
        sparse = task.keep < d
        seed = task.mask_seed
        if task.mask_scope == "client":
            seed = client_mask_seed(seed, node)
        gen = torch.Generator().manual_seed(task.server_round * 1_000_003 + node)
        values = torch.randn(task.keep, generator=gen) * 0.01
        payload_kwargs = dict(mask_seed=seed) if sparse else {}
        update = encode_update(
            values,
            dense_size=d,
            round=task.server_round,
            encoding=wire_encoding(cfg.codec, sparse=sparse),
            value_dtype=cfg.value_dtype,
            compression=cfg.compression,
            **payload_kwargs,
        )
        reply = TrainReply(
            update=update,
            num_examples=1,
            examples_seen=0,
            train_loss=0.25 + node % 7,
            epsilon=1.5 + task.server_round,
            noise_multiplier=1.1,
            keep=task.keep,
            seeded_noise=1,
        )
        config, metrics = reply.to_records()
        content = RecordDict(
            {CONFIG_RECORD: ConfigRecord(config), METRICS_RECORD: MetricRecord(metrics)}
        )
        return Message(content=content, reply_to=msg)

    return handler


@pytest.fixture
def make_synthetic_client() -> Callable[[FederatedConfig, int], SyntheticClient]:
    """``synthetic_client``: ``make_synthetic_client(cfg, d)`` is a client callable."""
    return synthetic_client
