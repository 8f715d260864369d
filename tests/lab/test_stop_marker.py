"""A stop request reaches the ServerApp before any process is killed: no partial round recorded.

Seen before the marker existed: SIGTERM to ``fedsparse simulate`` killed Ray while the
ServerApp was in round 3; one client's reply came back as ``ActorDiedError``, the round was
aggregated from the other two and checkpointed, and ``--resume`` continued from that partial
round (final weights differed from the uninterrupted run).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fedsparse.common.config import FederatedConfig
from fedsparse.common.layout import ParamLayout
from fedsparse.common.wire.run_log import RoundLog
from fedsparse.lab.launch.base import prepare_run
from fedsparse.lab.launch.processes import clear_stop, request_stop, stop_requested, watch_run_dir
from fedsparse.server.launch_markers import STOP_FILE
from fedsparse.server.run_records import RunRecorder, RunStopped


@pytest.fixture(autouse=True)
def _cleared() -> Iterator[None]:
    clear_stop()
    yield
    clear_stop()


def _entry(server_round: int) -> RoundLog:
    return RoundLog(
        round=server_round,
        num_clients=3,
        num_replies=3,
        num_rejected=0,
        rate=0.0,
        keep=4,
        keep_fraction=1.0,
        test_accuracy=0.5,
        test_loss=1.0,
        epsilon_max=1.0,
        epsilon_median=1.0,
        train_loss=1.0,
        uplink_payload_bytes=1,
        uplink_message_bytes=1,
        downlink_payload_bytes=1,
        downlink_message_bytes=1,
        dense_uplink_bytes=48,
        dense_downlink_bytes=48,
        wall_seconds=0.1,
        started_at=0.0,
        ended_at=0.1,
        rejected=[],
    )


def test_a_stop_request_marks_every_watched_run_before_the_stop_flag(tmp_path: Path) -> None:
    runs = [tmp_path / "a", tmp_path / "b"]
    for out in runs:
        out.mkdir()
        (out / STOP_FILE).write_text("stale, from an earlier stopped run\n")
        watch_run_dir(out)
        assert not (out / STOP_FILE).exists()  # a new run starts unmarked
    request_stop()
    assert stop_requested()
    assert all((out / STOP_FILE).exists() for out in runs)


def test_prepare_run_clears_a_stale_marker(tmp_path: Path) -> None:
    (tmp_path / STOP_FILE).write_text("stale\n")
    prepare_run(tmp_path, {"dataset": "digits"})
    assert not (tmp_path / STOP_FILE).exists()


def test_a_marked_run_records_no_further_round(tmp_path: Path) -> None:
    layout = ParamLayout(names=("w",), shapes=((4,),))
    recorder = RunRecorder(tmp_path, FederatedConfig(out_dir=str(tmp_path)), layout)
    recorder.begin()
    recorder.round_done(_entry(1), torch.ones(4))
    before = (tmp_path / "rounds.jsonl").read_text(), (tmp_path / "checkpoint.pt").read_bytes()
    (tmp_path / STOP_FILE).write_text("the launcher is stopping this run\n")
    with pytest.raises(RunStopped, match="round 2: not recorded: the launcher is stopping"):
        recorder.round_done(_entry(2), torch.full((4,), 2.0))
    after = (tmp_path / "rounds.jsonl").read_text(), (tmp_path / "checkpoint.pt").read_bytes()
    assert after == before
    assert [json.loads(line)["round"] for line in after[0].splitlines()] == [1]
    assert torch.load(tmp_path / "checkpoint.pt")["round"] == 1
