"""``fedsparse frontier``: arms parsed and checked before any run, verdicts from intervals,
bits per parameter from the runs' byte totals, and one small frontier end to end."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
from scipy import stats
from typer.testing import CliRunner

from fedsparse.lab.cli import app
from fedsparse.lab.experiments.frontier import (
    DEFAULT_ARMS,
    DEFAULT_TUNE,
    grid_edges,
    parse_arm,
    verdict,
)
from fedsparse.lab.experiments.tuning import plan_tuning

ENV = {"COLUMNS": "240"}


def test_an_arm_is_parsed_in_order_and_bad_ones_are_named() -> None:
    arm = parse_arm("final-rate=0.9, value-dtype=int2,schedule=constant")
    assert list(arm.items()) == [
        ("final-rate", "0.9"),
        ("value-dtype", "int2"),
        ("schedule", "constant"),
    ]
    for text, match in (
        ("final-rate", "expected key=value"),
        ("final-rate=", "expected key=value"),
        ("lr=1,lr=2", "lr given twice"),
        ("seed=3", "seed is not allowed"),
    ):
        with pytest.raises(ValueError, match=match):
            parse_arm(text)


def test_the_verdict_reads_the_interval_against_one_point() -> None:
    assert verdict(-0.009, 0.02) == "within"
    assert verdict(-0.05, -0.011) == "not within"
    assert verdict(-0.02, 0.01) == "inconclusive"
    assert verdict(math.nan, math.nan).startswith("inconclusive")


def test_a_pick_at_an_end_of_its_grid_is_named() -> None:
    tune = {"lr": ["0.05", "0.1", "0.25"], "num-rounds": ["20", "40"], "momentum": ["0.9"]}
    assert grid_edges((("lr", "0.1"), ("momentum", "0.9")), tune) == ""
    assert grid_edges((("lr", "0.05"), ("num-rounds", "40")), tune) == (
        "lr=0.05 (lowest), num-rounds=40 (highest)"
    )


def test_every_default_arm_is_a_valid_run_config_and_the_baseline_is_dense_fp32() -> None:
    assert DEFAULT_ARMS[0] == {"final-rate": "0", "value-dtype": "fp32"}
    fixed = {"dataset": "digits", "target-epsilon": "3"}
    for arm in DEFAULT_ARMS:
        plan = plan_tuning({}, DEFAULT_TUNE, {**fixed, **arm}, tune_seeds=2, clients=10)
        assert len(plan.runs) == 2 * math.prod(len(v) for v in DEFAULT_TUNE.values())
    # (1 - r) b bits a parameter: every constant-rate arm is meant to reach <= 1 bit
    bits = {"int8": 8, "int4": 4, "int2": 2, "int1": 1}
    for arm in DEFAULT_ARMS:
        if arm.get("schedule") == "constant":
            assert (1 - float(arm["final-rate"])) * bits[arm["value-dtype"]] <= 0.8 + 1e-9


def test_a_bad_arm_is_refused_before_any_run(tmp_path: Path) -> None:
    args = ["frontier", "--out", str(tmp_path / "f"), "--arm", "final-rate=0"]
    args += ["--arm", "final-rate=0.9,value-dtype=int3", "--backend", "inprocess"]
    result = CliRunner().invoke(app, args, env=ENV)
    assert result.exit_code != 0 and "int3" in result.output, result.output
    assert not (tmp_path / "f" / "runs").exists()


@pytest.mark.slow
def test_a_small_frontier_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "frontier"
    args = ["frontier", "--out", str(out), "--arm", "final-rate=0,value-dtype=fp32"]
    args += ["--arm", "final-rate=0.9,value-dtype=int2,schedule=constant"]
    args += ["--tune", "lr=0.25,0.5", "--set", "num-rounds=2", "--seeds", "3"]
    args += ["--tune-seeds", "1", "--clients", "3", "--backend", "inprocess"]
    args += ["--extend-corners", "0"]  # the grid as given
    result = CliRunner().invoke(app, args, env=ENV)
    assert result.exit_code == 0, result.output
    with (out / "frontier.csv").open() as fh:
        dense, sparse = list(csv.DictReader(fh))
    assert dense["verdict"] == "baseline" and int(sparse["seeds"]) == 3
    # Bits per parameter are the final runs' payload bytes over their dense fp32 bytes.
    arm_dir = out / "runs" / "final-rate-0.9_value-dtype-int2_schedule-constant"
    best = sparse["best"].replace("=", "-")
    bits, accuracy = [], {}
    for seed in range(3):
        summary = json.loads((arm_dir / f"{best}_seed-{seed}" / "summary.json").read_text())
        metrics = summary
        total, dense_total = (
            metrics["total_uplink_payload_bytes"],
            metrics["total_dense_uplink_bytes"],
        )
        bits.append(32 * total / dense_total)
        accuracy[seed] = metrics["final_test_accuracy"]
        assert summary["config"]["schedule"] == "constant"
    assert float(sparse["uplink_bits_per_param"]) == pytest.approx(sum(bits) / 3)
    # int2 on 10% of the coordinates: 0.2 bits, plus a scale per value block.
    assert 0.2 < float(sparse["uplink_bits_per_param"]) < 0.3
    assert float(dense["uplink_bits_per_param"]) == pytest.approx(32, abs=0.01)
    # The difference and its interval are paired by seed with the dense arm's runs.
    dense_dir = out / "runs" / "final-rate-0_value-dtype-fp32"
    dense_best = dense["best"].replace("=", "-")
    diffs = []
    for seed in range(3):
        summary = json.loads((dense_dir / f"{dense_best}_seed-{seed}" / "summary.json").read_text())
        diffs.append(accuracy[seed] - summary["final_test_accuracy"])
    mean = sum(diffs) / 3
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 2)
    half = stats.t.ppf(0.975, 2) * sd / math.sqrt(3)
    assert float(sparse["difference_vs_dense"]) == pytest.approx(mean)
    assert float(sparse["difference_low"]) == pytest.approx(mean - half)
    assert sparse["verdict"] == verdict(mean - half, mean + half)
    report = (out / "report.md").read_text()
    assert "fedsparse frontier --out" in report and "| final-rate=0.9, value-dtype=int2" in report
    for name in ("uplink_bits", "downlink_bits", "client_bytes"):
        assert (out / f"accuracy_vs_{name}.png").stat().st_size > 10_000


def test_a_frontier_with_failed_runs_exits_non_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that failed (one that trained nothing, say) is not a result: the frontier still
    writes its report of what finished, then exits 1."""
    from types import SimpleNamespace

    from typer.testing import CliRunner

    from fedsparse.lab.cli import app
    from fedsparse.lab.experiments import frontier as frontier_mod

    outcome = SimpleNamespace(
        label="final-rate=0", accuracy=0.5, uplink_bits=32.0, downlink_bits=32.0,
        verdict="baseline", seeds=1,
    )  # fmt: skip
    written: list[Path] = []
    monkeypatch.setattr(frontier_mod, "run_frontier", lambda *a, **k: [outcome])
    monkeypatch.setattr(frontier_mod, "write_frontier", lambda out, *a, **k: written.append(out))
    args = ["frontier", "--out", str(tmp_path), "--arm", "final-rate=0", "--seeds", "2"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "240"})
    assert result.exit_code == 1 and "runs failed" in result.output
    assert written == [tmp_path]
