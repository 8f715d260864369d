"""Benchmark: N virtual clients on the ray backend (``RayGrid``), or in one process (``population``:
the vectorised round, ``inprocess``: the ClientApp per client): round time and memory.

For each population size N (default 100 and 1000; digits, every client in every round), one
federation runs in a fresh child process, so that each N's peak memory is its own, on the ray
backend (``lab/simulation/raygrid.py``: one worker per CPU, each holding N / workers virtual
clients) or,
for comparison, on Flower's simulation engine (``--engines flower``). Printed per run:

* start-up: seconds from the child's start (imports included) to round 1's start: the Ray
  cluster, the workers and the clients' Contexts (Flower: SuperLink, ``flwr run``, Ray);
* round 1 and the median of the later rounds (steady state: round 1 ships dense models to
  every client and fills each worker's caches), from ``rounds.jsonl``'s ``wall_seconds``;
* peak memory of the whole process tree (the driver and every Ray or Flower process under
  it), sampled every 0.5 s (reading ``smaps_rollup`` takes CPU from the run): the sum of RSS
  (shared pages counted in every process that maps them: an upper bound) and of PSS (shared
  pages split between their processes);
* per virtual client: the state a worker holds for it (its ``Context.state`` pickled: model
  copy and accountant), and the tree's peak PSS growth from the smallest N to the largest,
  divided by the difference in N.

``--dataset synthetic`` replaces the embedded digits (1,797 images: too few for 10,000
clients) by ``benchmarks/population_data.py``'s synthetic digits-shaped set, with
``--examples-per-client`` examples for each client of every N (the same work per client);
``--clients-per-round`` samples that many clients a round (0: all).

Usage: python benchmarks/ray_population.py [--clients 100 1000] [--rounds 3]
           [--config default|fixed-noise] [--engines ray flower] [--cpus-per-client 1]
           [--dataset digits|synthetic] [--examples-per-client 2] [--clients-per-round 0]
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from fedsparse.lab.launch.processes import descendants

#: Run-config overrides of each ``--config`` (on top of ``num-rounds``).
CONFIGS = {
    "default": {},  # target-epsilon 3 (sigma calibrated per client), gradual to r* = 0.7
    "fixed-noise": {"target-epsilon": "0", "noise-multiplier": "1.0"},
    # FedAvg without DP: no clipping, no noise, every coordinate (pfl-research's setting)
    "no-dp": {
        "mechanism": "noisy",
        "target-epsilon": "0",
        "noise-multiplier": "0",
        "final-rate": "0",
        "schedule": "constant",
    },
    # DP-SGD with RS at r = 0.9 from round 1, sigma fixed
    "rs-0.9": {
        "target-epsilon": "0",
        "noise-multiplier": "1.0",
        "final-rate": "0.9",
        "schedule": "constant",
    },
}
GIB = 2**30
#: The backends a run can take (``--engines``): ``population`` and ``inprocess`` run the
#: clients in the child's process (``PopulationGrid``, ``InProcessGrid``); ``ray-population``
#: is ``ray`` with vectorised workers (``RayWorkers(vectorised=True)``).
ENGINES = ("ray", "flower", "population", "inprocess", "ray-population")


def _memory(pid: int) -> tuple[int, int]:
    """(RSS, PSS) bytes of ``pid`` (0, 0 if it is gone)."""
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1]) * 1024
    except OSError:
        pass
    return rss, pss


class TreeSampler(threading.Thread):
    """Samples the summed RSS and PSS of ``pid`` and its descendants; keeps the peaks."""

    def __init__(self, pid: int, *, every: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.pid, self.every = pid, every
        self.peak_rss = self.peak_pss = self.peak_processes = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            pids = [self.pid, *descendants(self.pid)]
            sizes = [_memory(p) for p in pids]
            self.peak_rss = max(self.peak_rss, sum(r for r, _ in sizes))
            self.peak_pss = max(self.peak_pss, sum(p for _, p in sizes))
            self.peak_processes = max(self.peak_processes, len(pids))
            self._halt.wait(self.every)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def _rounds(out: Path) -> dict[str, Any]:
    from fedsparse.common.wire.run_log import read_rounds

    rounds = read_rounds(out / "rounds.jsonl")
    later = [r.wall_seconds for r in rounds[1:]]
    return {
        "rounds": len(rounds),
        "round1_s": rounds[0].wall_seconds,
        "steady_round_s": statistics.median(later) if later else float("nan"),
        "first_round_started_at": rounds[0].started_at,
        "final_accuracy": rounds[-1].test_accuracy,
        "epsilon_max": rounds[-1].epsilon_max,
    }


def _child_ray(
    clients: int, overrides: dict[str, str], cpus: float, out: Path, *, vectorised: bool = False
) -> dict[str, Any]:
    from fedsparse.client.app import app as client_app
    from fedsparse.common.config import FederatedConfig
    from fedsparse.lab.simulation.raygrid import RayGrid
    from fedsparse.lab.simulation.rayworkers import RayWorkers, ray_cluster
    from fedsparse.server.app import run_federated

    logging.getLogger("flwr").setLevel(logging.WARNING)  # after flwr set its own level
    cfg = FederatedConfig.from_run_config({**overrides, "out-dir": str(out)})
    with (
        ray_cluster(),
        RayWorkers(client_app, cpus_per_client=cpus, vectorised=vectorised) as workers,
    ):
        grid = RayGrid(workers, num_nodes=clients, run_config=cfg.to_run_config())
        run_federated(grid, cfg)
        stats = workers.stats()
    held = sum(s.clients for s in stats)
    return {
        "workers": len(stats),
        "calls_per_worker_round": statistics.mean(s.calls for s in stats) / cfg.num_rounds,
        "state_bytes_per_client": sum(s.state_bytes for s in stats) / held,
        "context_bytes_per_client": sum(s.context_bytes for s in stats) / held,
        "worker_rss_bytes": [s.rss_bytes for s in stats],
    }


def _child_local(
    clients: int, overrides: dict[str, str], cpus: float, out: Path, *, population: bool
) -> dict[str, Any]:
    from fedsparse.client.app import app as client_app
    from fedsparse.common.config import FederatedConfig
    from fedsparse.lab.simulation.inprocess import InProcessGrid
    from fedsparse.lab.simulation.population import PopulationGrid
    from fedsparse.server.app import run_federated

    logging.getLogger("flwr").setLevel(logging.WARNING)
    cfg = FederatedConfig.from_run_config({**overrides, "out-dir": str(out)})
    grid_class = PopulationGrid if population else InProcessGrid
    grid = grid_class(client_app, num_nodes=clients, run_config=cfg.to_run_config())
    run_federated(grid, cfg)
    return {}


def _child_flower(
    clients: int, overrides: dict[str, str], cpus: float, out: Path
) -> dict[str, Any]:
    from rich.console import Console

    from fedsparse.lab.launch.simulate import run_simulation

    run_simulation(
        out=out,
        overrides=overrides,
        clients=clients,
        cpus_per_client=cpus,
        console=Console(file=open(os.devnull, "w")),  # noqa: SIM115 - the child's lifetime
    )
    return {}


def child(args: argparse.Namespace) -> None:
    """One run (``--child``): prints its numbers as one JSON line."""
    started = time.time()
    overrides = {**CONFIGS[args.config], "num-rounds": str(args.rounds)}
    overrides["clients-per-round"] = str(args.clients_per_round)
    if args.max_norm_ratio is not None:
        overrides["max-norm-ratio"] = str(args.max_norm_ratio)
    if args.dataset == "synthetic":
        overrides |= {"dataset": "population_data:load", "model": "digits-cnn"}
    else:
        overrides["dataset"] = "digits"
    with tempfile.TemporaryDirectory(prefix="ray-population-") as tmp:
        out = Path(tmp)
        runs = {
            "ray": _child_ray,
            "ray-population": functools.partial(_child_ray, vectorised=True),
            "flower": _child_flower,
            "inprocess": functools.partial(_child_local, population=False),
            "population": functools.partial(_child_local, population=True),
        }
        result = runs[args.engine](args.child, overrides, args.cpus_per_client, out)
        result.update(_rounds(out))
    result["startup_s"] = result.pop("first_round_started_at") - started
    print(json.dumps(result))


def measure(engine: str, clients: int, args: argparse.Namespace) -> dict[str, Any]:
    """Runs one child and samples its process tree."""
    cmd = [sys.executable, __file__, "--child", str(clients), "--engine", engine]
    cmd += ["--rounds", str(args.rounds), "--config", args.config]
    cmd += ["--cpus-per-client", str(args.cpus_per_client), "--dataset", args.dataset]
    cmd += ["--clients-per-round", str(args.clients_per_round)]
    if args.max_norm_ratio is not None:
        cmd += ["--max-norm-ratio", str(args.max_norm_ratio)]
    env = dict(os.environ)
    if args.dataset == "synthetic":
        here = str(Path(__file__).resolve().parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
        env["FEDSPARSE_BENCH_EXAMPLES"] = str(args.examples_per_client * clients)
    started = time.perf_counter()
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    sampler = TreeSampler(process.pid)
    sampler.start()
    stdout, _ = process.communicate()
    sampler.stop()
    if process.returncode != 0:
        raise SystemExit(f"{engine} N={clients}: exit code {process.returncode}")
    result = json.loads(stdout.strip().splitlines()[-1])
    result.update(
        engine=engine,
        clients=clients,
        total_s=time.perf_counter() - started,
        peak_rss_bytes=sampler.peak_rss,
        peak_pss_bytes=sampler.peak_pss,
        peak_processes=sampler.peak_processes,
    )
    return result


def _print(results: list[dict[str, Any]]) -> None:
    print(
        f"{'engine':>10} {'N':>5} {'start s':>8} {'round1 s':>9} {'steady s':>9} "
        f"{'peak RSS GiB':>13} {'peak PSS GiB':>13} {'state KiB/cl':>13} {'acc':>6} {'eps':>6}"
    )
    for r in results:
        state = r.get("state_bytes_per_client")
        print(
            f"{r['engine']:>10} {r['clients']:>5} {r['startup_s']:>8.1f} {r['round1_s']:>9.2f} "
            f"{r['steady_round_s']:>9.2f} {r['peak_rss_bytes'] / GIB:>13.2f} "
            f"{r['peak_pss_bytes'] / GIB:>13.2f} "
            f"{(f'{state / 1024:.1f}' if state else '-'):>13} "
            f"{r['final_accuracy']:>6.3f} {r['epsilon_max']:>6.2f}"
        )
    for engine in sorted({r["engine"] for r in results}):
        runs = sorted((r for r in results if r["engine"] == engine), key=lambda r: r["clients"])
        if len(runs) > 1 and runs[-1]["clients"] > runs[0]["clients"]:
            small, large = runs[0], runs[-1]
            grow = (large["peak_pss_bytes"] - small["peak_pss_bytes"]) / (
                large["clients"] - small["clients"]
            )
            print(
                f"{engine}: peak PSS per extra virtual client "
                f"(N={small['clients']} -> {large['clients']}): {grow / 1024:.1f} KiB"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="default")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=["ray"])
    parser.add_argument("--cpus-per-client", type=float, default=1.0)
    parser.add_argument("--dataset", choices=["digits", "synthetic"], default="digits")
    parser.add_argument("--examples-per-client", type=int, default=2)
    parser.add_argument("--clients-per-round", type=int, default=0)
    parser.add_argument(
        "--max-norm-ratio",
        type=float,
        help="the run's max-norm-ratio (default: the run config's, 3; 0: no rule over the "
        "round's median norm, so the server sums each update as it arrives)",
    )
    parser.add_argument("--json", type=Path, help="also write every result here")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args)
        return
    data = (
        "digits"
        if args.dataset == "digits"
        else (
            f"synthetic digits-shaped data ({args.examples_per_client} examples per client, "
            "population_data.py)"
        )
    )
    sampled = (
        f"{args.clients_per_round} clients a round"
        if args.clients_per_round
        else ("every client every round")
    )
    bound = "" if args.max_norm_ratio is None else f", max-norm-ratio {args.max_norm_ratio:g}"
    print(
        f"{data}, config {args.config}{bound}, {args.rounds} rounds, {sampled}, "
        f"{os.cpu_count()} CPUs, {args.cpus_per_client:g} CPU per client trained"
    )
    results = []
    for engine in args.engines:
        for clients in args.clients:
            results.append(measure(engine, clients, args))
            print(json.dumps(results[-1]), flush=True)
    _print(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
