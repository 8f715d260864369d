"""The wire schema: names and enum numbers, argument checks, and parsed-field checks.

The string names (``Encoding``, ``ValueDType``, ``Compression``) are what callers pass and what
``SparseUpdate`` carries; the proto enums are what travels. ``parse`` and the ``check_*_fields``
functions are the schema half of the decoder's trust boundary: they look at the header fields of
a parsed message, never at the bytes of its sections (``indices``, ``values``, ``compression``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, cast, get_args

import numpy as np
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet

from fedsparse.common.names import (
    COMPRESSIONS,
    LOWBIT_DTYPES,
    PAYLOAD_DTYPES,
    VALUE_DTYPES,
    Compression,
    LowBitDType,
    PayloadDType,
    ValueDType,
)
from fedsparse.v1 import payload_pb2 as pb

__all__ = [
    "COMPRESSIONS",
    "COMPRESSION_NAME",
    "COMPRESSION_WIRE",
    "COO_BOUND",
    "DEFAULT_VALUE_BLOCK",
    "DELTA_BITMAP_BOUND",
    "DTYPE_NAME",
    "DTYPE_WIRE",
    "ENCODINGS",
    "ENCODING_NAME",
    "ENCODING_WIRE",
    "EXPLICIT_ENCODINGS",
    "FORMAT_VERSION",
    "INDEX_ENCODINGS",
    "LOWBIT_DTYPES",
    "MAX_VARINT_BYTES",
    "PAYLOAD_DTYPES",
    "SUPPORTED_VERSIONS",
    "U32",
    "U64",
    "VALUE_DTYPES",
    "Compression",
    "Encoding",
    "ExplicitEncoding",
    "IndexEncoding",
    "LowBitDType",
    "PayloadDType",
    "PayloadError",
    "ValueDType",
    "check_compression",
    "check_block_fields",
    "check_encoding",
    "check_int",
    "check_scale",
    "check_support_fields",
    "check_value_dtype",
    "expect",
    "first_bad",
    "min_version",
    "parse",
]

ExplicitEncoding = Literal["coo", "delta", "bitmap"]
"""Index encodings that put the support on the wire."""
Encoding = Literal[Literal["seeded", "dense"], ExplicitEncoding]
"""How the support travels, in tie-break order for ``choose_encoding``."""
IndexEncoding = Literal[Encoding, Literal["auto"]]
"""What ``encode_update`` accepts: an ``Encoding`` or ``"auto"`` (the smallest)."""

ENCODINGS: tuple[Encoding, ...] = get_args(Encoding)
INDEX_ENCODINGS: tuple[IndexEncoding, ...] = get_args(IndexEncoding)
EXPLICIT_ENCODINGS: tuple[ExplicitEncoding, ...] = get_args(ExplicitEncoding)

FORMAT_VERSION = 2
SUPPORTED_VERSIONS = (1, 2)
_V1_DTYPES = ("fp32", "fp16", "bf16")
_V1_ENCODINGS = ("seeded", "dense", "coo")
U32 = 1 << 32  # exclusive bound of a uint32 field (round)
U64 = 1 << 64  # exclusive bound of a uint64 field (dense_size, keep, mask_seed)
COO_BOUND = 1 << 31  # coo indices are int32: each in [0, 2**31)
DELTA_BITMAP_BOUND = 1 << 62  # delta/bitmap: dense_size bound that keeps index sums in int64
MAX_VARINT_BYTES = 9  # 63 bits: every gap < dense_size < 2**62 fits
DEFAULT_VALUE_BLOCK = 256  # values per float32 step of the low-bit dtypes (see lowbit.py)

DTYPE_WIRE: dict[PayloadDType, pb.ValueDtype] = {
    "fp32": pb.VALUE_DTYPE_FP32,
    "fp16": pb.VALUE_DTYPE_FP16,
    "bf16": pb.VALUE_DTYPE_BF16,
    "int8": pb.VALUE_DTYPE_INT8,
    "int4": pb.VALUE_DTYPE_INT4,
    "int2": pb.VALUE_DTYPE_INT2,
    "int1": pb.VALUE_DTYPE_INT1,
}
ENCODING_WIRE: dict[Encoding, pb.IndexEncoding] = {
    "seeded": pb.INDEX_ENCODING_SEEDED_MASK,
    "dense": pb.INDEX_ENCODING_DENSE,
    "coo": pb.INDEX_ENCODING_COO_INT32,
    "delta": pb.INDEX_ENCODING_DELTA_VARINT,
    "bitmap": pb.INDEX_ENCODING_BITMAP,
}
COMPRESSION_WIRE: dict[Compression, pb.Compression] = {
    "none": pb.COMPRESSION_NONE,
    "zstd": pb.COMPRESSION_ZSTD,
}
DTYPE_NAME: dict[int, PayloadDType] = {int(v): k for k, v in DTYPE_WIRE.items()}
ENCODING_NAME: dict[int, Encoding] = {int(v): k for k, v in ENCODING_WIRE.items()}
COMPRESSION_NAME: dict[int, Compression] = {int(v): k for k, v in COMPRESSION_WIRE.items()}


class PayloadError(ValueError):
    """A payload failed validation; the message names the field and the bad value."""


def min_version(encoding: str, value_dtype: str, compression: str) -> int:
    """The lowest format version that can express a payload with these parts."""
    v1 = encoding in _V1_ENCODINGS and value_dtype in _V1_DTYPES and compression == "none"
    return 1 if v1 else 2


# --- caller arguments (ValueError) -------------------------------------------------------------


def check_int(name: str, value: int, lo: int, hi: int) -> int:
    """``value`` as a Python int in ``[lo, hi)``; rejects bools and non-integers."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name}={value!r}: expected an integer")
    if not lo <= int(value) < hi:
        raise ValueError(f"{name}={value}: expected {lo} <= {name} < {hi}")
    return int(value)


