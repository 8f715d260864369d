"""The index codecs (delta varints, bitmaps): golden bytes and the decoder's checks.

COO indices, the encoder's index checks and ``auto`` are tested in test_api.py and
test_sizing.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsparse.common.wire.payload import PayloadError, decode_update, encode_update
from fedsparse.v1 import payload_pb2 as pb
from tests.common.wire.payload.helpers import BITMAP, v2


def test_golden_version_2_bytes() -> None:
    """Pins the version-2 layout: LEB128 gaps, little-endian bitmaps, int8 + fixed32 scale."""
    v = torch.tensor([1.0, -0.5, 0.25, 2.0])
    delta = encode_update(
        v, dense_size=400, round=0, indices=torch.tensor([0, 1, 129, 300]), encoding="delta"
    )
    msg = pb.SparseUpdate.FromString(delta)
    assert msg.format_version == 2 and msg.index_encoding == pb.INDEX_ENCODING_DELTA_VARINT
    assert msg.indices.hex() == "00007faa01"  # gaps 0, 0, 127, 170
    bitmap = encode_update(
        v[:3], dense_size=10, round=0, indices=torch.tensor([0, 3, 9]), encoding="bitmap"
    )
    assert pb.SparseUpdate.FromString(bitmap).indices.hex() == "0902"
    int8 = encode_update(v[:3], dense_size=3, round=0, value_dtype="int8")
    # scale 1/127; -0.5 * 127 = -63.5 ties to even (-64); 0.25 * 127 = 31.75 -> 32.
    assert int8.hex() == "08021003200230034004" + "5a037fc020" + "65" + "0402013c"
    assert np.float32(1 / 127).tobytes().hex() == "0402013c"
    assert decode_update(int8).values.tolist() == [
        float(np.float32(q) * np.float32(1 / 127)) for q in (127, -64, 32)
    ]


# --- the decoder's checks of delta and bitmap indices ---------------------------------------------


REJECTED: list[tuple[str, bytes, str]] = [
    ("truncated varint", v2(indices=bytes([5, 0, 0x80])), r"^indices: truncated varint"),
    ("too few varints", v2(indices=bytes([5, 0])), r"^indices: 2 varints in 2 bytes"),
    ("too many varints", v2(indices=bytes([5, 0, 1, 1])), r"^indices: 4 varints"),
    ("overlong varint", v2(indices=bytes([5, 0x80, 0x00, 1])), r"^indices: varint 1 is not min"),
    ("10-byte varint", v2(indices=bytes([5, 0, *[0x80] * 9, 1])), r"^indices: varint 2 has 10"),
    ("gap past d", v2(indices=bytes([5, 0, 0xE8, 0x07])), r"^indices: gap 1000 at position 2"),
    ("sum past d", v2(indices=bytes([0xE7, 0x07, 0x10, 0x10])), r"^indices: last index 1033"),
    ("bitmap length", v2(**BITMAP, indices=b"\x07"), r"^indices: 1 bytes, expected 2 bitmap"),
    ("bitmap popcount", v2(**BITMAP, indices=b"\x0f\x00"), r"^indices: bitmap has 4 bits set"),
    ("bitmap padding", v2(**BITMAP, indices=b"\x03\x04"), r"^indices: padding bits past"),
]


@pytest.mark.parametrize(("data", "match"), [c[1:] for c in REJECTED], ids=[c[0] for c in REJECTED])
def test_malformed_version_2_payloads_are_rejected(data: bytes, match: str) -> None:
    with pytest.raises(PayloadError, match=match):
        decode_update(data)
