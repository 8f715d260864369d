"""Centralized DP-SGD with random sparsification as a run: a run directory in, a summary out.

``run_train`` loads the dataset's split, builds the model, trains it
(``common/training/centralized.py: train_centralized``; RS paper, Algorithm 1, or another
method) and writes ``epochs.jsonl`` (one line per epoch) and ``summary.json`` into the run
directory. ``fedsparse train`` and the reproduction's centralized runs
(``lab/research/reproduction/central_runs.py``) both call it.

``summary.json`` has the header and figures every run's summary shares with the federated
``RunSummary`` (``common/wire/run_log.py``: ``SHARED_SUMMARY_KEYS``), under the same names:
``kind`` ("train"), ``schema``, ``command``, ``config_hash`` (of ``config``), ``versions``,
``engine``, ``noise_multiplier_min``/``_max`` (both the calibrated sigma),
``final_test_accuracy``, ``final_test_loss``, ``epsilon_max`` (the run's epsilon),
``delta``, ``parameters``, ``wall_seconds``, ``total_density`` and ``config`` (dataset,
model, split, privacy, sparsity, train and method settings). Its own keys stay as before for
the readers of older files: ``epsilon`` (= ``epsilon_max``), ``dataset``, ``eval_split``,
``split_seed``, ``model``, ``mean_keep_fraction``, ``method``, ``index_epsilon`` (GIP's
index selection; ``null`` for a method that spends none), ``privacy``, ``sparsity``,
``train``; new beside them: ``noise_multiplier`` (the sigma DP-SGD ran with, calibrated from
``target_epsilon`` when that is set; ``null`` for a non-private mechanism) and ``epochs``
(the epochs run, where a federated summary has ``rounds``; ``epochs.jsonl`` numbers them
from 0).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from fedsparse.common.data.datasets import DatasetName, EvalSplit, load_eval_splits
from fedsparse.common.dp.mechanisms import is_private
from fedsparse.common.methods import Method, MethodConfig, total_density
from fedsparse.common.models.classifiers import (
    DEFAULT_MODELS,
    ModelName,
    build_model,
    count_parameters,
)
from fedsparse.common.seeds import Stream, stream_seed
from fedsparse.common.training.centralized import train_centralized
from fedsparse.common.training.configs import (
    PrivacyConfig,
    SparsityConfig,
    TrainConfig,
    planned_engine,
)
from fedsparse.common.training.local import EpochStats
from fedsparse.common.wire.run_log import summary_header
from fedsparse.lab.experiments.export import save_trained
from fedsparse.lab.launch.run_dir import claim
from fedsparse.server.tracking import Trackers, plot_series

__all__ = ["run_train"]


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
    console: Console | None = None,
    log: Sequence[str] = (),
    command: str | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Runs centralized training, printing a line per epoch; returns the summary dict.

    An ``out`` that holds a run is refused unless ``overwrite`` (its files are removed first,
    once the data has loaded: ``run_dir.claim``).

    ``eval_split="validation"`` trains without the validation slice and reports accuracy on
    it (the ``test_*`` fields then hold validation numbers): for tuning. ``split_seed`` fixes
    the train/test split (digits') across runs of different seeds (default: the run seed).
    ``console`` prints the progress (default: a console on standard output). ``log`` names
    trackers (``server/tracking.py``: tensorboard, mlflow) that get each epoch's accuracy,
    loss, epsilon and kept fraction; every run also draws ``run.png``. ``command``: the
    command line that started the run, recorded in the summary (None: the Python API).
    """
    console = console or Console()
    method = method or MethodConfig()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    seed = 0 if train.seed is None else train.seed
    train_split, test_split = load_eval_splits(
        dataset, data_dir=data_dir, seed=seed, eval_split=eval_split, split_seed=split_seed
    )
    model_name = model_name or DEFAULT_MODELS[dataset]
    model = build_model(model_name, seed=stream_seed(seed, Stream.MODEL_INIT) % 2**31)
    claim(out, overwrite=overwrite, resumable=False)
    out.mkdir(parents=True, exist_ok=True)  # after the data loaded: a failed start leaves none
    console.print(
        f"[bold]{dataset}[/]: {len(train_split)} train / {len(test_split)} test examples; "
        f"model {model_name} with {count_parameters(model):,} trainable parameters"
    )
    started = time.perf_counter()
    trackers = Trackers(
        log,
        out,
        {
            "dataset": dataset,
            "model": model_name,
            **{f"privacy.{k}": v for k, v in dataclasses.asdict(privacy).items()},
            **{f"sparsity.{k}": v for k, v in dataclasses.asdict(sparsity).items()},
            **{f"train.{k}": v for k, v in dataclasses.asdict(train).items()},
            "method": method.name,
        },
    )
    epochs_log = (out / "epochs.jsonl").open("w")

    def on_epoch(stats: EpochStats) -> None:
        epochs_log.write(json.dumps(dataclasses.asdict(stats)) + "\n")
        epochs_log.flush()
        trackers.log_scalars(
            stats.epoch,
            {
                "accuracy/test": stats.test_accuracy,
                "loss/test": stats.test_loss,
                "loss/train": stats.train_loss,
                "privacy/epsilon": stats.epsilon,
                "sparsity/keep_fraction": stats.keep_fraction,
            },
        )
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
        epochs_log.close()
        trackers.close()
    last = history[-1]
    parameters = count_parameters(model)
    private = is_private(privacy.mechanism)
    sigma = last.noise_multiplier if private else None
    # gip: the index selection's own budget; a method with no split spends none (null)
    spends_index = type(method.method()).split_privacy is not Method.split_privacy
    engine = planned_engine(train.engine, model_name, train.device)  # "auto" resolved
    config = {
        "dataset": dataset,
        "eval_split": eval_split,
        "split_seed": seed if split_seed is None else split_seed,
        "model": model_name,
        "privacy": dataclasses.asdict(privacy),
        "sparsity": dataclasses.asdict(sparsity),
        "train": dataclasses.asdict(train),
        "method": dataclasses.asdict(method),
    }
    summary = {
        **config,
        "parameters": parameters,
        "final_test_accuracy": last.test_accuracy,
        "final_test_loss": last.test_loss,
        "epsilon": last.epsilon,
        "delta": privacy.delta,
        "mean_keep_fraction": sum(h.keep_fraction for h in history) / len(history),
        # random freeze's total density: trained coordinates over dense ones, every step
        # weighted alike (Poisson epochs have the same expected number of steps)
        "total_density": total_density(
            [round(h.keep_fraction * parameters) for h in history],
            [1.0] * len(history),
            numel=parameters,
        ),
        "index_epsilon": last.index_epsilon if spends_index else None,
        "wall_seconds": time.perf_counter() - started,
        "noise_multiplier": sigma,
        "epochs": len(history),
        # the header and names every summary shares (common/wire/run_log.py)
        **summary_header(
            "train",
            config=config,
            command=command,
            engine=engine,
            noise_multiplier_min=sigma,
            noise_multiplier_max=sigma,
        ),
        "epsilon_max": last.epsilon,
        "config": config,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    model_file = save_trained(model, model_name, out)  # what ``fedsparse export`` reads
    plot_series(
        [h.epoch for h in history],
        [
            ("test accuracy", [h.test_accuracy for h in history]),
            ("epsilon", [h.epsilon for h in history]),
            ("kept fraction", [h.keep_fraction for h in history]),
        ],
        out / "run.png",
        xlabel="epoch",
        title=f"{method.name}, {dataset}, {model_name}",
    )
    eps = "inf (non-private ablation)" if math.isinf(last.epsilon) else f"{last.epsilon:.3f}"
    console.print(
        f"[bold green]final test accuracy {last.test_accuracy:.4f}[/], epsilon {eps} at "
        f"delta={privacy.delta:g}, mean kept fraction {summary['mean_keep_fraction']:.3f}; "
        f"wrote {out / 'epochs.jsonl'}, {out / 'summary.json'} and {model_file}"
    )
    return summary
