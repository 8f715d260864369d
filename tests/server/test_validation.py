"""``max_payload_bytes``: the size bound checked before a reply's payload is parsed; the
low-bit dtypes' ``value-block`` checked against the run's."""

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from fedsparse.client.app import app as client_app
from fedsparse.common.masks import keep_count, sample_mask
from fedsparse.common.wire.payload import encode_update
from fedsparse.common.wire.protocol import CONFIG_RECORD, METRICS_RECORD, TrainReply
from fedsparse.lab.simulation.inprocess import InProcessGrid
from fedsparse.server.validation import (
    RejectedReply,
    accepted_encodings,
    check_reply,
    max_payload_bytes,
)

D = 5_000
SEED = 12345


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16", "int8", "int4", "int2", "int1"])
@pytest.mark.parametrize("encoding", ["seeded", "coo", "delta", "bitmap", "dense"])
def test_every_valid_payload_fits_and_the_bound_is_tight(encoding, dtype, compression) -> None:
    keep = D if encoding == "dense" else keep_count(D, rate=0.7)
    mask = sample_mask(D, keep=keep, seed=SEED)
    values = torch.randn(keep, generator=torch.Generator().manual_seed(0))
    payload = encode_update(
        values,
        dense_size=D,
        round=7,
        mask_seed=SEED if encoding == "seeded" else None,
        indices=None if encoding in ("seeded", "dense") else torch.nonzero(mask).flatten(),
        encoding=encoding,
        value_dtype=dtype,
        value_block=100,
        rounding=np.random.default_rng(0),
        compression=compression,
    )
    bound = max_payload_bytes(
        d=D,
        server_round=7,
        keep=keep,
        expected_seed=SEED if encoding == "seeded" else None,
        encodings=(encoding,),
        value_dtype=dtype,
        compression=compression,
        value_block=100,
    )
    assert len(payload) <= bound
    if compression == "none" and encoding != "delta":  # exact up to the compression field
        assert bound - len(payload) <= 2


def test_auto_takes_the_largest_encodings_bound() -> None:
    keep = keep_count(D, rate=0.5)
    kwargs = dict(d=D, server_round=1, keep=keep, expected_seed=SEED)
    kwargs |= dict(value_dtype="fp32", compression="none")
    each = {e: max_payload_bytes(encodings=(e,), **kwargs) for e in ("seeded", "coo", "delta")}
    both = max_payload_bytes(encodings=accepted_encodings("auto", sparse=True), **kwargs)
    assert both == max(each.values()) == each["delta"]  # 9 bytes per varint at worst
    assert each["seeded"] < each["coo"]


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


@pytest.mark.parametrize("dtype", ["int4", "int2", "int1"])
def test_a_lowbit_reply_must_carry_the_runs_value_block_and_dtype(dtype: str) -> None:
    keep = keep_count(D, rate=0.7)
    values = torch.randn(keep, generator=torch.Generator().manual_seed(1))

    def payload(block: int, value_dtype: str = dtype) -> bytes:
        return encode_update(
            values,
            dense_size=D,
            round=7,
            mask_seed=SEED,
            value_dtype=value_dtype,
            value_block=block,
            rounding=np.random.default_rng(2),
        )

    kwargs = dict(d=D, server_round=7, expected_seed=SEED, keep=keep, value_dtype=dtype)
    valid = check_reply(_reply(payload(64)), value_block=64, **kwargs)
    assert valid.payload_bytes == len(payload(64)) and valid.values.numel() == keep
    # a larger block: smaller, but not the run's
    with pytest.raises(RejectedReply, match=r"^value_block: 128, expected 64 \(the run's\)$"):
        check_reply(_reply(payload(128)), value_block=64, **kwargs)
    # a smaller block: more steps than the run's largest payload holds, refused unparsed
    with pytest.raises(RejectedReply, match=r"^payload: \d+ bytes, exceeds max_bytes=\d+$"):
        check_reply(_reply(payload(8)), value_block=64, **kwargs)
    with pytest.raises(RejectedReply, match=r"^payload: \d+ bytes, exceeds max_bytes=\d+$"):
        check_reply(_reply(payload(64, "fp32")), value_block=64, **kwargs)  # 4 bytes a value
    # a low-bit reply in an fp32 run: the dtype names the mismatch
    with pytest.raises(RejectedReply, match=rf"^value_dtype: '{dtype}', expected 'fp32'"):
        check_reply(_reply(payload(64)), **{**kwargs, "value_dtype": "fp32"})
