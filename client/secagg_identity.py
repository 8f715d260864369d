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
  (:func:`verified_members`): a signature that does not verify refuses the ring (the server
  altered a key, replayed another round's advertisement or relabelled a node); it counts the
  distinct roster identities among its peers and refuses, before it shares or masks anything,
  a ring with fewer than ``secagg-min-trusted`` of them.

At the collect stage the node masks only with peers among which ``secagg-min-trusted`` roster
identities remain (:func:`check_masked_with`), and when the nodes sign, a consistency stage
comes before the unmasking: each survivor signs the survivor set it is shown, and a node
unmasks only the set it signed, signed by that many roster identities (:func:`check_survivors`).

What remains (the threat model, ``docs/explanation/secure-aggregation.md``): a roster member
that colludes with the server counts as trusted; the ring and its ``(n, t)`` are not signed
and a survivor set needs ``secagg-min-trusted`` roster signatures, not ``t``, so a server
that shows each node its own ring can still isolate a node's input (a reviewer's attacks:
with peers that enforce nothing, and with every node at ``secagg-min-trusted=1``); against a
malicious server only the node's worst-case ε is claimed. One roster identity is one party:
the members it names beyond the first count as off the roster.

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

from fedsparse.common.wire.secagg import SecAggError, advertisement, survivors_message

__all__ = [
    "IDENTITY_BYTES",
    "SIGNATURE_BYTES",
    "Identity",
    "check_members",
    "check_survivors",
    "load_roster",
    "verified_members",
    "write_identity",
]

IDENTITY_BYTES: Final = 32
"""An Ed25519 public key, raw."""
SIGNATURE_BYTES: Final = 64


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

    def sign_survivors(
        self, round_id: int, nonce: bytes, node_id: int, active: Sequence[int]
    ) -> bytes:
        return self._key.sign(survivors_message(round_id, nonce, node_id, active))


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
            public = Ed25519PublicKey.from_public_bytes(key)
        except ValueError:
            raise ValueError(
                f"{where}: line {number}: {words[0]!r} is not a hex Ed25519 public key"
            ) from None
        if _small_order(public, key):
            raise ValueError(
                f"{where}: line {number}: {words[0]!r} is a small-order point, under which "
                "anyone forges a signature"
            )
        keys.add(key)
    return frozenset(keys)


def _small_order(public: Ed25519PublicKey, key: bytes) -> bool:
    """Whether ``key`` is a point of small order: (R, S) = (key, 0) then verifies any
    message, so its 'signatures' prove nothing."""
    try:
        public.verify(key + bytes(32), b"fedsparse/secagg/small-order-probe")
    except InvalidSignature:
        return False
    return True


def verified_members(
    *,
    own: int,
    round_id: int,
    nonce: bytes,
    nids: Sequence[int],
    pk1: Sequence[bytes],
    pk2: Sequence[bytes],
    identities: Sequence[bytes],
    signatures: Sequence[bytes],
) -> dict[int, bytes]:
    """``own``'s peers whose advertisements verify, with the identities they name.

    An empty identity is an unsigned member (left out). Raises ``ValueError`` naming the
    node whose identity is malformed or whose signature does not verify.
    """
    verified = {}
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
        verified[nid] = identity
    return verified


