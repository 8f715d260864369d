"""The server's checks of a sparse ring (``server/secagg.py``): each node's compact keys at
setup, its ciphertexts' length at key sharing, and the survivors one part of the ring, each
failing with the node it names (``SecAggError.node``) or before anyone releases."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from fedsparse.common.aggregation.graph import parts
from fedsparse.common.aggregation.shamir import from_bytes
from fedsparse.common.wire.secagg import SecAggError
from fedsparse.common.wire.secagg_compact import CIPHERTEXT_BYTES, load_compressed

__all__ = ["check_ciphertexts", "check_keys", "check_one_part", "is_share"]


def check_keys(stage: str, replies: Mapping[int, Mapping[str, Any]]) -> None:
    """Every setup reply's ``pk1`` and ``pk2`` a compressed point on the curve, the two
    different, and no key another node's (a node with a bad or copied key would fail its
    neighbours' key sharing unnamed)."""
    owner: dict[bytes, int] = {}
    for nid, reply in replies.items():
        for field in ("pk1", "pk2"):
            try:
                load_compressed(reply[field])
            except ValueError as exc:
                raise SecAggError(
                    f"secure aggregation, stage {stage!r}: field {field!r} of node {nid} is not "
                    f"a key: {exc}",
                    node=nid,
                ) from None
            other = owner.setdefault(reply[field], nid)
            if other != nid or reply["pk1"] == reply["pk2"]:
                raise SecAggError(
                    f"secure aggregation, stage {stage!r}: field {field!r} of node {nid} repeats "
                    f"a key of node {other}",
                    node=nid,
                )


def check_ciphertexts(stage: str, src: int, ctxts: Sequence[bytes]) -> None:
    """Each of ``src``'s share ciphertexts :data:`CIPHERTEXT_BYTES` long (its neighbour would
    refuse it at the collection without naming it)."""
    if any(len(c) != CIPHERTEXT_BYTES for c in ctxts):
        raise SecAggError(
            f"secure aggregation, stage {stage!r}: field 'ctxts' of node {src} holds a "
            f"ciphertext that is not {CIPHERTEXT_BYTES} bytes",
            node=src,
        )


def check_one_part(
    stage: str, graph: Mapping[int, Sequence[int]], alive: Collection[int], when: str
) -> None:
    """``ValueError`` naming the parts when the ``alive`` nodes fall into more than one part
    of the ring (each part's sum could be decoded apart; the server's dropout error)."""
    split = parts(graph, alive)
    if len(split) > 1:
        raise ValueError(
            f"secure aggregation, stage {stage!r}: the {len(alive)} {when} fall into "
            f"{len(split)} parts of the sparse ring (the smallest of {min(map(len, split))} "
            "nodes): no sum is decoded"
        )


def is_share(share: bytes) -> bool:
    """Whether ``share`` is a sparse ring's share: one element of ``GF(P)``."""
    try:
        from_bytes(share)
    except ValueError:
        return False
    return True
