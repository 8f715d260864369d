"""Secure aggregation's sparse ring (SecAgg+): who masks and shares with whom, and its bounds.

Bell et al., "Secure Single-Server Aggregation with (Poly)Logarithmic Overhead" (CCS 2020,
IACR ePrint 2020/704): each client masks with and secret-shares its seeds among ``k``
neighbours, not all ``n - 1`` others, so keys, shares and their ciphertexts cost ``O(k)`` per
client, with ``k = O(log n)``.

The graph is the Harary graph ``H(n, k)`` (``k`` even: the circulant where each position is
adjacent to the ``k / 2`` positions on either side) over the members placed in a random
order. The order is public and the same for every party: members sorted by
``SHA-256(seed || id)``, the seed hashing the round's id, the server's nonce, ``k`` and the
sorted members (:func:`graph_seed`). Every node computes its own neighbourhood from the
member list it is shown (``neighbourhood``) and refuses any other set of ids.

What ``k`` and the share threshold ``t`` must satisfy (``n`` members, ``c`` of which may
collude with the server, ``N[u]``: ``u`` and its ``k`` neighbours, which hold ``u``'s ``k + 1``
shares):

* **Equivocation** (the threshold): the server asks each holder once whether ``u`` lived; it
  gets both ``u``'s self-mask seed (from holders told "alive") and its key (from holders told
  "dead") only if ``2t <= (k + 1) + c_u``, ``c_u`` the colluders in ``N(u)``. Under a random
  order ``c_u`` is hypergeometric (``k`` draws from the ``n - 1`` others, ``c`` of them
  colluders); :func:`colluding_neighbours` is the ``c_k`` that no node's neighbourhood exceeds
  but with probability ``2^-sigma`` (a union over the ``n`` nodes), and
  :func:`share_threshold` the smallest ``t`` with ``2t - (k + 1) > c_k``: the complete graph's
  ``2t - n > c``, per neighbourhood.
* **Reliability**: a node's secrets are rebuilt from ``t`` of its ``k + 1`` holders; with
  ``d`` members dropping at random no neighbourhood loses more than ``k + 1 - t`` but with
  probability ``2^-eta`` (:func:`lost_holders_bound`).
* **Connectivity**: the server learns the sum of each connected part of the honest
  survivors. ``H(n, k)`` without a set ``B`` of positions falls apart only where ``B`` holds
  two runs of ``k / 2`` consecutive positions; for ``B`` a random set of ``b`` members that has
  probability at most ``n^2 / 2 * C(b, k) / C(n, k)`` (:func:`disconnection_bound`), and none
  for ``b < k``. The bound assumes the dropouts do not depend on the order: a server that
  chooses whom to drop after seeing it can cut the ring into arcs of its choosing (each
  node's own guarantee, its noise share alone, stands; the central one is an arc's).

:func:`sparse_degree` is the smallest ``k`` meeting all three for stated ``c`` and ``d``.
The bounds hold for a server that follows the protocol: one that lies can grind the order
(it picks the nonce before the round: ``2^40`` draws of ``n`` hashes each, offline, for
``c_k + 1`` colluders by one node), besides what the unchecked keys and views of a sparse
ring let it do (docs/explanation/secure-aggregation.md, "Limits").
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Final

__all__ = [
    "CORRECTNESS_BITS",
    "SECURITY_BITS",
    "colluding_neighbours",
    "disconnection_bound",
    "graph_seed",
    "lost_holders_bound",
    "neighbourhood",
    "neighbourhoods",
    "order",
    "parts",
    "share_threshold",
    "sparse_degree",
]

SECURITY_BITS: Final = 40
"""``sigma``: the bounds that guard privacy fail with probability at most ``2^-sigma``."""
CORRECTNESS_BITS: Final = 20
"""``eta``: the bound that guards a round's completion fails with probability ``2^-eta``."""

_SEED_LABEL: Final = b"fedsparse/secagg/graph/v1\x00"


def _check_degree(members: int, degree: int) -> None:
    if degree < 2 or degree % 2:
        raise ValueError(f"neighbours must be an even number >= 2, got {degree}")
    if members < 3:
        raise ValueError(f"a sparse ring needs at least 3 members, got {members}")


def graph_seed(round_id: int, nonce: bytes, degree: int, members: Sequence[int]) -> bytes:
    """The seed of the round's order: SHA-256 of the round, the nonce, ``k`` and the sorted
    members (each part length-prefixed, under a label)."""
    digest = hashlib.sha256(_SEED_LABEL)
    for part in (round_id.to_bytes(8, "big"), nonce, degree.to_bytes(4, "big")):
        digest.update(len(part).to_bytes(4, "big") + part)
    digest.update(len(members).to_bytes(4, "big"))
    for nid in sorted(members):
        digest.update(nid.to_bytes(8, "big"))
    return digest.digest()


def order(members: Sequence[int], seed: bytes) -> list[int]:
    """The members in the graph's order: by ``SHA-256(seed || id)`` (then by id)."""
    return sorted(members, key=lambda nid: (_place(seed, nid), nid))


def _place(seed: bytes, nid: int) -> bytes:
    return hashlib.sha256(seed + nid.to_bytes(8, "big")).digest()


