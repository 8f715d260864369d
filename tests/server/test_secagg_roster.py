"""Signed key advertisements, the owner's roster and the consistency stage
(``client/secagg_identity.py``): a ring of roster members sums as before, each survivor
signing the survivor set; a member the server made up, a key altered under a real signature,
another round's advertisement and one identity under two nodes are refused before a node
shares anything; peers trimmed to made-up members at the collect stage, a survivor set other
than the one signed, forged or missing survivor signatures are refused before a node masks or
unmasks; the signatures' bytes are counted; the policy's files are checked."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from flwr.supercore.primitives.asymmetric import generate_key_pairs, public_key_to_bytes

from fedsparse.client.node_policy import NodePolicy
from fedsparse.client.secagg import SecAggClient
from fedsparse.client.secagg_identity import Identity, load_roster, write_identity
from fedsparse.common.aggregation.secure import RingParams, choose_ring
from fedsparse.common.wire.secagg import SecAggError, payload_bytes
from fedsparse.server.secagg import SecAggServer

REAL = [101, 202, 303]
FAKE = 909  # a member the server makes up: its keys are the server's
K = 40


def ring(clients: int, colluders: int = 0) -> RingParams:
    threshold = (clients + colluders) // 2 + 1
    return choose_ring(
        clip=1.0, sigma=0.01, clients=clients, threshold=threshold, kept=K, colluders=colluders
    )


def identity() -> Identity:
    return Identity(Ed25519PrivateKey.generate())


def values(nid: int) -> torch.Tensor:
    v = torch.randn(K, generator=torch.Generator().manual_seed(nid), dtype=torch.float64)
    return v * (0.5 / float(v.norm()))


class Ring:
    """A server over ``members``; ``signed`` maps a node to its identity; each real node's
    roster holds every real node's identity and it requires ``min_trusted`` of them."""

    def __init__(
        self,
        members: list[int],
        signed: Mapping[int, Identity],
        *,
        min_trusted: int,
        round_id: int = 4,
        nonce: bytes | None = None,
        colluders: int = 0,
    ) -> None:
        p = ring(len(members), colluders)
        roster = [signed[n].public for n in REAL if n in signed]
        self.server = SecAggServer(p, members, round_id=round_id, nonce=nonce)
        self.clients = {
            n: SecAggClient(
                n,
                p,
                min_noise_multiplier=0.0,
                identity=signed.get(n),
                roster=roster if n in REAL else (),
                min_trusted_peers=min_trusted if n in REAL else 0,
                colluders=colluders,
            )
            for n in members
        }

    def setup(self) -> dict[int, dict[str, Any]]:
        s = self.server
        s.receive_setup({n: self.clients[n].handle(m) for n, m in s.setup_messages().items()})
        return s.share_keys_messages()

    def share(self, messages: dict[int, dict[str, Any]]) -> dict[int, str]:
        """Each node's share-keys reply, or its refusal's text."""
        out: dict[int, str] = {}
        replies = {}
        for n, m in messages.items():
            try:
                replies[n] = self.clients[n].handle(m)
            except SecAggError as err:
                out[n] = str(err)
        if not out:
            self.server.receive_share_keys(replies)
        return out

    def sum(self) -> torch.Tensor:
        """Collect, consistency (the server asks: some node signed), unmask; the sum."""
        s, clients = self.server, self.clients
        s.receive_collect(
            {n: clients[n].handle(m, values(n)) for n, m in s.collect_messages().items()}
        )
        assert s.checks_consistency
        s.receive_consistency(
            {n: clients[n].handle(m) for n, m in s.consistency_messages().items()}
        )
        total = s.receive_unmask({n: clients[n].handle(m) for n, m in s.unmask_messages().items()})
        return s.decode(total)


