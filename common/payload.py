"""Sparse update payloads: the ``fedsparse.v1.SparseUpdate`` wire codec and its trust boundary.

A payload carries ``keep`` of the ``dense_size`` coordinates of a flat vector (an uplink model
delta or a downlink model value) as two sections, the support (which coordinates) and the
values, plus a small header (``protos/fedsparse/v1/payload.proto``).

Index encodings (how the support travels):

- ``"seeded"``: no index bytes. The support is the public mask
  ``masks.sample_mask(dense_size, keep=keep, seed=mask_seed)``, which every party regenerates
  bit for bit, so random sparsification costs ``keep * value bytes`` plus a header of a few
  dozen bytes (RS paper, Sec. 5).
- ``"dense"``: every coordinate, ``keep == dense_size``, no index bytes.
- ``"coo"``: strictly increasing little-endian int32 indices, ``4 * keep`` bytes.
- ``"delta"``: the gaps between consecutive indices as LEB128 varints, about
  ``keep * ceil(log2(dense_size / keep) / 7)`` bytes (1 byte per index while the mean gap is
  below 128).
- ``"bitmap"``: one bit per coordinate, ``ceil(dense_size / 8)`` bytes whatever ``keep`` is.
- ``"auto"`` (encoder only): the smallest of the above for the support at hand (exact sizes
  from ``payload_size``; ties go to the earlier one in ``INDEX_ENCODINGS``).

Value encodings: ``"fp32"``, ``"fp16"``, ``"bf16"`` (round-to-nearest-even casts by torch;
overflow is an error, never a silent infinity) and ``"int8"``: symmetric quantization with one
float32 scale per update, ``q = round(v / s)`` with ``s = max|v| / 127``, so the error per value
is at most ``s / 2``. Everything decodes to float32. Optionally the index and value sections are
each compressed with Zstandard (``compression="zstd"``).

Privacy: encoding, quantizing and compressing happen after the DP noise has been added, on the
already-privatized update, so they are post-processing and cost no privacy (Dwork & Roth 2014,
Prop. 2.1). The support of a DP-SGD update is the data-independent mask, so sending it
explicitly (``coo``/``delta``/``bitmap``) reveals nothing that the seed does not.

``decode_update`` is the trust boundary: for any byte string it returns a fully validated
``SparseUpdate`` or raises ``PayloadError`` naming the offending field and value. Accepted
payloads are exactly the canonical (deterministic) serializations, so ``len(data) ==
payload_size(...)`` for every accepted payload (for zstd, given the compressed section sizes).
Decoding allocates at most a few times the payload's own size (bitmaps: 8 bytes per payload
bit; zstd sections: their declared, validated content size), never anything of size
``dense_size`` unless the sender paid for it; pass ``expected_dense_size`` before calling
``to_dense`` or ``support`` on an update from an untrusted peer.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import torch
import zstandard
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet

from fedsparse.common.masks import sample_mask
from fedsparse.v1 import payload_pb2 as pb

__all__ = [
    "COMPRESSIONS",
    "ENCODINGS",
    "EXPLICIT_ENCODINGS",
    "FORMAT_VERSION",
    "INDEX_ENCODINGS",
    "VALUE_DTYPES",
    "PayloadError",
    "SparseUpdate",
    "choose_encoding",
    "decode_update",
    "encode_update",
    "index_section_size",
    "information_limit",
    "payload_size",
]

FORMAT_VERSION = 2
SUPPORTED_VERSIONS = (1, 2)
VALUE_DTYPES = ("fp32", "fp16", "bf16", "int8")
ENCODINGS = ("seeded", "dense", "coo", "delta", "bitmap")
INDEX_ENCODINGS = (*ENCODINGS, "auto")
EXPLICIT_ENCODINGS = ("coo", "delta", "bitmap")
COMPRESSIONS = ("none", "zstd")
ZSTD_LEVEL = 3

_V1_DTYPES = ("fp32", "fp16", "bf16")
_V1_ENCODINGS = ("seeded", "dense", "coo")
_U32 = 1 << 32
_U64 = 1 << 64
_INT32_MAX = (1 << 31) - 1
_MAX_EXPLICIT = 1 << 62  # delta/bitmap: dense_size bound that keeps index sums in int64
_MAX_VARINT_BYTES = 9  # 63 bits: every gap < dense_size < 2**62 fits
_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}
_TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_DTYPE_WIRE = {
    "fp32": pb.VALUE_DTYPE_FP32,
    "fp16": pb.VALUE_DTYPE_FP16,
    "bf16": pb.VALUE_DTYPE_BF16,
    "int8": pb.VALUE_DTYPE_INT8,
}
_ENCODING_WIRE = {
    "seeded": pb.INDEX_ENCODING_SEEDED_MASK,
    "dense": pb.INDEX_ENCODING_DENSE,
    "coo": pb.INDEX_ENCODING_COO_INT32,
    "delta": pb.INDEX_ENCODING_DELTA_VARINT,
    "bitmap": pb.INDEX_ENCODING_BITMAP,
}
_COMPRESSION_WIRE = {"none": pb.COMPRESSION_NONE, "zstd": pb.COMPRESSION_ZSTD}
_DTYPE_NAME = {int(v): k for k, v in _DTYPE_WIRE.items()}
_ENCODING_NAME = {int(v): k for k, v in _ENCODING_WIRE.items()}
_COMPRESSION_NAME = {int(v): k for k, v in _COMPRESSION_WIRE.items()}


class PayloadError(ValueError):
    """A payload failed validation; the message names the field and the bad value."""


@dataclass(frozen=True, kw_only=True, eq=False)
class SparseUpdate:
    """A decoded sparse update: ``values`` on a support of a ``dense_size`` vector.

    Attributes:
        dense_size: length of the dense vector, ``> 0``.
        round: federated round the update belongs to.
        values: float32 1-D tensor of the kept values, in increasing coordinate order
            (dequantized for ``"int8"``).
        encoding: one of ``ENCODINGS`` (see the module docstring).
        mask_seed: the public mask's seed for ``"seeded"``, else None.
        indices: int64 1-D sorted support for the explicit encodings, else None.
        value_dtype: the wire dtype the values travelled in (one of ``VALUE_DTYPES``).
        compression: ``"none"`` or ``"zstd"``.
        value_scale: the int8 scale, else None.
    """

    dense_size: int
    round: int
    values: torch.Tensor
    encoding: str
    mask_seed: int | None = None
    indices: torch.Tensor | None = None
    value_dtype: str = "fp32"
    compression: str = "none"
    value_scale: float | None = None

    def __post_init__(self) -> None:
        _check_encoding(self.encoding)
        _check_dtype(self.value_dtype)
        _check_compression(self.compression)
        if self.values.dtype != torch.float32 or self.values.dim() != 1:
            raise ValueError(
                f"values: {self.values.dtype} {tuple(self.values.shape)}, expected 1-D float32"
            )
        if (self.mask_seed is None) != (self.encoding != "seeded"):
            raise ValueError(f"mask_seed={self.mask_seed}: required iff encoding='seeded'")
        if (self.indices is None) != (self.encoding not in EXPLICIT_ENCODINGS):
            raise ValueError(f"indices: required iff encoding is one of {EXPLICIT_ENCODINGS}")
        if self.indices is not None and self.indices.shape != self.values.shape:
            raise ValueError(f"indices: {len(self.indices)} entries for {self.keep} values")
        if (self.value_scale is None) != (self.value_dtype != "int8"):
            raise ValueError(f"value_scale={self.value_scale}: required iff value_dtype='int8'")
        if self.keep > self.dense_size or (
            self.encoding == "dense" and self.keep != self.dense_size
        ):
            raise ValueError(
                f"values: {self.keep} values for dense_size={self.dense_size} ({self.encoding})"
            )

    @property
    def keep(self) -> int:
        """Number of transmitted values."""
        return int(self.values.numel())

    def support(self) -> torch.Tensor | None:
        """The int64 sorted coordinates of ``values``, or None for ``"dense"`` (all of them).

        For ``"seeded"`` this regenerates the public mask (``O(dense_size)`` time and memory).
        """
        if self.encoding == "dense":
            return None
        if self.indices is not None:
            return self.indices
        assert self.mask_seed is not None  # __post_init__
        mask = sample_mask(self.dense_size, keep=self.keep, seed=self.mask_seed)
        return torch.nonzero(mask).flatten()

    def to_dense(self) -> torch.Tensor:
        """A float32 vector of length ``dense_size``: ``values`` on the support, zeros elsewhere."""
        support = self.support()
        if support is None:
            return self.values.clone()
        out = torch.zeros(self.dense_size, dtype=torch.float32)
        out[support] = self.values
        return out


def information_limit(*, keep: int, value_dtype: str) -> int:
    """Bytes of the values alone, ``keep * sizeof(value_dtype)``: the floor for any payload."""
    return _check_int("keep", keep, 0, _U64) * _DTYPE_BYTES[_check_dtype(value_dtype)]


def index_section_size(
    encoding: str, *, keep: int, dense_size: int, indices: torch.Tensor | None = None
) -> int:
    """Bytes of the uncompressed ``indices`` section for ``encoding``.

    ``"seeded"`` and ``"dense"``: 0; ``"coo"``: ``4 * keep``; ``"bitmap"``:
    ``ceil(dense_size / 8)``; ``"delta"``: the varint lengths of the gaps, which needs
    ``indices`` (sorted, as passed to ``encode_update``).
    """
    _check_encoding(encoding)
    if encoding in ("seeded", "dense"):
        return 0
    if encoding == "coo":
        return 4 * keep
    if encoding == "bitmap":
        return -(-dense_size // 8)
    if indices is None:
        raise ValueError("indices: required to size the 'delta' encoding")
    idx = indices.detach().cpu().to(torch.int64).numpy()
    return int(_varint_lengths(_gaps(idx)).sum())


def payload_size(
    *,
    keep: int,
    dense_size: int,
    round: int,
    encoding: str,
    value_dtype: str,
    mask_seed: int = 0,
    indices: torch.Tensor | None = None,
    compression: str = "none",
    compressed_sizes: tuple[int, int] | None = None,
) -> int:
    """Exact serialized size of ``encode_update``'s output, from the protobuf wire rules.

    Every field number is below 16, so each present field costs a 1-byte tag, plus a varint
    (scalars, enums), 4 bytes (the int8 ``value_scale``, always present for int8), or a varint
    length and the bytes (``indices``, ``values``). proto3 omits zero scalars and empty bytes.

    Args:
        keep, dense_size, round, mask_seed, value_dtype: as for ``encode_update``.
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
    keep = _check_int("keep", keep, 0, _U64)
    dense_size = _check_int("dense_size", dense_size, 1, _U64)
    nbytes = _DTYPE_BYTES[_check_dtype(value_dtype)]
    _check_encoding(encoding)
    _check_compression(compression)
    if keep > dense_size or (encoding == "dense" and keep != dense_size):
        raise ValueError(f"keep={keep}: invalid for dense_size={dense_size} ({encoding})")
    if encoding != "seeded" and mask_seed != 0:
        raise ValueError(f"mask_seed={mask_seed}: only the 'seeded' encoding carries a seed")
    if compression == "none":
        sections = (
            index_section_size(encoding, keep=keep, dense_size=dense_size, indices=indices),
            nbytes * keep,
        )
    elif compressed_sizes is None:
        raise ValueError("compressed_sizes: required for compression='zstd'")
    else:
        sections = compressed_sizes
    version = _min_version(encoding, value_dtype, compression)
    size = _scalar_size(version) + _scalar_size(dense_size)
    size += _scalar_size(_check_int("round", round, 0, _U32))
    size += _scalar_size(int(_ENCODING_WIRE[encoding]))
    size += _scalar_size(_check_int("mask_seed", mask_seed, 0, _U64))
    size += _scalar_size(keep) + _scalar_size(int(_DTYPE_WIRE[value_dtype]))
    size += _bytes_size(sections[0]) + _bytes_size(sections[1])
    size += 5 if value_dtype == "int8" else 0  # tag + fixed32
    size += _scalar_size(int(_COMPRESSION_WIRE[compression]))
    return size


