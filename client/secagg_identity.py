"""A node's identity for secure aggregation: signed key advertisements and the owner's roster.

Without it a malicious server can fill a node's ring with members it made up: it then holds
every other pairwise mask and recovers the node's masked input, protected by the node's own
noise share alone (its worst case, ``docs/explanation/secure-aggregation.md``). With it:

* **Identity** (node policy ``secagg-identity``, a PEM Ed25519 private key the owner keeps):
  the node signs each round's advertisement, ``(round_id, nonce, node_id, pk1, pk2)`` under a
  domain label (:func:`advertisement`), and replies its 32-byte public identity and the
  signature with its two public keys at the setup stage.
* **Roster** (``secagg-roster``, a file of the identities the owner trusts not to collude with
  the server, one hex key a line): at the key-sharing stage the server relays every member's
  identity and signature beside its keys. The node verifies each signature present
  (:func:`trusted_peers`): a signature that does not verify refuses the ring (the server
  altered a key, replayed another round's advertisement or relabelled a node); it counts the
  distinct roster identities among its peers and refuses, before it shares or masks anything,
  a ring with fewer than ``secagg-min-trusted`` of them.

What remains (the threat model): a roster member that colludes with the server counts as
trusted; and without a consistency round a server may still show different members different
survivor sets at the unmasking stage, which the threshold ``2t - n > c`` bounds as before.

``python -m fedsparse.client.secagg_identity KEY_PATH`` writes a new identity (mode 0600) and
prints its public key, the line the other owners add to their rosters.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from fedsparse.common.wire.secagg import SecAggError

__all__ = [
    "IDENTITY_BYTES",
    "SIGNATURE_BYTES",
    "Identity",
    "advertisement",
    "check_members",
    "load_roster",
    "trusted_peers",
    "write_identity",
]

IDENTITY_BYTES: Final = 32
"""An Ed25519 public key, raw."""
SIGNATURE_BYTES: Final = 64
_LABEL: Final = b"fedsparse/secagg/advertisement/v1\x00"


def advertisement(round_id: int, nonce: bytes, node_id: int, pk1: bytes, pk2: bytes) -> bytes:
    """The bytes a node signs for one round: each part length-prefixed, under a label."""
    parts = (round_id.to_bytes(8, "big"), node_id.to_bytes(8, "big"), nonce, pk1, pk2)
    return _LABEL + b"".join(len(p).to_bytes(4, "big") + p for p in parts)


class Identity:
    """A node's signing key (``secagg-identity``)."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        self.public = key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @classmethod
    def load(cls, path: str | Path) -> Identity:
        """The key at ``path``; ``ValueError`` naming the policy key for anything else."""
        where = f"node policy: secagg-identity={str(path)!r}"
        try:
            key = serialization.load_pem_private_key(Path(path).expanduser().read_bytes(), None)
        except (OSError, ValueError, TypeError) as err:
            raise ValueError(f"{where}: {err}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{where}: expected an Ed25519 private key")
        return cls(key)

    def sign(self, round_id: int, nonce: bytes, node_id: int, pk1: bytes, pk2: bytes) -> bytes:
        return self._key.sign(advertisement(round_id, nonce, node_id, pk1, pk2))


def write_identity(path: str | Path) -> str:
    """A new identity at ``path`` (not overwritten; mode 0600); its public key in hex."""
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(Path(path).expanduser(), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(pem)
    return Identity(key).public.hex()


def load_roster(path: str | Path) -> frozenset[bytes]:
    """The identities of ``secagg-roster``: one hex public key a line (``#`` starts a comment;
    text after the key, such as its owner's name, is ignored)."""
    where = f"node policy: secagg-roster={str(path)!r}"
    try:
        text = Path(path).expanduser().read_text()
    except OSError as err:
        raise ValueError(f"{where}: {err}") from None
    keys = set()
    for number, line in enumerate(text.splitlines(), start=1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        try:
            key = bytes.fromhex(words[0])
            Ed25519PublicKey.from_public_bytes(key)
        except ValueError:
            raise ValueError(
                f"{where}: line {number}: {words[0]!r} is not a hex Ed25519 public key"
            ) from None
        keys.add(key)
    return frozenset(keys)


def trusted_peers(
    *,
    own: int,
    round_id: int,
    nonce: bytes,
    nids: Sequence[int],
    pk1: Sequence[bytes],
    pk2: Sequence[bytes],
    identities: Sequence[bytes],
    signatures: Sequence[bytes],
    roster: frozenset[bytes],
) -> int:
    """How many distinct roster identities signed the advertisements of ``own``'s peers.

    An empty identity is an unsigned member (not counted). Raises ``ValueError`` naming the
    node whose identity is malformed or whose signature does not verify.
    """
    trusted = set()
    for nid, key1, key2, identity, signature in zip(
        nids, pk1, pk2, identities, signatures, strict=True
    ):
        if nid == own or not identity:
            continue
        try:
            public = Ed25519PublicKey.from_public_bytes(identity)
            public.verify(signature, advertisement(round_id, nonce, nid, key1, key2))
        except (ValueError, InvalidSignature):
            raise ValueError(
                f"node {nid}'s advertisement does not verify under the identity it names"
            ) from None
        if identity in roster:
            trusted.add(identity)
    return len(trusted)


def check_members(
    fields: Mapping[str, Any],
    own: int,
    bound: tuple[int, bytes],
    roster: frozenset[bytes],
    min_trusted: int,
    where: str,
) -> None:
    """The key-sharing stage's check (``fields``, checked by ``check_payload``) for node
    ``own`` in the round ``bound`` (round id, nonce): every relayed signature verifies, and
    at least ``min_trusted`` distinct roster identities signed the other members' keys.

    Raises:
        SecAggError: naming the field, and the node whose signature fails.
    """
    count = len(fields["nids"])
    empty = [b""] * count
    try:
        trusted = trusted_peers(
            own=own,
            round_id=bound[0],
            nonce=bound[1],
            nids=fields["nids"],
            pk1=fields["pk1"],
            pk2=fields["pk2"],
            identities=fields.get("identities", empty),
            signatures=fields.get("signatures", empty),
            roster=roster,
        )
    except ValueError as exc:
        raise SecAggError(f"{where}: field 'signatures': {exc}") from None
    if trusted < min_trusted:
        raise SecAggError(
            f"{where}: field 'identities': {trusted} of the ring's {count - 1} other members "
            f"are on this node's roster, it requires {min_trusted} (secagg-min-trusted)"
        )


if __name__ == "__main__":  # pragma: no cover - a command for owners
    if len(sys.argv) != 2:
        sys.exit("usage: python -m fedsparse.client.secagg_identity KEY_PATH")
    print(write_identity(sys.argv[1]))
