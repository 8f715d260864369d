"""The ``fedsparse`` command line.

``fedsparse simulate`` runs the federated app on Flower's simulation engine (Ray backend)
and writes ``rounds.jsonl`` and ``summary.json``; ``fedsparse demo`` is ``simulate`` on the
embedded digits; ``fedsparse train`` runs centralized DP-SGD with random sparsification (RS
paper, Algorithm 1) and writes ``epochs.jsonl`` and ``summary.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import warnings
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.console import Console

from fedsparse.common.data import load_dataset
from fedsparse.common.masks import derive_seed
from fedsparse.common.models import DEFAULT_MODELS, build_model, count_parameters
from fedsparse.common.training import (
    EpochStats,
    PrivacyConfig,
    SparsityConfig,
    TrainConfig,
    train_centralized,
)

# Opacus/torch chatter that says nothing about this run: seeded (non-secure) RNG is the
# documented default, the RDP order warning is informational, and Opacus's hooks fire on inputs
# that do not require grad by design.
for _message in (
    "Secure RNG turned off",
    "Optimal order is the largest alpha",
    "Full backward hook is firing",
):
    warnings.filterwarnings("ignore", message=_message)

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
console = Console()
if not console.is_terminal:  # logs and CI: do not squeeze the round table into 80 columns
    console = Console(width=140)


def run_train(
    *,
    out: Path,
    dataset: str,
    data_dir: Path | None,
    model_name: str | None,
    privacy: PrivacyConfig,
    sparsity: SparsityConfig,
    train: TrainConfig,
) -> dict:
    """Runs centralized training, printing a table per epoch; returns the summary dict."""
    torch.set_num_threads(max(1, torch.get_num_threads()))
    out.mkdir(parents=True, exist_ok=True)
    train_split, test_split = load_dataset(dataset, data_dir=data_dir, seed=train.seed)
    model_name = model_name or DEFAULT_MODELS[dataset]
    with torch.random.fork_rng():
        torch.manual_seed(derive_seed(train.seed, 0) % 2**31)
        model = build_model(model_name)
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
        )
    finally:
        log.close()
    last = history[-1]
    summary = {
        "dataset": dataset,
        "model": model_name,
        "parameters": count_parameters(model),
        "final_test_accuracy": last.test_accuracy,
        "final_test_loss": last.test_loss,
        "epsilon": last.epsilon,
        "delta": privacy.delta,
        "mean_keep_fraction": sum(h.keep_fraction for h in history) / len(history),
        "wall_seconds": time.perf_counter() - started,
        "privacy": dataclasses.asdict(privacy),
        "sparsity": dataclasses.asdict(sparsity),
        "train": dataclasses.asdict(train),
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


@app.command()
def train(
    out: Annotated[Path, Opt(help="output directory")] = Path("runs/train"),
    dataset: Annotated[str, Opt(help="digits | mnist | fmnist | cifar10 | svhn")] = "digits",
    data_dir: Annotated[Path | None, Opt(help="directory with the dataset's files")] = None,
    model: Annotated[str | None, Opt(help="model name (default: per dataset)")] = None,
    epochs: Annotated[int, Opt(help="training epochs E")] = 15,
    batch_size: Annotated[int, Opt(help="expected (Poisson) batch size")] = 64,
    lr: Annotated[float, Opt(help="learning rate")] = 0.5,
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
    cooling_steps: Annotated[int, Opt(help="cooling time e* for --schedule cooling")] = 1,
    mechanism: Annotated[str, Opt(help="dpsgd | clipped | noisy")] = "dpsgd",
    accountant: Annotated[str, Opt(help="rdp | prv | gdp")] = "rdp",
    max_physical_batch_size: Annotated[int, Opt(help="BatchMemoryManager limit, 0 = off")] = 0,
    seed: Annotated[int, Opt(help="seed for init, sampling, noise and masks")] = 0,
) -> None:
    """Centralized DP-SGD with random sparsification (RS paper, Algorithm 1)."""
    if noise_multiplier is not None:
        target_epsilon = None
    try:
        privacy = PrivacyConfig(
            mechanism=mechanism,
            noise_multiplier=noise_multiplier,
            target_epsilon=target_epsilon,
            delta=delta,
            max_grad_norm=max_grad_norm,
            accountant=accountant,
        )
        sparsity = SparsityConfig(
            schedule=schedule,
            final_rate=final_rate,
            cooling_steps=cooling_steps,
            mask_seed=derive_seed(seed, 3),
        )
        config = TrainConfig(
            epochs=epochs,
            batch_size=batch_size,
            lr=lr,
            momentum=momentum,
            max_physical_batch_size=max_physical_batch_size,
            seed=seed,
        )
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    if dataset not in DEFAULT_MODELS:
        raise typer.BadParameter(
            f"dataset={dataset!r}: expected one of {', '.join(DEFAULT_MODELS)}"
        )
    run_train(
        out=out,
        dataset=dataset,
        data_dir=data_dir,
        model_name=model,
        privacy=privacy,
        sparsity=sparsity,
        train=config,
    )


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
    timeout: Annotated[float, Opt(help="seconds before the run is stopped")] = 3600.0,
) -> None:
    """Federated DP-SGD + RS on Flower's simulation engine (Ray backend)."""
    from fedsparse.server.simulate import run_simulation

    if clients < 1:
        raise typer.BadParameter(f"clients={clients}: expected >= 1")
    overrides = _parse_sets(set_ or [])
    try:
        summary = run_simulation(
            out=out,
            overrides=overrides,
            clients=clients,
            cpus_per_client=cpus_per_client,
            timeout=timeout,
            console=console,
        )
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    except RuntimeError as err:
        console.print(f"[bold red]simulation failed:[/] {err}")
        raise typer.Exit(1) from err
    up, dense = summary["total_uplink_payload_bytes"], summary["total_dense_uplink_bytes"]
    console.print(
        f"[bold green]final test accuracy {summary['final_test_accuracy']:.4f}[/], "
        f"epsilon max {summary['epsilon_max']:.3f} (median {summary['epsilon_median']:.3f}) at "
        f"delta={summary['delta']:g}\nuplink {up / 1e6:.3f} MB vs dense {dense / 1e6:.3f} MB "
        f"({summary['uplink_savings']:.2f}x less); Flower messages "
        f"{summary['total_uplink_message_bytes'] / 1e6:.3f} MB; wrote {out / 'rounds.jsonl'}"
    )


@app.command()
def demo(out: Annotated[Path, Opt(help="output directory")] = Path("runs/demo")) -> None:
    """10 clients on the embedded digits: epsilon=3, gradual cooling to r*=0.7, 10 rounds."""
    simulate(out=out, clients=10, set_=None, cpus_per_client=1.0, timeout=3600.0)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
