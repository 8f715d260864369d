"""Benchmark: DP-SGD + random sparsification step time, for each DP engine.

DP-CNN (550,570 parameters; ``--model`` another of ``models.MODEL_NAMES``) on random inputs,
batch 256, 2 threads. Measures examples/s
for non-private SGD; plain Opacus DP-SGD and the Opacus-hooks RS engine (``SparseDPEngine``) at
r = 0 (no mask), 0.5 and 0.9; the torch.func engine (``FuncDPEngine``) with no mask, with the
all-kept mask of r = 0 (keep = d: the no-mask code path), and at r = 0.5 and 0.9; and the
factored engine (``FactoredDPEngine``) with no mask and at r = 0.5 and 0.9.

Every configuration runs in a process of its own (spawned, one thread pool each, only one
process working at a time): in one shared process the configurations disturbed each other
through the C allocator (a step of non-private SGD ranged 0.44-0.62 s depending on which DP
engines had run before it, from where glibc placed and returned their large buffers). The
configurations still run interleaved round-robin, so machine noise hits all alike.
``--malloc retain`` has each process call ``lab/simulation/memory.py``'s ``retain_freed_memory``
first
(what ``fedsparse train`` does): glibc's mmap and trim thresholds raised, so that freed
buffers are reused instead of returned to the kernel and faulted in again (on a virtual
machine each page fault is expensive): the steady state of a long training run.

Prints medians and each step time relative to plain Opacus and each throughput relative to
non-private SGD (target: >= 0.6), then the RS overheads (RS time / the same engine's time
without a mask; target <= 1.03) and the engines' speed-ups over each other. Every ratio comes
with a 95% bootstrap interval over the paired repetitions (the ratio of two configurations'
times within one round-robin pass).

Usage: python benchmarks/engine.py [--reps 5] [--steps 2] [--batch 256] [--mode hooks]
           [--device cpu|cuda|auto] [--malloc default|retain]
           [--only non-private,factored,factored-r0.9,...]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import statistics
import time
import warnings
from multiprocessing.connection import Connection

import torch
from opacus import PrivacyEngine
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedsparse.common.dp.engine import SparseDPEngine
from fedsparse.common.dp.engines.factored import FactoredDPEngine, FactoredGradSampleModule
from fedsparse.common.dp.engines.func import FuncDPEngine, FuncGradSampleModule
from fedsparse.common.masks import keep_count, sample_mask
from fedsparse.common.models.classifiers import MODEL_INPUT_SHAPES, MODEL_NAMES, build_model
from fedsparse.lab.experiments.stats import ratio_interval
from fedsparse.lab.simulation.memory import retain_freed_memory

warnings.filterwarnings("ignore")

#: (label, engine kind, rate): rate None is "no mask ever set".
CONFIGS = [
    ("non-private", "non-private", None),
    ("opacus", "opacus", None),
    ("rs-r0", "rs", 0.0),
    ("rs-r0.5", "rs", 0.5),
    ("rs-r0.9", "rs", 0.9),
    ("func", "func", None),
    ("func-r0", "func", 0.0),
    ("func-r0.5", "func", 0.5),
    ("func-r0.9", "func", 0.9),
    ("factored", "factored", None),
    ("factored-r0.5", "factored", 0.5),
    ("factored-r0.9", "factored", 0.9),
]
#: (numerator, denominator) time ratios reported as RS overheads and engine speed-ups.
OVERHEADS = [
    ("func-r0.9", "func"),
    ("func-r0.5", "func"),
    ("func-r0", "func"),
    ("rs-r0.9", "opacus"),
    ("rs-r0.5", "opacus"),
    ("opacus", "func"),
    ("rs-r0.9", "func-r0.9"),
    ("factored-r0.9", "factored"),
    ("factored-r0.5", "factored"),
    ("opacus", "factored"),
    ("rs-r0.9", "factored-r0.9"),
]


def make_runner(
    kind: str, rate: float | None, batch: int, mode: str, device: torch.device, model_name: str
):
    torch.manual_seed(0)
    model = build_model(model_name).to(device)  # type: ignore[arg-type]
    x = torch.randn(batch, *MODEL_INPUT_SHAPES[model_name], device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if kind != "non-private":
        engines = {
            "opacus": PrivacyEngine,
            "rs": SparseDPEngine,
            "func": FuncDPEngine,
            "factored": FactoredDPEngine,
        }
        engine = engines[kind]()
        model, optimizer, loader = engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            poisson_sampling=False,
            grad_sample_mode=mode if kind in ("opacus", "rs") else "hooks",
        )
        # rs r=0: no mask (what training does at r = 0); func r=0: the all-kept mask.
        if rate is not None and (rate > 0 or kind == "func"):
            numel = engine.layout.numel
            mask = sample_mask(numel, keep=keep_count(numel, rate=rate), seed=1)
            engine.set_mask(mask.to(device))
    xb, yb = next(iter(loader))
    criterion = nn.CrossEntropyLoss()

    def step() -> None:
        if isinstance(model, (FuncGradSampleModule, FactoredGradSampleModule)):
            model.backward_per_sample(xb, yb, criterion=criterion)
        else:
            criterion(model(xb), yb).backward()
        optimizer.step()
        # Here rather than first: frees the B x d per-sample gradients before the next
        # configuration runs (9 of them would hold 4.5 GB at batch 256).
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    step()  # warm-up
    return step


def worker(conn: Connection, kind: str, rate: float | None, args: dict) -> None:
    """One configuration's process: builds its runner, then times ``steps`` steps per request."""
    warnings.filterwarnings("ignore")
    if args["malloc"] == "retain" and not retain_freed_memory():
        raise RuntimeError("--malloc retain: this C library has no glibc mallopt")
    torch.set_num_threads(args["threads"])
    device = torch.device(args["device"])
    step = make_runner(kind, rate, args["batch"], args["mode"], device, args["model"])
    conn.send("ready")
    while conn.recv() == "run":
        start = time.perf_counter()
        for _ in range(args["steps"]):
            step()
        conn.send((time.perf_counter() - start) / args["steps"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="steps per timed sample")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--model", default="dpcnn", choices=MODEL_NAMES)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mode", default="hooks", help="Opacus grad_sample_mode")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    parser.add_argument(
        "--malloc",
        default="default",
        choices=["default", "retain"],
        help="glibc allocator settings of the worker processes (module docstring)",
    )
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated config labels (default: all); "
        "non-private is always run, and a ratio is printed when both of its configs ran",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    name = args.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    only = {label for label in args.only.split(",") if label} | {"non-private"}
    unknown = only - {label for label, _, _ in CONFIGS}
    if unknown:
        parser.error(f"--only: unknown config(s) {', '.join(sorted(unknown))}")
    configs = [c for c in CONFIGS if not args.only or c[0] in only]
    context = mp.get_context("spawn")
    settings = {
        "threads": args.threads,
        "batch": args.batch,
        "mode": args.mode,
        "device": str(device),
        "steps": args.steps,
        "model": args.model,
        "malloc": args.malloc,
    }
    workers: dict[str, tuple[mp.process.BaseProcess, Connection]] = {}
    try:
        for label, kind, rate in configs:  # one at a time: a build does not overlap a step
            ours, theirs = context.Pipe()
            process = context.Process(target=worker, args=(theirs, kind, rate, settings))
            process.start()
            if ours.recv() != "ready":
                raise RuntimeError(f"{label}: the worker did not start")
            workers[label] = (process, ours)
        samples: dict[str, list[float]] = {label: [] for label in workers}
        for _ in range(args.reps):
            for label, (_, conn) in workers.items():
                conn.send("run")
                samples[label].append(conn.recv())
    finally:
        for process, conn in workers.values():
            with contextlib.suppress(OSError):
                conn.send("stop")
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    where = f"{args.threads} threads"
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    print(
        f"{args.model}, batch {args.batch}, {where}, torch {torch.__version__}, "
        f"grad_sample_mode={args.mode}, malloc {args.malloc}, a process per config, "
        f"median of {args.reps} x {args.steps} steps"
    )
    opacus, plain = samples.get("opacus"), samples["non-private"]
    print(
        f"{'config':<12} {'s/step':>8} {'ex/s':>9} "
        f"{'time / opacus [95% CI]':>26} {'throughput / non-private [95% CI]':>36}"
    )
    for label, times in samples.items():
        med = statistics.median(times)
        vs_opacus = " " * 26
        if opacus is not None:
            r, lo, hi = ratio_interval(times, opacus)
            vs_opacus = f"{r:>10.3f} [{lo:.3f}, {hi:.3f}]"
        t, tlo, thi = ratio_interval(plain, times)  # throughput ratio = time ratio inverted
        print(
            f"{label:<12} {med:>8.4f} {args.batch / med:>9.1f} "
            f"{vs_opacus} {t:>20.3f} [{tlo:.3f}, {thi:.3f}]"
        )
    pairs = [(a, b) for a, b in OVERHEADS if a in samples and b in samples]
    if pairs:
        print("time ratios (RS overhead: RS / the same engine without a mask) [95% CI]")
    for num, den in pairs:
        r, lo, hi = ratio_interval(samples[num], samples[den])
        print(f"{num + ' / ' + den:<24} {r:>8.3f} [{lo:.3f}, {hi:.3f}]")


if __name__ == "__main__":
    main()
