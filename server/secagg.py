"""The server's side of secure aggregation: a state machine over the four stage payloads.

It follows Flower's ``SecAggPlusWorkflow`` (``flwr.server.workflow.secure_aggregation``) and
uses its primitives (Shamir's ``combine_shares``, the ECDH + HKDF shared key), on the round's
``k`` kept values in the ring of :mod:`fedsparse.common.aggregation.secure`, over the complete
graph of the round's clients. No Flower message here: ``*_messages`` return one payload per
node, ``receive_*`` take the replies that came (a node without a reply dropped out).

Who is where: ``U0`` answered the setup (public keys), ``U1`` the key sharing (encrypted
shares; every node of ``U1`` masks with every other), ``U2`` the collection (masked vectors:
the sum is theirs), ``U3`` the unmasking (shares). Each set must keep at least ``t`` nodes, or
the round ends with :class:`SecAggDropoutError`. Unmasking rebuilds, from ``t`` or more
shares each, the self-mask seed of every node of ``U2`` and the ``sk1`` of every node of
``U1 - U2``, whose pairwise masks with ``U2`` it removes; it never asks for both of one node.

Every payload's bytes are counted as Flower's ``ConfigRecord`` counts them, per stage and
direction (:attr:`SecAggServer.bytes`): each message sent, each reply accepted. A reply that
breaks the protocol raises :class:`SecAggError` with its ``node``, before any state changes:
the caller may drop it (a dropout) and call again.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

from fedsparse.common.aggregation.secure import (
    SEED_BYTES,
    RingParams,
    check_threshold,
    decode_sum,
    remove_masks,
    ring_sum,
    unpack_ring,
)
from fedsparse.common.wire.secagg import (
    COLLECT,
    RING_FIELDS,
    SETUP,
    SHARE_KEYS,
    STAGE,
    STAGES,
    UNMASK,
    SecAggError,
    check_payload,
    payload_bytes,
)

__all__ = ["SecAggDropoutError", "SecAggServer"]


class SecAggDropoutError(SecAggError):
    """Fewer than the threshold of nodes remain: the round's sum cannot be decoded."""


