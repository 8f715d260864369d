"""``fedsparse simulate``'s own options: the ``--rounds``/``--seed`` shortcuts, the ``--resume``
line a stopped run prints, and a failed start that leaves nothing behind; its output where it
is not a terminal: the status line before the first round, plain log lines, each once.

The run itself (``lab/launch/simulate.py:run_simulation``) is replaced by a recorder where the test
is
about the command line, so these tests start no Flower process.
"""

from __future__ import annotations

import io
import logging
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fedsparse.lab.cli import app
from fedsparse.lab.cli.simulate import resume_command, shortcuts


def _flat(output: str) -> str:
    return " ".join(output.replace("│", " ").split())


class _Recorder:
    """Stands in for ``run_simulation``: records its arguments, then stops as Ctrl-C does,
    after writing a checkpoint when ``checkpoint`` is set."""

    def __init__(self, *, checkpoint: bool) -> None:
        self.calls: list[dict[str, Any]] = []
        self.checkpoint = checkpoint

    def __call__(self, **kwargs: Any) -> None:
        self.calls.append(kwargs)
        kwargs["out"].mkdir(parents=True, exist_ok=True)
        if self.checkpoint:
            (kwargs["out"] / "checkpoint.pt").write_bytes(b"round 1")
        raise KeyboardInterrupt("stop requested")


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    recorder = _Recorder(checkpoint=True)
    monkeypatch.setattr("fedsparse.lab.launch.simulate.run_simulation", recorder)
    return recorder


def test_shortcuts_set_their_keys() -> None:
    assert shortcuts({}, rounds=3, seed=7) == {"num-rounds": "3", "seed": "7"}
    assert shortcuts({"lr": "0.5"}, rounds=None, seed=0) == {"seed": "0"}
    assert shortcuts({}, rounds=None, seed=None) == {}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rounds", "3", "--set", "num-rounds=2"], "--rounds 3: --set num-rounds=2 sets"),
        (["--rounds", "3", "--set", "num_rounds=2"], "--rounds 3: --set num_rounds=2 sets"),
        (["--seed", "4", "--set", "seed=1"], "--seed 4: --set seed=1 sets seed too; give one"),
        (["--log", "mlflow", "--set", "log=tensorboard"], "--log mlflow: --set log=tensorboard"),
        (["--log", "wandb"], "log='wandb': expected some of tensorboard, mlflow"),
        (["--set", "log=tensorboard,wandb"], "log='tensorboard,wandb': expected some of"),
    ],
)
def test_a_shortcut_and_a_set_of_its_key_conflict(
    tmp_path: Path, recorder: _Recorder, args: list[str], message: str
) -> None:
    out = tmp_path / "never"
    result = CliRunner().invoke(app, ["simulate", "--out", str(out), *args])
    assert result.exit_code == 2 and message in _flat(result.output), result.output
    assert recorder.calls == [] and not out.exists()


def test_shortcuts_reach_the_run_config(tmp_path: Path, recorder: _Recorder) -> None:
    args = ["simulate", "--out", str(tmp_path / "run"), "--rounds", "4", "--seed", "9"]
    result = CliRunner().invoke(app, [*args, "--set", "lr=0.5", "--log", "tensorboard"])
    assert recorder.calls[0]["overrides"] == {
        "lr": "0.5",
        "num-rounds": "4",
        "seed": "9",
        "log": "tensorboard",
    }
    assert "--log tensorboard --resume" in _flat(result.output)


