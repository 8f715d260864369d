"""The payload's names and header fields: literal types, enums, versions, the int8 scale field."""

from __future__ import annotations

import math
from typing import get_args

import pytest
import torch

from fedsparse.common.wire import payload
from fedsparse.common.wire.payload import (
    COMPRESSIONS,
    ENCODINGS,
    EXPLICIT_ENCODINGS,
    VALUE_DTYPES,
    PayloadError,
    decode_update,
    encode_update,
)
from fedsparse.v1 import payload_pb2 as pb
from tests.common.wire.payload.helpers import message, serialize, v2


def test_name_tuples_are_the_literal_types_in_tie_break_order() -> None:
    assert ENCODINGS == ("seeded", "dense", "coo", "delta", "bitmap")  # choose_encoding ties
    assert get_args(payload.Encoding) == ENCODINGS
    assert get_args(payload.IndexEncoding) == payload.INDEX_ENCODINGS == (*ENCODINGS, "auto")
    assert get_args(payload.ExplicitEncoding) == EXPLICIT_ENCODINGS == ENCODINGS[2:]
    assert get_args(payload.ValueDType) == VALUE_DTYPES == ("fp32", "fp16", "bf16", "int8")
    assert get_args(payload.Compression) == COMPRESSIONS == ("none", "zstd")


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("value_dtype", 0, r"^value_dtype: 0, expected one of"),
        ("value_dtype", 9, r"^value_dtype: 9, expected one of"),
        ("index_encoding", 0, r"^index_encoding: 0, expected one of"),
        ("index_encoding", 7, r"^index_encoding: 7, expected one of"),
    ],
)
def test_unknown_enums_are_rejected(field: str, value: int, match: str) -> None:
    msg = message()
    setattr(msg, field, value)  # proto3 enums are open: unknown numbers parse
    with pytest.raises(PayloadError, match=match):
        decode_update(serialize(msg))


# --- the decoder's checks of version-2 header fields ----------------------------------------------


REJECTED: list[tuple[str, bytes, str]] = [
    ("v1 with delta", v2(format_version=1), r"^format_version: 1, expected 2"),
    (
        "v2 for a v1 payload",
        encode_update(torch.ones(2), dense_size=2, round=0).replace(b"\x08\x01", b"\x08\x02", 1),
        r"^format_version: 2, expected 1 for dense/fp32/none",
    ),
    ("version 3", v2(format_version=3), r"^format_version: 3, expected one of \(1, 2\)"),
    ("unknown compression", v2(compression=7), r"^compression: 7, expected one of"),
    ("delta huge d", v2(dense_size=2**62), r"^dense_size: 4611686018427387904, expected < 2\*\*62"),
    ("int8 no scale", v2(value_scale=None), r"^value_scale: absent"),
    ("int8 nan scale", v2(value_scale=math.nan), r"^value_scale: nan, expected a finite"),
    ("int8 inf scale", v2(value_scale=math.inf), r"^value_scale: inf"),
    ("int8 negative scale", v2(value_scale=-1.0), r"^value_scale: -1.0"),
    ("int8 -0.0 scale", v2(value_scale=-0.0), r"^value_scale: -0.0"),
    (
        "fp32 with scale",
        v2(value_dtype=pb.VALUE_DTYPE_FP32, values=b"\0" * 12),
        r"^value_scale: 0.5, expected absent for fp32",
    ),
]


@pytest.mark.parametrize(("data", "match"), [c[1:] for c in REJECTED], ids=[c[0] for c in REJECTED])
def test_malformed_version_2_payloads_are_rejected(data: bytes, match: str) -> None:
    with pytest.raises(PayloadError, match=match):
        decode_update(data)
