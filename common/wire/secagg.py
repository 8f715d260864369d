"""Secure aggregation's stage messages: names, field types, checks and byte counts, no Flower.

Four stages, each a request from the server and a reply from every client that is still there
(the names and keys follow Flower's SecAgg+ where they mean the same):

=========================  ====================================  ===========================
stage                      server -> client                      client -> server
=========================  ====================================  ===========================
``setup``                  the ring's public parameters          ``pk1``, ``pk2`` (PEM keys,
                                                                 sparse: compressed points),
                                                                 ``seeded_noise`` (0 or 1),
                                                                 [``identity``, ``signature``,
                                                                 ``enforces``]
``share_keys``             ``nids``, ``pk1``, ``pk2`` (lists),   ``dsts``, ``ctxts``,
                           [``identities``, ``signatures``,      ``seed_commit``,
                           ``enforcing``]                        [``ring_signature``]
``collect_masked_vectors`` ``srcs``, ``ctxts`` (shares for it)   ``masked_params`` (bytes),
                           [``ring_sigs``]                       ``round_id``, ``nonce``
[``consistency``]          ``active_nids``                       ``signature``
``unmask``                 ``active_nids``, ``dead_nids``,       ``nids``, ``shares``
                           [``signers``, ``consistency_sigs``]
=========================  ====================================  ===========================

Fields in brackets travel together or not at all: a node with an identity signs its keys and
whether it enforces its ring checks (``enforces``: it requires roster peers;
``client/secagg_identity.py``), and the server relays every member's identity, signature and
flag (``b""``, ``0`` for a member without one) beside the keys. A signing node also signs the
digest of the ring it was shown (:func:`ring_digest`: the ring's parameters, every member's
id, keys and identity) in its share-keys reply, and the collect stage relays each source's
(``ring_sigs``, ``b""`` for an unsigned one). Then the ``consistency`` stage runs between
collect and unmask: each survivor signs the set of nodes whose inputs the sum holds, bound to
its ring's digest (``b""``: a node without an identity), and the unmask stage relays the
signatures.

A sparse ring (SecAgg+, ``common/aggregation/graph.py``) adds two fields: the setup's
``neighbours`` (``k``), and the share-keys stage's ``members`` (every member's id, from which
each node computes its own ``k`` neighbours); then ``nids``, ``pk1``, ``pk2`` (and the
identity lists) are the node's own neighbourhood, the node included, ``dsts`` its
neighbours, the collect stage's ``srcs`` and the unmask stage's ``active_nids`` and
``dead_nids`` lie in it, and the ring a signing node signs is :func:`graph_digest` (the
parameters, ``k``, the members and the keys of its neighbourhood). Its keys, shares and
share ciphertexts are the compact ones of ``common/wire/secagg_compact.py``. The complete
graph sends neither field: its payloads are byte for byte what they were.

Every message from the server also carries the round's ``round_id`` and ``nonce`` (the
server's random bytes): a client binds the round to them at setup and releases one masked
input per ``round_id``, whose reply names the round again.

A payload is a plain ``dict`` of ``int``, ``float``, ``bytes`` and lists of them, what a
Flower ``ConfigRecord`` holds. :func:`check_payload` is the trust boundary: a missing field,
a value of the wrong type (``bool`` is not an ``int``), or parallel lists of different lengths
raise one :class:`SecAggError` naming the stage and the field; so do a node id outside
``[0, 2^64)``, a bytes field over :data:`MAX_FIELD_BYTES` (but the masked vector, whose
length the ring fixes), and a ``stage`` field in a reply. :func:`payload_bytes` counts
a payload as ``ConfigRecord.count_bytes`` does (8 per number, the length of each bytes or
string, the keys' lengths), so the wiring can record every stage's bytes, up and down.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, Final

from fedsparse.common.wire.protocol import ProtocolError

__all__ = [
    "DOWN",
    "SECAGG_ACTION",
    "SECAGG_RECORD",
    "ALL_STAGES",
    "CONSISTENCY",
    "STAGES",
    "UP",
    "SecAggError",
    "advertisement",
    "graph_digest",
    "ring_digest",
    "ring_message",
    "check_payload",
    "payload_bytes",
    "seed_commitment",
    "survivors_message",
]

#: The ``ConfigRecord`` of a Flower message that carries a stage, both ways: the setup rides
#: on the train message (and its reply), the later stages on ``query.secagg`` messages.
SECAGG_RECORD: Final = "fedsparse.secagg"
SECAGG_ACTION: Final = "secagg"
STAGE: Final = "stage"
SETUP: Final = "setup"
SHARE_KEYS: Final = "share_keys"
COLLECT: Final = "collect_masked_vectors"
UNMASK: Final = "unmask"
STAGES: Final = (SETUP, SHARE_KEYS, COLLECT, UNMASK)
#: Between collect and unmask when the nodes sign (``client/secagg_identity.py``): each
#: survivor signs the set of nodes whose inputs the sum holds; the unmask stage relays them.
CONSISTENCY: Final = "consistency"
ALL_STAGES: Final = (SETUP, SHARE_KEYS, COLLECT, CONSISTENCY, UNMASK)

#: The setup's ring parameters, by name and type (``RingParams``'s fields).
RING_FIELDS: Final[dict[str, type]] = {
    "clip": float,
    "sigma": float,
    "clients": int,
    "threshold": int,
    "kept": int,
    "scale": float,
    "bits": int,
    "colluders": int,
}
#: What ties each message to one round: the round's id and the server's nonce.
BINDING: Final[dict[str, type]] = {"round_id": int, "nonce": bytes}
NONCE_BYTES: Final = 16
"""The fewest bytes of a server's nonce (it draws this many from OS entropy)."""
COMMIT_BYTES: Final = 32
"""A self-seed commitment: SHA-256."""
MAX_FIELD_BYTES: Final = 4096
"""The most bytes a key, share, nonce or ciphertext may have (theirs are a few hundred)."""
#: Fields whose ints are node ids (Flower's are unsigned 64-bit).
NODE_ID_FIELDS: Final = frozenset(
    {"nids", "dsts", "srcs", "active_nids", "dead_nids", "signers", "members"}
)

