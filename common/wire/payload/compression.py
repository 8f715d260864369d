"""Optional Zstandard stage: each non-empty section is one zstd frame (RFC 8878).

The encoder writes the frame's content size; the decoder checks that size against the bounds
the header allows before it allocates anything, so a small frame cannot expand into a large
buffer (a "zip bomb"), and it rejects dictionaries and trailing bytes so that only the
canonical form is accepted.
"""

from __future__ import annotations

import zstandard

from fedsparse.common.wire.payload.schema import PayloadError

__all__ = ["ZSTD_LEVEL", "unzstd", "zstd"]

ZSTD_LEVEL = 3


def zstd(raw: bytes) -> bytes:
    """One zstd frame with its content size (empty stays empty)."""
    if not raw:
        return b""
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(raw)


def unzstd(field: str, frame: bytes, lo: int, hi: int) -> bytes:
    """Decompresses one validated zstd frame whose content size lies in ``[lo, hi]``.

    An empty section stands for an empty one; a frame must declare a nonzero content size
    (checked before anything is allocated), use no dictionary and have no trailing bytes.
    """
    if not frame:
        if lo > 0:
            raise PayloadError(f"{field}: empty, expected a zstd frame of {lo}..{hi} bytes")
        return b""
    try:
        params = zstandard.get_frame_parameters(frame)
    except zstandard.ZstdError as exc:
        raise PayloadError(f"{field}: not a zstd frame ({len(frame)} bytes: {exc})") from exc
    size = params.content_size
    if size in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR):
        raise PayloadError(f"{field}: zstd frame without a content size")
    if size == 0 or not lo <= size <= hi:
        raise PayloadError(f"{field}: zstd content size {size}, expected {lo}..{hi} (nonzero)")
    if params.dict_id != 0:
        raise PayloadError(f"{field}: zstd dictionary {params.dict_id}, expected none")
    try:
        raw = zstandard.ZstdDecompressor().decompress(
            frame, max_output_size=size, allow_extra_data=False
        )
    except zstandard.ZstdError as exc:
        raise PayloadError(f"{field}: corrupt zstd frame ({exc})") from exc
    if len(raw) != size:
        raise PayloadError(f"{field}: zstd frame gave {len(raw)} bytes, declared {size}")
    return raw
