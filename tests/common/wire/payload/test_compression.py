"""The zstd stage: what it shrinks, and the decoder's checks of compressed sections."""

from __future__ import annotations

import pytest
import torch

from fedsparse.common.wire.payload import PayloadError, decode_update, encode_update
from tests.common.wire.payload.helpers import VALID_VALUES, ZSTD, sections, v2, zstd_frame


def test_zstd_shrinks_redundant_sections_and_leaves_empty_ones_empty() -> None:
    d = 100_000
    idx = torch.arange(0, d, 4)  # a regular support: highly compressible
    values = torch.ones(len(idx))
    plain = encode_update(values, dense_size=d, round=0, indices=idx, encoding="coo")
    packed = encode_update(
        values, dense_size=d, round=0, indices=idx, encoding="coo", compression="zstd"
    )
    # zstd has no delta stage: arithmetic int32 indices shrink only a few times, while
    # repeated values collapse.
    assert sections(packed)[1] < sections(plain)[1] / 50
    assert sections(packed)[0] < sections(plain)[0] and len(packed) < len(plain) / 2
    update = decode_update(packed)
    assert torch.equal(update.indices, idx) and torch.equal(update.values, values)
    seeded = encode_update(torch.zeros(0), dense_size=d, round=0, mask_seed=1, compression="zstd")
    assert sections(seeded) == (0, 0)


# --- the decoder's checks of zstd frames ----------------------------------------------------------


REJECTED: list[tuple[str, bytes, str]] = [
    ("zstd garbage", v2(**ZSTD, values=b"\x01\x02\x03"), r"^indices: not a zstd frame"),
    (
        "zstd no content size",
        v2(**ZSTD, indices=zstd_frame(bytes([5, 0, 0x80, 0x01]), content_size=False)),
        r"^indices: zstd frame without a content size",
    ),
    (
        "zstd wrong size",
        v2(**ZSTD, indices=zstd_frame(bytes([5, 0, 0x80, 0x01])), values=zstd_frame(b"\1\2")),
        r"^values: zstd content size 2, expected 3\.\.3",
    ),
    (
        "zstd bomb",
        v2(**ZSTD, indices=zstd_frame(bytes(10**6))),
        r"^indices: zstd content size 1000000, expected 3\.\.27",
    ),
    (
        "zstd trailing bytes",
        v2(
            **ZSTD,
            indices=zstd_frame(bytes([5, 0, 0x80, 0x01])),
            values=zstd_frame(VALID_VALUES) + b"\0",
        ),
        r"^values: corrupt zstd frame",
    ),
    (
        "zstd empty content",
        v2(**ZSTD, indices=zstd_frame(bytes([5, 0, 0x80, 0x01])), values=zstd_frame(b"")),
        r"^values: zstd content size 0",
    ),
    (
        "zstd inner error",
        v2(**ZSTD, indices=zstd_frame(bytes([5, 0, 0x80])), values=zstd_frame(VALID_VALUES)),
        r"^indices: truncated varint",
    ),
]


@pytest.mark.parametrize(("data", "match"), [c[1:] for c in REJECTED], ids=[c[0] for c in REJECTED])
def test_malformed_version_2_payloads_are_rejected(data: bytes, match: str) -> None:
    with pytest.raises(PayloadError, match=match):
        decode_update(data)
