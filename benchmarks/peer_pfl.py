"""Benchmark: fedsparse against pfl-research 0.6 on the same work (issue "A population engine").

The work: FedAvg of the digits CNN (``digits-cnn``, 38,282 parameters) on the embedded digits,
N clients (fedsparse's IID partitions of the training split), every client every round, one
local epoch, batch 32, lr 0.25, no DP, the test split evaluated after every round. pfl runs in
a venv of its own (``benchmarks/peer/setup-pfl.sh``) on a data file this script writes from
fedsparse's own partitions, test split and initial weights, so both train the same model from
the same weights on the same examples; fedsparse runs on ``--backend population`` (or any
``--engines`` of ``benchmarks/ray_population.py``) with ``--config no-dp`` (``mechanism=noisy``,
σ = 0, every coordinate) or ``rs-0.9`` (DP-SGD with RS at r = 0.9, σ = 1, against pfl's
non-private round: pfl has no sample-level DP-SGD).

Runs alternate (pfl, fedsparse, pfl, ...), each in a fresh child process whose whole process
tree's peak RSS is sampled (``ray_population.TreeSampler``). Printed per run: round 1, the
median of the later rounds (steady), the whole run (process start to exit) and the peak RSS;
then the medians over repeats and the steady-round ratio pfl / fedsparse (> 1: fedsparse is
faster).

Settings that do not match, listed: fedsparse's no-DP step still runs its DP engine's
per-example path with σ = 0 and no clipping (``mechanism=noisy``), its batches are Poisson
(rate 1/ceil(n/32)) where pfl's are fixed batches of 32, and it encodes each update (fp32) and
validates it on the server; pfl uses one thread in one process, fedsparse's vectorised step
every CPU of its process. With N >= 45 every client holds at most 32 examples, so one batch is
the whole partition in both (full-batch local steps: the same computation). pfl's first round
also evaluates every user before and after training (its iteration 0 is always an evaluation
iteration); its later rounds do not, as fedsparse never does. The central evaluation on the
test split runs after every round in both.

Usage: python benchmarks/peer_pfl.py [--clients 100 1000] [--rounds 5] [--repeats 2]
           [--config no-dp|rs-0.9] [--engines population] [--pfl-python .venv-pfl/bin/python]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import ray_population  # noqa: E402 - the fedsparse side and the memory sampler

GIB = 2**30


def export(clients: int, path: Path) -> None:
    """Writes fedsparse's digits partitions for ``clients``, its test split and initial
    weights to ``path`` (an ``.npz`` pfl's side reads)."""
    from fedsparse.client.data import local_data
    from fedsparse.common.config import FederatedConfig
    from fedsparse.common.data.datasets import load_eval_splits
    from fedsparse.common.models.classifiers import build_model

    cfg = FederatedConfig(dataset="digits")
    arrays: dict[str, np.ndarray] = {"clients": np.array(clients)}
    for i in range(clients):
        part = local_data(cfg, i, clients)
        arrays[f"x{i}"], arrays[f"y{i}"] = part.x.numpy(), part.y.numpy()
    _, test = load_eval_splits(
        cfg.dataset,
        data_dir=None,
        seed=cfg.seed,
        eval_split=cfg.eval_split,
        split_seed=cfg.data_seed,
    )
    arrays["x_test"], arrays["y_test"] = test.x.numpy(), test.y.numpy()
    model = build_model(cfg.model_name, seed=cfg.seed)
    for name, value in model.state_dict().items():
        arrays[f"w:{name}"] = value.numpy()
    np.savez(path, **arrays)


def measure_pfl(python: str, data: Path, rounds: int) -> dict[str, Any]:
    """One pfl run in a child process, its tree's peak RSS sampled."""
    cmd = [python, str(HERE / "peer" / "pfl_fedavg.py"), "--data", str(data)]
    cmd += ["--rounds", str(rounds)]
    started = time.perf_counter()
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    sampler = ray_population.TreeSampler(process.pid)
    sampler.start()
    stdout, _ = process.communicate()
    sampler.stop()
    if process.returncode != 0:
        raise SystemExit(f"pfl: exit code {process.returncode}")
    result = json.loads(stdout.strip().splitlines()[-1])
    seconds = result["round_seconds"]
    return {
        "engine": "pfl",
        "round1_s": seconds[0],
        "steady_round_s": statistics.median(seconds[1:]),
        "final_accuracy": result["accuracy"][-1] if result["accuracy"] else float("nan"),
        "total_s": time.perf_counter() - started,
        "peak_rss_bytes": sampler.peak_rss,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--config", choices=["no-dp", "rs-0.9"], default="no-dp")
    parser.add_argument("--engines", nargs="+", default=["population"])
    parser.add_argument(
        "--max-norm-ratio",
        type=float,
        help="fedsparse's max-norm-ratio (default: the run config's, 3; pfl bounds no norm: 0 "
        "matches it, and the server then sums each update as it arrives)",
    )
    parser.add_argument("--pfl-python", default=str(HERE.parent / ".venv-pfl" / "bin" / "python"))
    args = parser.parse_args()
    side = argparse.Namespace(
        rounds=args.rounds,
        config=args.config,
        cpus_per_client=1.0,
        dataset="digits",
        clients_per_round=0,
        examples_per_client=0,
        max_norm_ratio=args.max_norm_ratio,
    )
    print(
        f"digits-cnn FedAvg, every client every round, 1 local epoch, batch 32, lr 0.25, "
        f"{args.rounds} rounds; fedsparse --config {args.config}"
        + ("" if args.max_norm_ratio is None else f", max-norm-ratio {args.max_norm_ratio:g}")
        + "; pfl: no DP"
    )
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="peer-pfl-") as tmp:
        for clients in args.clients:
            data = Path(tmp) / f"digits-{clients}.npz"
            export(clients, data)
            for _ in range(args.repeats):
                for engine in ["pfl", *args.engines]:
                    if engine == "pfl":
                        result = measure_pfl(args.pfl_python, data, args.rounds)
                    else:
                        result = ray_population.measure(engine, clients, side)
                    result["clients"] = clients
                    results.append(result)
                    print(json.dumps({k: result[k] for k in sorted(result)}), flush=True)
    print(
        f"{'system':>10} {'N':>5} {'round1 s':>9} {'steady s':>9} {'run s':>7} "
        f"{'peak RSS GiB':>13} {'acc':>6}"
    )
    for clients in args.clients:
        steady: dict[str, float] = {}
        for engine in ["pfl", *args.engines]:
            runs = [r for r in results if r["clients"] == clients and r["engine"] == engine]
            med = {
                k: statistics.median(r[k] for r in runs)
                for k in (
                    "round1_s",
                    "steady_round_s",
                    "total_s",
                    "peak_rss_bytes",
                    "final_accuracy",
                )
            }
            steady[engine] = med["steady_round_s"]
            print(
                f"{engine:>10} {clients:>5} {med['round1_s']:>9.2f} {med['steady_round_s']:>9.2f} "
                f"{med['total_s']:>7.1f} {med['peak_rss_bytes'] / GIB:>13.2f} "
                f"{med['final_accuracy']:>6.3f}"
            )
        for engine in args.engines:
            print(
                f"N={clients}: steady round pfl / {engine} = {steady['pfl'] / steady[engine]:.2f}"
            )


if __name__ == "__main__":
    main()
