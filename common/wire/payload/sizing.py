"""Exact payload sizes from the protobuf wire rules, and the smallest encoding they imply.

``payload_size`` is analytic: it never serializes, so it also sizes payloads far too large to
build (``dense_size`` up to ``2**64 - 1``). The decoder accepts canonical payloads only, so
``len(data) == payload_size(...)`` holds for every payload either side produces or accepts.
"""

from __future__ import annotations

import functools

import torch

from fedsparse.common.wire.payload.indices import gaps, varint_lengths
from fedsparse.common.wire.payload.schema import (
    COMPRESSION_WIRE,
    COO_BOUND,
    DEFAULT_VALUE_BLOCK,
    DELTA_BITMAP_BOUND,
    DTYPE_WIRE,
    ENCODING_WIRE,
    ENCODINGS,
    EXPLICIT_ENCODINGS,
    LOWBIT_DTYPES,
    MAX_VARINT_BYTES,
    U32,
    U64,
    Compression,
    Encoding,
    PayloadDType,
    check_compression,
    check_encoding,
    check_int,
    check_value_dtype,
    min_version,
)
from fedsparse.common.wire.payload.values import value_section_size

__all__ = [
    "choose_encoding",
    "index_section_bounds",
    "index_section_size",
    "information_limit",
    "payload_size",
    "scale_section_size",
]


def information_limit(*, keep: int, value_dtype: PayloadDType) -> int:
    """Bytes of the values alone, ``ceil(keep * bits(value_dtype) / 8)``: the floor for any
    payload (the low-bit dtypes add ``scale_section_size`` bytes of steps)."""
    return value_section_size(check_int("keep", keep, 0, U64), check_value_dtype(value_dtype))


