"""A malicious server driving the project's own ``SecAggClient`` objects (tests only).

``attack(spec, victim)`` plays every stage as the server chooses: each node's ring (with
members whose keys the server made, ``fakes``), the peers it is told it masks with, the
survivor set it is asked to sign, who is dead at the unmask and whose signatures are relayed.
It relays every real signature it holds (a node's key advertisement, its signature of the ring
it was shown, its survivor-set signature) and then tries to rebuild the victim's individual
input from what the nodes released. The outcome says which node refused at which stage, or
how close the rebuilt input came. Adapted from an attacker's review of the signed rings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares
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

from fedsparse.client.secagg import SecAggClient, pair_seed
from fedsparse.client.secagg_identity import Identity
from fedsparse.common.aggregation.secure import (
    PAIR_LABEL,
    SELF_LABEL,
    choose_ring,
    decode_sum,
    expand_mask,
    pairwise_sign,
    unpack_ring,
)
from fedsparse.common.wire.secagg import RING_FIELDS, SecAggError

K, ROUND = 40, 7


def values(nid: int) -> torch.Tensor:
    v = torch.randn(K, generator=torch.Generator().manual_seed(nid), dtype=torch.float64)
    return (v * (0.5 / float(v.norm()))).to(torch.float32)


@dataclass
class Node:
    """What the server shows one node."""

    ring: list[int]  # its ring's ids (those in ``fakes`` get the server's keys)
    n: int
    t: int
    srcs: list[int]  # whom it is told it masks with (collect)
    S: list[int] | None = None  # the survivor set shown at consistency (None: no such stage)
    D: list[int] = field(default_factory=list)  # told dead at the unmask
    signers: list[int] = field(default_factory=list)  # whose survivor signatures are relayed
    unmask: bool = True
    fakes: list[int] = field(default_factory=list)
    min_trusted: int = 1
    roster: str | list[int] = "all"  # "all": every node's identity


@dataclass
class Outcome:
    refused: dict[int, str]  # node -> "stage: reason", for each node that refused
    error: float | None  # max |rebuilt - victim's input| if the server rebuilt it, else None
    missing: str = ""  # what the server lacked, when it could not


def attack(spec: dict[int, Node], victim: int) -> Outcome:
    """Runs the server's plan ``spec``; what came of it for ``victim``."""
    ids = {v: Identity(Ed25519PrivateKey.generate()) for v in spec}
    nonce = os.urandom(16)
    refused: dict[int, str] = {}
    clients = {}
    for v, s in spec.items():
        members = spec if s.roster == "all" else s.roster
        roster = [ids[u].public for u in members]
        params = choose_ring(clip=1.0, sigma=0.01, clients=s.n, threshold=s.t, kept=K)
        clients[v] = SecAggClient(
            v,
            params,
            min_noise_multiplier=0.0,
            identity=ids[v],
            roster=roster,
            min_trusted_peers=s.min_trusted,
        )
    pk = {}
    for v in spec:
        p = clients[v].params
        setup = {"stage": "setup", **{f: getattr(p, f) for f in RING_FIELDS}}
        pk[v] = clients[v].handle({**setup, "round_id": ROUND, "nonce": nonce})
    fake_keys: dict[tuple[int, int], tuple[bytes, ...]] = {}
    ciphertexts: dict[tuple[int, int], bytes] = {}
    ring_sig: dict[int, bytes] = {}
    leaked: dict[int, dict[str, list[bytes]]] = {}

    def leak(owner: int, kind: str, share: bytes) -> None:
        leaked.setdefault(owner, {"seed": [], "sk1": []})[kind].append(share)

    for v, s in spec.items():
        nids, pk1, pk2, idn, sig, enf = [], [], [], [], [], []
        for u in sorted(s.ring):
            nids.append(u)
            if u in s.fakes:
                a, b = generate_key_pairs()
                c, d = generate_key_pairs()
                keys = (*map(private_key_to_bytes, (a, c)), *map(public_key_to_bytes, (b, d)))
                fake_keys[(v, u)] = keys
                pk1.append(keys[2])
                pk2.append(keys[3])
                idn.append(b"")
                sig.append(b"")
                enf.append(0)
            else:
                for out, name in ((pk1, "pk1"), (pk2, "pk2"), (idn, "identity")):
                    out.append(pk[u][name])
                sig.append(pk[u]["signature"])
                enf.append(pk[u]["enforces"])
        message = {"stage": "share_keys", "nids": nids, "pk1": pk1, "pk2": pk2}
        message |= {"identities": idn, "signatures": sig, "enforcing": enf}
        try:
            reply = clients[v].handle({**message, "round_id": ROUND, "nonce": nonce})
        except SecAggError as err:
            refused[v] = f"share_keys: {err}"
            continue
        ring_sig[v] = reply.get("ring_signature", b"")
        for dst, ciphertext in zip(reply["dsts"], reply["ctxts"], strict=True):
            if dst in s.fakes:  # what v sent a member the server made: the server's to read
                key = generate_shared_key(
                    bytes_to_private_key(fake_keys[(v, dst)][1]), bytes_to_public_key(pk[v]["pk2"])
                )
                _, _, seed_share, sk1_share = share_keys_plaintext_separate(
                    decrypt(key, ciphertext)
                )
                leak(v, "seed", seed_share)
                leak(v, "sk1", sk1_share)
            else:
                ciphertexts[(v, dst)] = ciphertext
    masked = {}
    for v, s in spec.items():
        if v in refused:
            continue
        ctxts = []
        for u in s.srcs:
            if u in s.fakes:
                fk = fake_keys[(v, u)]
                key = generate_shared_key(
                    bytes_to_private_key(fk[1]), bytes_to_public_key(pk[v]["pk2"])
                )
                junk = create_shares(os.urandom(32), 2, 2)[0]
                ctxts.append(encrypt(key, share_keys_plaintext_concat(u, v, junk, junk)))
            else:
                ctxts.append(ciphertexts.get((u, v), b""))
        message = {"stage": "collect_masked_vectors", "srcs": s.srcs, "ctxts": ctxts}
        message["ring_sigs"] = [ring_sig.get(u, b"") for u in s.srcs]
        try:
            reply = clients[v].handle({**message, "round_id": ROUND, "nonce": nonce}, values(v))
        except SecAggError as err:
            refused[v] = f"collect: {err}"
            continue
        masked[v] = reply["masked_params"]
    sigs = {}
    for v, s in spec.items():
        if s.S is not None and v in masked:
            message = {"stage": "consistency", "active_nids": s.S}
            try:
                sigs[v] = clients[v].handle({**message, "round_id": ROUND, "nonce": nonce})
            except SecAggError as err:
                refused[v] = f"consistency: {err}"
    for v, s in spec.items():
        if not s.unmask or v not in masked or v in refused:
            continue
        message = {"stage": "unmask", "active_nids": s.S, "dead_nids": s.D}
        if s.S is not None:
            message["signers"] = [u for u in s.signers if u in sigs]
            message["consistency_sigs"] = [sigs[u]["signature"] for u in message["signers"]]
        try:
            reply = clients[v].handle({**message, "round_id": ROUND, "nonce": nonce})
        except SecAggError as err:
            refused[v] = f"unmask: {err}"
            continue
        for owner, share in zip(reply["nids"], reply["shares"], strict=True):
            leak(owner, "seed" if owner in (s.S or []) else "sk1", share)
    if victim not in masked:
        return Outcome(refused, None, "the victim masked nothing")
    return _rebuild(spec, victim, clients, masked, leaked, fake_keys, pk, refused)


