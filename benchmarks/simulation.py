"""Benchmark: fedsparse on Flower's simulation engine against a stock Flower FedAvg + Opacus app.

Both apps do the same work (``benchmarks/stock_flower``): the digits CNN, the same iid
partitions over N clients, every client training every round, one local epoch of DP-SGD with
the same batch size, learning rate and clipping norm, on the same Poisson batches, and the
server's evaluation of each new model on the test split; both run with the same recipe (a
simulation SuperLink, ``flwr run ... --stream``, Ray backend, ``--cpus-per-client`` Ray CPUs
per client, nothing installed at run time). Configurations, for each N:

* ``stock``: ``benchmarks/stock_flower/launch.py``: Flower's ``FedAvg`` and plain Opacus
  ``PrivacyEngine.make_private`` with a fixed noise multiplier; each client reports Opacus's
  ``get_epsilon`` after each round, as Flower's ``examples/opacus`` does (fedsparse's client
  reports ε every round too, from a memoized accountant);
* ``stock-no-eps``: the same without ``get_epsilon`` (``report-epsilon=false``). Opacus's
  RDP over fractional orders costs ~0.3 s per call at q = 0.2 (N = 10) and almost nothing
  at q = 1 (N >= 100: one batch per client): less work than fedsparse does, the floor of
  what Flower + Opacus cost;
* ``fedsparse-sigma``: ``fedsparse simulate`` with the same fixed noise multiplier
  (``target-epsilon=0``), so σ calibration is not part of the comparison; everything else at
  fedsparse's defaults (random sparsification to ``final-rate`` 0.7, values-only payloads,
  records and checkpoints every round);
* ``fedsparse-eps``: ``fedsparse simulate`` at its default ``target-epsilon`` (σ calibrated).

Each is a process tree started from here in its own session. Per run: start-up (process start
to round 1's ``started_at`` in ``rounds.jsonl``), round 1 (start of round 1 to start of round
2: the Ray actors' first imports land here), the steady round (the median over rounds 2..R of
the time from one round's start to the next one's, or to the end of the last round, so that
everything the server does between rounds counts), and the peak over samples (every
``--sample`` seconds) of the summed RSS, and of the summed PSS (every ``PSS_EVERY``-th sample:
reading ``smaps_rollup`` walks each process's page tables, ~50 ms a sample at N = 1000, CPU
taken from the run it measures), of every process of the tree (descendants found in
``/proc``, and those seen before that were reparented). The summed RSS counts shared pages
(torch's libraries, Ray's object store) once per process; PSS divides them among the
processes that share them. Between two runs the script waits ``--settle`` seconds, so that
one run's exit (Ray's shutdown, freed memory) does not overlap the next one's rounds.

The configurations are interleaved, each repetition in a rotated order, so machine noise hits
all alike; the tables give medians and, for each baseline, every other configuration's ratio
to it with a 95% bootstrap interval of the median over the paired repetitions (the ratio of
two configurations' figures within one repetition). The issue's target: steady round <= 1.2x
stock at N = 10 and N = 100. With few repetitions the intervals are wide, and a machine
shared with other work makes every figure noisy.

Every process a run starts is stopped by PID (SIGTERM to the launcher, which stops its own
tree, then SIGKILL to anything of the tree still alive), also on Ctrl-C, SIGTERM or SIGHUP.

Usage: python benchmarks/simulation.py [--clients 10 100 1000] [--reps 3] [--rounds 5]
           [--configs stock stock-no-eps fedsparse-sigma fedsparse-eps]
           [--fedsparse-backend flower] [--noise-multiplier 1.0] [--cpus-per-client 1]
           [--settle 5]
           [--out runs/bench-simulation]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from fedsparse.lab.experiments.stats import ratio_interval

REPO = Path(__file__).resolve().parents[1]
STOCK_LAUNCHER = REPO / "benchmarks" / "stock_flower" / "launch.py"
BIN = Path(sys.executable).parent
CONFIGS = ("stock", "stock-no-eps", "fedsparse-sigma", "fedsparse-eps")
#: The configurations the others are compared with.
BASELINES = ("stock", "stock-no-eps")
#: The issue's target for the steady round, and the N it applies to.
TARGET_RATIO, TARGET_CLIENTS = 1.2, (10, 100)
PAGE = os.sysconf("SC_PAGE_SIZE")
#: Every how many memory samples the (costly) PSS is read too.
PSS_EVERY = 4


# --------------------------------------------------------------------------- process trees


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of ``pid``, or None if gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), int(fields[19])


def _memory(pid: int, *, pss: bool = True) -> tuple[int, int]:
    """(RSS, PSS) of ``pid`` in bytes (PSS 0 unless ``pss``); zeros if it is gone."""
    rss, pss_bytes = 0, 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
    if not pss:
        return rss, 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                pss_bytes = int(line.split()[1]) * 1024
                break
    return rss, pss_bytes


class ProcessTree:
    """The live processes of the tree under ``root``, remembered by (pid, start time).

    A process whose parent exits is reparented (to init, or a subreaper) and leaves the
    ``/proc`` tree of ``root``; remembering every (pid, start time) seen keeps it counted and
    stoppable, and the start time guards against a recycled pid.
    """

    def __init__(self, root: int) -> None:
        self.root = root
        self.seen: dict[int, int] = {}
        self.peak_rss = 0
        self.peak_pss = 0
        self.samples = 0

    def live(self) -> list[int]:
        """Live pids of the tree (its current descendants and the ones seen before)."""
        table: dict[int, tuple[int, int]] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
                table[int(entry.name)] = stat
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        found, stack = [], [self.root]
        while stack:
            pid = stack.pop()
            if pid in table:
                found.append(pid)
                self.seen.setdefault(pid, table[pid][1])
            stack.extend(children.get(pid, []))
        found_set = set(found)
        for pid, start in self.seen.items():  # reparented orphans that are still ours
            if pid not in found_set and pid in table and table[pid][1] == start:
                found.append(pid)
        return found

    def sample(self) -> None:
        """Adds one memory sample of the whole tree to the peaks (PSS every ``PSS_EVERY``)."""
        with_pss = self.samples % PSS_EVERY == 0
        self.samples += 1
        rss, pss = 0, 0
        for pid in self.live():
            r, p = _memory(pid, pss=with_pss)
            rss, pss = rss + r, pss + p
        self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)

    def stop(self, process: subprocess.Popen[bytes], *, grace: float = 30.0) -> None:
        """SIGTERM to the launcher (it stops its tree), then SIGKILL to whatever is left."""
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=grace)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            left = self.live()
            if not left:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline and any(_stat(p) for p in left):
                time.sleep(0.2)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5.0)


class _Stop(KeyboardInterrupt):
    """SIGTERM/SIGHUP, turned into a KeyboardInterrupt so every ``finally`` runs."""


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop(signal.Signals(signum).name)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Ignores SIGINT/SIGTERM/SIGHUP while a run's processes are being stopped."""
    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in handled}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# --------------------------------------------------------------------------- one run


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What every run of the benchmark shares."""

    rounds: int
    noise_multiplier: float
    target_epsilon: float
    local_epochs: int
    batch_size: int
    lr: float
    max_grad_norm: float
    seed: int
    cpus_per_client: float
    timeout: float
    sample: float
    fedsparse_backend: str


@dataclass(frozen=True, kw_only=True)
class RunResult:
    """One run's figures (seconds, bytes); ``error`` is set when it failed."""

    config: str
    clients: int
    rep: int
    startup: float = math.nan
    first_round: float = math.nan
    steady_round: float = math.nan
    total: float = math.nan
    peak_rss: int = 0
    peak_pss: int = 0
    rounds: int = 0
    min_replies: int = -1  # fewest replies in a round (stock: counted; fedsparse: recorded)
    error: str = ""


