"""A run that trains nothing does not succeed: every command exits non-zero with one line
naming the cause when no round accepted an update, or at ``max-failed-rounds``; the records
of the rounds it ran are kept, and the cause is in ``failure.txt`` beside them."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from fedsparse.common.wire.run_log import FAILURE_FILE, one_line, untrained
from fedsparse.lab.cli import app

#: Every update above an absolute norm of 1e-9: each one is rejected, no round trains.
REJECT_ALL = ["--set", "max-update-norm=1e-9", "--set", "min-clients=2", "--set", "final-rate=0"]


def _flat(output: str) -> str:
    return " ".join(output.replace("│", " ").split())


def test_a_simulation_whose_every_update_is_rejected_exits_non_zero_naming_why(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    args = ["simulate", "--out", str(out), "--backend", "inprocess", "--clients", "2"]
    result = CliRunner().invoke(app, [*args, "--rounds", "2", *REJECT_ALL], env={"COLUMNS": "240"})
    assert result.exit_code == 1, result.output
    text = _flat(result.output)
    assert "simulation failed: the run trained nothing: none of its 2 rounds accepted" in text
    assert "max-update-norm" in text  # the first rejection's reason
    cause = (out / FAILURE_FILE).read_text()
    assert cause.count("\n") == 1 and cause.startswith("the run trained nothing")
    assert len((out / "rounds.jsonl").read_text().splitlines()) == 2  # the records stay
    assert json.loads((out / "summary.json").read_text())["failed_rounds"] == 2


def test_max_failed_rounds_ends_the_run_with_one_line(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["simulate", "--out", str(out), "--backend", "inprocess", "--clients", "2"]
    stop = [*REJECT_ALL, "--set", "max-failed-rounds=1"]
    result = CliRunner().invoke(app, [*args, "--rounds", "3", *stop], env={"COLUMNS": "240"})
    assert result.exit_code == 1, result.output
    assert "max-failed-rounds=1: rounds 1 to 1 failed in a row" in _flat(result.output)
    assert (out / FAILURE_FILE).read_text().startswith("max-failed-rounds=1")


def test_one_line_keeps_the_first_line_of_each_part() -> None:
    text = "client error: boom\nTraceback (most recent call last):\n  File x; second\nmore"
    assert one_line(text) == "client error: boom; second"
    assert len(one_line("x" * 1000)) == 400


def test_a_round_that_sampled_no_user_trained_nothing(tmp_path: Path) -> None:
    """dp-level=user samples users by Poisson sampling: a round may take none; a run of such
    rounds trained nothing though no round is marked failed."""
    out = tmp_path / "run"
    args = ["simulate", "--out", str(out), "--backend", "inprocess", "--clients", "10"]
    sets = ["dp-level=user", "clients-per-round=1", "central-noise=seeded", "seed=5"]
    sets += ["num-rounds=1", "min-clients=2"]
    result = CliRunner().invoke(
        app, [*args, *[a for s in sets for a in ("--set", s)]], env={"COLUMNS": "240"}
    )
    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert rounds[0]["num_accepted"] == 0 and not rounds[0]["failed"]
    assert result.exit_code == 1 and "no client was sampled" in _flat(result.output)
    assert untrained([]) is None
