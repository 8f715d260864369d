"""The ring a node shares its secrets with, as the key-sharing stage shows it (secagg.py).

Over the complete graph (``neighbours = 0``) the stage's ``nids`` are every member of the
round, each holding one share of the node's self-mask seed and ``sk1``. Over a sparse ring
(SecAgg+, ``common/aggregation/graph.py``) the stage also names every ``members`` id and the
node computes its own neighbourhood from them, the round and the server's nonce; the
``nids`` must be exactly it (the node and its neighbours, by id: which ids, not which keys,
those are the server's word as over the complete graph without a roster), and the share
threshold follows from the member count and the ring's colluder bound.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.fernet import InvalidToken
from cryptography.hazmat.primitives.asymmetric.ec import EllipticCurvePublicKey
from flwr.common.secure_aggregation.crypto.shamir import create_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt, encrypt
from flwr.common.secure_aggregation.secaggplus_utils import (
    share_keys_plaintext_concat,
    share_keys_plaintext_separate,
)
from flwr.supercore.primitives.asymmetric import bytes_to_public_key, public_key_to_bytes

from fedsparse.common.aggregation.graph import graph_seed, neighbourhood
from fedsparse.common.aggregation.secure import RingParams
from fedsparse.common.aggregation.shamir import split, to_bytes
from fedsparse.common.wire.secagg import (
    RING_FIELDS,
    SecAggError,
    graph_digest,
    ring_digest,
)
from fedsparse.common.wire.secagg_compact import (
    compressed,
    load_compressed,
    open_shares,
    scalar_of,
    seal_shares,
)

__all__ = [
    "RingView",
    "decode_public",
    "encode_public",
    "make_shares",
    "ring_view",
    "seal",
    "unseal",
]


@dataclass(frozen=True)
class RingView:
    """What a node shares with this round."""

    holders: list[int]
    """The nodes that hold its shares, itself included, in the order of Shamir's ``x``."""
    threshold: int
    """The shares that rebuild one of its secrets."""
    digest: bytes
    """The ring it was shown, as a signing node signs it (``ring_digest``/``graph_digest``)."""
    members: int
    """The ring's members (a sparse ring's threshold follows from their count)."""


def ring_view(
    fields: Mapping[str, Any],
    node_id: int,
    params: RingParams,
    bound: tuple[int, bytes],
    own_keys: tuple[bytes, bytes],
    where: str,
) -> RingView:
    """The key-sharing stage's ring (``fields``, checked by ``check_payload``) for
    ``node_id`` in the round ``bound`` (round id, nonce), whose setup keys are ``own_keys``.

    Raises:
        SecAggError: naming the field that is wrong.
    """
    nids: list[int] = fields["nids"]
    members: list[int] | None = fields.get("members")
    if len(set(nids)) != len(nids):
        raise SecAggError(f"{where}: field 'nids' repeats a node")
    if not params.neighbours and not params.threshold <= len(nids) <= params.clients:
        raise SecAggError(
            f"{where}: field 'nids' has {len(nids)} nodes, outside "
            f"[threshold {params.threshold}, clients {params.clients}]"
        )
    if node_id not in nids:
        raise SecAggError(f"{where}: field 'nids' leaves out this node")
    mine = nids.index(node_id)
    if (fields["pk1"][mine], fields["pk2"][mine]) != own_keys:
        raise SecAggError(f"{where}: field 'pk1'/'pk2' alters this node's own keys")
    keys = fields["pk1"] + fields["pk2"]
    if len(set(keys)) != len(keys):
        raise SecAggError(f"{where}: field 'pk1'/'pk2' repeats a public key")
    ring = {name: getattr(params, name) for name in RING_FIELDS}
    ring |= {"modular": 1} if params.modular else {}
    identities = fields.get("identities", [b""] * len(nids))
    digest = ring_digest(ring, nids, fields["pk1"], fields["pk2"], identities)
    if not params.neighbours:
        if members is not None:
            raise SecAggError(f"{where}: field 'members' in a ring of the complete graph")
        return RingView(list(nids), params.threshold, digest, len(nids))
    if members is None:
        raise SecAggError(
            f"{where}: field 'members' is missing: the ring is sparse "
            f"(neighbours={params.neighbours})"
        )
    if members != sorted(set(members)) or node_id not in members:
        raise SecAggError(
            f"{where}: field 'members' must list each member once, by id, this node included"
        )
    if not params.threshold <= len(members) <= params.clients:
        raise SecAggError(
            f"{where}: field 'members' has {len(members)} nodes, outside "
            f"[threshold {params.threshold}, clients {params.clients}]"
        )
    seed = graph_seed(bound[0], bound[1], params.neighbours, members)
    holders = sorted([node_id, *neighbourhood(node_id, members, params.neighbours, seed)])
    if nids != holders:
        raise SecAggError(
            f"{where}: field 'nids' is not this node's neighbourhood in the ring (itself and "
            f"its {len(holders) - 1} neighbours, by id)"
        )
    threshold = params.share_threshold(len(members))
    view = graph_digest(ring, params.neighbours, members, digest)
    return RingView(holders, threshold, view, len(members))