def command(config: str, clients: int, out: Path, settings: Settings) -> list[str]:
    """The command line of one run of ``config`` on ``clients`` clients, into ``out``."""
    shared: dict[str, object] = {
        "num-rounds": settings.rounds,
        "local-epochs": settings.local_epochs,
        "batch-size": settings.batch_size,
        "lr": settings.lr,
        "max-grad-norm": settings.max_grad_norm,
        "seed": settings.seed,
    }
    if config.startswith("stock"):
        values = {**shared, "min-nodes": clients, "noise-multiplier": settings.noise_multiplier}
        values["report-epsilon"] = "false" if config == "stock-no-eps" else "true"
        args = [sys.executable, str(STOCK_LAUNCHER)]
    else:
        privacy: dict[str, object] = (
            {"target-epsilon": 0, "noise-multiplier": settings.noise_multiplier}
            if config == "fedsparse-sigma"
            else {"target-epsilon": settings.target_epsilon}
        )
        values = {**shared, "min-clients": clients, **privacy}
        args = [str(BIN / "fedsparse"), "simulate"]
        if settings.fedsparse_backend != "flower":
            args += ["--backend", settings.fedsparse_backend]
    sets = [item for k, v in values.items() for item in ("--set", f"{k}={v}")]
    return [
        *args,
        "--out",
        str(out),
        "--clients",
        str(clients),
        "--cpus-per-client",
        f"{settings.cpus_per_client:g}",
        "--timeout",
        f"{settings.timeout:g}",
        *sets,
    ]


