"""Benchmark: a client ``train`` call with the process's model reused against one that builds it.

A worker serving many virtual clients (``--backend ray``, Flower's simulation actors, the
in-process grid) reuses one model per architecture across its ``train`` calls
(``client/model_cache.py``'s ``process_model``: the round's weights loaded, Opacus's hooks and the
gradients taken off again after each call). This times node 0's steady-state call
(``benchmarks/client_round.py``'s ``node_before``) both ways, interleaved in a rotated order,
and prints each median and the ratio reused / rebuilt with a 95% bootstrap interval of the
median of the paired ratios.

Usage: python benchmarks/process_model.py [--nodes 1000] [--rate 0.7] [--reps 300]
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

from fedsparse.client import model_cache  # noqa: E402
from fedsparse.common.config import FederatedConfig  # noqa: E402
from fedsparse.common.wire.protocol import CONFIG_RECORD  # noqa: E402
from fedsparse.lab.experiments.stats import ratio_interval  # noqa: E402

warnings.filterwarnings("ignore")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, default=1000, help="partitions (sets n per node)")
    parser.add_argument("--rate", type=float, default=0.7, help="final-rate")
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--round", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = FederatedConfig(
        num_rounds=max(10, args.round),
        final_rate=args.rate,
        target_epsilon=0.0,
        noise_multiplier=1.0,
    )
    context, msg = node_before(cfg, args.nodes, args.round)
    updates: dict[str, bytes] = {}

    def call(name: str) -> float:
        if name == "rebuilt":
            model_cache.process_model.cache_clear()
        ctx, message = copy.deepcopy(context), copy.deepcopy(msg)
        start = time.perf_counter()
        reply = client_app(message, ctx)
        elapsed = time.perf_counter() - start
        assert not reply.has_error(), reply.error.reason
        update = bytes(reply.content.config_records[CONFIG_RECORD]["update"])
        assert updates.setdefault(name, update) == update  # seeded: the same bytes every call
        return elapsed

    names = ["rebuilt", "reused"]
    for name in names * 5:  # warm-up: imports, the data and accountant memos
        call(name)
    assert updates["rebuilt"] == updates["reused"]
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(args.reps):
        for name in names if rep % 2 else names[::-1]:
            times[name].append(call(name))
    ratio, low, high = ratio_interval(times["reused"], times["rebuilt"])
    print(
        f"digits CNN, node 0 of {args.nodes} iid partitions, round {args.round}, r={args.rate:g}, "
        f"fixed σ, 1 thread, torch {torch.__version__}, {args.reps} interleaved pairs"
    )
    print(
        f"rebuilt {1e3 * statistics.median(times['rebuilt']):.2f} ms, reused "
        f"{1e3 * statistics.median(times['reused']):.2f} ms per call; reused / rebuilt "
        f"{ratio:.3f} [{low:.3f}, {high:.3f}]; update bytes equal"
    )


if __name__ == "__main__":
    main()
