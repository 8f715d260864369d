"""``message_bytes`` computes Flower's serialized size from the parts, byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID

from fedsparse.client.app import app as client_app
from fedsparse.common.config import FederatedConfig
from fedsparse.common.layout import ParamLayout
from fedsparse.common.models.classifiers import build_model
from fedsparse.common.wire.protocol import CONFIG_RECORD, TrainInstruction
from fedsparse.lab.simulation.inprocess import InProcessGrid
from fedsparse.server import messages
from fedsparse.server.messages import framed_bytes, message_bytes, serialized_bytes
from fedsparse.server.strategy import SparseFedAvg, flat_array

D = 2500


def _round_messages(grid: InProcessGrid, cfg: FederatedConfig, d: int, w0: torch.Tensor):
    """Every message a run's strategy sends and receives, before and after the grid stamps it."""
    strategy = SparseFedAvg(cfg, num_parameters=d)
    strategy.resumed_from = 1 if cfg.seed % 2 else 0
    arrays, seen = flat_array(w0), []
    for server_round in range(1, cfg.num_rounds + 1):
        sent = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid))
        sizes = [framed_bytes(m) for m in sent]
        # the round's count, from records the messages share: each message's own size
        assert strategy.last_round.downlink_message_bytes == sum(serialized_bytes(m) for m in sent)
        seen += sent
        replies = list(grid.send_and_receive(sent))
        assert [framed_bytes(m) for m in sent] == sizes  # ids stamped: same size
        seen += replies
        arrays, _ = strategy.aggregate_train(server_round, replies)
    return seen


def _check(seen: list[Message]) -> None:
    for message in seen:
        computed = framed_bytes(message)
        assert computed is not None  # no fallback for what the protocol sends
        assert computed == serialized_bytes(message) == message_bytes(message)


CODECS = [
    ("values", "fp32", "none", "round"),
    ("values", "int8", "zstd", "round"),
    ("coo", "fp16", "none", "round"),
    ("delta", "bf16", "zstd", "client"),
    ("bitmap", "fp32", "none", "client"),
    ("auto", "fp32", "zstd", "round"),
]


@pytest.mark.parametrize(("codec", "value_dtype", "compression", "mask_scope"), CODECS)
def test_computed_bytes_equal_serialized_for_every_message_of_a_run(
    make_synthetic_client, codec: str, value_dtype: str, compression: str, mask_scope: str
) -> None:
    """Dense and sparse downloads, replies, error replies; small and 64-bit node ids."""
    cfg = FederatedConfig(
        num_rounds=4,
        final_rate=0.7,
        clients_per_round=4,
        codec=codec,
        value_dtype=value_dtype,
        compression=compression,
        mask_scope=mask_scope,
        seed=len(codec) + len(compression),
    )
    client = make_synthetic_client(cfg, D)

    def failing(msg: Message, context) -> Message:  # type: ignore[no-untyped-def]
        if msg.metadata.group_id == "2":
            raise ValueError("bad shard ünïcode")
        return client(msg, context)

    ids = [1, 127, 128, 2**31, 2**63 - 1, 2**64 - 2]
    grid = InProcessGrid(
        client,
        num_nodes=len(ids),
        node_ids=ids,
        run_config=cfg.to_run_config(),
        overrides={2**31: failing, 128: failing},
    )
    seen = _round_messages(grid, cfg, D, torch.randn(D, generator=torch.Generator()))
    assert any(m.has_error() for m in seen)
    sizes = {framed_bytes(m) for m in seen if not m.has_error()}
    assert len(sizes) > 4
    _check(seen)


def test_computed_bytes_equal_serialized_for_the_real_client_app(tmp_path) -> None:
    """The real ClientApp's replies (DP-SGD trained) and a SuperLink error reply."""
    cfg = FederatedConfig(out_dir=str(tmp_path), num_rounds=2, final_rate=0.5)
    model = build_model(cfg.model_name, seed=cfg.seed)
    layout = ParamLayout.from_module(model)
    grid = InProcessGrid(client_app, num_nodes=2, run_config=cfg.to_run_config())
    seen = _round_messages(grid, cfg, layout.numel, layout.flatten_module(model))
    superlink = Message(Error(code=2, reason="node 1001 went away"), reply_to=seen[0])
    superlink.metadata.__dict__["_src_node_id"] = SUPERLINK_NODE_ID
    _check([*seen, superlink])


