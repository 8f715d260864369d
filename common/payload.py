"""Sparse update payloads: the ``fedsparse.v1.SparseUpdate`` wire codec and its trust boundary.

A payload carries ``keep`` of the ``dense_size`` coordinates of a flat vector (an uplink model
delta or a downlink model value) as raw little-endian values, plus the metadata that says
which coordinates they are (``protos/fedsparse/v1/payload.proto``):

- ``"seeded"``: no index bytes. The support is the public mask
  ``masks.sample_mask(dense_size, keep=keep, seed=mask_seed)``, which every party regenerates
  bit for bit, so random sparsification costs ``keep * dtype bytes`` plus a header of a few
  dozen bytes (RS paper, Sec. 5).
- ``"dense"``: every coordinate, ``keep == dense_size``, no index bytes.
- ``"coo"``: explicit strictly increasing int32 indices, 4 bytes per kept value.

Values travel as fp32, fp16 or bf16 (round-to-nearest-even casts by torch; fp16 overflow is an
error, never a silent infinity) and always decode to float32. Encoding is post-processing of a
DP update and costs no privacy.

``decode_update`` is the trust boundary: for any byte string it returns a fully validated
``SparseUpdate`` or raises ``PayloadError`` naming the offending field and value. Accepted
payloads are exactly the canonical (deterministic) serializations, so
``len(data) == payload_size(...)`` for every accepted payload. Decoding never allocates
anything of size ``dense_size``; pass ``expected_dense_size`` before calling ``to_dense`` or
``support`` on an update from an untrusted peer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet

from fedsparse.common.masks import sample_mask
from fedsparse.v1 import payload_pb2 as pb

__all__ = [
    "ENCODINGS",
    "FORMAT_VERSION",
    "VALUE_DTYPES",
    "PayloadError",
    "SparseUpdate",
    "decode_update",
    "encode_update",
    "information_limit",
    "payload_size",
]

FORMAT_VERSION = 1
VALUE_DTYPES = ("fp32", "fp16", "bf16")
ENCODINGS = ("seeded", "dense", "coo")

_U32 = 1 << 32
_U64 = 1 << 64
_INT32_MAX = (1 << 31) - 1
_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
_TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_DTYPE_WIRE = {
    "fp32": pb.VALUE_DTYPE_FP32,
    "fp16": pb.VALUE_DTYPE_FP16,
    "bf16": pb.VALUE_DTYPE_BF16,
}
_ENCODING_WIRE = {
    "seeded": pb.INDEX_ENCODING_SEEDED_MASK,
    "dense": pb.INDEX_ENCODING_DENSE,
    "coo": pb.INDEX_ENCODING_COO_INT32,
}
_DTYPE_NAME = {int(v): k for k, v in _DTYPE_WIRE.items()}
_ENCODING_NAME = {int(v): k for k, v in _ENCODING_WIRE.items()}


class PayloadError(ValueError):
    """A payload failed validation; the message names the field and the bad value."""


@dataclass(frozen=True, kw_only=True, eq=False)
class SparseUpdate:
    """A decoded sparse update: ``values`` on a support of a ``dense_size`` vector.

    Attributes:
        dense_size: length of the dense vector, ``> 0``.
        round: federated round the update belongs to.
        values: float32 1-D tensor of the kept values, in increasing coordinate order.
        encoding: ``"seeded"``, ``"dense"`` or ``"coo"`` (see the module docstring).
        mask_seed: the public mask's seed for ``"seeded"``, else None.
        indices: int64 1-D sorted support for ``"coo"``, else None.
        value_dtype: the wire dtype the values travelled in (one of ``VALUE_DTYPES``).
    """

    dense_size: int
    round: int
    values: torch.Tensor
    encoding: str
    mask_seed: int | None = None
    indices: torch.Tensor | None = None
    value_dtype: str = "fp32"

    def __post_init__(self) -> None:
        if self.encoding not in ENCODINGS:
            raise ValueError(f"encoding={self.encoding!r}: expected one of {ENCODINGS}")
        if self.value_dtype not in VALUE_DTYPES:
            raise ValueError(f"value_dtype={self.value_dtype!r}: expected one of {VALUE_DTYPES}")
        if self.values.dtype != torch.float32 or self.values.dim() != 1:
            raise ValueError(
                f"values: {self.values.dtype} {tuple(self.values.shape)}, expected 1-D float32"
            )
        if (self.mask_seed is None) != (self.encoding != "seeded"):
            raise ValueError(f"mask_seed={self.mask_seed}: required iff encoding='seeded'")
        if (self.indices is None) != (self.encoding != "coo"):
            raise ValueError("indices: required iff encoding='coo'")
        if self.indices is not None and self.indices.shape != self.values.shape:
            raise ValueError(f"indices: {len(self.indices)} entries for {self.keep} values")
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
        if self.encoding == "coo":
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


def payload_size(
    *, keep: int, dense_size: int, round: int, encoding: str, value_dtype: str, mask_seed: int = 0
) -> int:
    """Exact serialized size of ``encode_update``'s output, from the protobuf wire rules.

    Every field number is below 16, so each present field costs a 1-byte tag, plus a varint
    (scalars, enums) or a varint length and the bytes (``indices``, ``values``). proto3 omits
    zero scalars and empty bytes.

    Raises:
        ValueError: on out-of-range arguments, ``keep != dense_size`` for ``"dense"``, or a
            nonzero ``mask_seed`` for an encoding other than ``"seeded"``.
    """
    keep = _check_int("keep", keep, 0, _U64)
    dense_size = _check_int("dense_size", dense_size, 1, _U64)
    nbytes = _DTYPE_BYTES[_check_dtype(value_dtype)]
    _check_encoding(encoding)
    if keep > dense_size or (encoding == "dense" and keep != dense_size):
        raise ValueError(f"keep={keep}: invalid for dense_size={dense_size} ({encoding})")
    if encoding != "seeded" and mask_seed != 0:
        raise ValueError(f"mask_seed={mask_seed}: only the 'seeded' encoding carries a seed")
    size = _scalar_size(FORMAT_VERSION) + _scalar_size(dense_size)
    size += _scalar_size(_check_int("round", round, 0, _U32))
    size += _scalar_size(int(_ENCODING_WIRE[encoding]))
    size += _scalar_size(_check_int("mask_seed", mask_seed, 0, _U64))
    size += _scalar_size(keep) + _scalar_size(int(_DTYPE_WIRE[value_dtype]))
    size += _bytes_size(4 * keep if encoding == "coo" else 0) + _bytes_size(nbytes * keep)
    return size


def encode_update(
    values: torch.Tensor,
    *,
    dense_size: int,
    round: int,
    mask_seed: int | None = None,
    indices: torch.Tensor | None = None,
    value_dtype: str = "fp32",
) -> bytes:
    """Serializes ``values`` on a support of a ``dense_size`` vector as a ``SparseUpdate``.

    The encoding follows from the arguments: ``mask_seed`` given -> ``"seeded"`` (``values``
    are the entries on ``sample_mask(dense_size, keep=len(values), seed=mask_seed)`` in
    increasing coordinate order); ``indices`` given -> ``"coo"``; neither and
    ``len(values) == dense_size`` -> ``"dense"``. Values are cast to ``value_dtype`` by torch
    (round to nearest even); the bytes are deterministic for the same inputs.

    Args:
        values: 1-D floating tensor of the kept values, all finite. Empty is allowed
            (``keep = 0``, e.g. rate 1) for ``"seeded"`` and ``"coo"``.
        dense_size: length of the dense vector, ``1 <= dense_size < 2**64``.
        round: federated round, ``0 <= round < 2**32``.
        mask_seed: public mask seed, ``0 <= mask_seed < 2**64``.
        indices: 1-D integer tensor, strictly increasing, in ``[0, min(dense_size, 2**31))``.
        value_dtype: one of ``VALUE_DTYPES``.

    Returns:
        The serialized payload, ``payload_size(...)`` bytes long.

    Raises:
        ValueError: on an invalid argument, non-finite values, or values that overflow
            ``value_dtype`` (e.g. ``|v| > 65504`` for fp16), naming the field and the value.
    """
    dense_size = _check_int("dense_size", dense_size, 1, _U64)
    round = _check_int("round", round, 0, _U32)
    raw_values = _values_to_bytes(values, _check_dtype(value_dtype))
    keep = int(values.numel())
    if keep > dense_size:
        raise ValueError(f"values: {keep} values, expected <= dense_size={dense_size}")
    msg = pb.SparseUpdate(
        format_version=FORMAT_VERSION,
        dense_size=dense_size,
        round=round,
        keep=keep,
        value_dtype=_DTYPE_WIRE[value_dtype],
        values=raw_values,
    )
    if mask_seed is not None and indices is not None:
        raise ValueError("mask_seed and indices: pass at most one (seeded or coo encoding)")
    if mask_seed is not None:
        msg.index_encoding = pb.INDEX_ENCODING_SEEDED_MASK
        msg.mask_seed = _check_int("mask_seed", mask_seed, 0, _U64)
    elif indices is not None:
        msg.index_encoding = pb.INDEX_ENCODING_COO_INT32
        msg.indices = _indices_to_bytes(indices, keep=keep, dense_size=dense_size)
    elif keep == dense_size:
        msg.index_encoding = pb.INDEX_ENCODING_DENSE
    else:
        raise ValueError(
            f"values: {keep} values for dense_size={dense_size}; a sparse update needs "
            "mask_seed= (seeded) or indices= (coo)"
        )
    return msg.SerializeToString(deterministic=True)


def decode_update(
    data: bytes | bytearray | memoryview,
    *,
    expected_dense_size: int | None = None,
    expected_round: int | None = None,
    expected_mask_seed: int | None = None,
    expected_encoding: str | None = None,
    expected_keep: int | None = None,
    max_bytes: int = 1 << 31,
) -> SparseUpdate:
    """Parses and validates an untrusted payload.

    Checks, in order: size, protobuf parse, no unknown fields, ``format_version``, known
    enums, ``dense_size > 0`` and the ``expected_*`` values given, ``keep <= dense_size``, the
    encoding's rules (seeded: no indices; dense: ``keep == dense_size``; coo: ``4*keep`` index
    bytes, strictly increasing, in range; only seeded carries a nonzero ``mask_seed``), the
    value byte count, canonical encoding, and that every value is finite.
    ``expected_mask_seed`` applies to seeded payloads only: pass
    ``expected_encoding="seeded"`` to require one.

    Returns:
        The validated update (values widened to float32; nothing of size ``dense_size`` is
        allocated).

    Raises:
        PayloadError: for any byte string that is not a valid payload (and only that).
        TypeError: if ``data`` is not bytes-like.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data: {type(data).__name__}, expected bytes")
    if expected_encoding is not None:
        _check_encoding(expected_encoding)
    if not isinstance(data, bytes):
        data = bytes(data)
    if len(data) > max_bytes:
        raise PayloadError(f"payload: {len(data)} bytes, exceeds max_bytes={max_bytes}")
    msg = _parse(data)
    dtype = _DTYPE_NAME[msg.value_dtype]
    encoding = _ENCODING_NAME[msg.index_encoding]
    _expect("dense_size", msg.dense_size, expected_dense_size)
    _expect("round", msg.round, expected_round)
    _expect("index_encoding", encoding, expected_encoding)
    _expect("keep", msg.keep, expected_keep)
    if encoding == "seeded":
        _expect("mask_seed", msg.mask_seed, expected_mask_seed)
    dense_size, keep = msg.dense_size, msg.keep
    _check_support_fields(msg, encoding)
    indices = (
        _indices_from_bytes(msg.indices, keep=keep, dense_size=dense_size)
        if encoding == "coo"
        else None
    )
    nbytes = _DTYPE_BYTES[dtype]
    if len(msg.values) != keep * nbytes:
        raise PayloadError(
            f"values: {len(msg.values)} bytes, expected {keep * nbytes} "
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
        values=_values_from_bytes(msg.values, dtype),
        encoding=encoding,
        mask_seed=msg.mask_seed if encoding == "seeded" else None,
        indices=indices,
        value_dtype=dtype,
    )