def scale_section_size(
    *, keep: int, value_dtype: PayloadDType, value_block: int = DEFAULT_VALUE_BLOCK
) -> int:
    """Bytes of the ``value_scales`` section: ``4 * ceil(keep / value_block)`` float32 steps for
    int4/int2/int1, 0 for the other dtypes (whatever ``value_block`` is)."""
    keep = check_int("keep", keep, 0, U64)
    value_block = check_int("value_block", value_block, 1, U32)
    if check_value_dtype(value_dtype) not in LOWBIT_DTYPES:
        return 0
    return 4 * -(-keep // value_block)


def index_section_size(
    encoding: Encoding, *, keep: int, dense_size: int, indices: torch.Tensor | None = None
) -> int:
    """Bytes of the uncompressed ``indices`` section for ``encoding``.

    ``"seeded"`` and ``"dense"``: 0; ``"coo"``: ``4 * keep``; ``"bitmap"``:
    ``ceil(dense_size / 8)``; ``"delta"``: the varint lengths of the gaps, which needs
    ``indices`` (sorted, as passed to ``encode_update``).
    """
    check_encoding(encoding)
    if encoding in ("seeded", "dense"):
        return 0
    if encoding == "coo":
        return 4 * keep
    if encoding == "bitmap":
        return -(-dense_size // 8)
    if indices is None:
        raise ValueError("indices: required to size the 'delta' encoding")
    idx = indices.detach().cpu().to(torch.int64).numpy()
    return int(varint_lengths(gaps(idx)).sum())


def index_section_bounds(encoding: Encoding, keep: int, dense_size: int) -> tuple[int, int]:
    """(min, max) byte length of the uncompressed ``indices`` section (before reading it)."""
    if encoding not in EXPLICIT_ENCODINGS:
        return 0, 0
    if encoding == "coo":
        return 4 * keep, 4 * keep
    if encoding == "bitmap":
        return -(-dense_size // 8), -(-dense_size // 8)
    return keep, MAX_VARINT_BYTES * keep


def payload_size(
    *,
    keep: int,
    dense_size: int,
    round: int,
    encoding: Encoding,
    value_dtype: PayloadDType,
    mask_seed: int = 0,
    indices: torch.Tensor | None = None,
    compression: Compression = "none",
    compressed_sizes: tuple[int, int] | None = None,
    value_block: int = DEFAULT_VALUE_BLOCK,
) -> int:
    """Exact serialized size of ``encode_update``'s output, from the protobuf wire rules.

    Every field number is below 16, so each present field costs a 1-byte tag, plus a varint
    (scalars, enums), 4 bytes (the int8 ``value_scale``, always present for int8), or a varint
    length and the bytes (``indices``, ``values``, ``value_scales``). proto3 omits zero scalars
    and empty bytes. The low-bit dtypes add ``value_block`` (always) and ``value_scales``
    (``4 * ceil(keep / value_block)`` bytes, never compressed).

    Args:
        keep, dense_size, round, mask_seed, value_dtype, value_block: as for ``encode_update``
            (``value_block`` matters for int4/int2/int1 only).
        encoding: the resolved index encoding (one of ``ENCODINGS``, not ``"auto"``).
        indices: the support; needed for ``"delta"`` only (its size depends on the gaps).
        compression: ``"none"`` or ``"zstd"``.
        compressed_sizes: for ``"zstd"``, the (indices, values) section sizes after
            compression (0 for an empty section): zstd's output length depends on the data.

    Raises:
        ValueError: on out-of-range arguments, ``keep != dense_size`` for ``"dense"``, a
            nonzero ``mask_seed`` for an encoding other than ``"seeded"``, or missing
            ``indices``/``compressed_sizes`` where needed.
    """
    keep = check_int("keep", keep, 0, U64)
    dense_size = check_int("dense_size", dense_size, 1, U64)
    value_dtype = check_value_dtype(value_dtype)
    scale_bytes = scale_section_size(keep=keep, value_dtype=value_dtype, value_block=value_block)
    check_encoding(encoding)
    check_compression(compression)
    if keep > dense_size or (encoding == "dense" and keep != dense_size):
        raise ValueError(f"keep={keep}: invalid for dense_size={dense_size} ({encoding})")
    if encoding != "seeded" and mask_seed != 0:
        raise ValueError(f"mask_seed={mask_seed}: only the 'seeded' encoding carries a seed")
    if compression == "none":
        sections = (
            index_section_size(encoding, keep=keep, dense_size=dense_size, indices=indices),
            value_section_size(keep, value_dtype),
        )
    elif compressed_sizes is None:
        raise ValueError("compressed_sizes: required for compression='zstd'")
    else:
        sections = compressed_sizes
    version = min_version(encoding, value_dtype, compression)
    size = _scalar_size(version) + _scalar_size(dense_size)
    size += _scalar_size(check_int("round", round, 0, U32))
    size += _scalar_size(int(ENCODING_WIRE[encoding]))
    size += _scalar_size(check_int("mask_seed", mask_seed, 0, U64))
    size += _scalar_size(keep) + _scalar_size(int(DTYPE_WIRE[value_dtype]))
    size += _bytes_size(sections[0]) + _bytes_size(sections[1])
    size += 5 if value_dtype == "int8" else 0  # tag + fixed32
    size += _scalar_size(int(COMPRESSION_WIRE[compression]))
    if value_dtype in LOWBIT_DTYPES:
        size += _scalar_size(value_block) + _bytes_size(scale_bytes)
    return size


def choose_encoding(
    *,
    keep: int,
    dense_size: int,
    indices: torch.Tensor | None = None,
    mask_seed: int | None = None,
    round: int = 0,
    value_dtype: PayloadDType = "fp32",
    value_block: int = DEFAULT_VALUE_BLOCK,
) -> Encoding:
    """The smallest index encoding for a support (what ``encoding="auto"`` picks).

    Candidates: ``"seeded"`` if ``mask_seed`` is given, ``"dense"`` if ``keep ==
    dense_size``, ``"coo"`` if ``dense_size <= 2**31``, ``"bitmap"`` and, when ``indices`` are
    given, ``"delta"`` (bitmap and delta only for ``dense_size < 2**62``). Sizes are exact
    uncompressed payload sizes; ties go to the earlier encoding in ``ENCODINGS``. Without
    ``indices`` the choice is a function of the numbers alone, memoized (every update of a
    round asks the same: about 15 us a call).
    """
    if indices is None:
        return _implicit_choice(keep, dense_size, mask_seed, round, value_dtype, value_block)
    return _choice(keep, dense_size, indices, mask_seed, round, value_dtype, value_block)


@functools.lru_cache(maxsize=1024, typed=True)  # True, 1 and 1.0: checked apart
def _implicit_choice(
    keep: int,
    dense_size: int,
    mask_seed: int | None,
    round: int,
    value_dtype: PayloadDType,
    value_block: int,
) -> Encoding:
    """``choose_encoding`` without ``indices`` (memoized)."""
    return _choice(keep, dense_size, None, mask_seed, round, value_dtype, value_block)


def _choice(
    keep: int,
    dense_size: int,
    indices: torch.Tensor | None,
    mask_seed: int | None,
    round: int,
    value_dtype: PayloadDType,
    value_block: int,
) -> Encoding:
    """``choose_encoding``'s choice."""
    candidates: list[Encoding] = []
    if mask_seed is not None:
        candidates.append("seeded")
    if keep == dense_size:
        candidates.append("dense")
    if dense_size <= COO_BOUND:
        candidates.append("coo")
    if dense_size < DELTA_BITMAP_BOUND:
        if indices is not None:
            candidates.append("delta")
        candidates.append("bitmap")
    if not candidates:
        raise ValueError(f"dense_size={dense_size}: no encoding fits; pass mask_seed=")

    def size(encoding: Encoding) -> int:
        return payload_size(
            keep=keep,
            dense_size=dense_size,
            round=round,
            encoding=encoding,
            value_dtype=value_dtype,
            mask_seed=(mask_seed or 0) if encoding == "seeded" else 0,
            indices=indices,
            value_block=value_block,
        )

    return min(candidates, key=lambda e: (size(e), ENCODINGS.index(e)))


def _varint_size(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)


def _scalar_size(n: int) -> int:
    """Tag + varint of a proto3 scalar field numbered < 16; 0 when the value is 0 (omitted)."""
    return 0 if n == 0 else 1 + _varint_size(n)


def _bytes_size(n: int) -> int:
    """Tag + varint length + payload of a proto3 bytes field numbered < 16; 0 when empty."""
    return 0 if n == 0 else 1 + _varint_size(n) + n
