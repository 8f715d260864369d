"""The ``fedsparse train`` command: files written, epsilon within budget, accuracy above chance."""

import json
from pathlib import Path

from typer.testing import CliRunner

from fedsparse.lab.cli import app


def test_train_writes_epochs_and_summary(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = CliRunner().invoke(
        app,
        [
            "train",
            "--out",
            str(out),
            "--epochs",
            "3",
            "--final-rate",
            "0.9",
            "--target-epsilon",
            "2.0",
        ],
    )
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


def test_bad_option_names_field_and_value(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["train", "--out", str(tmp_path), "--final-rate", "1.5"])
    assert result.exit_code != 0
    assert "final_rate=1.5" in result.output
