"""Benchmark: the value codecs' share of a client's ``train`` call, at N = 100.

Node 0 of ``--nodes`` (default 100) digits clients, round ``--round`` of a run at target
epsilon 3, sparse from round 1 (``schedule=constant``, ``final-rate`` 0.9: the bandwidth
frontier's setting), is called as ``InProcessGrid`` calls it (``client_round.node_before``).
For each value dtype, interleaved round-robin, each repetition times:

* the whole ``train`` call (DP-SGD + RS, accounting, encoding), on a fresh copy of the same
  Context and message;
* encoding the reply's own update values again (``encode_update`` with the call's settings
  and a fresh rounding generator) and decoding the payload (``decode_update`` and the values
  to float32), as client and server do.

Prints per dtype the median call and codec times and the ratio codec / call: the median of the
per-repetition ratios with a 95% bootstrap interval (the target: at most 5%).

Usage: python benchmarks/codec_share.py [--reps 21] [--nodes 100] [--round 3]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import numpy as np
from client_round import node_before

from fedsparse.client.app import app as client_app
from fedsparse.common.config import FederatedConfig
from fedsparse.common.wire.payload import decode_update, encode_update
from fedsparse.common.wire.protocol import CONFIG_RECORD, METRICS_RECORD, TrainReply
from fedsparse.common.wire.value_formats import wire_encoding
from fedsparse.lab.experiments.stats import ratio_interval

warnings.filterwarnings("ignore")

DTYPES = ("fp32", "int8", "int4", "int2", "int1")


def _codec_seconds(payload: bytes, cfg: FederatedConfig, seed: int) -> float:
    """Decodes ``payload``, then times encoding its values again and decoding the result."""
    update = decode_update(payload)
    values = update.values
    start = time.perf_counter()
    again = encode_update(
        values,
        dense_size=update.dense_size,
        round=update.round,
        mask_seed=update.mask_seed or None,
        encoding=wire_encoding(cfg.codec, sparse=update.mask_seed != 0),
        value_dtype=cfg.value_dtype,
        value_block=cfg.value_block,
        rounding=np.random.default_rng(seed),
        compression=cfg.compression,
    )
    decode_update(again)  # values come out as float32 (dequantized)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--round", type=int, default=3, help="the timed round (>= 1)")
    args = parser.parse_args()
    setups = {}
    for dtype in DTYPES:
        cfg = FederatedConfig(
            num_rounds=10,
            final_rate=0.9,
            schedule="constant",
            target_epsilon=3.0,
            value_dtype=dtype,
        )
        setups[dtype] = (cfg, *node_before(cfg, args.nodes, args.round))
    calls: dict[str, list[float]] = {d: [] for d in DTYPES}
    codecs: dict[str, list[float]] = {d: [] for d in DTYPES}
    for rep in range(args.reps):
        for dtype, (cfg, context, msg) in setups.items():
            ctx, message = copy.deepcopy(context), copy.deepcopy(msg)
            start = time.perf_counter()
            reply = client_app(message, ctx)
            calls[dtype].append(time.perf_counter() - start)
            assert not reply.has_error(), reply.error.reason
            content = reply.content
            payload = TrainReply.from_records(
                content.config_records[CONFIG_RECORD], content.metric_records[METRICS_RECORD]
            ).update
            codecs[dtype].append(_codec_seconds(payload, cfg, seed=rep))
    print(
        f"digits, node 0 of {args.nodes}, round {args.round}, constant r = 0.9, target eps 3, "
        f"{args.reps} interleaved repetitions"
    )
    print(f"{'dtype':>6} {'call ms':>8} {'codec ms':>9} {'codec / call [95% CI]':>28}")
    for dtype in DTYPES:
        ratio, low, high = ratio_interval(codecs[dtype], calls[dtype])
        print(
            f"{dtype:>6} {1e3 * statistics.median(calls[dtype]):>8.2f} "
            f"{1e3 * statistics.median(codecs[dtype]):>9.3f} "
            f"{100 * ratio:>12.2f}% [{100 * low:.2f}, {100 * high:.2f}]"
        )


if __name__ == "__main__":
    main()
