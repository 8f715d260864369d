"""Benchmark: the server's cost per node of a round, with the downlink cache and without it.

Times ``SparseFedAvg.configure_train`` + ``aggregate_train`` for N simulated nodes with
synthetic valid replies (built as ``client/app.py`` builds them, with random values instead of
training; built outside the timed region), over ``--rounds`` rounds of a fresh run: round 1
sends the dense model to every node; later rounds send a seeded sparse patch to nodes one
version behind, a union to nodes further behind and the dense model to fresh ones
(``--clients`` of the N nodes are sampled each round, so the states mix).

Two paths, interleaved (the order alternates between repeats, each repeat a fresh run):

* ``old``: ``message_bytes`` serializes (and hashes) every message (``serialized_bytes``),
  the downlink encodes per node (``DownlinkCache.payload``: a dense encoding and the seeded
  mask regenerated for each node) and ``check_reply`` samples the round's mask per reply;
* ``new``: byte counts from the parts (``framed_bytes``); one encoding per base a round; the
  round's mask sampled once for all replies (``mask_support``).

Prints per N the median server time per node per round of each path and the median old/new
ratio with its range over the repeats (with 5 paired repeats, [min, max] covers the median
ratio with probability 1 - 2/2**5 = 94%). Both paths must send and count the same bytes: the
benchmark checks the round's byte counts and the final model agree.

Usage: python benchmarks/server_round.py [--nodes 100 1000] [--repeats 5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedsparse.common.config import FederatedConfig
from fedsparse.common.models.classifiers import DEFAULT_MODELS, build_model, count_parameters
from fedsparse.common.wire.payload import encode_update
from fedsparse.common.wire.protocol import (
    CONFIG_RECORD,
    METRICS_RECORD,
    TrainInstruction,
    TrainReply,
    client_mask_seed,
)
from fedsparse.common.wire.value_formats import wire_encoding
from fedsparse.lab.simulation.inprocess import InProcessGrid
from fedsparse.server import strategy as strategy_module
from fedsparse.server.downlink import DownlinkCache
from fedsparse.server.messages import serialized_bytes
from fedsparse.server.strategy import SparseFedAvg, flat_array, flat_tensor
from fedsparse.server.validation import check_reply


def synthetic_client(cfg: FederatedConfig, d: int):  # type: ignore[no-untyped-def]
    """A ClientApp stand-in: the reply ``client/app.py`` builds, with random values."""

    def handler(msg: Message, context: Context) -> Message:
        task = TrainInstruction.from_record(msg.content.config_records[CONFIG_RECORD])
        sparse = task.keep < d
        seed = task.mask_seed
        if task.mask_scope == "client":
            seed = client_mask_seed(seed, context.node_id)
        gen = torch.Generator().manual_seed(task.server_round * 1_000_003 + context.node_id)
        update = encode_update(
            torch.randn(task.keep, generator=gen) * 0.01,
            dense_size=d,
            round=task.server_round,
            encoding=wire_encoding(cfg.codec, sparse=sparse),
            value_dtype=cfg.value_dtype,
            value_block=cfg.value_block,
            rounding=np.random.default_rng(task.server_round * 1_000_003 + context.node_id),
            compression=cfg.compression,
            **({"mask_seed": seed} if sparse else {}),
        )
        reply = TrainReply(
            update=update,
            num_examples=1,
            examples_seen=0,
            train_loss=0.5,
            epsilon=2.0,
            noise_multiplier=1.1,
            keep=task.keep,
            seeded_noise=1,
        )
        config, metrics = reply.to_records()
        content = RecordDict(
            {CONFIG_RECORD: ConfigRecord(config), METRICS_RECORD: MetricRecord(metrics)}
        )
        return Message(content=content, reply_to=msg)

    return handler


@contextlib.contextmanager
def old_path(strategy: SparseFedAvg) -> Iterator[None]:
    """The path without the downlink cache: serialize to count, encode the downlink per node."""
    cache: DownlinkCache = strategy.downlink

    def per_node(nodes, weights, *, version, server_round):  # type: ignore[no-untyped-def]
        return {
            n: cache.payload(n, weights, version=version, server_round=server_round) for n in nodes
        }

    def check_sampling(*args, mask_support=None, **kwargs):  # type: ignore[no-untyped-def]
        return check_reply(*args, **kwargs)  # the mask sampled per reply

    counted = strategy_module.message_bytes
    strategy_module.message_bytes = serialized_bytes  # type: ignore[assignment]
    strategy_module.check_reply = check_sampling  # type: ignore[assignment]
    cache.payloads = per_node  # type: ignore[method-assign]
    try:
        yield
    finally:
        strategy_module.message_bytes = counted
        strategy_module.check_reply = check_reply


def run(cfg: FederatedConfig, d: int, nodes: int, *, old: bool) -> tuple[float, list[Any]]:
    """(server seconds over the run, [per-round byte counts and the final model])."""
    grid = InProcessGrid(synthetic_client(cfg, d), num_nodes=nodes, run_config={})
    strategy = SparseFedAvg(cfg, num_parameters=d)
    arrays = flat_array(torch.randn(d, generator=torch.Generator().manual_seed(0)) * 0.1)
    seconds, record = 0.0, []
    with old_path(strategy) if old else contextlib.nullcontext():
        for server_round in range(1, cfg.num_rounds + 1):
            start = time.perf_counter()
            messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid))
            seconds += time.perf_counter() - start
            replies = list(grid.send_and_receive(messages))
            start = time.perf_counter()
            new, _ = strategy.aggregate_train(server_round, replies)
            seconds += time.perf_counter() - start
            assert new is not None and strategy.last_round is not None
            stats = strategy.last_round
            record.append((stats.downlink_message_bytes, stats.uplink_message_bytes))
            arrays = new
    return seconds, [*record, flat_tensor(arrays)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="digits-cnn", choices=sorted(DEFAULT_MODELS.values()))
    parser.add_argument("--codec", default="values")
    args = parser.parse_args()
    torch.set_num_threads(1)
    d = count_parameters(build_model(args.model, seed=0))
    print(f"model {args.model}: d = {d:,}; {args.rounds} rounds; codec {args.codec}")
    print(
        f"{'N':>6} {'old ms/node':>12} {'new ms/node':>12} {'old/new median':>15} "
        f"{'[min, max]':>16}"
    )
    for nodes in args.nodes:
        cfg = FederatedConfig(
            num_rounds=args.rounds,
            final_rate=0.7,
            clients_per_round=max(1, nodes * 4 // 5),
            dataset=next(ds for ds, m in DEFAULT_MODELS.items() if m == args.model),
            model=args.model,
            codec=args.codec,
            seed=3,
        )
        per_node: dict[bool, list[float]] = {False: [], True: []}
        ratios = []
        for repeat in range(args.repeats):
            order = (True, False) if repeat % 2 == 0 else (False, True)
            seconds, outputs = {}, {}
            for old in order:
                seconds[old], outputs[old] = run(cfg, d, nodes, old=old)
                sent = cfg.clients_per_round * cfg.num_rounds
                per_node[old].append(seconds[old] / sent)
            *counts_old, model_old = outputs[True]
            *counts_new, model_new = outputs[False]
            assert counts_old == counts_new and torch.equal(model_old, model_new)
            ratios.append(seconds[True] / seconds[False])
        print(
            f"{nodes:>6} {1e3 * statistics.median(per_node[True]):>12.3f} "
            f"{1e3 * statistics.median(per_node[False]):>12.3f} "
            f"{statistics.median(ratios):>15.2f} "
            f"{f'[{min(ratios):.2f}, {max(ratios):.2f}]':>16}",
            flush=True,
        )


if __name__ == "__main__":
    main()
