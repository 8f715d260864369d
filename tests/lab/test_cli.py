"""The ``fedsparse train`` command: files written, epsilon within budget, accuracy above chance;
``fedsparse reconstruct``: the options of the study's ``-m`` entry point, and a tiny run.

And the command line's process hygiene: importing ``fedsparse.lab`` changes no global state.
"""

import json
import math
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedsparse.common.data.datasets import load_eval_splits
from fedsparse.common.dp.accounting import calibrate_noise_multiplier, sample_rate, steps_per_epoch
from fedsparse.common.wire.run_log import (
    SCHEMA,
    config_hash,
    shared_key_problems,
    software_versions,
)
from fedsparse.lab.cli import QUIET_WARNINGS, app, main
from fedsparse.lab.cli.train import TRAIN_DEFAULTS

LAB = Path(__file__).resolve().parents[2] / "lab"


def test_train_writes_epochs_and_summary(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "run"
    args = ["train", "--out", str(out), "--epochs", "3", "--final-rate", "0.9"]
    args += ["--target-epsilon", "2.0"]
    monkeypatch.setattr(sys, "argv", ["/some/venv/bin/fedsparse", *args])
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    epochs = [json.loads(line) for line in (out / "epochs.jsonl").read_text().splitlines()]
    assert [e["epoch"] for e in epochs] == [0, 1, 2]
    assert [round(e["rate"], 6) for e in epochs] == [0.0, 0.45, 0.9]
    # keep = d - floor(r d): the kept fraction is within 1/d of 1 - r.
    for e in epochs:
        assert abs(e["keep_fraction"] - (1 - e["rate"])) < 1e-4
    assert all(a["epsilon"] < b["epsilon"] for a, b in zip(epochs, epochs[1:], strict=False))
    summary = json.loads((out / "summary.json").read_text())
    assert 1.8 < summary["epsilon"] <= 2.0 + 1e-6
    assert summary["final_test_accuracy"] > 0.3  # chance is 0.1
    assert summary["parameters"] == 38_282
    assert summary["train"]["engine"] == "auto" and summary["engine"] == "factored"  # on a CPU
    # the header every summary shares, with the federated summary's names and types
    assert shared_key_problems(summary) == []
    assert (summary["kind"], summary["schema"]) == ("train", SCHEMA)
    assert summary["command"] == f"fedsparse train --out {out} --epochs 3 --final-rate 0.9 " + (
        "--target-epsilon 2.0"
    )
    assert summary["config_hash"] == config_hash(summary["config"])
    assert summary["config"]["privacy"]["target_epsilon"] == 2.0
    assert summary["epsilon_max"] == summary["epsilon"] and summary["epochs"] == 3
    assert summary["versions"] == software_versions()
    assert summary["index_epsilon"] is None  # rs spends no index budget: null, not 0
    # sigma as calibrated for the target over the run's steps, computed here on its own
    train_split, _ = load_eval_splits("digits", data_dir=None, seed=0, eval_split="test")
    n, batch = len(train_split), TRAIN_DEFAULTS["digits"][1]
    sigma = calibrate_noise_multiplier(
        target_epsilon=2.0,
        delta=1e-5,
        sample_rate=sample_rate(n, batch),
        steps=3 * steps_per_epoch(n, batch),
        accountant="rdp",
    )
    assert summary["noise_multiplier"] == pytest.approx(sigma, rel=1e-12) and sigma > 0.5
    assert summary["noise_multiplier_min"] == summary["noise_multiplier_max"] == sigma
    assert summary["privacy"]["noise_multiplier"] is None  # the setting, as given


def test_train_records_null_sigma_for_a_non_private_mechanism(tmp_path: Path) -> None:
    options = ["--epochs", "1", "--mechanism", "clipped", "--noise-multiplier", "0"]
    result = CliRunner().invoke(app, ["train", "--out", str(tmp_path), *options])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert shared_key_problems(summary) == []
    assert summary["noise_multiplier"] is None and summary["noise_multiplier_max"] is None
    assert math.isinf(summary["epsilon_max"])


def test_bad_option_names_field_and_value(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["train", "--out", str(tmp_path), "--final-rate", "1.5"])
    assert result.exit_code != 0
    assert "final_rate=1.5" in result.output


def test_train_checks_names_before_running(tmp_path: Path) -> None:
    out = tmp_path / "never"
    for option, value in (("--dataset", "imagenet"), ("--model", "resnet"), ("--accountant", "x")):
        result = CliRunner().invoke(app, ["train", "--out", str(out), option, value])
        assert result.exit_code != 0
        assert f"{option[2:]}={value!r}: expected one of" in result.output
    assert not out.exists()


def test_train_checks_the_method_before_running(tmp_path: Path) -> None:
    out = tmp_path / "never"
    cases = (
        (
            ["--method", "ranked-x"],
            "method='ranked-x': expected one of rs, random-freeze, lf, ranked",
        ),
        (
            ["--method", "random-freeze", "--schedule", "constant"],
            "schedule='constant': method='random-freeze' ramps the rate to r*",
        ),
        (["--method", "lf", "--freeze-layers", "0"], "freeze-layers=0: expected >= 1"),
    )
    for options, message in cases:
        result = CliRunner().invoke(app, ["train", "--out", str(out), *options])
        assert result.exit_code != 0
        assert message in " ".join(result.output.replace("│", " ").split()), result.output
    assert not out.exists()


def test_train_runs_layer_freezing_and_reports_total_density(tmp_path: Path) -> None:
    options = ["--epochs", "2", "--method", "lf", "--freeze-after", "1", "--target-epsilon", "2"]
    result = CliRunner().invoke(app, ["train", "--out", str(tmp_path), *options])
    assert result.exit_code == 0, result.output
    epochs = [json.loads(line) for line in (tmp_path / "epochs.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "summary.json").read_text())
    method = summary["method"]
    assert (method["name"], method["freeze_layers"], method["freeze_after"]) == ("lf", 1, 1)
    assert epochs[0]["keep_fraction"] == 1.0 and epochs[1]["keep_fraction"] < 1.0
    assert summary["total_density"] == pytest.approx((1.0 + epochs[1]["keep_fraction"]) / 2)


# Imports every module-level import of the lab modules first (third-party packages and the
# other fedsparse packages may set up what they like), then the lab modules themselves.
_IMPORT_CHECK = """
import ast, importlib, sys, warnings
from pathlib import Path
root = Path(sys.argv[1])
lab = sorted(root.rglob("*.py"))
for path in lab:
    for node in ast.parse(path.read_text()).body:
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
        for name in names:
            if not name.startswith("fedsparse.lab"):
                importlib.import_module(name)
import matplotlib
filters, backend = list(warnings.filters), dict.__getitem__(matplotlib.rcParams, "backend")
for path in lab:
    parts = path.relative_to(root).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    if parts[-1:] != ("__main__",):  # runs the command line
        importlib.import_module(".".join(("fedsparse.lab", *parts)))
assert warnings.filters == filters, [f for f in warnings.filters if f not in filters]
assert dict.__getitem__(matplotlib.rcParams, "backend") == backend
assert "matplotlib.pyplot" not in sys.modules
print(len(lab))
"""


def test_importing_lab_changes_no_global_state() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_CHECK, str(LAB)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == len(list(LAB.rglob("*.py")))
    assert (LAB / "cli" / "app.py").is_file()  # the command line's package is among them


def test_main_ignores_the_chatter_only_while_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    def command() -> None:
        seen.append([str(f[1].pattern) for f in warnings.filters if f[1] is not None])

    monkeypatch.setattr("fedsparse.lab.cli.app", command)
    before = list(warnings.filters)
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 0
    assert all(message in seen[0] for message in QUIET_WARNINGS)
    assert warnings.filters == before


@pytest.mark.parametrize(("dataset", "batch", "lr"), [("digits", 64, 0.25), ("mnist-5k", 256, 0.5)])
def test_train_takes_the_datasets_tuned_defaults(
    tmp_path: Path, dataset: str, batch: int, lr: float
) -> None:
    """Unset --batch-size/--lr (and --epochs) come from TRAIN_DEFAULTS[dataset]; given ones win."""
    from fedsparse.lab.cli import TRAIN_DEFAULTS

    assert TRAIN_DEFAULTS[dataset][1:] == (batch, lr)
    args = ["train", "--out", str(tmp_path), "--dataset", dataset, "--epochs", "1"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    train = json.loads((tmp_path / "summary.json").read_text())["train"]
    assert (train["epochs"], train["batch_size"], train["lr"]) == (1, batch, lr)


def test_version_and_short_help() -> None:
    from importlib.metadata import version

    runner = CliRunner()
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert f"fedsparse {version('fedsparse')} (flwr {version('flwr')}" in result.output
    short = runner.invoke(app, ["-h"])
    assert short.exit_code == 0 and "simulate" in short.output
    assert runner.invoke(app, ["simulate", "-h"]).exit_code == 0


def test_an_unknown_command_is_suggested_once() -> None:
    result = CliRunner().invoke(app, ["report"])
    assert result.exit_code != 0
    assert result.output.count("Did you mean") == 1
    assert "'wire-report'" in result.output


class _Chosen(Exception):
    """Raised in place of a run: carries the backend the command resolved."""


@pytest.mark.parametrize("command", ["simulate", "sweep"])
def test_one_backend_vocabulary_in_every_command(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedsparse.lab.launch.backends import BACKEND_ALIASES, BACKEND_HELP, BACKENDS

    def simulate(**kwargs: object) -> None:
        raise _Chosen(kwargs["backend"])

    def sweep(plan: object, *, settings: object, **kwargs: object) -> None:
        raise _Chosen(settings.backend)  # type: ignore[attr-defined]

    monkeypatch.setattr("fedsparse.lab.launch.simulate.run_simulation", simulate)
    monkeypatch.setattr("fedsparse.lab.experiments.sweep.run_sweep", sweep)
    names = {**{name: name for name in BACKENDS}, **BACKEND_ALIASES}
    assert set(names) == {
        "flower",
        "inprocess",
        "deploy",
        "ray",
        "population",
        "ray-population",
        "simulation",
    }
    for name, resolved in names.items():
        args = [command, "--out", str(tmp_path / name), "--backend", name]
        result = CliRunner().invoke(app, args, env={"COLUMNS": "240"})
        assert isinstance(result.exception, _Chosen), (name, result.output)
        assert result.exception.args == (resolved,)
    help_text = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "240"}).output
    assert " ".join(BACKEND_HELP.split()) in " ".join(help_text.replace("│", " ").split())
    result = CliRunner().invoke(app, [command, "--backend", "rya"], env={"COLUMNS": "240"})
    assert result.exit_code != 0
    assert "backend='rya': expected one of flower, inprocess, deploy, ray" in result.output
    assert "(did you mean 'ray'?)" in result.output


def test_train_names_a_bad_out_and_the_files_a_dataset_needs(tmp_path: Path) -> None:
    file = tmp_path / "out.txt"
    file.write_text("")
    result = CliRunner().invoke(app, ["train", "--out", str(file)], env={"COLUMNS": "240"})
    assert result.exit_code == 2 and "exists and is not a directory" in result.output
    assert "Errno" not in result.output
    missing = CliRunner().invoke(
        app, ["train", "--out", str(tmp_path / "c"), "--dataset", "cifar10"]
    )
    message = str(missing.exception)
    assert "data-dir is not set" in message and "--data-dir" in message
    assert "data_batch_1" in message and "data_dir=None" not in message


def test_reconstruct_parses_the_options_of_the_m_entry_point() -> None:
    """``fedsparse reconstruct`` is ``python -m fedsparse.lab.research.inversion``: the same
    options, the same defaults; a value the study refuses is a usage error naming it."""
    from fedsparse.lab.cli.reconstruct import IMAGES, ITERATIONS, RESTARTS
    from fedsparse.lab.research.inversion.attack import InversionConfig
    from fedsparse.lab.research.inversion.grid import ExperimentConfig

    assert (
        ExperimentConfig.num_images,
        InversionConfig.iterations,
        InversionConfig.restarts,
    ) == (IMAGES, ITERATIONS, RESTARTS)
    runner = CliRunner()
    help_text = runner.invoke(app, ["reconstruct", "-h"])
    assert help_text.exit_code == 0
    for option in ("--out", "--images", "--iterations", "--restarts", "--seed", "--threads"):
        assert option in help_text.output
    assert "reconstruct" in runner.invoke(app, ["-h"]).output
    missing = runner.invoke(app, ["reconstruct"])
    assert missing.exit_code == 2 and "--out" in missing.output
    bad = runner.invoke(app, ["reconstruct", "--out", "x", "--restarts", "0"])
    assert bad.exit_code == 2 and "restarts=0" in bad.output


def test_reconstruct_runs_a_tiny_grid(tmp_path: Path) -> None:
    """Four images, two Adam steps: every output written, the command recorded."""
    out = tmp_path / "rec"
    result = CliRunner().invoke(
        app, ["reconstruct", "--out", str(out), "--images", "4", "--iterations", "2"]
    )
    assert result.exit_code == 0, result.output
    assert {p.name for p in out.iterdir()} == {
        "examples.png",
        "mse_vs_rate.png",
        "report.md",
        "results.csv",
    }
    report = (out / "report.md").read_text()
    assert f"Produced by `fedsparse reconstruct --out {out} --images 4 --iterations 2`" in report
