"""Tuning past grid corners (``lab/experiments/corners.py``, ``run_tuned_sweep(extend=N)``):
a pick at an end of a numeric axis extends the axis until the pick is interior or at its cap."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fedsparse.lab.cli import app
from fedsparse.lab.experiments import frontier, tuning
from fedsparse.lab.experiments.corners import beyond, corner_label, corners
from fedsparse.lab.experiments.sweep_backends import RunSettings
from fedsparse.lab.experiments.sweep_plan import parse_grid
from fedsparse.lab.experiments.tuning import render_tuning, run_tuned_sweep


def test_corners_are_the_numeric_ends_of_axes_of_two_or_more_values() -> None:
    grid = {"lr": ["0.5", "0.1", "1"], "num-rounds": ["20"], "method": ["rs", "gip"]}
    best = (("lr", "0.1"), ("num-rounds", "20"), ("method", "rs"))
    assert corners(best, grid) == [("lr", "0.1", "lowest")]  # not first in the list: lowest
    assert corners((("lr", "1"),), grid) == [("lr", "1", "highest")]
    assert corners((("lr", "0.5"),), grid) == []  # interior
    assert corner_label([("lr", "0.1", "lowest"), ("num-rounds", "80", "highest")]) == (
        "lr=0.1 (lowest), num-rounds=80 (highest)"
    )


@pytest.mark.parametrize(
    ("values", "side", "expected"),
    [
        (["0.1", "0.5"], "lowest", "0.05"),
        (["0.1", "0.5"], "highest", "1"),
        (["0.025", "0.05"], "lowest", "0.0125"),
        (["40", "80", "160"], "highest", "320"),
        (["40", "80"], "lowest", "20"),
        (["3", "8"], "lowest", "1"),  # integer halving, floor
        (["1", "2"], "lowest", None),  # an integer axis stays >= 1
        (["0", "0.5"], "lowest", None),  # 0 does not scale
        (["rs", "gip"], "highest", None),  # no order
        (["-2", "-1"], "highest", None),  # x2 would move inwards
    ],
)
def test_beyond_is_one_geometric_step_past_the_end(
    values: list[str], side: str, expected: str | None
) -> None:
    assert beyond(values, side) == expected  # type: ignore[arg-type]


def test_an_axis_is_one_of_integers_by_its_run_config_key() -> None:
    assert beyond(["1", "2", "4"], "lowest", "lr") == "0.5"  # lr is a float key
    assert beyond(["1", "2"], "lowest", "local-epochs") is None  # an int key, at 1
    assert beyond(["40", "80"], "highest", "num-rounds") == "160"


#: Validation accuracy: each arm's peak at lr = 0.125 (rate 0) or 0.5 (rate 0.9), at 20 rounds.
PEAK = {"0": 0.125, "0.9": 0.5}


def _accuracy(point: dict[str, str], seed: int) -> float:
    lr, rounds = float(point["lr"]), float(point.get("num-rounds", "20"))
    score = 0.9 - 0.05 * abs(math.log2(lr / PEAK[point["final-rate"]]))
    score -= 0.02 * abs(math.log2(rounds / 20))
    return score + 0.001 * (seed % 7) + (0.02 if point["final-rate"] == "0.9" else 0.0)


def _fake_sweep(ran: list[dict[str, str]]):  # type: ignore[no-untyped-def]
    def run_sweep(plan: Any, **kwargs: Any) -> list[dict[str, Any]]:
        rows = []
        for run in plan.runs:
            point = {k: str(v) for k, v in run.overrides.items()}  # the arm's fixed keys too
            ran.append({**point, "split": run.overrides["eval-split"]})
            rows.append(
                {
                    "status": "ok",
                    "final_test_accuracy": _accuracy(point, run.seed),
                    "seed": run.seed,
                    **dict.fromkeys(("total_uplink_payload_bytes", "total_dense_uplink_bytes"), 8),
                    **dict.fromkeys(
                        ("total_downlink_payload_bytes", "total_dense_downlink_bytes"), 8
                    ),
                }
            )
        return rows

    return run_sweep


def _tuned(monkeypatch: pytest.MonkeyPatch, extend: int, tune: list[str]):  # type: ignore[no-untyped-def]
    ran: list[dict[str, str]] = []
    monkeypatch.setattr(tuning, "run_sweep", _fake_sweep(ran))
    result = run_tuned_sweep(
        parse_grid(["final-rate=0,0.9"]),
        parse_grid(tune),
        {},
        tune_seeds=2,
        seeds=3,
        settings=RunSettings(backend="inprocess", clients=3),
        runs_dir=Path("unused"),
        extend=extend,
    )
    return result, [r for r in ran if r["split"] == "validation"]


def test_each_arm_is_extended_until_its_pick_is_interior(monkeypatch: pytest.MonkeyPatch) -> None:
    result, ran = _tuned(monkeypatch, 4, ["lr=0.5,1", "num-rounds=10,20"])
    picks = {c.label: dict(c.best) for c in result.choices}
    assert picks == {
        "final-rate=0": {"lr": "0.125", "num-rounds": "20"},
        "final-rate=0.9": {"lr": "0.5", "num-rounds": "20"},
    }
    assert all(c.capped == "" for c in result.choices)
    tried = {r["final-rate"]: set() for r in ran}
    for r in ran:
        tried[r["final-rate"]].add((r["lr"], r["num-rounds"]))
    # rate 0: lr halved three times (0.125 then interior), each new lr with every round count
    # so far; rounds doubled once (40: 20 became interior); rate 0.9's lr was interior after
    # one step down (0.25), its rounds likewise.
    lrs = {lr for lr, _ in tried["0"]}
    assert lrs == {"1", "0.5", "0.25", "0.125", "0.0625"}
    assert {rounds for lr, rounds in tried["0"] if lr == "0.0625"} == {"10", "20", "40"}
    assert {lr for lr, _ in tried["0.9"]} == {"1", "0.5", "0.25"}
    assert {rounds for _, rounds in tried["0.9"]} == {"10", "20", "40"}
    assert len(ran) == len({tuple(sorted(r.items())) for r in ran})  # no run twice
    # the final runs are at the extended picks
    assert {tuple(sorted(dict(run.point).items())) for run in result.plan.runs} == {
        (("final-rate", "0"), ("lr", "0.125"), ("num-rounds", "20")),
        (("final-rate", "0.9"), ("lr", "0.5"), ("num-rounds", "20")),
    }
    assert "at the cap" not in "\n".join(
        render_tuning(result.choices, result.differences, tune={}, tune_seeds=2)
    )


def test_a_pick_still_at_an_end_is_at_the_cap_and_gets_no_verdict(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    result, ran = _tuned(monkeypatch, 1, ["lr=0.5,1"])
    baseline = result.choices[0]
    assert dict(baseline.best) == {"lr": "0.25"} and baseline.capped == "lr=0.25 (lowest)"
    assert result.choices[1].capped == ""  # 0.5 became interior once 0.25 ran
    assert {r["lr"] for r in ran if r["final-rate"] == "0"} == {"1", "0.5", "0.25"}
    lines = render_tuning(result.choices, result.differences, tune={}, tune_seeds=2)
    row = next(line for line in lines if line.startswith("| final-rate=0.9 − final-rate=0"))
    assert row.endswith("| at the cap (final-rate=0: lr=0.25 (lowest)) |")
    assert not any("is not significant" in line for line in lines)


def test_without_extend_the_grid_is_as_given(monkeypatch: pytest.MonkeyPatch) -> None:
    result, ran = _tuned(monkeypatch, 0, ["lr=0.5,1"])
    assert {r["lr"] for r in ran} == {"0.5", "1"} and len(ran) == 8
    assert all(c.capped == "" for c in result.choices)


def test_the_frontier_marks_an_arm_at_the_cap_and_judges_none_against_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(tuning, "run_sweep", _fake_sweep([]))
    arms = [{"final-rate": "0"}, {"final-rate": "0.9"}]
    settings = RunSettings(backend="inprocess", clients=3)
    kwargs: dict[str, Any] = dict(tune_seeds=1, seeds=3, settings=settings, runs_dir=tmp_path)
    capped = frontier.run_frontier(arms, {"lr": ["0.5", "1"]}, {}, extend=1, **kwargs)
    assert [(o.capped, o.edge, o.verdict) for o in capped] == [
        (True, "lr=0.25 (lowest)", "baseline"),
        (False, "", "at the cap"),  # its own pick is interior; the baseline's is not
    ]
    interior = frontier.run_frontier(arms, {"lr": ["0.5", "1"]}, {}, extend=3, **kwargs)
    assert [(o.capped, o.best) for o in interior] == [(False, "lr=0.125"), (False, "lr=0.5")]
    assert interior[1].verdict != "at the cap"


def test_the_commands_refuse_a_negative_cap_and_a_cap_without_tuning(tmp_path: Path) -> None:
    env = {"COLUMNS": "240"}
    for args in (
        ["sweep", "--out", str(tmp_path / "a"), "--extend-corners", "2"],
        ["sweep", "--out", str(tmp_path / "b"), "--tune", "lr=0.1,1", "--extend-corners", "-1"],
        ["frontier", "--out", str(tmp_path / "c"), "--extend-corners", "-1"],
    ):
        result = CliRunner().invoke(app, args, env=env)
        assert result.exit_code != 0 and "--extend-corners" in result.output, result.output
        assert not (tmp_path / args[2]).exists()


def test_an_axis_the_run_config_bounds_ends_there_and_keeps_its_verdict(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """momentum=0.9 at the top: 1.8 is refused by the run config (no crash, no run); a pick
    there, or at local-epochs=1, is an edge, not at the cap."""
    ran: list[dict[str, str]] = []

    def run_sweep(plan: Any, **kwargs: Any) -> list[dict[str, Any]]:
        rows = []
        for run in plan.runs:
            point = {k: str(v) for k, v in run.overrides.items()}
            ran.append(point)
            score = float(point["momentum"]) - 0.1 * float(point["local-epochs"])
            rows.append({"status": "ok", "final_test_accuracy": score, "seed": run.seed})
        return rows

    monkeypatch.setattr(tuning, "run_sweep", run_sweep)
    result = run_tuned_sweep(
        parse_grid(["final-rate=0,0.9"]),
        parse_grid(["momentum=0,0.5,0.9", "local-epochs=1,2"]),
        {},
        tune_seeds=1,
        seeds=2,
        settings=RunSettings(backend="inprocess", clients=3),
        runs_dir=Path("unused"),
        extend=3,
    )
    for choice in result.choices:
        assert dict(choice.best) == {"momentum": "0.9", "local-epochs": "1"}
        assert choice.capped == ""
        assert choice.edges == "momentum=0.9 (highest), local-epochs=1 (lowest)"
    tuned = [r for r in ran if r["eval-split"] == "validation"]
    assert len(tuned) == 2 * 6  # the grid as given: nothing past either bound ran
    lines = render_tuning(result.choices, result.differences, tune={}, tune_seeds=1)
    assert not any("at the cap" in line for line in lines)


class _Stop(ValueError):
    """Ends a command once it has called the tuner (the CLI reports a ValueError)."""


def test_the_commands_extend_twice_unless_told_and_record_the_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--extend-corners`` defaults to 2 in ``sweep --tune`` and ``frontier``; 0 keeps the grid
    as given; the frontier's report records the cap it ran with, 0 included."""
    seen: list[int] = []

    def tuned(*args: Any, extend: int, **kwargs: Any) -> Any:
        seen.append(extend)
        raise _Stop("stop")

    monkeypatch.setattr(tuning, "run_tuned_sweep", tuned)
    commands: list[str] = []

    def frontier_runs(*args: Any, extend: int, **kwargs: Any) -> list[Any]:
        seen.append(extend)
        return []

    monkeypatch.setattr(frontier, "run_frontier", frontier_runs)
    monkeypatch.setattr(
        frontier, "write_frontier", lambda out, *a, command, **k: commands.append(command)
    )
    env = {"COLUMNS": "240"}
    sweep = ["sweep", "--tune", "lr=0.1,1", "--backend", "inprocess"]
    for i, extra in enumerate(([], ["--extend-corners", "0"], ["--extend-corners", "3"])):
        result = CliRunner().invoke(
            app, [*sweep, "--out", str(tmp_path / f"s{i}"), *extra], env=env
        )
        assert result.exit_code != 0 and "stop" in result.output, result.output
    for i, extra in enumerate(([], ["--extend-corners", "0"])):
        args = ["frontier", "--out", str(tmp_path / f"f{i}"), "--arm", "final-rate=0", *extra]
        result = CliRunner().invoke(app, [*args, "--backend", "inprocess"], env=env)
        assert result.exit_code == 0, result.output
    assert seen == [2, 0, 3, 2, 0]
    assert [c.split("--extend-corners ")[1].split()[0] for c in commands] == ["2", "0"]
