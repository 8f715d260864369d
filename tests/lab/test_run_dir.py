"""No run is lost or mixed: a command refuses a folder that holds a run unless it is told to
``--resume`` it or ``--overwrite`` it (the old run's files, logs included, removed first), and
a resume with any input that changes the numbers is refused by name, input by input."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedsparse.lab.cli import app
from fedsparse.lab.launch.run_dir import (
    INPUTS_FILE,
    RunFolderError,
    RunInputs,
    check_inputs,
    claim,
    claim_runs,
    plugin_version,
    run_entries,
    write_inputs,
)

ONE_ROUND = ["--set", "num-rounds=1", "--set", "min-clients=2", "--set", "final-rate=0"]


def _flat(output: str) -> str:
    return " ".join(output.replace("│", " ").split())


def _old_run(out: Path) -> None:
    """A finished run's files, logs included, and one file of the user's."""
    (out / "node-state").mkdir(parents=True)
    (out / "node-state" / "node-0.pt").write_bytes(b"state")
    for name in ("rounds.jsonl", "summary.json", "flwr.log", "superlink.log", "supernode-0.log"):
        (out / name).write_text("old\n")
    (out / "notes.txt").write_text("mine\n")


def test_a_folder_without_a_run_is_used_as_it_is(tmp_path: Path) -> None:
    claim(tmp_path / "missing")
    (tmp_path / "notes.txt").write_text("mine\n")
    claim(tmp_path)
    assert run_entries(tmp_path) == []


def test_a_folder_with_a_run_is_refused_without_resume_or_overwrite(tmp_path: Path) -> None:
    _old_run(tmp_path)
    with pytest.raises(RunFolderError, match="holds a run .*--resume.*--overwrite"):
        claim(tmp_path)
    claim(tmp_path, resume=True)  # continue it: nothing touched
    assert (tmp_path / "flwr.log").read_text() == "old\n"
    with pytest.raises(RunFolderError, match="give one"):
        claim(tmp_path, resume=True, overwrite=True)


def test_overwrite_removes_the_old_runs_files_logs_included_and_keeps_others(
    tmp_path: Path,
) -> None:
    _old_run(tmp_path)
    claim(tmp_path, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_a_runs_dir_of_an_earlier_sweep_is_refused_or_emptied(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    for slug in ("lr-0.5_seed-0", "lr-1.0_seed-0"):
        (runs / slug).mkdir(parents=True)
        (runs / slug / "summary.json").write_text("{}")
        (runs / slug / "sweep-run.json").write_text("{}")
    with pytest.raises(RunFolderError, match="holds 2 runs"):
        claim_runs(runs)
    claim_runs(runs, resume=True)
    claim_runs(runs, overwrite=True)
    assert list(runs.iterdir()) == []


def _inputs(**change: object) -> RunInputs:
    base = {"clients": 3, "results": "simulation", "data": "ab" * 32, "plugins": {}}
    return RunInputs(**{**base, **change})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"clients": 4}, "clients=4"),
        ({"results": "deployment"}, "backend='deployment'"),
        ({"data": "cd" * 32}, "data='sha256 cdcdcdcdcdcd...'"),
        ({"plugins": {"method": "pkg.m:M @ sha256:1"}}, "plug-ins="),
    ],
)
def test_a_resume_with_another_input_is_refused_naming_it(
    tmp_path: Path, change: dict, named: str
) -> None:
    write_inputs(tmp_path, _inputs())
    check_inputs(tmp_path, _inputs())  # the same inputs: resumed
    with pytest.raises(RunFolderError, match="started with") as err:
        check_inputs(tmp_path, _inputs(**change))
    assert named in str(err.value)


def test_backends_of_one_family_of_results_resume_each_other() -> None:
    config = {"method": "rs"}
    one = RunInputs.of_run(clients=2, backend="flower", data="x", run_config=config)
    for backend in ("ray", "inprocess"):
        assert RunInputs.of_run(clients=2, backend=backend, data="x", run_config=config) == one
    other = RunInputs.of_run(clients=2, backend="deploy", data="x", run_config=config)
    assert other != one


def test_a_plugins_version_is_its_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = tmp_path / "my_method_v.py"
    module.write_text("class M:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = plugin_version("my_method_v:M")
    assert before.startswith("sha256:")
    module.write_text("class M:\n    step = 2\n")
    assert plugin_version("my_method_v:M") != before
    config = {"method": "my_method_v:M", "model": "digits-cnn"}
    inputs = RunInputs.of_run(clients=2, backend="flower", data="x", run_config=config)
    assert list(inputs.plugins) == ["method"]
    engine = RunInputs.of_run(  # a user's DP engine is code too: an edited one is a new run
        clients=2, backend="flower", data="x", run_config={**config, "engine": "my_method_v:M"}
    )
    assert list(engine.plugins) == ["engine", "method"]
    assert engine.plugins["engine"] == f"my_method_v:M @ {plugin_version('my_method_v:M')}"
    assert sys.modules.get("my_method_v") is None  # found, never imported


@pytest.mark.slow
def test_simulate_refuses_a_finished_run_then_overwrites_or_resumes_it_by_its_inputs(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    args = ["simulate", "--out", str(out), "--backend", "inprocess", "--clients", "3"]
    first = CliRunner().invoke(app, [*args, *ONE_ROUND], env={"COLUMNS": "240"})
    assert first.exit_code == 0, first.output
    assert json.loads((out / INPUTS_FILE).read_text())["clients"] == 3
    (out / "flwr.log").write_text("an older run's log\n")

    again = CliRunner().invoke(app, [*args, *ONE_ROUND], env={"COLUMNS": "240"})
    assert again.exit_code == 2 and "holds a run" in _flat(again.output)
    assert (out / "flwr.log").exists()  # refused: nothing touched

    more = ["simulate", "--out", str(out), "--backend", "inprocess", "--clients", "4"]
    clients = CliRunner().invoke(app, [*more, *ONE_ROUND, "--resume"], env={"COLUMNS": "240"})
    assert clients.exit_code == 2, clients.output
    assert "clients=4, but the run" in _flat(clients.output)
    assert "started with clients=3" in _flat(clients.output)

    other = [*ONE_ROUND[:-1], "final-rate=0.5"]
    config = CliRunner().invoke(app, [*args, *other, "--resume"], env={"COLUMNS": "240"})
    assert config.exit_code == 2, config.output
    assert "final-rate=0.5, but the checkpoint" in _flat(config.output)
    assert "with final-rate=0.0" in _flat(config.output)

    same = CliRunner().invoke(app, [*args, *ONE_ROUND, "--resume"], env={"COLUMNS": "240"})
    assert same.exit_code == 0, same.output

    replaced = CliRunner().invoke(app, [*args, *ONE_ROUND, "--overwrite"], env={"COLUMNS": "240"})
    assert replaced.exit_code == 0, replaced.output
    assert not (out / "flwr.log").exists()  # the old run's log went with it


def test_train_refuses_a_folder_that_holds_a_run(tmp_path: Path) -> None:
    _old_run(tmp_path)
    result = CliRunner().invoke(
        app, ["train", "--out", str(tmp_path), "--epochs", "1"], env={"COLUMNS": "240"}
    )
    assert result.exit_code == 2 and "holds a run" in _flat(result.output)
    assert (tmp_path / "summary.json").read_text() == "old\n"


def test_the_demo_target_replaces_its_own_folder() -> None:
    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    demo = textwrap.dedent(makefile.split("\ndemo:", 1)[1].split("\n\n", 1)[0])
    assert "--overwrite" in demo


def test_a_run_that_recorded_no_inputs_is_not_resumed(tmp_path: Path) -> None:
    with pytest.raises(RunFolderError, match="records no run inputs"):
        check_inputs(tmp_path, _inputs())


def test_under_partial_participation_each_backend_is_its_own_family() -> None:
    """Flower's simulated nodes get random ids, and sampling goes by id: flower, ray and
    inprocess agree bit for bit only when every client trains every round."""
    partial = {"method": "rs", "clients-per-round": 2}
    flower = RunInputs.of_run(clients=4, backend="flower", data="x", run_config=partial)
    ray = RunInputs.of_run(clients=4, backend="ray", data="x", run_config=partial)
    assert (flower.results, ray.results) == ("flower", "ray")
    every = {"method": "rs", "clients-per-round": 4}
    assert RunInputs.of_run(clients=4, backend="ray", data="x", run_config=every).results == (
        "simulation"
    )


def test_overwrite_removes_nothing_when_a_later_check_fails(tmp_path: Path) -> None:
    runs = tmp_path / "out" / "runs" / "lr-0.5_seed-0"
    runs.mkdir(parents=True)
    (runs / "summary.json").write_text("{}")
    args = ["sweep", "--out", str(tmp_path / "out"), "--backend", "inprocess", "--overwrite"]
    bad_tune = CliRunner().invoke(app, [*args, "--tune", "lr=-1"], env={"COLUMNS": "240"})
    assert bad_tune.exit_code == 2 and "lr=-1" in _flat(bad_tune.output)
    bad_grid = CliRunner().invoke(app, [*args, "--grid", "lr=0.5,0"], env={"COLUMNS": "240"})
    assert bad_grid.exit_code == 2 and "lr=0" in _flat(bad_grid.output)
    assert (runs / "summary.json").read_text() == "{}"


def test_a_command_without_resume_does_not_offer_it(tmp_path: Path) -> None:
    _old_run(tmp_path)
    with pytest.raises(RunFolderError) as err:
        claim(tmp_path, resumable=False)
    assert "--resume" not in str(err.value) and "--overwrite" in str(err.value)
