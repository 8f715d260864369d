"""Benchmark: DP-SGD + random sparsification step time against plain Opacus.

DP-CNN (550,570 parameters) on random 3x32x32 inputs, batch 256, 2 threads. Measures examples/s
for non-private SGD, plain Opacus DP-SGD, and DP-SGD+RS at r = 0 (no mask), 0.5 and 0.9, with the
configurations interleaved round-robin so machine noise hits all alike, and prints medians and
the ratio of each RS step time to the plain Opacus step time (target: <= 1.03).

Usage: python benchmarks/engine.py [--reps 5] [--steps 2] [--batch 256] [--mode hooks]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from opacus import PrivacyEngine
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedsparse.common.dp import SparseDPEngine
from fedsparse.common.masks import keep_count, sample_mask
from fedsparse.common.models import build_model

warnings.filterwarnings("ignore")


def make_runner(kind: str, rate: float, batch: int, mode: str):
    torch.manual_seed(0)
    model = build_model("dpcnn")
    x = torch.randn(batch, 3, 32, 32)
    y = torch.randint(0, 10, (batch,))
    loader = DataLoader(TensorDataset(x, y), batch_size=batch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if kind != "non-private":
        engine = PrivacyEngine() if kind == "opacus" else SparseDPEngine()
        model, optimizer, loader = engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            poisson_sampling=False,
            grad_sample_mode=mode,
        )
        if kind == "rs" and rate > 0:
            numel = engine.layout.numel
            engine.set_mask(sample_mask(numel, keep=keep_count(numel, rate=rate), seed=1))
    xb, yb = next(iter(loader))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(xb), yb).backward()
        optimizer.step()

    step()  # warm-up
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="steps per timed sample")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mode", default="hooks", help="Opacus grad_sample_mode")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    configs = [("non-private", 0.0), ("opacus", 0.0), ("rs", 0.0), ("rs", 0.5), ("rs", 0.9)]
    runners = {c: make_runner(*c, args.batch, args.mode) for c in configs}
    samples: dict[tuple[str, float], list[float]] = {c: [] for c in configs}
    for _ in range(args.reps):
        for config, step in runners.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            samples[config].append((time.perf_counter() - start) / args.steps)
    base = statistics.median(samples[("opacus", 0.0)])
    print(
        f"DP-CNN, batch {args.batch}, {args.threads} threads, grad_sample_mode={args.mode}, "
        f"median of {args.reps} x {args.steps} steps"
    )
    print(f"{'config':<16} {'s/step':>8} {'ex/s':>8} {'time / opacus':>14}")
    for (kind, rate), times in samples.items():
        med = statistics.median(times)
        label = kind if kind != "rs" else f"rs r={rate}"
        print(f"{label:<16} {med:>8.3f} {args.batch / med:>8.1f} {med / base:>14.3f}")


if __name__ == "__main__":
    main()
