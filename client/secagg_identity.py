"""A node's identity for secure aggregation: signed key advertisements and the owner's roster.

Without it a malicious server can fill a node's ring with members it made up: it then holds
every other pairwise mask and recovers the node's masked input, protected by the node's own
noise share alone (its worst case, ``docs/explanation/secure-aggregation.md``). With it:

* **Identity** (node policy ``secagg-identity``, a PEM Ed25519 private key the owner keeps):
  the node signs each round's advertisement, ``(round_id, nonce, node_id, pk1, pk2,
  enforces)`` under a domain label (:func:`advertisement`; ``enforces``: it requires trusted
  peers), and replies its 32-byte public identity, the flag and the signature with its keys.
* **Roster** (``secagg-roster``, a file of the identities the owner trusts not to collude with
  the server, one hex key a line): a peer is *trusted* when its identity is on the roster and
  it signed that it enforces (one that enforces nothing may answer any unmask). At the
  key-sharing stage the server relays every member's identity, flag and signature beside its
  keys; the node verifies each (:func:`verified_members`: a signature that does not verify
  refuses the ring), and one that requires ``secagg-min-trusted`` trusted peers refuses, before
  it shares or masks anything, a ring with fewer, or with more untrusted members than its
  ``secagg-colluders`` (:func:`check_members`).
* **Signed rings.** Each signing node signs the digest of the ring it was shown
  (:func:`~fedsparse.common.wire.secagg.ring_digest`) in its share-keys reply; at the collect
  stage a node that enforces masks only if every trusted peer among those the server says
  remain signed its own ring, and enough remain (:func:`check_masked_with`).
* **Consistency.** When the nodes sign, each survivor signs the survivor set it is shown,
  bound to its ring's digest, and a node that enforces unmasks only the set it signed, signed
  with it by ``t`` distinct trusted identities (:func:`check_survivors`): in one ring two
  such sets would need ``2t > n`` honest signers.

Why these close the attacks the reviews ran (the counting argument), and what they rest on
(roster members honest; a node that enforces nothing is not protected), is in
``docs/explanation/secure-aggregation.md``; against a malicious server the node's ledger
still charges its worst-case ε. One roster identity is one party: the members it names
beyond the first count as untrusted.

``python -m fedsparse.client.secagg_identity KEY_PATH`` writes a new identity (mode 0600) and
prints its public key, the line the other owners add to their rosters; ``... --nodes N FOLDER``
writes ``N`` (``node-<i>.pem``) and their roster (``roster.txt``), for one policy naming
``secagg-identity = FOLDER/node-{partition-id}.pem`` (a simulation, or one owner's nodes).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from fedsparse.common.wire.secagg import (
    SecAggError,
    advertisement,
    ring_message,
    survivors_message,
)

__all__ = [
    "IDENTITY_BYTES",
    "SIGNATURE_BYTES",
    "Identity",
    "Trust",
    "check_masked_with",
    "check_members",
    "check_survivors",
    "load_roster",
    "trusted_identities",
    "verified_members",
    "write_identities",
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

    def sign(
        self, round_id: int, nonce: bytes, node_id: int, pk1: bytes, pk2: bytes, enforces: int
    ) -> bytes:
        return self._key.sign(advertisement(round_id, nonce, node_id, pk1, pk2, enforces))

    def sign_ring(self, round_id: int, nonce: bytes, node_id: int, digest: bytes) -> bytes:
        return self._key.sign(ring_message(round_id, nonce, node_id, digest))

    def sign_survivors(
        self, round_id: int, nonce: bytes, node_id: int, active: Sequence[int], digest: bytes
    ) -> bytes:
        return self._key.sign(survivors_message(round_id, nonce, node_id, active, digest))


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


def write_identities(folder: str | Path, count: int) -> Path:
    """``count`` new identities in ``folder``, ``node-<i>.pem`` for ``i < count`` (the node
    policy's ``secagg-identity = folder/node-{partition-id}.pem``), and ``roster.txt``, their
    public keys (one owner's nodes, or a simulation's); none overwritten. Returns the roster.

    Raises:
        ValueError: ``count < 1``. FileExistsError: a key or the roster exists already.
    """
    if count < 1:
        raise ValueError(f"count={count}: expected >= 1")
    folder = Path(folder).expanduser()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    roster = folder / "roster.txt"
    keys = [folder / f"node-{i}.pem" for i in range(count)]
    for path in (roster, *keys):  # all or nothing (a link, even a dangling one, counts)
        if path.exists() or path.is_symlink():
            raise FileExistsError(f"{path}: exists (an identity is never overwritten)")
    lines = [f"{write_identity(key)}  # {key.stem}" for key in keys]
    fd = os.open(roster, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "w") as out:
        out.write("\n".join(lines) + "\n")
    return roster


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
    enforcing: Sequence[int],
) -> dict[int, tuple[bytes, bool]]:
    """``own``'s peers whose advertisements verify: the identity each names and whether it
    signed that it enforces its ring checks.

    An empty identity is an unsigned member (left out). Raises ``ValueError`` naming the
    node whose identity is malformed, whose flag is not 0 or 1 or whose signature does not
    verify.
    """
    verified = {}
    for nid, key1, key2, identity, signature, flag in zip(
        nids, pk1, pk2, identities, signatures, enforcing, strict=True
    ):
        if nid == own or not identity:
            continue
        if flag not in (0, 1):
            raise ValueError(f"node {nid}'s 'enforcing' flag is {flag}, expected 0 or 1")
        try:
            public = Ed25519PublicKey.from_public_bytes(identity)
            public.verify(signature, advertisement(round_id, nonce, nid, key1, key2, flag))
        except (ValueError, InvalidSignature):
            raise ValueError(
                f"node {nid}'s advertisement does not verify under the identity it names"
            ) from None
        verified[nid] = (identity, bool(flag))
    return verified


def check_members(
    fields: Mapping[str, Any],
    own: int,
    bound: tuple[int, bytes],
    roster: frozenset[bytes],
    min_trusted: int,
    colluders: int,
    where: str,
) -> tuple[dict[int, bytes], set[int]]:
    """The key-sharing stage's check (``fields``, checked by ``check_payload``) for node
    ``own`` in the round ``bound`` (round id, nonce): every relayed signature verifies, and
    at least ``min_trusted`` distinct trusted identities (on the roster *and* signed as
    enforcing their ring checks) signed the other members' keys; and, where the node
    requires any, no more members are untrusted than the ``colluders`` it tolerates (a
    made-up member is the server's own, a member that enforces nothing may answer any
    unmask: ``2t - n > c`` then keeps the untrusted below the threshold). The members whose
    advertisements verified, with their identities, and those among them that enforce.

    Raises:
        SecAggError: naming the field, and the node whose signature fails.
    """
    count = len(fields["nids"])
    try:
        verified = verified_members(
            own=own,
            round_id=bound[0],
            nonce=bound[1],
            nids=fields["nids"],
            pk1=fields["pk1"],
            pk2=fields["pk2"],
            identities=fields.get("identities", [b""] * count),
            signatures=fields.get("signatures", [b""] * count),
            enforcing=fields.get("enforcing", [0] * count),
        )
    except ValueError as exc:
        raise SecAggError(f"{where}: field 'signatures': {exc}") from None
    identity_of = {nid: identity for nid, (identity, _) in verified.items()}
    enforcing = {nid for nid, (_, enforces) in verified.items() if enforces}
    # one roster identity is one party, however many members name it: the others it names
    # count as untrusted (a reviewer's catch: counting members let it shrink 'outside')
    trusted = len(trusted_identities(identity_of, enforcing, roster))
    outside = count - 1 - trusted
    if min_trusted and outside > colluders:  # untrusted: as good as the server's own
        raise SecAggError(
            f"{where}: field 'identities': {outside} of the ring's {count - 1} other members "
            f"are off this node's roster or enforce nothing, more than the {colluders} "
            "colluders it tolerates (secagg-colluders)"
        )
    if trusted < min_trusted:
        raise SecAggError(
            f"{where}: field 'identities': {trusted} of the ring's {count - 1} other members "
            f"are on this node's roster and enforce their checks, it requires {min_trusted} "
            "(secagg-min-trusted)"
        )
    return identity_of, enforcing


@dataclass(frozen=True)
class Trust:
    """What a node knows of its ring after the key-sharing stage: the identity each member
    advertised (verified), those signed as enforcing, the owner's roster and the digest of
    the ring it was shown."""

    identity_of: Mapping[int, bytes]
    enforcing: frozenset[int]
    roster: frozenset[bytes]
    digest: bytes


def trusted_identities(
    identity_of: Mapping[int, bytes], enforcing: Iterable[int], roster: frozenset[bytes]
) -> set[bytes]:
    """The distinct identities of the members that are trusted: on the roster and signed as
    enforcing their ring checks."""
    return {identity_of[n] for n in enforcing if identity_of.get(n, b"") in roster}


def check_masked_with(
    srcs: Sequence[int],
    ring_sigs: Sequence[bytes] | None,
    trust: Trust,
    min_trusted: int,
    bound: tuple[int, bytes],
    where: str,
) -> None:
    """The collect stage's check (where the node requires trusted peers): every trusted peer
    among those this node masks with (``srcs``: the server may claim the others dropped)
    signed that it was shown this node's ring (``trust.digest``), and at least ``min_trusted``
    distinct trusted identities remain. A trusted peer shown another ring would hand its
    ``sk1`` shares to that ring's members, out of this ring's count."""
    if not min_trusted:
        return
    if ring_sigs is None:
        raise SecAggError(
            f"{where}: field 'ring_sigs' is missing: this node masks only with trusted peers "
            "that signed its ring (secagg-min-trusted)"
        )
    trusted = set()
    for src, signature in zip(srcs, ring_sigs, strict=True):
        identity = trust.identity_of.get(src, b"")
        if src not in trust.enforcing or identity not in trust.roster:
            continue
        try:
            public = Ed25519PublicKey.from_public_bytes(identity)
            public.verify(signature, ring_message(bound[0], bound[1], src, trust.digest))
        except (ValueError, InvalidSignature):
            raise SecAggError(
                f"{where}: field 'ring_sigs': node {src} did not sign this node's ring (it was "
                "shown another, or the signature was altered)"
            ) from None
        trusted.add(identity)
    if len(trusted) < min_trusted:
        raise SecAggError(
            f"{where}: field 'srcs': {len(trusted)} trusted identities among the peers this "
            f"node would mask with, it requires {min_trusted} (secagg-min-trusted)"
        )


def check_survivors(
    fields: Mapping[str, Any],
    own: int,
    bound: tuple[int, bytes],
    signed: Sequence[int],
    trust: Trust,
    needed: int,
    where: str,
) -> None:
    """The unmask stage's check for node ``own``, which signed the survivor set ``signed`` in
    the ring of ``trust.digest`` at the consistency stage: the server names that same set, every
    relayed signature is a member's of it and verifies (for that set, in that ring) under the
    identity that member advertised, and with ``own`` the signers hold at least ``needed``
    distinct trusted identities (the threshold ``t``: two survivor sets signed so in one ring
    would need ``2t`` trusted members, more than its ``n``, so honest trusted nodes unmask
    one set a ring and round).

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
        identity = trust.identity_of.get(signer, b"")
        if signer not in signed or not identity:
            raise SecAggError(f"{where}: field 'signers' names node {signer}, no signed member")
        message = survivors_message(bound[0], bound[1], signer, signed, trust.digest)
        try:
            public = Ed25519PublicKey.from_public_bytes(identity)
            public.verify(signature, message)
        except (ValueError, InvalidSignature):
            raise SecAggError(
                f"{where}: field 'consistency_sigs': node {signer}'s signature of the survivor "
                "set does not verify (another set, another ring, or altered)"
            ) from None
        if identity in trust.roster and signer in trust.enforcing:
            trusted.add(identity)
    if len(trusted) + 1 < needed:
        raise SecAggError(
            f"{where}: field 'signers': this node and {len(trusted)} trusted identities signed "
            f"this survivor set, it requires the threshold t = {needed} (secagg-min-trusted)"
        )


if __name__ == "__main__":  # pragma: no cover - a command for owners
    if (
        len(sys.argv) == 4
        and sys.argv[1] == "--nodes"
        and sys.argv[2].isascii()
        and sys.argv[2].isdigit()
    ):
        print(write_identities(sys.argv[3], int(sys.argv[2])))
    elif len(sys.argv) == 2:
        print(write_identity(sys.argv[1]))
    else:
        sys.exit(
            "usage: python -m fedsparse.client.secagg_identity KEY_PATH\n"
            "       python -m fedsparse.client.secagg_identity --nodes N FOLDER"
        )