class SecAggServer:
    """One round's secure sum over ``node_ids``; call the stages in order."""

    def __init__(self, params: RingParams, node_ids: Sequence[int]) -> None:
        check_threshold(params.clients, params.threshold)
        if len(set(node_ids)) != len(node_ids) or len(node_ids) != params.clients:
            raise ValueError(f"expected {params.clients} distinct node ids, got {list(node_ids)}")
        self.params = params
        self.sampled = sorted(node_ids)
        self.bytes: dict[str, dict[str, int]] = {s: {"down": 0, "up": 0} for s in STAGES}
        """Stage -> ``{"down": bytes sent, "up": bytes received}``."""
        self._pk: dict[int, tuple[bytes, bytes]] = {}
        self._u1: list[int] = []
        self._u2: list[int] = []
        self._forward: dict[int, dict[int, bytes]] = {}
        self._masked_total: torch.Tensor | None = None
        self._next = SETUP

    @property
    def survivors(self) -> list[int]:
        """The nodes whose inputs the sum holds (``U2``), once the collection has run."""
        return list(self._u2)

    def _stage(self, stage: str) -> None:
        if self._next != stage:
            raise SecAggError(
                f"secure aggregation: stage {stage!r} out of order, {self._next!r} next"
            )

    def _send(self, stage: str, payloads: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        self.bytes[stage]["down"] += sum(payload_bytes(p) for p in payloads.values())
        return payloads

    def _replies(
        self, stage: str, replies: Mapping[int, Any], asked: Sequence[int]
    ) -> dict[int, dict[str, Any]]:
        strangers = sorted(set(replies) - set(asked))
        if strangers:
            raise SecAggError(
                f"secure aggregation, stage {stage!r}: a reply from node {strangers[0]}, "
                "which was not asked"
            )
        checked = {}
        for nid in sorted(replies):
            try:
                checked[nid] = check_payload(replies[nid], stage, "up")
            except SecAggError as exc:
                raise SecAggError(f"{exc} (node {nid})", node=nid) from None
        if len(checked) < self.params.threshold:
            raise SecAggDropoutError(
                f"secure aggregation, stage {stage!r}: {len(checked)} of "
                f"{self.params.clients} nodes remain, fewer than the threshold "
                f"{self.params.threshold}"
            )
        return checked

    def _accept(self, stage: str, replies: Mapping[int, Any], next_stage: str) -> None:
        """Count the accepted replies' bytes and move on (a failed call changes nothing)."""
        self.bytes[stage]["up"] += sum(payload_bytes(reply) for reply in replies.values())
        self._next = next_stage

    def setup_messages(self) -> dict[int, dict[str, Any]]:
        self._stage(SETUP)
        ring = {name: getattr(self.params, name) for name in RING_FIELDS}
        return self._send(SETUP, {nid: {STAGE: SETUP, **ring} for nid in self.sampled})

    def receive_setup(self, replies: Mapping[int, Any]) -> None:
        self._stage(SETUP)
        checked = self._replies(SETUP, replies, self.sampled)
        self._pk = {nid: (r["pk1"], r["pk2"]) for nid, r in checked.items()}
        self._accept(SETUP, replies, SHARE_KEYS)

    def share_keys_messages(self) -> dict[int, dict[str, Any]]:
        self._stage(SHARE_KEYS)
        u0 = sorted(self._pk)
        body = {
            STAGE: SHARE_KEYS,
            "nids": u0,
            "pk1": [self._pk[nid][0] for nid in u0],
            "pk2": [self._pk[nid][1] for nid in u0],
        }
        return self._send(SHARE_KEYS, {nid: dict(body) for nid in u0})

    def receive_share_keys(self, replies: Mapping[int, Any]) -> None:
        self._stage(SHARE_KEYS)
        u0 = sorted(self._pk)
        checked = self._replies(SHARE_KEYS, replies, u0)
        u1 = sorted(checked)
        forward: dict[int, dict[int, bytes]] = {nid: {} for nid in u1}
        for src, reply in checked.items():
            if sorted(reply["dsts"]) != [nid for nid in u0 if nid != src]:
                raise SecAggError(
                    f"secure aggregation, stage {SHARE_KEYS!r}: field 'dsts' of node {src} "
                    "must name every other node of the round once",
                    node=src,
                )
            for dst, ciphertext in zip(reply["dsts"], reply["ctxts"], strict=True):
                if dst in forward:
                    forward[dst][src] = ciphertext
        self._u1, self._forward = u1, forward
        self._accept(SHARE_KEYS, replies, COLLECT)

    def collect_messages(self) -> dict[int, dict[str, Any]]:
        self._stage(COLLECT)
        payloads = {}
        for dst, by_src in self._forward.items():
            srcs = sorted(by_src)
            payloads[dst] = {STAGE: COLLECT, "srcs": srcs, "ctxts": [by_src[s] for s in srcs]}
        return self._send(COLLECT, payloads)

    def receive_collect(self, replies: Mapping[int, Any]) -> None:
        self._stage(COLLECT)
        checked = self._replies(COLLECT, replies, self._u1)
        vectors = []
        for nid, reply in checked.items():
            try:
                vectors.append(
                    unpack_ring(reply["masked_params"], self.params.kept, self.params.bits)
                )
            except ValueError as exc:
                raise SecAggError(
                    f"secure aggregation, stage {COLLECT!r}: field 'masked_params' of node "
                    f"{nid}: {exc}",
                    node=nid,
                ) from None
        self._masked_total = ring_sum(vectors, self.params.bits)
        self._u2 = sorted(checked)
        self._forward = {}
        self._accept(COLLECT, replies, UNMASK)

    def unmask_messages(self) -> dict[int, dict[str, Any]]:
        self._stage(UNMASK)
        dead = [nid for nid in self._u1 if nid not in self._u2]
        body = {STAGE: UNMASK, "active_nids": list(self._u2), "dead_nids": dead}
        return self._send(UNMASK, {nid: dict(body) for nid in self._u2})

    def receive_unmask(self, replies: Mapping[int, Any]) -> torch.Tensor:
        """The ring sum of the survivors' inputs (``U2``), masks removed."""
        self._stage(UNMASK)
        checked = self._replies(UNMASK, replies, self._u2)
        dead = [nid for nid in self._u1 if nid not in self._u2]
        expected = sorted(self._u2 + dead)
        shares: dict[int, list[bytes]] = {nid: [] for nid in expected}
        for nid, reply in checked.items():
            if sorted(reply["nids"]) != expected:
                raise SecAggError(
                    f"secure aggregation, stage {UNMASK!r}: field 'nids' of node {nid} must "
                    "name every live and dead node once",
                    node=nid,
                )
            for owner, share in zip(reply["nids"], reply["shares"], strict=True):
                shares[owner].append(share)
        self_seeds = [self._secret(shares[nid], nid) for nid in self._u2]
        for seed, nid in zip(self_seeds, self._u2, strict=True):
            if len(seed) != SEED_BYTES:
                raise SecAggError(f"secure aggregation: node {nid}'s self-mask seed is malformed")
        pairs = []
        for gone in dead:
            sk1 = self._secret(shares[gone], gone)
            try:
                private = bytes_to_private_key(sk1)
            except ValueError:
                raise SecAggError(
                    f"secure aggregation: node {gone}'s key does not rebuild"
                ) from None
            for live in self._u2:
                key = generate_shared_key(private, bytes_to_public_key(self._pk[live][0]))
                pairs.append((live, gone, base64.urlsafe_b64decode(key)))
        assert self._masked_total is not None
        total = remove_masks(self._masked_total, self_seeds, pairs, self.params.bits)
        self._masked_total = None
        self._accept(UNMASK, replies, SETUP)
        return total

    def _secret(self, share_list: list[bytes], owner: int) -> bytes:
        if len({len(s) for s in share_list}) > 1 or any(len(s) < 20 for s in share_list):
            raise SecAggError(f"secure aggregation: field 'shares' for node {owner} is malformed")
        try:
            return combine_shares(share_list)
        except ValueError:
            raise SecAggError(
                f"secure aggregation: the shares of node {owner} do not combine"
            ) from None

    def decode(self, ring_total: torch.Tensor) -> torch.Tensor:
        """The survivors' sum in value units (the centered lift over the scale)."""
        return decode_sum(ring_total, self.params)