def choose_encoding(
    *,
    keep: int,
    dense_size: int,
    indices: torch.Tensor | None = None,
    mask_seed: int | None = None,
    round: int = 0,
    value_dtype: str = "fp32",
) -> str:
    """The smallest index encoding for a support (what ``encoding="auto"`` picks).

    Candidates: ``"seeded"`` if ``mask_seed`` is given, ``"dense"`` if ``keep ==
    dense_size``, ``"coo"`` if ``dense_size <= 2**31``, ``"bitmap"`` and, when ``indices`` are
    given, ``"delta"`` (bitmap and delta only for ``dense_size < 2**62``). Sizes are exact
    uncompressed payload sizes; ties go to the earlier encoding in ``ENCODINGS``.
    """
    candidates: list[str] = []
    if mask_seed is not None:
        candidates.append("seeded")
    if keep == dense_size:
        candidates.append("dense")
    if dense_size <= _INT32_MAX + 1:
        candidates.append("coo")
    if dense_size < _MAX_EXPLICIT:
        if indices is not None:
            candidates.append("delta")
        candidates.append("bitmap")
    if not candidates:
        raise ValueError(f"dense_size={dense_size}: no encoding fits; pass mask_seed=")

    def size(encoding: str) -> int:
        return payload_size(
            keep=keep,
            dense_size=dense_size,
            round=round,
            encoding=encoding,
            value_dtype=value_dtype,
            mask_seed=mask_seed or 0 if encoding == "seeded" else 0,
            indices=indices,
        )

    return min(candidates, key=lambda e: (size(e), ENCODINGS.index(e)))