# --- helpers ---------------------------------------------------------------------------------


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
    if msg.format_version != FORMAT_VERSION:
        raise PayloadError(f"format_version: {msg.format_version}, expected {FORMAT_VERSION}")
    if msg.value_dtype not in _DTYPE_NAME:
        raise PayloadError(f"value_dtype: {msg.value_dtype}, expected one of {_DTYPE_NAME}")
    if msg.index_encoding not in _ENCODING_NAME:
        raise PayloadError(
            f"index_encoding: {msg.index_encoding}, expected one of {_ENCODING_NAME}"
        )
    if msg.dense_size == 0:
        raise PayloadError("dense_size: 0, expected > 0")
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
    if encoding != "coo" and msg.indices:
        raise PayloadError(f"indices: {len(msg.indices)} bytes, expected 0 for {encoding} encoding")


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


def _values_to_bytes(values: torch.Tensor, value_dtype: str) -> bytes:
    """Casts to ``value_dtype`` (round to nearest even) and returns the little-endian bytes."""
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
    cast = values.to(_TORCH_DTYPES[value_dtype]).contiguous()
    if not bool(torch.isfinite(cast).all()):
        max_abs = float(values.abs().max())
        limit = float(torch.finfo(cast.dtype).max)
        raise ValueError(
            f"values: max |v| = {max_abs:.6g} overflows {value_dtype} (max {limit:.6g})"
        )
    if value_dtype == "bf16":  # numpy has no bfloat16: ship the raw 16-bit patterns
        return cast.view(torch.int16).numpy().astype("<i2", copy=False).tobytes()
    return cast.numpy().astype("<f4" if value_dtype == "fp32" else "<f2", copy=False).tobytes()


