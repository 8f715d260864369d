"""``fedsparse sweep``: grid parsing and validation, mean/SE, a real in-process sweep, resume."""

import contextlib
import csv
import json
import math
import os
import shlex
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from fedsparse.lab.cli import app
from fedsparse.lab.experiments import sweep as sweep_mod
from fedsparse.lab.experiments.report import PLOTS, ROUND_KEYS, mean_se, write_outputs
from fedsparse.lab.experiments.sweep import METRICS, run_sweep
from fedsparse.lab.experiments.sweep_backends import (
    RunSettings,
    ray_session,
    run_backend,
    standalone_command,
)
from fedsparse.lab.experiments.sweep_plan import parse_grid, plan_sweep, run_slug

PNG = b"\x89PNG\r\n\x1a\n"
ENV = {"COLUMNS": "240"}  # keep rich from wrapping error messages
INT_METRICS = [m for m in METRICS if m.startswith("total_") and m.endswith("_bytes")]


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def test_csv_columns_are_the_published_ones() -> None:
    # Taken from the record schema's metadata (common/wire/run_log.py); results.csv, summary.csv
    # and rounds.csv published so far have exactly these columns, in this order, but the last
    # (downlink_bits_per_param, added later: older records derive it from their bytes).
    assert METRICS == (
        "final_test_accuracy",
        "epsilon_max",
        "total_uplink_payload_bytes",
        "total_uplink_message_bytes",
        "total_downlink_payload_bytes",
        "total_downlink_message_bytes",
        "total_dense_uplink_bytes",
        "total_dense_downlink_bytes",
        "uplink_savings",
        "uplink_bits_per_param",
        "total_density",
        "downlink_bits_per_param",
    )
    assert ROUND_KEYS == (
        "round",
        "rate",
        "keep_fraction",
        "test_accuracy",
        "test_loss",
        "epsilon_max",
        "train_loss",
        "uplink_payload_bytes",
        "uplink_message_bytes",
        "downlink_payload_bytes",
        "downlink_message_bytes",
        "dense_uplink_bytes",
        "dense_downlink_bytes",
        "wall_seconds",
        "uplink_bits_per_param",
        "downlink_bits_per_param",
    )


def test_parse_grid_keeps_keys_and_values_in_order() -> None:
    grid = parse_grid(["final-rate=0, 0.5,0.9", "value-dtype=fp16,fp32"])
    assert grid == {"final-rate": ["0", "0.5", "0.9"], "value-dtype": ["fp16", "fp32"]}
    assert parse_grid([]) == {}


