"""``fedsparse train --log``: per-epoch metrics in TensorBoard and MLflow, and the run's plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedsparse.lab.cli import app


def test_train_logs_each_epoch_to_both_trackers_and_draws_its_plot(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    mlflow = pytest.importorskip("mlflow")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fedsparse.server.tracking import mlflow_uri

    out = tmp_path / "run"
    args = ["train", "--out", str(out), "--epochs", "2", "--log", "tensorboard,mlflow"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    epochs = [json.loads(line) for line in (out / "epochs.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("accuracy/test")]
    assert logged == [(e["epoch"], pytest.approx(e["test_accuracy"])) for e in epochs]
    client = mlflow.MlflowClient(tracking_uri=mlflow_uri(out))
    (run,) = client.search_runs([client.get_experiment_by_name("fedsparse").experiment_id])
    history = client.get_metric_history(run.info.run_id, "privacy.epsilon")
    assert [(m.step, m.value) for m in history] == [
        (e["epoch"], pytest.approx(e["epsilon"])) for e in epochs
    ]
    assert run.data.params["dataset"] == "digits"
    assert (out / "run.png").read_bytes()[:4] == b"\x89PNG"


def test_an_unknown_tracker_fails_before_anything_starts(tmp_path: Path) -> None:
    out = tmp_path / "never"
    result = CliRunner().invoke(app, ["train", "--out", str(out), "--log", "wandb"])
    assert result.exit_code == 2
    assert "--log='wandb': expected some of tensorboard, mlflow" in " ".join(
        result.output.replace("│", " ").split()
    )
    assert not out.exists()