def test_train_messages_are_train_message_s_sharing_a_record_per_instruction() -> None:
    base = dict(
        num_rounds=3, mask_seed=5, keep=9, mask_scope="round", local_epochs=1, batch_size=8,
        lr=0.1, momentum=0.0, base_version=-1, model_version=0,
    )  # fmt: skip
    same = TrainInstruction(server_round=1, model=b"\x01" * 40, **base)  # type: ignore[arg-type]
    other = TrainInstruction(server_round=1, model=b"\x02" * 41, **base)  # type: ignore[arg-type]
    plan = [(3, same, "values"), (2**40, same, "values"), (9, other, "values"), (4, same, "d")]
    got, sizes = messages.train_messages(plan, resumed_from=2, support=b"\xff")
    for message, size, (node, instruction, kind) in zip(got, sizes, plan, strict=True):
        alone = messages.train_message(
            instruction, node=node, resumed_from=2, support=b"\xff", downlink_kind=kind
        )
        assert message.metadata.dst_node_id == node
        assert dict(message.content.config_records[CONFIG_RECORD]) == dict(
            alone.content.config_records[CONFIG_RECORD]
        )
        assert size == serialized_bytes(message) == serialized_bytes(alone)
    records = [m.content.config_records[CONFIG_RECORD] for m in got]
    assert records[0] is records[1]  # one record per (instruction, downlink kind)
    assert len({id(r) for r in records}) == 3


def _message(**records) -> Message:  # type: ignore[no-untyped-def]
    return Message(content=RecordDict(records), dst_node_id=7, message_type="train")


@pytest.mark.parametrize("length", [0, 1, 127, 128, 16_383, 16_384, 2_097_152])
def test_varint_boundaries_of_keys_values_and_items(length: int) -> None:
    InProcessGrid(client_app, num_nodes=1, run_config={})  # stamps Flower's task identity
    record = {
        "b": b"\x01" * length,
        "k" * length: "é" * (length // 2),
        "": 0,
        "ints": -(2**63),
        "big": 2**64 - 1,
        "mid": 2**63,
        "small": -1,
        "f": float("nan"),
        "t": True,
        "n": False,
    }
    metrics = {"x" * length: 2**63 + 5, "y": -(2**40), "z": float("inf")}
    message = _message(cfg=ConfigRecord(record), m=MetricRecord(metrics))
    assert framed_bytes(message) == serialized_bytes(message)
    empty = _message()
    assert framed_bytes(empty) == serialized_bytes(empty)


def test_what_the_formula_does_not_cover_is_serialized(monkeypatch: pytest.MonkeyPatch) -> None:
    """Arrays, list values, two records of one class: None, and ``message_bytes`` serializes."""
    InProcessGrid(client_app, num_nodes=1, run_config={})
    uncovered = [
        _message(a=ArrayRecord({"w": Array(np.arange(5, dtype=np.float32))})),
        _message(c=ConfigRecord({"xs": [1, 2, 3]})),
        _message(m=MetricRecord({"xs": [0.5, 1.5]})),
        _message(a=ConfigRecord({"k": 1}), b=ConfigRecord({"k": 1})),  # one id, shipped once
    ]
    calls = []

    def counting(message: Message) -> int:
        calls.append(message)
        return serialized_bytes(message)

    monkeypatch.setattr(messages, "serialized_bytes", counting)
    for message in uncovered:
        assert framed_bytes(message) is None
        assert messages.message_bytes(message) == serialized_bytes(message)
    assert calls == uncovered
    covered = _message(c=ConfigRecord({"k": b"xyz"}))
    assert messages.message_bytes(covered) == serialized_bytes(covered)
    assert len(calls) == len(uncovered)  # the formula, not the fallback
