"""A sparse ring's compact keys, shares and ciphertexts (common/wire/secagg_compact.py): their
sizes, round trips, and every way a relayed ciphertext or key is refused."""

from __future__ import annotations

import base64
import os

import pytest
from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
from flwr.supercore.primitives.asymmetric import (
    generate_key_pairs,
    private_key_to_bytes,
    public_key_to_bytes,
)

from fedsparse.common.aggregation.shamir import PRIME, to_bytes
from fedsparse.common.wire.secagg_compact import (
    CIPHERTEXT_BYTES,
    KEY_BYTES,
    compressed,
    load_compressed,
    open_shares,
    private_key_of,
    scalar_of,
    seal_shares,
    seed_of,
)

BOUND = (7, bytes(range(16)))


def test_a_compressed_key_is_49_bytes_and_the_same_key() -> None:
    sk, pk = generate_key_pairs()
    data = compressed(pk)
    assert len(data) == KEY_BYTES == 49 and data[0] in (2, 3)
    assert compressed(public_key_to_bytes(pk)) == data  # from PEM alike
    assert load_compressed(data).public_numbers() == pk.public_numbers()
    other_sk, other_pk = generate_key_pairs()
    # ECDH through the compressed key agrees with the PEM one
    assert generate_shared_key(sk, load_compressed(compressed(other_pk))) == generate_shared_key(
        other_sk, pk
    )


@pytest.mark.parametrize(
    "data",
    [b"", bytes(49), b"\x04" + bytes(48), b"\x02" + b"\xff" * 48, b"\x02" + bytes(47)],
)
def test_anything_but_a_compressed_point_is_refused(data: bytes) -> None:
    with pytest.raises(ValueError):
        load_compressed(data)


def test_pem_keys_are_not_compressed_points() -> None:
    _, pk = generate_key_pairs()
    with pytest.raises(ValueError, match="49-byte compressed"):
        load_compressed(public_key_to_bytes(pk))


def test_the_private_scalar_rebuilds_the_key_and_a_seed_is_256_bits() -> None:
    sk, pk = generate_key_pairs()
    scalar = scalar_of(private_key_to_bytes(sk))
    assert 0 < scalar < 2**384 < PRIME
    assert compressed(private_key_of(scalar).public_key()) == compressed(pk)
    for bad in (0, 2**384):
        with pytest.raises(ValueError):
            private_key_of(bad)
    seed = os.urandom(32)
    assert seed_of(int.from_bytes(seed, "big")) == seed
    with pytest.raises(ValueError, match="not a 32-byte seed"):
        seed_of(2**256)


def _key() -> bytes:
    a, _ = generate_key_pairs()
    _, b = generate_key_pairs()
    return base64.urlsafe_b64decode(generate_shared_key(a, b))


def test_a_sealed_pair_of_shares_opens_only_for_its_round_and_pair() -> None:
    key, shares = _key(), (to_bytes(5), to_bytes(PRIME - 1))
    sealed = seal_shares(key, BOUND, 11, 22, *shares)
    assert len(sealed) == CIPHERTEXT_BYTES == 126
    assert open_shares(key, BOUND, 11, 22, sealed) == shares
    assert seal_shares(key, BOUND, 11, 22, *shares) != sealed  # a fresh nonce each time
    wrong = [
        (key, (8, BOUND[1]), 11, 22, sealed),  # another round
        (key, (7, bytes(16)), 11, 22, sealed),  # another nonce of the server
        (key, BOUND, 22, 11, sealed),  # sent back to its sender
        (key, BOUND, 11, 33, sealed),  # relayed to another node
        (_key(), BOUND, 11, 22, sealed),  # another pair's key
        (key, BOUND, 11, 22, sealed[:-1] + bytes([sealed[-1] ^ 1])),  # altered
    ]
    for args in wrong:
        with pytest.raises(ValueError, match="does not decrypt"):
            open_shares(*args)
    with pytest.raises(ValueError, match="is not 126 bytes"):
        open_shares(key, BOUND, 11, 22, sealed + b"\x00")
    with pytest.raises(ValueError, match="a share is 49 bytes"):
        seal_shares(key, BOUND, 11, 22, b"\x01", shares[1])