def encode_update(
    values: torch.Tensor,
    *,
    dense_size: int,
    round: int,
    mask_seed: int | None = None,
    indices: torch.Tensor | None = None,
    encoding: str = "auto",
    value_dtype: str = "fp32",
    compression: str = "none",
) -> bytes:
    """Serializes ``values`` on a support of a ``dense_size`` vector as a ``SparseUpdate``.

    The support is given by ``mask_seed`` (``values`` are the entries on ``sample_mask(
    dense_size, keep=len(values), seed=mask_seed)`` in increasing coordinate order), by
    ``indices``, or by neither when ``len(values) == dense_size``. ``encoding`` says how it
    travels: ``"auto"`` (the smallest, see ``choose_encoding``), ``"seeded"`` (needs
    ``mask_seed``), ``"dense"``, or an explicit one (``"coo"``, ``"delta"``, ``"bitmap"``; with
    ``mask_seed`` the indices are the mask's). Values are cast to ``value_dtype`` (round to
    nearest even; int8: symmetric with scale ``max|v| / 127``); the output is deterministic.

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

    Returns:
        The serialized payload, ``payload_size(...)`` bytes long.

    Raises:
        ValueError: on an invalid argument, non-finite values, or values that overflow
            ``value_dtype`` (e.g. ``|v| > 65504`` for fp16), naming the field and the value.
    """
    dense_size = _check_int("dense_size", dense_size, 1, _U64)
    round = _check_int("round", round, 0, _U32)
    if encoding not in INDEX_ENCODINGS:
        raise ValueError(f"encoding={encoding!r}: expected one of {INDEX_ENCODINGS}")
    _check_compression(compression)
    raw_values, scale = _values_to_bytes(values, _check_dtype(value_dtype))
    keep = int(values.numel())
    if keep > dense_size:
        raise ValueError(f"values: {keep} values, expected <= dense_size={dense_size}")
    if mask_seed is not None and indices is not None:
        raise ValueError("mask_seed and indices: pass at most one")
    if mask_seed is not None:
        mask_seed = _check_int("mask_seed", mask_seed, 0, _U64)
    idx = None if indices is None else _check_index_tensor(indices, keep, dense_size)
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
    if encoding in EXPLICIT_ENCODINGS and idx is None:
        if mask_seed is not None:
            idx = torch.nonzero(sample_mask(dense_size, keep=keep, seed=mask_seed)).numpy()
            idx = idx.reshape(-1).astype(np.int64)
        elif keep == dense_size:
            idx = np.arange(dense_size, dtype=np.int64)
        else:
            raise ValueError(f"encoding={encoding!r}: needs indices= or mask_seed=")
    raw_indices = b"" if idx is None else _indices_to_bytes(idx, encoding, dense_size)
    if encoding not in EXPLICIT_ENCODINGS:
        raw_indices = b""
    if compression == "zstd":
        raw_indices, raw_values = _zstd(raw_indices), _zstd(raw_values)
    msg = pb.SparseUpdate(
        format_version=_min_version(encoding, value_dtype, compression),
        dense_size=dense_size,
        round=round,
        index_encoding=_ENCODING_WIRE[encoding],
        mask_seed=mask_seed if encoding == "seeded" else 0,
        keep=keep,
        value_dtype=_DTYPE_WIRE[value_dtype],
        indices=raw_indices,
        values=raw_values,
        compression=_COMPRESSION_WIRE[compression],
    )
    if scale is not None:
        msg.value_scale = scale
    return msg.SerializeToString(deterministic=True)


