"""``fedsparse train``: centralized DP-SGD with random sparsification, from options.

The options become the config dataclasses (``PrivacyConfig``, ``SparsityConfig``,
``MethodConfig``, ``TrainConfig``), every name and value checked before anything runs; the
run itself is ``lab/experiments/train.py:run_train``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Final

import typer

from fedsparse.lab.cli.utils import Opt, choice, console

__all__ = ["TRAIN_DEFAULTS", "train"]

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


def train(
    out: Annotated[Path, Opt(help="output directory")] = Path("runs/train"),
    dataset: Annotated[
        str, Opt(help="digits | mnist | fmnist | cifar10 | svhn | mnist-5k")
    ] = "digits",
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
        Opt(
            help="DP engine (or a user's EngineSpec as package.module:spec): auto (func on "
            "CUDA, else factored) | opacus | func | factored"
        ),
    ] = "auto",
    device: Annotated[str, Opt(help="auto (CUDA if available) | cpu | cuda")] = "auto",
    eval_split: Annotated[
        str, Opt(help="test | validation (a held-out 20% of the training split, for tuning)")
    ] = "test",
    split_seed: Annotated[
        int | None,
        Opt(help="--eval-split validation: the seed of the held-out split (default: --seed)"),
    ] = None,
    retain_memory: Annotated[
        bool,
        Opt(help="keep freed memory for reuse (glibc; faster steps, RSS stays at its peak)"),
    ] = True,
    log: Annotated[
        str,
        Opt(help="tensorboard, mlflow or both, comma-separated: per-epoch metrics in --out"),
    ] = "",
    overwrite: Annotated[
        bool, Opt(help="replace the run OUT holds (its files are removed first)")
    ] = False,
) -> None:
    """Centralized DP-SGD with random sparsification (RS paper, Algorithm 1) or another method.

    An OUT that holds a run is refused unless --overwrite (its files are removed first)."""
    from fedsparse.common.data.datasets import DATASET_NAMES, EVAL_SPLITS
    from fedsparse.common.dp.accounting import ACCOUNTANTS
    from fedsparse.common.dp.engines import ENGINES as DP_ENGINES
    from fedsparse.common.dp.optimizer import MECHANISMS
    from fedsparse.common.methods import (
        METHODS,
        SELECTION_MODES,
        SELECTIONS,
        MethodConfig,
        method_schedule,
    )
    from fedsparse.common.methods.schedules import SCHEDULES
    from fedsparse.common.models.classifiers import MODEL_NAMES
    from fedsparse.common.seeds import Stream, stream_seed
    from fedsparse.common.training.configs import (
        DEVICES,
        PrivacyConfig,
        SparsityConfig,
        TrainConfig,
    )
    from fedsparse.common.wire.run_log import command_line
    from fedsparse.lab.experiments.train import run_train
    from fedsparse.lab.launch.run_dir import RunFolderError
    from fedsparse.server.tracking import parse_trackers

    if noise_multiplier is not None:
        target_epsilon = None
    try:
        privacy = PrivacyConfig(
            mechanism=choice("mechanism", mechanism, MECHANISMS),
            noise_multiplier=noise_multiplier,
            target_epsilon=target_epsilon,
            delta=delta,
            max_grad_norm=max_grad_norm,
            accountant=choice("accountant", accountant, ACCOUNTANTS),
        )
        method_config = MethodConfig(
            name=choice("method", method, METHODS, plugin=True),
            freeze_layers=freeze_layers,
            freeze_after=freeze_after,
            public_fraction=public_fraction,
            public_epochs=public_epochs,
            selection=choice("selection", selection, SELECTIONS),
            selection_mode=choice("selection-mode", selection_mode, SELECTION_MODES),
            index_budget_fraction=index_budget_fraction,
            group_size=group_size,
        )
        sparsity = SparsityConfig(
            schedule=method_schedule(method_config.name, choice("schedule", schedule, SCHEDULES)),
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
            engine=choice("engine", engine, DP_ENGINES, plugin=True),
            device=choice("device", device, DEVICES),
        )
        dataset_name = choice("dataset", dataset, DATASET_NAMES, plugin=True)
        split = choice("eval-split", eval_split, EVAL_SPLITS)
        model_name = None if model is None else choice("model", model, MODEL_NAMES, plugin=True)
        if model_name is None and dataset_name not in DATASET_NAMES:
            raise ValueError(f"--dataset {dataset_name}: a user's dataset needs --model")
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {out}: exists and is not a directory")
        trackers = parse_trackers(log, field="--log")
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    if retain_memory:
        from fedsparse.lab.simulation.memory import retain_freed_memory

        retain_freed_memory()  # lab/simulation/memory.py; not glibc: left alone
    try:
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
            split_seed=split_seed,
            console=console,
            log=trackers,
            command=command_line(sys.argv),
            overwrite=overwrite,
        )
    except RunFolderError as err:
        raise typer.BadParameter(str(err)) from err
