"""Typed messages: round trips, the exact record layout on the wire, and named rejections."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsparse.common.seeds import Stream, stream_seed
from fedsparse.common.wire.protocol import (
    EvaluateInstruction,
    EvaluateReply,
    ProtocolError,
    TrainInstruction,
    TrainReply,
    client_mask_seed,
    round_seed,
)

INT63 = st.integers(min_value=0, max_value=2**63 - 1)


@st.composite
def instructions(draw: st.DrawFn) -> TrainInstruction:
    num_rounds = draw(st.integers(1, 10_000))
    return TrainInstruction(
        server_round=draw(st.integers(1, num_rounds)),
        num_rounds=num_rounds,
        mask_seed=draw(INT63),
        keep=draw(st.integers(0, 10**9)),
        mask_scope=draw(st.sampled_from(["round", "client"])),
        local_epochs=draw(st.integers(1, 100)),
        batch_size=draw(st.integers(1, 4096)),
        lr=draw(st.floats(1e-6, 10.0)),
        momentum=draw(st.floats(0.0, 0.99)),
        base_version=draw(st.integers(-1, 1000)),
        model_version=draw(st.integers(0, 1000)),
        model=draw(st.binary(max_size=64)),
    )


@st.composite
def replies(draw: st.DrawFn) -> TrainReply:
    return TrainReply(
        update=draw(st.binary(max_size=64)),
        num_examples=draw(st.integers(0, 10**9)),
        examples_seen=draw(st.integers(0, 10**9)),
        train_loss=draw(st.floats(allow_nan=True, allow_infinity=False)),
        epsilon=draw(st.one_of(st.floats(0.0, 1e6), st.just(math.inf))),
        noise_multiplier=draw(st.floats(0.0, 100.0)),
        keep=draw(st.integers(0, 10**9)),
        seeded_noise=draw(st.sampled_from([0, 1])),
    )


@settings(derandomize=True, max_examples=200)
@given(instructions())
def test_train_instruction_round_trips(task: TrainInstruction) -> None:
    assert TrainInstruction.from_record(task.to_record()) == task


@settings(derandomize=True, max_examples=200)
@given(replies())
def test_train_reply_round_trips(reply: TrainReply) -> None:
    back = TrainReply.from_records(*reply.to_records())
    assert back.update == reply.update and back.epsilon == reply.epsilon
    assert back.num_examples == reply.num_examples and back.keep == reply.keep
    assert back.train_loss == reply.train_loss or math.isnan(reply.train_loss)


def test_evaluate_messages_round_trip() -> None:
    task = EvaluateInstruction(model=b"\x01\x02")
    assert EvaluateInstruction.from_record(task.to_record()) == task
    reply = EvaluateReply(num_examples=7, loss=0.5, accuracy=0.75)
    assert reply.to_record() == {"num-examples": 7, "loss": 0.5, "accuracy": 0.75}
    assert EvaluateReply.from_record(reply.to_record()) == reply


def test_record_layout_is_the_wire_schema() -> None:
    """Key names, order and value types are what the byte counts were measured with."""
    task = TrainInstruction(
        server_round=2,
        num_rounds=10,
        mask_seed=5,
        keep=9,
        mask_scope="round",
        local_epochs=1,
        batch_size=32,
        lr=0.5,
        momentum=0.0,
        base_version=0,
        model_version=1,
        model=b"m",
    )
    record = task.to_record()
    assert list(record) == [
        "round",
        "num-rounds",
        "mask-seed",
        "keep",
        "mask-scope",
        "local-epochs",
        "batch-size",
        "lr",
        "momentum",
        "base-version",
        "model-version",
        "model",
    ]
    assert [type(v) for v in record.values()] == [int] * 4 + [str] + [int] * 2 + [float] * 2 + [
        int
    ] * 2 + [bytes]
    reply = TrainReply(
        update=b"u",
        num_examples=3,
        examples_seen=4,
        train_loss=0.1,
        epsilon=math.inf,
        noise_multiplier=1.1,
        keep=2,
    )
    config, metrics = reply.to_records()
    assert config == {"update": b"u"}
    assert metrics == {
        "num-examples": 3,
        "examples-seen": 4,
        "train-loss": 0.1,
        "epsilon": -1.0,  # inf: not private
        "noise-multiplier": 1.1,
        "keep": 2,
        "seeded-noise": 0,
    }


def _reply_records() -> tuple[dict, dict]:
    return TrainReply(
        update=b"u",
        num_examples=3,
        examples_seen=3,
        train_loss=0.1,
        epsilon=1.0,
        noise_multiplier=1.0,
        keep=1,
    ).to_records()


@pytest.mark.parametrize(
    ("record", "key", "value", "match"),
    [
        ("config", "update", 2**40, r"train reply: update=1099511627776: expected bytes, got int"),
        ("config", "update", "abc", r"update='abc': expected bytes, got str"),
        ("metrics", "num-examples", True, r"num-examples=True: expected int, got bool"),
        ("metrics", "num-examples", 1.5, r"num-examples=1.5: expected int, got float"),
        ("metrics", "num-examples", 2**70, r"num-examples=.*: expected a 64-bit integer"),
        ("metrics", "epsilon", -3.0, r"epsilon=-3.0: expected >= 0"),
        ("metrics", "epsilon", math.nan, r"epsilon=nan: expected >= 0"),
        ("metrics", "noise-multiplier", math.inf, r"noise-multiplier=inf: expected a finite"),
        ("metrics", "keep", [1, 2], r"keep=\[1, 2\]: expected int, got list"),
        ("metrics", "seeded-noise", 2, r"seeded-noise=2: expected 0 or 1"),
    ],
)
def test_bad_reply_fields_are_named(record: str, key: str, value, match: str) -> None:
    config, metrics = _reply_records()
    (config if record == "config" else metrics)[key] = value
    with pytest.raises(ProtocolError, match=match):
        TrainReply.from_records(config, metrics)


def test_missing_keys_and_records_are_named() -> None:
    config, metrics = _reply_records()
    del metrics["train-loss"]
    with pytest.raises(ProtocolError, match="train reply: missing key 'train-loss'"):
        TrainReply.from_records(config, metrics)
    with pytest.raises(ProtocolError, match="expected a record"):
        TrainInstruction.from_record([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("round", 0, r"round=0: expected 1 <= round <= num-rounds=10"),
        ("round", 11, r"round=11"),
        ("mask-scope", "all", r"mask-scope='all': expected one of round, client"),
        ("keep", -1, r"keep=-1: expected >= 0"),
        ("mask-seed", -5, r"mask-seed=-5"),
        ("lr", math.nan, r"lr=nan: expected a finite value > 0"),
        ("batch-size", 0, r"batch-size=0: expected >= 1"),
        ("model", None, r"model=None: expected bytes, got NoneType"),
    ],
)
def test_bad_instruction_fields_are_named(key: str, value, match: str) -> None:
    record = TrainInstruction(
        server_round=1,
        num_rounds=10,
        mask_seed=5,
        keep=9,
        mask_scope="round",
        local_epochs=1,
        batch_size=32,
        lr=0.5,
        momentum=0.0,
        base_version=-1,
        model_version=0,
        model=b"m",
    ).to_record()
    record[key] = value
    with pytest.raises(ProtocolError, match=match):
        TrainInstruction.from_record(record)


def test_seeds_come_from_the_registry_and_are_pinned() -> None:
    """The wire depends on these: a change would regenerate other masks on old nodes."""
    assert round_seed(0, 1) == stream_seed(0, Stream.ROUND_MASK, 1) == 8518276903192261680
    assert client_mask_seed(7, 1001) == stream_seed(7, Stream.CLIENT_MASK, 1001)
    assert client_mask_seed(7, 1001) == 4208161663410830846
    assert stream_seed(0, Stream.CLIENT_SELECTION) == 1788728487251936618
    assert len({round_seed(0, r) for r in range(1, 101)}) == 100
    streams = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 0xD0D0, 0x5EED, 0xC11E, 0xC0FFEE}
    assert {int(s) for s in Stream} == streams
    # The later streams, pinned too: every party derives the ranking noise and DP-SSGD's split.
    assert stream_seed(0, Stream.RANKING_NOISE, 2) == 2140077671786211028
    assert stream_seed(0, Stream.PUBLIC_SPLIT) == 3196842989531307819
    assert stream_seed(0, Stream.PUBLIC_PRETRAIN) == 831481152648434082
    # Private, but pinned so that seeded simulations stay reproducible across versions.
    assert stream_seed(0, Stream.INDEX_SELECTION) == 8511229059162262994
    # Public: the lossy downlink's rounding, which a resumed run repeats.
    assert stream_seed(0, Stream.DOWNLINK_ROUNDING, 1) == 6028307450975431297
    # Private, seeded in simulation only: a node's secure-aggregation rounding and share.
    assert stream_seed(0, Stream.SECAGG_NOISE) == 5730991735984000148
    assert len({stream_seed(0, s) for s in Stream}) == len(Stream)
