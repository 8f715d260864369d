"""The client's side of secure aggregation: a state machine over the four stage payloads.

It follows Flower's SecAgg+ client (``flwr.client.mod.secaggplus_mod``) and uses its
primitives: two elliptic-curve key pairs per round (``pk1`` for the pairwise masks, ``pk2``
for encrypting shares), ECDH + HKDF shared keys, Fernet encryption of the shares, Shamir's
secret sharing of the self-mask seed and of ``sk1``. What differs: every pair of clients
masks (the complete graph), the vector is the round's ``k`` kept values in the ring of
:mod:`fedsparse.common.aggregation.secure` (clipped, scaled, rounded, with the client's
discrete Gaussian noise share), and the masks are SHAKE-256 expansions of full 32-byte seeds
(Flower's ``pseudo_rand_gen`` folds its seed to 32 bits for NumPy's Mersenne Twister).

No Flower message here: each method takes the server's payload (a ``dict``) and returns the
reply. The client checks what it can: the ring parameters equal its own (the public DP
parameters of its run config), its own keys come back unaltered, the threshold is met at
every stage, no node is both alive and dead, and it answers the unmask stage once per round.
"""

from __future__ import annotations

import base64
import os
from typing import Any

import torch
from cryptography.fernet import InvalidToken
from flwr.common.secure_aggregation.crypto.shamir import create_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import (
    decrypt,
    encrypt,
    generate_shared_key,
)
from flwr.common.secure_aggregation.secaggplus_utils import (
    share_keys_plaintext_concat,
    share_keys_plaintext_separate,
)
from flwr.supercore.primitives.asymmetric import (
    bytes_to_private_key,
    bytes_to_public_key,
    generate_key_pairs,
    private_key_to_bytes,
    public_key_to_bytes,
)

from fedsparse.common.aggregation.secure import (
    SEED_BYTES,
    RingParams,
    encode,
    mask_input,
    pack_ring,
)
from fedsparse.common.wire.secagg import (
    COLLECT,
    RING_FIELDS,
    SETUP,
    SHARE_KEYS,
    STAGE,
    UNMASK,
    SecAggError,
    check_payload,
)

__all__ = ["SecAggClient", "pair_seed"]


def pair_seed(private_pem: bytes, public_pem: bytes) -> bytes:
    """The 32-byte seed two nodes share: ECDH of their ``sk1``/``pk1``, through HKDF-SHA256."""
    key = generate_shared_key(bytes_to_private_key(private_pem), bytes_to_public_key(public_pem))
    seed = base64.urlsafe_b64decode(key)
    assert len(seed) == SEED_BYTES
    return seed


