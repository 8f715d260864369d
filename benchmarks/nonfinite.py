"""Benchmark: does a poisoned example change the DP step's time? And what does branch-free cost?

A step's time must not depend on whether one chosen example's per-sample gradient is finite:
Flower reports every reply's runtime to the server, so a step that did extra work for a
non-finite example would be a membership oracle (``common/dp/optimizer.py``'s docstring, "Non-finite
per-sample gradients"). The digits CNN (38,282 parameters) on the first ``--batch`` sklearn
digits, on each engine (``opacus`` = ``SparseDPEngine``'s Opacus hooks, ``func``,
``factored``), without a mask and at r = 0.5, sigma = 1, C = 1, lr 0 (every step starts from
the same weights), no Poisson sampling (the batch is fixed), and these batches:

  - ``clean``: the digits as they are, on the model as built.
  - ``nan``: the same, one example (``POISONED``) with one NaN pixel: its loss, and so its
    per-sample gradient, is NaN.
  - ``subnormal``: the same, that example's pixels scaled by 1e-39 into float32's subnormal
    range: its first layer's per-sample gradient is formed from subnormal values (slow on x86
    unless ``flush_denormals``).
  - ``crafted-out`` / ``crafted-in``: the membership attack of ``tests/client/test_membership.py``
    (a finite model whose loss is NaN for exactly one example of the batch, the target) on the
    batch with the target replaced by another digit (a non-member, the same batch size) and on
    the batch itself (a member).

Code versions, every one in each engine and masking (one process per configuration, spawned,
one at a time working, interleaved round-robin as in ``benchmarks/engine.py``):

  - ``new``: the branch-free code of ``common/`` (as imported).
  - ``new+ftz``: ``new`` in a process that calls ``dp.flush_denormals()`` first.

(Measured once against the branching version this replaced, which did extra work only for a
non-finite example: member/non-member step time was up to 6.8x there, 1.00-1.03 here; the
branch-free pass costs 1.2-1.5x on the unmasked Opacus/func step, about 1.04x on a whole
iteration, and nothing measurable on the masked and factored paths.)

Each sample is the mean over ``--steps`` steps of one batch; a repetition takes one sample of
every batch in every process (the batches in a rotated order). Times: ``step`` is
``optimizer.step()`` (clip, accumulate, noise, scale, update: where the handling lives),
``iter`` adds ``zero_grad`` and the forward and backward pass (what a client's round is made
of). Prints, per configuration, the clean batch's median step time and each poisoned batch's
time relative to its clean one (``nan`` and ``subnormal`` / ``clean``, ``crafted-in`` /
``crafted-out``) with a 95% bootstrap interval of the median of the paired ratios, and the
AUC (the fraction of sample pairs in which the poisoned batch was slower; 0.5: no signal, 1:
every poisoned sample slower than every clean one).

Usage: python benchmarks/nonfinite.py [--reps 30] [--steps 5] [--batch 256] [--threads 2]
           [--only opacus,func-r0.5,...] [--codes new,new+ftz]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing as mp
import statistics
import time
import warnings
from multiprocessing.connection import Connection

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedsparse.lab.experiments.stats import ratio_interval

warnings.filterwarnings("ignore")

ENGINES = ("opacus", "func", "factored")
RATES = {"": None, "-r0.5": 0.5}
CODES = ("new", "new+ftz")
BATCHES = ("clean", "nan", "subnormal", "crafted-out", "crafted-in")
#: (poisoned batch, its clean reference)
PAIRS = (("nan", "clean"), ("subnormal", "clean"), ("crafted-in", "crafted-out"))
POISONED = 3
FLOAT_MAX = torch.finfo(torch.float32).max


# --- the batches and one configuration's runner ----------------------------------------------


def crafted_model(model: nn.Module, x: torch.Tensor) -> tuple[nn.Module, int]:
    """``model`` made into ``tests/client/test_membership.py``'s crafted model for ``x``: its
    loss is NaN for exactly the returned example (the target) and finite for the others."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        features = model.classifier[0](model.features(x))
        u = torch.randn(features.shape[1], generator=generator)
        top2 = torch.topk(features @ u, 2)
        scale = 40.0 / float(top2.values[0] - top2.values[1])
        fc1, fc2 = model.classifier[1], model.classifier[3]
        fc1.weight[0] = scale * u
        fc1.bias[0] = -scale * float(top2.values[0] + top2.values[1]) / 2
        fc1.weight[1] = 0.0
        fc1.bias[1] = 20.0
        fc2.weight[0] = 0.0
        fc2.weight[0, 0] = FLOAT_MAX
        fc2.weight[0, 1] = FLOAT_MAX
        fc2.bias[0] = 0.0
    return model, int(top2.indices[0])


