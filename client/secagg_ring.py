"""The ring a node shares its secrets with, as the key-sharing stage shows it (secagg.py).

Over the complete graph (``neighbours = 0``) the stage's ``nids`` are every member of the
round, each holding one share of the node's self-mask seed and ``sk1``. Over a sparse ring
(SecAgg+, ``common/aggregation/graph.py``) the stage also names every ``members`` id and the
node computes its own neighbourhood from them, the round and the server's nonce; the
``nids`` must be exactly it (the node and its neighbours, by id), so the server cannot pick
whom a node shares with, and the share threshold follows from the member count and the
ring's colluder bound, not from the server's word.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedsparse.common.aggregation.graph import graph_seed, neighbourhood
from fedsparse.common.aggregation.secure import RingParams
from fedsparse.common.wire.secagg import (
    RING_FIELDS,
    SecAggError,
    graph_digest,
    ring_digest,
)

__all__ = ["RingView", "ring_view"]


@dataclass(frozen=True)
class RingView:
    """What a node shares with this round."""

    holders: list[int]
    """The nodes that hold its shares, itself included, in the order of Shamir's ``x``."""
    threshold: int
    """The shares that rebuild one of its secrets."""
    digest: bytes
    """The ring it was shown, as a signing node signs it (``ring_digest``/``graph_digest``)."""


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
    if not params.neighbours:
        if members is not None:
            raise SecAggError(f"{where}: field 'members' in a ring of the complete graph")
        identities = fields.get("identities", [b""] * len(nids))
        digest = ring_digest(ring, nids, fields["pk1"], fields["pk2"], identities)
        return RingView(list(nids), params.threshold, digest)
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
    return RingView(holders, threshold, graph_digest(ring, params.neighbours, members))
