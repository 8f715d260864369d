"""Benchmark: DP-SGD + random sparsification step time against plain Opacus.

DP-CNN (550,570 parameters) on random 3x32x32 inputs, batch 256, 2 threads. Measures examples/s
for non-private SGD, plain Opacus DP-SGD, and DP-SGD+RS at r = 0 (no mask), 0.5 and 0.9, with the
configurations interleaved round-robin so machine noise hits all alike, and prints medians and
the ratio of each step time to the plain Opacus step time (target for RS: <= 1.03) and to the
non-private one, each ratio with a 95% bootstrap interval over the paired repetitions (the
ratio of two configurations' times within one round-robin pass).

Usage: python benchmarks/engine.py [--reps 5] [--steps 2] [--batch 256] [--mode hooks]
           [--device cpu|cuda|auto]
"""

from __future__ import annotations

import argparse
import random
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


def make_runner(kind: str, rate: float, batch: int, mode: str, device: torch.device):
    torch.manual_seed(0)
    model = build_model("dpcnn").to(device)
    x = torch.randn(batch, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
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
            mask = sample_mask(numel, keep=keep_count(numel, rate=rate), seed=1)
            engine.set_mask(mask.to(device))
    xb, yb = next(iter(loader))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(xb), yb).backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    step()  # warm-up
    return step


def ratio_interval(
    num: list[float], den: list[float], *, draws: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """Median of the paired ratios ``num[i] / den[i]`` and its 95% bootstrap interval."""
    ratios = [a / b for a, b in zip(num, den, strict=True)]
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return statistics.median(ratios), medians[int(0.025 * draws)], medians[int(0.975 * draws)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="steps per timed sample")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mode", default="hooks", help="Opacus grad_sample_mode")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    name = args.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    configs = [("non-private", 0.0), ("opacus", 0.0), ("rs", 0.0), ("rs", 0.5), ("rs", 0.9)]
    runners = {c: make_runner(*c, args.batch, args.mode, device) for c in configs}
    samples: dict[tuple[str, float], list[float]] = {c: [] for c in configs}
    for _ in range(args.reps):
        for config, step in runners.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            samples[config].append((time.perf_counter() - start) / args.steps)
    where = f"{args.threads} threads"
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    print(
        f"DP-CNN, batch {args.batch}, {where}, torch {torch.__version__}, "
        f"grad_sample_mode={args.mode}, median of {args.reps} x {args.steps} steps"
    )
    opacus, plain = samples[("opacus", 0.0)], samples[("non-private", 0.0)]
    print(
        f"{'config':<12} {'s/step':>8} {'ex/s':>9} "
        f"{'time / opacus [95% CI]':>26} {'throughput / non-private [95% CI]':>36}"
    )
    for (kind, rate), times in samples.items():
        med = statistics.median(times)
        label = kind if kind != "rs" else f"rs r={rate}"
        r, lo, hi = ratio_interval(times, opacus)
        t, tlo, thi = ratio_interval(plain, times)  # throughput ratio = time ratio inverted
        print(
            f"{label:<12} {med:>8.4f} {args.batch / med:>9.1f} "
            f"{r:>10.3f} [{lo:.3f}, {hi:.3f}] {t:>20.3f} [{tlo:.3f}, {thi:.3f}]"
        )


if __name__ == "__main__":
    main()
