"""The launch skeleton shared by the simulation and deployment launchers, on tiny processes."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import pytest

from fedsparse.common.wire.run_log import RunSummary
from fedsparse.lab.launch.base import (
    connect,
    log_tails,
    prepare_run,
    read_summary,
    start_process,
    superlink_args,
    wait_for_exit,
)
from fedsparse.lab.launch.processes import Process, free_port, is_zombie

ENV = dict(os.environ)


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _summary_json() -> str:
    return RunSummary(
        rounds=2,
        parameters=10,
        final_test_accuracy=0.5,
        final_test_loss=1.0,
        epsilon_max=2.0,
        epsilon_median=1.5,
        delta=1e-5,
        total_uplink_payload_bytes=100,
        total_uplink_message_bytes=120,
        total_downlink_payload_bytes=200,
        total_downlink_message_bytes=220,
        total_dense_uplink_bytes=400,
        total_dense_downlink_bytes=400,
        uplink_savings=4.0,
        uplink_message_savings=400 / 120,
        rejected_updates=0,
        wall_seconds=3.0,
        config={"num-rounds": 2},
    ).to_json()


def test_a_bad_run_config_touches_nothing(tmp_path: Path) -> None:
    out = tmp_path / "never"
    with pytest.raises(ValueError, match=r"final-rate=1\.5"):
        prepare_run(out, {"final-rate": "1.5"})
    assert not out.exists()


def test_prepare_replaces_flwr_home_keeps_results_and_types_the_overrides(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    (out / ".flwr").mkdir(parents=True)
    (out / ".flwr" / "config.toml").write_text("old")
    for name in ("rounds.jsonl", "summary.json", "wire.json", "keep.txt"):
        (out / name).write_text("old")
    run = prepare_run(out, {"num-rounds": "2", "codec": "coo"}, resume=True)
    assert run.out == out.resolve() and run.config.num_rounds == 2
    assert run.run_config == {"num-rounds": 2, "codec": "coo", "out-dir": str(out.resolve())}
    for name in ("rounds.jsonl", "summary.json", "wire.json", "keep.txt"):
        assert (out / name).read_text() == "old"  # a resumed run keeps its records
    assert not (out / ".flwr").exists()
    assert [p.name for p in run.app.iterdir()] == ["pyproject.toml"]
    assert (run.superlink_log.name, run.flwr_log.name) == ("superlink.log", "flwr.log")


def test_connect_writes_a_private_flwr_home(tmp_path: Path) -> None:
    run = prepare_run(tmp_path, {})
    link = connect(run, name="sim")
    assert link.http_port != link.fleet_port
    assert link.env["FLWR_HOME"] == str(run.flwr_home)
    config = (run.flwr_home / "config.toml").read_text()
    assert f'address = "127.0.0.1:{link.http_port}"' in config and "insecure = true" in config
    args = superlink_args(["--insecure"], http_port=link.http_port, fleet_port=link.fleet_port)
    assert Path(args[0]).name == "flower-superlink" and args[1] == "--insecure"
    assert args[-3:] == [
        "--fleet-api-address",
        f"127.0.0.1:{link.fleet_port}",
        "--disable-runtime-dependency-installation",
    ]


def _stopped(process: Process) -> bool:
    return process.poll() is not None or is_zombie(process.pid)


def test_free_port_never_hands_out_a_port_twice() -> None:
    # 1,000 probes of a ~14,000-port pool repeat some port ~36 times on average (birthday
    # bound): without the record of handed-out ports this fails with probability 1 - e^-36.
    ports = [free_port() for _ in range(1000)]
    assert len(set(ports)) == len(ports)
    with socket.socket() as sock:  # and each was free: the last can still be bound
        sock.bind(("127.0.0.1", ports[-1]))


def test_start_process_waits_for_its_port_logs_and_stops(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "p.log"
    pids: list[int] = []
    server = (
        "import socket, time; s = socket.socket(); "
        f"s.bind(('127.0.0.1', {port})); s.listen(); print('listening', flush=True); "
        "time.sleep(60)"
    )
    with start_process(_python(server), env=ENV, log=log, ports=[port], pids=pids) as process:
        assert pids == [process.pid] and process.poll() is None
        deadline = time.monotonic() + 30
        while "listening" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)  # the port is open: the line is on its way to the log
        assert log.read_text() == "listening\n"
    assert _stopped(process)


def test_wait_for_exit_returns_the_code_after_a_last_poll(tmp_path: Path) -> None:
    polls: list[bool] = []
    with start_process(_python("raise SystemExit(3)"), env=ENV, log=tmp_path / "p.log") as p:
        code = wait_for_exit(p, timeout=30, on_poll=lambda: polls.append(p.poll() is not None))
    assert code == 3 and polls[-1] is True  # the last look comes after the exit


def test_wait_for_exit_names_a_watched_process_that_died(tmp_path: Path) -> None:
    with (
        start_process(_python("raise SystemExit(7)"), env=ENV, log=tmp_path / "a.log") as dead,
        start_process(_python("import time; time.sleep(60)"), env=ENV, log=tmp_path / "b.log") as p,
    ):
        dead.wait(timeout=30)
        with pytest.raises(RuntimeError, match=r"python[0-9.]* exited with code 7$"):
            wait_for_exit(p, timeout=30, watch=[dead])


def test_wait_for_exit_times_out_with_the_hint(tmp_path: Path) -> None:
    sleeper = _python("import time; time.sleep(60)")
    with (
        start_process(sleeper, env=ENV, log=tmp_path / "p.log") as process,
        pytest.raises(RuntimeError, match=r"^timeout=0 s reached; see flwr\.log$"),
    ):
        wait_for_exit(process, timeout=0.2, timeout_hint="; see flwr.log")
    assert _stopped(process)


def test_read_summary(tmp_path: Path) -> None:
    run = prepare_run(tmp_path, {})
    with pytest.raises(
        RuntimeError, match="^flwr run exited with code 0 and no summary.json of this run:\nLOGS$"
    ):
        read_summary(run, 0, logs=lambda: "LOGS")
    (run.out / "summary.json").write_text(_summary_json())
    with pytest.raises(
        RuntimeError, match="^flwr run exited with code 2 and a summary.json of this run:\n"
    ):
        read_summary(run, 2, logs=lambda: "LOGS")
    summary = read_summary(run, 0, logs=lambda: "LOGS")
    assert summary.rounds == 2 and summary.total_uplink_payload_bytes == 100
    data = json.loads(_summary_json())
    del data["epsilon_max"]
    (run.out / "summary.json").write_text(json.dumps(data))
    with pytest.raises(RuntimeError, match="missing field.*epsilon_max"):
        read_summary(run, 0, logs=lambda: "LOGS")


def test_log_tails_show_the_last_lines_of_each_existing_log(tmp_path: Path) -> None:
    (tmp_path / "a.log").write_text("".join(f"a{i}\n" for i in range(30)))
    (tmp_path / "b.log").write_text("only\n")
    text = log_tails([tmp_path / "a.log", tmp_path / "missing.log", tmp_path / "b.log"], lines=2)
    assert text == "--- a.log ---\na28\na29\n--- b.log ---\nonly"
