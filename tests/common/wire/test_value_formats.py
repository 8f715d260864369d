"""Value dtypes and codecs by what they do (``common/wire/value_formats.py``): every
dtype's norm bound holds for the real codec's bytes; the encodings each codec picks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsparse.common.names import CODECS, PAYLOAD_DTYPES
from fedsparse.common.wire.payload import decode_update, encode_update
from fedsparse.common.wire.value_formats import (
    VALUE_FORMATS,
    explicit_encoding,
    value_format,
    wire_encoding,
)


def test_every_dtype_has_a_format_and_unknown_names_are_named() -> None:
    assert tuple(VALUE_FORMATS) == PAYLOAD_DTYPES
    with pytest.raises(ValueError, match="value_dtype='int3': expected one of fp32"):
        value_format("int3")
    with pytest.raises(ValueError, match="codec='zip': expected one of values"):
        explicit_encoding("zip")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", PAYLOAD_DTYPES)
def test_the_norm_bound_holds_for_the_codecs_bytes(name: str) -> None:
    """Over 20 seeded draws of heavy-tailed values (and their rounding), the decoded values'
    norm never exceeds ``grown_norm``; fp32 is exact."""
    fmt = value_format(name)
    rng = np.random.default_rng(7)
    for draw in range(20):
        values = torch.from_numpy(rng.standard_t(2, size=300).astype(np.float32))
        payload = encode_update(
            values,
            dense_size=300,
            round=1,
            value_dtype=name,  # type: ignore[arg-type]
            value_block=64,
            rounding=np.random.default_rng(draw),
        )
        decoded = decode_update(payload).values.double()
        norm = float(values.double().norm())
        assert float(decoded.norm()) <= fmt.grown_norm(norm, keep=300, block=64), draw
    if name == "fp32":
        assert fmt.grown_norm(1.0, keep=300) == 1.0 and fmt.contraction() == (0.0, 0.0)
    assert (fmt.contraction() is None) == (name in ("int2", "int1"))


def test_each_codec_picks_its_encoding() -> None:
    assert {c: wire_encoding(c, sparse=True) for c in CODECS} == {
        "values": "seeded",
        "coo": "coo",
        "delta": "delta",
        "bitmap": "bitmap",
        "auto": "auto",
    }
    assert {wire_encoding(c, sparse=False) for c in CODECS} == {"dense"}
    assert [explicit_encoding(c) for c in CODECS] == ["auto", "coo", "delta", "bitmap", "auto"]
