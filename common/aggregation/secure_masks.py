"""Secure aggregation's masks and the ring's wire packing (``secure.py`` re-exports them).

Client ``i`` sends ``y_i = x_i + sum_{j>i} m_ij - sum_{j<i} m_ji + m_i (mod 2^b)``, each mask the
expansion of a 32-byte seed by SHAKE-256 (an extendable-output function of the standard
library's ``hashlib``); the pairwise ones cancel in the sum, and the server removes the
survivors' self masks and the pair masks shared with dropped clients (``remove_masks``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import numpy as np
import torch

__all__ = [
    "PAIR_LABEL",
    "SEED_BYTES",
    "SELF_LABEL",
    "expand_mask",
    "mask_input",
    "pack_ring",
    "pairwise_sign",
    "remove_masks",
    "ring_sum",
    "unpack_ring",
]

SEED_BYTES = 32
"""Length of a mask seed."""


def expand_mask(seed: bytes, kept: int, bits: int, label: bytes) -> torch.Tensor:
    """``kept`` uniform ring elements from a 32-byte seed (SHAKE-256, domain ``label``).

    Each element is the low ``bits`` of a 64-bit little-endian word of the output: exactly
    uniform, because ``2^bits`` divides ``2^64``.
    """
    if not isinstance(seed, bytes) or len(seed) != SEED_BYTES:
        raise ValueError(f"a mask seed is {SEED_BYTES} bytes")
    xof = hashlib.shake_256(b"fedsparse/secagg/" + label + b"\x00" + seed)
    words = np.frombuffer(xof.digest(8 * kept), dtype="<u8")
    ring = words & np.uint64((1 << bits) - 1)
    return torch.from_numpy(ring.astype(np.int64))


SELF_LABEL = b"self"
PAIR_LABEL = b"pair"


def pairwise_sign(own: int, other: int) -> int:
    """How node ``own`` applies the mask it shares with ``other``: ``+1`` below, ``-1`` above."""
    if own == other:
        raise ValueError(f"node {own} shares no mask with itself")
    return 1 if own < other else -1


def mask_input(
    ring_input: torch.Tensor,
    own: int,
    pair_seeds: Mapping[int, bytes],
    self_seed: bytes,
    bits: int,
) -> torch.Tensor:
    """``y = x + sum_{j>own} m_(own,j) - sum_{j<own} m_(j,own) + m_own (mod 2^bits)``."""
    kept = ring_input.numel()
    mask = (1 << bits) - 1
    y = (ring_input + expand_mask(self_seed, kept, bits, SELF_LABEL)) & mask
    for other, seed in sorted(pair_seeds.items()):
        y = (y + pairwise_sign(own, other) * expand_mask(seed, kept, bits, PAIR_LABEL)) & mask
    return y


def remove_masks(
    masked_total: torch.Tensor,
    self_seeds: Iterable[bytes],
    dropped_pairs: Iterable[tuple[int, int, bytes]],
    bits: int,
) -> torch.Tensor:
    """The sum of the survivors' inputs from the sum of their masked vectors.

    ``self_seeds``: each survivor's self-mask seed; ``dropped_pairs``: ``(survivor, dropped,
    seed)`` for every pair mask a survivor applied with a client whose vector never came.
    """
    kept = masked_total.numel()
    mask = (1 << bits) - 1
    total = masked_total.clone()
    for seed in self_seeds:
        total = (total - expand_mask(seed, kept, bits, SELF_LABEL)) & mask
    for survivor, dropped, seed in dropped_pairs:
        m = expand_mask(seed, kept, bits, PAIR_LABEL)
        total = (total - pairwise_sign(survivor, dropped) * m) & mask
    return total


def pack_ring(values: torch.Tensor, bits: int) -> bytes:
    """Ring elements as ``ceil(bits/8)`` little-endian bytes each."""
    width = (bits + 7) // 8
    words = values.to(torch.int64).numpy().astype("<u8")
    return words.view(np.uint8).reshape(-1, 8)[:, :width].tobytes()


def unpack_ring(data: bytes, kept: int, bits: int) -> torch.Tensor:
    """The inverse of :func:`pack_ring`; ``ValueError`` for a wrong length or a value >= 2^b."""
    width = (bits + 7) // 8
    if len(data) != kept * width:
        raise ValueError(f"expected {kept * width} bytes ({kept} x {width}), got {len(data)}")
    raw = np.zeros((kept, 8), dtype=np.uint8)
    raw[:, :width] = np.frombuffer(data, dtype=np.uint8).reshape(kept, width)
    words = raw.reshape(-1).view("<u8")
    if kept and int(words.max()) >> bits:
        raise ValueError(f"a ring element is not below 2^{bits}")
    return torch.from_numpy(words.astype(np.int64))


def ring_sum(vectors: Iterable[torch.Tensor], bits: int) -> torch.Tensor:
    """The sum of ring vectors mod ``2^bits`` (reduced after every addition: no overflow)."""
    total: torch.Tensor | None = None
    mask = (1 << bits) - 1
    for v in vectors:
        total = v.clone() if total is None else (total + v) & mask
    if total is None:
        raise ValueError("ring_sum of no vectors")
    return total & mask