#: Field -> type: ``int``, ``float``, ``bytes``, or ``(list, element type)``.
DOWN: Final[dict[str, dict[str, Any]]] = {
    SETUP: {**RING_FIELDS, **BINDING},
    SHARE_KEYS: {"nids": (list, int), "pk1": (list, bytes), "pk2": (list, bytes), **BINDING},
    COLLECT: {"srcs": (list, int), "ctxts": (list, bytes), **BINDING},
    CONSISTENCY: {"active_nids": (list, int), **BINDING},
    UNMASK: {"active_nids": (list, int), "dead_nids": (list, int), **BINDING},
}
UP: Final[dict[str, dict[str, Any]]] = {
    SETUP: {"pk1": bytes, "pk2": bytes, "seeded_noise": int},
    SHARE_KEYS: {"dsts": (list, int), "ctxts": (list, bytes), "seed_commit": bytes},
    COLLECT: {"masked_params": bytes, **BINDING},
    CONSISTENCY: {"signature": bytes},
    UNMASK: {"nids": (list, int), "shares": (list, bytes)},
}
#: Fields a payload carries together or not at all (a node's signed advertisement at setup,
#: relayed with every member's keys: ``client/secagg_identity.py``), checked when present.
OPTIONAL: Final[dict[tuple[str, str], dict[str, Any]]] = {
    (SETUP, "up"): {"identity": bytes, "signature": bytes, "enforces": int},
    (SHARE_KEYS, "down"): {
        "identities": (list, bytes),
        "signatures": (list, bytes),
        "enforcing": (list, int),
    },
    (SHARE_KEYS, "up"): {"ring_signature": bytes},
    (COLLECT, "down"): {"ring_sigs": (list, bytes)},
    (UNMASK, "down"): {"signers": (list, int), "consistency_sigs": (list, bytes)},
}
#: A sparse ring's fields (travelling together, as ``OPTIONAL``'s; absent: the complete graph).
SPARSE: Final[dict[tuple[str, str], dict[str, Any]]] = {
    (SETUP, "down"): {"neighbours": int},
    (SHARE_KEYS, "down"): {"members": (list, int)},
}
#: A small ring's field (``common/aggregation/small_ring.py``; absent: the exact ring).
SMALL: Final[dict[tuple[str, str], dict[str, Any]]] = {(SETUP, "down"): {"modular": int}}
#: Lists that pair up element by element (with the optional lists, when present).
PARALLEL: Final[dict[tuple[str, str], tuple[str, ...]]] = {
    (SHARE_KEYS, "down"): ("nids", "pk1", "pk2"),
    (SHARE_KEYS, "up"): ("dsts", "ctxts"),
    (COLLECT, "down"): ("srcs", "ctxts"),
    (UNMASK, "up"): ("nids", "shares"),
}


#: The domain labels of what a node's identity signs (``client/secagg_identity.py``).
_ADVERTISEMENT: Final = b"fedsparse/secagg/advertisement/v2\x00"
_RING_VIEW: Final = b"fedsparse/secagg/ring/v1\x00"
_RING_DIGEST: Final = b"fedsparse/secagg/ring-digest/v1\x00"
_SURVIVORS: Final = b"fedsparse/secagg/survivors/v2\x00"
_GRAPH_DIGEST: Final = b"fedsparse/secagg/graph-digest/v1\x00"


