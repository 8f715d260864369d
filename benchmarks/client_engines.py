"""Benchmark: a federated client's ``train`` call on each DP engine.

Node 0's steady-state call (``benchmarks/client_round.py``'s ``node_before``: the real
ClientApp with the simulation node policy, round ``--round`` after the earlier ones, fixed σ,
the process's model reused) with ``engine`` = ``opacus``, ``func`` and ``factored``, each call
on a fresh copy of its Context and message, interleaved in a rotated order. Prints each
engine's median time and its ratio to Opacus's with a 95% bootstrap interval of the median of
the paired ratios (two engines' times within one pass).

The engines draw the same batches, mask and noise; their updates agree to float rounding,
not bit for bit (``tests/common/dp/test_factored_dp.py``), so this checks the payload sizes and
that the decoded updates agree within 1e-4 of their largest value.

Usage: python benchmarks/client_engines.py [--nodes 1000] [--rate 0.7] [--reps 200]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]

from client_round import client_app, node_before  # noqa: E402

from fedsparse.common.config import FederatedConfig  # noqa: E402
from fedsparse.common.wire.payload import decode_update  # noqa: E402
from fedsparse.common.wire.protocol import CONFIG_RECORD  # noqa: E402
from fedsparse.lab.experiments.stats import ratio_interval  # noqa: E402

warnings.filterwarnings("ignore")

ENGINES = ("opacus", "func", "factored")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, default=1000, help="partitions (sets n per node)")
    parser.add_argument("--rate", type=float, default=0.7, help="final-rate")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--round", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    nodes = {}
    for engine in ENGINES:
        cfg = FederatedConfig(
            num_rounds=max(10, args.round),
            final_rate=args.rate,
            target_epsilon=0.0,
            noise_multiplier=1.0,
            engine=engine,  # type: ignore[arg-type]
        )
        nodes[engine] = node_before(cfg, args.nodes, args.round)
    updates: dict[str, bytes] = {}

    def call(engine: str) -> float:
        context, msg = nodes[engine]
        ctx, message = copy.deepcopy(context), copy.deepcopy(msg)
        start = time.perf_counter()
        reply = client_app(message, ctx)
        elapsed = time.perf_counter() - start
        assert not reply.has_error(), reply.error.reason
        update = bytes(reply.content.config_records[CONFIG_RECORD]["update"])
        assert updates.setdefault(engine, update) == update  # seeded: the same every call
        return elapsed

    for engine in ENGINES * 5:  # warm-up: imports, the data and accountant memos
        call(engine)
    values = {e: decode_update(u).values for e, u in updates.items()}
    scale = float(values["opacus"].abs().max())
    for engine in ENGINES:
        assert len(updates[engine]) == len(updates["opacus"])
        torch.testing.assert_close(values[engine], values["opacus"], rtol=0, atol=1e-4 * scale)
    times: dict[str, list[float]] = {e: [] for e in ENGINES}
    for rep in range(args.reps):
        shift = rep % len(ENGINES)
        for engine in ENGINES[shift:] + ENGINES[:shift]:
            times[engine].append(call(engine))
    print(
        f"digits CNN, node 0 of {args.nodes} iid partitions, round {args.round}, r={args.rate:g}, "
        f"fixed σ, 1 thread, torch {torch.__version__}, {args.reps} interleaved passes"
    )
    for engine in ENGINES:
        ratio, low, high = ratio_interval(times[engine], times["opacus"])
        print(
            f"{engine:<9} {1e3 * statistics.median(times[engine]):7.2f} ms per call; "
            f"/ opacus {ratio:.3f} [{low:.3f}, {high:.3f}]"
        )


if __name__ == "__main__":
    main()