def test_a_stopped_run_prints_the_command_that_resumes_it(
    tmp_path: Path, recorder: _Recorder
) -> None:
    out = tmp_path / "run dir"  # a space: the printed line must quote it
    args = ["simulate", "--out", str(out), "--clients", "3", "--set", "lr=0.5", "--rounds", "4"]
    args += ["--backend", "ray", "--gpus-per-client", "0.25", "--timeout", "60"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code != 0
    line = next(x for x in result.output.splitlines() if "to continue" in x)
    command = line.split("checkpoint: ", 1)[1]
    words = shlex.split(command)
    assert words[:2] == ["fedsparse", "simulate"] and words[-1] == "--resume"
    # the printed line, run, resumes the same run: the same arguments, plus resume
    CliRunner().invoke(app, words[1:])
    first, again = recorder.calls
    assert again == {**first, "resume": True} and first["resume"] is False
    assert first["backend"] == "ray" and first["gpus_per_client"] == 0.25


def test_a_run_stopped_before_its_first_checkpoint_has_nothing_to_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(b"an earlier run's")
    old = out.stat().st_mtime - 60
    os.utime(out / "checkpoint.pt", (old, old))
    monkeypatch.setattr("fedsparse.lab.launch.simulate.run_simulation", _Recorder(checkpoint=False))
    result = CliRunner().invoke(app, ["simulate", "--out", str(out)])
    assert "nothing to resume" in result.output and "--resume" not in result.output


def test_resume_command_leaves_defaults_out() -> None:
    command = resume_command(
        out=Path("runs/simulate"),
        clients=10,
        sets=[],
        rounds=None,
        seed=None,
        cpus_per_client=1.0,
        gpus_per_client=0.0,
        timeout=3600.0,
        backend="flower",
    )
    assert command == "fedsparse simulate --out runs/simulate --clients 10 --resume"


def test_a_failed_start_leaves_no_folder(tmp_path: Path) -> None:
    """Config problems found only once the config module loaded (a value out of range, too few
    clients for min-clients) leave no folder; nor do data problems (below)."""
    runner = CliRunner()
    for n, args in enumerate(
        (
            ["--clients", "1", "--set", "min-clients=2"],
            ["--set", "final-rate=1.5"],
        )
    ):
        out = tmp_path / f"simulate-{n}"
        result = runner.invoke(app, ["simulate", "--out", str(out), *args])
        assert result.exit_code == 2, result.output
        assert not out.exists(), args


def test_a_failed_train_start_leaves_no_folder(tmp_path: Path) -> None:
    out = tmp_path / "train"
    runner = CliRunner()
    result = runner.invoke(app, ["train", "--out", str(out), "--dataset", "cifar10"])
    assert result.exit_code != 0 and "--data-dir" in str(result.exception)
    assert not out.exists()


def test_a_failed_start_keeps_a_folder_that_was_there(tmp_path: Path) -> None:
    """Even with --overwrite: the checks run before the old run's files are removed."""
    out = tmp_path / "earlier"
    out.mkdir()
    (out / "rounds.jsonl").write_text("{}\n")
    args = ["simulate", "--out", str(out), "--clients", "1", "--set", "min-clients=2"]
    result = CliRunner().invoke(app, [*args, "--overwrite"])
    assert result.exit_code == 2 and "below min-clients=2" in _flat(result.output)
    assert (out / "rounds.jsonl").read_text() == "{}\n"


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _simulate(out: Path, *args: str) -> str:
    """``fedsparse simulate`` of 1 round of 2 clients, its output a pipe (not a terminal)."""
    result = subprocess.run(
        [sys.executable, "-m", "fedsparse.lab.cli", "simulate", "--out", str(out)]
        + ["--clients", "2", "--rounds", "1", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def _first_round_row(lines: list[str]) -> int:
    return next(i for i, line in enumerate(lines) if re.match(r"^│\s+1 │", line))


#: A log line's start: a level name, alone (Flower's console) or after a timestamp (the
#: root handler ``logging.basicConfig`` adds), then its message.
LOG_LINE = re.compile(r"^(?:\d\d/\d\d/\d{4} [\d:]+:)?(DEBUG|INFO|WARNING|ERROR|CRITICAL)\s*:\s*")


def _log_messages(text: str) -> list[str]:
    """The messages of the log lines of ``text`` (ANSI codes removed), blank ones left out."""
    lines = (
        LOG_LINE.match(ANSI.sub("", line)) and ANSI.sub("", line) for line in text.splitlines()
    )
    return [m for line in lines if line and (m := LOG_LINE.sub("", line).strip())]


def test_a_repeated_log_line_is_seen_in_either_format() -> None:
    """The oracle of the test below, on the lines a Flower run used to log."""
    text = (
        "\x1b[92mINFO \x1b[0m:      round 1: r=0.700 acc=0.2139\n"
        "11/26/2026 03:27:50:INFO:round 1: r=0.700 acc=0.2139\n"
        "\x1b[92mINFO \x1b[0m:      \nUsing SuperLink: sim\n"
    )
    assert _log_messages(text) == ["round 1: r=0.700 acc=0.2139"] * 2


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["inprocess", "population"])
def test_a_simulate_in_this_process_says_what_it_waits_for_before_round_1(
    tmp_path: Path, backend: str
) -> None:
    output = _simulate(tmp_path / "run", "--backend", backend)
    lines = output.splitlines()
    status = lines.index("waiting for round 1 (2 clients in this process)...")
    assert status < _first_round_row(lines)
    assert not ANSI.search(output)
    final = next(i for i, line in enumerate(lines) if "final test accuracy" in line)
    assert lines[final].startswith("final test accuracy ")  # a line of its own, after the table
    assert lines[final - 1].startswith("└")


@pytest.mark.slow
def test_a_flower_simulate_logs_plain_lines_once(tmp_path: Path) -> None:
    """Flower's engine, non-TTY: the status lines come before the first round, and neither the
    output nor the logs of Flower's processes carry ANSI codes or a log line twice (the
    ServerApp's lines used to come again through the root handler Opacus's import adds)."""
    out = tmp_path / "run"
    output = _simulate(out, "--backend", "flower")
    lines = output.splitlines()
    starting = lines.index("starting Flower's simulation engine (SuperLink, Ray)...")
    waiting = lines.index("waiting for round 1 (2 simulated nodes)...")
    assert starting < waiting < _first_round_row(lines)
    flwr_log, superlink_log = (out / "flwr.log").read_text(), (out / "superlink.log").read_text()
    for text in (output, flwr_log, superlink_log):
        assert not ANSI.search(text)
    messages = _log_messages(flwr_log)
    assert any(m.startswith("round 1: r=0.700") for m in messages), flwr_log
    repeated = {m for m in messages if messages.count(m) > 1}
    assert not repeated, repeated


class _Stream(io.StringIO):
    def __init__(self, *, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


@pytest.mark.parametrize("tty", [False, True])
def test_flowers_logger_in_this_process_writes_once_colored_only_on_a_terminal(
    tty: bool,
) -> None:
    from flwr.common.logger import ConsoleHandler

    from fedsparse.lab.launch.flower import flower_logs_in_this_process

    logger = logging.getLogger("flwr")
    console_stream, root_stream = _Stream(tty=tty), io.StringIO()
    console = ConsoleHandler(colored=True, stream=console_stream)
    root = logging.StreamHandler(root_stream)  # what Opacus's logging.basicConfig adds
    logger.addHandler(console)
    logging.getLogger().addHandler(root)
    level, propagate = logger.level, logger.propagate
    try:
        with flower_logs_in_this_process():
            logger.info("a round's line")  # the live table shows rounds
            logger.warning("a warning")
        assert (logger.level, logger.propagate, console.colored) == (level, propagate, True)
    finally:
        logger.removeHandler(console)
        logging.getLogger().removeHandler(root)
    assert "a round's line" not in console_stream.getvalue()
    assert console_stream.getvalue().count("a warning") == 1
    assert bool(ANSI.search(console_stream.getvalue())) is tty
    assert root_stream.getvalue() == ""


def test_the_serverapp_logs_plain_lines_once() -> None:
    from flwr.common.logger import ConsoleHandler

    from fedsparse.server.app import plain_flower_logs

    logger = logging.getLogger("flwr")
    stream, root_stream = _Stream(tty=False), io.StringIO()
    console = ConsoleHandler(colored=True, stream=stream)
    root = logging.StreamHandler(root_stream)
    logger.addHandler(console)
    logging.getLogger().addHandler(root)
    propagate = logger.propagate
    try:
        plain_flower_logs()
        logger.warning("once")
    finally:
        logger.propagate = propagate
        logger.removeHandler(console)
        logging.getLogger().removeHandler(root)
    assert stream.getvalue().count("once") == 1 and not ANSI.search(stream.getvalue())
    assert root_stream.getvalue() == ""
