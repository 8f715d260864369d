"""``fedsparse simulate``'s own options: the ``--rounds``/``--seed`` shortcuts, the ``--resume``
line a stopped run prints, and a failed start that leaves nothing behind.

The run itself (``lab/launch/simulate.py:run_simulation``) is replaced by a recorder where the test
is
about the command line, so these tests start no Flower process.
"""

from __future__ import annotations

import os
import shlex
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
    out = tmp_path / "earlier"
    out.mkdir()
    (out / "rounds.jsonl").write_text("{}\n")
    result = CliRunner().invoke(
        app, ["simulate", "--out", str(out), "--clients", "1", "--set", "min-clients=2"]
    )
    assert result.exit_code == 2 and "below min-clients=2" in _flat(result.output)
    assert (out / "rounds.jsonl").read_text() == "{}\n"
