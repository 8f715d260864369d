"""The command line's first contact: help and usage errors load no heavy library.

``fedsparse --help``, a command's ``--help`` and a run-config error answer from typer, rich and
the app's ``pyproject.toml`` alone; torch, Flower, Opacus and Ray load inside the commands that
run something (``lab/cli/app.py``). Asserted as a property (what is in ``sys.modules``), not as a
timing, so that a slow machine cannot fail it and a fast one cannot hide a regression.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedsparse.lab.cli import QUIET_WARNINGS, app
from fedsparse.lab.cli.utils import APP_PYPROJECT, check_run_config

HEAVY = ("torch", "flwr", "opacus", "ray", "numpy")

# Runs ``main`` with the given arguments, then prints which heavy packages it imported.
_PROBE = """
import json, sys
heavy = json.loads(sys.argv[2])
sys.argv = ["fedsparse", *json.loads(sys.argv[1])]
from fedsparse.lab.cli import main
try:
    main()
except SystemExit as exit_:
    code = exit_.code
print(json.dumps({"code": code, "loaded": [m for m in heavy if m in sys.modules]}))
"""


def _probe(args: list[str]) -> dict[str, object]:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(args), json.dumps(HEAVY)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["--help"], 0),
        (["-h"], 0),
        (["simulate", "--help"], 0),
        (["train", "--help"], 0),
        (["sweep", "--help"], 0),
        (["deploy", "--help"], 0),
        (["simulate", "--set", "num-round=2"], 2),  # an unknown key
        (["simulate", "--set", "num-rounds=two"], 2),  # a value of the wrong type
        (["simulate", "--set", "num-rounds"], 2),  # not key=value
        (["train", "--no-such-option"], 2),
        (["simulate", "--rounds", "2", "--set", "num-rounds=3"], 2),  # a shortcut set twice
        (["deploy", "--set", "num-round=2"], 2),
        (["sweep", "--set", "num-round=2"], 2),
    ],
)
def test_help_and_usage_errors_import_no_heavy_library(args: list[str], code: int) -> None:
    assert _probe(args) == {"code": code, "loaded": []}


def test_the_probe_sees_a_command_that_runs(tmp_path: Path) -> None:
    """The probe's oracle: a config error found only by the full check (a plug-in method that
    does not import) loads torch."""
    args = ["simulate", "--out", str(tmp_path / "x"), "--set", "method=no_such_pkg.mod:Method"]
    probe = _probe(args)
    assert probe["code"] == 2 and "torch" in probe["loaded"]  # type: ignore[operator]


def test_fast_config_errors_are_the_configs_own_words(tmp_path: Path) -> None:
    """``check_run_config`` answers as ``FederatedConfig.from_run_config`` does, word for
    word, and runs against the app's own ``pyproject.toml`` (``lab/launch/flower.py:APP_DIR``)."""
    from fedsparse.common.config import FederatedConfig
    from fedsparse.lab.launch.flower import APP_DIR

    assert APP_PYPROJECT == APP_DIR / "pyproject.toml"
    declared = tomllib.loads(APP_PYPROJECT.read_text())["tool"]["flwr"]["app"]["config"]
    bad = [{"num-round": "2"}, {"numrounds": "2"}, {"zzz": "1"}, {"num-rounds": "two"}]
    bad += [{"lr": "fast"}, {"resume": "maybe"}, {"num_rounds": "2.5"}]
    for overrides in bad:
        with pytest.raises(ValueError) as fast:
            check_run_config(overrides)
        with pytest.raises(ValueError) as full:
            FederatedConfig.from_run_config(overrides)
        assert str(fast.value) == str(full.value), overrides
    check_run_config({"num_rounds": "3", "lr": "0.5", "resume": "true", "dataset": "digits"})
    check_run_config({key: str(value) for key, value in declared.items()})


def test_an_unknown_key_fails_before_anything_is_created(tmp_path: Path) -> None:
    out = tmp_path / "never"
    result = CliRunner().invoke(app, ["simulate", "--out", str(out), "--set", "num-round=2"])
    assert result.exit_code == 2
    assert "did you mean 'num-rounds'?" in " ".join(result.output.replace("│", " ").split())
    assert not out.exists()


def test_the_cli_silences_the_libraries_list() -> None:
    from fedsparse.common.known_warnings import KNOWN_WARNINGS

    assert tuple(known.message for known in KNOWN_WARNINGS) == QUIET_WARNINGS


def test_python_dash_m_runs_the_command_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fedsparse.lab.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and result.stdout.startswith("fedsparse "), result.stderr


def _listed(help_text: str) -> list[str]:
    """The names an option's help lists: ``a | b (why) | c``, after any ``label:`` prefix."""
    return [segment.split(":")[-1].split()[0] for segment in help_text.split("|")]


def test_train_help_lists_the_names_each_option_accepts() -> None:
    """Every name ``train --help`` lists is accepted, and every accepted name is listed
    (schedules: those that need no option train lacks, i.e. all but ``steps``)."""
    import typer.main

    from fedsparse.common.data.datasets import DATASET_NAMES, EVAL_SPLITS
    from fedsparse.common.dp.accounting import ACCOUNTANTS
    from fedsparse.common.dp.engines import ENGINES
    from fedsparse.common.dp.optimizer import MECHANISMS
    from fedsparse.common.methods import METHODS, SELECTION_MODES, SELECTIONS
    from fedsparse.common.methods.schedules import SCHEDULES
    from fedsparse.common.training.configs import DEVICES

    accepted = {
        "dataset": DATASET_NAMES,
        "eval_split": EVAL_SPLITS,
        "mechanism": MECHANISMS,
        "engine": ENGINES,
        "method": METHODS,
        "selection": SELECTIONS,
        "selection_mode": SELECTION_MODES,
        "accountant": ACCOUNTANTS,
        "device": DEVICES,
        "schedule": tuple(s for s in SCHEDULES if s != "steps"),  # steps: a list train lacks
    }
    command = typer.main.get_command(app).commands["train"]  # type: ignore[attr-defined]
    helps = {param.name: param.help for param in command.params}
    for name, names in accepted.items():
        assert sorted(_listed(helps[name])) == sorted(names), name


def _commands() -> list[list[str]]:
    import typer.main

    group = typer.main.get_command(app)
    return [[], *([name] for name in group.commands)]  # type: ignore[attr-defined]


@pytest.mark.parametrize("command", _commands(), ids=lambda c: " ".join(c) or "fedsparse")
def test_help_shows_no_rst_double_backticks(command: list[str]) -> None:
    result = CliRunner().invoke(app, [*command, "--help"], prog_name="fedsparse")
    assert result.exit_code == 0, result.output
    assert "``" not in result.output
    assert f"Usage: {' '.join(['fedsparse', *command])} " in result.output


def test_help_text_turns_rst_into_plain_paragraphs() -> None:
    from fedsparse.lab.cli.app import help_text

    doc = """First line, ``name`` and
        ``--set key=value``.

        A second paragraph
        over two lines.
        """
    assert help_text(doc) == (
        "First line, `name` and `--set key=value`.\n\nA second paragraph over two lines."
    )
    export_help = typer_command_help("export")
    assert "`torch.load(out, weights_only=True)`" in export_help


def typer_command_help(name: str) -> str:
    import typer.main

    return typer.main.get_command(app).commands[name].help or ""  # type: ignore[attr-defined]
