"""``fedsparse reproduce``: verdict rules, convergence flags, run reuse, and a tiny end-to-end run
whose report numbers are recomputed from the run directories."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedsparse.lab.cli import app
from fedsparse.lab.experiments.tuning import ArmChoice, PairedDifference
from fedsparse.lab.research.reproduction.central_runs import run_specs
from fedsparse.lab.research.reproduction.comparison import (
    ArmResult,
    Comparison,
    _by_length,
    _tuning_se,
    gain_verdict,
    still_rising,
)
from fedsparse.lab.research.reproduction.noise import measure_noise_ratio
from fedsparse.lab.research.reproduction.plan import (
    CentralSpec,
    CentralStudy,
    FederatedStudy,
    ReproductionPlan,
)
from fedsparse.lab.research.reproduction.report import reproduce_and_report
from fedsparse.lab.research.reproduction.run import run_central_study
from fedsparse.lab.research.reproduction.sections import _ablation_section, _scaling_section


def diff(mean: float, low: float, high: float, n: int = 5) -> PairedDifference:
    return PairedDifference(arm="a", baseline="b", n=n, mean=mean, low=low, high=high)


def test_gain_verdict_follows_the_interval() -> None:
    # paper gain +0.8 points = 0.008
    assert gain_verdict(diff(0.02, 0.001, 0.04), 0.8) == "reproduced"
    assert gain_verdict(diff(-0.01, -0.02, 0.005), 0.8) == "not reproduced"  # excludes +0.8
    assert gain_verdict(diff(0.0, -0.02, 0.02), 0.8) == "inconclusive"  # holds 0 and +0.8
    assert gain_verdict(diff(0.03, 0.01, 0.05, n=1), 0.8).startswith("inconclusive")
    # an interval between 0 and the paper's gain: the gain is excluded, none is shown
    assert gain_verdict(diff(0.002, -0.001, 0.007), 0.8) == "not reproduced"


def test_still_rising_measures_the_last_fifth() -> None:
    rising = [[0.1 * i for i in range(10)], [0.1 * i + 0.01 for i in range(10)]]
    gain, se, flag = still_rising(rising)
    assert gain == pytest.approx(0.2)  # mean(0.8, 0.9) - mean(0.6, 0.7)
    assert se == pytest.approx(0.0, abs=1e-12)
    assert flag
    flat = [[0.5, 0.7, 0.8, 0.8, 0.81, 0.8, 0.8, 0.8, 0.805, 0.8]] * 3
    gain, _, flag = still_rising(flat)
    assert gain == pytest.approx((0.805 + 0.8) / 2 - 0.8)
    assert not flag
    # noisy gains: a mean above the tolerance but within 2 SE is not called rising
    noisy = [[0.0] * 8 + [0.2, 0.2], [0.0] * 8 + [-0.15, -0.15]]
    assert not still_rising(noisy)[2]


def _arm(length: str, curve: list[float], by_length: dict[str, float]) -> ArmResult:
    return ArmResult(
        rate=0.9,
        best=f"lr=0.1, num-rounds={length}",
        validation=by_length[length],
        accuracy={0: curve[-1], 1: curve[-1]},
        curves=[curve, [x + 0.01 for x in curve]],
        best_values={"lr": "0.1", "num-rounds": length},
        by_length=by_length,
    )


def test_a_rising_run_is_cut_short_only_at_the_longest_length_tried() -> None:
    rising = [0.05 * i for i in range(10)]
    flat = [0.5] * 10
    comparison = Comparison(
        name="c",
        setting="federated",
        dataset="digits",
        model="digits-cnn",
        epsilon=3.0,
        tuned_over="",
        arms=[],
        tune_seeds=2,
        seeds=2,
        grid={"lr": ("0.1",), "num-rounds": ("40", "80", "160")},
        length_key="num-rounds",
    )
    lengths = {"40": 0.70, "80": 0.78, "160": 0.71}
    tuned = comparison.convergence(_arm("80", rising, lengths))
    assert tuned.rising and not tuned.cut_short
    assert tuned.length == "80" and tuned.longer == {"160": 0.71}
    longest = comparison.convergence(_arm("160", rising, {**lengths, "160": 0.8}))
    assert longest.rising and longest.cut_short and longest.longer == {}
    assert not comparison.convergence(_arm("160", flat, lengths)).cut_short
    # no error estimate (one tuning seed): the longest length's rise is never called level
    assert longest.profile is not None and math.isnan(longest.profile.se)
    assert longest.profile.gain == pytest.approx(0.8 - 0.78)
    # at the longest length, a gain over the shorter ones within 2 SE: levelled off
    level = _arm("160", rising, {**lengths, "160": 0.8})
    level.tuning_se = 0.011
    conv = comparison.convergence(level)
    assert conv.rising and not conv.cut_short and conv.profile.levelled
    level.tuning_se = 0.009  # 0.02 > 2 * 0.009: still climbing
    assert comparison.convergence(level).cut_short
    # one length only (not tuned): a rising curve is cut short
    fixed = Comparison(**{**comparison.__dict__, "grid": {"lr": ("0.1",), "num-rounds": ("40",)}})
    arm = _arm("40", rising, {"40": 0.7})
    arm.best_values.pop("num-rounds")
    assert fixed.convergence(arm).cut_short
    arm.tuning_se = 1.0  # with nothing shorter to compare, no profile
    assert fixed.convergence(arm).cut_short and fixed.convergence(arm).profile is None


def test_tuning_se_pools_the_candidates_variance() -> None:
    # per-run variances se² n pooled over the candidates of 2 runs; difference SE sqrt(2 v / n)
    choice = ArmChoice(
        arm=(("final-rate", "0.9"),),
        best=(("lr", "0.1"),),
        score=0.8,
        candidates=(("lr=0.1", 0.8, 0.02, 2), ("lr=0.2", 0.7, 0.04, 2), ("lr=1", 0.1, math.nan, 1)),
    )
    variance = (0.02**2 * 2 + 0.04**2 * 2) / 2
    assert _tuning_se(choice) == pytest.approx(math.sqrt(2 * variance / 2))
    lonely = ArmChoice(arm=(), best=(), score=0.8, candidates=(("lr=0.1", 0.8, math.nan, 1),))
    assert math.isnan(_tuning_se(lonely))


def test_by_length_keeps_the_best_validation_per_length() -> None:
    choice = ArmChoice(
        arm=(("final-rate", "0.9"),),
        best=(("lr", "0.1"), ("num-rounds", "80")),
        score=0.8,
        candidates=(
            ("lr=0.05, num-rounds=40", 0.6, 0.01, 2),
            ("lr=0.1, num-rounds=40", 0.7, 0.01, 2),
            ("lr=0.05, num-rounds=80", 0.75, 0.01, 2),
            ("lr=0.1, num-rounds=80", 0.8, 0.01, 2),
            ("lr=0.1, num-rounds=160", math.nan, math.nan, 1),  # not finished on every seed
        ),
    )
    assert _by_length(choice, "num-rounds") == {"40": 0.7, "80": 0.8}


def test_noise_ratio_matches_sqrt_keep_fraction() -> None:
    rows = measure_noise_ratio((0.5, 0.9), d=50_000, trials=3)
    for row in rows:
        # relative s.e. of the ratio ~ sqrt(1/(2k) + 1/(2d)) / sqrt(3) <= 0.3%: 5 SE is 1.5%
        assert abs(row["relative_error"]) < 0.015
        assert row["predicted"] == pytest.approx(math.sqrt(1 - row["rate"]), rel=1e-4)
        assert row["within_3se"] == 1.0


def test_run_specs_reuses_finished_runs_and_records_failures(tmp_path: Path) -> None:
    good = CentralSpec(epochs=1, lr=0.25, seed=3)
    bad = CentralSpec(epochs=1, mechanism="clipped", target_epsilon=3.0)  # needs sigma 0
    first = run_specs([good, bad], tmp_path)
    assert first[0]["status"] == "ok" and not first[0]["reused"]
    assert first[1]["status"] == "failed"
    assert "target_epsilon=3.0" in first[1]["error"]
    again = run_specs([good], tmp_path)
    assert again[0]["reused"]
    assert again[0]["final_test_accuracy"] == first[0]["final_test_accuracy"]
    # another spec (another seed) is not taken for this one
    other = run_specs([CentralSpec(epochs=1, lr=0.25, seed=4)], tmp_path)
    assert not other[0]["reused"]
    # the record names the engine that ran ("auto": factored on this CPU); a spec.json of
    # another engine, or one older than the key (Opacus then), is not this run
    saved = json.loads((tmp_path / good.slug / "spec.json").read_text())
    assert saved == {**dataclasses.asdict(good), "engine": "factored"}
    for stale in ({**saved, "engine": "opacus"}, dataclasses.asdict(good)):
        (tmp_path / good.slug / "spec.json").write_text(json.dumps(stale))
        assert not run_specs([good], tmp_path)[0]["reused"]


@pytest.mark.parametrize(
    "spec",
    [
        # tuning: validation split of seed 0 under another seed (the train CLI's default
        # split seed is --seed)
        CentralSpec(epochs=2, lr=0.25, rate=0.5, seed=7, eval_split="validation"),
        CentralSpec(epochs=2, mechanism="noisy", noise_multiplier=1.0, target_epsilon=None),
    ],
    ids=["validation", "noisy"],
)
def test_a_central_run_records_the_train_command_that_repeats_it(
    spec: CentralSpec, tmp_path: Path
) -> None:
    (row,) = run_specs([spec], tmp_path / "runs")
    recorded = json.loads((Path(row["run_dir"]) / "summary.json").read_text())
    args = shlex.split(recorded["command"])
    assert args[:2] == ["fedsparse", "train"]
    args[args.index("--out") + 1] = str(tmp_path / "alone")
    result = CliRunner().invoke(app, args[1:], env={"COLUMNS": "240"})
    assert result.exit_code == 0, result.output
    alone = json.loads((tmp_path / "alone" / "summary.json").read_text())
    for key in ("final_test_accuracy", "final_test_loss", "epsilon", "noise_multiplier"):
        assert alone[key] == recorded[key], key
    assert alone["split_seed"] == recorded["split_seed"] == 0


@pytest.mark.slow
def test_central_study_tunes_on_validation_and_pairs_on_test(tmp_path: Path) -> None:
    study = CentralStudy(
        name="t",
        dataset="digits",
        model=None,
        epsilon=3.0,
        rates=(0.0, 0.9),
        lrs=(0.05, 0.5),
        epochs=(1,),
        tune_seeds=2,
        seeds=2,
        untuned=True,
    )
    comparison = run_central_study(study, tmp_path, jobs=1)
    tune_dirs = sorted((tmp_path / "t" / "tune").iterdir())
    assert len(tune_dirs) == 2 * 2 * 2
    scores: dict[tuple[float, float], list[float]] = {}
    for d in tune_dirs:
        summary = json.loads((d / "summary.json").read_text())
        assert summary["eval_split"] == "validation" and summary["split_seed"] == 0
        assert summary["train"]["seed"] >= 1000  # never a final seed
        key = (summary["sparsity"]["final_rate"], summary["train"]["lr"])
        scores.setdefault(key, []).append(summary["final_test_accuracy"])
    for arm in comparison.arms:
        best_lr = max((0.05, 0.5), key=lambda lr: sum(scores[(arm.rate, lr)]) / 2)
        assert arm.best == f"lr={best_lr:g}, epochs=1"
        assert arm.validation == pytest.approx(sum(scores[(arm.rate, best_lr)]) / 2)
        assert sorted(arm.accuracy) == [0, 1]
        assert all(len(curve) == 1 for curve in arm.curves)
    finals = [d for d in (tmp_path / "t").iterdir() if d.name != "tune"]
    for d in finals:
        summary = json.loads((d / "summary.json").read_text())
        assert summary["eval_split"] == "test" and summary["split_seed"] == 0
    base, rs = comparison.arms
    d = comparison.difference(rs)
    expected = [rs.accuracy[s] - base.accuracy[s] for s in (0, 1)]
    assert d.mean == pytest.approx(sum(expected) / 2)
    assert sorted(rs.untuned) == [0, 1]  # r* 0.9 at the baseline's lr, every seed


def test_at_edge_flags_picks_on_the_grid_boundary() -> None:
    arm = ArmResult(
        rate=0.5, best="", validation=0.0, accuracy={}, curves=[], best_values={"lr": "0.1"}
    )
    comparison = Comparison(
        name="c",
        setting="centralized",
        dataset="digits",
        model="digits-cnn",
        epsilon=1.0,
        tuned_over="",
        arms=[arm, arm],
        tune_seeds=2,
        seeds=2,
        grid={"lr": ("0.1", "0.25", "0.5"), "epochs": ("15",)},
    )
    assert comparison.at_edge(arm) == ["lr=0.1"]
    arm.best_values["lr"] = "0.25"
    assert comparison.at_edge(arm) == []
    assert comparison.paper == ("FMNIST DP-CNN/S", (83.2, 84.5, 1.3))


def _row(acc: float, loss: float = 0.0) -> dict[str, object]:
    return {"status": "ok", "final_test_accuracy": acc, "final_train_loss": loss}


def test_scaling_verdict_counts_rows_and_columns_peaking_on_the_diagonal() -> None:
    plan = ReproductionPlan(
        scaling_clips=(0.1, 0.2, 0.5, 1.0),
        scaling_momenta=(0.0, 0.5, 0.8, 0.9),
        scaling_seeds=2,
        scaling=CentralSpec(rate=0.7),
    )
    # accuracy falls with |log(C / (1 - mu))|: every row and column peaks on C/(1-mu) = 1
    on_rule = {
        (c, m): [_row(0.9 - abs(math.log(c / (1 - m)))), _row(0.9 - abs(math.log(c / (1 - m))))]
        for c in plan.scaling_clips
        for m in plan.scaling_momenta
    }
    lines, verdict, rows = _scaling_section(on_rule, plan)
    assert verdict == "reproduced"
    # every row and column has 2 of its 4 cells within a factor 2 of ratio 1: chance is 4
    assert "8 of 8 rows and columns peak on the diagonal (chance: 4.0)." in lines
    assert len(rows) == 16
    # accuracy grows with C alone (ties: the first cell): rows peak at mu = 0, ratios
    # 0.1, 0.2, 0.5, 1 (2 near the best cell's 1); columns at C = 1, ratios 1, 2, 5, 10 (2)
    by_clip = {(c, m): [_row(c), _row(c)] for c, m in on_rule}
    lines, verdict, _ = _scaling_section(by_clip, plan)
    assert "4 of 8 rows and columns peak on the diagonal (chance: 4.0)." in lines
    assert verdict == "not reproduced"
    # a failed cell is no peak: here the best cell of its row and column, had it finished
    failed = {**by_clip, (1.0, 0.0): [{"status": "failed"}, {"status": "failed"}]}
    best_of_row = [
        line for line in _scaling_section(failed, plan)[0] if line.startswith("| C = 1 ")
    ]
    assert best_of_row and "μ = 0.5" in best_of_row[0]


def test_ablation_verdict_reads_the_training_loss() -> None:
    plan = ReproductionPlan(ablation=CentralSpec(), ablation_seeds=3)
    slower = {
        "clipped": {
            0.0: [_row(0.9, 0.30), _row(0.9, 0.32), _row(0.9, 0.31)],
            0.9: [_row(0.8, 0.50), _row(0.8, 0.53), _row(0.8, 0.50)],
        },
        "noisy": {
            0.0: [_row(0.9, 0.50), _row(0.9, 0.52), _row(0.9, 0.51)],
            0.9: [_row(0.9, 0.30), _row(0.9, 0.33), _row(0.9, 0.30)],
        },
    }
    _, verdicts, rows = _ablation_section(slower, plan)
    assert verdicts["clipped"][0] == "reproduced"
    assert verdicts["noisy"][0] == "not reproduced"  # faster with RS
    assert rows[1]["train_loss_mean"] == pytest.approx((0.50 + 0.53 + 0.50) / 3)


@pytest.mark.slow
def test_reproduction_report_matches_its_runs(tmp_path: Path) -> None:
    plan = ReproductionPlan(
        noise_rates=(0.5,),
        noise_dim=10_000,
        central=(
            CentralStudy(
                name="central",
                dataset="digits",
                model=None,
                epsilon=3.0,
                rates=(0.0, 0.9),
                lrs=(0.25,),
                epochs=(1,),
                tune_seeds=1,
                seeds=2,
            ),
        ),
        federated=(
            FederatedStudy(
                name="fed",
                dataset="digits",
                epsilon=3.0,
                rates=(0.0, 0.9),
                lrs=(0.5,),
                rounds=(2, 3),  # tuned with lr
                clients=2,
                tune_seeds=1,
                seeds=2,
            ),
            FederatedStudy(
                name="fed-int8",
                dataset="digits",
                epsilon=3.0,
                rates=(0.9,),
                lrs=(0.5,),
                rounds=(2, 3),
                clients=2,
                tune_seeds=1,
                seeds=2,
                extra=(("value-dtype", "int8"),),
                baseline_from="fed",
            ),
        ),
        ablation_rates=(0.0, 0.9),
        ablation_seeds=2,
        ablation=CentralSpec(epochs=1),
        scaling_clips=(0.5, 1.0),
        scaling_momenta=(0.0, 0.5),
        scaling_seeds=1,
        scaling=CentralSpec(epochs=1, rate=0.7),
    )
    out = tmp_path / "report"
    reproduce_and_report(plan, out=out, runs_dir=tmp_path / "runs", command="fedsparse reproduce")
    report = (out / "report.md").read_text()
    for needle in ("## Verdicts", "Fig. 1c", "Table 2", "Fig. 3", "App. H", "fedsparse reproduce"):
        assert needle in report
    for name in ("noise_ratio.png", "accuracy_vs_rate.png", "curves.png", "scaling.png"):
        assert (out / name).stat().st_size > 1000
    assert (out / "federated" / "fed" / "report.md").is_file()
    with (out / "comparisons.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["comparison"], r["rate"]) for r in rows] == [
        ("central", "0.0"),
        ("central", "0.9"),
        ("fed", "0.0"),
        ("fed", "0.9"),
        ("fed-int8", "0.0"),  # the dense fp32 baseline of "fed", paired by seed
        ("fed-int8", "0.9"),
    ]
    bits = {(r["comparison"], r["rate"]): float(r["uplink_bits_per_param"]) for r in rows[2:]}
    assert bits[("fed", "0.0")] == pytest.approx(32, rel=0.01)
    # gradual cooling to 0.9 keeps on average (1 + 0.1) / 2 of the values over 2 or 3 rounds
    assert bits[("fed", "0.9")] == pytest.approx(32 * 1.1 / 2, rel=0.01)
    assert bits[("fed-int8", "0.9")] == pytest.approx(8 * 1.1 / 2, rel=0.02)
    assert "## Bits per parameter" in report
    # the federated length was tuned: both lengths ran on validation, each arm has its pick
    tuned = {d.name for d in (tmp_path / "runs" / "federated" / "fed" / "tune").iterdir()}
    assert {"final-rate-0_lr-0.5_num-rounds-2_seed-1000"} <= tuned
    assert {"final-rate-0.9_lr-0.5_num-rounds-3_seed-1000"} <= tuned
    for row in rows[2:4]:
        assert row["length"] in ("2", "3") and f"num-rounds={row['length']}" in row["best"]
        curves = [
            json.loads(line)
            for d in (tmp_path / "runs" / "federated" / "fed").glob("final-rate-*")
            if f"num-rounds-{row['length']}_" in d.name
            for line in (d / "rounds.jsonl").read_text().splitlines()
        ]
        assert curves and all(r["round"] <= int(row["length"]) for r in curves)
    assert (out / "lengths.png").stat().st_size > 1000
    assert "r* = 0.9, value-dtype=int8 at ε = 3" in report
    # the centralized means are the final test accuracies in the run directories
    runs = tmp_path / "runs" / "central" / "central"
    for row in rows[:2]:
        accs = [
            json.loads((d / "summary.json").read_text())["final_test_accuracy"]
            for d in runs.iterdir()
            if d.name != "tune" and f"_r{float(row['rate']):g}_" in d.name
        ]
        assert len(accs) == 2
        assert float(row["test_accuracy_mean"]) == pytest.approx(sum(accs) / 2)
    # a second run reuses every run (the noise draws are seeded): the same report
    reproduce_and_report(plan, out=out, runs_dir=tmp_path / "runs", command="fedsparse reproduce")
    assert (out / "report.md").read_text() == report


def test_cli_refuses_an_unknown_part(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["reproduce", "--out", str(tmp_path), "--parts", "noise,figure9"]
    )
    assert result.exit_code != 0
    assert "figure9" in result.output


def test_specs_sharing_a_directory_are_refused(tmp_path: Path) -> None:
    a, b = CentralSpec(lr=0.1234567), CentralSpec(lr=0.1234568)  # ``:g`` rounds both alike
    assert a.slug == b.slug
    with pytest.raises(ValueError, match="share the directory"):
        run_specs([a, b], tmp_path)


def test_a_borrowed_baseline_must_pair_by_seed() -> None:
    from fedsparse.lab.research.reproduction.run import _baseline_source

    source = FederatedStudy(name="src", dataset="digits", epsilon=3.0)
    other = FederatedStudy(
        name="int8", dataset="digits", epsilon=1.0, rates=(0.9,), baseline_from="src"
    )
    with pytest.raises(ValueError, match="epsilon 3.0 != 1.0"):
        _baseline_source(other, {"src": source, "int8": other}, [])
    same = FederatedStudy(
        name="int8", dataset="digits", epsilon=3.0, rates=(0.9,), baseline_from="src"
    )
    with pytest.raises(ValueError, match="must run"):
        _baseline_source(same, {"src": source, "int8": same}, [])
    longer = FederatedStudy(
        name="int8",
        dataset="digits",
        epsilon=3.0,
        rates=(0.9,),
        rounds=(40, 80),
        baseline_from="src",
    )
    with pytest.raises(ValueError, match=r"rounds \(40, 80\) tries lengths"):
        _baseline_source(longer, {"src": source, "int8": longer}, [])
    # fewer lengths than the baseline's: it pairs (the baseline was tuned over more)
    source = FederatedStudy(name="src", dataset="digits", epsilon=3.0, rounds=(40, 80))
    shorter = FederatedStudy(
        name="int8",
        dataset="digits",
        epsilon=3.0,
        rates=(0.9,),
        rounds=(40,),
        baseline_from="src",
    )
    with pytest.raises(ValueError, match="must run"):
        _baseline_source(shorter, {"src": source, "int8": shorter}, [])
    with pytest.raises(ValueError, match="no federated study"):
        _baseline_source(same, {"int8": same}, [])


def test_fig4_verdict_uses_the_margin_on_both_sides() -> None:
    from fedsparse.lab.research.reproduction.sections import _untuned_verdict

    assert _untuned_verdict(diff(-0.003, -0.009, 0.003)) == "reproduced"
    assert _untuned_verdict(diff(-0.005, -0.011, -0.001)) == "inconclusive"
    assert _untuned_verdict(diff(-0.03, -0.04, -0.02)) == "not reproduced"


def test_the_commands_default_parts_are_the_plans() -> None:
    """``fedsparse reproduce --help`` spells the parts without importing the plan: the same list."""
    from fedsparse.lab.cli.reproduce import PARTS_ALL
    from fedsparse.lab.research.reproduction.plan import PARTS

    assert PARTS_ALL.split(",") == list(PARTS)