def round_figures(rounds: list[dict[str, float]], started: float) -> tuple[float, float, float]:
    """(start-up, round 1, steady round) from ``rounds.jsonl`` lines and the process start."""
    starts = [r["started_at"] for r in rounds]
    ends = [*starts[1:], rounds[-1]["ended_at"]]  # a round lasts until the next one starts
    periods = [end - start for start, end in zip(starts, ends, strict=True)]
    steady = statistics.median(periods[1:]) if len(periods) > 1 else math.nan
    return starts[0] - started, periods[0], steady


def run_one(config: str, clients: int, rep: int, out: Path, settings: Settings) -> RunResult:
    """Runs one configuration as a process tree; measures it; stops all of it."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("rounds.jsonl", "summary.json"):
        (out / name).unlink(missing_ok=True)
    args = command(config, clients, out, settings)
    (out / "command.txt").write_text(" ".join(args) + "\n")
    with (out / "launcher.log").open("wb") as log:
        started = time.time()
        process = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=REPO,
            start_new_session=True,  # a terminal's Ctrl-C reaches this script only
        )
        tree = ProcessTree(process.pid)
        try:
            deadline = time.monotonic() + settings.timeout + 60.0
            while process.poll() is None and time.monotonic() < deadline:
                tree.sample()
                time.sleep(settings.sample)
        finally:
            with _signals_deferred():
                tree.stop(process)
    total = time.time() - started
    result = RunResult(
        config=config,
        clients=clients,
        rep=rep,
        total=total,
        peak_rss=tree.peak_rss,
        peak_pss=tree.peak_pss,
    )
    rounds_path = out / "rounds.jsonl"
    lines = rounds_path.read_text().splitlines() if rounds_path.exists() else []
    rounds = [json.loads(line) for line in lines if line.strip()]
    if process.returncode != 0 or len(rounds) != settings.rounds:
        tail = "\n".join((out / "launcher.log").read_text(errors="replace").splitlines()[-5:])
        return dataclasses.replace(
            result,
            rounds=len(rounds),
            error=f"exit code {process.returncode}, {len(rounds)} rounds: {tail}",
        )
    startup, first, steady = round_figures(rounds, started)
    return dataclasses.replace(
        result,
        startup=startup,
        first_round=first,
        steady_round=steady,
        rounds=len(rounds),
        min_replies=min(int(r.get("num_replies", -1)) for r in rounds),
    )


# --------------------------------------------------------------------------- statistics


METRICS = (  # (label, RunResult field, scale, format)
    ("start-up s", "startup", 1.0, "{:.1f}"),
    ("round 1 s", "first_round", 1.0, "{:.1f}"),
    ("steady s", "steady_round", 1.0, "{:.3f}"),
    ("RSS MB", "peak_rss", 1e-6, "{:.0f}"),
    ("PSS MB", "peak_pss", 1e-6, "{:.0f}"),
)
RATIOS = (("steady", "steady_round"), ("start-up", "startup"), ("RSS", "peak_rss"))


def _paired(
    runs: dict[int, RunResult], base: dict[int, RunResult], field: str
) -> tuple[float, float, float, int] | None:
    """Median ratio ``runs / base`` of ``field`` over shared repetitions, its interval, count."""
    reps = sorted(set(runs) & set(base))
    if not reps:
        return None
    num = [getattr(runs[i], field) for i in reps]
    den = [getattr(base[i], field) for i in reps]
    return (*ratio_interval(num, den), len(reps))


def report(results: Sequence[RunResult], clients: int, configs: Sequence[str]) -> str:
    """The tables of one N: medians per configuration; ratios to each baseline with intervals."""
    ok = [r for r in results if r.clients == clients and not r.error]
    by_config = {c: {r.rep: r for r in ok if r.config == c} for c in configs}
    lines = [
        f"N = {clients}",
        f"{'config':<16} {'runs':>4}" + "".join(f" {m[0]:>11}" for m in METRICS),
    ]
    for config in configs:
        row = f"{config:<16} {len(by_config[config]):>4}"
        for _, field, scale, fmt in METRICS:
            values = [getattr(r, field) * scale for r in by_config[config].values()]
            row += f" {fmt.format(statistics.median(values)) if values else '-':>11}"
        lines.append(row)
    for baseline in [b for b in BASELINES if by_config.get(b)]:
        head = f"{'vs ' + baseline:<21}"
        lines.append(head + "".join(f" {name + ' ratio [95% CI]':>27}" for name, _ in RATIOS))
        for config in [c for c in configs if c != baseline]:
            row = f"{config:<21}"
            for _, field in RATIOS:
                paired = _paired(by_config[config], by_config[baseline], field)
                text = (
                    "-" if paired is None else f"{paired[0]:.3f} [{paired[1]:.3f}, {paired[2]:.3f}]"
                )
                row += f" {text:>27}"
            lines.append(row)
    if clients in TARGET_CLIENTS:
        for baseline in [b for b in BASELINES if by_config.get(b)]:
            for config in [c for c in configs if c.startswith("fedsparse")]:
                paired = _paired(by_config[config], by_config[baseline], "steady_round")
                if paired is None:
                    continue
                mid, lo, hi, count = paired
                verdict = "unclear"  # the interval straddles the target
                if hi <= TARGET_RATIO:
                    verdict = "met"
                elif lo > TARGET_RATIO:
                    verdict = "not met"
                lines.append(
                    f"target steady <= {TARGET_RATIO}x {baseline}, {config}: {verdict} "
                    f"(median {mid:.3f} [{lo:.3f}, {hi:.3f}], {count} paired runs)"
                )
    for r in ok:
        if 0 <= r.min_replies < clients:
            lines.append(f"warning: {r.config} rep {r.rep}: a round had {r.min_replies} replies")
    for r in results:
        if r.clients == clients and r.error:
            lines.append(f"FAILED {r.config} rep {r.rep}: {r.error}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def backend_available(backend: str) -> bool:
    """Whether ``fedsparse simulate --help`` offers ``--backend`` (and names ``backend``)."""
    if backend == "flower":
        return True
    shown = subprocess.run(
        [str(BIN / "fedsparse"), "simulate", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
        check=False,
    ).stdout
    return "--backend" in shown and backend in shown


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each config")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per run (>= 2)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--fedsparse-backend", default="flower", help="flower, or ray if offered")
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument("--target-epsilon", type=float, default=3.0)
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.25)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpus-per-client", type=float, default=1.0)
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    parser.add_argument("--sample", type=float, default=0.5, help="seconds between samples")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds between two runs")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench-simulation")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error(f"--rounds={args.rounds}: expected >= 2 (round 1 is not steady)")
    if not backend_available(args.fedsparse_backend):
        parser.error(
            f"--fedsparse-backend={args.fedsparse_backend!r}: `fedsparse simulate --help` "
            "offers no such --backend"
        )
    settings = Settings(
        rounds=args.rounds,
        noise_multiplier=args.noise_multiplier,
        target_epsilon=args.target_epsilon,
        local_epochs=args.local_epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        max_grad_norm=args.max_grad_norm,
        seed=args.seed,
        cpus_per_client=args.cpus_per_client,
        timeout=args.timeout,
        sample=args.sample,
        fedsparse_backend=args.fedsparse_backend,
    )
    configs = list(dict.fromkeys(args.configs))
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_stop)
    print(
        f"digits CNN, {args.rounds} rounds, batch {args.batch_size}, lr {args.lr}, "
        f"C {args.max_grad_norm}, sigma {args.noise_multiplier} (fedsparse-eps: target "
        f"epsilon {args.target_epsilon}), {args.cpus_per_client:g} Ray CPU per client, "
        f"{os.cpu_count()} cores, fedsparse backend {args.fedsparse_backend}, "
        f"{args.reps} interleaved repetitions",
        flush=True,
    )
    results: list[RunResult] = []
    log = args.out / "results.jsonl"
    args.out.mkdir(parents=True, exist_ok=True)
    log.write_text("")  # this invocation's runs only
    try:
        for clients in args.clients:
            for rep in range(args.reps):
                shift = rep % len(configs)
                for config in configs[shift:] + configs[:shift]:
                    out = args.out / f"n{clients}" / f"{config}-{rep}"
                    if results:
                        time.sleep(args.settle)
                    result = run_one(config, clients, rep, out, settings)
                    results.append(result)
                    with log.open("a") as fh:
                        fh.write(json.dumps(dataclasses.asdict(result)) + "\n")
                    print(
                        f"  N={clients} rep {rep} {config}: "
                        + (
                            f"start-up {result.startup:.1f} s, round 1 "
                            f"{result.first_round:.1f} s, steady {result.steady_round:.3f} s, "
                            f"RSS {result.peak_rss / 1e6:.0f} MB, PSS "
                            f"{result.peak_pss / 1e6:.0f} MB, total {result.total:.0f} s"
                            if not result.error
                            else f"FAILED: {result.error}"
                        ),
                        flush=True,
                    )
            print(report(results, clients, configs), flush=True)
    except KeyboardInterrupt as stop:
        print(f"stopped ({stop or 'SIGINT'}); every process of the runs was stopped")
        for clients in dict.fromkeys(r.clients for r in results):
            print(report(results, clients, configs))
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