def neighbourhoods(members: Sequence[int], degree: int, seed: bytes) -> dict[int, list[int]]:
    """Each member's neighbours in ``H(n, k)`` over :func:`order` (sorted by id); every
    member's ``k`` others where ``k >= n - 1`` (then the graph is complete)."""
    _check_degree(len(members), degree)
    if len(set(members)) != len(members):
        raise ValueError("the members repeat a node")
    placed = order(members, seed)
    n = len(placed)
    if degree >= n - 1:
        return {nid: sorted(m for m in placed if m != nid) for nid in placed}
    half = degree // 2
    out = {}
    for position, nid in enumerate(placed):
        near = [placed[(position + step) % n] for step in range(-half, half + 1) if step]
        out[nid] = sorted(near)
    return out


def neighbourhood(node: int, members: Sequence[int], degree: int, seed: bytes) -> list[int]:
    """``node``'s neighbours (sorted), ``ValueError`` if it is not a member."""
    if node not in members:
        raise ValueError(f"node {node} is not a member of the ring")
    return neighbourhoods(members, degree, seed)[node]


def parts(graph: Mapping[int, Sequence[int]], alive: Collection[int]) -> list[list[int]]:
    """The connected parts of ``graph`` among the ``alive`` nodes (each sorted, by smallest
    id): the sums a server that rebuilds every survivor's seed can decode apart."""
    left, out = set(alive), []
    for start in sorted(left):
        if start not in left:
            continue
        part, todo = [start], [start]
        left.discard(start)
        while todo:
            for near in graph[todo.pop()]:
                if near in left:
                    left.discard(near)
                    part.append(near)
                    todo.append(near)
        out.append(sorted(part))
    return out


def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def _tail(population: int, marked: int, draws: int, above: int) -> float:
    """``P[X > above]`` for ``X`` hypergeometric: ``draws`` of ``population``, ``marked`` marked
    (summed in logs: exact enough far below ``2^-40``)."""
    top = min(marked, draws)
    low = max(above + 1, draws - (population - marked))
    if low > top:
        return 0.0
    total = _log_comb(population, draws)
    logs = [
        _log_comb(marked, j) + _log_comb(population - marked, draws - j) - total
        for j in range(low, top + 1)
    ]
    peak = max(logs)
    return math.exp(peak) * math.fsum(math.exp(v - peak) for v in logs)


def colluding_neighbours(
    members: int, degree: int, colluders: int, security_bits: int = SECURITY_BITS
) -> int:
    """``c_k``: the most colluders any member's ``k`` neighbours hold but with probability
    ``2^-sigma`` (``n`` times the hypergeometric tail)."""
    _check_degree(members, degree)
    if colluders < 0:
        raise ValueError(f"colluders must be >= 0, got {colluders}")
    others, draws = members - 1, min(degree, members - 1)
    marked = min(colluders, others)
    limit = 2.0**-security_bits
    for bound in range(min(marked, draws) + 1):
        if members * _tail(others, marked, draws, bound) <= limit:
            return bound
    return min(marked, draws)


def share_threshold(
    members: int, degree: int, colluders: int, security_bits: int = SECURITY_BITS
) -> int:
    """The smallest ``t`` with ``2t - (k + 1) > c_k`` (:func:`colluding_neighbours`): at most
    the ``k + 1`` holders (all of them where every neighbour may collude, ``c_k = k``)."""
    holders = min(degree, members - 1) + 1
    bound = colluding_neighbours(members, degree, colluders, security_bits)
    return (holders + bound) // 2 + 1


def lost_holders_bound(members: int, degree: int, threshold: int, dropouts: int) -> float:
    """The probability bound that ``dropouts`` random members leave some neighbourhood
    fewer than ``threshold`` of its ``k + 1`` holders (``n`` times the tail)."""
    holders = min(degree, members - 1) + 1
    if dropouts <= holders - threshold:
        return 0.0
    return min(1.0, members * _tail(members, dropouts, holders, holders - threshold))


def disconnection_bound(members: int, degree: int, removed: int) -> float:
    """The module docstring's bound on ``P[H(n, k)`` without ``removed`` random members is
    disconnected``]``: 0 below ``k`` removed, else ``n^2 / 2 * C(b, k) / C(n, k)``, at most 1."""
    _check_degree(members, degree)
    if degree >= members - 1 or removed < degree:
        return 0.0
    log_ratio = _log_comb(removed, degree) - _log_comb(members, degree)
    return min(1.0, math.exp(2 * math.log(members) - math.log(2) + log_ratio))


def sparse_degree(
    members: int,
    colluders: int,
    dropouts: int,
    *,
    security_bits: int = SECURITY_BITS,
    correctness_bits: int = CORRECTNESS_BITS,
) -> tuple[int, int] | None:
    """The smallest even ``k`` (and its ``t``) below ``n - 1`` with the three bounds of the
    module docstring for ``c`` colluders and ``d`` random dropouts; None: none (the complete
    graph, ``secagg-neighbours = 0``)."""
    for degree in range(2, members - 1, 2):
        threshold = share_threshold(members, degree, colluders, security_bits)
        if lost_holders_bound(members, degree, threshold, dropouts) > 2.0**-correctness_bits:
            continue
        if disconnection_bound(members, degree, colluders + dropouts) > 2.0**-security_bits:
            continue
        return degree, threshold
    return None