def _values_from_bytes(raw: bytes, value_dtype: str) -> torch.Tensor:
    """Little-endian ``value_dtype`` bytes widened (exactly) to a finite float32 tensor."""
    if value_dtype == "bf16":  # bf16 is the top half of a binary32
        wide = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)
    else:
        wide = np.frombuffer(raw, dtype="<f4" if value_dtype == "fp32" else "<f2").astype(
            np.float32
        )
    bad = ~np.isfinite(wide)
    if bad.any():
        first = _first_bad(bad)
        raise PayloadError(
            f"values: {int(bad.sum())} non-finite ({value_dtype}), first at position {first} "
            f"({float(wide[first])})"
        )
    return torch.from_numpy(wide)


def _indices_to_bytes(indices: torch.Tensor, *, keep: int, dense_size: int) -> bytes:
    if not isinstance(indices, torch.Tensor) or indices.dim() != 1 or indices.is_floating_point():
        raise ValueError(
            f"indices: {getattr(indices, 'dtype', type(indices).__name__)}, expected 1-D integers"
        )
    if indices.numel() != keep:
        raise ValueError(f"indices: {indices.numel()} entries, expected {keep} (one per value)")
    idx = indices.detach().cpu().to(torch.int64).numpy()
    _check_indices(idx, dense_size=dense_size, error=ValueError)
    return idx.astype("<i4").tobytes()


def _indices_from_bytes(raw: bytes, *, keep: int, dense_size: int) -> torch.Tensor:
    if len(raw) != 4 * keep:
        raise PayloadError(
            f"indices: {len(raw)} bytes, expected {4 * keep} (keep={keep} x 4 bytes int32)"
        )
    idx = np.frombuffer(raw, dtype="<i4").astype(np.int64)
    _check_indices(idx, dense_size=dense_size, error=PayloadError)
    return torch.from_numpy(idx)


def _check_indices(idx: np.ndarray, *, dense_size: int, error: type[ValueError]) -> None:
    """Strictly increasing, in ``[0, min(dense_size, 2**31))``; else raises ``error``."""
    upper = min(dense_size, _INT32_MAX + 1)
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