# What differs between the two rings' encodings (common/wire/secagg_compact.py): Flower's
# for the complete graph, the compact ones for a sparse ring.


def encode_public(sparse: bool, key: EllipticCurvePublicKey) -> bytes:
    """A public key on the wire: a compressed point in a sparse ring, else Flower's PEM."""
    return compressed(key) if sparse else public_key_to_bytes(key)


def decode_public(sparse: bool, data: bytes) -> EllipticCurvePublicKey:
    """``encode_public``'s key; ``ValueError`` (or ``TypeError``) for anything else."""
    return load_compressed(data) if sparse else bytes_to_public_key(data)


def make_shares(
    sparse: bool, threshold: int, holders: int, self_seed: bytes, sk1_pem: bytes
) -> tuple[list[bytes], list[bytes]]:
    """The shares of the self-mask seed and of ``sk1`` for ``holders`` holders, in their
    order: ``GF(P)`` elements of the seed and the private scalar in a sparse ring, else
    Flower's ``create_shares`` of the seed and the PEM key."""
    if not sparse:
        return (
            create_shares(self_seed, threshold, holders),
            create_shares(sk1_pem, threshold, holders),
        )
    seed = int.from_bytes(self_seed, "big")
    seed_shares = [to_bytes(y) for y in split(seed, threshold, holders)]
    sk1_shares = [to_bytes(y) for y in split(scalar_of(sk1_pem), threshold, holders)]
    return seed_shares, sk1_shares


def seal(
    sparse: bool,
    key: bytes,
    bound: tuple[int, bytes],
    src: int,
    dst: int,
    shares: tuple[bytes, bytes],
) -> bytes:
    """``src``'s shares for ``dst`` under their share ``key`` (Flower's Fernet key)."""
    if sparse:
        return seal_shares(base64.urlsafe_b64decode(key), bound, src, dst, *shares)
    return encrypt(key, share_keys_plaintext_concat(src, dst, *shares))


def unseal(
    sparse: bool, key: bytes, bound: tuple[int, bytes], src: int, dst: int, ciphertext: bytes
) -> tuple[bytes, bytes]:
    """``seal``'s shares, or ``ValueError`` naming why not (it does not decrypt, or it names
    another pair)."""
    if sparse:
        return open_shares(base64.urlsafe_b64decode(key), bound, src, dst, ciphertext)
    try:
        actual_src, actual_dst, seed_share, sk1_share = share_keys_plaintext_separate(
            decrypt(key, ciphertext)
        )
    except (InvalidToken, ValueError, IndexError):
        raise ValueError("does not decrypt") from None
    if (actual_src, actual_dst) != (src, dst):
        raise ValueError(f"carries {actual_src} -> {actual_dst}")
    return seed_share, sk1_share
