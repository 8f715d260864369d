"""The ``fedsparse`` command line.

``fedsparse simulate`` runs the federated app on Flower's simulation engine (Ray backend), or
with ``--backend ray`` on Ray workers that each hold many virtual clients (``lab/raygrid.py``),
and writes ``rounds.jsonl`` and ``summary.json``; ``fedsparse demo`` is ``simulate`` on the
embedded digits; ``fedsparse train`` runs centralized DP-SGD with random sparsification (RS
paper, Algorithm 1) and writes ``epochs.jsonl`` and ``summary.json``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import signal
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Final, TypeVar

import torch
import typer
from rich.console import Console

from fedsparse.common.data import (
    DATASET_NAMES,
    EVAL_SPLITS,
    DatasetName,
    EvalSplit,
    load_eval_splits,
)
from fedsparse.common.dp import MECHANISMS
from fedsparse.common.engines import ENGINES as DP_ENGINES
from fedsparse.common.methods import (
    METHODS,
    SELECTION_MODES,
    SELECTIONS,
    MethodConfig,
    method_schedule,
    total_density,
)
from fedsparse.common.models import (
    DEFAULT_MODELS,
    MODEL_NAMES,
    ModelName,
    build_model,
    count_parameters,
)
from fedsparse.common.privacy import ACCOUNTANTS
from fedsparse.common.schedules import SCHEDULES
from fedsparse.common.seeds import Stream, stream_seed
from fedsparse.common.training import (
    DEVICES,
    EpochStats,
    PrivacyConfig,
    SparsityConfig,
    TrainConfig,
    planned_engine,
    train_centralized,
)

#: Opacus/torch chatter that says nothing about a run: seeded (non-secure) RNG is the
#: documented default, the RDP order warning is informational, and Opacus's hooks fire on
#: inputs that do not require grad by design. Ignored while a command runs (``main``).
QUIET_WARNINGS = (
    "Secure RNG turned off",
    "Optimal order is the largest alpha",
    "Full backward hook is firing",
)

Choice = TypeVar("Choice", bound=str)

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    suggest_commands=False,  # click suggests already: once is enough
    help=__doc__,
    pretty_exceptions_show_locals=False,  # locals can hold keys and data; --debug shows frames
)
console = Console()
if not console.is_terminal:  # logs and CI: do not squeeze the round table into 80 columns
    console = Console(width=140)


def run_train(
    *,
    out: Path,
    dataset: DatasetName,
    data_dir: Path | None,
    model_name: ModelName | None,
    privacy: PrivacyConfig,
    sparsity: SparsityConfig,
    train: TrainConfig,
    method: MethodConfig | None = None,
    eval_split: EvalSplit = "test",
    split_seed: int | None = None,
) -> dict[str, Any]:
    """Runs centralized training, printing a table per epoch; returns the summary dict.

    ``eval_split="validation"`` trains without the validation slice and reports accuracy on
    it (the ``test_*`` fields then hold validation numbers): for tuning. ``split_seed`` fixes
    the train/test split (digits') across runs of different seeds (default: the run seed)."""
    method = method or MethodConfig()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    out.mkdir(parents=True, exist_ok=True)
    seed = 0 if train.seed is None else train.seed
    train_split, test_split = load_eval_splits(
        dataset, data_dir=data_dir, seed=seed, eval_split=eval_split, split_seed=split_seed
    )
    model_name = model_name or DEFAULT_MODELS[dataset]
    model = build_model(model_name, seed=stream_seed(seed, Stream.MODEL_INIT) % 2**31)
    console.print(
        f"[bold]{dataset}[/]: {len(train_split)} train / {len(test_split)} test examples; "
        f"model {model_name} with {count_parameters(model):,} trainable parameters"
    )
    started = time.perf_counter()
    log = (out / "epochs.jsonl").open("w")

    def on_epoch(stats: EpochStats) -> None:
        log.write(json.dumps(dataclasses.asdict(stats)) + "\n")
        log.flush()
        console.print(
            f"epoch {stats.epoch:>3}  r={stats.rate:.3f}  kept={stats.keep_fraction:.3f}  "
            f"loss={stats.train_loss:.4f}  test_acc={stats.test_accuracy:.4f}  "
            f"eps={stats.epsilon:.3f}"
        )

    try:
        history = train_centralized(
            model,
            (train_split.x, train_split.y),
            (test_split.x, test_split.y),
            privacy=privacy,
            sparsity=sparsity,
            train=train,
            on_epoch=on_epoch,
            method=method,
        )
    finally:
        log.close()
    last = history[-1]
    summary = {
        "dataset": dataset,
        "eval_split": eval_split,
        "split_seed": seed if split_seed is None else split_seed,
        "model": model_name,
        "parameters": count_parameters(model),
        "final_test_accuracy": last.test_accuracy,
        "final_test_loss": last.test_loss,
        "epsilon": last.epsilon,
        "delta": privacy.delta,
        "mean_keep_fraction": sum(h.keep_fraction for h in history) / len(history),
        # random freeze's total density: trained coordinates over dense ones, every step
        # weighted alike (Poisson epochs have the same expected number of steps)
        "total_density": total_density(
            [round(h.keep_fraction * count_parameters(model)) for h in history],
            [1.0] * len(history),
            numel=count_parameters(model),
        ),
        "method": dataclasses.asdict(method),
        "index_epsilon": last.index_epsilon,
        "wall_seconds": time.perf_counter() - started,
        "privacy": dataclasses.asdict(privacy),
        "sparsity": dataclasses.asdict(sparsity),
        "train": dataclasses.asdict(train),
        "engine": planned_engine(train.engine, model_name, train.device),  # "auto" resolved
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    eps = "inf (non-private ablation)" if math.isinf(last.epsilon) else f"{last.epsilon:.3f}"
    console.print(
        f"[bold green]final test accuracy {last.test_accuracy:.4f}[/], epsilon {eps} at "
        f"delta={privacy.delta:g}, mean kept fraction {summary['mean_keep_fraction']:.3f}; "
        f"wrote {out / 'epochs.jsonl'} and {out / 'summary.json'}"
    )
    return summary


Opt = typer.Option

#: ``fedsparse train``'s (epochs, batch size, learning rate) per dataset when not given: the
#: baseline's (rate 0, epsilon 3) best mean accuracy on the dataset's validation split
#: (``--eval-split validation``), not RS's. digits: lr 0.1 / 0.25 / 0.5 / 1 at 15 epochs, batch
#: 64, 2 seeds: 0.875 / 0.909 / 0.880 / 0.740. mnist-5k: at batch 256, (epochs, lr) in
#: {10, 20, 30} x {0.5, 1, 2}, 1-3 seeds: (30, 0.5) 0.903, (20, 0.5) 0.898, (20, 1) 0.895,
#: (10, 1) 0.893, the others <= 0.88. Other datasets take digits'.
TRAIN_DEFAULTS: Final[dict[str, tuple[int, int, float]]] = {
    "digits": (15, 64, 0.25),
    "mnist-5k": (30, 256, 0.5),
}


#: Backend names every command accepts: one vocabulary, ``simulate``'s and ``sweep``'s.
#: ``flower`` (``simulate``) and ``simulation`` (``sweep``) are Flower's simulation engine.
BACKEND_ALIASES: dict[str, str] = {"simulation": "flower", "flower": "simulation"}


def _choice(
    field: str, value: str, choices: Sequence[Choice], *, aliases: Mapping[str, str] = {}
) -> Choice:
    """``value`` as the one of ``choices`` it names (directly or through ``aliases``).

    Raises:
        ValueError: none of them (naming ``field`` and ``value``, and the closest choice).
    """
    for choice in choices:
        if aliases.get(value, value) == choice or value == choice:
            return choice
    close = difflib.get_close_matches(value, list(choices), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"{field}={value!r}: expected one of {', '.join(choices)}{hint}")


@app.command()
def train(
    out: Annotated[Path, Opt(help="output directory")] = Path("runs/train"),
    dataset: Annotated[str, Opt(help="digits | mnist | fmnist | cifar10 | svhn")] = "digits",
    data_dir: Annotated[Path | None, Opt(help="directory with the dataset's files")] = None,
    model: Annotated[str | None, Opt(help="model name (default: per dataset)")] = None,
    epochs: Annotated[int | None, Opt(help="training epochs E (default: per dataset)")] = None,
    batch_size: Annotated[
        int | None, Opt(help="expected (Poisson) batch size (default: per dataset)")
    ] = None,
    lr: Annotated[float | None, Opt(help="learning rate (default: per dataset)")] = None,
    momentum: Annotated[float, Opt(help="SGD momentum")] = 0.0,
    max_grad_norm: Annotated[float, Opt(help="per-sample clipping bound C")] = 1.0,
    noise_multiplier: Annotated[
        float | None, Opt(help="sigma (else from --target-epsilon)")
    ] = None,
    target_epsilon: Annotated[float | None, Opt(help="target epsilon")] = 3.0,
    delta: Annotated[float, Opt(help="delta")] = 1e-5,
    final_rate: Annotated[float, Opt(help="final sparsification rate r*")] = 0.7,
    schedule: Annotated[
        str, Opt(help="gradual | cooling | constant | linear-keep | exp-keep")
    ] = "gradual",
    cooling_steps: Annotated[
        int, Opt(help="cooling time e* for --schedule cooling and --method random-freeze")
    ] = 1,
    method: Annotated[
        str,
        Opt(
            help="rs | random-freeze (schedule cooling) | lf (layer freezing) | ranked | dpssgd "
            "| gip (noisy top-k per step) | random-k"
        ),
    ] = "rs",
    freeze_layers: Annotated[int, Opt(help="--method lf: layers m_f frozen")] = 1,
    freeze_after: Annotated[int, Opt(help="--method lf: first frozen epoch t_f (0-based)")] = 0,
    public_fraction: Annotated[
        float, Opt(help="--method dpssgd: share of the training set declared public")
    ] = 0.1,
    public_epochs: Annotated[int, Opt(help="--method dpssgd: pretraining epochs on it")] = 5,
    selection: Annotated[str, Opt(help="--method dpssgd: magnitude | random")] = "magnitude",
    selection_mode: Annotated[
        str, Opt(help="--method dpssgd: freeze (select once) | reselect (every epoch)")
    ] = "freeze",
    index_budget_fraction: Annotated[
        float, Opt(help="--method gip: share of --target-epsilon spent on the indices")
    ] = 0.01,
    group_size: Annotated[int, Opt(help="--method gip / random-k: group length l")] = 256,
    final_keep: Annotated[
        float, Opt(help="--schedule linear-keep / exp-keep: the final keep ratio k")
    ] = 1.0,
    mechanism: Annotated[str, Opt(help="dpsgd | clipped | noisy")] = "dpsgd",
    accountant: Annotated[str, Opt(help="rdp | prv | gdp")] = "rdp",
    max_physical_batch_size: Annotated[int, Opt(help="BatchMemoryManager limit, 0 = off")] = 0,
    seed: Annotated[int, Opt(help="seed for init, sampling, noise and masks")] = 0,
    engine: Annotated[
        str,
        Opt(help="DP engine: auto (func on CUDA, else factored) | opacus | func | factored"),
    ] = "auto",
    device: Annotated[str, Opt(help="auto (CUDA if available) | cpu | cuda")] = "auto",
    eval_split: Annotated[
        str, Opt(help="test | validation (a held-out 20% of the training split, for tuning)")
    ] = "test",
    retain_memory: Annotated[
        bool,
        Opt(help="keep freed memory for reuse (glibc; faster steps, RSS stays at its peak)"),
    ] = True,
) -> None:
    """Centralized DP-SGD with random sparsification (RS paper, Algorithm 1) or another method."""
    if noise_multiplier is not None:
        target_epsilon = None
    try:
        privacy = PrivacyConfig(
            mechanism=_choice("mechanism", mechanism, MECHANISMS),
            noise_multiplier=noise_multiplier,
            target_epsilon=target_epsilon,
            delta=delta,
            max_grad_norm=max_grad_norm,
            accountant=_choice("accountant", accountant, ACCOUNTANTS),
        )
        method_config = MethodConfig(
            name=_choice("method", method, METHODS),
            freeze_layers=freeze_layers,
            freeze_after=freeze_after,
            public_fraction=public_fraction,
            public_epochs=public_epochs,
            selection=_choice("selection", selection, SELECTIONS),
            selection_mode=_choice("selection-mode", selection_mode, SELECTION_MODES),
            index_budget_fraction=index_budget_fraction,
            group_size=group_size,
        )
        sparsity = SparsityConfig(
            schedule=method_schedule(method_config.name, _choice("schedule", schedule, SCHEDULES)),
            final_rate=final_rate,
            final_keep=final_keep,
            cooling_steps=cooling_steps,
            mask_seed=stream_seed(seed, Stream.EPOCH_MASKS),
        )
        default_epochs, default_batch, default_lr = TRAIN_DEFAULTS.get(
            dataset, TRAIN_DEFAULTS["digits"]
        )
        config = TrainConfig(
            epochs=default_epochs if epochs is None else epochs,
            batch_size=default_batch if batch_size is None else batch_size,
            lr=default_lr if lr is None else lr,
            momentum=momentum,
            max_physical_batch_size=max_physical_batch_size,
            seed=seed,
            engine=_choice("engine", engine, DP_ENGINES),
            device=_choice("device", device, DEVICES),
        )
        dataset_name = _choice("dataset", dataset, DATASET_NAMES)
        split = _choice("eval-split", eval_split, EVAL_SPLITS)
        model_name = None if model is None else _choice("model", model, MODEL_NAMES)
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {out}: exists and is not a directory")
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    if retain_memory:
        from fedsparse.lab.memory import retain_freed_memory

        retain_freed_memory()  # lab/memory.py; a C library other than glibc is left alone
    run_train(
        out=out,
        dataset=dataset_name,
        data_dir=data_dir,
        model_name=model_name,
        privacy=privacy,
        sparsity=sparsity,
        train=config,
        method=method_config,
        eval_split=split,
    )


def _rate(field: str, text: str | None) -> float | None:
    """A link rate option in bit/s (``lab/netns.py:parse_rate``), or None if not given."""
    from fedsparse.lab.netns import parse_rate

    return None if text is None else parse_rate(text, field=field)


def _parse_sets(items: list[str]) -> dict[str, str]:
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"--set {item!r}: expected key=value")
        overrides[key.strip()] = value.strip()
    return overrides


@app.command()
def simulate(
    out: Annotated[Path, Opt(help="output directory")] = Path("runs/simulate"),
    clients: Annotated[int, Opt(help="number of virtual clients (SuperNodes)")] = 10,
    set_: Annotated[list[str] | None, Opt("--set", help="run-config override key=value")] = None,
    cpus_per_client: Annotated[float, Opt(help="Ray CPUs per virtual client")] = 1.0,
    gpus_per_client: Annotated[
        float, Opt(help="Ray GPUs per virtual client, fractional (0.25: 4 share a GPU)")
    ] = 0.0,
    timeout: Annotated[float, Opt(help="seconds before the run is stopped")] = 3600.0,
    resume: Annotated[
        bool, Opt(help="continue the run in OUT from its checkpoint (same --set values)")
    ] = False,
    backend: Annotated[
        str,
        Opt(help="flower (alias simulation): Flower's engine | ray: many clients per worker"),
    ] = "flower",
) -> None:
    """Federated DP-SGD + RS on Flower's simulation engine (Ray backend).

    --backend ray runs the same server loop and ClientApp on a local Ray cluster whose
    workers (one per CPU, or per --gpus-per-client share of a GPU) each hold many virtual
    clients and train a batch of them per Ray task: for 1000+ clients. With the same seeds
    and full participation it ends with the same model as --backend flower, bit for bit.

    With --resume, a run that was stopped (signal, crash, timeout) continues from its last
    checkpoint (OUT/checkpoint.pt, the nodes' states in OUT/node-state) and ends with the
    same model as the run that was never stopped; give it the same --set values.
    """
    from fedsparse.lab.simulate import ENGINES, run_simulation

    overrides = _parse_sets(set_ or [])
    try:
        summary = run_simulation(
            out=out,
            overrides=overrides,
            clients=clients,
            cpus_per_client=cpus_per_client,
            gpus_per_client=gpus_per_client,
            timeout=timeout,
            console=console,
            resume=resume,
            backend=_choice("backend", backend, ENGINES, aliases=BACKEND_ALIASES),
        )
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    except RuntimeError as err:
        console.print(f"[bold red]simulation failed:[/] {err}")
        raise typer.Exit(1) from err
    up, dense = summary.total_uplink_payload_bytes, summary.total_dense_uplink_bytes
    console.print(
        f"[bold green]final test accuracy {summary.final_test_accuracy:.4f}[/], "
        f"epsilon max {summary.epsilon_max:.3f} (median {summary.epsilon_median:.3f}) at "
        f"delta={summary.delta:g}\nuplink {up / 1e6:.3f} MB vs dense {dense / 1e6:.3f} MB "
        f"({summary.uplink_savings:.2f}x less); Flower messages "
        f"{summary.total_uplink_message_bytes / 1e6:.3f} MB; wrote {out / 'rounds.jsonl'}"
    )


@app.command()
def sweep(
    out: Annotated[Path, Opt(help="output: CSVs, plots, report.md")] = Path("runs/sweep"),
    grid: Annotated[
        list[str] | None, Opt("--grid", help="key=v1,v2,... (repeat for a cartesian product)")
    ] = None,
    set_: Annotated[list[str] | None, Opt("--set", help="fixed override key=value")] = None,
    seeds: Annotated[int, Opt(help="seeds per config: base+0..N-1 (base: --set seed)")] = 1,
    clients: Annotated[int, Opt(help="clients (SuperNodes) per run")] = 10,
    backend: Annotated[
        str, Opt(help="simulation (alias flower) | inprocess | deploy | ray")
    ] = "simulation",
    jobs: Annotated[int, Opt(help="runs at a time")] = 1,
    timeout: Annotated[float, Opt(help="seconds per simulation run")] = 3600.0,
    cpus_per_client: Annotated[float, Opt(help="Ray CPUs per virtual client")] = 1.0,
    gpus_per_client: Annotated[
        float, Opt(help="Ray GPUs per virtual client (simulation, ray), e.g. 0.25")
    ] = 0.0,
    runs_dir: Annotated[Path | None, Opt(help="per-run directories (default OUT/runs)")] = None,
    uplink_rate: Annotated[
        str | None, Opt(help="deploy: shape each node's uplink, e.g. 1mbit")
    ] = None,
    downlink_rate: Annotated[
        str | None, Opt(help="deploy: shape each node's downlink, e.g. 8mbit")
    ] = None,
    tune: Annotated[
        list[str] | None,
        Opt("--tune", help="key=v1,v2,...: tune each grid point (arm) over these, on validation"),
    ] = None,
    tune_seeds: Annotated[int, Opt(help="--tune: seeds per tuning combination")] = 2,
    scale_clip: Annotated[
        bool,
        Opt(
            help="scaling rule (RS App. H): max-grad-norm = C (1 - momentum) per run, C the "
            "--set max-grad-norm tuned at momentum 0, along a --grid momentum=..."
        ),
    ] = False,
) -> None:
    """Bandwidth vs accuracy: a grid of runs x seeds; results/summary CSVs, plots, report.md.

    With --tune, every grid point (arm) is first tuned over the --tune grid on a validation
    split (20% of the training split held out; seeds from base + 1000), then each arm runs at
    its own best on the test split with --seeds paired seeds, and the report compares every
    arm with the first, best vs best, with 95% intervals (lab/tuning.py).

    --backend ray runs every run on one local Ray cluster and one set of workers
    (lab/raygrid.py), one run at a time (--jobs 1): each run uses every worker.
    Finished runs (summary.json with the same config) are reused; failed runs are recorded and
    the sweep goes on (exit code 1 at the end if any failed).
    """
    import shlex

    from fedsparse.lab.report import write_outputs
    from fedsparse.lab.sweep import (
        BACKENDS,
        RunSettings,
        SweepInterrupted,
        check_jobs,
        parse_grid,
        plan_sweep,
        run_sweep,
    )
    from fedsparse.lab.tuning import render_tuning, run_tuned_sweep

    try:
        settings = RunSettings(
            backend=_choice("backend", backend, BACKENDS, aliases=BACKEND_ALIASES),
            clients=clients,
            cpus_per_client=cpus_per_client,
            gpus_per_client=gpus_per_client,
            timeout=timeout,
            uplink_bps=_rate("uplink-rate", uplink_rate),
            downlink_bps=_rate("downlink-rate", downlink_rate),
        )
        check_jobs(settings, jobs)
        fixed = _parse_sets(set_ or [])
        if not tune:
            plan = plan_sweep(
                parse_grid(grid or []), fixed, seeds=seeds, clients=clients, scale_clip=scale_clip
            )
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    args = ["fedsparse", "sweep", "--out", str(out)]
    args += [a for g in grid or [] for a in ("--grid", g)]
    args += [a for s in set_ or [] for a in ("--set", s)]
    args += ["--seeds", str(seeds), "--clients", str(clients), "--backend", backend]
    args += ["--jobs", str(jobs)] + (["--runs-dir", str(runs_dir)] if runs_dir else [])
    args += ["--gpus-per-client", str(gpus_per_client)] if gpus_per_client else []
    args += ["--uplink-rate", uplink_rate] if uplink_rate else []
    args += ["--downlink-rate", downlink_rate] if downlink_rate else []
    args += [a for t in tune or [] for a in ("--tune", t)]
    args += ["--tune-seeds", str(tune_seeds)] if tune else []
    args += ["--scale-clip"] if scale_clip else []
    runs_dir = runs_dir or out / "runs"
    extra: list[str] = []
    try:
        if tune:
            try:
                result = run_tuned_sweep(
                    parse_grid(grid or []),
                    parse_grid(tune),
                    fixed,
                    tune_seeds=tune_seeds,
                    seeds=seeds,
                    settings=settings,
                    runs_dir=runs_dir,
                    jobs=jobs,
                    scale_clip=scale_clip,
                    console=console,
                    tuning_csv=out / "tuning.csv",
                )
            except ValueError as err:
                raise typer.BadParameter(str(err)) from err
            plan, rows = result.plan, result.rows
            extra = render_tuning(
                result.choices, result.differences, tune=parse_grid(tune), tune_seeds=tune_seeds
            )
        else:
            console.print(
                f"[bold]{len(plan.runs)} runs[/] ({len(plan.runs) // seeds} configs x {seeds} "
                f"seeds, {clients} clients, {backend}); run directories under {runs_dir}"
            )
            rows = run_sweep(plan, runs_dir=runs_dir, settings=settings, jobs=jobs, console=console)
    except SweepInterrupted as stop:  # the CSVs and report of what finished, then the exit
        if stop.plan is None and tune:  # stopped while tuning: tuning.csv is not written
            raise
        stopped = stop.plan or plan
        paths = write_outputs(out, stopped, settings, stop.rows, command=shlex.join(args))
        done = sum(r["status"] == "ok" for r in stop.rows)
        console.print(
            f"[bold red]sweep interrupted[/]: {done} of {len(stop.rows)} runs finished; "
            f"wrote {paths['results.csv']} and {paths['report.md']}"
        )
        raise
    paths = write_outputs(out, plan, settings, rows, command=shlex.join(args), extra=extra)
    failed = sum(r["status"] != "ok" for r in rows)
    reused = sum(bool(r["reused"]) for r in rows)
    console.print(
        f"[bold]{len(rows) - failed} ok[/] ({reused} reused), [bold]{failed} failed[/]; "
        f"wrote {paths['results.csv']}, {paths['summary.csv']} and {paths['report.md']}"
    )
    if failed:
        raise typer.Exit(1)


PARTS_ALL: Final = "noise,central,federated,ablations,scaling"


@app.command()
def reproduce(
    out: Annotated[Path, Opt(help="output: report.md, CSVs, plots")] = Path(
        "runs/reproduction/report"
    ),
    runs_dir: Annotated[Path, Opt(help="per-run directories (finished runs are reused)")] = Path(
        "runs/reproduction"
    ),
    parts: Annotated[
        str, Opt(help="comma list of noise, central, federated, ablations, scaling")
    ] = PARTS_ALL,
    jobs: Annotated[int, Opt(help="centralized runs at a time (one torch thread each)")] = 2,
    quick: Annotated[
        bool, Opt(help="a minutes-long plan to try the command (too small to conclude)")
    ] = False,
) -> None:
    """The RS paper's claims re-run (Fig. 1c, Table 2 / Fig. 4 best vs best, Fig. 3, App. H),
    beside the paper's numbers, with verdicts (lab/reproduce.py). The committed report:
    docs/reproduction (about 2 hours on 2 cores)."""
    from fedsparse.lab.reproduce import PARTS, ReproductionPlan, run_reproduction

    chosen = [p.strip() for p in parts.split(",") if p.strip()]
    try:
        for part in chosen:
            _choice("parts", part, PARTS)
        if jobs < 1:
            raise ValueError(f"jobs={jobs}: expected >= 1")
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    plan = ReproductionPlan.quick() if quick else ReproductionPlan.full()
    command = f"fedsparse reproduce --out {out} --runs-dir {runs_dir} --jobs {jobs}"
    command += (" --quick" if quick else "") + (f" --parts {parts}" if parts != PARTS_ALL else "")
    run_reproduction(
        plan,
        out=out,
        runs_dir=runs_dir,
        parts=chosen,
        jobs=jobs,
        log=lambda line: console.print(line, markup=False, highlight=False),
        command=command,
    )
    console.print(f"[bold green]wrote {out / 'report.md'}[/]")


@app.command()
def demo(out: Annotated[Path, Opt(help="output directory")] = Path("runs/demo")) -> None:
    """10 clients on the embedded digits: epsilon=3, gradual cooling to r*=0.7, 10 rounds."""
    simulate(
        out=out,
        clients=10,
        set_=None,
        cpus_per_client=1.0,
        gpus_per_client=0.0,
        timeout=3600.0,
        resume=False,
        backend="flower",
    )


def _print_wire_report(run_dir: Path) -> None:
    from fedsparse.lab.wire import capture_lines, wire_report, wire_table, write_wire_csv

    rows = wire_report(run_dir)
    console.print(wire_table(rows, title=f"bytes per round: {run_dir}"))
    for line in capture_lines(run_dir):
        console.print(line)
    console.print(f"wrote {write_wire_csv(rows, run_dir / 'wire_report.csv')}")


@app.command()
def deploy(
    out: Annotated[Path, Opt(help="output directory")] = Path("runs/deploy"),
    nodes: Annotated[int, Opt(help="flower-supernode processes")] = 2,
    set_: Annotated[list[str] | None, Opt("--set", help="run-config override key=value")] = None,
    insecure: Annotated[
        bool, Opt(help="no TLS and no SuperNode authentication (explicit opt-in)")
    ] = False,
    node_auth: Annotated[
        bool, Opt(help="SuperNode authentication: registered keys only (needs TLS)")
    ] = True,
    tls: Annotated[
        bool, Opt("--tls", hidden=True, help="TLS (the default now; kept for old commands)")
    ] = True,
    uplink_rate: Annotated[
        str | None, Opt(help="shape each node's uplink, e.g. 1mbit, 500kbit, 2000000 (bit/s)")
    ] = None,
    downlink_rate: Annotated[str | None, Opt(help="shape each node's downlink, e.g. 8mbit")] = None,
    idle_seconds: Annotated[float, Opt(help="idle polling measurement before the run")] = 6.0,
    timeout: Annotated[float, Opt(help="seconds before the run is stopped")] = 3600.0,
) -> None:
    """Loopback deployment (SuperLink + SuperNodes over gRPC) with on-the-wire byte counts.

    Secure by default: TLS with a throwaway CA and SuperNode authentication (a registered key
    per node). A SuperNode that dies costs its replies, not the run. With --uplink-rate or
    --downlink-rate each node sits in its own network namespace behind a tbf-shaped veth pair
    (root; else the byte relays shape, labelled) and the time to each accuracy is reported.
    """
    from fedsparse.lab.deploy import run_deployment

    overrides = _parse_sets(set_ or [])
    try:
        up, down = _rate("uplink-rate", uplink_rate), _rate("downlink-rate", downlink_rate)
        run_deployment(
            out=out,
            overrides=overrides,
            num_nodes=nodes,
            timeout=timeout,
            tls=not insecure,
            node_auth=node_auth and not insecure,
            idle_seconds=idle_seconds,
            uplink_bps=up,
            downlink_bps=down,
            on_event=lambda line: console.print(f"[yellow]{line}[/]"),
        )
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    except RuntimeError as err:
        console.print(f"[bold red]deployment failed:[/] {err}")
        raise typer.Exit(1) from err
    _print_wire_report(out)
    _print_time_to_accuracy(out)


#: Accuracies whose time-to-accuracy ``deploy`` prints (those the run reached).
ACCURACY_TARGETS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


def _print_time_to_accuracy(run_dir: Path) -> None:
    from fedsparse.common.records import read_rounds
    from fedsparse.lab.timing import time_to_accuracy

    rounds = read_rounds(run_dir / "rounds.jsonl")
    wire = run_dir / "wire.json"
    shaping = json.loads(wire.read_text()).get("shaping") if wire.exists() else None
    link = "unshaped loopback"
    if shaping:
        rates = [
            f"{name} {shaping[f'{name}_bps'] / 1e6:g} Mbit/s"
            for name in ("uplink", "downlink")
            if shaping.get(f"{name}_bps")
        ]
        link = f"{', '.join(rates)} per node ({shaping['mode']})"
    reached = [
        f"{target:.2f} in {seconds:.1f} s"
        for target in ACCURACY_TARGETS
        if (seconds := time_to_accuracy(rounds, target)) is not None
    ]
    per_round = ", ".join(f"{r.wall_seconds:.1f}" for r in rounds)
    console.print(
        f"time to accuracy ({link}; round wall-clock, rounds.jsonl wall_seconds): "
        f"{'; '.join(reached) or 'no target reached'}; seconds per round: {per_round}"
    )


@app.command()
def compose(
    out: Annotated[Path, Opt(help="compose file to write")] = Path("docker-compose.yml"),
    nodes: Annotated[int, Opt(help="SuperNodes (partition i of N each)")] = 3,
    overlay: Annotated[str | None, Opt(help="write an overlay instead: insecure | gpu")] = None,
    certs: Annotated[str, Opt(help="folder of deploy/certs/generate.sh's files")] = (
        "./deploy/certs"
    ),
    dataset: Annotated[str, Opt(help="the dataset the SuperNodes declare")] = "digits",
) -> None:
    """Writes the compose file for N SuperNodes (TLS + SuperNode auth), or an overlay."""
    from fedsparse.lab.compose import Overlay, write_compose

    overlays: tuple[Overlay, ...] = ("insecure", "gpu")
    try:
        kind = None if overlay is None else _choice("overlay", overlay, overlays)
        path = write_compose(out, nodes, overlay=kind, certs=certs, dataset=dataset)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    console.print(f"wrote {path} ({nodes} SuperNodes{f', {overlay} overlay' if overlay else ''})")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def node(ctx: typer.Context) -> None:
    """A SuperNode that runs only its own installed ClientApp, never the server's code.

    Takes flower-supernode's arguments (--superlink, --root-certificates,
    --auth-supernode-private-key, --node-config, --host/--port of the loopback Runtime API,
    ...) and runs flower-supernode --isolation process with them, launching every ClientApp
    task itself with the fedsparse installed here (client/node.py).
    """
    from fedsparse.client.node import run_node
    from fedsparse.lab.flower import tool

    try:
        code = run_node(ctx.args, supernode=tool("flower-supernode"))
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    raise typer.Exit(code)


@app.command("wire-report")
def wire_report_command(
    run_dir: Annotated[Path, typer.Argument(help="run directory with rounds.jsonl")],
) -> None:
    """Payload, message and wire bytes per round (wire.json if captured); writes a CSV."""
    if not (run_dir / "rounds.jsonl").exists():
        raise typer.BadParameter(f"run_dir={run_dir}: no rounds.jsonl")
    _print_wire_report(run_dir)


def _print_version(value: bool) -> None:
    if not value:
        return
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    parts = ", ".join(f"{name} {of(name)}" for name in ("flwr", "opacus", "torch"))
    console.print(f"fedsparse {of('fedsparse')} ({parts})")
    raise typer.Exit()


@app.callback()
def _options(
    debug: Annotated[bool, Opt(help="show full tracebacks of errors")] = False,
    version: Annotated[
        bool,
        Opt(
            "--version",
            help="print the versions of fedsparse, Flower, Opacus and torch, and exit",
            callback=_print_version,
            is_eager=True,
        ),
    ] = False,
) -> None:
    """Options of every command."""
    _STATE["debug"] = debug


#: What ``main`` needs to know of the command's run: ``--debug``, the stopping signal.
_STATE: dict[str, Any] = {"debug": False, "signal": None}


def _on_signal(signum: int, frame: object) -> None:
    """SIGINT, SIGTERM and SIGHUP alike: stop the command and every process it started.

    The first signal interrupts the main thread and asks every wait loop (worker threads
    included) to stop (``processes.request_stop``); each launcher then stops its processes
    by PID (SIGTERM, SIGKILL after a grace period) and the command exits with 128 + the
    signal's number, its results up to then written. Later signals are ignored, so that they
    cannot cut that clean-up short.
    """
    from fedsparse.lab.processes import request_stop, stopping_processes

    if _STATE["signal"] is not None:
        return
    _STATE["signal"] = signum
    request_stop()
    console.print(
        f"[bold red]{signal.Signals(signum).name}[/]: stopping every process of this command"
    )
    if not stopping_processes():  # else the next wait loop raises, after that clean-up
        raise KeyboardInterrupt(signal.Signals(signum).name)


def _one_line(err: BaseException) -> str:
    text = " | ".join(line.strip() for line in str(err).splitlines() if line.strip())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def main() -> None:
    """Console-script entry point: the command line, without ``QUIET_WARNINGS``.

    SIGINT, SIGTERM and SIGHUP stop the command cleanly (``_on_signal``: no process left,
    partial results valid, exit code 128 + signal number). An unexpected error is one line
    (``--debug`` for the traceback).
    """
    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, _on_signal) for sig in handled}
    code: int | str | None = 0
    try:
        with warnings.catch_warnings():
            for message in QUIET_WARNINGS:
                warnings.filterwarnings("ignore", message=message)
            try:
                app()
            except SystemExit as exit_:  # click's own exit: usage errors, Abort (our signals)
                code = exit_.code
            except KeyboardInterrupt:
                code = 130
            except Exception as err:
                if _STATE["debug"]:
                    raise
                hint = "[dim](--debug: traceback)[/]"
                console.print(f"[bold red]error:[/] {_one_line(err)} {hint}")
                code = 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if _STATE["signal"] is not None:
        code = 128 + int(_STATE["signal"])
    raise SystemExit(code)


if __name__ == "__main__":
    main()
