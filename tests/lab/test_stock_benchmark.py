"""The stock Flower + Opacus app of ``benchmarks/simulation.py`` does fedsparse's work.

One round on 2 in-process nodes (no SuperLink): the stock ServerApp (Flower's ``FedAvg``)
with the stock ClientApp (plain Opacus), against fedsparse's ServerApp loop and ClientApp in a
dense round (``final-rate=0``) with the same fixed σ and example weighting. Same partitions,
batches and noise streams, so the two rounds take the same steps on the same examples and end
with the same model (up to the float rounding of averaging models vs. averaging deltas).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
from flwr.app import Context, Message

from fedsparse.client.app import app as fedsparse_client
from fedsparse.client.data import local_data
from fedsparse.common.config import FederatedConfig
from fedsparse.common.dp.accounting import steps_per_epoch
from fedsparse.common.wire.protocol import METRICS_RECORD
from fedsparse.lab.simulation.inprocess import InProcessGrid
from fedsparse.server.app import run_federated

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
APP_DIR = BENCHMARKS / "stock_flower"
#: The keys the benchmark sets alike for both apps, and their values here.
SHARED = {"num-rounds": 1, "local-epochs": 1, "batch-size": 32, "lr": 0.5, "max-grad-norm": 1.0}
SIGMA = 1.0


@pytest.fixture(scope="module")
def stock() -> Iterator[SimpleNamespace]:
    """The stock app's modules, imported with its directory on ``sys.path`` (as Flower does)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(APP_DIR))
        from stock_opacus import client_app, server_app, task

        yield SimpleNamespace(client=client_app, server=server_app, task=task)


