"""Benchmark: one client's ``train`` call on digits, with the accounting memos on and off.

The real ClientApp (``client.app.app``) is called as ``InProcessGrid`` calls it, with the
node's ``Context`` (the simulation node policy: seeded noise, no ledger) and a ``train``
message for round ``--round``: the node has trained rounds 1 to ``round - 1`` before (its
``Context.state`` carries the model and the accountant history), so the call does what a
steady-state round does (calibrate σ for the run, charge the round, one epoch of DP-SGD + RS,
ε of the history, encode). Configurations, interleaved round-robin so machine noise hits
all alike, each call on a fresh copy of the same Context and message:

* ``memo off``: ``privacy.accounting_cache(enabled=False)``: every σ and ε afresh (the code
  before the memos: the plain Opacus calls);
* ``memo cold``: memos on but emptied before the call (a node's first round in a process);
* ``memo on``: memos on and kept (every later round; here warmed by the earlier rounds).

Prints the median time of each and the ratio of each to ``memo off``, each ratio with a 95%
bootstrap interval of the median over the paired repetitions (the ratio of two
configurations' times within one round-robin pass). Also checks that the three replies
carry the same update bytes, ε and σ.

Usage: python benchmarks/client_round.py [--reps 15] [--round 5] [--nodes 10]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
import warnings
from collections.abc import Iterator

import torch
from flwr.app import Context, Message

from fedsparse.client.app import app as client_app
from fedsparse.client.data import local_data
from fedsparse.common.config import FederatedConfig
from fedsparse.common.dp import accounting as privacy
from fedsparse.common.layout import ParamLayout
from fedsparse.common.masks import keep_count
from fedsparse.common.models.classifiers import build_model
from fedsparse.common.wire.payload import encode_update
from fedsparse.common.wire.protocol import (
    CONFIG_RECORD,
    METRICS_RECORD,
    TrainInstruction,
    round_seed,
)
from fedsparse.lab.experiments.stats import ratio_interval
from fedsparse.lab.simulation.inprocess import InProcessGrid
from fedsparse.server.messages import train_message

warnings.filterwarnings("ignore")

CONFIGS = ("memo off", "memo cold", "memo on")


def train_instruction(cfg: FederatedConfig, weights: torch.Tensor, rnd: int) -> TrainInstruction:
    """Round ``rnd`` with the dense global model (accepted at any round)."""
    d = weights.numel()
    rate = cfg.sparsity().rate_schedule(cfg.num_rounds).rate(rnd - 1)
    return TrainInstruction(
        server_round=rnd,
        num_rounds=cfg.num_rounds,
        mask_seed=round_seed(cfg.seed, rnd),
        keep=keep_count(d, rate=rate),
        mask_scope="round",
        local_epochs=cfg.local_epochs,
        batch_size=cfg.batch_size,
        lr=cfg.lr,
        momentum=0.0,
        base_version=-1,
        model_version=rnd - 1,
        model=encode_update(weights, dense_size=d, round=rnd),
    )


def node_before(cfg: FederatedConfig, nodes: int, rnd: int) -> tuple[Context, Message]:
    """Node 0's Context after rounds 1 .. rnd - 1, and round ``rnd``'s message to it."""
    grid = InProcessGrid(client_app, num_nodes=nodes, run_config=cfg.to_run_config())
    node = next(iter(grid.get_node_ids()))
    model = build_model(cfg.model_name, seed=cfg.seed)
    weights = ParamLayout.from_module(model).flatten_module(model)
    for r in range(1, rnd):
        (reply,) = grid.send_and_receive(
            [train_message(train_instruction(cfg, weights, r), node=node)]
        )
        assert not reply.has_error(), reply.error.reason
    msg = train_message(train_instruction(cfg, weights, rnd), node=node)
    grid.push_messages([msg])  # stamps the ids a delivered message carries
    return grid._contexts[node], msg


@contextlib.contextmanager
def configured(name: str) -> Iterator[None]:
    if name == "memo cold":
        privacy.clear_accounting_caches()
    with privacy.accounting_cache(enabled=name != "memo off"):
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--round", type=int, default=5, help="the timed round (>= 1)")
    parser.add_argument("--nodes", type=int, default=10, help="partitions (sets q)")
    parser.add_argument("--rounds", type=int, default=10, help="num-rounds of the run")
    args = parser.parse_args()
    cfg = FederatedConfig(num_rounds=args.rounds, final_rate=0.7, target_epsilon=3.0)
    context, msg = node_before(cfg, args.nodes, args.round)
    n = len(local_data(cfg, 0, args.nodes))
    q = privacy.sample_rate(n, cfg.batch_size)

    samples: dict[str, list[float]] = {c: [] for c in CONFIGS}
    replies: dict[str, tuple] = {}
    for _ in range(args.reps):
        for name in CONFIGS:
            ctx, message = copy.deepcopy(context), copy.deepcopy(msg)
            with configured(name):
                start = time.perf_counter()
                reply = client_app(message, ctx)
                samples[name].append(time.perf_counter() - start)
            assert not reply.has_error(), reply.error.reason
            conf = reply.content.config_records[CONFIG_RECORD]
            metrics = reply.content.metric_records[METRICS_RECORD]
            replies[name] = (bytes(conf["update"]), *sorted(metrics.items()))
    assert replies["memo off"] == replies["memo cold"] == replies["memo on"], "replies differ"

    print(
        f"digits, {args.nodes} partitions (n = {n}, q = {q:.4g}), round {args.round} of "
        f"{args.rounds}, local-epochs {cfg.local_epochs}, target ε {cfg.target_epsilon}, "
        f"accountant {cfg.accountant}, torch {torch.__version__}, median of {args.reps} reps"
    )
    print("replies: same update bytes, ε, σ and metrics in all configurations")
    off = samples["memo off"]
    print(f"{'config':<10} {'s/call':>8} {'time / memo off [95% CI]':>28} {'speed-up':>9}")
    for name, times in samples.items():
        r, lo, hi = ratio_interval(times, off)
        print(
            f"{name:<10} {statistics.median(times):>8.4f} "
            f"{r:>12.4f} [{lo:.4f}, {hi:.4f}] {1 / r:>8.1f}x"
        )


if __name__ == "__main__":
    main()