def check_value_dtype(value_dtype: str) -> PayloadDType:
    """``value_dtype`` if it is one of ``PAYLOAD_DTYPES``, else ValueError."""
    if value_dtype not in PAYLOAD_DTYPES:
        raise ValueError(f"value_dtype={value_dtype!r}: expected one of {PAYLOAD_DTYPES}")
    return cast(PayloadDType, value_dtype)


def check_encoding(encoding: str) -> Encoding:
    """``encoding`` if it is one of ``ENCODINGS`` (not ``"auto"``), else ValueError."""
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding={encoding!r}: expected one of {ENCODINGS}")
    return cast(Encoding, encoding)


def check_compression(compression: str) -> Compression:
    """``compression`` if it is one of ``COMPRESSIONS``, else ValueError."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression={compression!r}: expected one of {COMPRESSIONS}")
    return cast(Compression, compression)


# --- parsed fields (PayloadError) --------------------------------------------------------------


def first_bad(bad: np.ndarray) -> int:
    """Position of the first True in a boolean array (for error messages)."""
    return int(np.flatnonzero(bad)[0])


def expect(field: str, value: int | str, expected: int | str | None) -> None:
    """PayloadError unless ``expected`` is None or equals ``value``."""
    if expected is not None and value != expected:
        raise PayloadError(f"{field}: {value!r}, expected {expected!r}")


def parse(data: bytes) -> pb.SparseUpdate:
    """Protobuf parse plus the schema-level checks (unknown fields, version, enums, size)."""
    msg = pb.SparseUpdate()
    try:
        msg.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError, OverflowError, MemoryError) as exc:
        raise PayloadError(
            f"payload: not a fedsparse.v1.SparseUpdate ({len(data)} bytes: {exc})"
        ) from exc
    unknown = sorted({field.field_number for field in UnknownFieldSet(msg)})
    if unknown:
        raise PayloadError(f"payload: unknown field number(s) {unknown} (newer format?)")
    if msg.format_version not in SUPPORTED_VERSIONS:
        raise PayloadError(
            f"format_version: {msg.format_version}, expected one of {SUPPORTED_VERSIONS}"
        )
    names: Mapping[int, str]
    for field, names in (
        ("value_dtype", DTYPE_NAME),
        ("index_encoding", ENCODING_NAME),
        ("compression", COMPRESSION_NAME),
    ):
        if getattr(msg, field) not in names:
            raise PayloadError(f"{field}: {getattr(msg, field)}, expected one of {names}")
    if msg.dense_size == 0:
        raise PayloadError("dense_size: 0, expected > 0")
    encoding = ENCODING_NAME[msg.index_encoding]
    dtype = DTYPE_NAME[msg.value_dtype]
    compression = COMPRESSION_NAME[msg.compression]
    version = min_version(encoding, dtype, compression)
    if msg.format_version != version:
        raise PayloadError(
            f"format_version: {msg.format_version}, expected {version} for "
            f"{encoding}/{dtype}/{compression} (the lowest version that expresses it)"
        )
    return msg


def check_support_fields(msg: pb.SparseUpdate, encoding: Encoding) -> None:
    """``keep``, ``mask_seed`` and ``indices`` consistent with the encoding (not index values)."""
    if msg.keep > msg.dense_size:
        raise PayloadError(f"keep: {msg.keep}, expected <= dense_size={msg.dense_size}")
    if encoding != "seeded" and msg.mask_seed != 0:
        raise PayloadError(f"mask_seed: {msg.mask_seed}, expected 0 for {encoding} encoding")
    if encoding == "dense" and msg.keep != msg.dense_size:
        raise PayloadError(
            f"keep: {msg.keep}, expected dense_size={msg.dense_size} for dense encoding"
        )
    if encoding not in EXPLICIT_ENCODINGS and msg.indices:
        raise PayloadError(f"indices: {len(msg.indices)} bytes, expected 0 for {encoding} encoding")
    if encoding in ("delta", "bitmap") and msg.dense_size >= DELTA_BITMAP_BOUND:
        raise PayloadError(
            f"dense_size: {msg.dense_size}, expected < 2**62 for {encoding} encoding"
        )


def check_scale(msg: pb.SparseUpdate, dtype: PayloadDType) -> float | None:
    """The int8 scale: present iff int8, finite, >= 0 (not -0.0); None for other dtypes."""
    present = msg.HasField("value_scale")
    if dtype != "int8":
        if present:
            raise PayloadError(f"value_scale: {msg.value_scale}, expected absent for {dtype}")
        return None
    if not present:
        raise PayloadError("value_scale: absent, expected a scale for int8 values")
    scale = float(msg.value_scale)
    if not np.isfinite(scale) or scale < 0 or np.signbit(scale):
        raise PayloadError(f"value_scale: {scale}, expected a finite value >= 0")
    return scale


def check_block_fields(msg: pb.SparseUpdate, dtype: PayloadDType) -> int | None:
    """The low-bit block size: ``value_block >= 1`` and ``ceil(keep / value_block)`` float32
    ``value_scales`` for int4/int2/int1 (checked before anything is allocated), both absent
    for every other dtype. Returns the block size, or None. The scales' values are checked by
    ``lowbit.dequantize_blocks``.
    """
    if dtype not in LOWBIT_DTYPES:
        if msg.value_block:
            raise PayloadError(f"value_block: {msg.value_block}, expected 0 (absent) for {dtype}")
        if msg.value_scales:
            raise PayloadError(
                f"value_scales: {len(msg.value_scales)} bytes, expected 0 (absent) for {dtype}"
            )
        return None
    if msg.value_block == 0:
        raise PayloadError(f"value_block: 0, expected >= 1 for {dtype}")
    blocks = -(-msg.keep // msg.value_block)
    if len(msg.value_scales) != 4 * blocks:
        raise PayloadError(
            f"value_scales: {len(msg.value_scales)} bytes, expected {4 * blocks} "
            f"(ceil(keep={msg.keep} / value_block={msg.value_block}) x 4 bytes float32)"
        )
    return int(msg.value_block)