def make_runner(engine_name: str, rate: float | None, batch: int):
    """{batch name: a function running one step on it, returning (step s, iteration s)}."""
    from fedsparse.common.data.datasets import load_dataset
    from fedsparse.common.dp.engine import SparseDPEngine
    from fedsparse.common.dp.engines.factored import FactoredDPEngine
    from fedsparse.common.dp.engines.func import FuncDPEngine
    from fedsparse.common.masks import keep_count, sample_mask
    from fedsparse.common.models.classifiers import build_model

    train, _ = load_dataset("digits")
    x, y = train.x[:batch].clone(), train.y[:batch].clone()
    nan = x.clone()
    nan[POISONED, 0, 4, 4] = math.nan
    subnormal = x.clone()
    subnormal[POISONED] = subnormal[POISONED].abs() * 1e-39 + 1e-40  # every pixel subnormal
    assert bool((subnormal[POISONED].abs() < torch.finfo(torch.float32).tiny).all())
    crafted, target = crafted_model(build_model("digits-cnn", seed=0), x)
    other = (target + 1) % batch
    outside = x.clone()
    outside[target] = x[other]  # a non-member in its place: the same batch size
    with torch.no_grad():
        inside_loss = nn.functional.cross_entropy(crafted(x), y, reduction="none")
        outside_loss = nn.functional.cross_entropy(crafted(outside), y, reduction="none")
    assert (~inside_loss.isfinite()).nonzero().flatten().tolist() == [target]
    assert bool(outside_loss.isfinite().all())
    engines = {"opacus": SparseDPEngine, "func": FuncDPEngine, "factored": FactoredDPEngine}

    def private(model: nn.Module):
        engine = engines[engine_name]()
        module, optimizer, _ = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=batch),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            poisson_sampling=False,
            noise_generator=torch.Generator().manual_seed(7),
        )
        if rate is not None:
            numel = engine.layout.numel
            engine.set_mask(sample_mask(numel, keep=keep_count(numel, rate=rate), seed=1))
        return module, optimizer

    plain = private(build_model("digits-cnn", seed=0))
    attacked = private(crafted)
    criterion = nn.CrossEntropyLoss()

    def runner(setup, xb: torch.Tensor):
        module, optimizer = setup

        def run() -> tuple[float, float]:
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            per_sample = getattr(module, "backward_per_sample", None)
            if per_sample is not None:
                per_sample(xb, y, criterion=criterion)
            else:
                criterion(module(xb), y).backward()
            mid = time.perf_counter()
            optimizer.step()
            end = time.perf_counter()
            return end - mid, end - start

        return run

    runs = {
        "clean": runner(plain, x),
        "nan": runner(plain, nan),
        "subnormal": runner(plain, subnormal),
        "crafted-out": runner(attacked, outside),
        "crafted-in": runner(attacked, x),
    }
    for run in runs.values():  # warm-up
        run()
    return runs