def _framed(*parts: bytes) -> bytes:
    return b"".join(len(p).to_bytes(4, "big") + p for p in parts)


def advertisement(
    round_id: int, nonce: bytes, node_id: int, pk1: bytes, pk2: bytes, enforces: int
) -> bytes:
    """The bytes a node signs for one round: its keys and whether it enforces its ring checks
    (1 or 0), each part length-prefixed, under a label."""
    flag = bytes([1 if enforces else 0])
    ids = (round_id.to_bytes(8, "big"), node_id.to_bytes(8, "big"))
    return _ADVERTISEMENT + _framed(*ids, nonce, pk1, pk2, flag)


def _ring_parameters(digest: Any, ring: Mapping[str, Any]) -> None:
    """Hashes the ring's parameters (``RING_FIELDS``, and ``modular`` when a small ring's)."""
    for name, kind in RING_FIELDS.items():
        value = repr(float(ring[name])) if kind is float else str(int(ring[name]))
        digest.update(_framed(f"{name}={value}".encode()))
    if ring.get("modular"):
        digest.update(_framed(b"modular=1"))


def ring_digest(
    ring: Mapping[str, Any],
    nids: Sequence[int],
    pk1: Sequence[bytes],
    pk2: Sequence[bytes],
    identities: Sequence[bytes],
) -> bytes:
    """The SHA-256 of a ring as a node was shown it: its parameters (``RING_FIELDS`` of
    ``ring``, and its ``modular`` flag when set) and each member's id, keys and identity
    (``b""``: none), by id. Two nodes that were shown the same ring compute the same digest;
    a server that shows them different rings (members, keys or parameters) cannot give them
    one."""
    digest = hashlib.sha256(_RING_DIGEST)
    _ring_parameters(digest, ring)
    for nid, key1, key2, identity in sorted(zip(nids, pk1, pk2, identities, strict=True)):
        digest.update(_framed(nid.to_bytes(8, "big"), key1, key2, identity))
    return digest.digest()


def graph_digest(
    ring: Mapping[str, Any], neighbours: int, members: Sequence[int], view: bytes
) -> bytes:
    """The SHA-256 of a sparse ring as one node was shown it: the ring's parameters
    (``RING_FIELDS``), ``neighbours``, the sorted member ids and ``view``, the
    :func:`ring_digest` of the neighbourhood's keys it was sent (so two share-keys messages
    that differ in one key are two rings, for the node's one ring a round)."""
    digest = hashlib.sha256(_GRAPH_DIGEST)
    _ring_parameters(digest, ring)
    digest.update(_framed(f"neighbours={int(neighbours)}".encode()))
    digest.update(len(members).to_bytes(4, "big"))
    for nid in sorted(members):
        digest.update(nid.to_bytes(8, "big"))
    digest.update(_framed(view))
    return digest.digest()


def ring_message(round_id: int, nonce: bytes, node_id: int, digest: bytes) -> bytes:
    """The bytes a node signs in its share-keys reply: the digest of the ring it was shown."""
    ids = (round_id.to_bytes(8, "big"), node_id.to_bytes(8, "big"))
    return _RING_VIEW + _framed(*ids, nonce, digest)


def survivors_message(
    round_id: int, nonce: bytes, node_id: int, active: Sequence[int], digest: bytes
) -> bytes:
    """The bytes a survivor signs at the consistency stage: the sorted survivor set, in the
    ring of ``digest`` (``ring_digest``)."""
    head = round_id.to_bytes(8, "big") + node_id.to_bytes(8, "big")
    body = b"".join(n.to_bytes(8, "big") for n in sorted(active))
    return _SURVIVORS + head + _framed(nonce, digest) + body


class SecAggError(ProtocolError):
    """A secure-aggregation payload or state that does not match the protocol.

    ``node`` is the node whose reply broke it, when one did: the server's state is unchanged
    by the failed call, so a caller may drop that reply and call again.
    """

    def __init__(self, message: str, node: int | None = None) -> None:
        super().__init__(message)
        self.node = node


def _type_name(spec: Any) -> str:
    return f"list of {spec[1].__name__}" if isinstance(spec, tuple) else spec.__name__


def _fits(value: Any, spec: Any) -> bool:
    if isinstance(spec, tuple):
        return isinstance(value, list) and all(_fits(v, spec[1]) for v in value)
    if spec is float:
        return type(value) in (float, int)
    return type(value) is spec


