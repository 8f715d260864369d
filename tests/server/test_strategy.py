"""SparseFedAvg as a Flower Strategy: Flower's own loop drives it; hostile replies are dropped."""

import re
from pathlib import Path

import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedsparse.client.app import app as client_app
from fedsparse.common.config import FederatedConfig
from fedsparse.common.layout import ParamLayout
from fedsparse.common.models.classifiers import build_model
from fedsparse.common.wire.protocol import CONFIG_RECORD, METRICS_RECORD
from fedsparse.lab.simulation.inprocess import InProcessGrid
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


# --- dp-norm-bound: the caps the strategy resolves ---------------------------------------------


def test_the_dp_bound_caps_come_from_the_training_split_or_the_config() -> None:
    from fedsparse.common.data.datasets import load_eval_splits

    loaded = SparseFedAvg(FederatedConfig(), num_parameters=10).honest_bound()
    assert loaded is not None and loaded.max_examples == 1437  # digits' training split
    # A run holding out a validation slice still covers a node that declares the whole split.
    validation = FederatedConfig(eval_split="validation")
    train, _ = load_eval_splits("digits", seed=0, eval_split="validation")
    caps = SparseFedAvg(validation, num_parameters=10).honest_bound()
    assert caps is not None and caps.max_examples == 1437 > len(train)
    given = SparseFedAvg(FederatedConfig(), num_parameters=10, train_examples=500).honest_bound()
    assert given is not None and given.max_examples == 500
    override = FederatedConfig(max_client_examples=100)
    caps = SparseFedAvg(override, num_parameters=10, train_examples=500).honest_bound()
    assert caps is not None and caps.max_examples == 100


def test_the_bounds_description_names_the_smallest_client_and_how_to_cover_fewer() -> None:
    from fedsparse.server.norm_bound import derived_bound

    keep = 1000
    plain = SparseFedAvg(FederatedConfig(), num_parameters=10).honest_bound()
    assert plain is not None and plain.smallest_covered_examples(keep) > 2
    bound, how = derived_bound(plain, keep=keep, d=10, selects_per_step=False)
    assert how.endswith(
        f"clients of >={plain.smallest_covered_examples(keep)} of <=1437 examples; "
        "fewer: set min-client-examples"
    )
    declared = SparseFedAvg(FederatedConfig(min_client_examples=2), num_parameters=10)
    caps = declared.honest_bound()
    assert caps is not None and caps.min_examples == 2
    wider, how = derived_bound(caps, keep=keep, d=10, selects_per_step=False)
    assert how.endswith("clients of >=2 of <=1437 examples") and wider > bound


def test_a_split_that_does_not_load_names_the_keys_that_replace_it() -> None:
    cfg = FederatedConfig(dataset="mnist")  # a file dataset without data-dir
    with pytest.raises(ValueError, match="dataset='mnist' data-dir='' did not load") as info:
        SparseFedAvg(cfg, num_parameters=10).honest_bound()
    assert "set max-client-examples, or dp-norm-bound='off'" in str(info.value)
    caps = SparseFedAvg(
        FederatedConfig(dataset="mnist", max_client_examples=60_000), num_parameters=10
    ).honest_bound()
    assert caps is not None and caps.max_batches == 1875  # ceil(60000 / 32)
    off = FederatedConfig(dataset="mnist", dp_norm_bound="off")
    assert SparseFedAvg(off, num_parameters=10).honest_bound() is None


@pytest.mark.parametrize(
    "kw",
    [
        {"dp_norm_bound": "off"},
        {"mechanism": "noisy", "target_epsilon": 0.0},  # nothing bounds an unclipped update
        {"dp_level": "user", "clients_per_round": 2},  # the server clips (central-clip)
    ],
)
def test_no_dp_bound_where_it_does_not_apply(kw: dict) -> None:
    assert SparseFedAvg(FederatedConfig(**kw), num_parameters=10).honest_bound() is None


def test_gip_and_random_k_noise_covers_each_steps_groups() -> None:
    """Per-step supports (``common/methods/mallows.py``): keep_count of each group of group-size."""
    from fedsparse.common.masks import keep_count
    from fedsparse.server.round_stats import RoundStats

    for method in ("gip", "random-k"):
        cfg = FederatedConfig(method=method, final_rate=0.9, group_size=100)
        strategy = SparseFedAvg(cfg, num_parameters=1050)
        stats = RoundStats(1, 0.9, 105, 0, [], 0.0, 0.0, client_support=True)
        # 10 groups of 100 keep 10 each, the last of 50 keeps 5
        assert strategy._noise_keep(stats) == 10 * keep_count(100, rate=0.9) + 5 == 105
        stats = RoundStats(1, 0.0, 1050, 0, [], 0.0, 0.0, client_support=True)
        assert strategy._noise_keep(stats) == 1050
    plain = SparseFedAvg(FederatedConfig(), num_parameters=1050)
    assert plain._noise_keep(RoundStats(1, 0.9, 105, 0, [], 0.0, 0.0)) == 105


def test_summary_logs_how_the_dp_bound_is_set(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="flwr"):
        SparseFedAvg(FederatedConfig(), num_parameters=38_282).summary()
    (line,) = [r.getMessage() for r in caplog.records if "dp-norm-bound=auto" in r.getMessage()]
    assert "sigma <= 4.905" in line and "<= 45 steps a round" in line
    assert line.endswith(": 67.32 at keep=d")