def _load_script(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_stock_round_is_fedsparse_dense_round(tmp_path: Path, stock: SimpleNamespace) -> None:
    cfg = stock.task.StockConfig.from_run_config(
        {**SHARED, "noise-multiplier": SIGMA, "min-nodes": 2, "out-dir": str(tmp_path / "stock")}
    )
    grid = InProcessGrid(stock.client.app, num_nodes=2, run_config=cfg.to_run_config())
    summary = stock.server.run_stock(grid, cfg)
    (entry,) = _lines(tmp_path / "stock" / "rounds.jsonl")

    fcfg = FederatedConfig.from_run_config(
        {
            **SHARED,
            "target-epsilon": 0.0,
            "noise-multiplier": SIGMA,
            "final-rate": 0.0,
            "weighting": "examples",
            "engine": "opacus",  # the stock app's engine: equal bit for bit, not to rounding
            "out-dir": str(tmp_path / "fedsparse"),
        }
    )
    seen: list[int] = []

    def recording(msg: Message, context: Context) -> Message:
        reply = fedsparse_client(msg, context)
        seen.append(int(reply.content.metric_records[METRICS_RECORD]["examples-seen"]))
        return reply

    grid = InProcessGrid(recording, num_nodes=2, run_config=fcfg.to_run_config())
    fsummary = run_federated(grid, fcfg)

    parts = [local_data(fcfg, i, 2) for i in range(2)]
    assert entry["num_replies"] == 2
    # Same steps (one per Poisson batch) and the same batches: the examples seen are a
    # Poisson draw around the partition sizes, so equal counts mean equal sampling streams.
    assert entry["steps"] == sum(steps_per_epoch(len(p), 32) for p in parts) > 2
    assert entry["examples_seen"] == sum(seen) and len(seen) == 2
    # Same model: the test loss agrees to float rounding (bit for bit here), not roughly.
    assert summary["final_test_loss"] == pytest.approx(fsummary.final_test_loss, rel=1e-9)
    assert summary["final_test_accuracy"] == fsummary.final_test_accuracy
    # fedsparse's default engine on the CPU (factored) does the same step to float rounding.
    factored_cfg = dataclasses.replace(fcfg, engine="auto", out_dir=str(tmp_path / "factored"))
    grid = InProcessGrid(fedsparse_client, num_nodes=2, run_config=factored_cfg.to_run_config())
    factored = run_federated(grid, factored_cfg)
    assert factored.final_test_loss == pytest.approx(fsummary.final_test_loss, rel=1e-5)
    assert factored.final_test_loss != fsummary.final_test_loss  # another engine ran
    assert 0 < entry["started_at"] < entry["ended_at"]
    assert entry["wall_seconds"] == pytest.approx(entry["ended_at"] - entry["started_at"], abs=0.05)


def test_stock_round_differs_with_other_noise(tmp_path: Path, stock: SimpleNamespace) -> None:
    """The model comparison above can fail: another σ gives another model."""
    results = []
    for sigma in (SIGMA, 2 * SIGMA):
        cfg = stock.task.StockConfig.from_run_config(
            {**SHARED, "noise-multiplier": sigma, "out-dir": str(tmp_path / f"s{sigma}")}
        )
        grid = InProcessGrid(stock.client.app, num_nodes=2, run_config=cfg.to_run_config())
        results.append(stock.server.run_stock(grid, cfg)["final_test_loss"])
    assert results[0] != pytest.approx(results[1], rel=1e-3)


def test_client_reports_steps_and_examples(stock: SimpleNamespace) -> None:
    cfg = stock.task.StockConfig.from_run_config({**SHARED, "noise-multiplier": SIGMA})
    data = stock.task.load_partition(cfg, 0, 3)
    net = stock.task.build_net(cfg)
    before = [p.detach().clone() for p in net.parameters()]
    result = stock.task.train_dp(net, data, cfg=cfg, server_round=1, partition_id=0)
    assert result.steps == steps_per_epoch(len(data), 32)
    assert 0.5 * len(data) < result.examples < 1.5 * len(data)  # Poisson, expected len(data)
    assert 0 < result.epsilon < 100
    assert any(not a.equal(b) for a, b in zip(before, net.parameters(), strict=True))
    bare = stock.task.StockConfig.from_run_config({**SHARED, "report-epsilon": "false"})
    assert bare.report_epsilon is False
    again = stock.task.train_dp(
        stock.task.build_net(cfg), data, cfg=bare, server_round=1, partition_id=0
    )
    assert math.isnan(again.epsilon) and again.examples == result.examples


def test_pyproject_defaults_match_config_and_fedsparse(stock: SimpleNamespace) -> None:
    declared = tomllib.loads((APP_DIR / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    config = stock.task.StockConfig.from_run_config(declared["config"])
    assert config == stock.task.StockConfig()
    assert set(declared["config"]) == set(config.to_run_config())
    assert declared["components"] == {
        "serverapp": "stock_opacus.server_app:app",
        "clientapp": "stock_opacus.client_app:app",
    }
    fedsparse = FederatedConfig().to_run_config()
    for key in ("local-epochs", "batch-size", "lr", "max-grad-norm", "delta", "seed"):
        assert config.to_run_config()[key] == fedsparse[key], key


def test_config_errors_name_the_key(stock: SimpleNamespace) -> None:
    with pytest.raises(ValueError, match=r"noise-multiplier=-1.0: expected finite >= 0"):
        stock.task.StockConfig.from_run_config({"noise-multiplier": -1.0})
    with pytest.raises(ValueError, match=r"report-epsilon='yes': expected true or false"):
        stock.task.StockConfig.from_run_config({"report-epsilon": "yes"})
    with pytest.raises(ValueError, match=r"'target-epsilon' is unknown"):
        stock.task.StockConfig.from_run_config({"target-epsilon": 3.0})


def test_benchmark_runs_both_apps_on_the_same_settings(tmp_path: Path) -> None:
    bench = _load_script("bench_simulation", BENCHMARKS / "simulation.py")
    settings = bench.Settings(
        rounds=4,
        noise_multiplier=1.5,
        target_epsilon=3.0,
        local_epochs=2,
        batch_size=16,
        lr=0.25,
        max_grad_norm=0.5,
        seed=7,
        cpus_per_client=1.0,
        timeout=60.0,
        sample=0.5,
        fedsparse_backend="flower",
    )

    def sets(config: str) -> dict[str, str]:
        args = bench.command(config, 10, tmp_path, settings)
        return dict(args[i + 1].split("=", 1) for i, a in enumerate(args) if a == "--set")

    stock_sets, bare_sets, sigma_sets, eps_sets = (sets(c) for c in bench.CONFIGS)
    shared = {"num-rounds", "local-epochs", "batch-size", "lr", "max-grad-norm", "seed"}
    for key in shared:
        assert stock_sets[key] == bare_sets[key] == sigma_sets[key] == eps_sets[key], key
    assert stock_sets["noise-multiplier"] == sigma_sets["noise-multiplier"] == "1.5"
    assert (stock_sets["report-epsilon"], bare_sets["report-epsilon"]) == ("true", "false")
    assert sigma_sets["target-epsilon"] == "0" and eps_sets["target-epsilon"] == "3.0"
    assert stock_sets["min-nodes"] == sigma_sets["min-clients"] == "10"


def test_round_figures(tmp_path: Path) -> None:
    bench = _load_script("bench_simulation", BENCHMARKS / "simulation.py")
    rounds = [  # round 2's server work after its line (a checkpoint) counts until round 3
        {"started_at": 110.0, "ended_at": 130.0},
        {"started_at": 130.5, "ended_at": 131.5},
        {"started_at": 132.0, "ended_at": 133.0},
        {"started_at": 133.0, "ended_at": 134.5},
    ]
    startup, first, steady = bench.round_figures(rounds, 100.0)
    assert (startup, first, steady) == (10.0, 20.5, 1.5)