def check_payload(payload: Any, stage: str, direction: str) -> dict[str, Any]:
    """``payload``'s fields for ``stage`` (``direction`` "down" or "up"), checked; a copy."""
    if stage not in ALL_STAGES:
        raise SecAggError(f"secure aggregation: unknown stage {stage!r}")
    schema = {"down": DOWN, "up": UP}[direction][stage]
    where = f"secure aggregation, stage {stage!r} ({direction})"
    if not isinstance(payload, Mapping):
        raise SecAggError(f"{where}: the payload must be a mapping, got {type(payload).__name__}")
    if direction == "down" and payload.get(STAGE) != stage:
        raise SecAggError(f"{where}: field {STAGE!r} must be {stage!r}, got {payload.get(STAGE)!r}")
    if direction == "up" and STAGE in payload:
        raise SecAggError(f"{where}: unexpected field {STAGE!r} in a reply")
    optional: dict[str, Any] = {}
    present: list[str] = []
    paired: list[str] = []  # the optional lists that pair with the stage's (not the members)
    groups = (OPTIONAL, SPARSE, SMALL)
    for group in (kind.get((stage, direction), {}) for kind in groups):
        here = [field for field in group if field in payload]
        if here and len(here) != len(group):
            missing = next(field for field in group if field not in payload)
            raise SecAggError(f"{where}: field {missing!r} is missing (it comes with {here[0]!r})")
        if group is OPTIONAL.get((stage, direction)):
            paired = [field for field in here if isinstance(group[field], tuple)]
        optional |= group
        present += here
    out: dict[str, Any] = {}
    for field, spec in {**schema, **{f: optional[f] for f in present}}.items():
        if field not in payload:
            raise SecAggError(f"{where}: field {field!r} is missing")
        value = payload[field]
        if not _fits(value, spec):
            raise SecAggError(
                f"{where}: field {field!r} must be {_type_name(spec)}, got {_describe(value)}"
            )
        problem = _out_of_range(field, value)
        if problem:
            raise SecAggError(f"{where}: field {field!r} {problem}")
        out[field] = float(value) if spec is float else value
    extra = sorted(set(payload) - set(schema) - set(optional) - {STAGE})
    if extra:
        raise SecAggError(f"{where}: unexpected field {extra[0]!r}")
    lists = PARALLEL.get((stage, direction), ())
    lists = (*lists, *paired)
    lengths = {field: len(out[field]) for field in lists}
    if len(set(lengths.values())) > 1:
        sizes = ", ".join(f"{f}={n}" for f, n in lengths.items())
        raise SecAggError(f"{where}: field {lists[-1]!r} must pair with {lists[0]!r} ({sizes})")
    return out


def _out_of_range(field: str, value: Any) -> str:
    items = value if isinstance(value, list) else [value]
    if field in NODE_ID_FIELDS or field == "round_id":
        bad = [v for v in items if not 0 <= v < 1 << 64]
        return f"holds {bad[0]}, not an unsigned 64-bit id" if bad else ""
    if field == "neighbours" and value < 2:  # a complete ring sends no such field
        return f"holds {value}, not a sparse ring's (>= 2)"
    if field == "modular" and value != 1:  # an exact ring sends no such field
        return f"holds {value}, not a small ring's (1)"
    if field != "masked_params":
        long = [len(v) for v in items if isinstance(v, bytes) and len(v) > MAX_FIELD_BYTES]
        return f"holds {long[0]} bytes, more than {MAX_FIELD_BYTES}" if long else ""
    return ""


def _describe(value: Any) -> str:
    if isinstance(value, list):
        kinds = sorted({type(v).__name__ for v in value})
        return f"a list of {'/'.join(kinds) or 'nothing'}"
    return type(value).__name__


def _value_bytes(value: Any) -> int:
    if isinstance(value, bool):
        return 1
    if isinstance(value, int | float):
        return 8
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, bytes):
        return len(value)
    raise SecAggError(f"secure aggregation: cannot count a {type(value).__name__}")


def payload_bytes(payload: Mapping[str, Any]) -> int:
    """A payload's bytes as a Flower ``ConfigRecord`` counts them, keys included."""
    total = 0
    for key, value in payload.items():
        total += len(key.encode())
        items = value if isinstance(value, list) else [value]
        total += sum(_value_bytes(v) for v in items)
    return total


def seed_commitment(seed: bytes) -> bytes:
    """A client's commitment to its self-mask seed (SHA-256, domain-separated): the server
    checks a rebuilt seed against it, so a bad share cannot silently change the sum."""
    return hashlib.sha256(b"fedsparse/secagg/self-seed\x00" + seed).digest()
