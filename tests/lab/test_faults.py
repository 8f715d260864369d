"""Faults a user meets: signals, a dead SuperNode, config errors, a failed start.

The slow tests run the real command line (``fedsparse simulate``/``deploy``/``sweep``) as a
subprocess whose environment carries a unique marker; every process it starts (SuperLink,
``flower-superexec``, ``flwr run``, ``flwr-simulation``, Ray, SuperNodes, pool workers)
inherits that environment, so "no process left behind" is checked by scanning ``/proc`` for
the marker (or a marked ancestor), not by trusting the PIDs the command reported.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from fedsparse.common.wire.run_log import read_rounds
from fedsparse.lab.launch.base import prepare_run, read_summary, wait_for_exit
from fedsparse.lab.launch.processes import clear_stop, managed_process, request_stop
from fedsparse.lab.launch.simulate import run_simulation

FEDSPARSE = Path(sys.executable).parent / "fedsparse"
QUICK = ["--set", "dataset=digits", "--set", "min-clients=2"]


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _marked(marker: str) -> list[int]:
    """PIDs of live processes whose environment holds ``marker``, or whose parent's does, or
    its parent's... (zombies excluded).

    The ancestry counts because a process that retitles itself may zero the block that
    ``/proc/PID/environ`` reads: Ray's agents and workers (``setproctitle``) sometimes do, and
    their environment then reads as 1,584 NUL bytes. Their raylet keeps its own.
    """
    processes: dict[int, tuple[int, str, bool]] = {}  # pid: (parent, state, marked)
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        processes[int(entry.name)] = (int(fields[1]), fields[0], marker.encode() in environ)
    marked = {pid for pid, (_, _, has) in processes.items() if has}
    grown = True
    while grown:
        children = {pid for pid, (parent, _, _) in processes.items() if parent in marked}
        grown = not children <= marked
        marked |= children
    return sorted(pid for pid in marked if processes[pid][1] != "Z")


#: Each started command's log, shown when it ends before the test expects it to.
_LOGS: dict[int, Path] = {}


def _start(args: list[str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    marker = f"FEDSPARSE_TEST_MARK={uuid.uuid4().hex}"
    key, value = marker.split("=")
    env = {**os.environ, key: value, "COLUMNS": "140"}
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [str(FEDSPARSE), *args], env=env, stdout=sink, stderr=subprocess.STDOUT
        )
    _LOGS[process.pid] = log
    return process, marker


def _wait_rounds(path: Path, count: int, process: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log = _LOGS.get(process.pid)
            tail = log.read_text(errors="replace")[-4000:] if log is not None else ""
            raise AssertionError(f"the command ended (code {process.returncode}) early:\n{tail}")
        if path.exists() and len(path.read_text().splitlines()) >= count:
            return
        time.sleep(0.5)
    raise AssertionError(f"{path}: fewer than {count} rounds after {timeout} s")


def _assert_nothing_left(marker: str, *, within: float = 15.0) -> None:
    deadline = time.monotonic() + within
    while _marked(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _marked(marker) == []


# -- wait loops ---------------------------------------------------------------------------------


def test_a_lost_expendable_process_is_reported_once_and_the_wait_goes_on(tmp_path: Path) -> None:
    log = (tmp_path / "log").open("wb")
    lost: list[int] = []
    with (
        managed_process(_python("import time; time.sleep(1.5)"), env=os.environ, log=log) as main,
        managed_process(_python("raise SystemExit(3)"), env=os.environ, log=log) as node,
        managed_process(_python("import time; time.sleep(60)"), env=os.environ, log=log) as link,
    ):
        code = wait_for_exit(
            main,
            timeout=30,
            watch=[link],
            expendable=[node],
            on_lost=lambda p: lost.append(p.returncode or 0),
        )
    assert code == 0 and lost == [3]


def test_a_requested_stop_interrupts_the_wait(tmp_path: Path) -> None:
    log = (tmp_path / "log").open("wb")
    with managed_process(_python("import time; time.sleep(60)"), env=os.environ, log=log) as p:
        request_stop()
        try:
            started = time.monotonic()
            with pytest.raises(KeyboardInterrupt):
                wait_for_exit(p, timeout=30)
            assert time.monotonic() - started < 2
        finally:
            clear_stop()
    assert p.returncode is not None  # stopped on the way out


# -- config errors before anything starts; a failed start keeps the last results ---------------


def test_prepare_keeps_the_previous_results_and_read_summary_ignores_them(
    tmp_path: Path,
) -> None:
    old = {"rounds.jsonl": '{"round": 1}\n', "summary.json": "{}", "checkpoint.pt": "old"}
    for name, text in old.items():
        (tmp_path / name).write_text(text)
        os.utime(tmp_path / name, (time.time() - 60, time.time() - 60))
    with pytest.raises(ValueError, match="holds a run"):  # neither --resume nor --overwrite
        prepare_run(tmp_path, {"num-rounds": "2"})
    run = prepare_run(tmp_path, {"num-rounds": "2"}, resume=True)
    assert {n: (tmp_path / n).read_text() for n in old} == old
    with pytest.raises(RuntimeError, match="no summary.json of this run"):
        read_summary(run, 0, logs=lambda: "")


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"dataset": "mnist", "data-dir": "/nonexistent"}, "dataset='mnist' data-dir='/nonex"),
        ({"dataset": "mnist"}, "dataset='mnist': data-dir is not set"),
        ({"no-such-key": "1"}, "'no-such-key' is unknown"),
    ],
)
def test_config_errors_name_the_field_and_touch_nothing(
    tmp_path: Path, overrides: dict, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        prepare_run(tmp_path / "never", overrides)
    assert not (tmp_path / "never").exists()


def test_out_that_is_a_file_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="out=.*file: exists and is not a directory"):
        prepare_run(tmp_path / "file", {})


def test_fewer_clients_than_min_clients_fails_before_starting(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(ValueError, match="clients=1: below min-clients=2"):
        run_simulation(out=tmp_path, overrides={"min-clients": "2"}, clients=1)
    assert time.monotonic() - started < 20 and not (tmp_path / "superlink.log").exists()


def test_user_errors_are_one_line_and_debug_shows_the_traceback(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    args = ["simulate", "--out", str(tmp_path / "file"), "--clients", "1"]
    result = subprocess.run([str(FEDSPARSE), *args], capture_output=True, text=True)
    assert result.returncode == 2
    assert "exists and is not a directory" in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    code = "from fedsparse.lab import cli\ndef boom():\n    raise OSError('disk full')\n"
    code += "cli.app = boom\ncli.main()"
    plain = subprocess.run(_python(code), capture_output=True, text=True)
    assert plain.returncode == 1 and "OSError: disk full" in plain.stdout
    assert len(plain.stdout.strip().splitlines()) == 1 and "Traceback" not in plain.stderr
    debug = subprocess.run(
        _python(code.replace("cli.main()", "cli._STATE['debug'] = True\ncli.main()")),
        capture_output=True,
        text=True,
    )
    assert debug.returncode == 1 and "Traceback" in debug.stderr


# -- signals -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_stops_a_simulation_and_everything_it_started(tmp_path: Path) -> None:
    out = tmp_path / "sim"
    args = ["simulate", "--out", str(out), "--clients", "3", *QUICK, "--set", "num-rounds=60"]
    process, marker = _start(args, tmp_path / "cli.log")
    try:
        _wait_rounds(out / "rounds.jsonl", 2, process, timeout=180)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if process.poll() is None:
            process.kill()
    _assert_nothing_left(marker)
    rounds = read_rounds(out / "rounds.jsonl")  # valid partial JSONL
    assert 2 <= len(rounds) < 60 and [r.round for r in rounds] == list(range(1, len(rounds) + 1))
    time.sleep(3)  # no orphan keeps training
    assert len(read_rounds(out / "rounds.jsonl")) == len(rounds)
    assert not (out / "summary.json").exists()


@pytest.mark.slow
def test_sighup_stops_a_parallel_sweep_and_writes_what_finished(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    args = ["sweep", "--out", str(out), "--grid", "final-rate=0.5,0.7", *QUICK]
    args += ["--set", "num-rounds=60", "--clients", "2", "--backend", "inprocess", "--jobs", "2"]
    process, marker = _start(args, tmp_path / "cli.log")
    try:
        for slug in ("final-rate-0.5_seed-0", "final-rate-0.7_seed-0"):
            _wait_rounds(out / "runs" / slug / "rounds.jsonl", 1, process, timeout=120)
        process.send_signal(signal.SIGHUP)
        assert process.wait(timeout=30) == 128 + signal.SIGHUP
    finally:
        if process.poll() is None:
            process.kill()
    _assert_nothing_left(marker)
    results = (out / "results.csv").read_text().splitlines()
    assert len(results) == 3 and all(",interrupted," in row for row in results[1:])


@pytest.mark.slow
def test_a_dead_supernode_costs_its_replies_not_the_run(tmp_path: Path) -> None:
    out = tmp_path / "deploy"
    args = ["deploy", "--out", str(out), "--nodes", "3", "--idle-seconds", "0", *QUICK]
    # 3 rounds: one with all nodes, the one in flight when a node dies, one without it.
    args += ["--set", "num-rounds=3", "--set", "clients-per-round=0"]
    process, marker = _start(args, tmp_path / "cli.log")
    try:
        _wait_rounds(out / "rounds.jsonl", 1, process, timeout=180)
        nodes = json.loads((out / "nodes.json").read_text())["nodes"]
        os.kill(nodes[2]["pid"], signal.SIGKILL)
        assert process.wait(timeout=400) == 0, (tmp_path / "cli.log").read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
    _assert_nothing_left(marker)
    rounds = read_rounds(out / "rounds.jsonl")
    assert [r.round for r in rounds] == [1, 2, 3]
    assert sum(r.num_missing for r in rounds) == 1  # the one round in flight when it died
    assert rounds[0].num_replies == 3 and rounds[-1].num_clients == 2
    assert json.loads((out / "summary.json").read_text())["rounds"] == 3
    lost = json.loads((out / "nodes.json").read_text())["nodes"]
    assert [n["lost_at"] is not None for n in lost] == [False, False, True]
    assert "SuperNode 2 lost" in (tmp_path / "cli.log").read_text()


@pytest.mark.slow
def test_sigterm_stops_a_deployment_and_everything_it_started(tmp_path: Path) -> None:
    out = tmp_path / "deploy"
    args = ["deploy", "--out", str(out), "--nodes", "2", "--idle-seconds", "0", *QUICK]
    args += ["--set", "num-rounds=60"]
    process, marker = _start(args, tmp_path / "cli.log")
    try:
        _wait_rounds(out / "rounds.jsonl", 1, process, timeout=180)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if process.poll() is None:
            process.kill()
    _assert_nothing_left(marker)
    assert 1 <= len(read_rounds(out / "rounds.jsonl")) < 60


# -- resume ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_simulation_stopped_by_sigterm_resumes_to_the_uninterrupted_model(
    tmp_path: Path,
) -> None:
    import torch

    # Rounds take ~0.3-0.8 s here: 12 of them leave the signal, sent once 2 are logged (0.5 s
    # polls), room to land before the last one.
    rounds = 12
    sets = [*QUICK, "--set", f"num-rounds={rounds}", "--set", "clients-per-round=0"]
    sets += ["--set", "seed=3"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    base = ["simulate", "--clients", "3", *sets]
    # The uninterrupted run in process: with every client in every round it is Flower's
    # engine's run bit for bit (tests/integration/test_ray_backend.py), without Ray's start-up.
    # It runs while the engine of the run to cut starts up.
    whole_args = [*base, "--backend", "inprocess", "--out", str(whole)]
    uninterrupted, _ = _start(whole_args, tmp_path / "whole.log")
    process, marker = _start([*base, "--out", str(cut)], tmp_path / "cut.log")
    try:
        _wait_rounds(cut / "rounds.jsonl", 2, process, timeout=300)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if process.poll() is None:
            process.kill()
    try:
        code = uninterrupted.wait(timeout=400)
        assert code == 0, (tmp_path / "whole.log").read_text()[-2000:]
    finally:
        if uninterrupted.poll() is None:
            uninterrupted.kill()
    _assert_nothing_left(marker)
    stopped_at = len(read_rounds(cut / "rounds.jsonl"))
    assert 2 <= stopped_at < rounds and not (cut / "summary.json").exists()
    checkpointed = torch.load(cut / "checkpoint.pt", weights_only=False)["round"]
    # No round aggregated while the clients were being killed was recorded (the stop marker).
    assert all(r.num_accepted == 3 for r in read_rounds(cut / "rounds.jsonl"))
    states = sorted(str(f.relative_to(cut)) for f in (cut / "node-state").rglob("*.json"))
    where = f"killed after {stopped_at} logged rounds, checkpoint round {checkpointed}, {states}"
    # the stopped command printed the line that resumes it: the same options, plus --resume
    printed = [x for x in (tmp_path / "cut.log").read_text().splitlines() if "to continue" in x]
    resume = shlex.split(printed[-1].split("checkpoint: ", 1)[1])
    assert resume == [
        "fedsparse",
        "simulate",
        "--out",
        str(cut),
        "--clients",
        "3",
        *sets,
        "--resume",
    ]
    process, _ = _start(resume[1:], tmp_path / "resume.log")
    assert process.wait(timeout=400) == 0, (tmp_path / "resume.log").read_text()[-2000:]
    rounds_a, rounds_b = read_rounds(whole / "rounds.jsonl"), read_rounds(cut / "rounds.jsonl")
    assert [r.round for r in rounds_b] == list(range(1, rounds + 1)), where
    for x, y in zip(rounds_a, rounds_b, strict=True):  # the first round that differs, if any
        fields = ("num_clients", "num_accepted", "test_accuracy", "epsilon_max")
        fields += ("uplink_payload_bytes",)
        assert [getattr(x, f) for f in fields] == [getattr(y, f) for f in fields], (
            f"{where}: round {x.round} differs"
        )
    a = torch.load(whole / "checkpoint.pt", weights_only=False)
    b = torch.load(cut / "checkpoint.pt", weights_only=False)
    assert a["round"] == b["round"] == rounds
    assert torch.equal(a["weights"], b["weights"]), where  # bit for bit
    summary = json.loads((cut / "summary.json").read_text())
    assert summary["rounds"] == rounds
    assert (
        summary["final_test_accuracy"]
        == json.loads((whole / "summary.json").read_text())["final_test_accuracy"]
    )
