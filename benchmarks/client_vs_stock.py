"""Benchmark: one fedsparse client ``train`` call against one stock Flower + Opacus client call.

Both ClientApps are called in process on the same work: node 0 of ``--nodes`` iid digits
partitions, round ``--round``, one local epoch of DP-SGD at the same batch size, clipping
norm and fixed noise multiplier (no σ calibration on either side), the digits CNN. fedsparse's
call is the simulation node's steady-state round (``benchmarks/client_round.py``'s
``node_before``: its ``Context.state`` holds the model and accountant history of the earlier
rounds) at ``final-rate`` r for each ``--rates`` value; the stock call is
``benchmarks/stock_flower``'s ClientApp (a dense ``state_dict`` in and out, Opacus's
``make_private``, ``get_epsilon`` after the round). Each call gets fresh copies of its
Context and message. Configurations are interleaved round-robin, in a rotated order each
repetition, so machine noise hits all alike.

Prints each configuration's median time per call and its ratio to stock, with a 95% bootstrap
interval of the median of the paired ratios. r = 0 isolates the framework (records, node
state, payload encoding, the ledger checks); r > 0 adds random sparsification's own per-call
work (splitting the mask per parameter, gathering the kept per-sample gradient columns).

Usage: python benchmarks/client_vs_stock.py [--nodes 100] [--rates 0 0.7] [--reps 60]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "stock_flower")]

from client_round import client_app, node_before  # noqa: E402
from stock_opacus.client_app import app as stock_app  # noqa: E402
from stock_opacus.task import StockConfig, build_net  # noqa: E402

from fedsparse.common.config import FederatedConfig  # noqa: E402
from fedsparse.lab.experiments.stats import ratio_interval  # noqa: E402

warnings.filterwarnings("ignore")


def fedsparse_call(nodes: int, rnd: int, rate: float, sigma: float) -> Callable[[], float]:
    """One timed fedsparse ``train`` call (fresh copies of node 0's Context and message)."""
    cfg = FederatedConfig(
        num_rounds=max(10, rnd), final_rate=rate, target_epsilon=0.0, noise_multiplier=sigma
    )
    context, msg = node_before(cfg, nodes, rnd)

    def call() -> float:
        ctx, message = copy.deepcopy(context), copy.deepcopy(msg)
        start = time.perf_counter()
        reply = client_app(message, ctx)
        elapsed = time.perf_counter() - start
        assert not reply.has_error(), reply.error.reason
        return elapsed

    return call


def stock_call(nodes: int, rnd: int, sigma: float) -> Callable[[], float]:
    """One timed stock ``train`` call: node 0 of ``nodes``, the dense model in and out."""
    cfg = StockConfig(noise_multiplier=sigma)
    context = Context(
        run_id=1,
        node_id=1,
        node_config={"partition-id": 0, "num-partitions": nodes},
        state=RecordDict(),
        run_config=cfg.to_run_config(),
    )
    content = RecordDict(
        {
            "arrays": ArrayRecord(build_net(cfg).state_dict()),
            "config": ConfigRecord({"server-round": rnd}),
        }
    )
    msg = Message(content=content, dst_node_id=1, message_type="train")

    def call() -> float:
        ctx, message = copy.deepcopy(context), copy.deepcopy(msg)
        start = time.perf_counter()
        reply = stock_app(message, ctx)
        elapsed = time.perf_counter() - start
        assert not reply.has_error(), reply.error.reason
        return elapsed

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, default=100, help="partitions (sets q and n)")
    parser.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument("--round", type=int, default=5)
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ours = {
        f"fedsparse r={rate:g}": fedsparse_call(args.nodes, args.round, rate, args.noise_multiplier)
        for rate in args.rates
    }
    # after the in-process grid of ``node_before`` set Flower's task identity (``Message``)
    calls = {"stock": stock_call(args.nodes, args.round, args.noise_multiplier), **ours}
    names = list(calls)
    for name in names:  # warm-up: imports, the data and accountant memos
        for _ in range(5):
            calls[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(args.reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(calls[name]())
    print(
        f"digits CNN, node 0 of {args.nodes} iid partitions, round {args.round}, fixed σ "
        f"{args.noise_multiplier:g}, 1 thread, torch {torch.__version__}, {args.reps} "
        "interleaved repetitions"
    )
    print(f"{'config':<16} {'ms/call':>8} {'/ stock [95% CI]':>26}")
    for name in names:
        ratio, low, high = ratio_interval(times[name], times["stock"])
        print(
            f"{name:<16} {1e3 * statistics.median(times[name]):>8.2f} "
            f"{ratio:>10.3f} [{low:.3f}, {high:.3f}]"
        )


if __name__ == "__main__":
    main()
