"""Benchmark: seed-shared mask sampling vs torch.randperm, numel 1e6..1e8.

Prints the median time of ``sample_mask`` (chunked SplitMix64 window selection) and of the
obvious alternative ``torch.randperm(numel)[:keep]`` (library-RNG dependent, O(numel) int64
memory), and their ratio, measured in this run. Usage: python benchmarks/masks.py [--max 1e8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fedsparse.common.masks import sample_mask


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max", type=float, default=1e8, help="largest numel")
    parser.add_argument("--rate", type=float, default=0.9, help="sparsification rate")
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(f"{'numel':>12} {'sample_mask s':>14} {'randperm s':>11} {'speedup':>8} {'Mcoord/s':>9}")
    numel = 10**6
    while numel <= args.max:
        keep = numel - int(args.rate * numel)
        repeats = 5 if numel <= 10**7 else 3
        ours = median_seconds(lambda n=numel, k=keep: sample_mask(n, keep=k, seed=1), repeats)
        gen = torch.Generator().manual_seed(1)
        theirs = median_seconds(
            lambda n=numel, k=keep, g=gen: torch.randperm(n, generator=g)[:k], repeats
        )
        print(
            f"{numel:>12,} {ours:>14.4f} {theirs:>11.4f} {theirs / ours:>7.1f}x "
            f"{numel / ours / 1e6:>9.0f}"
        )
        numel *= 10


if __name__ == "__main__":
    main()