def check_members(
    fields: Mapping[str, Any],
    own: int,
    bound: tuple[int, bytes],
    roster: frozenset[bytes],
    min_trusted: int,
    colluders: int,
    where: str,
) -> dict[int, bytes]:
    """The key-sharing stage's check (``fields``, checked by ``check_payload``) for node
    ``own`` in the round ``bound`` (round id, nonce): every relayed signature verifies, and
    at least ``min_trusted`` distinct roster identities signed the other members' keys; and,
    where the node requires any, no more members are off its roster than the ``colluders``
    it tolerates (a made-up member is the server's own: ``2t - n > c`` then keeps the
    members off the roster below the threshold). The members whose advertisements
    verified, with their identities.

    Raises:
        SecAggError: naming the field, and the node whose signature fails.
    """
    count = len(fields["nids"])
    empty = [b""] * count
    try:
        verified = verified_members(
            own=own,
            round_id=bound[0],
            nonce=bound[1],
            nids=fields["nids"],
            pk1=fields["pk1"],
            pk2=fields["pk2"],
            identities=fields.get("identities", empty),
            signatures=fields.get("signatures", empty),
        )
    except ValueError as exc:
        raise SecAggError(f"{where}: field 'signatures': {exc}") from None
    # one roster identity is one party, however many members name it: the others it names
    # count as off the roster (a reviewer's catch: counting members let it shrink 'outside')
    trusted = len({identity for identity in verified.values() if identity in roster})
    outside = count - 1 - trusted
    if min_trusted and outside > colluders:  # off the roster: as good as the server's own
        raise SecAggError(
            f"{where}: field 'identities': {outside} of the ring's {count - 1} other members "
            f"are off this node's roster, more than the {colluders} colluders it tolerates "
            "(secagg-colluders)"
        )
    if trusted < min_trusted:
        raise SecAggError(
            f"{where}: field 'identities': {trusted} of the ring's {count - 1} other members "
            f"are on this node's roster, it requires {min_trusted} (secagg-min-trusted)"
        )
    return verified


def check_masked_with(
    srcs: Sequence[int],
    identity_of: Mapping[int, bytes],
    roster: frozenset[bytes],
    min_trusted: int,
    where: str,
) -> None:
    """The collect stage's check: at least ``min_trusted`` distinct roster identities among
    the peers this node masks with (``srcs``: the server may claim the others dropped)."""
    trusted = {identity_of[n] for n in srcs if identity_of.get(n, b"") in roster}
    if len(trusted) < min_trusted:
        raise SecAggError(
            f"{where}: field 'srcs': {len(trusted)} roster identities among the peers this "
            f"node would mask with, it requires {min_trusted} (secagg-min-trusted)"
        )


def check_survivors(
    fields: Mapping[str, Any],
    own: int,
    bound: tuple[int, bytes],
    signed: Sequence[int],
    identity_of: Mapping[int, bytes],
    roster: frozenset[bytes],
    min_trusted: int,
    where: str,
) -> None:
    """The unmask stage's check for node ``own``, which signed the survivor set ``signed`` at
    the consistency stage: the server names that same set, every relayed signature is a
    member's of it and verifies under the identity that member advertised, and at least
    ``min_trusted`` distinct roster identities (not ``own``'s own) are among the signers.

    Raises:
        SecAggError: naming the field, and the node whose signature fails.
    """
    if sorted(fields["active_nids"]) != sorted(signed):
        raise SecAggError(f"{where}: field 'active_nids' is not the set this node signed")
    signers, signatures = fields.get("signers", []), fields.get("consistency_sigs", [])
    if len(set(signers)) != len(signers):
        raise SecAggError(f"{where}: field 'signers' repeats a node")
    trusted = set()
    for signer, signature in zip(signers, signatures, strict=True):
        if signer == own:  # its own: it knows what it signed
            continue
        identity = identity_of.get(signer, b"")
        if signer not in signed or not identity:
            raise SecAggError(f"{where}: field 'signers' names node {signer}, no signed member")
        try:
            public = Ed25519PublicKey.from_public_bytes(identity)
            public.verify(signature, survivors_message(bound[0], bound[1], signer, signed))
        except (ValueError, InvalidSignature):
            raise SecAggError(
                f"{where}: field 'consistency_sigs': node {signer}'s signature of the survivor "
                "set does not verify"
            ) from None
        if identity in roster:
            trusted.add(identity)
    if len(trusted) < min_trusted:
        raise SecAggError(
            f"{where}: field 'signers': {len(trusted)} roster identities signed this survivor "
            f"set, this node requires {min_trusted} (secagg-min-trusted)"
        )


if __name__ == "__main__":  # pragma: no cover - a command for owners
    if len(sys.argv) != 2:
        sys.exit("usage: python -m fedsparse.client.secagg_identity KEY_PATH")
    print(write_identity(sys.argv[1]))