def decode_update(
    data: bytes | bytearray | memoryview,
    *,
    expected_dense_size: int | None = None,
    expected_round: int | None = None,
    expected_mask_seed: int | None = None,
    expected_encoding: str | Collection[str] | None = None,
    expected_keep: int | None = None,
    max_bytes: int = 1 << 31,
) -> SparseUpdate:
    """Parses and validates an untrusted payload.

    Checks, in order: size, protobuf parse, no unknown fields, ``format_version`` (1 or 2,
    and the lowest that expresses the payload), known enums, ``dense_size > 0`` and the
    ``expected_*`` values given, ``keep <= dense_size``, the encoding's rules (seeded: no
    indices; dense: ``keep == dense_size``; only seeded carries a nonzero ``mask_seed``;
    delta/bitmap: ``dense_size < 2**62``), the int8 scale, the zstd frames (content size
    declared and as expected, no dictionary, no trailing bytes), the indices (count, minimal
    varints, strictly increasing, in range, bitmap popcount and padding), the value byte count,
    canonical encoding, and that every value is finite. ``expected_mask_seed`` applies to
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
    msg = _parse(data)
    dtype = _DTYPE_NAME[msg.value_dtype]
    encoding = _ENCODING_NAME[msg.index_encoding]
    compression = _COMPRESSION_NAME[msg.compression]
    _expect("dense_size", msg.dense_size, expected_dense_size)
    _expect("round", msg.round, expected_round)
    if accepted is not None and encoding not in accepted:
        wanted = repr(next(iter(accepted))) if len(accepted) == 1 else f"one of {sorted(accepted)}"
        raise PayloadError(f"index_encoding: {encoding!r}, expected {wanted}")
    _expect("keep", msg.keep, expected_keep)
    if encoding == "seeded":
        _expect("mask_seed", msg.mask_seed, expected_mask_seed)
    dense_size, keep = msg.dense_size, msg.keep
    _check_support_fields(msg, encoding)
    scale = _check_scale(msg, dtype)
    nbytes = _DTYPE_BYTES[dtype]
    raw_indices, raw_values = msg.indices, msg.values
    if compression == "zstd":
        lo, hi = _index_section_bounds(encoding, keep, dense_size)
        raw_indices = _unzstd("indices", raw_indices, lo, hi)
        raw_values = _unzstd("values", raw_values, keep * nbytes, keep * nbytes)
    indices = (
        _indices_from_bytes(raw_indices, encoding, keep=keep, dense_size=dense_size)
        if encoding in EXPLICIT_ENCODINGS
        else None
    )
    if len(raw_values) != keep * nbytes:
        raise PayloadError(
            f"values: {len(raw_values)} bytes, expected {keep * nbytes} "
            f"(keep={keep} x {nbytes} bytes {dtype})"
        )
    canonical = msg.SerializeToString(deterministic=True)
    if canonical != data:
        raise PayloadError(
            f"payload: {len(data)} bytes not in canonical encoding (re-encoding gives "
            f"{len(canonical)} bytes: duplicate, out-of-order, default-valued or overlong fields)"
        )
    return SparseUpdate(
        dense_size=dense_size,
        round=msg.round,
        values=_values_from_bytes(raw_values, dtype, scale),
        encoding=encoding,
        mask_seed=msg.mask_seed if encoding == "seeded" else None,
        indices=indices,
        value_dtype=dtype,
        compression=compression,
        value_scale=scale,
    )


# --- helpers ---------------------------------------------------------------------------------


def _min_version(encoding: str, value_dtype: str, compression: str) -> int:
    """The lowest format version that can express a payload with these parts."""
    v1 = encoding in _V1_ENCODINGS and value_dtype in _V1_DTYPES and compression == "none"
    return 1 if v1 else 2


def _accepted_encodings(expected: str | Collection[str] | None) -> frozenset[str] | None:
    if expected is None:
        return None
    names = frozenset([expected] if isinstance(expected, str) else expected)
    for name in names:
        _check_encoding(name)
    return names


def _parse(data: bytes) -> pb.SparseUpdate:
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
    for field, names in (
        ("value_dtype", _DTYPE_NAME),
        ("index_encoding", _ENCODING_NAME),
        ("compression", _COMPRESSION_NAME),
    ):
        if getattr(msg, field) not in names:
            raise PayloadError(f"{field}: {getattr(msg, field)}, expected one of {names}")
    if msg.dense_size == 0:
        raise PayloadError("dense_size: 0, expected > 0")
    version = _min_version(
        _ENCODING_NAME[msg.index_encoding],
        _DTYPE_NAME[msg.value_dtype],
        _COMPRESSION_NAME[msg.compression],
    )
    if msg.format_version != version:
        raise PayloadError(
            f"format_version: {msg.format_version}, expected {version} for "
            f"{_ENCODING_NAME[msg.index_encoding]}/{_DTYPE_NAME[msg.value_dtype]}/"
            f"{_COMPRESSION_NAME[msg.compression]} (the lowest version that expresses it)"
        )
    return msg


def _check_support_fields(msg: pb.SparseUpdate, encoding: str) -> None:
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
    if encoding in ("delta", "bitmap") and msg.dense_size >= _MAX_EXPLICIT:
        raise PayloadError(
            f"dense_size: {msg.dense_size}, expected < 2**62 for {encoding} encoding"
        )


def _check_scale(msg: pb.SparseUpdate, dtype: str) -> float | None:
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


def _index_section_bounds(encoding: str, keep: int, dense_size: int) -> tuple[int, int]:
    """(min, max) byte length of the uncompressed ``indices`` section."""
    if encoding not in EXPLICIT_ENCODINGS:
        return 0, 0
    if encoding == "coo":
        return 4 * keep, 4 * keep
    if encoding == "bitmap":
        return -(-dense_size // 8), -(-dense_size // 8)
    return keep, _MAX_VARINT_BYTES * keep


def _zstd(raw: bytes) -> bytes:
    """One zstd frame with its content size (empty stays empty)."""
    if not raw:
        return b""
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(raw)


def _unzstd(field: str, frame: bytes, lo: int, hi: int) -> bytes:
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


def _expect(field: str, value: int | str, expected: int | str | None) -> None:
    if expected is not None and value != expected:
        raise PayloadError(f"{field}: {value!r}, expected {expected!r}")


def _check_int(name: str, value: int, lo: int, hi: int) -> int:
    """``value`` as a Python int in ``[lo, hi)``; rejects bools and non-integers."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name}={value!r}: expected an integer")
    if not lo <= int(value) < hi:
        raise ValueError(f"{name}={value}: expected {lo} <= {name} < {hi}")
    return int(value)


