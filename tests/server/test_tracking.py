"""``server/tracking.py``: TensorBoard and MLflow logs read back, and the per-run plot."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedsparse.common.wire.run_log import RoundLog
from fedsparse.server.tracking import Trackers, TrackingError, mlflow_uri, plot_run, read_rounds

CONFIG = {"num-rounds": 3, "method": "rs", "final-rate": 0.9}


def round_log(number: int, *, accuracy: float, epsilon: float, failed: bool = False) -> RoundLog:
    return RoundLog(
        round=number,
        num_clients=3,
        num_replies=3,
        num_rejected=0,
        rate=0.9,
        keep=100,
        keep_fraction=0.1,
        test_accuracy=accuracy,
        test_loss=2.0 - accuracy,
        epsilon_max=epsilon,
        epsilon_median=epsilon / 2,
        train_loss=1.5,
        uplink_payload_bytes=1200 * number,
        uplink_message_bytes=1500 * number,
        downlink_payload_bytes=4000,
        downlink_message_bytes=4200,
        dense_uplink_bytes=12000,
        dense_downlink_bytes=12000,
        wall_seconds=0.5,
        started_at=1.7e9 + number,
        ended_at=1.7e9 + number + 0.5,
        rejected=[],
        failed=failed,
    )


ROUNDS = [round_log(1, accuracy=0.3, epsilon=0.5), round_log(2, accuracy=0.6, epsilon=0.8)]


def test_tensorboard_events_read_back(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trackers = Trackers(["tensorboard"], tmp_path, CONFIG)
    for entry in ROUNDS:
        trackers.log_round(entry)
    trackers.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    accuracy = [(e.step, round(e.value, 6)) for e in events.Scalars("accuracy/test")]
    assert accuracy == [(1, 0.3), (2, 0.6)]
    assert [e.value for e in events.Scalars("bytes/uplink_payload")] == [1200, 2400]
    assert [round(e.value, 6) for e in events.Scalars("bytes/uplink_bits_per_param")] == [3.2, 6.4]
    assert "privacy/user_epsilon" not in events.Tags()["scalars"]  # null: does not apply


def test_mlflow_store_reads_back(tmp_path: Path) -> None:
    mlflow = pytest.importorskip("mlflow")
    run_dir = tmp_path / "run-7"
    trackers = Trackers(["mlflow"], run_dir, CONFIG)
    for entry in ROUNDS:
        trackers.log_round(entry)
    trackers.close()
    client = mlflow.MlflowClient(tracking_uri=mlflow_uri(run_dir))
    experiment = client.get_experiment_by_name("fedsparse")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "run-7" and run.info.status == "FINISHED"
    assert run.data.params == {key: str(value) for key, value in CONFIG.items()}
    history = client.get_metric_history(run.info.run_id, "privacy.epsilon_max")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.8)]


def test_an_unknown_tracker_is_named_and_none_is_a_no_op(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="log='wandb': expected some of tensorboard, mlflow"):
        Trackers(["wandb"], tmp_path, CONFIG)
    quiet = Trackers([], tmp_path, CONFIG)
    quiet.log_round(ROUNDS[0])
    quiet.close()
    assert list(tmp_path.iterdir()) == []


def test_a_missing_package_fails_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow raises ImportError
    with pytest.raises(TrackingError, match=r"log=mlflow: .*fedsparse\[tracking\]"):
        Trackers(["mlflow"], tmp_path, CONFIG)


def test_a_tracker_that_fails_mid_run_is_dropped_not_fatal(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    trackers = Trackers(["tensorboard"], tmp_path, CONFIG)

    class Broken:
        def log_scalars(self, step: int, scalars: object) -> None:
            raise OSError("disk full")

        def close(self) -> None:
            raise AssertionError("a dropped tracker is not closed")

    trackers._trackers.append(Broken())
    trackers.log_round(ROUNDS[0])
    trackers.log_round(ROUNDS[1])
    trackers.close()
    assert trackers.failures == ["Broken: disk full"]


def test_the_run_plot_and_rounds_jsonl(tmp_path: Path) -> None:
    lines = [
        entry.to_json() for entry in [*ROUNDS, round_log(3, accuracy=0.6, epsilon=1.0, failed=True)]
    ]
    (tmp_path / "rounds.jsonl").write_text("\n".join(lines) + '\n{"round": 4, "num_cl')  # cut
    rounds = read_rounds(tmp_path / "rounds.jsonl")
    assert [entry.round for entry in rounds] == [1, 2, 3]
    path = plot_run(rounds, tmp_path / "run.png", title="rs, 3 clients")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_a_federated_run_logs_each_round_and_draws_its_plot(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fedsparse.client.app import app as client_app
    from fedsparse.client.node_policy import SIMULATION_NODE_POLICY
    from fedsparse.common.config import FederatedConfig
    from fedsparse.lab.simulation.inprocess import InProcessGrid
    from fedsparse.server.app import run_federated

    cfg = FederatedConfig(num_rounds=2, out_dir=str(tmp_path / "run"), log="tensorboard")
    grid = InProcessGrid(
        client_app, num_nodes=2, run_config=cfg.to_run_config(), node_config=SIMULATION_NODE_POLICY
    )
    run_federated(grid, cfg)
    rounds = [json.loads(x) for x in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("bytes/uplink_payload")]
    assert logged == [(r["round"], r["uplink_payload_bytes"]) for r in rounds]
    assert (tmp_path / "run" / "run.png").read_bytes()[:4] == b"\x89PNG"


def test_log_takes_tracker_names_only() -> None:
    from fedsparse.common.config import FederatedConfig

    assert FederatedConfig(log="tensorboard, mlflow").trackers == ("tensorboard", "mlflow")
    with pytest.raises(ValueError, match="log='wandb': expected some of tensorboard, mlflow"):
        FederatedConfig.from_run_config({"log": "wandb"})
