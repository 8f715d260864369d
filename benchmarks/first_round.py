"""Benchmark: time to the first round, for each way of running a federation (3 clients).

What a newcomer waits for before anything happens. Configurations, each a fresh process
started from here (so imports count), 3 clients, ``--rounds`` rounds, the embedded digits:

* ``inprocess``: the Python API (``InProcessGrid`` + ``run_federated``: the real ClientApp and
  ServerApp loop in one process, no SuperLink, no Ray), as the README's example runs it;
* ``flower``: ``fedsparse simulate --backend flower`` (a simulation SuperLink, ``flwr run``,
  Flower's Ray-based simulation engine);
* ``ray``: ``fedsparse simulate --backend ray`` (fedsparse's own Ray population grid).

Per run: **to round 1**, process start to round 1's ``started_at`` in ``rounds.jsonl`` (imports,
data, the backend's start-up); **round 1 done**, to its ``ended_at``; and the whole run. Also
``fedsparse --help`` (median of 5), the first contact. The configurations are interleaved,
repetition by repetition, and the tables give medians; ``flower`` and ``ray`` against
``inprocess`` with 95% bootstrap intervals over the paired repetitions
(``lab/experiments/stats.py``).
The goal (issue "The first hour"): <= 5 s to round 1 on this machine on a fast path.

Usage: python benchmarks/first_round.py [--reps 3] [--rounds 2] [--configs inprocess flower ray]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fedsparse.lab.experiments.stats import ratio_interval

CONFIGS = ("inprocess", "flower", "ray")

INPROCESS = """
import sys
from fedsparse.client.app import app as client_app
from fedsparse.common.config import FederatedConfig
from fedsparse.client.node_policy import SIMULATION_NODE_POLICY
from fedsparse.lab.simulation.inprocess import InProcessGrid
from fedsparse.server.app import run_federated

cfg = FederatedConfig(num_rounds=int(sys.argv[2]), out_dir=sys.argv[1])
grid = InProcessGrid(client_app, num_nodes=3, run_config=cfg.to_run_config(),
                     node_config=SIMULATION_NODE_POLICY)
run_federated(grid, cfg)
"""


def command(config: str, out: Path, rounds: int) -> list[str]:
    if config == "inprocess":
        return [sys.executable, "-c", INPROCESS, str(out), str(rounds)]
    fedsparse = str(Path(sys.executable).with_name("fedsparse"))
    return [
        fedsparse,
        "simulate",
        "--out",
        str(out),
        "--clients",
        "3",
        "--rounds",
        str(rounds),
        "--backend",
        config,
    ]


def one_run(config: str, rounds: int) -> dict[str, float]:
    """One run's times in seconds from its process start."""
    folder = Path(tempfile.mkdtemp(prefix=f"first-round-{config}-"))
    out = folder / "run"
    try:
        start = time.time()
        subprocess.run(
            command(config, out, rounds),
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=900,
        )
        total = time.time() - start
        first = json.loads((out / "rounds.jsonl").read_text().splitlines()[0])
        return {
            "to round 1": first["started_at"] - start,
            "round 1 done": first["ended_at"] - start,
            "whole run": total,
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def help_seconds(reps: int = 5) -> float:
    fedsparse = str(Path(sys.executable).with_name("fedsparse"))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        subprocess.run([fedsparse, "--help"], check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    args = parser.parse_args()
    samples: dict[str, list[dict[str, float]]] = {c: [] for c in args.configs}
    for rep in range(args.reps):
        order = args.configs[rep % len(args.configs) :] + args.configs[: rep % len(args.configs)]
        for config in order:
            samples[config].append(one_run(config, args.rounds))
    print(f"fedsparse --help: {help_seconds():.2f} s (median of 5)")
    print(
        f"3 clients, {args.rounds} rounds, digits; median of {args.reps} runs (seconds from "
        "process start)"
    )
    fields = ("to round 1", "round 1 done", "whole run")
    print(f"{'config':<10} " + " ".join(f"{f:>13}" for f in fields))
    for config, runs in samples.items():
        medians = [statistics.median(r[f] for r in runs) for f in fields]
        print(f"{config:<10} " + " ".join(f"{m:>13.2f}" for m in medians))
    if "inprocess" in samples:
        base = [r["to round 1"] for r in samples["inprocess"]]
        for config in samples:
            if config == "inprocess":
                continue
            mine = [r["to round 1"] for r in samples[config]]
            r, lo, hi = ratio_interval(mine, base)
            print(f"to round 1, {config} / inprocess: {r:.2f} [{lo:.2f}, {hi:.2f}]")


if __name__ == "__main__":
    main()