def _check_dtype(value_dtype: str) -> str:
    if value_dtype not in VALUE_DTYPES:
        raise ValueError(f"value_dtype={value_dtype!r}: expected one of {VALUE_DTYPES}")
    return value_dtype


def _check_encoding(encoding: str) -> str:
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding={encoding!r}: expected one of {ENCODINGS}")
    return encoding


def _check_compression(compression: str) -> str:
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression={compression!r}: expected one of {COMPRESSIONS}")
    return compression


def _varint_size(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)


def _scalar_size(n: int) -> int:
    """Tag + varint of a proto3 scalar field numbered < 16; 0 when the value is 0 (omitted)."""
    return 0 if n == 0 else 1 + _varint_size(n)


def _bytes_size(n: int) -> int:
    """Tag + varint length + payload of a proto3 bytes field numbered < 16; 0 when empty."""
    return 0 if n == 0 else 1 + _varint_size(n) + n


def _first_bad(bad: np.ndarray) -> int:
    return int(np.flatnonzero(bad)[0])


def _values_to_bytes(values: torch.Tensor, value_dtype: str) -> tuple[bytes, float | None]:
    """(little-endian bytes in ``value_dtype``, int8 scale or None); checks finiteness."""
    if not isinstance(values, torch.Tensor) or values.dim() != 1 or not values.is_floating_point():
        shape = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
        raise ValueError(
            f"values: {getattr(values, 'dtype', '')} {shape}, expected a 1-D float tensor"
        )
    values = values.detach().cpu()
    finite = torch.isfinite(values)
    if not bool(finite.all()):
        bad = (~finite).numpy()
        raise ValueError(
            f"values: {int(bad.sum())} non-finite, first at position {_first_bad(bad)} "
            f"({float(values[_first_bad(bad)])})"
        )
    if value_dtype == "int8":
        return _quantize_int8(values.to(torch.float32).numpy())
    cast = values.to(_TORCH_DTYPES[value_dtype]).contiguous()
    if not bool(torch.isfinite(cast).all()):
        max_abs = float(values.abs().max())
        limit = float(torch.finfo(cast.dtype).max)
        raise ValueError(
            f"values: max |v| = {max_abs:.6g} overflows {value_dtype} (max {limit:.6g})"
        )
    if value_dtype == "bf16":  # numpy has no bfloat16: ship the raw 16-bit patterns
        return cast.view(torch.int16).numpy().astype("<i2", copy=False).tobytes(), None
    fmt = "<f4" if value_dtype == "fp32" else "<f2"
    return cast.numpy().astype(fmt, copy=False).tobytes(), None


