"""The sparse ring's graph and bounds (common/aggregation/graph.py): the Harary graph's shape
and connectivity, its random order, and each bound against an independent computation."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
from scipy import stats

from fedsparse.common.aggregation.graph import (
    colluding_neighbours,
    disconnection_bound,
    graph_seed,
    lost_holders_bound,
    neighbourhood,
    neighbourhoods,
    order,
    parts,
    share_threshold,
    sparse_degree,
)

NONCE = bytes(range(16))


def seed(members: list[int], degree: int, round_id: int = 3, nonce: bytes = NONCE) -> bytes:
    return graph_seed(round_id, nonce, degree, members)


def connected(graph: dict[int, list[int]], removed: set[int]) -> bool:
    left = [n for n in graph if n not in removed]
    if not left:
        return True
    seen, todo = {left[0]}, [left[0]]
    while todo:
        for m in graph[todo.pop()]:
            if m not in removed and m not in seen:
                seen.add(m)
                todo.append(m)
    return len(seen) == len(left)


@pytest.mark.parametrize(("n", "k"), [(7, 2), (7, 4), (20, 6), (101, 10), (9, 8), (6, 10)])
def test_every_member_has_k_neighbours_and_the_relation_is_symmetric(n: int, k: int) -> None:
    members = [1000 + 7 * i for i in range(n)]
    graph = neighbourhoods(members, k, seed(members, k))
    assert sorted(graph) == members
    for node, near in graph.items():
        assert near == sorted(set(near)) and node not in near
        assert len(near) == min(k, n - 1)  # k >= n - 1: the complete graph
        assert all(node in graph[m] for m in near)
        assert near == neighbourhood(node, members, k, seed(members, k))


def test_the_order_is_the_public_seeds_and_the_member_lists_order_does_not_matter() -> None:
    members = list(range(50, 90))
    shuffled = random.Random(1).sample(members, len(members))
    assert order(members, seed(members, 6)) == order(shuffled, seed(shuffled, 6))
    assert seed(members, 6) == seed(shuffled, 6)
    graphs = {
        tuple(order(members, seed(members, 6, *change)))
        for change in [(3, NONCE), (4, NONCE), (3, bytes(16)), (3, NONCE + b"x")]
    }
    assert len(graphs) == 4  # round, nonce: another order
    assert seed(members, 6) != seed(members, 8) != seed(members[1:], 6)


def test_a_non_member_has_no_neighbourhood_and_bad_degrees_are_refused() -> None:
    members = list(range(10))
    with pytest.raises(ValueError, match="node 99 is not a member"):
        neighbourhood(99, members, 4, seed(members, 4))
    for degree in (0, 1, 3):
        with pytest.raises(ValueError, match="even number >= 2"):
            neighbourhoods(members, degree, seed(members, degree))
    with pytest.raises(ValueError, match="repeat"):
        neighbourhoods([1, 1, 2, 3], 2, b"s")


@pytest.mark.parametrize(("n", "k"), [(10, 4), (11, 6), (12, 2)])
def test_only_two_runs_of_k_over_2_removed_positions_disconnect_the_ring(n: int, k: int) -> None:
    """Every subset of positions, removed: the ring falls apart exactly when the removed set
    holds two disjoint runs of k/2 consecutive positions (with survivors between them), and
    no k - 1 removed nodes ever disconnect it (its vertex connectivity is k)."""
    members = list(range(n))
    placed = order(members, seed(members, k))
    graph = neighbourhoods(members, k, seed(members, k))
    half = k // 2
    for size in range(n + 1):
        for positions in itertools.combinations(range(n), size):
            removed = {placed[p] for p in positions}
            # the arcs of survivors between removed runs: apart iff two gaps of >= k/2
            gaps, run = [], 0
            start = next((p for p in range(n) if p not in positions), None)
            if start is None or size == n - 1:
                continue  # nothing or one node left: connected
            for step in range(1, n + 1):
                if (start + step) % n in positions:
                    run += 1
                else:
                    gaps.append(run)
                    run = 0
            apart = sum(1 for g in gaps if g >= half) >= 2
            assert connected(graph, removed) is not apart, positions
            if size < k:
                assert not apart


def test_a_nodes_colluding_neighbours_are_hypergeometric_over_random_orders() -> None:
    """Over 4,000 nonces the colluders among one node's k neighbours follow the
    hypergeometric law the bounds assume (k of the n - 1 others, c of them colluders)."""
    n, k, colluders = 40, 8, 10
    members = list(range(n))
    bad = set(range(1, colluders + 1))
    counts = np.array(
        [
            len(bad & set(neighbourhood(0, members, k, seed(members, k, 1, t.to_bytes(16)))))
            for t in range(4000)
        ]
    )
    law = stats.hypergeom(n - 1, colluders, k)
    observed = np.bincount(counts, minlength=k + 1)[: k + 1]
    expected = law.pmf(np.arange(k + 1)) * len(counts)
    keep = expected >= 5  # chi-square cells, the tail pooled
    obs = np.append(observed[keep], observed[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    assert stats.chisquare(obs, exp).pvalue > 1e-3
    se = math.sqrt(law.var() / len(counts))
    assert abs(counts.mean() - law.mean()) < 4 * se


@pytest.mark.parametrize(
    ("n", "k", "c"), [(100, 16, 5), (1000, 50, 50), (1000, 94, 100), (60, 20, 0), (30, 4, 29)]
)
def test_the_colluder_bound_is_the_smallest_with_the_union_tail_below_2_to_the_minus_40(
    n: int, k: int, c: int
) -> None:
    bound = colluding_neighbours(n, k, c)
    law = stats.hypergeom(n - 1, min(c, n - 1), min(k, n - 1))
    assert n * law.sf(bound) <= 2.0**-40
    if bound > 0:
        assert n * law.sf(bound - 1) > 2.0**-40
    threshold = share_threshold(n, k, c)
    assert 2 * threshold - (k + 1) > bound >= 2 * (threshold - 1) - (k + 1)
    assert threshold <= k + 1


@pytest.mark.parametrize(
    ("n", "k", "t", "d"), [(100, 16, 12, 5), (1000, 50, 36, 50), (200, 10, 8, 40)]
)
def test_the_lost_holders_bound_is_the_union_of_hypergeometric_tails(
    n: int, k: int, t: int, d: int
) -> None:
    tail = stats.hypergeom(n, d, k + 1).sf(k + 1 - t)
    assert lost_holders_bound(n, k, t, d) == pytest.approx(min(1.0, n * tail), rel=1e-9)
    assert lost_holders_bound(n, k, t, k + 1 - t) == 0.0


def test_the_disconnection_bound_holds_over_random_removals() -> None:
    """Monte Carlo at n = 30, k = 4: random sets of b removed nodes disconnect the ring no
    more often than the bound (plus 4 standard errors); none below k."""
    n, k = 30, 4
    members = list(range(n))
    graph = neighbourhoods(members, k, seed(members, k))
    rng = random.Random(5)
    for removed in (3, 8, 12):
        trials = 3000
        hits = sum(not connected(graph, set(rng.sample(members, removed))) for _ in range(trials))
        p = hits / trials
        bound = disconnection_bound(n, k, removed)
        assert p <= bound + 4 * math.sqrt(max(p * (1 - p), 1e-4) / trials)
        assert (removed < k) is (bound == 0.0)
    exact = n**2 / 2 * math.comb(12, k) / math.comb(n, k)
    assert disconnection_bound(n, k, 12) == pytest.approx(min(1.0, exact), rel=1e-9)


@pytest.mark.parametrize(("n", "c", "d"), [(100, 5, 5), (1000, 50, 50), (1000, 100, 100)])
def test_the_suggested_degree_is_the_smallest_meeting_all_three_bounds(
    n: int, c: int, d: int
) -> None:
    found = sparse_degree(n, c, d)
    assert found is not None
    k, t = found

    def meets(degree: int) -> bool:
        try:
            threshold = share_threshold(n, degree, c)
        except ValueError:
            return False
        return (
            lost_holders_bound(n, degree, threshold, d) <= 2.0**-20
            and disconnection_bound(n, degree, c + d) <= 2.0**-40
        )

    assert t == share_threshold(n, k, c) and meets(k)
    assert not any(meets(degree) for degree in range(2, k, 2))
    assert k < n // 5  # O(log n), far below the complete graph's n - 1


def test_no_sparse_ring_meets_the_bounds_for_most_members_colluding() -> None:
    """30 of 40 colluding and 5 dropping: every k below 39 leaves some bound unmet (then
    only the complete graph, secagg-neighbours = 0)."""
    assert sparse_degree(40, 30, 5) is None
    assert sparse_degree(40, 20, 2) == (24, 23)  # half colluding: 23 of 25 holders


def test_the_parts_of_a_ring_are_its_connected_survivors() -> None:
    members = list(range(12))
    graph = neighbourhoods(members, 2, seed(members, 2))
    placed = order(members, seed(members, 2))
    alive = [n for n in members if n not in (placed[0], placed[5])]
    split = parts(graph, alive)
    assert sorted(map(len, split)) == [4, 6]
    assert sorted(n for part in split for n in part) == sorted(alive)
    assert all(connected(graph, set(members) - set(part)) for part in split)
    assert parts(graph, members) == [members]
    assert parts(graph, []) == []
