"""The seeds and streams of a node's secure-aggregation round (``client/secagg.py``, which
re-exports them): the pair seed two nodes share, and the rounding and noise generators of
one masked input."""

from __future__ import annotations

import base64
import hashlib
import os

import torch
from cryptography.hazmat.primitives.asymmetric.ec import (
    EllipticCurvePrivateKey,
    EllipticCurvePublicKey,
)
from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

from fedsparse.common.aggregation.secure import SEED_BYTES

__all__ = ["fresh_generators", "pair_seed", "seeded_generators"]


def pair_seed(
    private: bytes | EllipticCurvePrivateKey, public: bytes | EllipticCurvePublicKey
) -> bytes:
    """The 32-byte seed two nodes share: ECDH of their ``sk1``/``pk1`` (PEM keys or parsed
    ones: a node parses its own once for all its peers), through HKDF-SHA256."""
    peer = bytes_to_public_key(public) if isinstance(public, bytes) else public
    own = bytes_to_private_key(private) if isinstance(private, bytes) else private
    key = generate_shared_key(own, peer)
    seed = base64.urlsafe_b64decode(key)
    assert len(seed) == SEED_BYTES
    return seed


def _seeded(material: bytes) -> torch.Generator:
    return torch.Generator().manual_seed(int.from_bytes(material[:8], "little") >> 1)


def fresh_generators() -> tuple[torch.Generator, torch.Generator]:
    """The rounding and noise streams of one masked input, each seeded by ``os.urandom``."""
    return _seeded(os.urandom(8)), _seeded(os.urandom(8))


def seeded_generators(seed: int, round_id: int) -> tuple[torch.Generator, torch.Generator]:
    """Simulation only (``noise="seeded"``): the rounding and noise streams of ``seed`` in
    ``round_id``. Anyone who knows both can strip the noise share from the sum."""

    def stream(label: str) -> torch.Generator:
        material = f"fedsparse/secagg/{label}/{seed}/{round_id}".encode()
        return _seeded(hashlib.sha256(material).digest())

    return stream("rounding"), stream("noise")