def _rebuild(spec, victim, clients, masked, leaked, fake_keys, pk, refused) -> Outcome:  # type: ignore[no-untyped-def]
    """The server's try at the victim's input from the shares it holds."""

    def secret(owner: int, kind: str) -> bytes | None:
        shares = {int.from_bytes(x[:4], "little"): x for x in leaked.get(owner, {}).get(kind, [])}
        if len(shares) < spec[owner].t:
            return None
        return combine_shares(list(shares.values()))

    params = clients[victim].params
    mod = (1 << params.bits) - 1
    seed = secret(victim, "seed")
    if seed is None:
        return Outcome(refused, None, f"the victim's seed ({spec[victim].t} shares needed)")
    x = (
        unpack_ring(masked[victim], params.kept, params.bits)
        - expand_mask(seed, params.kept, params.bits, SELF_LABEL)
    ) & mod
    for u in spec[victim].srcs:
        if u in spec[victim].fakes:
            pair = pair_seed(fake_keys[(victim, u)][0], pk[victim]["pk1"])
        else:
            sk1 = secret(u, "sk1")
            if sk1 is None:
                return Outcome(refused, None, f"node {u}'s sk1")
            pair = pair_seed(sk1, pk[victim]["pk1"])
        x = (
            x - pairwise_sign(victim, u) * expand_mask(pair, params.kept, params.bits, PAIR_LABEL)
        ) & mod
    got = decode_sum(x, params)
    return Outcome(refused, float((got - values(victim).to(got.dtype)).abs().max()))
