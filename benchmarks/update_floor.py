"""Benchmark: what every update of a round costs however it was trained (issue "A population
engine"), at the peer benchmark's model.

The population backend trains a round's clients together, but each client's update still goes
through the same per-update steps as in a deployment, one update at a time:

* ``encode``: the client's payload from its values (``encode_update``, dense fp32 here);
* ``decode``: the server's parse and checks of the untrusted payload (``decode_update``: the
  protobuf parse, canonical re-encoding, the values' byte count and finiteness);
* ``norm``: the update's L2 norm for the norm bound (``l2_norm``, in float64);
* ``add``: the weighted sum (``SparseAggregator.add``: exact, so the model does not depend
  on arrival order or node ids; it replaced a SHA-256 content key the updates were sorted by
  before a float64 sum, 89-90 + 34-47 us of the floor then).

The updates are ``--clients`` distinct random vectors of ``d`` = 38,282 (``digits-cnn``), held
at once as a round holds them (so memory traffic is a round's, not one cached vector's). Each
step is timed over all of them, one thread, ``--repeats`` times; printed: the median per update
of each step, their sum, and that sum for a round of ``--clients`` updates. With ``--steady S``
(a steady round measured by ``benchmarks/peer_pfl.py`` on the same machine, same day) it also
prints the steps' share of it: the part of a round no vectorisation of the training removes.

Usage: python benchmarks/update_floor.py [--clients 1000] [--repeats 5] [--steady 1.1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from fedsparse.common.aggregation.robust import l2_norm
from fedsparse.common.aggregation.sparse import make_aggregator
from fedsparse.common.layout import ParamLayout
from fedsparse.common.models.classifiers import build_model
from fedsparse.common.wire.payload import decode_update, encode_update

STEPS = ("encode", "decode", "norm", "add")


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def one_pass(values: list[torch.Tensor], d: int) -> dict[str, float]:
    """Seconds of each step over every update, in a round's order."""
    out: dict[str, float] = {}
    payloads: list[bytes] = []
    decoded: list[torch.Tensor] = []
    out["encode"] = _timed(
        lambda: payloads.extend(encode_update(v, dense_size=d, round=1) for v in values)
    )
    out["decode"] = _timed(
        lambda: decoded.extend(
            decode_update(p, expected_dense_size=d, expected_round=1).values for p in payloads
        )
    )
    out["norm"] = _timed(lambda: [l2_norm(v) for v in decoded])
    aggregator = make_aggregator("mean", d, trim_fraction=0.0)
    out["add"] = _timed(lambda: [aggregator.add(v, support=None, weight=1.0) for v in decoded])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steady", type=float, default=None, help="a measured steady round, s")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the server and a client's reply take one thread
    d = ParamLayout.from_module(build_model("digits-cnn", seed=0)).numel
    generator = torch.Generator().manual_seed(0)
    values = [torch.randn(d, generator=generator) for _ in range(args.clients)]
    runs = [one_pass(values, d) for _ in range(args.repeats)]
    print(f"digits-cnn (d = {d:,}), {args.clients} dense fp32 updates, {args.repeats} repeats")
    medians = {step: statistics.median(r[step] for r in runs) for step in STEPS}
    for step in STEPS:
        print(f"{step:>10}  {medians[step] / args.clients * 1e6:7.1f} us per update")
    total = statistics.median(sum(r.values()) for r in runs)
    print(f"{'sum':>10}  {total / args.clients * 1e6:7.1f} us per update (median of sums)")
    print(f"a round of {args.clients} updates: {total:.3f} s in these steps alone")
    if args.steady is not None:
        print(f"share of a {args.steady:.3f} s steady round: {total / args.steady:.0%}")


if __name__ == "__main__":
    main()
