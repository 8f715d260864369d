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
A sparse ring (``params.neighbours``: SecAgg+, ``common/aggregation/graph.py``) does all of
this per neighbourhood: each node is sent its neighbours' keys, shares with and masks with
them only, and is asked to unmask for them only; every secret needs its share threshold of
its holders.
A rebuilt seed must match the commitment its node sent with its shares, a rebuilt ``sk1`` the
``pk1`` its node advertised; when one does not and more than ``t`` shares came, the reply
whose share is bad is found by leaving each out in turn and named.

Every message carries the round's ``round_id`` and a fresh ``nonce`` (the clients bind the
round to them), and each masked vector must come back naming both.

Every payload's bytes are counted as Flower's ``ConfigRecord`` counts them, per stage and
direction (:attr:`SecAggServer.bytes`): each message sent, each reply accepted. A reply that
breaks the protocol raises :class:`SecAggError` with its ``node``, before any state changes:
the caller may drop it (a dropout) and call again.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Final

import torch
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
from flwr.supercore.primitives.asymmetric import (
    bytes_to_private_key,
    bytes_to_public_key,
    public_key_to_bytes,
)

from fedsparse.common.aggregation.graph import graph_seed, neighbourhoods
from fedsparse.common.aggregation.secure import (
    SEED_BYTES,
    RingParams,
    check_threshold,
    decode_sum,
    remove_masks,
    ring_sum,
    unpack_input,
)
from fedsparse.common.aggregation.small_ring import rotation_seed
from fedsparse.common.wire.secagg import (
    COLLECT,
    COMMIT_BYTES,
    CONSISTENCY,
    NONCE_BYTES,
    RING_FIELDS,
    SETUP,
    SHARE_KEYS,
    STAGE,
    STAGES,
    UNMASK,
    SecAggError,
    advertisement,
    check_payload,
    graph_digest,
    payload_bytes,
    ring_digest,
    ring_message,
    seed_commitment,
    survivors_message,
)
from fedsparse.common.wire.secagg_compact import compressed, load_compressed
from fedsparse.server.secagg_rebuild import Share, rebuild
from fedsparse.server.secagg_sparse import check_ciphertexts, check_keys, check_one_part, is_share

__all__ = ["SecAggDropoutError", "SecAggServer"]


_UNSIGNED: Final = (b"", b"", 0)  # a member without an identity, as relayed