def worker(conn: Connection, code: str, engine: str, rate: float | None, args: dict) -> None:
    """One configuration's process: times ``steps`` steps of the requested batch per request."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args["threads"])
    flushed = None
    if code == "new+ftz":
        from fedsparse.common.dp.engine import flush_denormals

        flushed = flush_denormals()  # first: before torch's threads start
    runs = make_runner(engine, rate, args["batch"])
    conn.send(("ready", flushed))
    while True:
        request = conn.recv()
        if request == "stop":
            return
        step_total = iter_total = 0.0
        for _ in range(args["steps"]):
            step_s, iter_s = runs[request]()
            step_total += step_s
            iter_total += iter_s
        conn.send((step_total / args["steps"], iter_total / args["steps"]))


# --- statistics and the report ---------------------------------------------------------------


def auc(poisoned: list[float], clean: list[float]) -> float:
    """The fraction of (poisoned, clean) sample pairs in which the poisoned one was slower."""
    wins = sum((a > b) + 0.5 * (a == b) for a in poisoned for b in clean)
    return wins / (len(poisoned) * len(clean))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--steps", type=int, default=5, help="steps per timed sample")
    parser.add_argument("--batch", type=int, default=256, help="examples (<= 1437 digits)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", default="", help="comma-separated engines, e.g. func-r0.5")
    parser.add_argument("--codes", default=",".join(CODES), help="comma-separated code versions")
    args = parser.parse_args()
    codes = [c for c in args.codes.split(",") if c]
    if set(codes) - set(CODES):
        parser.error(f"--codes: expected some of {', '.join(CODES)}")
    settings = {"threads": args.threads, "batch": args.batch, "steps": args.steps}
    labels = [e + suffix for e in ENGINES for suffix in RATES]
    only = [label for label in args.only.split(",") if label]
    if set(only) - set(labels):
        parser.error(f"--only: expected some of {', '.join(labels)}")
    configs = [
        (code, label, engine, rate)
        for engine in ENGINES
        for suffix, rate in RATES.items()
        for label in [engine + suffix]
        if not only or label in only
        for code in codes
    ]
    context = mp.get_context("spawn")
    workers: dict[tuple[str, str], tuple[mp.process.BaseProcess, Connection]] = {}
    flushed: dict[tuple[str, str], bool | None] = {}
    samples: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
    try:
        for code, label, engine, rate in configs:  # one at a time: a build overlaps no step
            ours, theirs = context.Pipe()
            process = context.Process(target=worker, args=(theirs, code, engine, rate, settings))
            process.start()
            status, flushed[code, label] = ours.recv()
            if status != "ready":
                raise RuntimeError(f"{code} {label}: the worker did not start")
            workers[code, label] = (process, ours)
        for rep in range(args.reps):
            for (code, label), (_, conn) in workers.items():
                shift = rep % len(BATCHES)
                for batch in BATCHES[shift:] + BATCHES[:shift]:
                    conn.send(batch)
                    samples.setdefault((code, label, batch), []).append(conn.recv())
    finally:
        for process, conn in workers.values():
            with contextlib.suppress(OSError):
                conn.send("stop")
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    print(
        f"digits-cnn, batch {args.batch}, {args.threads} threads, torch {torch.__version__}, "
        f"sigma 1, a process per config, median of {args.reps} x {args.steps} steps"
    )
    for key, value in flushed.items():
        if value is not None:
            print(f"flush_denormals() in {key[0]} {key[1]}: {value}")
    for which, index in (("step", 0), ("iter", 1)):
        print(
            f"\n[{which}] {'code':<8} {'config':<12} {'clean ms':>9}   "
            + "   ".join(f"{a + ' / ' + b:>34}" for a, b in PAIRS)
        )
        for code, label in workers:
            times = {b: [s[index] for s in samples[code, label, b]] for b in BATCHES}
            cells = []
            for num, den in PAIRS:
                r, lo, hi = ratio_interval(times[num], times[den])
                cells.append(f"{r:6.3f} [{lo:.3f}, {hi:.3f}] AUC {auc(times[num], times[den]):.2f}")
            clean = statistics.median(times["clean"]) * 1e3
            print(f"{'':6} {code:<8} {label:<12} {clean:>9.2f}   " + "   ".join(cells))


if __name__ == "__main__":
    main()
