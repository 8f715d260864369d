"""The reproduction's centralized runs (``fedsparse train``, one ``CentralSpec`` each): run
in worker processes or in this one, recorded with the engine that trained them
(``spec.json``), and reused when a finished run's record matches (``run_specs``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import shlex
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from typing import Any, cast

import torch

from fedsparse.lab.experiments.sweep import stop_pool
from fedsparse.lab.research.reproduction.plan import CentralSpec, Log

__all__ = ["run_specs", "train_command"]


def _execute(spec_json: str, run_dir: str, threads: int) -> dict[str, Any]:
    """Runs one spec into ``run_dir`` (in a worker process when ``jobs > 1``)."""
    from fedsparse.common.known_warnings import quiet_known_warnings
    from fedsparse.common.seeds import Stream, stream_seed
    from fedsparse.common.training.configs import PrivacyConfig, SparsityConfig, TrainConfig
    from fedsparse.lab.experiments.train import run_train

    if threads > 0:
        torch.set_num_threads(threads)
    spec = CentralSpec(**json.loads(spec_json))
    out = Path(run_dir)
    with (
        quiet_known_warnings(),
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),
    ):
        run_train(
            out=out,
            dataset=spec.dataset,  # type: ignore[arg-type]
            data_dir=None,
            model_name=spec.model,  # type: ignore[arg-type]
            privacy=PrivacyConfig(
                mechanism=spec.mechanism,  # type: ignore[arg-type]
                noise_multiplier=spec.noise_multiplier,
                target_epsilon=spec.target_epsilon,
                max_grad_norm=spec.max_grad_norm,
            ),
            sparsity=SparsityConfig(
                schedule="gradual",
                final_rate=spec.rate,
                mask_seed=stream_seed(spec.seed, Stream.EPOCH_MASKS),
            ),
            train=TrainConfig(
                epochs=spec.epochs,
                batch_size=spec.batch_size,
                lr=spec.lr,
                momentum=spec.momentum,
                seed=spec.seed,
            ),
            eval_split=spec.eval_split,  # type: ignore[arg-type]
            split_seed=spec.split_seed,
            command=train_command(spec, out),
            overwrite=True,  # an unfinished run's leftovers (the command claimed the folder)
        )
    (out / "spec.json").write_text(json.dumps(_recorded_spec(spec)) + "\n")
    return _read_row(spec, out, reused=False)


def train_command(spec: CentralSpec, out: Path) -> str:
    """The ``fedsparse train`` line that runs ``spec`` alone into ``out`` (its
    ``summary.json``'s ``command``): the same model, bit for bit."""
    args = ["fedsparse", "train", "--out", str(out), "--dataset", spec.dataset]
    args += ["--model", spec.model] if spec.model is not None else []
    args += ["--epochs", str(spec.epochs), "--batch-size", str(spec.batch_size)]
    args += ["--lr", repr(spec.lr), "--final-rate", repr(spec.rate), "--schedule", "gradual"]
    if spec.noise_multiplier is not None:  # sigma given: no target epsilon
        args += ["--noise-multiplier", repr(spec.noise_multiplier)]
    elif spec.target_epsilon is not None:
        args += ["--target-epsilon", repr(spec.target_epsilon)]
    args += ["--max-grad-norm", repr(spec.max_grad_norm), "--momentum", repr(spec.momentum)]
    args += ["--mechanism", spec.mechanism, "--seed", str(spec.seed)]
    args += ["--eval-split", spec.eval_split, "--split-seed", str(spec.split_seed)]
    return shlex.join(args)


def _recorded_spec(spec: CentralSpec) -> dict[str, Any]:
    """``spec.json``: the spec and the engine that trains it here (``TrainConfig``'s "auto":
    engines agree only to float rounding, so a run by another engine is not this run)."""
    from fedsparse.common.data.datasets import DatasetName
    from fedsparse.common.models.classifiers import DEFAULT_MODELS, ModelName
    from fedsparse.common.training.configs import planned_engine

    model = spec.model or DEFAULT_MODELS[cast(DatasetName, spec.dataset)]
    engine = planned_engine("auto", cast(ModelName, model))
    return {**dataclasses.asdict(spec), "engine": engine}


def _read_row(spec: CentralSpec, run_dir: Path, *, reused: bool) -> dict[str, Any]:
    summary = json.loads((run_dir / "summary.json").read_text())
    epochs = [json.loads(line) for line in (run_dir / "epochs.jsonl").read_text().splitlines()]
    return {
        "slug": spec.slug,
        "status": "ok",
        "reused": reused,
        "final_test_accuracy": summary["final_test_accuracy"],
        "final_train_loss": epochs[-1]["train_loss"],
        "epsilon": summary["epsilon"],
        "curve": [e["test_accuracy"] for e in epochs],
        "loss_curve": [e["train_loss"] for e in epochs],
        "wall_seconds": summary["wall_seconds"],
        "run_dir": str(run_dir),
        "error": "",
    }


def _finished(spec: CentralSpec, run_dir: Path) -> bool:
    try:
        saved = json.loads((run_dir / "spec.json").read_text())
    except (OSError, ValueError):
        return False
    # A spec.json older than its "engine" key ran on Opacus (the CPU's "auto" before the
    # factored engine): no longer this run.
    return saved == _recorded_spec(spec) and (run_dir / "summary.json").is_file()


def other_run(spec: CentralSpec, run_dir: Path) -> str | None:
    """Where ``run_dir`` holds a finished run of another spec: the first differing key with
    both values (it is not rerun over: ``run_dir.claim``'s rule); else None."""
    try:
        saved = json.loads((run_dir / "spec.json").read_text())
    except (OSError, ValueError):
        return None
    if not (run_dir / "summary.json").is_file():
        return None
    wanted = _recorded_spec(spec)
    for key in sorted(set(saved) | set(wanted)):
        if saved.get(key) != wanted.get(key):
            return (
                f"{run_dir} holds a finished run with {key}={saved.get(key)!r}, this plan's "
                f"has {key}={wanted.get(key)!r}: not rerun over it (--overwrite starts over)"
            )
    return None


def run_specs(
    specs: Sequence[CentralSpec], root: Path, *, jobs: int = 1, log: Log | None = None
) -> list[dict[str, Any]]:
    """Every spec's row, in order; finished runs (``spec.json`` equal) are reused, the others
    run ``jobs`` at a time (worker processes with one torch thread each when ``jobs > 1``).
    A run that raises is a row with ``status="failed"`` and its error; the others go on."""
    if jobs < 1:
        raise ValueError(f"jobs={jobs}: expected >= 1")
    rows: dict[str, dict[str, Any]] = {}
    pending: dict[str, CentralSpec] = {}
    seen: dict[str, CentralSpec] = {}
    for spec in specs:
        if seen.setdefault(spec.slug, spec) != spec:  # a slug rounds values (``:g``)
            raise ValueError(
                f"run_specs: {seen[spec.slug]} and {spec} share the directory {spec.slug!r}"
            )
    for spec in specs:
        run_dir = root / spec.slug
        if spec.slug in rows or spec.slug in pending:
            continue
        if _finished(spec, run_dir):
            rows[spec.slug] = _read_row(spec, run_dir, reused=True)
        elif (other := other_run(spec, run_dir)) is not None:
            rows[spec.slug] = {
                "slug": spec.slug,
                "status": "failed",
                "reused": False,
                "run_dir": str(run_dir),
                "error": f"RunFolderError: {other}",
            }
        else:
            pending[spec.slug] = spec

    def failed(spec: CentralSpec, err: BaseException) -> dict[str, Any]:
        return {
            "slug": spec.slug,
            "status": "failed",
            "reused": False,
            "run_dir": str(root / spec.slug),
            "error": f"{type(err).__name__}: {err}",
        }

    total, done = len(pending), 0
    if jobs == 1 or total <= 1:
        for slug, spec in pending.items():
            try:
                rows[slug] = _execute(json.dumps(dataclasses.asdict(spec)), str(root / slug), 0)
            except Exception as err:  # noqa: BLE001 - recorded, the others go on
                rows[slug] = failed(spec, err)
            done += 1
            if log:
                log(f"  [{done}/{total}] {slug}: {_row_text(rows[slug])}")
    else:
        pool = ProcessPoolExecutor(jobs, mp_context=get_context("spawn"))
        try:
            futures = {
                pool.submit(
                    _execute, json.dumps(dataclasses.asdict(spec)), str(root / slug), 1
                ): spec
                for slug, spec in pending.items()
            }
            for future in as_completed(futures):
                spec = futures[future]
                try:
                    rows[spec.slug] = future.result()
                except Exception as err:  # noqa: BLE001 - recorded, the others go on
                    rows[spec.slug] = failed(spec, err)
                done += 1
                if log:
                    log(f"  [{done}/{total}] {spec.slug}: {_row_text(rows[spec.slug])}")
        except BaseException:  # a stop: cancel what is queued, stop the workers by PID
            stop_pool(pool)
            raise
        pool.shutdown(wait=True)
    return [rows[spec.slug] for spec in specs]


def _row_text(row: Mapping[str, Any]) -> str:
    if row["status"] != "ok":
        return f"FAILED {row['error']}"
    return f"acc {row['final_test_accuracy']:.4f}"
