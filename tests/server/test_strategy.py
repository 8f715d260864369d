"""SparseFedAvg as a Flower Strategy: Flower's own loop drives it; hostile replies are dropped."""

import re
from pathlib import Path

import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedsparse.client.app import app as client_app
from fedsparse.common.config import FederatedConfig
from fedsparse.common.layout import ParamLayout
from fedsparse.common.models import build_model
from fedsparse.common.protocol import CONFIG_RECORD, METRICS_RECORD
from fedsparse.lab.inprocess import InProcessGrid
from fedsparse.server.app import run_federated
from fedsparse.server.strategy import SparseFedAvg, flat_array, flat_tensor

CFG = dict(num_rounds=2, final_rate=0.5, target_epsilon=3.0)


def _initial(cfg: FederatedConfig) -> tuple[ParamLayout, torch.Tensor]:
    model = build_model(cfg.model_name, seed=cfg.seed)
    layout = ParamLayout.from_module(model)
    return layout, layout.flatten_module(model)


def test_flowers_own_start_loop_reaches_the_apps_final_model(tmp_path: Path) -> None:
    """Swappable like any Flower strategy: ``Strategy.start`` gives the same model, bit for bit."""
    cfg = FederatedConfig(out_dir=str(tmp_path / "app"), **CFG)
    run_federated(InProcessGrid(client_app, num_nodes=3, run_config=cfg.to_run_config()), cfg)
    ours = torch.load(tmp_path / "app" / "checkpoint.pt")["weights"]

    layout, w0 = _initial(cfg)
    strategy = SparseFedAvg(cfg, num_parameters=layout.numel)
    grid = InProcessGrid(client_app, num_nodes=3, run_config=cfg.to_run_config())
    result = strategy.start(grid=grid, initial_arrays=flat_array(w0), num_rounds=cfg.num_rounds)
    flowers = flat_tensor(result.arrays)
    assert not torch.equal(flowers, w0)
    assert torch.equal(flowers, ours)
    metrics = result.train_metrics_clientapp[2]
    assert metrics["num-replies"] == 3 and metrics["num-rejected"] == 0
    assert metrics["rate"] == 0.5 and 0 < metrics["epsilon-max"] <= 3.0 + 1e-6


def _replace(build):
    """A client that trains honestly, then replaces its reply's records with ``build(...)``."""

    def handler(msg: Message, ctx: Context) -> Message:
        reply = client_app(msg, ctx)
        config = dict(reply.content.config_records[CONFIG_RECORD])
        metrics = dict(reply.content.metric_records[METRICS_RECORD])
        return Message(content=build(config, metrics), reply_to=msg)

    return handler


def _records(config=None, metrics=None, **kwargs) -> RecordDict:
    records = {}
    if config is not None:
        records[CONFIG_RECORD] = ConfigRecord(config)
    if metrics is not None:
        records[METRICS_RECORD] = MetricRecord(metrics)
    return RecordDict({**records, **kwargs})


HOSTILE = {
    "integer update": (
        lambda c, m: _records({"update": 2**40}, m),
        "update=1099511627776: expected bytes",
    ),
    "string update": (lambda c, m: _records({"update": "x" * 10_000}, m), "expected bytes"),
    "no metrics": (lambda c, m: _records(c), "missing record 'metrics'"),
    "no config": (lambda c, m: _records(None, m), "missing record 'fedsparse'"),
    "float count": (
        lambda c, m: _records(c, {**m, "num-examples": 10.0**12}),
        "num-examples=1000000000000.0: expected int, got float",
    ),
    "inflated count": (
        lambda c, m: _records(c, {**m, "num-examples": 10**12}),
        r"num-examples=1000000000000: expected an integer in \[0, 1e\+09\]",
    ),
    "negative epsilon": (lambda c, m: _records(c, {**m, "epsilon": -7.0}), "epsilon=-7.0"),
}


def test_hostile_records_are_dropped_with_their_reason_and_the_rest_aggregate(
    tmp_path: Path,
) -> None:
    """One round, two honest nodes and one node per hostile reply; nothing crashes."""
    kinds = sorted(HOSTILE)
    cfg = FederatedConfig(out_dir=str(tmp_path), num_rounds=1, final_rate=0.5)
    layout, w0 = _initial(cfg)
    strategy = SparseFedAvg(cfg, num_parameters=layout.numel)
    hostile = {1001 + i: _replace(HOSTILE[kind][0]) for i, kind in enumerate(kinds)}
    grid = InProcessGrid(
        client_app, num_nodes=len(kinds) + 2, run_config=cfg.to_run_config(), overrides=hostile
    )
    messages = strategy.configure_train(1, flat_array(w0), ConfigRecord(), grid)
    arrays, metrics = strategy.aggregate_train(1, grid.send_and_receive(messages))
    stats = strategy.last_round
    assert stats is not None and stats.accepted == 2
    assert len(stats.rejected) == len(kinds) and metrics is not None
    assert metrics["num-rejected"] == len(kinds)
    for i, kind in enumerate(kinds):
        reason = next(r for r in stats.rejected if r.startswith(f"node {1001 + i}: "))
        assert re.search(HOSTILE[kind][1], reason), (kind, reason)
    assert arrays is not None
    new = flat_tensor(arrays)
    assert torch.isfinite(new).all() and not torch.equal(new, w0)


def test_aggregate_without_configure_is_an_error() -> None:
    cfg = FederatedConfig(num_rounds=1)
    strategy = SparseFedAvg(cfg, num_parameters=10)
    with pytest.raises(RuntimeError, match="without configure_train"):
        strategy.aggregate_train(1, [])