def test_a_ring_of_roster_members_sums_as_before_and_counts_the_signatures() -> None:
    signed = {n: identity() for n in REAL}
    r = Ring(REAL, signed, min_trusted=2)
    messages = r.setup()
    # each setup reply carries 32 + 64 bytes of identity and signature beside its keys
    for n in REAL:
        assert len(messages[n]["identities"]) == len(REAL)
    assert r.share(messages) == {}
    decoded = r.sum()
    expected = sum(values(n) for n in REAL)
    assert isinstance(expected, torch.Tensor)
    assert float((decoded - expected).abs().max()) < 0.2  # noise 0.01 sqrt(3/2), rounding
    # the bytes: the same ring without identities, plus the signed fields, up and down
    plain = Ring(REAL, {}, min_trusted=0)
    plain_messages = plain.setup()
    extra_up = len(REAL) * (len("identity") + 32 + len("signature") + 64 + len("enforces") + 8)
    assert r.server.bytes["setup"]["up"] - plain.server.bytes["setup"]["up"] == extra_up
    relayed = sum(payload_bytes(m) for m in messages.values())
    assert relayed - sum(payload_bytes(m) for m in plain_messages.values()) == len(REAL) * (
        len("identities") + len("signatures") + len("enforcing") + len(REAL) * (32 + 64 + 8)
    )
    # each node signs the ring it was shown (64 bytes up); the collect stage relays its
    # sources' signatures (64 bytes each, down)
    ring_up = len(REAL) * (len("ring_signature") + 64)
    ring_down = len(REAL) * (len("ring_sigs") + (len(REAL) - 1) * 64)
    plain.share(plain_messages)
    _through_collect(plain)
    for stage, direction, extra in (("share_keys", "up", ring_up), ("collect", "down", ring_down)):
        key = "collect_masked_vectors" if stage == "collect" else stage
        got = r.server.bytes[key][direction] - plain.server.bytes[key][direction]
        assert got == extra, (stage, direction)
    # the consistency stage: its own bytes, a 64-byte signature from each survivor up
    assert set(r.server.bytes) == {*plain.server.bytes, "consistency"}
    assert r.server.bytes["consistency"]["up"] == len(REAL) * (len("signature") + 64)


@pytest.mark.parametrize("fake_signs", [False, True])
def test_a_member_the_server_made_up_is_refused_by_every_real_node(fake_signs: bool) -> None:
    """Signed or not (by a key on nobody's roster), the made-up member leaves two of the
    three other members on each real node's roster: a node requiring three refuses, and so
    does one that requires two but tolerates no colluder (the member off its roster)."""
    signed = {n: identity() for n in REAL}
    if fake_signs:
        signed[FAKE] = identity()
    strict = Ring([*REAL, FAKE], signed, min_trusted=2, colluders=0)
    for n, refusal in strict.share(strict.setup()).items():
        assert n in REAL and "1 of the ring's 3 other members are off this node's roster" in (
            refusal
        )
    r = Ring([*REAL, FAKE], signed, min_trusted=3, colluders=1)
    refusals = r.share(r.setup())
    assert sorted(refusals) == REAL  # the fake member, the server's own, shares as it likes
    for n in REAL:
        assert (
            "2 of the ring's 3 other members are on this node's roster and enforce their "
            "checks, it requires 3" in (refusals[n])
        )
    # a node that allows one unknown member takes the same ring
    allowing = Ring([*REAL, FAKE], signed, min_trusted=2, colluders=1)
    assert allowing.share(allowing.setup()) == {}


def test_a_restored_node_still_refuses_a_made_up_member() -> None:
    signed = {n: identity() for n in REAL}
    r = Ring([*REAL, FAKE], signed, min_trusted=3, colluders=1)
    messages = r.setup()
    restored = SecAggClient.from_state(r.clients[101].to_state())
    with pytest.raises(SecAggError, match="it requires 3"):
        restored.handle(messages[101])


def test_a_key_altered_under_a_real_signature_is_refused_naming_its_node() -> None:
    signed = {n: identity() for n in REAL}
    r = Ring(REAL, signed, min_trusted=0)  # even a node that requires nobody checks them
    messages = r.setup()
    _, server_public = generate_key_pairs()  # the server's own key takes node 202's place
    for n in (101, 303):
        payload = dict(messages[n])
        payload["pk1"] = list(payload["pk1"])
        payload["pk1"][payload["nids"].index(202)] = public_key_to_bytes(server_public)
        with pytest.raises(SecAggError, match="node 202's advertisement does not verify"):
            r.clients[n].handle(payload)


def test_another_rounds_advertisement_is_refused() -> None:
    signed = {n: identity() for n in REAL}
    old = Ring(REAL, signed, min_trusted=2, round_id=3)
    replayed = old.setup()[202]  # round 3's keys and signatures
    new = Ring(REAL, signed, min_trusted=2, round_id=4)
    messages = new.setup()
    payload = dict(messages[101])
    at = payload["nids"].index(202)
    for field in ("pk1", "pk2", "identities", "signatures"):
        payload[field] = list(payload[field])
        payload[field][at] = replayed[field][at]
    with pytest.raises(SecAggError, match="node 202's advertisement does not verify"):
        new.clients[101].handle(payload)


def test_one_identity_under_two_nodes_counts_once() -> None:
    shared = identity()
    signed = {101: identity(), 202: shared, 303: shared}
    r = Ring(REAL, signed, min_trusted=2, colluders=1)  # the second name: the one tolerated
    refusals = r.share(r.setup())
    assert (
        "1 of the ring's 2 other members are on this node's roster and enforce their checks, it "
        "requires 2" in (refusals[101])
    )