@pytest.mark.parametrize(
    ("items", "match"),
    [
        (["final-rate"], "--grid 'final-rate': expected key=v1,v2"),
        (["=0,1"], "expected key=v1,v2"),
        (["final-rate="], "--grid final-rate='': empty value"),
        (["final-rate=0,,0.5"], "--grid final-rate='0,,0.5': empty value"),
        (["final-rate=0.5,0,0.5"], "duplicate value 0.5"),
        (["final-rate=0", "final-rate=0.5"], "final-rate: given twice"),
    ],
)
def test_parse_grid_errors_name_key_and_value(items: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_grid(items)


@pytest.mark.parametrize(
    ("grid", "fixed", "kwargs", "match"),
    [
        (
            {"final-rate": ["0", "1.2"]},
            {},
            {},
            r"point final-rate=1\.2, seed 0: final-rate=1\.2",
        ),
        ({"value-dtype": ["fp32", "fp64"]}, {}, {}, "value-dtype='fp64': expected one of"),
        ({"num-round": ["1", "2"]}, {}, {}, "'num-round' is unknown"),
        ({"lr": ["0.1"]}, {"lr": "0.2"}, {}, "'lr' is in both --grid and --set"),
        ({"final-rate": ["0.5", "0.50"]}, {}, {}, "final-rate=0.50, seed 0: the same run config"),
        ({"seed": ["1", "2"]}, {}, {}, "--grid seed: not allowed here"),
        ({}, {"out-dir": "x"}, {}, "--set out-dir: not allowed"),
        ({}, {"seed": "-1"}, {}, "seed=-1"),
        ({}, {"lr": "fast"}, {}, "lr='fast': expected float"),
        ({"final-rate": ["0"]}, {}, {"seeds": 0}, "seeds=0: expected >= 1"),
        ({}, {"min-clients": "4"}, {"clients": 3}, "min-clients=4 > clients=3"),
    ],
)
def test_plan_rejects_bad_configs_before_running(grid, fixed, kwargs, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_sweep(grid, fixed, **{"seeds": 1, **kwargs})


def test_plan_is_the_cartesian_product_times_seeds() -> None:
    grid = {"final-rate": ["0", "0.9"], "value-dtype": ["fp32", "fp16", "bf16"]}
    plan = plan_sweep(grid, {"num-rounds": "2", "seed": "5"}, seeds=3)
    assert plan.seeds == (5, 6, 7) and len(plan.runs) == 2 * 3 * 3
    points = [(r.overrides["final-rate"], r.overrides["value-dtype"]) for r in plan.runs[::3]]
    assert points == [(r, d) for r in ("0", "0.9") for d in ("fp32", "fp16", "bf16")]
    first = plan.runs[:3]
    assert [r.seed for r in first] == [5, 6, 7]
    assert [r.overrides["seed"] for r in first] == ["5", "6", "7"]
    assert first[0].overrides == {
        "num-rounds": "2",
        "seed": "5",
        "final-rate": "0",
        "value-dtype": "fp32",
    }
    assert first[0].slug == "final-rate-0_value-dtype-fp32_seed-5"
    assert first[0].label == "final-rate=0, value-dtype=fp32"
    assert len({r.slug for r in plan.runs}) == len(plan.runs)
    # No grid: one config ("default") per seed.
    assert [r.label for r in plan_sweep({}, {}, seeds=2).runs] == ["default", "default"]


def test_slugs_are_filesystem_safe_and_unique() -> None:
    a = run_slug([("data-dir", "/tmp/a b")], 0)
    b = run_slug([("data-dir", "/tmp/a_b")], 0)
    assert a != b
    for slug in (a, b):
        assert all(c.isalnum() or c in ".+-_" for c in slug), slug


def test_mean_and_standard_error_by_hand() -> None:
    mean, se = mean_se([1, 2, 3, 4])  # var = (2.25 + .25 + .25 + 2.25) / 3 = 5/3
    assert mean == 2.5 and se == pytest.approx(math.sqrt(5 / 3) / 2, rel=1e-15)
    mean, se = mean_se([0.7, 0.9])  # |a - b| / 2 for two values
    assert mean == pytest.approx(0.8) and se == pytest.approx(0.1, rel=1e-12)
    mean, se = mean_se([5.0])
    assert mean == 5.0 and math.isnan(se)
    assert all(math.isnan(x) for x in mean_se([]))


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real sweep: final-rate 0 and 0.9, 2 seeds, 3 in-process clients, 2 rounds."""
    out = tmp_path_factory.mktemp("sweep")
    args = ["sweep", "--out", str(out), "--grid", "final-rate=0,0.9", "--seeds", "2"]
    args += ["--set", "num-rounds=2", "--clients", "3", "--backend", "inprocess"]
    result = CliRunner().invoke(app, args, env=ENV)
    assert result.exit_code == 0, result.output
    return out


def test_results_rows_equal_each_runs_summary(swept: Path) -> None:
    rows = read_csv(swept / "results.csv")
    assert [(r["final-rate"], r["seed"]) for r in rows] == [
        ("0", "0"),
        ("0", "1"),
        ("0.9", "0"),
        ("0.9", "1"),
    ]
    for row in rows:
        assert row["status"] == "ok" and row["reused"] == "False" and row["error"] == ""
        run_dir = swept / row["run_dir"]
        assert run_dir == swept / "runs" / row["slug"]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["config"]["final-rate"] == float(row["final-rate"])
        assert summary["config"]["seed"] == int(row["seed"]) and summary["rounds"] == 2
        for key in INT_METRICS:
            assert int(row[key]) == summary[key], key
        for key in ("final_test_accuracy", "epsilon_max", "uplink_savings"):
            assert float(row[key]) == summary[key], key  # floats round-trip exactly
        assert float(row["uplink_savings"]) == pytest.approx(
            summary["total_dense_uplink_bytes"] / summary["total_uplink_payload_bytes"]
        )
        assert float(row["wall_seconds"]) > 0
    # The two seeds are different runs (data order, noise, init), not copies.
    assert rows[0]["final_test_accuracy"] != rows[1]["final_test_accuracy"]


def test_each_run_records_the_command_that_reruns_it_alone(swept: Path, tmp_path: Path) -> None:
    row = next(r for r in read_csv(swept / "results.csv") if r["final-rate"] == "0.9")
    summary = json.loads((swept / row["run_dir"] / "summary.json").read_text())
    args = shlex.split(summary["command"])
    assert args[:2] == ["fedsparse", "simulate"] and "--backend" in args
    assert args[args.index("--clients") + 1] == "3"
    assert "final-rate=0.9" in args and f"seed={row['seed']}" in args
    args[args.index("--out") + 1] = str(tmp_path / "alone")
    result = CliRunner().invoke(app, args[1:], env=ENV)
    assert result.exit_code == 0, result.output
    alone = json.loads((tmp_path / "alone" / "summary.json").read_text())
    # the same federation: the same model, bytes and privacy, bit for bit
    for key in ("final_test_accuracy", "final_test_loss", "epsilon_max", *INT_METRICS):
        assert alone[key] == summary[key], key


def test_standalone_command_of_a_shaped_deployment(tmp_path: Path) -> None:
    from fedsparse.lab.launch.netns import parse_rate

    settings = RunSettings(
        backend="deploy", clients=4, uplink_bps=1.5e6, downlink_bps=8e6, timeout=600.0
    )
    line = standalone_command({"final-rate": "0.9", "seed": "3"}, tmp_path / "r", settings)
    args = shlex.split(line)
    assert args[:2] == ["fedsparse", "deploy"] and args[args.index("--nodes") + 1] == "4"
    assert args[args.index("--idle-seconds") + 1] == "0"  # a sweep's deployments skip it
    assert parse_rate(args[args.index("--uplink-rate") + 1]) == 1.5e6
    assert parse_rate(args[args.index("--downlink-rate") + 1]) == 8e6
    assert args[args.index("--timeout") + 1] == "600"
    assert args[6:10] == ["--set", "final-rate=0.9", "--set", "seed=3"]
    # the defaults stay out of a simulation's line
    plain = shlex.split(standalone_command({}, tmp_path, RunSettings(clients=2)))
    assert plain == ["fedsparse", "simulate", "--out", str(tmp_path), "--clients", "2"]


def test_sparsification_shrinks_the_uplink(swept: Path) -> None:
    rows = {(r["final-rate"], r["seed"]): r for r in read_csv(swept / "results.csv")}
    for seed in ("0", "1"):
        dense, sparse = rows["0", seed], rows["0.9", seed]
        for key in ("total_uplink_payload_bytes", "total_uplink_message_bytes"):
            assert int(sparse[key]) < 0.6 * int(dense[key]), key  # r = 0 then 0.9: keep 55%
        assert float(sparse["uplink_savings"]) > 1.7 > 1.0 > float(dense["uplink_savings"]) - 1e-3


def test_summary_is_numpy_mean_and_se_over_seeds(swept: Path) -> None:
    results = read_csv(swept / "results.csv")
    summary = read_csv(swept / "summary.csv")
    assert [s["config"] for s in summary] == ["final-rate=0", "final-rate=0.9"]
    for row in summary:
        runs = [r for r in results if r["final-rate"] == row["final-rate"]]
        assert int(row["n"]) == len(runs) == 2 and row["n_failed"] == "0"
        for metric in (*METRICS, "wall_seconds"):
            x = np.array([float(r[metric]) for r in runs])
            assert float(row[f"{metric}_mean"]) == pytest.approx(x.mean(), rel=1e-12, abs=0)
            se = x.std(ddof=1) / np.sqrt(x.size)
            assert float(row[f"{metric}_se"]) == pytest.approx(se, rel=1e-9, abs=1e-12)


def test_plots_and_report(swept: Path) -> None:
    report = (swept / "report.md").read_text()
    for name in PLOTS:
        data = (swept / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 1000, name
        assert f"]({name})" in report
    results, bits = report.split("## Uplink bits per parameter")
    table = [line for line in results.splitlines() if line.startswith("| final-rate=")]
    assert len(table) == 2
    # Each config against the references: fp32 values, so 32 bits/param at r = 0 and about
    # 32 * 0.1 at r = 0.9 late in the run (plus a header of a few bytes per client).
    per_config = [line.split(" | ") for line in bits.splitlines() if line.startswith("| final")]
    assert [row[0] for row in per_config] == ["| final-rate=0", "| final-rate=0.9"]
    assert 32 <= float(per_config[0][1]) < 32.1 and 3.2 < float(per_config[1][1]) < 32
    assert "(Chen et al. 2022) = 1.2" in bits
    assert table[0].startswith("| final-rate=0 | 2 | ") and " ± " in table[0]
    assert "--grid final-rate=0,0.9 --set num-rounds=2 --seeds 2 --clients 3" in report
    assert "| num-rounds | 2 |" in report and "| clients | 3 |" in report
    rounds = read_csv(swept / "rounds.csv")
    assert len(rounds) == 4 * 2 and {r["round"] for r in rounds} == {"1", "2"}


def test_resume_reuses_finished_runs(swept: Path, tmp_path: Path) -> None:
    summaries = sorted((swept / "runs").glob("*/summary.json"))
    assert len(summaries) == 4
    before = {p: p.stat().st_mtime_ns for p in summaries}
    args = ["sweep", "--out", str(tmp_path), "--runs-dir", str(swept / "runs")]
    args += ["--grid", "final-rate=0,0.9", "--seeds", "2", "--set", "num-rounds=2"]
    args += ["--clients", "3", "--backend", "inprocess"]
    refused = CliRunner().invoke(app, args, env=ENV)  # neither --resume nor --overwrite
    assert refused.exit_code == 2 and "holds 4 runs" in refused.output
    result = CliRunner().invoke(app, [*args, "--resume"], env=ENV)
    assert result.exit_code == 0, result.output
    assert result.output.count("reused") >= 4 and "4 ok (4 reused)" in result.output
    assert {p: p.stat().st_mtime_ns for p in summaries} == before
    again = read_csv(tmp_path / "results.csv")
    first = read_csv(swept / "results.csv")
    assert [r["reused"] for r in again] == ["True"] * 4
    for a, b in zip(again, first, strict=True):
        for key in (*METRICS, "wall_seconds"):
            assert a[key] == b[key], key


def test_a_finished_run_of_other_inputs_is_refused_by_name_never_rerun_over(
    monkeypatch: pytest.MonkeyPatch, swept: Path, tmp_path: Path
) -> None:
    calls: list[str] = []

    def fake(overrides, out, settings):
        calls.append(out.name)
        raise RuntimeError("not reused")

    monkeypatch.setattr(sweep_mod, "run_backend", fake)
    runs_dir = tmp_path / "runs"
    src = swept / "runs" / "final-rate-0_seed-0"
    (runs_dir / src.name).mkdir(parents=True)
    for name in ("summary.json", "sweep-run.json"):
        (runs_dir / src.name / name).write_bytes((src / name).read_bytes())
    same = plan_sweep({"final-rate": ["0"]}, {"num-rounds": "2"}, seeds=1)
    settings = RunSettings(backend="inprocess", clients=3)
    assert run_sweep(same, runs_dir=runs_dir, settings=settings)[0]["reused"] and not calls
    other = RunSettings(backend="inprocess", clients=4)  # same config, other federation
    (row,) = run_sweep(same, runs_dir=runs_dir, settings=other)
    assert row["status"] == "failed" and "clients=3, this sweep's has clients=4" in row["error"]
    lr = plan_sweep({"final-rate": ["0"]}, {"num-rounds": "2", "lr": "0.1"}, seeds=1)
    (row,) = run_sweep(lr, runs_dir=runs_dir, settings=settings)
    assert row["status"] == "failed" and "lr=0.25, this sweep's has lr=0.1" in row["error"]
    assert calls == []  # nothing was rerun over the finished run
    assert (runs_dir / src.name / "summary.json").read_bytes() == (
        src / "summary.json"
    ).read_bytes()


def test_a_run_recorded_with_another_engine_is_not_reused(
    monkeypatch: pytest.MonkeyPatch, swept: Path, tmp_path: Path
) -> None:
    # "auto" resolves by machine and model (and what it resolves to has changed between
    # versions); engines agree only to float rounding, so the record names the one that ran.
    calls: list[str] = []

    def fake(overrides, out, settings):
        calls.append(out.name)
        raise RuntimeError("not reused")

    monkeypatch.setattr(sweep_mod, "run_backend", fake)
    src = swept / "runs" / "final-rate-0_seed-0"
    record = json.loads((src / "sweep-run.json").read_text())
    assert record["engine"] == "factored" and record["config"]["engine"] == "auto"
    plan = plan_sweep({"final-rate": ["0"]}, {"num-rounds": "2"}, seeds=1)
    settings = RunSettings(backend="inprocess", clients=3)
    variants = {
        "same": {**record},
        "opacus": {**record, "engine": "opacus"},
        "unrecorded": {k: v for k, v in record.items() if k != "engine"},  # older than the key
    }
    reused = {}
    for name, variant in variants.items():
        run_dir = tmp_path / name / src.name
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_bytes((src / "summary.json").read_bytes())
        (run_dir / "sweep-run.json").write_text(json.dumps(variant))
        (row,) = run_sweep(plan, runs_dir=run_dir.parent, settings=settings)
        reused[name] = row["reused"]
        assert row["reused"] or "engine=" in row["error"], row
    assert reused == {"same": True, "opacus": False, "unrecorded": False}
    assert calls == []  # refused by name (--overwrite starts over), never rerun over
    # a record older than the key, of a run that named its engine, ran with that engine
    explicit = plan_sweep({"final-rate": ["0"]}, {"num-rounds": "2", "engine": "opacus"}, seeds=1)
    old = {**variants["unrecorded"], "config": {**record["config"], "engine": "opacus"}}
    run_dir = tmp_path / "explicit" / explicit.runs[0].slug
    run_dir.mkdir(parents=True)
    summary = json.loads((src / "summary.json").read_text())
    summary["config"]["engine"] = "opacus"
    (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / "sweep-run.json").write_text(json.dumps(old))
    assert run_sweep(explicit, runs_dir=run_dir.parent, settings=settings)[0]["reused"]


def test_a_run_recorded_under_an_older_backend_name_is_reused(
    monkeypatch: pytest.MonkeyPatch, swept: Path, tmp_path: Path
) -> None:
    # Flower's engine was the sweep's "simulation" backend; its finished runs stay reusable.
    monkeypatch.setattr(sweep_mod, "run_backend", lambda *args: pytest.fail("rerun"))
    src = swept / "runs" / "final-rate-0_seed-0"
    record = json.loads((src / "sweep-run.json").read_text())
    run_dir = tmp_path / "runs" / src.name
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_bytes((src / "summary.json").read_bytes())
    (run_dir / "sweep-run.json").write_text(json.dumps({**record, "backend": "simulation"}))
    plan = plan_sweep({"final-rate": ["0"]}, {"num-rounds": "2"}, seeds=1)
    settings = RunSettings(backend="simulation", clients=3)
    assert settings.backend == "flower"
    assert run_sweep(plan, runs_dir=run_dir.parent, settings=settings)[0]["reused"]


def test_the_default_backend_trains_a_new_run_on_population_with_inprocess_numbers(
    swept: Path, tmp_path: Path
) -> None:
    # No --backend: auto. A new run trains vectorised (population) and records that backend
    # and the line that reruns it; its bytes equal inprocess's run of the same cell exactly,
    # its accuracy to float32 rounding (client/population.py).
    out = tmp_path / "auto"
    args = ["sweep", "--out", str(out), "--grid", "final-rate=0.9", "--set", "num-rounds=2"]
    result = CliRunner().invoke(app, [*args, "--clients", "3"], env=ENV)
    assert result.exit_code == 0, result.output
    (row,) = read_csv(out / "results.csv")
    run_dir = out / "runs" / row["slug"]
    assert json.loads((run_dir / "sweep-run.json").read_text())["backend"] == "population"
    command = shlex.split(json.loads((run_dir / "summary.json").read_text())["command"])
    assert command[command.index("--backend") + 1] == "population"
    assert "--backend auto" in (out / "report.md").read_text()
    assert "auto (new runs: population;" in (out / "report.md").read_text()
    (reference,) = [r for r in read_csv(swept / "results.csv") if r["slug"] == row["slug"]]
    for key in INT_METRICS:
        assert row[key] == reference[key], key
    assert float(row["epsilon_max"]) == pytest.approx(float(reference["epsilon_max"]), rel=1e-12)
    # float32 rounding may flip an example on the boundary: two of digits' 360 test examples
    gap = abs(float(row["final_test_accuracy"]) - float(reference["final_test_accuracy"]))
    assert gap <= 2 / 360 + 1e-12


def test_auto_keeps_a_folders_finished_run_on_the_backend_that_ran_it(
    monkeypatch: pytest.MonkeyPatch, swept: Path, tmp_path: Path
) -> None:
    # A recorded sweep (inprocess, or Flower's engine under its old name) is reused under
    # auto; another config in such a folder is refused by that key, not by the backend; an
    # empty folder runs on population.
    ran: list[tuple[str, str]] = []

    def fake(overrides, out, settings):
        ran.append((out.name, settings.fresh_backend))
        raise RuntimeError("ran")

    monkeypatch.setattr(sweep_mod, "run_backend", fake)
    src = swept / "runs" / "final-rate-0_seed-0"
    record = json.loads((src / "sweep-run.json").read_text())
    assert record["backend"] == "inprocess"
    plan = plan_sweep({"final-rate": ["0"]}, {"num-rounds": "2"}, seeds=1)
    auto = RunSettings(backend="auto", clients=3)
    for name, backend in (("inprocess", "inprocess"), ("old-name", "simulation")):
        run_dir = tmp_path / name / src.name
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_bytes((src / "summary.json").read_bytes())
        (run_dir / "sweep-run.json").write_text(json.dumps({**record, "backend": backend}))
        (row,) = run_sweep(plan, runs_dir=run_dir.parent, settings=auto)
        assert row["status"] == "ok" and row["reused"], row
    lr = plan_sweep({"final-rate": ["0"]}, {"num-rounds": "2", "lr": "0.1"}, seeds=1)
    (row,) = run_sweep(lr, runs_dir=tmp_path / "inprocess", settings=auto)
    assert row["status"] == "failed" and "lr=0.25, this sweep's has lr=0.1" in row["error"]
    assert ran == []  # nothing was rerun over a finished run
    (row,) = run_sweep(plan, runs_dir=tmp_path / "new", settings=auto)
    assert row["status"] == "failed" and ran == [(src.name, "population")]
    # a run recorded as failed is not a finished run: it runs again, on auto's choice
    run_dir = tmp_path / "failed" / src.name
    run_dir.mkdir(parents=True)
    (run_dir / "sweep-run.json").write_text(json.dumps({**record, "status": "failed"}))
    run_sweep(plan, runs_dir=run_dir.parent, settings=auto)
    # the same run recorded on inprocess whose summary is gone trains again, but on auto's
    # choice (what the sweep set up), never on the recorded backend
    run_dir = tmp_path / "no-summary" / src.name
    run_dir.mkdir(parents=True)
    (run_dir / "sweep-run.json").write_text(json.dumps(record))
    run_sweep(plan, runs_dir=run_dir.parent, settings=auto)
    # a record that is not an object is no finished run (the sweep goes on)
    run_dir = tmp_path / "list" / src.name
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_bytes((src / "summary.json").read_bytes())
    (run_dir / "sweep-run.json").write_text("[1, 2]")
    (row,) = run_sweep(plan, runs_dir=run_dir.parent, settings=auto)
    assert row["status"] == "failed" and row["error"] == "RuntimeError: ran"
    assert ran == [(src.name, "population")] * 4
    # a cluster address asks new runs for ray-population; a recorded population run is
    # still reused under it (reuse needs no cluster)
    recorded = tmp_path / "population" / src.name
    recorded.mkdir(parents=True)
    (recorded / "summary.json").write_bytes((src / "summary.json").read_bytes())
    (recorded / "sweep-run.json").write_text(json.dumps({**record, "backend": "population"}))
    cluster = RunSettings(backend="auto", clients=3, ray_address="127.0.0.1:1")
    (row,) = run_sweep(plan, runs_dir=recorded.parent, settings=cluster)
    assert row["status"] == "ok" and row["reused"], row


def test_auto_picks_ray_population_for_a_cluster_or_gpus_and_refuses_shaped_links() -> None:
    assert RunSettings(backend="auto").fresh_backend == "population"
    assert RunSettings(backend="auto").backend_traits.in_process
    cluster = RunSettings(backend="auto", ray_address="auto")
    assert cluster.fresh_backend == "ray-population" and cluster.backend_traits.cluster
    assert RunSettings(backend="auto", gpus_per_client=0.5).fresh_backend == "ray-population"
    with pytest.raises(ValueError, match=r"uplink-rate: shaped links need --backend deploy"):
        RunSettings(backend="auto", uplink_bps=1e6)
    with pytest.raises(ValueError, match="jobs=2: expected 1 with backend='auto'"):
        sweep_mod.check_jobs(cluster, 2)
    assert RunSettings(backend="inprocess").for_folder(Path("/nonexistent")).backend == "inprocess"
    assert RunSettings(backend="auto").for_folder(Path("/nonexistent")).backend == "population"


@pytest.mark.parametrize("backend", ["inprocess", "population"])
def test_an_in_process_run_past_its_timeout_fails_with_it(backend: str, tmp_path: Path) -> None:
    # In process the deadline is checked when a round's replies are pulled: round 1 here.
    plan = plan_sweep({}, {"num-rounds": "2"}, seeds=1)
    settings = RunSettings(backend=backend, clients=2, timeout=1e-6)
    (row,) = run_sweep(plan, runs_dir=tmp_path / "runs", settings=settings)
    assert row["status"] == "failed", row
    assert "timeout=1e-06 s: the run's deadline passed" in row["error"], row["error"]


def test_a_job_process_gets_its_share_of_the_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    from fedsparse.lab.experiments import sweep_backends

    monkeypatch.setattr(sweep_backends.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    monkeypatch.setattr(sweep_backends, "_JOB_THREADS", None)
    sweep_backends.share_cpus(2)
    assert sweep_backends._JOB_THREADS == 2
    sweep_backends.share_cpus(8)
    assert sweep_backends._JOB_THREADS == 1


def test_a_failed_run_is_recorded_and_the_others_go_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    real = sweep_mod.run_backend

    def flaky(overrides, out, settings):
        if overrides["final-rate"] == "0.5":
            raise RuntimeError("disk on fire\nsecond line")
        return real(overrides, out, settings)

    monkeypatch.setattr(sweep_mod, "run_backend", flaky)
    plan = plan_sweep({"final-rate": ["0", "0.5", "0.9"]}, {"num-rounds": "1"}, seeds=1)
    settings = RunSettings(backend="inprocess", clients=2)
    rows = run_sweep(plan, runs_dir=tmp_path / "runs", settings=settings)
    assert [r["status"] for r in rows] == ["ok", "failed", "ok"]
    failed = rows[1]
    assert failed["error"] == "RuntimeError: disk on fire | second line"
    assert failed["final_test_accuracy"] is None
    assert "disk on fire" in (tmp_path / "runs" / failed["slug"] / "error.txt").read_text()
    assert not (tmp_path / "runs" / failed["slug"] / "summary.json").exists()
    write_outputs(tmp_path, plan, settings, rows, command="fedsparse sweep ...")
    summary = {s["config"]: s for s in read_csv(tmp_path / "summary.csv")}
    bad = summary["final-rate=0.5"]
    assert (bad["n"], bad["n_failed"], bad["final_test_accuracy_mean"]) == ("0", "1", "")
    good = summary["final-rate=0.9"]
    assert good["n"] == "1" and good["final_test_accuracy_se"] == ""  # SE blank for n = 1
    results = read_csv(tmp_path / "results.csv")
    assert results[1]["status"] == "failed" and results[1]["final_test_accuracy"] == ""
    report = (tmp_path / "report.md").read_text()
    assert "## Failed runs" in report and "disk on fire" in report
    assert "| final-rate=0.5 | 0 | — |" in report
    # A failed run is retried next time; finished ones are reused.
    monkeypatch.setattr(sweep_mod, "run_backend", real)
    again = run_sweep(plan, runs_dir=tmp_path / "runs", settings=settings)
    assert [(r["status"], r["reused"]) for r in again] == [
        ("ok", True),
        ("ok", False),
        ("ok", True),
    ]


def test_parallel_jobs_keep_plan_order(tmp_path: Path) -> None:
    plan = plan_sweep({"final-rate": ["0", "0.5", "0.9"]}, {}, seeds=2)

    def fake(run, run_dir, settings):
        return {"slug": run.slug, "status": "ok", "reused": False, "error": "", **metrics}

    metrics = {"final_test_accuracy": 0.5, "total_uplink_payload_bytes": 1000}

    rows = run_sweep(
        plan, runs_dir=tmp_path, settings=RunSettings(backend="flower"), jobs=3, execute=fake
    )
    assert [r["slug"] for r in rows] == [r.slug for r in plan.runs]


def test_cli_validates_before_running(tmp_path: Path) -> None:
    out = tmp_path / "never"
    args = ["sweep", "--out", str(out), "--grid", "final-rate=0,1.5", "--backend", "inprocess"]
    result = CliRunner().invoke(app, args, env=ENV)
    assert result.exit_code != 0 and "final-rate=1.5" in result.output
    assert not out.exists()
    result = CliRunner().invoke(app, ["sweep", "--out", str(out), "--backend", "dask"], env=ENV)
    assert result.exit_code != 0 and "backend='dask'" in result.output


@pytest.mark.slow
def test_simulation_backend_sweep(tmp_path: Path) -> None:
    """One config, 2 rounds, 2 clients on Flower's simulation engine."""
    plan = plan_sweep({"final-rate": ["0.5"]}, {"num-rounds": "2"}, seeds=1)
    settings = RunSettings(backend="flower", clients=2, timeout=300)
    rows = run_sweep(plan, runs_dir=tmp_path / "runs", settings=settings)
    assert rows[0]["status"] == "ok", rows[0]["error"]
    summary = json.loads((tmp_path / "runs" / rows[0]["slug"] / "summary.json").read_text())
    assert rows[0]["total_uplink_payload_bytes"] == summary["total_uplink_payload_bytes"] > 0
    assert (tmp_path / "runs" / rows[0]["slug"] / "flwr.log").exists()
    assert os.path.isdir(tmp_path / "runs" / rows[0]["slug"] / ".flwr")


def test_shaped_links_only_on_deployments_and_part_of_a_runs_identity() -> None:
    with pytest.raises(ValueError, match="uplink-rate: shaped links need --backend deploy"):
        RunSettings(backend="flower", uplink_bps=1e6)
    run = plan_sweep({}, {"num-rounds": "2"}, seeds=1, clients=2).runs[0]
    slow = sweep_mod._identity(run, RunSettings(backend="deploy", clients=2, uplink_bps=1e6))
    fast = sweep_mod._identity(run, RunSettings(backend="deploy", clients=2, uplink_bps=8e6))
    assert slow != fast and slow["uplink_bps"] == 1e6  # a finished run at 8 Mbit/s is not reused


def test_scale_clip_keeps_clip_over_one_minus_momentum() -> None:
    """The scaling rule (RS App. H): C / (1 - mu) of every run equals the fixed C at mu = 0."""
    plan = plan_sweep(
        parse_grid(["momentum=0,0.5,0.9"]),
        {"max-grad-norm": "2.0"},
        seeds=1,
        scale_clip=True,
    )
    clips = {r.overrides["momentum"]: float(r.overrides["max-grad-norm"]) for r in plan.runs}
    assert clips == pytest.approx({"0": 2.0, "0.5": 1.0, "0.9": 0.2})
    for run in plan.runs:
        mu = float(run.overrides["momentum"])
        assert float(run.overrides["max-grad-norm"]) / (1 - mu) == pytest.approx(2.0)
    plain = plan_sweep(parse_grid(["momentum=0,0.9"]), {"max-grad-norm": "2.0"}, seeds=1)
    assert {r.overrides["max-grad-norm"] for r in plain.runs} == {"2.0"}
    with pytest.raises(ValueError, match="max-grad-norm is set by the rule"):
        plan_sweep(parse_grid(["max-grad-norm=1,2"]), {}, seeds=1, scale_clip=True)
    with pytest.raises(ValueError, match="momentum=1.0"):
        plan_sweep(parse_grid(["momentum=1.0"]), {}, seeds=1, scale_clip=True)


def test_a_ray_cluster_that_does_not_answer_is_tried_once_per_sweep(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from fedsparse.lab.simulation import rayworkers

    tried: list[str | None] = []

    @contextlib.contextmanager
    def nowhere(*, address: str | None = None, **_: object) -> Iterator[None]:
        tried.append(address)
        raise RuntimeError(f"ray_address={address}: no Ray cluster answers there")
        yield

    monkeypatch.setattr(rayworkers, "ray_cluster", nowhere)
    settings = RunSettings(backend="ray", clients=2, ray_address="192.0.2.1:6379")
    messages = []
    with ray_session(settings):
        for i in range(3):
            with pytest.raises(RuntimeError, match="ray_address=192.0.2.1:6379: no Ray") as info:
                run_backend({"num-rounds": "1"}, tmp_path / str(i), settings)
            messages.append(str(info.value))
    assert tried == ["192.0.2.1:6379"]  # later runs fail at once, not after a timeout each
    assert messages[1] == messages[2] and messages[1].endswith("first ray run found none)")
