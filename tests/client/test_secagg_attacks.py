"""A malicious server against nodes that check their ring (``client/secagg_identity.py``):
the attacks an attacker's review ran with the project's own clients, each of which rebuilt a
node's individual input while every check of the time passed, are refused now; with the
checks off (``secagg-min-trusted=0``) the same plans still rebuild it, so the refusals are
what protects the input."""

from __future__ import annotations

import dataclasses

import pytest

from tests.client.secagg_attacks import Node, attack

X = 1


def peers_that_enforce_nothing() -> dict[int, Node]:
    """X requires every peer on its roster; its four roster peers check nothing, and the
    server shows each of them the others under keys it made: they encrypt their shares of
    sk1 to the server, whose pairwise masks with X are then its own."""
    peers = [2, 3, 4, 5]
    plan = {
        X: Node(
            ring=[X, *peers],
            n=5,
            t=3,
            srcs=peers,
            S=[X, *peers],
            signers=peers,
            min_trusted=4,
            roster=peers,
        )
    }
    for j in peers:
        others = [u for u in peers if u != j]
        plan[j] = Node(
            ring=[X, *peers],
            n=5,
            t=3,
            srcs=[X, *others],
            S=[X, *peers],
            signers=[X],
            fakes=others,
            min_trusted=0,
            roster=[],
        )
    return plan


def split_rings() -> dict[int, Node]:
    """Every node enforces (one trusted peer, all on every roster, none made up), but the
    server shows each node a ring of its own, of its own size: X's seed and its partners'
    sk1 come from survivor sets each signed within its own ring."""
    w, p, c, f1, f2, d1, d2, d3, d4, d5 = range(2, 12)
    sx, sp = [X, w, p], [X, p, c, d1, d2]
    plan = {
        X: Node(ring=[X, w, p, c], n=4, t=3, srcs=[w, p], S=sx, signers=[w]),
        w: Node(ring=[w, X, p, f1, f2], n=5, t=3, srcs=[X, p], S=sx, signers=[X]),
        p: Node(
            ring=[p, X, w, c, d1, d2, d3, d4, d5],
            n=9,
            t=5,
            srcs=[X, w, c, d1, d2],
            S=sp,
            D=[w],
            signers=[c],
        ),
        c: Node(ring=[c, p, X, d1, d2], n=5, t=3, srcs=[p, X, d1, d2], S=sp, signers=[p]),
        f1: Node(ring=[f1, f2, w], n=3, t=2, srcs=[f2, w], S=[f1, f2], D=[w], signers=[f2]),
        f2: Node(ring=[f2, f1, w], n=3, t=2, srcs=[f1, w], S=[f1, f2], D=[w], signers=[f1]),
        d1: Node(
            ring=[d1, d2, p, c], n=4, t=3, srcs=[d2, p, c], S=[d1, d2, c], D=[p], signers=[d2]
        ),
        d2: Node(
            ring=[d2, d1, p, c], n=4, t=3, srcs=[d1, p, c], S=[d1, d2, c], D=[p], signers=[d1]
        ),
    }
    for d in (d3, d4, d5):
        others = [u for u in (d3, d4, d5) if u != d]
        plan[d] = Node(
            ring=[d, *others, p], n=4, t=3, srcs=[*others, p], S=[d3, d4, d5], D=[p], signers=others
        )
    return plan


