"""Round 1 waits for every node a launcher started, not only for ``min-clients``.

Flower's simulation starts the ServerApp thread before ``start_vce`` registers the nodes, so
the ServerApp can see the nodes appear one by one. Waiting only for ``min-clients`` let round 1
sample from a partial set: fewer clients, and a model that depended on thread timing (the
cause of an intermittent mismatch between a resumed and an uninterrupted simulation).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

from fedsparse.client.app import app as client_app
from fedsparse.client.node_policy import SIMULATION_NODE_POLICY
from fedsparse.common.config import FederatedConfig
from fedsparse.lab.simulation.inprocess import InProcessGrid
from fedsparse.server.launch_markers import EXPECTED_NODES_ENV
from fedsparse.server.loop import expected_nodes, run_federated, wait_for_nodes

NODES = 3


class RegisteringGrid(InProcessGrid):
    """Shows one node more on each ``get_node_ids`` call, from two on (nodes registering)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.visible = 2

    def get_node_ids(self) -> Iterable[int]:  # noqa: D102
        nodes = sorted(super().get_node_ids())[: self.visible]
        self.visible += 1
        return nodes


def _cfg(out: Path) -> FederatedConfig:
    return FederatedConfig(
        out_dir=str(out), num_rounds=2, final_rate=0.5, seed=5, min_clients=2, target_epsilon=3.0
    )


def _run(out: Path, grid_type: type[InProcessGrid], *, expected: int) -> list[dict[str, Any]]:
    cfg = _cfg(out)
    grid = grid_type(
        client_app,
        num_nodes=NODES,
        run_config=cfg.to_run_config(),
        node_config=SIMULATION_NODE_POLICY,
    )
    run_federated(grid, cfg, expected_nodes=expected)
    return [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]


def test_wait_for_nodes_waits_for_the_expected_count() -> None:
    cfg = _cfg(Path("unused"))
    grid = RegisteringGrid(client_app, num_nodes=NODES, run_config=cfg.to_run_config())
    assert len(wait_for_nodes(grid, 2, timeout=5.0, expected=NODES)) == NODES
    grid = RegisteringGrid(client_app, num_nodes=NODES, run_config=cfg.to_run_config())
    assert len(wait_for_nodes(grid, 2, timeout=5.0)) == 2  # min-clients alone: a partial set


def test_too_few_expected_nodes_time_out_naming_the_count() -> None:
    cfg = _cfg(Path("unused"))
    grid = InProcessGrid(client_app, num_nodes=2, run_config=cfg.to_run_config())
    with pytest.raises(TimeoutError, match="3 expected nodes: only 2 nodes connected"):
        wait_for_nodes(grid, 2, timeout=0.2, expected=3)


def test_a_run_on_registering_nodes_equals_one_on_registered_nodes(tmp_path: Path) -> None:
    reference = _run(tmp_path / "ref", InProcessGrid, expected=0)
    waited = _run(tmp_path / "waited", RegisteringGrid, expected=NODES)
    assert [r["num_clients"] for r in waited] == [NODES, NODES]
    assert torch.equal(
        torch.load(tmp_path / "ref" / "checkpoint.pt")["weights"],
        torch.load(tmp_path / "waited" / "checkpoint.pt")["weights"],
    )
    assert [r["test_accuracy"] for r in waited] == [r["test_accuracy"] for r in reference]


@pytest.mark.parametrize(
    ("environ", "value"), [({}, 0), ({EXPECTED_NODES_ENV: ""}, 0), ({EXPECTED_NODES_ENV: "7"}, 7)]
)
def test_expected_nodes_reads_the_environment(environ: dict[str, str], value: int) -> None:
    assert expected_nodes(environ) == value


@pytest.mark.parametrize("text", ["-1", "three", "2.5"])
def test_a_bad_expected_count_is_named(text: str) -> None:
    with pytest.raises(ValueError, match=f"{EXPECTED_NODES_ENV}='{text}': expected an integer"):
        expected_nodes({EXPECTED_NODES_ENV: text})
