"""What the payload codec's tests share: constants, strategies, exact sizes, fixtures.

``update_args`` draws a valid format-1 ``encode_update`` call; ``size_of`` and ``size_for`` are
the analytic sizes the encoded bytes must match. ``message``/``serialize`` build a valid
format-1 message to break one field at a time; ``v2`` does the same for a version-2
delta/int8 message (the codecs' new fields), and ``zstd_frame`` wraps a section in a
Zstandard frame.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import zstandard
from hypothesis import strategies as st

from fedsparse.common.wire.payload import SparseUpdate, encode_update, payload_size
from fedsparse.v1 import payload_pb2 as pb

# Format version 1 (seeded/dense/COO, fp32/fp16/bf16); the package's ENCODINGS and VALUE_DTYPES
# add the version-2 codecs (delta, bitmap, int8). The low-bit dtypes (int4, int2, int1) have
# their own tests (test_lowbit.py); the exact-size test, the version-1 fuzz and the malformed
# table include them too.
V1_ENCODINGS = ("seeded", "dense", "coo")
V1_VALUE_DTYPES = ("fp32", "fp16", "bf16")
LOWBIT_DTYPES = ("int4", "int2", "int1")
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
U32, U64 = 2**32, 2**64
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
F32_MAX = float(np.finfo(np.float32).max)


@st.composite
def update_args(
    draw: st.DrawFn, *, max_keep: int = 48, max_dense: int = 5000
) -> tuple[torch.Tensor, dict[str, Any], str]:
    """A valid ``encode_update`` call: (values, kwargs, encoding)."""
    value_dtype = draw(st.sampled_from(V1_VALUE_DTYPES))
    encoding = draw(st.sampled_from(V1_ENCODINGS))
    if encoding == "dense":
        dense_size = keep = draw(st.integers(1, max_keep))
    else:
        dense_size = draw(st.integers(1, max_dense))
        keep = draw(st.integers(0, min(dense_size, max_keep)))
    bound = float(torch.finfo(TORCH_DTYPES[value_dtype]).max)
    floats = st.floats(-bound, bound, width=32, allow_nan=False, allow_infinity=False)
    values = torch.tensor(draw(st.lists(floats, min_size=keep, max_size=keep)), dtype=torch.float32)
    kwargs: dict[str, Any] = {
        "dense_size": dense_size,
        "round": draw(st.integers(0, U32 - 1)),
        "value_dtype": value_dtype,
        "encoding": encoding,
    }
    if encoding == "seeded":
        kwargs["mask_seed"] = draw(st.integers(0, U64 - 1))
    elif encoding == "coo":
        idx = draw(st.sets(st.integers(0, dense_size - 1), min_size=keep, max_size=keep))
        kwargs["indices"] = torch.tensor(sorted(idx), dtype=torch.int64)
    return values, kwargs, encoding


def encode(kwargs: dict[str, Any]) -> bytes:
    return encode_update(kwargs["values"], **{k: v for k, v in kwargs.items() if k != "values"})


def size_of(kwargs: dict[str, Any], *, keep: int, encoding: str) -> int:
    return payload_size(
        keep=keep,
        dense_size=kwargs["dense_size"],
        round=kwargs["round"],
        encoding=encoding,
        value_dtype=kwargs["value_dtype"],
        mask_seed=kwargs.get("mask_seed", 0),
        **({"value_block": kwargs["value_block"]} if "value_block" in kwargs else {}),
    )


def sections(data: bytes) -> tuple[int, int]:
    """(indices, values) field lengths of a serialized payload."""
    msg = pb.SparseUpdate.FromString(data)
    return len(msg.indices), len(msg.values)


def size_for(update: SparseUpdate, data: bytes) -> int:
    """``payload_size`` of a decoded update (compressed sections measured from ``data``)."""
    return payload_size(
        keep=update.keep,
        dense_size=update.dense_size,
        round=update.round,
        encoding=update.encoding,
        value_dtype=update.value_dtype,
        mask_seed=update.mask_seed or 0,
        indices=update.indices,
        compression=update.compression,
        compressed_sizes=sections(data) if update.compression == "zstd" else None,
    )


# --- fixture payloads to break one field at a time ------------------------------------------------


def message(encoding: str = "seeded", keep: int = 4, value_dtype: str = "fp32") -> pb.SparseUpdate:
    """A valid message (dense_size=10, round=3) to break one field at a time."""
    nbytes = DTYPE_BYTES[value_dtype]
    msg = pb.SparseUpdate(
        format_version=1,
        dense_size=keep if encoding == "dense" else 10,
        round=3,
        index_encoding={"seeded": 1, "dense": 2, "coo": 3}[encoding],
        keep=keep,
        value_dtype={"fp32": 1, "fp16": 2, "bf16": 3}[value_dtype],
        values=b"\x00" * (nbytes * keep),
    )
    if encoding == "seeded":
        msg.mask_seed = 77
    if encoding == "coo":
        msg.indices = np.arange(0, 2 * keep, 2, dtype="<i4").tobytes()
    return msg


def serialize(msg: pb.SparseUpdate) -> bytes:
    return msg.SerializeToString(deterministic=True)


def v2(**fields: Any) -> bytes:
    """A valid delta/int8 message (d=1000, keep=3) with ``fields`` overriding."""
    msg = pb.SparseUpdate(
        format_version=2,
        dense_size=1000,
        round=1,
        index_encoding=pb.INDEX_ENCODING_DELTA_VARINT,
        keep=3,
        value_dtype=pb.VALUE_DTYPE_INT8,
        indices=bytes([5, 0, 0x80, 0x01]),  # indices 5, 6, 135
        values=bytes([1, 2, 0xFF]),
        value_scale=0.5,
    )
    for name, value in fields.items():
        if value is None:
            msg.ClearField(name)
        else:
            setattr(msg, name, value)
    return msg.SerializeToString(deterministic=True)


def zstd_frame(raw: bytes, *, content_size: bool = True) -> bytes:
    return zstandard.ZstdCompressor(write_content_size=content_size).compress(raw)


BITMAP = {"index_encoding": pb.INDEX_ENCODING_BITMAP, "dense_size": 10}
ZSTD = {"compression": pb.COMPRESSION_ZSTD}
VALID_VALUES = bytes([1, 2, 0xFF])
