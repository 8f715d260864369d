"""Index codecs: a sorted support to ``coo``, ``delta`` or ``bitmap`` bytes and back.

- ``"coo"``: strictly increasing little-endian int32, 4 bytes per index.
- ``"delta"``: the first index, then each gap ``idx[i] - idx[i-1] - 1``, as minimal unsigned
  LEB128 varints of at most ``MAX_VARINT_BYTES`` bytes.
- ``"bitmap"``: bit ``i % 8`` (least significant first) of byte ``i // 8``, padding bits 0.

Every function is vectorized over numpy arrays. The decoders check the count, minimality,
order and range of what they read, so whatever they return is a valid support of ``keep``
coordinates of a ``dense_size`` vector.
"""

from __future__ import annotations

import numpy as np
import torch

from fedsparse.common.wire.payload.schema import (
    COO_BOUND,
    DELTA_BITMAP_BOUND,
    MAX_VARINT_BYTES,
    ExplicitEncoding,
    PayloadError,
    first_bad,
)

__all__ = [
    "check_index_tensor",
    "gaps",
    "indices_from_bytes",
    "indices_to_bytes",
    "varint_lengths",
]


def check_index_tensor(indices: torch.Tensor, keep: int, dense_size: int) -> np.ndarray:
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


def indices_to_bytes(idx: np.ndarray, encoding: ExplicitEncoding, dense_size: int) -> bytes:
    """The ``indices`` section for a checked int64 support (see ``check_index_tensor``)."""
    if encoding == "coo":
        _check_indices(idx, upper=min(dense_size, COO_BOUND), error=ValueError)
        return idx.astype("<i4").tobytes()
    if dense_size >= DELTA_BITMAP_BOUND:
        raise ValueError(f"dense_size={dense_size}: expected < 2**62 for {encoding} encoding")
    if encoding == "bitmap":
        bits = np.zeros(-(-dense_size // 8) * 8, dtype=bool)
        bits[idx] = True
        return np.packbits(bits, bitorder="little").tobytes()
    return _varints_to_bytes(gaps(idx))


def indices_from_bytes(
    raw: bytes, encoding: ExplicitEncoding, *, keep: int, dense_size: int
) -> torch.Tensor:
    """Decoder-side: the int64 support in an ``indices`` section, or PayloadError."""
    if encoding == "coo":
        if len(raw) != 4 * keep:
            raise PayloadError(
                f"indices: {len(raw)} bytes, expected {4 * keep} (keep={keep} x 4 bytes int32)"
            )
        idx = np.frombuffer(raw, dtype="<i4").astype(np.int64)
        _check_indices(idx, upper=min(dense_size, COO_BOUND), error=PayloadError)
    elif encoding == "bitmap":
        idx = _bitmap_indices(raw, keep=keep, dense_size=dense_size)
    else:
        idx = _delta_indices(raw, keep=keep, dense_size=dense_size)
    return torch.from_numpy(idx)


def _check_indices(idx: np.ndarray, *, upper: int, error: type[ValueError]) -> None:
    """Strictly increasing, in ``[0, upper)``; else raises ``error``."""
    out = (idx < 0) | (idx >= upper)
    if out.any():
        i = first_bad(out)
        raise error(f"indices: {int(idx[i])} at position {i}, expected in [0, {upper})")
    steps = np.diff(idx) <= 0
    if steps.any():
        i = first_bad(steps) + 1
        raise error(
            f"indices: {int(idx[i])} at position {i} after {int(idx[i - 1])}, "
            "expected strictly increasing"
        )


def gaps(idx: np.ndarray) -> np.ndarray:
    """Delta coding: the first index, then ``idx[i] - idx[i-1] - 1`` (>= 0), as uint64."""
    if idx.size == 0:
        return np.zeros(0, dtype=np.uint64)
    out = np.empty(idx.size, dtype=np.int64)
    out[0] = idx[0]
    out[1:] = np.diff(idx) - 1
    return out.astype(np.uint64)


def varint_lengths(values: np.ndarray) -> np.ndarray:
    """LEB128 byte count of each uint64: 1 + the number of 7-bit thresholds reached."""
    lengths = np.ones(values.size, dtype=np.int64)
    for k in range(1, 10):
        lengths += values >= np.uint64(1 << (7 * k))
    return lengths


def _varints_to_bytes(values: np.ndarray) -> bytes:
    """Unsigned LEB128 of each uint64, concatenated (vectorized by byte position)."""
    lengths = varint_lengths(values)
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
    if lengths.max() > MAX_VARINT_BYTES:
        i = first_bad(lengths > MAX_VARINT_BYTES)
        raise PayloadError(
            f"indices: varint {i} has {int(lengths[i])} bytes, expected <= {MAX_VARINT_BYTES}"
        )
    overlong = (lengths > 1) & (b[ends] == 0)
    if overlong.any():
        raise PayloadError(f"indices: varint {first_bad(overlong)} is not minimal (overlong)")
    shifts = (np.arange(b.size) - np.repeat(starts, lengths)).astype(np.uint64) * np.uint64(7)
    deltas = np.add.reduceat((b & 0x7F).astype(np.uint64) << shifts, starts)
    too_far = deltas >= np.uint64(dense_size)
    if too_far.any():
        i = first_bad(too_far)
        raise PayloadError(f"indices: gap {int(deltas[i])} at position {i} >= dense_size")
    if float(deltas.sum(dtype=np.float64)) + keep > 2.0**62:  # keeps the int64 sum exact
        raise PayloadError(f"indices: gaps sum past dense_size={dense_size}")
    idx = np.cumsum(deltas.astype(np.int64) + 1) - 1
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
