"""A round's replies share one mask: sampled once a round, and validation is unchanged by it."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from fedsparse.client.app import app as client_app
from fedsparse.common import masks as masks_module
from fedsparse.common.config import FederatedConfig
from fedsparse.common.masks import keep_count, sample_mask
from fedsparse.common.wire.payload import decode_update, encode_update
from fedsparse.common.wire.protocol import CONFIG_RECORD, METRICS_RECORD, TrainReply
from fedsparse.lab.simulation.inprocess import InProcessGrid
from fedsparse.server.strategy import SparseFedAvg, flat_array
from fedsparse.server.validation import RejectedReply, check_reply

D, SEED, ROUND = 4_000, 777, 3


def _reply(payload: bytes) -> Message:
    InProcessGrid(client_app, num_nodes=1, run_config={})  # stamps Flower's task identity
    config, metrics = TrainReply(
        update=payload,
        num_examples=1,
        examples_seen=0,
        train_loss=0.1,
        epsilon=1.0,
        noise_multiplier=1.0,
        keep=1,
    ).to_records()
    content = RecordDict(
        {CONFIG_RECORD: ConfigRecord(config), METRICS_RECORD: MetricRecord(metrics)}
    )
    return Message(content=content, dst_node_id=1, message_type="train")


@pytest.mark.parametrize("codec", ["values", "coo", "delta", "bitmap", "auto"])
def test_a_given_round_support_validates_exactly_as_sampling_it(codec: str) -> None:
    keep = keep_count(D, rate=0.8)
    support = torch.nonzero(sample_mask(D, keep=keep, seed=SEED)).flatten()
    values = torch.randn(keep, generator=torch.Generator().manual_seed(0))
    encoding = {"values": "seeded"}.get(codec, codec)
    payload = encode_update(values, dense_size=D, round=ROUND, mask_seed=SEED, encoding=encoding)
    kwargs = dict(d=D, server_round=ROUND, expected_seed=SEED, keep=keep, codec=codec)
    given = check_reply(_reply(payload), mask_support=support, **kwargs)
    sampled = check_reply(_reply(payload), **kwargs)
    assert given.support is not None and sampled.support is not None
    assert torch.equal(given.support, sampled.support) and torch.equal(given.support, support)
    assert torch.equal(given.values, sampled.values)
    encoding = decode_update(payload).encoding  # auto: seeded (a seed is known)
    assert (given.support is support) == (encoding == "seeded")  # shared, not regenerated
    if encoding != "seeded":  # an explicit support that is not the round's mask: rejected
        other = torch.nonzero(sample_mask(D, keep=keep, seed=SEED + 1)).flatten()
        bad = encode_update(values, dense_size=D, round=ROUND, indices=other, encoding=encoding)
        for extra in ({"mask_support": support}, {}):
            with pytest.raises(RejectedReply, match="not the round's mask"):
                check_reply(_reply(bad), **kwargs, **extra)


@pytest.mark.parametrize(
    ("codec", "scope", "masks"),
    [("values", "round", 1), ("coo", "round", 1), ("values", "client", 20)],
)
def test_aggregate_samples_the_round_mask_once_for_all_replies(
    make_synthetic_client, monkeypatch: pytest.MonkeyPatch, codec: str, scope: str, masks: int
) -> None:
    """20 replies: one mask (mask-scope=round); per-client masks: one each, sampled once."""
    cfg = FederatedConfig(num_rounds=2, final_rate=0.5, codec=codec, mask_scope=scope, seed=5)
    grid = InProcessGrid(make_synthetic_client(cfg, D), num_nodes=20, run_config={})
    strategy = SparseFedAvg(cfg, num_parameters=D)
    arrays = flat_array(torch.zeros(D))
    calls: list[dict] = []

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(kwargs)
        return sample_mask(*args, **kwargs)

    sparse_rounds = 0
    for server_round in (1, 2):
        calls.clear()
        messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid))
        replies = list(grid.send_and_receive(messages))
        masks_module._shared.cache_clear()  # not the clients' (same process) masks
        monkeypatch.setattr(masks_module, "sample_mask", counting)
        arrays, _ = strategy.aggregate_train(server_round, replies)
        monkeypatch.undo()
        assert strategy.last_round is not None and strategy.last_round.accepted == 20
        sparse = strategy.last_round.keep < D
        assert len(calls) == (masks if sparse else 0)
        sparse_rounds += sparse
    assert sparse_rounds == 1  # round 1 is dense (gradual schedule), round 2 sparse
