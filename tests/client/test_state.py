"""The node's state in Context.state and the downlink patch."""

import pytest
import torch
from flwr.app import Context, RecordDict

from fedsparse.client.state import NodeState, apply_downlink
from fedsparse.common.payload import PayloadError, encode_update
from fedsparse.common.protocol import STATE_RECORD


def _context() -> Context:
    return Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={})


def test_state_round_trips_through_the_context() -> None:
    ctx = _context()
    assert NodeState.load(ctx, 10) == NodeState()
    model = torch.randn(10)
    history = [(1.1, 0.25, 4), (0.9, 0.25, 8)]
    NodeState(model, 3, history, last_round=4).save(ctx)
    back = NodeState.load(ctx, 10)
    assert torch.equal(back.model, model) and back.version == 3 and back.history == history
    assert back.last_round == 4
    assert list(ctx.state.config_records[STATE_RECORD]) == [
        "version",
        "last-round",
        "acc-sigma",
        "acc-q",
        "acc-steps",
    ]


def test_a_model_of_another_size_is_dropped_but_the_history_kept() -> None:
    ctx = _context()
    NodeState(torch.zeros(10), 2, [(1.0, 0.5, 3)]).save(ctx)
    back = NodeState.load(ctx, 11)
    assert back.model is None and back.version == -1 and back.history == [(1.0, 0.5, 3)]


def test_saving_without_a_model_is_an_error() -> None:
    with pytest.raises(ValueError, match="model=None"):
        NodeState().save(_context())


def test_dense_and_sparse_patches_are_exact() -> None:
    held = torch.randn(100)
    dense = encode_update(held, dense_size=100, round=1)
    assert torch.equal(
        apply_downlink(None, -1, dense, base_version=-1, numel=100, server_round=1), held
    )
    support = torch.tensor([3, 50, 99])
    values = torch.tensor([1.0, 2.0, 3.0])
    patch = encode_update(values, dense_size=100, round=2, indices=support, encoding="coo")
    out = apply_downlink(held, 1, patch, base_version=1, numel=100, server_round=2)
    expected = held.clone()
    expected[support] = values
    assert torch.equal(out, expected) and not torch.equal(out, held)


def test_a_patch_for_another_version_or_round_is_refused() -> None:
    patch = encode_update(
        torch.ones(1), dense_size=100, round=2, indices=torch.tensor([5]), encoding="coo"
    )
    with pytest.raises(ValueError, match="base-version=1: this node holds model version 0"):
        apply_downlink(torch.zeros(100), 0, patch, base_version=1, numel=100, server_round=2)
    with pytest.raises(ValueError, match="base-version=1: this node holds model version -1"):
        apply_downlink(None, -1, patch, base_version=1, numel=100, server_round=2)
    with pytest.raises(PayloadError):
        apply_downlink(torch.zeros(100), 1, patch, base_version=1, numel=100, server_round=3)
    with pytest.raises(PayloadError):
        apply_downlink(torch.zeros(99), 1, patch, base_version=1, numel=99, server_round=2)
