"""``fedsparse sweep --tune``: validation split, per-arm choice, paired best-vs-best intervals."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from scipy import stats
from typer.testing import CliRunner

from fedsparse.client.data import local_data, public_test_data
from fedsparse.common.config import FederatedConfig
from fedsparse.common.data.datasets import hold_out_validation, load_dataset, load_eval_splits
from fedsparse.lab.cli import app
from fedsparse.lab.experiments.sweep_plan import parse_grid
from fedsparse.lab.experiments.tuning import (
    TUNE_SEED_OFFSET,
    check_final_seeds,
    choose_best,
    paired_differences,
    plan_final,
    plan_tuning,
)

ENV = {"COLUMNS": "240"}


def test_validation_is_a_stratified_disjoint_slice_of_train() -> None:
    train, test = load_dataset("digits", seed=3)
    rest, validation = load_eval_splits("digits", seed=3, eval_split="validation")
    assert len(rest) + len(validation) == len(train)
    for c in range(10):
        n_c = int((train.y == c).sum())
        assert int((validation.y == c).sum()) == round(0.2 * n_c)
    # Disjoint and covering: every training image is in exactly one side (rows are unique).
    rows = {tuple(x.flatten().tolist()) for x in train.x}
    rest_rows = {tuple(x.flatten().tolist()) for x in rest.x}
    val_rows = {tuple(x.flatten().tolist()) for x in validation.x}
    assert rest_rows | val_rows == rows and not rest_rows & val_rows
    assert not val_rows & {tuple(x.flatten().tolist()) for x in test.x}
    # Seeded by the run seed; deterministic.
    again, _ = hold_out_validation(train, seed=3)
    other, _ = hold_out_validation(train, seed=4)
    assert torch.equal(again.x, rest.x) and not torch.equal(other.x, rest.x)


def test_a_validation_run_never_trains_or_evaluates_on_test() -> None:
    cfg = FederatedConfig(eval_split="validation", seed=2)
    rest, validation = load_eval_splits("digits", seed=2, eval_split="validation")
    parts = [local_data(cfg, p, 4) for p in range(4)]
    assert sum(len(p) for p in parts) == len(rest)
    assert torch.equal(torch.sort(torch.cat([p.y for p in parts])).values, rest.y.sort().values)
    assert torch.equal(public_test_data(cfg).x, validation.x)
    plain = FederatedConfig(seed=2)
    assert torch.equal(public_test_data(plain).x, load_dataset("digits", seed=2)[1].x)


def test_tuning_plan_runs_on_validation_with_its_own_seeds() -> None:
    plan = plan_tuning(
        parse_grid(["final-rate=0,0.9"]),
        parse_grid(["lr=0.1,0.5,1"]),
        {"seed": "5", "num-rounds": "2"},
        tune_seeds=2,
    )
    assert len(plan.runs) == 2 * 3 * 2
    assert {r.overrides["eval-split"] for r in plan.runs} == {"validation"}
    assert {r.seed for r in plan.runs} == {5 + TUNE_SEED_OFFSET, 6 + TUNE_SEED_OFFSET}
    # one train/test split for both phases: the base seed's
    assert {r.overrides["split-seed"] for r in plan.runs} == {"5"}


@pytest.mark.parametrize(
    ("grid", "tune", "fixed", "match"),
    [
        (["lr=0.1,0.5"], ["lr=0.1,1"], {}, "--tune lr: also given in --grid"),
        ([], ["lr=0.1,1"], {"lr": "0.5"}, "--tune lr: also given in --set"),
        ([], ["seed=1,2"], {}, "--tune seed: not tunable"),
        ([], ["lr=0.1"], {"eval-split": "test"}, "--set eval-split"),
        ([], ["lr=0.1"], {"split-seed": "3"}, "--set split-seed"),
        ([], ["lr=0.1,-1"], {}, "lr=-1"),
    ],
)
def test_tuning_plan_errors(grid: list[str], tune: list[str], fixed: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_tuning(parse_grid(grid), parse_grid(tune), fixed, tune_seeds=1)


def _rows(plan: Any, scores: dict[tuple[str, str, int], float | None]) -> list[dict[str, Any]]:
    rows = []
    for run in plan.runs:
        point = dict(run.point)
        score = scores.get((point["final-rate"], point.get("lr", ""), run.seed))
        status = "failed" if score is None else "ok"
        rows.append({"status": status, "final_test_accuracy": score})
    return rows


def test_choose_best_takes_each_arms_highest_mean_and_breaks_ties_in_grid_order() -> None:
    plan = plan_tuning(
        parse_grid(["final-rate=0,0.9"]), parse_grid(["lr=0.1,0.5,1"]), {}, tune_seeds=2
    )
    s0, s1 = TUNE_SEED_OFFSET, TUNE_SEED_OFFSET + 1
    scores = {
        ("0", "0.1", s0): 0.80, ("0", "0.1", s1): 0.84,  # mean 0.82: the best for r = 0
        ("0", "0.5", s0): 0.90, ("0", "0.5", s1): 0.70,  # mean 0.80
        ("0", "1", s0): 0.95, ("0", "1", s1): None,  # failed on one seed: not eligible
        ("0.9", "0.1", s0): 0.5, ("0.9", "0.1", s1): 0.7,  # 0.6
        ("0.9", "0.5", s0): 0.7, ("0.9", "0.5", s1): 0.7,  # 0.7, tied with lr=1: first wins
        ("0.9", "1", s0): 0.6, ("0.9", "1", s1): 0.8,
    }  # fmt: skip
    choices = choose_best(plan, _rows(plan, scores), ["final-rate"])
    assert [(c.label, dict(c.best)["lr"]) for c in choices] == [
        ("final-rate=0", "0.1"),
        ("final-rate=0.9", "0.5"),
    ]
    assert choices[0].score == pytest.approx(0.82)
    assert choices[0].candidates[2][0] == "lr=1" and math.isnan(choices[0].candidates[2][1])
    final = plan_final(choices, {"num-rounds": "2"}, seeds=3)
    assert [(dict(r.point)["lr"], r.seed) for r in final.runs] == [
        ("0.1", 0), ("0.1", 1), ("0.1", 2), ("0.5", 0), ("0.5", 1), ("0.5", 2)
    ]  # fmt: skip
    assert {r.overrides["eval-split"] for r in final.runs} == {"test"}
    # An arm none of whose tuning runs finished cannot be compared.
    failed = {k: (None if k[0] == "0.9" else v) for k, v in scores.items()}
    with pytest.raises(ValueError, match="arm final-rate=0.9: no tuning combination finished"):
        choose_best(plan, _rows(plan, failed), ["final-rate"])


def test_paired_differences_by_hand() -> None:
    plan = plan_tuning(parse_grid(["final-rate=0,0.5,0.9"]), parse_grid(["lr=1"]), {}, tune_seeds=1)
    choices = choose_best(
        plan,
        [{"status": "ok", "final_test_accuracy": 0.5} for _ in plan.runs],
        ["final-rate"],
    )
    final = plan_final(choices, {}, seeds=3)
    acc = {
        ("0", 0): 0.80, ("0", 1): 0.70, ("0", 2): 0.75,
        ("0.5", 0): 0.99, ("0.5", 1): 0.90, ("0.5", 2): 0.96,  # +0.19, +0.20, +0.21
        ("0.9", 0): 0.81, ("0.9", 1): 0.69, ("0.9", 2): 0.76,  # +0.01, -0.01, +0.01
    }  # fmt: skip
    rows = [
        {"status": "ok", "final_test_accuracy": acc[(dict(r.point)["final-rate"], r.seed)]}
        for r in final.runs
    ]
    better, same = paired_differences(final, rows, choices)
    half = stats.t.ppf(0.975, 2) * 0.01 / math.sqrt(3)  # sd of (0.19, 0.2, 0.21) is 0.01
    assert better.n == 3 and better.mean == pytest.approx(0.2)
    assert (better.low, better.high) == pytest.approx((0.2 - half, 0.2 + half))
    assert better.significant  # [0.175, 0.225]
    assert same.mean == pytest.approx(0.01 / 3) and not same.significant
    # (0.1, 0.2, 0.3) would not be: t(0.975, 2) = 4.30, half-width 0.248 > 0.2.
    assert stats.t.ppf(0.975, 2) * 0.1 / math.sqrt(3) > 0.2


@pytest.mark.slow
def test_a_tuned_sweep_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "tuned"
    args = ["sweep", "--out", str(out), "--grid", "final-rate=0,0.9", "--tune", "lr=0.25,1.0"]
    args += ["--tune-seeds", "1", "--seeds", "2", "--set", "num-rounds=2", "--clients", "3"]
    args += ["--backend", "inprocess", "--extend-corners", "0"]  # the grid as given
    result = CliRunner().invoke(app, args, env=ENV)
    assert result.exit_code == 0, result.output
    with (out / "tuning.csv").open() as fh:
        tuning = list(csv.DictReader(fh))
    assert len(tuning) == 4 and {r["seed"] for r in tuning} == {str(TUNE_SEED_OFFSET)}
    best = {}
    for rate in ("0", "0.9"):
        mine = [r for r in tuning if r["final-rate"] == rate]
        best[rate] = max(mine, key=lambda r: float(r["final_test_accuracy"]))["lr"]
    for rate in ("0", "0.9"):
        for seed in (0, 1):
            run = out / "runs" / f"final-rate-{rate}_lr-{best[rate]}_seed-{seed}"
            config = json.loads((run / "summary.json").read_text())["config"]
            assert config["eval-split"] == "test" and str(config["lr"]) == best[rate]
        tuned = out / "runs" / "tune" / f"final-rate-{rate}_lr-{best[rate]}_seed-1000"
        config = json.loads((tuned / "summary.json").read_text())["config"]
        assert config["eval-split"] == "validation"
    report = (out / "report.md").read_text()
    assert "## Tuned per arm, compared best vs best" in report
    assert "final-rate=0.9 − final-rate=0 | 2 |" in report


def test_tuning_never_sees_a_final_test_example() -> None:
    """digits' split follows the run seed unless split-seed fixes it; the tuned sweep fixes it
    to the base seed, so tuning seed base + 1000 trains and validates off the final test set."""
    rows = lambda split: {tuple(x.flatten().tolist()) for x in split.x}  # noqa: E731
    _, final_test = load_eval_splits("digits", seed=0, eval_split="test", split_seed=0)
    train, validation = load_eval_splits(
        "digits", seed=TUNE_SEED_OFFSET, eval_split="validation", split_seed=0
    )
    assert not (rows(train) | rows(validation)) & rows(final_test)
    cfg = FederatedConfig(seed=TUNE_SEED_OFFSET, split_seed=0, eval_split="validation")
    assert torch.equal(public_test_data(cfg).x, validation.x)


def test_more_final_seeds_than_the_tuning_offset_are_refused_before_any_run(
    tmp_path: Path,
) -> None:
    # final seeds 0..1000 would include 1000, the first tuning seed (the same noise draws)
    args = ["sweep", "--out", str(tmp_path / "s"), "--grid", "final-rate=0,0.9"]
    args += ["--tune", "lr=0.25,1.0", "--seeds", str(TUNE_SEED_OFFSET + 1)]
    args += ["--backend", "inprocess"]
    result = CliRunner().invoke(app, args, env=ENV)
    assert result.exit_code != 0
    assert f"--seeds {TUNE_SEED_OFFSET + 1}" in result.output
    assert not (tmp_path / "s" / "runs").exists()  # refused before the tuning phase
    with pytest.raises(ValueError, match="--seeds 1001"):
        check_final_seeds(1001)
    check_final_seeds(TUNE_SEED_OFFSET)  # seeds 0..999: disjoint from 1000..
