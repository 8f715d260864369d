"""The server's round is one number whatever the order its replies arrive in, and with a norm
bound fixed before the round it adds each update as it is read (holding none)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import pytest
import torch
from flwr.app import ConfigRecord, Message

from fedsparse.common.aggregation import sparse as sparse_module
from fedsparse.common.config import FederatedConfig
from fedsparse.lab.simulation.inprocess import InProcessGrid
from fedsparse.server.strategy import SparseFedAvg, flat_array, flat_tensor

D, NODES = 300, 12


def _round(
    cfg: FederatedConfig, make_client, server_round: int = 2
) -> tuple[SparseFedAvg, list[Message]]:
    """A strategy configured for ``server_round`` and its replies (synthetic clients)."""
    grid = InProcessGrid(make_client(cfg, D), num_nodes=NODES, run_config={})
    strategy = SparseFedAvg(cfg, num_parameters=D)
    arrays = flat_array(torch.zeros(D))
    for r in range(1, server_round + 1):
        messages = list(strategy.configure_train(r, arrays, ConfigRecord(), grid))
        replies = list(grid.send_and_receive(messages))
        if r < server_round:
            arrays, _ = strategy.aggregate_train(r, replies)
    return strategy, replies


def _fresh(
    cfg: FederatedConfig, make_client
) -> tuple[Callable[[list[Message]], tuple], list[Message]]:
    """(aggregate these replies of round 2 on a fresh copy of the strategy, the replies)."""
    _, replies = _round(cfg, make_client)

    def run(ordered: list[Message]) -> tuple:
        strategy, _ = _round(cfg, make_client)
        arrays, metrics = strategy.aggregate_train(2, iter(ordered))
        assert arrays is not None and metrics is not None
        return flat_tensor(arrays), dict(metrics)

    return run, replies


@pytest.mark.parametrize(
    "kw",
    [
        dict(),  # the median-norm rule: the round is held
        dict(max_norm_ratio=0.0),  # streamed
        dict(max_norm_ratio=0.0, mask_scope="client", weighting="examples"),
        dict(aggregator="trimmed-mean", max_norm_ratio=0.0),
    ],
    ids=["held", "streamed", "streamed-client-masks", "trimmed-mean"],
)
def test_any_order_of_arrival_gives_the_same_model_and_numbers_bit_for_bit(
    make_synthetic_client, kw: dict
) -> None:
    cfg = FederatedConfig(num_rounds=2, final_rate=0.5, seed=3, **kw)
    run, replies = _fresh(cfg, make_synthetic_client)
    want_model, want_metrics = run(replies)
    for seed in range(3):
        shuffled = list(replies)
        random.Random(seed).shuffle(shuffled)
        model, metrics = run(shuffled)
        assert torch.equal(model, want_model)
        assert metrics == want_metrics
    assert want_metrics["num-accepted"] == NODES


def _counting_adds(monkeypatch: pytest.MonkeyPatch, read: list[int]) -> list[int]:
    """Records, at each ``SparseAggregator.add``, how many replies had been read."""
    seen: list[int] = []
    add = sparse_module.SparseAggregator.add

    def counting(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(read[0])
        return add(self, *args, **kwargs)

    monkeypatch.setattr(sparse_module.SparseAggregator, "add", counting)
    return seen


@pytest.mark.parametrize(("ratio", "streamed"), [(0.0, True), (3.0, False)])
def test_a_bound_fixed_before_the_round_adds_each_update_as_it_is_read(
    make_synthetic_client, monkeypatch: pytest.MonkeyPatch, ratio: float, streamed: bool
) -> None:
    cfg = FederatedConfig(num_rounds=2, final_rate=0.5, seed=3, max_norm_ratio=ratio)
    strategy, replies = _round(cfg, make_synthetic_client)
    read = [0]

    def stream() -> Iterator[Message]:
        for reply in replies:
            read[0] += 1
            yield reply

    seen = _counting_adds(monkeypatch, read)
    strategy.aggregate_train(2, stream())
    # streamed: the k-th update is added before the (k+1)-th reply is read; held: after all
    assert seen == (list(range(1, NODES + 1)) if streamed else [NODES] * NODES)


def test_streamed_and_held_rounds_agree_where_the_median_rule_does_not_bind(
    make_synthetic_client,
) -> None:
    results = []
    for ratio in (1000.0, 0.0):  # held (a median rule that binds nobody), streamed
        cfg = FederatedConfig(num_rounds=2, final_rate=0.5, seed=3, max_norm_ratio=ratio)
        run, replies = _fresh(cfg, make_synthetic_client)
        results.append(run(replies))
    (held, held_metrics), (streamed, streamed_metrics) = results
    assert torch.equal(held, streamed) and not torch.equal(held, torch.zeros(D))
    for key in ("train-loss", "num-accepted", "epsilon-max", "uplink-payload-bytes"):
        assert held_metrics[key] == streamed_metrics[key], key


@pytest.mark.parametrize("action", ["reject", "clip"])
def test_a_streamed_round_holds_each_update_to_the_absolute_bound(
    make_synthetic_client, action: str
) -> None:
    """max-update-norm below every update's norm: each rejected, or clipped to it."""
    cfg = FederatedConfig(
        num_rounds=2,
        final_rate=0.5,
        seed=3,
        max_norm_ratio=0.0,
        max_update_norm=1e-3,
        norm_action=action,
    )
    strategy, replies = _round(cfg, make_synthetic_client)
    before = strategy.round_model
    assert before is not None
    before = before.clone()
    arrays, _ = strategy.aggregate_train(2, iter(replies))
    stats = strategy.last_round
    assert stats is not None and stats.norm_bound == 1e-3
    assert stats.norm_bound_how == "max-update-norm=0.001"
    if action == "reject":
        assert stats.accepted == 0 and len(stats.rejected) == NODES and stats.failed
        return
    assert stats.accepted == NODES and len(stats.clipped) == NODES and arrays is not None
    step = float((flat_tensor(arrays) - before).norm())
    assert 0 < step <= 1e-3 * (1 + 1e-5)  # a mean of updates of norm <= 1e-3
