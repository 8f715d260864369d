"""Benchmark: one round of secure aggregation at 100 and 1,000 clients, complete graph against
the sparse ring (issue "Secure aggregation at a thousand clients a round").

The server's and the clients' state machines (``server/secagg.py``, ``client/secagg.py``)
run one round in this process, without Flower messages (what a deployment adds to each
payload is Flower's framing, counted by the run records, not here): setup, key sharing,
collection of ``--kept`` masked values a client (3,829: the digits CNN at r = 0.9), and
unmasking, with a share ``--dropouts`` of the clients lost after key sharing (their pairwise
masks come off through their key's shares, the costliest path) and the ring for
``--colluders`` of them colluding. The sparse ring's ``k`` is ``sparse_degree`` for those two
shares (``common/aggregation/graph.py``) unless ``--neighbours`` names one.

Printed per configuration: each stage's bytes per client, down and up (the payloads as a
Flower ``ConfigRecord`` counts them, per message a client got and per reply it sent), the
key and share traffic of a client that stays (every stage but the masked values) against
its masked payload, and the wall time of the clients (all of them, one
after another) and of the server per stage, and the round's. The complete graph costs
``O(n^2)`` keys and shares in all, so it runs only up to ``--complete-up-to`` clients.

``--ring-bits b`` masks in a small ring of ``b`` bits (``common/aggregation/small_ring.py``),
its sigma the one that carries a central noise multiplier of 1 (the exact ring's: 1).

Usage: python benchmarks/secagg_scale.py [--clients 100 1000] [--complete-up-to 100]
[--ring-bits 12]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from typing import Any

import torch

from fedsparse.client.secagg import SecAggClient
from fedsparse.common.aggregation.graph import sparse_degree
from fedsparse.common.aggregation.secure import (
    central_noise_multiplier,
    choose_ring,
    ring_for_central,
    smallest_threshold,
)
from fedsparse.common.wire.secagg import COLLECT, SETUP, SHARE_KEYS, STAGES, UNMASK
from fedsparse.server.secagg import SecAggServer

ROUND = 1


def one_round(
    clients: int, neighbours: int, kept: int, colluders: int, dropouts: int, bits: int = 0
) -> dict[str, Any]:
    """One round's bytes per client per stage and times per stage (clients, server); ``bits``:
    a small ring's width (0: the exact ring)."""
    shape = dict(
        clip=1.0,
        clients=clients,
        threshold=smallest_threshold(clients, colluders),
        kept=kept,
        colluders=colluders,
    )
    ring = (  # a small ring: the sigma that carries a central noise multiplier of 1
        ring_for_central(1.0, bits=bits, **shape)  # type: ignore[arg-type]
        if bits
        else choose_ring(sigma=1.0, **shape)  # type: ignore[arg-type]
    )
    params = dataclasses.replace(ring, neighbours=neighbours)
    ids = [10_000 + 7 * i for i in range(clients)]
    server = SecAggServer(params, ids, round_id=ROUND)
    nodes = {n: SecAggClient(n, params, min_noise_multiplier=0.0, colluders=colluders) for n in ids}
    values = {
        n: torch.randn(kept, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
        * (0.5 / math.sqrt(kept))
        for n in ids
    }
    lost = set(ids[:: max(1, clients // dropouts)][:dropouts]) if dropouts else set()
    times: dict[str, tuple[float, float]] = {}
    counts: dict[str, tuple[int, int]] = {}  # stage -> (messages sent, replies)

    def stage(name: str, messages: Any, receive: Any, skip: frozenset[int] = frozenset()) -> Any:
        start = time.perf_counter()
        msgs = messages()
        mid = time.perf_counter()
        replies = {}
        for n, m in msgs.items():
            if n in skip:
                continue
            replies[n] = nodes[n].handle(m, values[n]) if name == COLLECT else nodes[n].handle(m)
        clients_done = time.perf_counter()
        out = receive(replies)
        end = time.perf_counter()
        times[name] = (clients_done - mid, (mid - start) + (end - clients_done))
        counts[name] = (len(msgs), len(replies))
        return out

    stage(SETUP, server.setup_messages, server.receive_setup)
    stage(SHARE_KEYS, server.share_keys_messages, server.receive_share_keys)
    stage(COLLECT, server.collect_messages, server.receive_collect, skip=frozenset(lost))
    total = stage(UNMASK, server.unmask_messages, server.receive_unmask)
    assert total.shape == (kept,)
    per_client = {  # per message a client got, per reply it sent
        s: (server.bytes[s]["down"] / counts[s][0], server.bytes[s]["up"] / counts[s][1])
        for s in STAGES
    }
    return {
        "params": params,
        "bytes": per_client,
        "times": times,
        "survivors": len(server.survivors),
    }


def report(clients: int, neighbours: int, result: dict[str, Any]) -> None:
    params = result["params"]
    shape = f"k = {neighbours}" if neighbours else "complete graph"
    kind = "small" if params.modular else "exact"
    central = central_noise_multiplier(params, params.threshold)
    print(
        f"\nn = {clients}, {shape}, {params.bits}-bit {kind} ring, threshold "
        f"{params.threshold}, {result['survivors']} survivors; sigma = {params.sigma:.4g} "
        f"carries a central noise multiplier of {central:.3f} at the threshold"
    )
    print(
        f"{'stage':>24} {'down B/client':>14} {'up B/client':>12} {'clients s':>10} {'server s':>9}"
    )
    for stage in STAGES:
        down, up = result["bytes"][stage]
        c, s = result["times"][stage]
        print(f"{stage:>24} {down:>14,.0f} {up:>12,.0f} {c:>10.2f} {s:>9.2f}")
    masked = result["bytes"][COLLECT][1]
    keys_up = sum(up for s, (_, up) in result["bytes"].items() if s != COLLECT)
    keys_down = sum(down for _, (down, _) in result["bytes"].items())
    wall = sum(c + s for c, s in result["times"].values())
    print(
        f"key and share traffic per client: {keys_up:,.0f} B up, {keys_down:,.0f} B down; "
        f"masked payload {masked:,.0f} B up ({keys_up / masked:.2f}x up, "
        f"{(keys_up + keys_down) / masked:.2f}x both ways); round {wall:.1f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--kept", type=int, default=3829)
    parser.add_argument("--colluders", type=float, default=0.05, help="share of clients")
    parser.add_argument("--dropouts", type=float, default=0.05, help="share of clients")
    parser.add_argument("--neighbours", type=int, default=0, help="0: sparse_degree's k")
    parser.add_argument("--complete-up-to", type=int, default=100)
    parser.add_argument("--ring-bits", type=int, default=0, help="a small ring's b; 0: exact")
    args = parser.parse_args()
    torch.set_num_threads(1)
    bits = args.ring_bits
    for n in args.clients:
        colluders, dropouts = int(args.colluders * n), int(args.dropouts * n)
        found = sparse_degree(n, colluders, dropouts)
        degree = args.neighbours or (found[0] if found else 0)
        print(
            f"\nn = {n}: {colluders} colluders, {dropouts} lost after key sharing; "
            f"sparse_degree: {found}"
        )
        if degree:
            report(n, degree, one_round(n, degree, args.kept, colluders, dropouts, bits))
        if n <= args.complete_up_to:
            report(n, 0, one_round(n, 0, args.kept, colluders, dropouts, bits))


if __name__ == "__main__":
    main()