class SecAggClient:
    """One node's secure-aggregation round; ``handle`` runs whichever stage a payload names."""

    def __init__(self, node_id: int, params: RingParams) -> None:
        self.node_id = node_id
        self.params = params
        self._done = UNMASK  # a round starts at setup
        self._reset()

    def _reset(self) -> None:
        self._sk1 = self._sk2 = self._pk1 = self._pk2 = b""
        self._self_seed = b""
        self._pk1_of: dict[int, bytes] = {}
        self._pk2_of: dict[int, bytes] = {}
        self._seed_shares: dict[int, bytes] = {}
        self._sk1_shares: dict[int, bytes] = {}
        self._masked_with: set[int] = set()

    def _where(self, stage: str) -> str:
        return f"secure aggregation, node {self.node_id}, stage {stage!r}"

    def _enter(self, stage: str) -> None:
        order = (SETUP, SHARE_KEYS, COLLECT, UNMASK)
        expected = order[(order.index(self._done) + 1) % len(order)]
        if stage != SETUP and stage != expected:
            raise SecAggError(f"{self._where(stage)}: expected stage {expected!r} next")

    def handle(
        self,
        payload: dict[str, Any],
        values: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> dict[str, Any]:
        """The reply to ``payload``; ``values`` and ``generator`` serve the collect stage."""
        stage = payload.get(STAGE) if isinstance(payload, dict) else None
        if stage == SETUP:
            return self.setup(payload)
        if stage == SHARE_KEYS:
            return self.share_keys(payload)
        if stage == COLLECT:
            if values is None or generator is None:
                raise SecAggError(f"{self._where(COLLECT)}: needs the kept values and a generator")
            return self.collect(payload, values, generator)
        if stage == UNMASK:
            return self.unmask(payload)
        raise SecAggError(f"secure aggregation, node {self.node_id}: unknown stage {stage!r}")

    def setup(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Check the ring parameters against this node's own; reply two new public keys."""
        self._enter(SETUP)
        fields = check_payload(payload, SETUP, "down")
        for name in RING_FIELDS:
            if fields[name] != getattr(self.params, name):
                raise SecAggError(
                    f"{self._where(SETUP)}: field {name!r} is {fields[name]!r}, "
                    f"this node's run config says {getattr(self.params, name)!r}"
                )
        self._reset()
        sk1, pk1 = generate_key_pairs()
        sk2, pk2 = generate_key_pairs()
        self._sk1, self._pk1 = private_key_to_bytes(sk1), public_key_to_bytes(pk1)
        self._sk2, self._pk2 = private_key_to_bytes(sk2), public_key_to_bytes(pk2)
        self._done = SETUP
        return {"pk1": self._pk1, "pk2": self._pk2}

    def share_keys(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Shamir-share the self-mask seed and ``sk1``; one encrypted share per other node."""
        self._enter(SHARE_KEYS)
        fields = check_payload(payload, SHARE_KEYS, "down")
        where = self._where(SHARE_KEYS)
        nids: list[int] = fields["nids"]
        if len(set(nids)) != len(nids):
            raise SecAggError(f"{where}: field 'nids' repeats a node")
        if not self.params.threshold <= len(nids) <= self.params.clients:
            raise SecAggError(
                f"{where}: field 'nids' has {len(nids)} nodes, outside "
                f"[threshold {self.params.threshold}, clients {self.params.clients}]"
            )
        if self.node_id not in nids:
            raise SecAggError(f"{where}: field 'nids' leaves out this node")
        mine = nids.index(self.node_id)
        if fields["pk1"][mine] != self._pk1 or fields["pk2"][mine] != self._pk2:
            raise SecAggError(f"{where}: field 'pk1'/'pk2' alters this node's own keys")
        keys = fields["pk1"] + fields["pk2"]
        if len(set(keys)) != len(keys):
            raise SecAggError(f"{where}: field 'pk1'/'pk2' repeats a public key")
        self._pk1_of = dict(zip(nids, fields["pk1"], strict=True))
        self._pk2_of = dict(zip(nids, fields["pk2"], strict=True))
        self._self_seed = os.urandom(SEED_BYTES)
        threshold, count = self.params.threshold, len(nids)
        seed_shares = create_shares(self._self_seed, threshold, count)
        sk1_shares = create_shares(self._sk1, threshold, count)
        dsts: list[int] = []
        ctxts: list[bytes] = []
        sk2 = bytes_to_private_key(self._sk2)
        for nid, seed_share, sk1_share in zip(nids, seed_shares, sk1_shares, strict=True):
            if nid == self.node_id:
                self._seed_shares[nid], self._sk1_shares[nid] = seed_share, sk1_share
                continue
            try:
                key = generate_shared_key(sk2, bytes_to_public_key(self._pk2_of[nid]))
            except ValueError as exc:
                raise SecAggError(f"{where}: field 'pk2' of node {nid}: {exc}") from None
            plaintext = share_keys_plaintext_concat(self.node_id, nid, seed_share, sk1_share)
            dsts.append(nid)
            ctxts.append(encrypt(key, plaintext))
        self._done = SHARE_KEYS
        return {"dsts": dsts, "ctxts": ctxts}

    def collect(
        self, payload: dict[str, Any], values: torch.Tensor, generator: torch.Generator
    ) -> dict[str, Any]:
        """Keep the shares sent to this node; reply its masked ring input on the kept values."""
        self._enter(COLLECT)
        fields = check_payload(payload, COLLECT, "down")
        where = self._where(COLLECT)
        srcs: list[int] = fields["srcs"]
        if len(set(srcs)) != len(srcs) or self.node_id in srcs:
            raise SecAggError(f"{where}: field 'srcs' repeats a node or names this one")
        unknown = sorted(set(srcs) - set(self._pk2_of))
        if unknown:
            raise SecAggError(f"{where}: field 'srcs' names node {unknown[0]}, not in the round")
        if len(srcs) + 1 < self.params.threshold:
            raise SecAggError(
                f"{where}: {len(srcs) + 1} nodes remain, fewer than the threshold "
                f"{self.params.threshold}"
            )
        sk2 = bytes_to_private_key(self._sk2)
        for src, ciphertext in zip(srcs, fields["ctxts"], strict=True):
            key = generate_shared_key(sk2, bytes_to_public_key(self._pk2_of[src]))
            try:
                plaintext = decrypt(key, ciphertext)
            except InvalidToken:
                raise SecAggError(
                    f"{where}: field 'ctxts' from node {src} does not decrypt"
                ) from None
            actual_src, dst, seed_share, sk1_share = share_keys_plaintext_separate(plaintext)
            if actual_src != src or dst != self.node_id:
                raise SecAggError(
                    f"{where}: field 'ctxts' from node {src} carries {actual_src} -> {dst}"
                )
            self._seed_shares[src], self._sk1_shares[src] = seed_share, sk1_share
        ring_input = encode(values, self.params, generator)
        pair_seeds = {src: pair_seed(self._sk1, self._pk1_of[src]) for src in srcs}
        masked = mask_input(ring_input, self.node_id, pair_seeds, self._self_seed, self.params.bits)
        self._masked_with = set(srcs)
        self._done = COLLECT
        return {"masked_params": pack_ring(masked, self.params.bits)}

    def unmask(self, payload: dict[str, Any]) -> dict[str, Any]:
        """The self-mask seed share of each live node, the ``sk1`` share of each dead one."""
        self._enter(UNMASK)
        fields = check_payload(payload, UNMASK, "down")
        where = self._where(UNMASK)
        active: list[int] = fields["active_nids"]
        dead: list[int] = fields["dead_nids"]
        if len(set(active)) != len(active) or len(set(dead)) != len(dead):
            raise SecAggError(f"{where}: field 'active_nids'/'dead_nids' repeats a node")
        both = sorted(set(active) & set(dead))
        if both:
            raise SecAggError(f"{where}: field 'dead_nids' names live node {both[0]}")
        if self.node_id not in active:
            raise SecAggError(f"{where}: field 'active_nids' leaves out this (live) node")
        if len(active) < self.params.threshold:
            raise SecAggError(
                f"{where}: field 'active_nids' has {len(active)} nodes, fewer than the "
                f"threshold {self.params.threshold}"
            )
        stranger = sorted((set(active) | set(dead)) - self._masked_with - {self.node_id})
        if stranger:
            raise SecAggError(f"{where}: node {stranger[0]} was not in this node's sum")
        self._done = UNMASK
        shares = [self._seed_shares[nid] for nid in active]
        shares += [self._sk1_shares[nid] for nid in dead]
        self._self_seed = b""
        return {"nids": active + dead, "shares": shares}
