"""Secure aggregation over a sparse ring (SecAgg+: ``secagg-neighbours``), server and clients
as plain state machines: the exact sum with dropouts at every stage, each node's traffic
over its neighbours only, the node computing its own neighbourhood, and the per-neighbourhood
threshold against a server that tells a node's holders different stories."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Collection
from typing import Any

import pytest
import torch
from flwr.supercore.primitives.asymmetric import generate_key_pairs, public_key_to_bytes

from fedsparse.client.secagg import SecAggClient
from fedsparse.client.secagg_state import RoundProgress
from fedsparse.common.aggregation.graph import (
    graph_seed,
    neighbourhoods,
    order,
    share_threshold,
)
from fedsparse.common.aggregation.secure import (
    RingParams,
    choose_ring,
    ring_sum,
    smallest_threshold,
)
from fedsparse.common.aggregation.shamir import PRIME, combine, from_bytes, to_bytes
from fedsparse.common.wire.secagg import SecAggError, payload_bytes
from fedsparse.common.wire.secagg_compact import compressed
from fedsparse.server.secagg import SecAggDropoutError, SecAggServer
from tests.server.test_secagg import RING_INPUTS, record_ring_inputs  # noqa: F401 (autouse)

IDS = [1000 + 37 * i for i in range(14)]
K = 200
ROUND = 9
DEGREE = 4


def params(degree: int = DEGREE, clients: int = len(IDS), colluders: int = 0) -> RingParams:
    ring = choose_ring(
        clip=1.0,
        sigma=1.0,
        clients=clients,
        threshold=smallest_threshold(clients, colluders),
        kept=K,
        colluders=colluders,
    )
    return dataclasses.replace(ring, neighbours=degree)


def values(nid: int) -> torch.Tensor:
    v = torch.randn(K, generator=torch.Generator().manual_seed(nid), dtype=torch.float64)
    return v * (0.9 / float(v.norm()))


class Round:
    """A server and its clients over a sparse ring; ``drop`` names who stops answering."""

    def __init__(self, p: RingParams, ids: list[int] = IDS, **policy: Any) -> None:
        self.p, self.ids = p, ids
        # a fixed nonce: the same graph every run (the tests pick nodes by their places)
        self.server = SecAggServer(p, ids, round_id=ROUND, nonce=b"fedsparse-sparse")
        policy.setdefault("min_noise_multiplier", 0.1)
        self.clients = {nid: SecAggClient(nid, p, **policy) for nid in ids}
        self.ring_inputs: dict[int, torch.Tensor] = {}

    def graph(self, members: list[int] | None = None) -> dict[int, list[int]]:
        u0 = sorted(members or self.ids)
        return neighbourhoods(
            u0, self.p.neighbours, graph_seed(ROUND, self.server.nonce, self.p.neighbours, u0)
        )

    def setup(self, drop: Collection[int] = ()) -> None:
        s = self.server
        msgs = s.setup_messages()
        s.receive_setup({n: self.clients[n].handle(m) for n, m in msgs.items() if n not in drop})

    def keys(self, drop: Collection[int] = ()) -> dict[int, dict[str, Any]]:
        msgs = self.server.share_keys_messages()
        replies = {n: self.clients[n].handle(m) for n, m in msgs.items() if n not in drop}
        self.server.receive_share_keys(replies)
        return replies

    def collect(self, drop: Collection[int] = ()) -> None:
        replies = {}
        for n, m in self.server.collect_messages().items():
            if n not in drop:
                replies[n] = self.clients[n].handle(m, values(n))
                self.ring_inputs[n] = RING_INPUTS.pop()
        self.server.receive_collect(replies)

    def unmask(self, drop: Collection[int] = ()) -> torch.Tensor:
        msgs = self.server.unmask_messages()
        return self.server.receive_unmask(
            {n: self.clients[n].handle(m) for n, m in msgs.items() if n not in drop}
        )

    def expected(self, nodes: Collection[int]) -> torch.Tensor:
        return ring_sum([self.ring_inputs[n] for n in sorted(nodes)], self.p.bits)


def test_the_sparse_ring_sums_exactly_and_each_node_talks_to_its_neighbours_only() -> None:
    r = Round(params())
    r.setup()
    graph = r.graph()
    msgs = r.server.share_keys_messages()
    for nid, m in msgs.items():
        assert m["members"] == IDS and m["nids"] == sorted([nid, *graph[nid]])
        assert len(m["pk1"]) == len(m["pk2"]) == DEGREE + 1
    replies = {n: r.clients[n].handle(m) for n, m in msgs.items()}
    for nid, reply in replies.items():
        assert reply["dsts"] == graph[nid] and len(reply["ctxts"]) == DEGREE
    r.server.receive_share_keys(replies)
    for nid, m in r.server.collect_messages().items():
        assert m["srcs"] == graph[nid]
    r.collect()
    for m in r.server.unmask_messages().values():
        assert len(m["active_nids"]) == DEGREE + 1 and m["dead_nids"] == []
    assert torch.equal(r.unmask(), r.expected(IDS))
    assert all(c.share_threshold == share_threshold(14, DEGREE, 0) for c in r.clients.values())


def test_dropouts_at_every_stage_leave_the_survivors_sum_exact() -> None:
    """One node gone before key sharing (the graph is over who answered the setup), one
    after sharing (its pair masks with its neighbours come off: their sk1 shares rebuild its
    key), one after masking (its self-mask seed rebuilt from its neighbours' shares)."""
    ids = [1000 + 37 * i for i in range(20)]
    p = params(degree=6, clients=20)
    r = Round(p, ids)
    r.setup(drop={ids[0]})
    members = ids[1:]
    graph = r.graph(members)
    # three in one neighbourhood: t = 4 of its 7 holders remain (k + 1 - t = 3 may go)
    gone_keys = members[4]
    gone_masked = graph[gone_keys][0]
    common = [n for n in graph[gone_keys] if n in graph[gone_masked]]
    gone_unmask = common[0] if common else graph[gone_keys][1]
    assert share_threshold(19, 6, 0) == 4
    r.keys(drop={gone_keys})
    r.collect(drop={gone_masked})
    dead = {nid: m["dead_nids"] for nid, m in r.server.unmask_messages().items()}
    for nid, listed in dead.items():
        assert listed == ([gone_masked] if gone_masked in graph[nid] else [])
    survivors = sorted(set(members) - {gone_keys, gone_masked})
    assert r.server.survivors == survivors
    assert torch.equal(r.unmask(drop={gone_unmask}), r.expected(survivors))


def test_too_few_holders_left_for_one_secret_is_a_dropout_naming_the_node() -> None:
    """A node whose neighbourhood lost more than k + 1 - t holders: its seed cannot be rebuilt,
    the round ends (the global count alone would have let it through)."""
    r = Round(params())
    r.setup()
    r.keys()
    r.collect()
    graph = r.graph()
    victim = IDS[3]
    t = r.clients[victim].share_threshold
    silent = graph[victim][: DEGREE + 2 - t]  # leaves t - 1 of its holders (itself among them)
    live = {o: [h for h in [o, *graph[o]] if h not in silent] for o in IDS if o not in silent}
    live |= {o: [h for h in graph[o] if h not in silent] for o in silent}  # silent owners
    short = sorted(o for o, holders in live.items() if len(holders) < t)
    assert victim in short and len(live[victim]) == t - 1
    # the first secret short of its threshold (the graph is random: the victim, or another
    # node whose neighbourhood the silent ones share) ends the round
    first = short[0]
    with pytest.raises(
        SecAggDropoutError, match=rf"node {first}'s secret has {len(live[first])} shares"
    ):
        r.unmask(drop=silent)


def test_key_traffic_grows_with_the_neighbours_not_the_ring() -> None:
    """Per node, the share-keys stage's bytes (both ways) are the same at 14 and 28 members
    for the same k (the member list aside), and far below the complete graph's at 28."""

    def per_node(ids: list[int], degree: int) -> tuple[float, float]:
        p = (
            params(degree, clients=len(ids))
            if degree
            else dataclasses.replace(params(4, clients=len(ids)), neighbours=0)
        )
        r = Round(p, ids)
        r.setup()
        msgs = r.server.share_keys_messages()
        replies = {n: r.clients[n].handle(m) for n, m in msgs.items()}
        members = sum(8 for _ in ids) + len("members") if degree else 0
        down = sum(payload_bytes(m) - members for m in msgs.values()) / len(ids)
        up = sum(payload_bytes(reply) for reply in replies.values()) / len(ids)
        return down, up

    small, large = [1000 + i for i in range(14)], [1000 + i for i in range(28)]
    down14, up14 = per_node(small, 4)
    down28, up28 = per_node(large, 4)
    assert down28 == pytest.approx(down14, rel=0.02) and up28 == pytest.approx(up14, rel=0.02)
    complete_down, complete_up = per_node(large, 0)
    assert complete_down > 4 * down28 and complete_up > 4 * up28


def test_a_node_shares_only_with_the_neighbourhood_it_computes_itself() -> None:
    r = Round(params())
    r.setup()
    msgs = r.server.share_keys_messages()
    nid = IDS[0]
    good = msgs[nid]
    stranger = next(n for n in IDS if n not in good["nids"])
    swapped = dict(good)  # a neighbour swapped for a stranger (its keys relayed)
    other = next(n for n in good["nids"] if n != nid)
    swapped["nids"] = sorted([n for n in good["nids"] if n != other] + [stranger])
    keys = {
        n: (msgs[n]["pk1"][msgs[n]["nids"].index(n)], msgs[n]["pk2"][msgs[n]["nids"].index(n)])
        for n in IDS
    }
    swapped["pk1"] = [keys[n][0] for n in swapped["nids"]]
    swapped["pk2"] = [keys[n][1] for n in swapped["nids"]]
    cases = [
        (swapped, "field 'nids' is not this node's neighbourhood in the ring"),
        ({**good, "members": IDS[::-1]}, "field 'members' must list each member once, by id"),
        ({**good, "members": IDS[1:]}, "field 'members' must list each member once"),
        ({**good, "members": IDS + [IDS[0]]}, "field 'members' must list each member once"),
        ({**good, "members": IDS[:6]}, r"field 'members' has 6 nodes, outside \[threshold 8"),
        ({k: v for k, v in good.items() if k != "members"}, "field 'members' is missing"),
    ]
    for payload, message in cases:
        client = r.clients[nid]
        before = dataclasses.replace(client.progress)
        with pytest.raises(SecAggError, match=message):
            client.handle(payload)
        assert client.progress == before  # nothing changed: the stage may come again
    assert "dsts" in r.clients[nid].handle(good)


def test_the_ring_shape_must_be_the_run_configs_both_ways() -> None:
    sparse, complete = params(), dataclasses.replace(params(), neighbours=0)
    server = SecAggServer(sparse, IDS, round_id=ROUND)
    msg = server.setup_messages()[IDS[0]]
    assert msg["neighbours"] == DEGREE
    with pytest.raises(SecAggError, match="field 'neighbours' is 4, this node's run config says 0"):
        SecAggClient(IDS[0], complete, min_noise_multiplier=0.1).handle(msg)
    plain = SecAggServer(complete, IDS, round_id=ROUND).setup_messages()[IDS[0]]
    assert "neighbours" not in plain
    with pytest.raises(SecAggError, match="field 'neighbours' is 0, this node's run config says 4"):
        SecAggClient(IDS[0], sparse, min_noise_multiplier=0.1).handle(plain)
    # members in a ring of the complete graph
    r = Round(complete)
    r.setup()
    msgs = r.server.share_keys_messages()
    with pytest.raises(SecAggError, match="field 'members' in a ring of the complete graph"):
        r.clients[IDS[0]].handle({**msgs[IDS[0]], "members": IDS})


def test_ring_parameters_refuse_a_bad_degree_and_a_node_that_enforces_refuses_sparse() -> None:
    for bad in (-2, 3, 13, 20):
        with pytest.raises(ValueError, match=rf"neighbours must be 0 .* got {bad}"):
            dataclasses.replace(params(), neighbours=bad)
    with pytest.raises(SecAggError, match="requires 2 trusted peers .* complete graph only"):
        SecAggClient(IDS[0], params(), min_noise_multiplier=0.1, min_trusted_peers=2)


def test_the_server_refuses_a_reply_that_shares_with_a_non_neighbour() -> None:
    r = Round(params())
    r.setup()
    msgs = r.server.share_keys_messages()
    replies = {n: r.clients[n].handle(m) for n, m in msgs.items()}
    liar = IDS[2]
    stranger = next(n for n in IDS if n != liar and n not in r.graph()[liar])
    bad = dict(replies[liar])
    bad["dsts"] = [*bad["dsts"][:-1], stranger]
    with pytest.raises(
        SecAggError, match=f"'dsts' of node {liar} must name every neighbour once"
    ) as err:
        r.server.receive_share_keys({**replies, liar: bad})
    assert err.value.node == liar
    r.server.receive_share_keys(replies)  # unchanged by the failed call


def test_no_consistency_stage_runs_or_is_answered_in_a_sparse_ring() -> None:
    r = Round(params())
    r.setup()
    r.keys()
    r.collect()
    assert not r.server.checks_consistency
    payload = {
        "stage": "consistency",
        "active_nids": IDS,
        "round_id": ROUND,
        "nonce": r.server.nonce,
    }
    with pytest.raises(SecAggError, match="no consistency stage in a sparse ring"):
        r.clients[IDS[0]].handle(payload)


def _holders_shares(r: Round, victim: int, alive: list[int]) -> tuple[list[bytes], list[bytes]]:
    """A lying server's unmask requests to the victim's holders: those in ``alive`` are told
    it lives (they reveal its self-mask seed share), the rest that it died (its sk1 share)."""
    seed, sk1 = [], []
    for holder in [victim, *r.graph()[victim]]:
        client = r.clients[holder]
        progress: RoundProgress = client.progress
        if holder in alive:
            seed.append(progress.seed_shares[victim])
        elif holder != victim:
            sk1.append(progress.sk1_shares[victim])
    return seed, sk1


def test_no_split_of_a_nodes_holders_gives_the_server_both_its_secrets() -> None:
    """Over every way to split a node's k + 1 holders into "alive" and "dead" stories (and
    with a colluding neighbour holding its share for both), the server never gets t shares of
    both the self-mask seed and sk1: 2t - (k + 1) > c_k per neighbourhood."""
    p = params(colluders=1)
    r = Round(p, colluders=1)
    r.setup()
    r.keys()
    r.collect()
    victim = IDS[5]
    near = r.graph()[victim]
    colluder = near[0]
    t = r.clients[victim].share_threshold
    assert 2 * t - (DEGREE + 1) > 1
    honest = [victim, *near[1:]]
    for size in range(len(honest) + 1):
        for alive in itertools.combinations(honest, size):
            seed, sk1 = _holders_shares(r, victim, [*alive, colluder])
            sk1.append(r.clients[colluder].progress.sk1_shares[victim])  # both, from it
            assert len(seed) < t or len(sk1) < t
    # the control: t shares do rebuild the seed, GF(P) elements at the holders' places
    seed, _ = _holders_shares(r, victim, [victim, *near])
    holders = sorted([victim, *near])
    points = [
        (holders.index(h) + 1, from_bytes(y)) for h, y in zip([victim, *near], seed, strict=True)
    ]
    rebuilt = combine(points[:t]).to_bytes(32, "big")
    assert rebuilt == r.clients[victim].progress.self_seed
    assert combine(points[: t - 1]).to_bytes(49, "big")[-32:] != rebuilt


def test_clients_saved_and_restored_between_stages_keep_the_ring_and_its_threshold() -> None:
    """A node's state (``Context.state``'s ConfigRecord through protobuf) holds the ring's
    degree and its share threshold; the restored clients give the exact sum."""
    from flwr.app import ConfigRecord
    from flwr.common.serde import config_record_from_proto, config_record_to_proto

    def through_proto(client: SecAggClient) -> SecAggClient:
        record = config_record_to_proto(ConfigRecord(client.to_state()))
        return SecAggClient.from_state(dict(config_record_from_proto(record)))

    r = Round(params())
    r.setup()
    r.keys()
    r.clients = {n: through_proto(c) for n, c in r.clients.items()}
    t = share_threshold(len(IDS), DEGREE, 0)
    assert all(c.params.neighbours == DEGREE for c in r.clients.values())
    assert all(c.share_threshold == t for c in r.clients.values())
    r.collect()
    r.clients = {n: through_proto(c) for n, c in r.clients.items()}
    assert torch.equal(r.unmask(), r.expected(IDS))
    # a state saved before sparse rings: the complete graph, its threshold
    old = SecAggClient(
        IDS[0], dataclasses.replace(params(), neighbours=0), min_noise_multiplier=0.1
    )
    state = old.to_state()
    del state["ring.neighbours"], state["members"]
    restored = SecAggClient.from_state(state)
    assert restored.params.neighbours == 0
    assert restored.share_threshold == restored.params.threshold


def test_a_sparse_rings_keys_shares_and_ciphertexts_are_the_compact_ones_to_the_byte() -> None:
    """Setup: two 49-byte compressed keys; key sharing: one 126-byte AES-GCM ciphertext a
    neighbour; unmask: one 49-byte GF(P) element a share."""
    r = Round(params())
    s = r.server
    setup = {n: r.clients[n].handle(m) for n, m in s.setup_messages().items()}
    assert all(len(rep["pk1"]) == len(rep["pk2"]) == 49 for rep in setup.values())
    s.receive_setup(setup)
    replies = r.keys()
    for reply in replies.values():
        assert [len(c) for c in reply["ctxts"]] == [126] * DEGREE
        head = len("dsts") + len("ctxts") + len("seed_commit") + 32
        assert payload_bytes(reply) == head + DEGREE * (8 + 126)
    r.collect()
    msgs = s.unmask_messages()
    answers = {n: r.clients[n].handle(m) for n, m in msgs.items()}
    assert all(len(share) == 49 for a in answers.values() for share in a["shares"])
    assert torch.equal(s.receive_unmask(answers), r.expected(IDS))


def test_a_bad_share_is_named_and_the_stage_runs_again_without_it() -> None:
    r = Round(params())
    r.setup()
    r.keys()
    r.collect()
    msgs = r.server.unmask_messages()
    answers = {n: r.clients[n].handle(m) for n, m in msgs.items()}
    liar = IDS[1]
    bad = dict(answers[liar])
    bad["shares"] = [to_bytes((from_bytes(y) + 1) % PRIME) for y in bad["shares"]]
    with pytest.raises(SecAggError, match=f"node {liar}'s share is bad") as err:
        r.server.receive_unmask({**answers, liar: bad})
    assert err.value.node == liar
    with pytest.raises(SecAggError, match="holds a share of node .* not sent to it"):
        r.server.receive_unmask(
            {**answers, liar: {**bad, "shares": [b"\x01" * 48] * len(bad["shares"])}}
        )
    rest = {n: a for n, a in answers.items() if n != liar}
    assert torch.equal(r.server.receive_unmask(rest), r.expected(IDS))


def test_a_node_of_a_sparse_ring_refuses_a_pem_key_and_a_ciphertext_not_sealed_for_it() -> None:
    r = Round(params())
    r.setup()
    msgs = r.server.share_keys_messages()
    nid = IDS[0]
    good = msgs[nid]
    peer = next(i for i, n in enumerate(good["nids"]) if n != nid)
    pem = public_key_to_bytes(generate_key_pairs()[1])
    bad = {**good, "pk2": [pem if i == peer else k for i, k in enumerate(good["pk2"])]}
    with pytest.raises(
        SecAggError, match=f"'pk1'/'pk2' of node {good['nids'][peer]} is not a usable key"
    ):
        r.clients[nid].handle(bad)
    replies = {n: r.clients[n].handle(m) for n, m in msgs.items()}
    r.server.receive_share_keys(replies)
    collect = r.server.collect_messages()
    target = collect[nid]
    swapped = {**target, "ctxts": target["ctxts"][::-1]}  # each under another pair's key
    with pytest.raises(SecAggError, match=r"field 'ctxts' from node \d+ does not decrypt"):
        r.clients[nid].handle(swapped, values(nid))
    assert r.clients[nid].progress.done == "share_keys"  # nothing released


def test_survivors_split_into_parts_of_the_ring_are_not_decoded() -> None:
    """k = 2 (a cycle): two survivors' gaps cut it in two, and each part's sum could be
    decoded apart; the server refuses at the collection, before any share is asked for."""
    r = Round(params(degree=2))
    r.setup()
    r.keys()
    placed = order(IDS, graph_seed(ROUND, r.server.nonce, 2, IDS))
    gone = {placed[0], placed[7]}  # two parts of 6 nodes each
    with pytest.raises(SecAggDropoutError, match="the 12 survivors fall into 2 parts .* of 6"):
        r.collect(drop=gone)
    r = Round(params(degree=2))
    r.setup()
    r.keys()
    placed = order(IDS, graph_seed(ROUND, r.server.nonce, 2, IDS))
    r.collect(drop={placed[0]})  # one gap: a path, one part
    assert torch.equal(r.unmask(), r.expected(sorted(set(IDS) - {placed[0]})))


def test_a_saved_sparse_state_keeps_an_honest_member_count() -> None:
    r = Round(params())
    r.setup()
    r.keys()
    client = r.clients[IDS[0]]
    state = client.to_state()
    assert state["members"] == len(IDS)
    for bad in (0, 1, len(IDS) + 1, 10**9):
        with pytest.raises(SecAggError, match=f"saved member count {bad} is not a ring's"):
            SecAggClient.from_state({**state, "members": bad})
    with pytest.raises(SecAggError, match="saved member count 0"):
        SecAggClient.from_state({k: v for k, v in state.items() if k != "members"})


def test_a_neighbourhood_key_changed_is_another_ring_and_a_complete_ring_sends_no_degree() -> None:
    r = Round(params())
    r.setup()
    msgs = r.server.share_keys_messages()
    nid = IDS[0]
    state = r.clients[nid].to_state()
    first, second = SecAggClient.from_state(state), SecAggClient.from_state(state)
    first.handle(msgs[nid])
    peer = next(i for i, n in enumerate(msgs[nid]["nids"]) if n != nid)
    other = compressed(generate_key_pairs()[1])
    pk2 = [other if i == peer else k for i, k in enumerate(msgs[nid]["pk2"])]
    second.handle({**msgs[nid], "pk2": pk2})
    assert first.ring_digest != second.ring_digest  # the ledger's one ring a round sees two
    complete = dataclasses.replace(params(), neighbours=0)
    setup = SecAggServer(complete, IDS, round_id=ROUND).setup_messages()[nid]
    with pytest.raises(SecAggError, match="field 'neighbours' holds 0, not a sparse ring's"):
        SecAggClient(nid, complete, min_noise_multiplier=0.1).handle({**setup, "neighbours": 0})


def test_two_colluding_holders_cannot_put_their_bad_shares_on_an_honest_one() -> None:
    """Two holders of one node shift their shares of its seed by d1, d2 with
    l1 d1 + l2 d2 = 0 over the holders but an honest H (l: the Lagrange weights at 0): then
    leaving H out rebuilds the seed, and "leave one out" would name H. The server names one
    of the two (the shares off the polynomial the other seven lie on)."""
    r = Round(params(degree=8))
    r.setup()
    r.keys()
    r.collect()
    msgs = r.server.unmask_messages()
    answers = {n: r.clients[n].handle(m) for n, m in msgs.items()}
    owner = IDS[4]
    holders = sorted([owner, *r.graph()[owner]])
    assert len(holders) == 9 and r.clients[owner].share_threshold == 5
    honest, bad1, bad2 = holders[0], holders[1], holders[2]
    xs = {h: i + 1 for i, h in enumerate(holders)}
    rest = [xs[h] for h in holders if h != honest]

    def weight(x: int) -> int:  # the Lagrange weight of x at 0 over the rest
        num = den = 1
        for other in rest:
            if other != x:
                num, den = num * other % PRIME, den * (other - x) % PRIME
        return num * pow(den, -1, PRIME) % PRIME

    shift = {bad1: 1, bad2: (-weight(xs[bad1]) * pow(weight(xs[bad2]), -1, PRIME)) % PRIME}
    for bad, d in shift.items():
        reply = dict(answers[bad])
        at = reply["nids"].index(owner)
        shares = list(reply["shares"])
        shares[at] = to_bytes((from_bytes(shares[at]) + d) % PRIME)
        answers[bad] = {**reply, "shares": shares}
    with pytest.raises(SecAggError, match="node .*'s share is bad") as err:
        r.server.receive_unmask(answers)
    assert err.value.node in (bad1, bad2)


def test_the_server_names_a_node_whose_keys_or_ciphertexts_its_neighbours_could_not_use() -> None:
    """A key off the curve, a PEM key, pk1 = pk2, another node's key; a ciphertext of the
    wrong length: each refused with its sender named, before its neighbours fail unnamed."""
    r = Round(params())
    s = r.server
    setup = {n: r.clients[n].handle(m) for n, m in s.setup_messages().items()}
    liar, other = IDS[3], IDS[6]
    pem = public_key_to_bytes(generate_key_pairs()[1])
    cases = [
        ({"pk1": b"\x02" + (1).to_bytes(48, "big")}, "field 'pk1' of node .* is not a key"),
        ({"pk2": pem}, "field 'pk2' of node .* is not a key"),
        ({"pk2": setup[liar]["pk1"]}, "repeats a key"),
        ({"pk1": setup[other]["pk2"]}, "repeats a key of node"),
    ]
    for change, message in cases:
        with pytest.raises(SecAggError, match=message) as err:
            s.receive_setup({**setup, liar: {**setup[liar], **change}})
        assert err.value.node in (liar, other)
    s.receive_setup(setup)
    msgs = s.share_keys_messages()
    replies = {n: r.clients[n].handle(m) for n, m in msgs.items()}
    short = {**replies[liar], "ctxts": [c[:-1] for c in replies[liar]["ctxts"]]}
    with pytest.raises(SecAggError, match=f"'ctxts' of node {liar} holds a ciphertext") as err:
        s.receive_share_keys({**replies, liar: short})
    assert err.value.node == liar


def test_a_ring_split_before_anyone_masks_is_refused_at_the_key_sharing() -> None:
    r = Round(params(degree=2))
    r.setup()
    placed = order(IDS, graph_seed(ROUND, r.server.nonce, 2, IDS))
    with pytest.raises(SecAggDropoutError, match="12 nodes that shared their keys fall into 2"):
        r.keys(drop={placed[0], placed[7]})
    assert all(c.released_rounds == frozenset() for c in r.clients.values())


def test_a_saved_member_count_must_be_an_int() -> None:
    r = Round(params())
    r.setup()
    r.keys()
    state = r.clients[IDS[0]].to_state()
    for bad in (8.7, "14", float("inf"), True):
        with pytest.raises(SecAggError, match="saved state is unusable|saved member count"):
            SecAggClient.from_state({**state, "members": bad})
