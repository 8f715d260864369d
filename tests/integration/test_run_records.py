"""Run records end to end: each round's sigma is what the clients' accountants calibrate,
and every federated ``summary.json`` carries the shared header (``common/wire/run_log.py``)."""

import json
from pathlib import Path

import pytest

from fedsparse.client.app import app as client_app
from fedsparse.client.data import holding, run_declaration
from fedsparse.common.config import FederatedConfig
from fedsparse.common.dp.accounting import calibrate_noise_multiplier, sample_rate, steps_per_epoch
from fedsparse.common.wire.run_log import SCHEMA, config_hash, shared_key_problems
from fedsparse.lab.simulation.inprocess import InProcessGrid
from fedsparse.server.app import run_federated


def _run(tmp_path: Path, nodes: int, **kwargs) -> tuple[FederatedConfig, list[dict], dict]:
    cfg = FederatedConfig(out_dir=str(tmp_path), **kwargs)
    grid = InProcessGrid(client_app, num_nodes=nodes, run_config=cfg.to_run_config())
    run_federated(grid, cfg)
    lines = (tmp_path / "rounds.jsonl").read_text().splitlines()
    return (
        cfg,
        [json.loads(line) for line in lines],
        json.loads((tmp_path / "summary.json").read_text()),
    )


def test_each_round_records_the_sigma_the_clients_calibrated(tmp_path: Path) -> None:
    nodes = 3
    cfg, rounds, summary = _run(
        tmp_path, nodes, num_rounds=2, target_epsilon=2.5, final_rate=0.5, batch_size=16,
        partitioner="dirichlet", dirichlet_alpha=1.0,
    )  # fmt: skip
    # Each node calibrates sigma for its own data size, over every round it may train in,
    # with the run's accountant (a simulated node): computed here on its own.
    sigmas = []
    for i in range(nodes):
        n = len(holding(run_declaration(cfg, i, nodes)).train)
        sigmas.append(
            calibrate_noise_multiplier(
                target_epsilon=2.5,
                delta=cfg.delta,
                sample_rate=sample_rate(n, cfg.batch_size),
                steps=cfg.num_rounds * cfg.local_epochs * steps_per_epoch(n, cfg.batch_size),
                accountant=cfg.accountant,
            )
        )
    assert max(sigmas) > min(sigmas) > 0.3  # partitions of different sizes: different sigmas
    for r in rounds:
        assert r["num_accepted"] == nodes
        assert r["noise_multiplier_min"] == pytest.approx(min(sigmas), rel=1e-12)
        assert r["noise_multiplier_max"] == pytest.approx(max(sigmas), rel=1e-12)
    assert summary["noise_multiplier_min"] == pytest.approx(min(sigmas), rel=1e-12)
    assert summary["noise_multiplier_max"] == pytest.approx(max(sigmas), rel=1e-12)
    assert shared_key_problems(summary) == []
    assert (summary["kind"], summary["schema"], summary["engine"]) == (
        "federated",
        SCHEMA,
        "factored",
    )
    assert summary["command"] is None  # the Python API
    assert summary["config_hash"] == config_hash(summary["config"])
    assert summary["user_epsilon"] is None


def test_a_non_private_run_records_null_sigma_and_the_launcher_the_command(
    tmp_path: Path,
) -> None:
    from fedsparse.lab.launch.simulate import run_simulation

    overrides = {"num-rounds": 1, "mechanism": "clipped", "noise-multiplier": 0.0}
    command = "fedsparse simulate --backend inprocess --rounds 1"
    summary = run_simulation(
        out=tmp_path, overrides=overrides, clients=2, backend="inprocess", command=command
    )
    (line,) = [json.loads(s) for s in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert line["num_accepted"] == 2
    assert line["noise_multiplier_min"] is None and line["noise_multiplier_max"] is None
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["command"] == command == summary.command
    assert written["noise_multiplier_min"] is None and written["noise_multiplier_max"] is None
    assert shared_key_problems(written) == []
