"""``encode_update`` and ``decode_update``: the two ends of the wire, built from the codec layers.

The encoder checks its arguments, resolves ``"auto"``, and writes the canonical serialization.
The decoder is the trust boundary: it runs the schema checks, then the section decoders, then
the canonical-form check, and returns a validated ``SparseUpdate`` or raises ``PayloadError``.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import cast

import numpy as np
import torch

from fedsparse.common.finite import all_finite
from fedsparse.common.masks import seeded_support
from fedsparse.common.wire.payload.compression import unzstd, zstd
from fedsparse.common.wire.payload.indices import (
    check_index_tensor,
    indices_from_bytes,
    indices_to_bytes,
)
from fedsparse.common.wire.payload.lowbit import dequantize_blocks, quantize_blocks
from fedsparse.common.wire.payload.schema import (
    COMPRESSION_NAME,
    COMPRESSION_WIRE,
    DEFAULT_VALUE_BLOCK,
    DTYPE_NAME,
    DTYPE_WIRE,
    ENCODING_NAME,
    ENCODING_WIRE,
    EXPLICIT_ENCODINGS,
    INDEX_ENCODINGS,
    LOWBIT_DTYPES,
    U32,
    U64,
    Compression,
    Encoding,
    IndexEncoding,
    LowBitDType,
    PayloadDType,
    PayloadError,
    ValueDType,
    check_block_fields,
    check_compression,
    check_encoding,
    check_int,
    check_scale,
    check_support_fields,
    check_value_dtype,
    expect,
    min_version,
    parse,
)
from fedsparse.common.wire.payload.sizing import choose_encoding, index_section_bounds
from fedsparse.common.wire.payload.update import SparseUpdate
from fedsparse.common.wire.payload.values import (
    DTYPE_BITS,
    check_values,
    value_section_size,
    values_from_bytes,
    values_to_bytes,
)
from fedsparse.v1 import payload_pb2 as pb

__all__ = ["decode_update", "encode_update"]


def encode_update(
    values: torch.Tensor,
    *,
    dense_size: int,
    round: int,
    mask_seed: int | None = None,
    indices: torch.Tensor | None = None,
    encoding: IndexEncoding = "auto",
    value_dtype: PayloadDType = "fp32",
    compression: Compression = "none",
    value_block: int = DEFAULT_VALUE_BLOCK,
    rounding: np.random.Generator | None = None,
) -> bytes:
    """Serializes ``values`` on a support of a ``dense_size`` vector as a ``SparseUpdate``.

    The support is given by ``mask_seed`` (``values`` are the entries on ``sample_mask(
    dense_size, keep=len(values), seed=mask_seed)`` in increasing coordinate order), by
    ``indices``, or by neither when ``len(values) == dense_size``. ``encoding`` says how it
    travels: ``"auto"`` (the smallest, see ``choose_encoding``), ``"seeded"`` (needs
    ``mask_seed``), ``"dense"``, or an explicit one (``"coo"``, ``"delta"``, ``"bitmap"``; with
    ``mask_seed`` the indices are the mask's). Values are cast to ``value_dtype`` (round to
    nearest even; int8: symmetric with scale ``max|v| / 127``), and then the output is
    deterministic; the low-bit dtypes (int4, int2, int1: ``payload.lowbit``) round each value
    at random, unbiased, with one float32 step per ``value_block`` values, drawing one
    uniform per value from ``rounding`` (the output is a function of the values and that
    generator's state).

    Args:
        values: 1-D floating tensor of the kept values, all finite. Empty is allowed
            (``keep = 0``, e.g. rate 1) for every encoding but ``"dense"``.
        dense_size: length of the dense vector, ``1 <= dense_size < 2**64``.
        round: federated round, ``0 <= round < 2**32``.
        mask_seed: public mask seed, ``0 <= mask_seed < 2**64``.
        indices: 1-D integer tensor, strictly increasing, in ``[0, dense_size)`` (and below
            ``2**31`` for ``"coo"``).
        encoding: one of ``INDEX_ENCODINGS``.
        value_dtype: one of ``VALUE_DTYPES``.
        compression: ``"none"`` or ``"zstd"`` (each non-empty section one zstd frame).
        value_block: values per step for int4/int2/int1, ``1 <= value_block < 2**32``
            (checked, otherwise unused).
        rounding: the stochastic rounding's generator, required for int4/int2/int1 and not
            touched for the other dtypes. No global RNG is used: a deployed node passes
            ``numpy.random.default_rng()`` (OS entropy), a simulation a seeded stream.

    Returns:
        The serialized payload, ``payload_size(...)`` bytes long.

    Raises:
        ValueError: on an invalid argument (e.g. no ``rounding`` generator for a low-bit
            dtype), non-finite values, or values that overflow ``value_dtype`` (e.g. ``|v| >
            65504`` for fp16, ``|v|`` past float32 for the others), naming the field and value.
    """
    dense_size = check_int("dense_size", dense_size, 1, U64)
    round = check_int("round", round, 0, U32)
    if encoding not in INDEX_ENCODINGS:
        raise ValueError(f"encoding={encoding!r}: expected one of {INDEX_ENCODINGS}")
    check_compression(compression)
    value_block = check_int("value_block", value_block, 1, U32)
    raw_values, scale, raw_scales = _value_sections(
        values, check_value_dtype(value_dtype), value_block, rounding
    )
    keep = int(values.numel())
    if keep > dense_size:
        raise ValueError(f"values: {keep} values, expected <= dense_size={dense_size}")
    if mask_seed is not None and indices is not None:
        raise ValueError("mask_seed and indices: pass at most one")
    if mask_seed is not None:
        mask_seed = check_int("mask_seed", mask_seed, 0, U64)
    idx = None if indices is None else check_index_tensor(indices, keep, dense_size)
    if encoding == "auto":
        if mask_seed is None and idx is None and keep != dense_size:
            raise ValueError(
                f"values: {keep} values for dense_size={dense_size}; a sparse update needs "
                "mask_seed= or indices="
            )
        encoding = choose_encoding(
            keep=keep,
            dense_size=dense_size,
            indices=None if idx is None else torch.from_numpy(idx),
            mask_seed=mask_seed,
            round=round,
            value_dtype=value_dtype,
        )
    if encoding == "seeded" and mask_seed is None:
        raise ValueError("encoding='seeded': needs mask_seed=")
    if encoding == "dense" and keep != dense_size:
        raise ValueError(f"values: {keep} values, encoding='dense' needs dense_size={dense_size}")
    raw_indices = b""
    if encoding in EXPLICIT_ENCODINGS:
        if idx is None:
            idx = _implicit_support(encoding, keep=keep, dense_size=dense_size, seed=mask_seed)
        raw_indices = indices_to_bytes(idx, encoding, dense_size)
    if compression == "zstd":
        raw_indices, raw_values = zstd(raw_indices), zstd(raw_values)
    msg = pb.SparseUpdate(
        format_version=min_version(encoding, value_dtype, compression),
        dense_size=dense_size,
        round=round,
        index_encoding=ENCODING_WIRE[encoding],
        mask_seed=mask_seed if encoding == "seeded" else 0,
        keep=keep,
        value_dtype=DTYPE_WIRE[value_dtype],
        indices=raw_indices,
        values=raw_values,
        compression=COMPRESSION_WIRE[compression],
    )
    if scale is not None:
        msg.value_scale = scale
    if value_dtype in LOWBIT_DTYPES:
        msg.value_block, msg.value_scales = value_block, raw_scales
    return msg.SerializeToString(deterministic=True)


def _value_sections(
    values: torch.Tensor,
    value_dtype: PayloadDType,
    value_block: int,
    rounding: np.random.Generator | None,
) -> tuple[bytes, float | None, bytes]:
    """(``values`` section, int8 scale or None, low-bit ``value_scales`` section)."""
    if value_dtype not in LOWBIT_DTYPES:
        return (*values_to_bytes(values, cast(ValueDType, value_dtype)), b"")
    if not isinstance(rounding, np.random.Generator):
        raise ValueError(
            f"rounding={rounding!r}: value_dtype={value_dtype!r} rounds at random, expected a "
            "numpy.random.Generator (numpy.random.default_rng() on a deployed node)"
        )
    wide = check_values(values)
    narrow = wide.to(torch.float32)
    if not all_finite(narrow):
        raise ValueError(
            f"values: max |v| = {float(wide.abs().max()):.6g} overflows {value_dtype} "
            "(float32 steps)"
        )
    packed, steps = quantize_blocks(
        narrow.numpy(), value_dtype, block=value_block, generator=rounding
    )
    return packed, None, steps


def _implicit_support(
    encoding: Encoding, *, keep: int, dense_size: int, seed: int | None
) -> np.ndarray:
    """The int64 support an explicit encoding sends when no ``indices=`` were passed."""
    if seed is not None:  # the public mask's positions
        idx = seeded_support(dense_size, keep, seed).numpy()
        return idx.reshape(-1).astype(np.int64)
    if keep == dense_size:
        return np.arange(dense_size, dtype=np.int64)
    raise ValueError(f"encoding={encoding!r}: needs indices= or mask_seed=")


def decode_update(
    data: bytes | bytearray | memoryview,
    *,
    expected_dense_size: int | None = None,
    expected_round: int | None = None,
    expected_mask_seed: int | None = None,
    expected_encoding: Encoding | Collection[Encoding] | None = None,
    expected_keep: int | None = None,
    max_bytes: int = 1 << 31,
) -> SparseUpdate:
    """Parses and validates an untrusted payload.

    Checks, in order: size, protobuf parse, no unknown fields, ``format_version`` (1 or 2,
    and the lowest that expresses the payload), known enums, ``dense_size > 0`` and the
    ``expected_*`` values given, ``keep <= dense_size``, the encoding's rules (seeded: no
    indices; dense: ``keep == dense_size``; only seeded carries a nonzero ``mask_seed``;
    delta/bitmap: ``dense_size < 2**62``), the int8 scale, the low-bit block fields
    (``value_block >= 1`` and ``ceil(keep / value_block)`` float32 ``value_scales`` for
    int4/int2/int1, both absent otherwise), the zstd frames (content size declared and as
    expected, no dictionary, no trailing bytes), the indices (count, minimal varints, strictly
    increasing, in range, bitmap popcount and padding), the value byte count (packed for the
    low-bit dtypes), canonical encoding, the low-bit steps (finite, ``>= 0``, not -0.0), padding
    bits and codes (no most negative pattern, all 0 in a block of step 0), and that every value
    is finite. ``expected_mask_seed`` applies to
    seeded payloads only: pass ``expected_encoding="seeded"`` to require one;
    ``expected_encoding`` may be one name or a collection of accepted names.

    Returns:
        The validated update (values widened to float32).

    Raises:
        PayloadError: for any byte string that is not a valid payload (and only that).
        TypeError: if ``data`` is not bytes-like.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data: {type(data).__name__}, expected bytes")
    accepted = _accepted_encodings(expected_encoding)
    if not isinstance(data, bytes):
        data = bytes(data)
    if len(data) > max_bytes:
        raise PayloadError(f"payload: {len(data)} bytes, exceeds max_bytes={max_bytes}")
    msg = parse(data)
    dtype = DTYPE_NAME[msg.value_dtype]
    encoding = ENCODING_NAME[msg.index_encoding]
    compression = COMPRESSION_NAME[msg.compression]
    expect("dense_size", msg.dense_size, expected_dense_size)
    expect("round", msg.round, expected_round)
    if accepted is not None and encoding not in accepted:
        wanted = repr(next(iter(accepted))) if len(accepted) == 1 else f"one of {sorted(accepted)}"
        raise PayloadError(f"index_encoding: {encoding!r}, expected {wanted}")
    expect("keep", msg.keep, expected_keep)
    if encoding == "seeded":
        expect("mask_seed", msg.mask_seed, expected_mask_seed)
    dense_size, keep = msg.dense_size, msg.keep
    check_support_fields(msg, encoding)
    scale = check_scale(msg, dtype)
    block = check_block_fields(msg, dtype)
    nbytes = value_section_size(keep, dtype)
    raw_indices, raw_values = msg.indices, msg.values
    if compression == "zstd":
        lo, hi = index_section_bounds(encoding, keep, dense_size)
        raw_indices = unzstd("indices", raw_indices, lo, hi)
        raw_values = unzstd("values", raw_values, nbytes, nbytes)
    indices = None
    if encoding in EXPLICIT_ENCODINGS:
        indices = indices_from_bytes(raw_indices, encoding, keep=keep, dense_size=dense_size)
    if len(raw_values) != nbytes:
        raise PayloadError(
            f"values: {len(raw_values)} bytes, expected {nbytes} {_per(keep, dtype)}"
        )
    canonical = msg.SerializeToString(deterministic=True)
    if canonical != data:
        raise PayloadError(
            f"payload: {len(data)} bytes not in canonical encoding (re-encoding gives "
            f"{len(canonical)} bytes: duplicate, out-of-order, default-valued or overlong fields)"
        )
    steps = None
    if block is None:
        values = values_from_bytes(raw_values, cast(ValueDType, dtype), scale)
    else:
        low, narrow = dequantize_blocks(
            raw_values, msg.value_scales, cast(LowBitDType, dtype), keep=keep, block=block
        )
        values, steps = torch.from_numpy(low), torch.from_numpy(narrow)
    return SparseUpdate(
        dense_size=dense_size,
        round=msg.round,
        values=values,
        encoding=encoding,
        mask_seed=msg.mask_seed if encoding == "seeded" else None,
        indices=indices,
        value_dtype=dtype,
        compression=compression,
        value_scale=scale,
        value_block=block,
        value_scales=steps,
    )


def _per(keep: int, dtype: PayloadDType) -> str:
    """How the values section's size follows from ``keep`` (for error messages)."""
    if dtype in LOWBIT_DTYPES:
        return f"(ceil(keep={keep} x {DTYPE_BITS[dtype]} bits / 8) packed {dtype})"
    return f"(keep={keep} x {DTYPE_BITS[dtype] // 8} bytes {dtype})"


def _accepted_encodings(
    expected: Encoding | Collection[Encoding] | None,
) -> frozenset[Encoding] | None:
    """``expected_encoding`` as a set of checked names (ValueError on an unknown one)."""
    if expected is None:
        return None
    names: Collection[str] = [expected] if isinstance(expected, str) else expected
    return frozenset(check_encoding(name) for name in names)
