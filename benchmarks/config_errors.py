"""Benchmark: how fast a bad value is refused, against an unknown key.

Each case runs ``fedsparse`` as a user would (a new process, the venv's entry point) with one
bad input and times it until the process exits with its one-line refusal (exit code 2):

* an unknown run-config key (``--set num-round=3``): the reference, refused from the app's
  ``pyproject.toml`` before anything heavy is imported;
* a value out of range (``final-rate=1.5``), an unknown name (``dataset=digit``), a setting
  that needs others (``secure-aggregation=true``), a grid value (``sweep --grid
  final-rate=0,1.5``): refused by ``common/config_values.py`` before torch is imported;
* a node declaration without ``nominal-size`` (``fedsparse node``): ``client/node_policy.py:
  check_node_config`` before Flower is imported.

Target on this machine (2 cores): every case within 1 s (median of ``--repeats`` alternating
runs), the same order as the unknown key. Prints each case's median, min and max and its ratio
to the unknown key's median.

Usage: python benchmarks/config_errors.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FEDSPARSE = Path(sys.executable).parent / "fedsparse"

CASES: dict[str, list[str]] = {
    "unknown key": ["simulate", "--set", "num-round=3"],
    "final-rate=1.5": ["simulate", "--set", "final-rate=1.5"],
    "dataset=digit": ["simulate", "--set", "dataset=digit"],
    "secure-aggregation=true": ["simulate", "--set", "secure-aggregation=true"],
    "sweep --grid final-rate=0,1.5": ["sweep", "--grid", "final-rate=0,1.5"],
    "node without nominal-size": [
        "node",
        "--insecure",
        "--superlink",
        "127.0.0.1:1",
        "--node-config",
        "dataset='digits' partition-id=0 num-partitions=2",
    ],
}


def _time(args: list[str], out: Path) -> float:
    started = time.perf_counter()
    result = subprocess.run(
        [str(FEDSPARSE), *args, "--out", str(out)]
        if args[0] != "node"
        else [str(FEDSPARSE), *args],
        capture_output=True,
        text=True,
        env={"COLUMNS": "200", "PATH": str(FEDSPARSE.parent)},
    )
    elapsed = time.perf_counter() - started
    if result.returncode != 2:
        raise RuntimeError(f"{args}: exit {result.returncode}, expected 2:\n{result.stdout}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in CASES}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):  # alternating, so that load drifts hit every case alike
            for name, case in CASES.items():
                times[name].append(_time(case, Path(tmp) / "never"))
    reference = statistics.median(times["unknown key"])
    print(f"{'case':32} {'median s':>9} {'min s':>7} {'max s':>7} {'x unknown key':>14}")
    worst = 0.0
    for name, values in times.items():
        median = statistics.median(values)
        worst = max(worst, median)
        print(
            f"{name:32} {median:9.3f} {min(values):7.3f} {max(values):7.3f} "
            f"{median / reference:14.2f}"
        )
    verdict = "met" if worst <= 1.0 else "MISSED"
    print(f"target: every case within 1 s (median): {verdict} (slowest {worst:.3f} s)")
    return 0 if worst <= 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