def rings_of_one_size() -> dict[int, Node]:
    """n = 9, t = 5 for every node, nobody made up, every node enforcing: rings that share X
    and its partners but differ elsewhere, so that five nodes told a partner dropped co-sign
    their own set and reveal its sk1."""
    w, p1, p2, p3, c1 = 2, 3, 4, 5, 6
    a, b, e, f = list(range(10, 15)), list(range(20, 25)), list(range(30, 35)), list(range(40, 44))
    sx, sp1 = [X, w, p1, p2, p3], [p1, c1, *a[:3]]
    plan = {
        X: Node(ring=[X, w, p1, p2, p3, *f], n=9, t=5, srcs=[w, p1, p2, p3], S=sx, signers=[w]),
        w: Node(ring=[w, X, p1, p2, p3, *f], n=9, t=5, srcs=[X, p1, p2, p3], S=sx, signers=[X]),
        p1: Node(
            ring=[p1, X, w, c1, *a], n=9, t=5, srcs=[w, c1, *a[:3]], S=sp1, D=[w], signers=[c1]
        ),
        c1: Node(ring=[c1, p1, *a[:3]], n=9, t=5, srcs=[p1, *a[:3]], S=sp1, signers=[p1]),
    }
    for p, group in ((p2, b), (p3, e)):
        plan[p] = Node(ring=[p, X, w, *group], n=9, t=5, srcs=[X, w, *group[:2]], unmask=False)
    for p, group in ((p1, a), (p2, b), (p3, e)):
        for g in group:
            others = [u for u in group if u != g]
            extra = [c1] if (p == p1 and g in a[:3]) else []
            plan[g] = Node(
                ring=[g, *others, p, *extra],
                n=9,
                t=5,
                srcs=[*others, p],
                S=group,
                D=[p],
                signers=others[:1],
            )
    for g in f:
        others = [u for u in f if u != g]
        plan[g] = Node(
            ring=[g, *others, w, X],
            n=9,
            t=5,
            srcs=[*others, w, X],
            S=[*f, X],
            D=[w],
            signers=others[:1],
        )
    return plan


def one_ring_split_survivors() -> dict[int, Node]:
    """One ring for all (n = 9, t = 5, every node enforcing, nobody made up): X is told four
    partners sent shares and four others dropped; each partner is asked to unmask a set with
    the other partners dead and the four 'dropped' nodes alive, the four a set with every
    partner dead: together, X's seed and every partner's sk1."""
    partners, dropped = [2, 3, 4, 5], [6, 7, 8, 9]
    ring = [X, *partners, *dropped]
    plan = {X: Node(ring=ring, n=9, t=5, srcs=partners, S=[X, *partners], signers=partners)}
    for v in [*partners, *dropped]:  # a partner: the others dead; a dropped one: all dead
        alive = [X, v, *dropped] if v in partners else [X, *dropped]
        signers = dropped if v in partners else [u for u in dropped if u != v]
        dead = [u for u in partners if u != v]
        others = [u for u in ring if u != v]
        plan[v] = Node(ring=ring, n=9, t=5, srcs=others, S=alive, D=dead, signers=signers)
    return plan


PLANS = {
    "peers that enforce nothing": (peers_that_enforce_nothing, "share_keys", "enforce nothing"),
    "split rings": (split_rings, "collect", "did not sign this node's ring"),
    "rings of one size": (rings_of_one_size, "collect", "did not sign this node's ring"),
    "one ring, split survivor sets": (one_ring_split_survivors, "unmask", "signature of the"),
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_the_victim_refuses_and_its_input_stays_hidden(name: str) -> None:
    plan, stage, reason = PLANS[name]
    outcome = attack(plan(), X)
    assert outcome.error is None, outcome
    assert outcome.refused[X].startswith(f"{stage}: ") and reason in outcome.refused[X]


@pytest.mark.parametrize("name", ["peers that enforce nothing", "one ring, split survivor sets"])
def test_with_the_checks_off_the_same_plan_rebuilds_the_input(name: str) -> None:
    """The control: no node requires trusted peers (and the server relays no survivor
    signature, which such a node does not ask for); the server rebuilds X's input to its
    noise share and rounding (0.01 / sqrt(t) and 1 / scale)."""
    plan = {
        n: dataclasses.replace(node, min_trusted=0, signers=[])
        for n, node in PLANS[name][0]().items()
    }
    outcome = attack(plan, X)
    assert outcome.refused == {} and outcome.error is not None
    assert outcome.error < 0.05