def _quantize_int8(values: np.ndarray) -> tuple[bytes, float]:
    """Symmetric int8: scale ``max|v| / 127`` in float32, q = round-half-even(v / scale)."""
    max_abs = np.float32(np.abs(values).max()) if values.size else np.float32(0)
    scale = np.float32(max_abs / np.float32(127))
    if scale == 0 and max_abs > 0:  # max|v| below 127 * the smallest subnormal
        scale = np.nextafter(np.float32(0), np.float32(1))
    if scale == 0:
        return np.zeros(values.size, dtype=np.int8).tobytes(), 0.0
    with np.errstate(over="ignore"):
        q = np.clip(np.rint(values / scale), -127, 127).astype(np.int8)
    return q.tobytes(), float(scale)


def _values_from_bytes(raw: bytes, value_dtype: str, scale: float | None) -> torch.Tensor:
    """Little-endian ``value_dtype`` bytes widened to a finite float32 tensor."""
    if value_dtype == "int8":
        q = np.frombuffer(raw, dtype=np.int8)
        if (q == -128).any():
            raise PayloadError(
                f"values: -128 at position {_first_bad(q == -128)}, expected q >= -127"
            )
        assert scale is not None  # _check_scale
        if scale == 0 and q.any():
            raise PayloadError(f"values: {int(np.count_nonzero(q))} nonzero q with value_scale 0")
        wide = q.astype(np.float32) * np.float32(scale)
    elif value_dtype == "bf16":  # bf16 is the top half of a binary32
        wide = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)
    else:
        fmt = "<f4" if value_dtype == "fp32" else "<f2"
        wide = np.frombuffer(raw, dtype=fmt).astype(np.float32)
    bad = ~np.isfinite(wide)
    if bad.any():
        first = _first_bad(bad)
        raise PayloadError(
            f"values: {int(bad.sum())} non-finite ({value_dtype}), first at position {first} "
            f"({float(wide[first])})"
        )
    return torch.from_numpy(np.ascontiguousarray(wide))


