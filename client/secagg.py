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
reply. The server writes every payload (and, in a deployment, the run config), so the client
decides its own privacy:

* **Randomness.** The stochastic rounding and the noise share come from two generators seeded
  afresh from OS entropy (``os.urandom``) for every masked input (``noise="fresh"``, the
  default). ``noise="seeded"`` with a ``noise_seed`` is for simulations only: whoever knows
  the seed and the round can regenerate the noise share and strip it from the sum. The setup
  reply says which (``seeded_noise``).
* **Ring.** :func:`~fedsparse.common.aggregation.secure.check_ring` with the node's own
  ``min_noise_multiplier`` (on the worst case: its share alone), ``colluders`` bound,
  ``wrap_probability`` and ``rounding_slack``: the threshold, ``sigma > 0``, and the scale
  and bits recomputed; and the setup's parameters must equal the ones it was built with.
* **One release per round.** The setup binds the round to its ``round_id`` and the server's
  ``nonce``; every later message must carry both, and the client releases one masked input
  per ``round_id`` (:attr:`SecAggClient.released_rounds`, to persist with the node's state):
  a server that restarts the round cannot collect the same values twice with fresh noise.
* **Members.** With an identity its keys and the ring it is shown are signed; a node that
  requires ``min_trusted_peers`` trusted peers checks its ring, the peers it masks with and
  the survivor set it unmasks (``client/secagg_identity.py``).
* **Payloads.** Its own keys come back unaltered, every peer key parses and agrees, the
  threshold is met at every stage, no node is both alive and dead, and it answers the unmask
  stage once per round.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from typing import Any, Final, Literal

import torch
from flwr.common.secure_aggregation.crypto.symmetric_encryption import (
    generate_shared_key,
)
from flwr.supercore.primitives.asymmetric import (
    bytes_to_private_key,
    generate_key_pairs,
    private_key_to_bytes,
)

from fedsparse.client import secagg_state
from fedsparse.client.secagg_identity import (
    Identity,
    Trust,
    check_masked_with,
    check_members,
    check_survivors,
)
from fedsparse.client.secagg_ring import (
    decode_public,
    encode_public,
    make_shares,
    ring_view,
    seal,
    unseal,
)
from fedsparse.client.secagg_state import RoundProgress
from fedsparse.client.secagg_streams import fresh_generators, pair_seed, seeded_generators
from fedsparse.common.aggregation.secure import (
    SEED_BYTES,
    RingParams,
    check_ring,
    encode,
    mask_input,
    pack_input,
)
from fedsparse.common.aggregation.small_ring import rotation_seed
from fedsparse.common.wire.secagg import (
    COLLECT,
    CONSISTENCY,
    NONCE_BYTES,
    RING_FIELDS,
    SETUP,
    SHARE_KEYS,
    STAGE,
    UNMASK,
    SecAggError,
    check_payload,
    seed_commitment,
)

__all__ = [
    "SecAggClient",
    "SecAggInputError",
    "fresh_generators",
    "pair_seed",
    "seeded_generators",
]

NoiseSource = Literal["fresh", "seeded"]


class SecAggInputError(ValueError):
    """The node's own values cannot be encoded (not finite, wrong shape): a local refusal.

    Its message is for the node's log, never for the server, which sees a dropout.
    """


class SecAggClient:
    """One node's secure aggregation; ``handle`` runs whichever stage a payload names.

    ``params`` are the ring the node expects (from its run config); ``min_noise_multiplier``
    and ``colluders`` are the node's own policy, not the server's. ``released_rounds``: the
    rounds it already released a masked input for (restored from the node's state).
    """

    def __init__(
        self,
        node_id: int,
        params: RingParams,
        *,
        min_noise_multiplier: float,
        colluders: int = 0,
        noise: NoiseSource = "fresh",
        noise_seed: int | None = None,
        wrap_probability: float = 1e-9,
        rounding_slack: float = 0.01,
        released_rounds: Iterable[int] = (),
        identity: Identity | None = None,
        roster: Iterable[bytes] = (),
        min_trusted_peers: int = 0,
    ) -> None:
        if type(node_id) is not int or not 0 <= node_id < 1 << 64:
            raise SecAggError(
                f"secure aggregation: node id {node_id!r} is not an unsigned 64-bit id"
            )
        self.node_id = node_id
        if noise not in ("fresh", "seeded"):
            raise SecAggError(
                f"{self._where(SETUP)}: noise must be 'fresh' or 'seeded', got {noise!r}"
            )
        if (noise == "seeded") != (noise_seed is not None):
            raise SecAggError(
                f"{self._where(SETUP)}: noise='seeded' (simulation) needs a noise_seed, "
                "'fresh' takes none"
            )
        if not (min_noise_multiplier >= 0 and math.isfinite(min_noise_multiplier)):
            raise SecAggError(
                f"{self._where(SETUP)}: min_noise_multiplier must be >= 0 and finite, "
                f"got {min_noise_multiplier}"
            )
        self.noise: NoiseSource = noise
        self._noise_seed = noise_seed
        #: signs its keys, ring and survivor set; never saved (the node's policy names it)
        self.identity = identity
        self._roster, self._min_trusted = frozenset(roster), min_trusted_peers
        self._policy: dict[str, Any] = {"min_noise_multiplier": min_noise_multiplier}
        self._policy |= {"colluders": colluders, "wrap_probability": wrap_probability}
        self._policy["rounding_slack"] = rounding_slack
        try:
            check_ring(params, **self._policy)
        except ValueError as exc:
            raise SecAggError(f"{self._where(SETUP)}: ring parameters refused: {exc}") from None
        if params.neighbours and min_trusted_peers:
            raise SecAggError(
                f"{self._where(SETUP)}: a sparse ring (neighbours={params.neighbours}): this "
                f"node requires {min_trusted_peers} trusted peers (secagg-min-trusted), which it "
                "checks over the complete graph only (neighbours=0)"
            )
        self.params = params
        self._released: set[int] = set(released_rounds)
        #: the round's keys, shares and checks so far (``secagg_state.RoundProgress``)
        self.progress = RoundProgress()

    @property
    def round_id(self) -> int | None:
        """The round the last setup bound (None: none yet)."""
        return None if self.progress.round is None else self.progress.round[0]

    @property
    def nonce(self) -> bytes | None:
        """The server's nonce the last setup bound (None: none yet)."""
        return None if self.progress.round is None else self.progress.round[1]

    @property
    def ring_digest(self) -> bytes:
        """The digest of the ring this node was shown this round (empty: none yet)."""
        return self.progress.ring_digest

    @property
    def signed_set(self) -> list[int]:
        """The survivor set this node signed this round (empty: none)."""
        return list(self.progress.consistent)

    @property
    def share_threshold(self) -> int:
        """The shares that rebuild one of its secrets this round: the ring's threshold over
        the complete graph, over a sparse ring the one its member count gives."""
        if not self.params.neighbours or not self.progress.members:
            return self.params.threshold
        return self.params.share_threshold(self.progress.members)

    @property
    def policy(self) -> dict[str, Any]:
        """The node policy's numbers it was made with (``secagg_state.to_state`` saves them;
        a simulation's noise seed among them: kept on the node, as the state is)."""
        more = {"roster": sorted(self._roster), "min_trusted_peers": self._min_trusted}
        return {**self._policy, **more, "noise_seed": self._noise_seed}

    @property
    def released_rounds(self) -> frozenset[int]:
        """The round ids this node released a masked input for: never another for these."""
        return frozenset(self._released)

    @property
    def _trust(self) -> Trust:
        p = self.progress
        return Trust(p.identity_of, frozenset(p.enforcing), self._roster, p.ring_digest)

    def _where(self, stage: str) -> str:
        return f"secure aggregation, node {self.node_id}, stage {stage!r}"

    def _enter(self, stage: str) -> None:
        expected = _NEXT[self.progress.done]
        if stage != SETUP and stage not in expected:
            raise SecAggError(f"{self._where(stage)}: expected stage {expected[0]!r} next")

    def _bind(self, fields: dict[str, Any], stage: str) -> tuple[int, bytes]:
        """The round this message is for: the one the setup bound, or a refusal."""
        assert self.progress.round is not None  # _enter lets no later stage in before a setup
        if (fields["round_id"], fields["nonce"]) != self.progress.round:
            raise SecAggError(
                f"{self._where(stage)}: field 'round_id'/'nonce' is not this round's "
                f"(round {self.progress.round[0]})"
            )
        return self.progress.round

    def handle(self, payload: dict[str, Any], values: torch.Tensor | None = None) -> dict[str, Any]:
        """The reply to ``payload``; ``values`` (the kept values) serve the collect stage."""
        stage = payload.get(STAGE) if isinstance(payload, dict) else None
        if stage == COLLECT:
            if values is None:
                raise SecAggError(f"{self._where(COLLECT)}: needs the kept values")
            return self.collect(payload, values)
        stages = {SETUP: self.setup, SHARE_KEYS: self.share_keys}
        stages |= {CONSISTENCY: self.consistency, UNMASK: self.unmask}
        if stage in stages:
            return stages[stage](payload)
        raise SecAggError(f"secure aggregation, node {self.node_id}: unknown stage {stage!r}")

    def setup(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Check the ring and the round; reply two new public keys and the noise source."""
        self._enter(SETUP)
        fields = check_payload(payload, SETUP, "down")
        where = self._where(SETUP)
        absent = {"neighbours": 0, "modular": 0}  # the complete graph, the exact ring
        ring = {**{name: fields[name] for name in RING_FIELDS}, **absent} | fields
        for name in (*RING_FIELDS, *absent):
            if ring[name] != getattr(self.params, name):
                raise SecAggError(
                    f"{where}: field {name!r} is {ring[name]!r}, "
                    f"this node's run config says {getattr(self.params, name)!r}"
                )
        round_id, nonce = fields["round_id"], fields["nonce"]
        if round_id in self._released:
            raise SecAggError(f"{where}: round {round_id} already has this node's masked input")
        if len(nonce) < NONCE_BYTES:
            raise SecAggError(
                f"{where}: field 'nonce' has {len(nonce)} bytes, fewer than {NONCE_BYTES}"
            )
        (sk1, pk1), (sk2, pk2) = generate_key_pairs(), generate_key_pairs()
        progress = self.progress = RoundProgress(  # a round's keys: nothing of the last one
            round=(round_id, nonce),
            done=SETUP,
            sk1=private_key_to_bytes(sk1),
            sk2=private_key_to_bytes(sk2),
            pk1=encode_public(bool(self.params.neighbours), pk1),
            pk2=encode_public(bool(self.params.neighbours), pk2),
        )
        reply: dict[str, Any] = {"pk1": progress.pk1, "pk2": progress.pk2}  # (sparse: compact)
        reply["seeded_noise"] = int(self.noise == "seeded")
        if self.identity is not None:  # signed: its keys, and whether it enforces its checks
            enforces = int(self._min_trusted > 0)
            reply["identity"] = self.identity.public
            reply["signature"] = self.identity.sign(
                round_id, nonce, self.node_id, progress.pk1, progress.pk2, enforces
            )
            reply["enforces"] = enforces
        return reply

    def share_keys(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Shamir-share the self-mask seed and ``sk1``; one encrypted share per other node."""
        self._enter(SHARE_KEYS)
        fields = check_payload(payload, SHARE_KEYS, "down")
        self._bind(fields, SHARE_KEYS)
        progress = self.progress
        where = self._where(SHARE_KEYS)
        assert progress.round is not None
        bound, roster, colluders = progress.round, self._roster, self._policy["colluders"]
        view = ring_view(
            fields, self.node_id, self.params, bound, (progress.pk1, progress.pk2), where
        )
        verified, enforcing = check_members(
            fields, self.node_id, bound, roster, self._min_trusted, colluders, where
        )
        nids, digest, sparse = view.holders, view.digest, bool(self.params.neighbours)
        sk1, sk2 = bytes_to_private_key(progress.sk1), bytes_to_private_key(progress.sk2)
        pair_seeds: dict[int, bytes] = {}
        share_keys: dict[int, bytes] = {}
        for nid, pk1, pk2 in zip(nids, fields["pk1"], fields["pk2"], strict=True):
            if nid == self.node_id:
                continue
            try:  # both of a peer's keys must parse and agree with this node's now
                pair_seeds[nid] = pair_seed(sk1, decode_public(sparse, pk1))
                share_keys[nid] = generate_shared_key(sk2, decode_public(sparse, pk2))
            except (ValueError, TypeError, AssertionError) as exc:
                raise SecAggError(
                    f"{where}: field 'pk1'/'pk2' of node {nid} is not a usable key: {exc}"
                ) from None
        progress.self_seed = os.urandom(SEED_BYTES)
        seed_shares, sk1_shares = make_shares(
            sparse, view.threshold, len(nids), progress.self_seed, progress.sk1
        )
        dsts: list[int] = []
        ctxts: list[bytes] = []
        for nid, seed_share, sk1_share in zip(nids, seed_shares, sk1_shares, strict=True):
            if nid == self.node_id:
                progress.seed_shares[nid], progress.sk1_shares[nid] = seed_share, sk1_share
                continue
            dsts.append(nid)
            shares = (seed_share, sk1_share)
            ctxts.append(seal(sparse, share_keys[nid], bound, self.node_id, nid, shares))
        progress.pair_seed_of, progress.share_key_of = pair_seeds, share_keys
        progress.identity_of, progress.enforcing, progress.ring_digest = verified, enforcing, digest
        progress.members, progress.done = view.members, SHARE_KEYS
        reply = {"dsts": dsts, "ctxts": ctxts, "seed_commit": seed_commitment(progress.self_seed)}
        if self.identity is not None:
            reply["ring_signature"] = self.identity.sign_ring(*bound, self.node_id, digest)
        return reply

    def collect(self, payload: dict[str, Any], values: torch.Tensor) -> dict[str, Any]:
        """Keep the shares sent to this node; reply its masked ring input on the kept values.

        Once per round: the round id is then spent. ``SecAggInputError`` (local, before
        anything changes) for values that are not ``k`` finite numbers.
        """
        self._enter(COLLECT)
        fields = check_payload(payload, COLLECT, "down")
        round_id, nonce = self._bind(fields, COLLECT)
        where = self._where(COLLECT)
        if round_id in self._released:
            raise SecAggError(f"{where}: round {round_id} already has this node's masked input")
        srcs: list[int] = fields["srcs"]
        if len(set(srcs)) != len(srcs) or self.node_id in srcs:
            raise SecAggError(f"{where}: field 'srcs' repeats a node or names this one")
        unknown = sorted(set(srcs) - set(self.progress.share_key_of))
        if unknown:
            raise SecAggError(f"{where}: field 'srcs' names node {unknown[0]}, not in the round")
        if len(srcs) + 1 < self.share_threshold:
            raise SecAggError(
                f"{where}: {len(srcs) + 1} nodes remain, fewer than the threshold "
                f"{self.share_threshold}"
            )
        trust, bound = self._trust, (round_id, nonce)
        check_masked_with(srcs, fields.get("ring_sigs"), trust, self._min_trusted, bound, where)
        received: dict[int, tuple[bytes, bytes]] = {}
        sparse = bool(self.params.neighbours)
        for src, ciphertext in zip(srcs, fields["ctxts"], strict=True):
            key = self.progress.share_key_of[src]
            try:
                received[src] = unseal(sparse, key, bound, src, self.node_id, ciphertext)
            except ValueError as exc:
                raise SecAggError(f"{where}: field 'ctxts' from node {src} {exc}") from None
        values = self._own_values(values)
        rounding, noise = (
            fresh_generators()
            if self._noise_seed is None
            else seeded_generators(self._noise_seed, round_id)
        )
        ring_input = encode(values, self.params, rounding, noise, rotation_seed(round_id, nonce))
        pair_seeds = {src: self.progress.pair_seed_of[src] for src in srcs}
        seed = self.progress.self_seed
        masked = mask_input(ring_input, self.node_id, pair_seeds, seed, self.params.bits)
        for src, (seed_share, sk1_share) in received.items():
            self.progress.seed_shares[src], self.progress.sk1_shares[src] = seed_share, sk1_share
        self._released.add(round_id)
        self.progress.masked_with = set(srcs)
        self.progress.done = COLLECT
        return {
            "masked_params": pack_input(masked, self.params),
            "round_id": round_id,
            "nonce": nonce,
        }

    def _own_values(self, values: torch.Tensor) -> torch.Tensor:
        kept = self.params.kept
        if not isinstance(values, torch.Tensor) or tuple(values.shape) != (kept,):
            raise SecAggInputError(f"{self._where(COLLECT)}: expected {kept} kept values")
        if not bool(torch.isfinite(values).all()):
            raise SecAggInputError(f"{self._where(COLLECT)}: the kept values are not finite")
        return values

    def consistency(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Sign the survivor set the server names (empty without an identity); the unmask
        stage then answers for that set only, once its signers check out."""
        self._enter(CONSISTENCY)
        fields = check_payload(payload, CONSISTENCY, "down")
        round_id, nonce = self._bind(fields, CONSISTENCY)
        if self.params.neighbours:  # its survivor set is per neighbourhood: none to sign
            raise SecAggError(f"{self._where(CONSISTENCY)}: no consistency stage in a sparse ring")
        active = self._active(fields["active_nids"], [], self._where(CONSISTENCY))
        self.progress.consistent, self.progress.done = sorted(active), CONSISTENCY
        if self.identity is None:
            return {"signature": b""}
        signature = self.identity.sign_survivors(
            round_id, nonce, self.node_id, active, self.progress.ring_digest
        )
        return {"signature": signature}

    def unmask(self, payload: dict[str, Any]) -> dict[str, Any]:
        """The self-mask seed share of each live node, the ``sk1`` share of each dead one."""
        self._enter(UNMASK)
        fields = check_payload(payload, UNMASK, "down")
        bound = self._bind(fields, UNMASK)
        where = self._where(UNMASK)
        if self.progress.done == CONSISTENCY:  # enforcing: t trusted signers, one set a ring
            needed = self.params.threshold if self._min_trusted else 0
            signed, trust = self.progress.consistent, self._trust
            check_survivors(fields, self.node_id, bound, signed, trust, needed, where)
        elif self._min_trusted:
            raise SecAggError(
                f"{where}: no consistency stage came, which this node requires (its "
                "secagg-min-trusted)"
            )
        active = self._active(fields["active_nids"], fields["dead_nids"], where)
        dead: list[int] = fields["dead_nids"]
        self.progress.done = UNMASK
        shares = [self.progress.seed_shares[nid] for nid in active]
        shares += [self.progress.sk1_shares[nid] for nid in dead]
        self.progress.self_seed = b""
        return {"nids": active + dead, "shares": shares}

    def _active(self, active: list[int], dead: list[int], where: str) -> list[int]:
        """The survivor set ``active`` (and the dropped ``dead``), checked against this round."""
        if len(set(active)) != len(active) or len(set(dead)) != len(dead):
            raise SecAggError(f"{where}: field 'active_nids'/'dead_nids' repeats a node")
        both = sorted(set(active) & set(dead))
        if both:
            raise SecAggError(f"{where}: field 'dead_nids' names live node {both[0]}")
        if self.node_id not in active:
            raise SecAggError(f"{where}: field 'active_nids' leaves out this (live) node")
        if len(active) < self.share_threshold:
            raise SecAggError(
                f"{where}: field 'active_nids' has {len(active)} nodes, fewer than the "
                f"threshold {self.share_threshold}"
            )
        stranger = sorted((set(active) | set(dead)) - self.progress.masked_with - {self.node_id})
        if stranger:
            raise SecAggError(f"{where}: node {stranger[0]} was not in this node's sum")
        return active

    def to_state(self) -> dict[str, Any]:
        """Everything this node holds of its secure aggregation, as a ``ConfigRecord``'s
        values (ints, floats, strings, bytes and lists of them): its private keys and shares
        too, so it is kept only in the node's own ``Context.state``, never sent
        (``client/secagg_state.py``)."""
        return secagg_state.to_state(self)

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> SecAggClient:
        """The node's client as ``to_state`` left it; the ring is checked again against the
        policy stored with it.

        Raises:
            SecAggError: a state that is not one ``to_state`` wrote.
        """
        return secagg_state.from_state(cls, state)


#: The stages that may follow each (the consistency stage runs when the nodes sign).
_NEXT: Final = {
    SETUP: (SHARE_KEYS,),
    SHARE_KEYS: (COLLECT,),
    COLLECT: (UNMASK, CONSISTENCY),
    CONSISTENCY: (UNMASK,),
    UNMASK: (SETUP,),
}