def test_one_identity_under_two_nodes_leaves_the_second_off_the_roster() -> None:
    """A reviewer's catch: the members a roster identity names beyond its first count as off
    the roster (one party), so that they cannot shrink the count the colluders bound."""
    shared = identity()
    r = Ring(REAL, {101: identity(), 202: shared, 303: shared}, min_trusted=1)
    refusals = r.share(r.setup())
    assert (
        "1 of the ring's 2 other members are off this node's roster or enforce nothing, more "
        "than the 0" in refusals[101]
    )


# -- the node policy's files ------------------------------------------------------------------


def test_an_identity_written_loads_and_a_roster_lists_it(tmp_path: Path) -> None:
    key = tmp_path / "identity.pem"
    public = write_identity(key)
    assert key.stat().st_mode & 0o777 == 0o600
    assert Identity.load(key).public.hex() == public
    with pytest.raises(FileExistsError):
        write_identity(key)  # never overwritten
    roster = tmp_path / "roster.txt"
    roster.write_text(f"# owners we trust\n{public}  alice\n\n{'ab' * 32}\n")
    assert load_roster(roster) == {bytes.fromhex(public), bytes.fromhex("ab" * 32)}


def test_bad_identity_and_roster_files_are_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pem"
    bad.write_text("not a key")
    with pytest.raises(ValueError, match="secagg-identity=.*bad.pem"):
        Identity.load(bad)
    roster = tmp_path / "roster.txt"
    roster.write_text("00" * 32 + "\nzz\n")
    with pytest.raises(ValueError, match="line 2: 'zz' is not a hex Ed25519 public key"):
        load_roster(roster)
    with pytest.raises(ValueError, match="secagg-roster=.*missing"):
        load_roster(tmp_path / "missing")
    with pytest.raises(ValueError, match="secagg-roster='': expected a roster file"):
        NodePolicy(secagg_min_trusted=2)
    with pytest.raises(ValueError, match="secagg-min-trusted=-1: expected >= 0"):
        NodePolicy(secagg_min_trusted=-1, secagg_roster="r")
    # it signs that it enforces: its answers must be held once a round (a reviewer's break
    # went through a ledgerless enforcing peer)
    with pytest.raises(ValueError, match="ledger-dir='': expected a directory with secagg-min"):
        NodePolicy(secagg_min_trusted=1, secagg_roster="r", ledger_dir="")
    policy = NodePolicy.from_sources(
        {"secagg-identity": str(bad), "secagg-roster": str(roster), "secagg-min-trusted": "2"}
    )
    assert (policy.secagg_min_trusted, policy.secagg_roster) == (2, str(roster))


# -- after key sharing: the peers a node masks with, the survivor set it signs ----------------


def _collect(r: Ring, node: int, srcs: list[int]) -> dict[str, Any]:
    forward, ring_sigs = r.server._forward[node], r.server._ring_sigs
    return {
        "stage": "collect_masked_vectors",
        "srcs": srcs,
        "ctxts": [forward[n] for n in srcs],
        "ring_sigs": [ring_sigs.get(n, b"") for n in srcs],
        "round_id": r.server.round_id,
        "nonce": r.server.nonce,
    }


def test_peers_trimmed_to_made_up_members_at_collect_are_refused() -> None:
    """A reviewer's attack: key sharing passes with both roster members present, then the
    server forwards node 101 the shares of one of them and of its made-up member only, as if
    303 dropped; 101 refuses before it masks anything."""
    signed = {n: identity() for n in REAL}
    r = Ring([*REAL, FAKE], signed, min_trusted=2, colluders=1)
    assert r.share(r.setup()) == {}
    with pytest.raises(SecAggError, match="1 trusted identities among the peers .* requires 2"):
        r.clients[101].handle(_collect(r, 101, [202, FAKE]), values(101))
    assert r.clients[101].released_rounds == frozenset()  # nothing masked, nothing spent


def test_more_members_off_the_roster_than_the_colluders_tolerated_are_refused() -> None:
    """Made-up members are the server's own: a node that requires roster members counts
    every other member as a colluder, so that 2t - n > c keeps them below the threshold."""
    signed = {n: identity() for n in REAL}
    r = Ring([*REAL, 901, 902], signed, min_trusted=2, colluders=1)
    refusals = r.share(r.setup())
    assert sorted(refusals) == REAL
    assert (
        "2 of the ring's 4 other members are off this node's roster or enforce nothing, more "
        "than the 1" in (refusals[101])
    )


def _through_collect(r: Ring) -> None:
    s = r.server
    s.receive_collect(
        {n: r.clients[n].handle(m, values(n)) for n, m in s.collect_messages().items()}
    )