def _check_index_tensor(indices: torch.Tensor, keep: int, dense_size: int) -> np.ndarray:
    """Encoder-side: a 1-D integer tensor of ``keep`` sorted indices in range, as int64."""
    if not isinstance(indices, torch.Tensor) or indices.dim() != 1 or indices.is_floating_point():
        raise ValueError(
            f"indices: {getattr(indices, 'dtype', type(indices).__name__)}, expected 1-D integers"
        )
    if indices.numel() != keep:
        raise ValueError(f"indices: {indices.numel()} entries, expected {keep} (one per value)")
    idx = indices.detach().cpu().to(torch.int64).numpy()
    _check_indices(idx, upper=dense_size, error=ValueError)
    return idx


def _indices_to_bytes(idx: np.ndarray, encoding: str, dense_size: int) -> bytes:
    if encoding == "coo":
        _check_indices(idx, upper=min(dense_size, _INT32_MAX + 1), error=ValueError)
        return idx.astype("<i4").tobytes()
    if dense_size >= _MAX_EXPLICIT:
        raise ValueError(f"dense_size={dense_size}: expected < 2**62 for {encoding} encoding")
    if encoding == "bitmap":
        bits = np.zeros(-(-dense_size // 8) * 8, dtype=bool)
        bits[idx] = True
        return np.packbits(bits, bitorder="little").tobytes()
    return _varints_to_bytes(_gaps(idx))


def _indices_from_bytes(raw: bytes, encoding: str, *, keep: int, dense_size: int) -> torch.Tensor:
    if encoding == "coo":
        if len(raw) != 4 * keep:
            raise PayloadError(
                f"indices: {len(raw)} bytes, expected {4 * keep} (keep={keep} x 4 bytes int32)"
            )
        idx = np.frombuffer(raw, dtype="<i4").astype(np.int64)
        _check_indices(idx, upper=min(dense_size, _INT32_MAX + 1), error=PayloadError)
    elif encoding == "bitmap":
        idx = _bitmap_indices(raw, keep=keep, dense_size=dense_size)
    else:
        idx = _delta_indices(raw, keep=keep, dense_size=dense_size)
    return torch.from_numpy(idx)


def _check_indices(idx: np.ndarray, *, upper: int, error: type[ValueError]) -> None:
    """Strictly increasing, in ``[0, upper)``; else raises ``error``."""
    out = (idx < 0) | (idx >= upper)
    if out.any():
        i = _first_bad(out)
        raise error(f"indices: {int(idx[i])} at position {i}, expected in [0, {upper})")
    steps = np.diff(idx) <= 0
    if steps.any():
        i = _first_bad(steps) + 1
        raise error(
            f"indices: {int(idx[i])} at position {i} after {int(idx[i - 1])}, "
            "expected strictly increasing"
        )


def _gaps(idx: np.ndarray) -> np.ndarray:
    """Delta coding: the first index, then ``idx[i] - idx[i-1] - 1`` (>= 0), as uint64."""
    if idx.size == 0:
        return np.zeros(0, dtype=np.uint64)
    gaps = np.empty(idx.size, dtype=np.int64)
    gaps[0] = idx[0]
    gaps[1:] = np.diff(idx) - 1
    return gaps.astype(np.uint64)


def _varint_lengths(values: np.ndarray) -> np.ndarray:
    """LEB128 byte count of each uint64: 1 + the number of 7-bit thresholds reached."""
    lengths = np.ones(values.size, dtype=np.int64)
    for k in range(1, 10):
        lengths += values >= np.uint64(1 << (7 * k))
    return lengths


def _varints_to_bytes(values: np.ndarray) -> bytes:
    """Unsigned LEB128 of each uint64, concatenated (vectorized by byte position)."""
    lengths = _varint_lengths(values)
    starts = np.cumsum(lengths) - lengths
    out = np.empty(int(lengths.sum()), dtype=np.uint8)
    for j in range(int(lengths.max(initial=0))):
        sel = lengths > j
        byte = (values[sel] >> np.uint64(7 * j)) & np.uint64(0x7F)
        more = (lengths[sel] - 1 > j).astype(np.uint64) << np.uint64(7)
        out[starts[sel] + j] = (byte | more).astype(np.uint8)
    return out.tobytes()


def _delta_indices(raw: bytes, *, keep: int, dense_size: int) -> np.ndarray:
    """Decodes ``keep`` minimal LEB128 gaps into strictly increasing indices < dense_size."""
    b = np.frombuffer(raw, dtype=np.uint8)
    if b.size and b[-1] & 0x80:
        raise PayloadError(f"indices: truncated varint at byte {b.size - 1}")
    ends = np.flatnonzero(b < 0x80)
    if ends.size != keep:
        raise PayloadError(f"indices: {ends.size} varints in {b.size} bytes, expected keep={keep}")
    if keep == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.concatenate(([0], ends[:-1] + 1))
    lengths = ends - starts + 1
    if lengths.max() > _MAX_VARINT_BYTES:
        i = _first_bad(lengths > _MAX_VARINT_BYTES)
        raise PayloadError(
            f"indices: varint {i} has {int(lengths[i])} bytes, expected <= {_MAX_VARINT_BYTES}"
        )
    overlong = (lengths > 1) & (b[ends] == 0)
    if overlong.any():
        raise PayloadError(f"indices: varint {_first_bad(overlong)} is not minimal (overlong)")
    shifts = (np.arange(b.size) - np.repeat(starts, lengths)).astype(np.uint64) * np.uint64(7)
    gaps = np.add.reduceat((b & 0x7F).astype(np.uint64) << shifts, starts)
    too_far = gaps >= np.uint64(dense_size)
    if too_far.any():
        i = _first_bad(too_far)
        raise PayloadError(f"indices: gap {int(gaps[i])} at position {i} >= dense_size")
    if float(gaps.sum(dtype=np.float64)) + keep > 2.0**62:  # keeps the int64 sum exact
        raise PayloadError(f"indices: gaps sum past dense_size={dense_size}")
    idx = np.cumsum(gaps.astype(np.int64) + 1) - 1
    if idx[-1] >= dense_size:
        raise PayloadError(f"indices: last index {int(idx[-1])}, expected < {dense_size}")
    return idx


def _bitmap_indices(raw: bytes, *, keep: int, dense_size: int) -> np.ndarray:
    """Set bits of a little-endian bitmap of ``ceil(dense_size / 8)`` bytes, ``keep`` of them."""
    expected = -(-dense_size // 8)
    if len(raw) != expected:
        raise PayloadError(f"indices: {len(raw)} bytes, expected {expected} bitmap bytes")
    bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")
    if bits[dense_size:].any():
        raise PayloadError(f"indices: padding bits past dense_size={dense_size} are set")
    idx = np.flatnonzero(bits).astype(np.int64)
    if idx.size != keep:
        raise PayloadError(f"indices: bitmap has {idx.size} bits set, expected keep={keep}")
    return idx