def _verifies(identity: bytes, signature: bytes, message: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(identity).verify(signature, message)
    except (ValueError, InvalidSignature):
        return False
    return True


def _advertised(round_id: int, nonce: bytes, nid: int, reply: Mapping[str, Any]) -> bool:
    if reply["enforces"] not in (0, 1):
        return False
    keys = (reply["pk1"], reply["pk2"], reply["enforces"])
    message = advertisement(round_id, nonce, nid, *keys)
    return _verifies(reply["identity"], reply["signature"], message)


class SecAggDropoutError(SecAggError):
    """Fewer than the threshold of nodes remain: the round's sum cannot be decoded."""


class SecAggServer:
    """One round's secure sum over ``node_ids``; call the stages in order.

    ``round_id`` names the training round (a client releases one masked input per round id);
    ``nonce`` defaults to fresh OS entropy.
    """

    def __init__(
        self,
        params: RingParams,
        node_ids: Sequence[int],
        *,
        round_id: int,
        nonce: bytes | None = None,
    ) -> None:
        check_threshold(params.clients, params.threshold, params.colluders)
        if len(set(node_ids)) != len(node_ids) or len(node_ids) != params.clients:
            raise ValueError(f"expected {params.clients} distinct node ids, got {list(node_ids)}")
        if any(type(n) is not int or not 0 <= n < 1 << 64 for n in node_ids):
            raise ValueError(f"node ids must be unsigned 64-bit ints, got {list(node_ids)}")
        if not 0 <= round_id < 1 << 64:
            raise ValueError(f"round_id must be an unsigned 64-bit int, got {round_id}")
        self.nonce = os.urandom(NONCE_BYTES) if nonce is None else nonce
        if len(self.nonce) < NONCE_BYTES:
            raise ValueError(f"the nonce needs at least {NONCE_BYTES} bytes")
        self.round_id = round_id
        self.seeded_noise: dict[int, bool] = {}
        """Node -> whether its setup reply says its noise is seeded (a simulation)."""
        self._commit: dict[int, bytes] = {}
        self.params = params
        self.sampled = sorted(node_ids)
        self.bytes: dict[str, dict[str, int]] = {s: {"down": 0, "up": 0} for s in STAGES}
        """Stage -> ``{"down": bytes sent, "up": bytes received}``."""
        self._pk: dict[int, tuple[bytes, bytes]] = {}
        # node -> (identity, signature, enforces): its signed advertisement
        self._signed: dict[int, tuple[bytes, bytes, int]] = {}
        self._digest = b""  # the ring the share-keys stage shows every node (ring_digest)
        self._digests: dict[int, bytes] = {}  # a sparse ring's, node by node (graph_digest)
        self._ring_sigs: dict[int, bytes] = {}  # node -> its signature of that ring
        self._u3: list[int] | None = None  # who answered the consistency stage (if it ran)
        self._survivor_sigs: dict[int, bytes] = {}
        self._u1: list[int] = []
        self._u2: list[int] = []
        self._forward: dict[int, dict[int, bytes]] = {}
        self._masked_total: torch.Tensor | None = None
        # a sparse ring's neighbourhoods over U0 (node -> its neighbours), its share threshold
        self._graph: dict[int, list[int]] = {}
        self._share_threshold = params.threshold
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
        for payload in payloads.values():
            payload.update(round_id=self.round_id, nonce=self.nonce)
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
        ring |= {"modular": 1} if self.params.modular else {}
        if self.params.neighbours:
            ring["neighbours"] = self.params.neighbours
        return self._send(SETUP, {nid: {STAGE: SETUP, **ring} for nid in self.sampled})

    def receive_setup(self, replies: Mapping[int, Any]) -> None:
        self._stage(SETUP)
        checked = self._replies(SETUP, replies, self.sampled)
        for nid, reply in checked.items():
            if reply["seeded_noise"] not in (0, 1):
                raise SecAggError(
                    f"secure aggregation, stage {SETUP!r}: field 'seeded_noise' of node {nid} "
                    "must be 0 or 1",
                    node=nid,
                )
        for nid, reply in checked.items():  # a forged advertisement is its sender's: dropped
            if "identity" in reply and not _advertised(self.round_id, self.nonce, nid, reply):
                raise SecAggError(
                    f"secure aggregation, stage {SETUP!r}: field 'signature' of node {nid} "
                    "does not verify under the identity it names",
                    node=nid,
                )
        if self.params.neighbours:  # compact keys: checked here, to name a bad one's node
            check_keys(SETUP, checked)
        self._pk = {nid: (r["pk1"], r["pk2"]) for nid, r in checked.items()}
        self._signed = {
            nid: (r["identity"], r["signature"], r["enforces"])
            for nid, r in checked.items()
            if "identity" in r
        }
        self.seeded_noise = {nid: bool(r["seeded_noise"]) for nid, r in checked.items()}
        self._accept(SETUP, replies, SHARE_KEYS)

    def share_keys_messages(self) -> dict[int, dict[str, Any]]:
        self._stage(SHARE_KEYS)
        u0 = sorted(self._pk)
        ring = {name: getattr(self.params, name) for name in RING_FIELDS}
        ring |= {"modular": 1} if self.params.modular else {}
        if not self.params.neighbours:  # every node is shown the same ring
            ids = [self._signed.get(n, _UNSIGNED)[0] for n in u0]
            self._digest = ring_digest(ring, u0, *self._key_lists(u0), ids)
            body = self._keys_body(u0)
            return self._send(SHARE_KEYS, {nid: dict(body) for nid in u0})
        self._share_threshold = self.params.share_threshold(len(u0))
        degree = self.params.neighbours
        seed = graph_seed(self.round_id, self.nonce, degree, u0)
        self._graph = neighbourhoods(u0, degree, seed)
        payloads = {}
        for nid in u0:
            body = self._keys_body(sorted([nid, *self._graph[nid]]))
            ids = body.get("identities", [b""] * len(body["nids"]))
            view = ring_digest(ring, body["nids"], body["pk1"], body["pk2"], ids)
            self._digests[nid] = graph_digest(ring, degree, u0, view)  # each node's own
            payloads[nid] = body | {"members": list(u0)}
        return self._send(SHARE_KEYS, payloads)

    def _key_lists(self, nids: list[int]) -> tuple[list[bytes], list[bytes]]:
        return [self._pk[n][0] for n in nids], [self._pk[n][1] for n in nids]

    def _keys_body(self, nids: list[int]) -> dict[str, Any]:
        """The share-keys payload's keys of ``nids`` (and their signed advertisements)."""
        pk1, pk2 = self._key_lists(nids)
        body: dict[str, Any] = {STAGE: SHARE_KEYS, "nids": nids, "pk1": pk1, "pk2": pk2}
        if self._signed:  # relayed for the nodes' own checks (client/secagg_identity.py)
            body["identities"] = [self._signed.get(nid, _UNSIGNED)[0] for nid in nids]
            body["signatures"] = [self._signed.get(nid, _UNSIGNED)[1] for nid in nids]
            body["enforcing"] = [self._signed.get(nid, _UNSIGNED)[2] for nid in nids]
        return body

    def _holders(self, owner: int) -> list[int]:
        """The nodes ``owner`` sent its shares to, itself included, in Shamir's ``x`` order."""
        if self._graph:
            return sorted([owner, *self._graph[owner]])
        return sorted(self._pk)

    def receive_share_keys(self, replies: Mapping[int, Any]) -> None:
        self._stage(SHARE_KEYS)
        u0 = sorted(self._pk)
        checked = self._replies(SHARE_KEYS, replies, u0)
        u1 = sorted(checked)
        forward: dict[int, dict[int, bytes]] = {nid: {} for nid in u1}
        for src, reply in checked.items():
            if sorted(reply["dsts"]) != [nid for nid in self._holders(src) if nid != src]:
                others = "neighbour" if self._graph else "other node of the round"
                raise SecAggError(
                    f"secure aggregation, stage {SHARE_KEYS!r}: field 'dsts' of node {src} "
                    f"must name every {others} once",
                    node=src,
                )
            if self._graph:
                check_ciphertexts(SHARE_KEYS, src, reply["ctxts"])
            if len(reply["seed_commit"]) != COMMIT_BYTES:
                raise SecAggError(
                    f"secure aggregation, stage {SHARE_KEYS!r}: field 'seed_commit' of node "
                    f"{src} must be {COMMIT_BYTES} bytes",
                    node=src,
                )
            signature = reply.get("ring_signature")
            if src in self._signed:  # a node that signs signs the ring it was shown
                identity = self._signed[src][0]
                digest = self._digests.get(src, self._digest)
                message = ring_message(self.round_id, self.nonce, src, digest)
                if signature is None or not _verifies(identity, signature, message):
                    raise SecAggError(
                        f"secure aggregation, stage {SHARE_KEYS!r}: field 'ring_signature' of "
                        f"node {src} is missing or does not verify for the ring it was sent",
                        node=src,
                    )
            for dst, ciphertext in zip(reply["dsts"], reply["ctxts"], strict=True):
                if dst in forward:
                    forward[dst][src] = ciphertext
        self._one_part(SHARE_KEYS, checked, "nodes that shared their keys")  # before any release
        self._ring_sigs = {
            src: r["ring_signature"] for src, r in checked.items() if "ring_signature" in r
        }
        self._u1, self._forward = u1, forward
        self._commit = {nid: r["seed_commit"] for nid, r in checked.items()}
        self._accept(SHARE_KEYS, replies, COLLECT)

    def collect_messages(self) -> dict[int, dict[str, Any]]:
        self._stage(COLLECT)
        payloads = {}
        for dst, by_src in self._forward.items():
            srcs = sorted(by_src)
            payloads[dst] = {STAGE: COLLECT, "srcs": srcs, "ctxts": [by_src[s] for s in srcs]}
            if self._signed:  # each source's signature of the ring it was shown
                payloads[dst]["ring_sigs"] = [self._ring_sigs.get(s, b"") for s in srcs]
        return self._send(COLLECT, payloads)

    def receive_collect(self, replies: Mapping[int, Any]) -> None:
        self._stage(COLLECT)
        checked = self._replies(COLLECT, replies, self._u1)
        vectors = []
        for nid, reply in checked.items():
            if (reply["round_id"], reply["nonce"]) != (self.round_id, self.nonce):
                raise SecAggError(
                    f"secure aggregation, stage {COLLECT!r}: field 'round_id'/'nonce' of node "
                    f"{nid} is not this round's",
                    node=nid,
                )
            try:
                vectors.append(unpack_input(reply["masked_params"], self.params))
            except ValueError as exc:
                raise SecAggError(
                    f"secure aggregation, stage {COLLECT!r}: field 'masked_params' of node "
                    f"{nid}: {exc}",
                    node=nid,
                ) from None
        self._one_part(COLLECT, checked, "survivors")
        self._masked_total = ring_sum(vectors, self.params.bits)
        self._u2 = sorted(checked)
        self._forward = {}
        self._accept(COLLECT, replies, CONSISTENCY if self.checks_consistency else UNMASK)

    def _one_part(self, stage: str, alive: Collection[int], when: str) -> None:
        """A sparse ring's ``alive`` nodes are one part of it, else ``SecAggDropoutError``."""
        if self._graph:
            try:
                check_one_part(stage, self._graph, alive, when)
            except ValueError as exc:
                raise SecAggDropoutError(str(exc)) from None

    @property
    def checks_consistency(self) -> bool:
        """Whether the consistency stage runs: some node signed its keys at setup (over the
        complete graph: a sparse ring's nodes enforce nothing, ``client/secagg.py``)."""
        return bool(self._signed) and not self.params.neighbours

    def consistency_messages(self) -> dict[int, dict[str, Any]]:
        """The survivor set ``U2``, for each survivor to sign."""
        self._stage(CONSISTENCY)
        self.bytes.setdefault(CONSISTENCY, {"down": 0, "up": 0})
        body = {STAGE: CONSISTENCY, "active_nids": list(self._u2)}
        return self._send(CONSISTENCY, {nid: dict(body) for nid in self._u2})

    def receive_consistency(self, replies: Mapping[int, Any]) -> None:
        """Keeps the survivors' signatures (each checked under the identity its node
        advertised); those who answered (``U3``) are asked to unmask."""
        self._stage(CONSISTENCY)
        checked = self._replies(CONSISTENCY, replies, self._u2)
        signatures = {}
        for nid, reply in checked.items():
            if not reply["signature"]:
                continue
            identity = self._signed.get(nid, (b"", b"", 0))[0]
            message = survivors_message(self.round_id, self.nonce, nid, self._u2, self._digest)
            if not _verifies(identity, reply["signature"], message):
                raise SecAggError(
                    f"secure aggregation, stage {CONSISTENCY!r}: field 'signature' of node "
                    f"{nid} does not verify",
                    node=nid,
                )
            signatures[nid] = reply["signature"]
        self._u3, self._survivor_sigs = sorted(checked), signatures
        self._accept(CONSISTENCY, replies, UNMASK)

    def unmask_messages(self) -> dict[int, dict[str, Any]]:
        self._stage(UNMASK)
        dead = [nid for nid in self._u1 if nid not in self._u2]
        body: dict[str, Any] = {STAGE: UNMASK, "active_nids": list(self._u2), "dead_nids": dead}
        if self._u3 is not None:  # the consistency stage ran: its signatures, relayed
            signers = sorted(self._survivor_sigs)
            body["signers"] = signers
            body["consistency_sigs"] = [self._survivor_sigs[n] for n in signers]
        asked = self._u2 if self._u3 is None else self._u3
        payloads = {nid: dict(body) for nid in asked}
        for nid in payloads if self._graph else ():  # a node's neighbourhood only
            held = set(self._holders(nid))
            payloads[nid]["active_nids"] = [n for n in self._u2 if n in held]
            payloads[nid]["dead_nids"] = [n for n in dead if n in held]
        return self._send(UNMASK, payloads)

    def receive_unmask(self, replies: Mapping[int, Any]) -> torch.Tensor:
        """The ring sum of the survivors' inputs (``U2``), masks removed."""
        self._stage(UNMASK)
        checked = self._replies(UNMASK, replies, self._u2 if self._u3 is None else self._u3)
        dead = [nid for nid in self._u1 if nid not in self._u2]
        expected = sorted(self._u2 + dead)
        shares: dict[int, list[Share]] = {nid: [] for nid in expected}
        everyone = {h: x for x, h in enumerate(sorted(self._pk), start=1)}  # Shamir's x
        x_of = {o: {h: x for x, h in enumerate(self._holders(o), start=1)} for o in self._graph}
        for nid, reply in checked.items():
            named = [n for n in expected if not self._graph or nid in x_of[n]]
            if sorted(reply["nids"]) != named:
                raise SecAggError(
                    f"secure aggregation, stage {UNMASK!r}: field 'nids' of node {nid} must "
                    "name every live and dead node "
                    + ("of its neighbourhood once" if self._graph else "once"),
                    node=nid,
                )
            for owner, share in zip(reply["nids"], reply["shares"], strict=True):
                index = x_of[owner][nid] if self._graph else everyone[nid]
                # a sparse ring's share is its y alone (x: the holder's place)
                if (
                    not is_share(share)
                    if self._graph
                    else (int.from_bytes(share[:4], "little") != index)
                ):
                    raise SecAggError(
                        f"secure aggregation, stage {UNMASK!r}: field 'shares' of node {nid} "
                        f"holds a share of node {owner} that was not sent to it",
                        node=nid,
                    )
                shares[owner].append((nid, index, share))
        for owner in (o for o in expected if len(shares[o]) < self._share_threshold):
            raise SecAggDropoutError(
                f"secure aggregation, stage {UNMASK!r}: node {owner}'s secret has "
                f"{len(shares[owner])} shares, fewer than the threshold {self._share_threshold}"
            )
        sparse, t = bool(self._graph), self._share_threshold
        self_seeds = [
            rebuild(shares[nid], nid, "self-mask seed", self._seed_ok, t, sparse)
            for nid in self._u2
        ]
        pairs = []
        for gone in dead:
            secret = rebuild(shares[gone], gone, "key", self._key_ok, t, sparse)
            private = bytes_to_private_key(secret)
            for live in self._u2:
                if self._graph and live not in self._graph[gone]:
                    continue  # they never masked with each other
                public = self._pk[live][0]
                peer = load_compressed(public) if sparse else bytes_to_public_key(public)
                key = generate_shared_key(private, peer)
                pairs.append((live, gone, base64.urlsafe_b64decode(key)))
        assert self._masked_total is not None
        total = remove_masks(self._masked_total, self_seeds, pairs, self.params.bits)
        self._masked_total = None
        self._accept(UNMASK, replies, SETUP)
        return total

    def _seed_ok(self, owner: int, secret: bytes) -> bool:
        return len(secret) == SEED_BYTES and seed_commitment(secret) == self._commit[owner]

    def _key_ok(self, owner: int, secret: bytes) -> bool:
        try:
            public = bytes_to_private_key(secret).public_key()
        except (ValueError, TypeError):
            return False
        encoded = compressed(public) if self._graph else public_key_to_bytes(public)
        return encoded == self._pk[owner][0]

    def decode(self, ring_total: torch.Tensor) -> torch.Tensor:
        """The survivors' sum in value units (the centered lift over the scale)."""
        return decode_sum(ring_total, self.params, rotation_seed(self.round_id, self.nonce))
