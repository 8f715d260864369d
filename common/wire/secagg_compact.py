"""A sparse ring's compact encodings of keys, shares and share ciphertexts (the complete graph
keeps Flower's: PEM keys, ``create_shares`` of the PEM private key, Fernet tokens).

* **Keys**: SECP384R1 public keys as X9.62 compressed points, 49 bytes (a PEM key is 215).
* **Shares**: one ``GF(P)`` element each (``common/aggregation/shamir.py``): the self-mask
  seed as a 256-bit integer, ``sk1`` as its private scalar, 49 bytes each (Flower's share of
  a 306-byte PEM key is 324 bytes).
* **Ciphertexts**: AES-256-GCM under the pair's ECDH + HKDF key (Flower's
  ``generate_shared_key``, the 32 bytes it encodes for Fernet), a random 12-byte nonce, and
  the round, the server's nonce, the source and the destination as associated data: a share
  relayed to another node, another round or back to its sender does not decrypt, and the
  plaintext is the two shares alone. 12 + 98 + 16 = 126 bytes (a Fernet token of Flower's
  plaintext is about 630).
"""

from __future__ import annotations

import os
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from fedsparse.common.aggregation.shamir import SHARE_BYTES, from_bytes

__all__ = [
    "CIPHERTEXT_BYTES",
    "KEY_BYTES",
    "compressed",
    "load_compressed",
    "open_shares",
    "private_key_of",
    "scalar_of",
    "seal_shares",
    "seed_of",
]

CURVE: Final = ec.SECP384R1()
KEY_BYTES: Final = 49
"""A compressed SECP384R1 point: a sign byte and the 48-byte x."""
NONCE_BYTES: Final = 12
CIPHERTEXT_BYTES: Final = NONCE_BYTES + 2 * SHARE_BYTES + 16
_AAD: Final = b"fedsparse/secagg/share/v1\x00"
_SEED_BITS: Final = 256


def compressed(public_pem_or_key: bytes | ec.EllipticCurvePublicKey) -> bytes:
    """A public key (PEM bytes or a key) as its compressed point."""
    key = (
        serialization.load_pem_public_key(public_pem_or_key)
        if isinstance(public_pem_or_key, bytes)
        else public_pem_or_key
    )
    return key.public_bytes(serialization.Encoding.X962, serialization.PublicFormat.CompressedPoint)


def load_compressed(data: bytes) -> ec.EllipticCurvePublicKey:
    """The SECP384R1 key of a compressed point; ``ValueError`` for anything else."""
    if len(data) != KEY_BYTES or data[0] not in (2, 3):
        raise ValueError(f"a key is a {KEY_BYTES}-byte compressed SECP384R1 point")
    return ec.EllipticCurvePublicKey.from_encoded_point(CURVE, data)


def scalar_of(private_pem: bytes) -> int:
    """The private scalar of a PEM private key (what the ring shares of ``sk1``)."""
    key = serialization.load_pem_private_key(private_pem, password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return key.private_numbers().private_value


def private_key_of(scalar: int) -> ec.EllipticCurvePrivateKey:
    """The SECP384R1 private key of ``scalar``; ``ValueError`` outside ``[1, order)``."""
    return ec.derive_private_key(scalar, CURVE)


def seed_of(element: int) -> bytes:
    """The 32-byte seed a rebuilt element stands for; ``ValueError`` when it is none."""
    if element >> _SEED_BITS:
        raise ValueError("the element is not a 32-byte seed")
    return element.to_bytes(_SEED_BITS // 8, "big")


def _aad(round_id: int, nonce: bytes, src: int, dst: int) -> bytes:
    ids = round_id.to_bytes(8, "big") + src.to_bytes(8, "big") + dst.to_bytes(8, "big")
    return _AAD + len(nonce).to_bytes(4, "big") + nonce + ids


def seal_shares(
    key: bytes, bound: tuple[int, bytes], src: int, dst: int, seed_share: bytes, sk1_share: bytes
) -> bytes:
    """``src``'s two shares (``SHARE_BYTES`` each) for ``dst`` under their 32-byte share
    ``key`` in round ``bound``."""
    if len(seed_share) != SHARE_BYTES or len(sk1_share) != SHARE_BYTES:
        raise ValueError(f"a share is {SHARE_BYTES} bytes")
    nonce = os.urandom(NONCE_BYTES)
    plaintext = seed_share + sk1_share
    return nonce + AESGCM(key).encrypt(nonce, plaintext, _aad(*bound, src, dst))


def open_shares(
    key: bytes, bound: tuple[int, bytes], src: int, dst: int, ciphertext: bytes
) -> tuple[bytes, bytes]:
    """``seal_shares``'s two shares (``SHARE_BYTES`` each); ``ValueError`` when the
    ciphertext is not one sealed for ``src -> dst`` in round ``bound`` under ``key``."""
    if len(ciphertext) != CIPHERTEXT_BYTES:
        raise ValueError(f"is not {CIPHERTEXT_BYTES} bytes")
    nonce, body = ciphertext[:NONCE_BYTES], ciphertext[NONCE_BYTES:]
    try:
        plaintext = AESGCM(key).decrypt(nonce, body, _aad(*bound, src, dst))
    except InvalidTag:
        raise ValueError("does not decrypt") from None
    seed_share, sk1_share = plaintext[:SHARE_BYTES], plaintext[SHARE_BYTES:]
    try:
        from_bytes(seed_share), from_bytes(sk1_share)  # each an element of the field
    except ValueError:
        raise ValueError("holds a share outside the field") from None
    return seed_share, sk1_share