def test_a_survivor_set_other_than_the_one_signed_is_refused_at_unmask() -> None:
    signed = {n: identity() for n in [*REAL, 404]}
    members = [*REAL, 404]
    r = Ring(members, signed, min_trusted=2, colluders=1)
    assert r.share(r.setup()) == {}
    _through_collect(r)
    s = r.server
    answers = {n: r.clients[n].handle(m) for n, m in s.consistency_messages().items()}
    s.receive_consistency(answers)
    unmask = s.unmask_messages()
    # a split view: node 101 is told 404 dropped, though it signed a set holding 404
    split = {**unmask[101], "active_nids": [101, 202, 303], "dead_nids": [404]}
    with pytest.raises(SecAggError, match="'active_nids' is not the set this node signed"):
        r.clients[101].handle(split)


def test_survivor_signatures_are_verified_and_counted_against_the_roster() -> None:
    signed = {n: identity() for n in REAL}
    r = Ring([*REAL, 901], signed, min_trusted=2, colluders=1)
    assert r.share(r.setup()) == {}
    _through_collect(r)
    s = r.server
    s.receive_consistency({n: r.clients[n].handle(m) for n, m in s.consistency_messages().items()})
    unmask = s.unmask_messages()
    assert unmask[101]["signers"] == REAL  # the made-up member 901 signs nothing
    # 202's signature dropped: one roster identity left for 101
    at = unmask[101]["signers"].index(202)
    dropped = dict(unmask[101])
    dropped["signers"] = [n for n in dropped["signers"] if n != 202]
    dropped["consistency_sigs"] = [x for i, x in enumerate(dropped["consistency_sigs"]) if i != at]
    with pytest.raises(SecAggError, match="this node and 1 trusted identities signed this"):
        r.clients[101].handle(dropped)
    # 202's signature on another set, relayed as if on this one
    forged = dict(unmask[303])
    forged["consistency_sigs"] = list(forged["consistency_sigs"])
    digest = s._digest
    forged["consistency_sigs"][at] = signed[202].sign_survivors(4, s.nonce, 202, [202, 303], digest)
    with pytest.raises(SecAggError, match="node 202's signature of the survivor set"):
        r.clients[303].handle(forged)
    # without the consistency stage, a node that requires roster members does not unmask
    plain = {k: v for k, v in unmask[202].items() if k not in ("signers", "consistency_sigs")}
    fresh = Ring([*REAL, 901], signed, min_trusted=2, colluders=1)
    assert fresh.share(fresh.setup()) == {}
    _through_collect(fresh)
    plain = {**plain, "nonce": fresh.server.nonce}
    with pytest.raises(SecAggError, match="no consistency stage came"):
        fresh.clients[202].handle(plain)


def test_the_server_drops_a_node_whose_setup_signature_fails() -> None:
    signed = {n: identity() for n in REAL}
    r = Ring(REAL, signed, min_trusted=0)
    s = r.server
    replies = {n: r.clients[n].handle(m) for n, m in s.setup_messages().items()}
    replies[202] = {**replies[202], "signature": bytes(64)}
    with pytest.raises(SecAggError, match="node 202 does not verify") as err:
        s.receive_setup(replies)
    assert err.value.node == 202


def test_a_small_order_key_on_a_roster_is_refused(tmp_path: Path) -> None:
    roster = tmp_path / "roster.txt"
    roster.write_text("01" + "00" * 31 + "\n")  # the identity point: (R, S) = (key, 0) verifies
    with pytest.raises(ValueError, match="line 1: .* small-order point"):
        load_roster(roster)


def test_a_saved_state_without_its_roster_is_refused() -> None:
    signed = {n: identity() for n in REAL}
    r = Ring(REAL, signed, min_trusted=2)
    state = r.clients[101].to_state()
    for key in ("policy.roster", "policy.min_trusted_peers", "consistent"):
        partial = {k: v for k, v in state.items() if k != key}
        with pytest.raises(SecAggError, match="saved state is unusable"):
            SecAggClient.from_state(partial)


def test_a_signing_nodes_share_keys_reply_must_sign_its_ring() -> None:
    """Without its ring's signature (or with one of another ring) the reply is the node's
    fault: the server drops it (``SecAggError.node``), as its peers would refuse it."""
    signed = {n: identity() for n in REAL}
    r = Ring(REAL, signed, min_trusted=0)
    messages = r.setup()
    replies = {n: r.clients[n].handle(m) for n, m in messages.items()}
    for bad in (None, signed[202].sign_ring(4, r.server.nonce, 202, b"another ring")):
        forged = dict(replies)
        forged[202] = {k: v for k, v in replies[202].items() if k != "ring_signature"}
        if bad is not None:
            forged[202]["ring_signature"] = bad
        with pytest.raises(SecAggError, match="'ring_signature' of node 202 is missing or") as err:
            r.server.receive_share_keys(forged)
        assert err.value.node == 202
    r.server.receive_share_keys(replies)  # the real ones pass
