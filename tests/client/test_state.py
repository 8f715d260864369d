"""The node's state in Context.state, its state files, and the downlink patch."""

from pathlib import Path

import pytest
import torch
from flwr.app import Context, RecordDict

from fedsparse.client.node_policy import NodePolicy
from fedsparse.client.state import (
    RESUMED_FROM,
    NodeState,
    StateFiles,
    apply_downlink,
    resumed_from,
)
from fedsparse.client.train_message import _node_state
from fedsparse.common.wire.payload import PayloadError, encode_update
from fedsparse.common.wire.protocol import STATE_MODEL, STATE_RECORD, ProtocolError


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
        STATE_MODEL,  # float32 little-endian bytes
    ]
    assert ctx.state.config_records[STATE_RECORD][STATE_MODEL] == model.numpy().tobytes()
    assert not ctx.state.array_records  # no Array: it would np.save and np.load the copy


def test_nodes_holding_equal_models_share_one_stored_copy() -> None:
    """A simulated population after a dense downlink stores one bytes object, not N."""
    model = torch.randn(1000)
    contexts = [_context() for _ in range(3)]
    for ctx in contexts:
        NodeState(model.clone(), 2, [(1.0, 0.5, 1)], last_round=2).save(ctx)
    stored = [ctx.state.config_records[STATE_RECORD][STATE_MODEL] for ctx in contexts]
    assert stored[0] is stored[1] is stored[2]
    other = model.clone()
    other[7] += 1.0
    NodeState(other, 2, [], last_round=2).save(contexts[2])
    changed = contexts[2].state.config_records[STATE_RECORD][STATE_MODEL]
    assert changed is not stored[0] and changed != stored[0]
    assert torch.equal(NodeState.load(contexts[0], 1000).model, model)
    assert torch.equal(NodeState.load(contexts[2], 1000).model, other)


def test_an_equal_downlink_is_decoded_once_and_one_model_shared_until_written() -> None:
    """The nodes of a process decode a round's payload once and get one read-only model (not
    a copy each); a model written in place is not handed out again, the cached decoding
    stays as decoded, and a payload for another round or size is decoded (and checked) anew."""
    from fedsparse.client import state

    held = torch.randn(100)
    dense = encode_update(held, dense_size=100, round=5)
    first = apply_downlink(None, -1, dense, base_version=-1, numel=100, server_round=5)
    cached = state._LAST_DOWNLINK
    assert cached is not None and cached[0] == dense
    again = apply_downlink(
        None, -1, bytes(bytearray(dense)), base_version=-1, numel=100, server_round=5
    )  # an equal payload in another object
    assert state._LAST_DOWNLINK is cached  # not decoded again
    assert again is first and torch.equal(first, held)
    assert cached[3].values is not first  # the decoding is not what the nodes hold
    first += 1.0  # written in place (no consumer does: test_population's read-only check)
    fresh = apply_downlink(None, -1, dense, base_version=-1, numel=100, server_round=5)
    assert fresh is not first and torch.equal(fresh, held)
    assert torch.equal(cached[3].values, held)
    with pytest.raises(PayloadError):  # the cached decoding is for round 5 only
        apply_downlink(None, -1, dense, base_version=-1, numel=100, server_round=6)
    with pytest.raises(PayloadError):
        apply_downlink(None, -1, dense[:-1], base_version=-1, numel=100, server_round=5)


def test_a_sparse_patch_of_one_stored_model_is_made_once_and_per_stored_tensor() -> None:
    """Nodes holding one stored tensor patched with one payload share the patched model;
    another stored tensor (equal bits or not), a stored tensor written since, or another
    downlink kind gives its own patch, each exact."""
    d = 50
    stored = torch.randn(d)
    support = torch.tensor([3, 10, 49])
    values = torch.tensor([1.0, -2.0, 0.5])
    sparse = encode_update(values, indices=support, dense_size=d, round=2)

    def patch(model: torch.Tensor, kind: str = "values") -> torch.Tensor:
        return apply_downlink(model, 1, sparse, base_version=1, numel=d, server_round=2, kind=kind)

    want = stored.clone()
    want[support] = values
    first = patch(stored)
    assert torch.equal(first, want) and patch(stored) is first
    copy = stored.clone()
    assert patch(copy) is not first and torch.equal(patch(copy), want)
    added = stored.clone()
    added[support] += values
    assert torch.equal(patch(stored, "delta"), added)
    stored[0] = 7.0  # the stored tensor written in place: patched anew, from its new bits
    want[0] = 7.0
    again = patch(stored)
    assert again is not first and torch.equal(again, want)


def test_nodes_with_equal_models_store_and_load_one_copy_but_other_bits_their_own() -> None:
    """A simulated population after a dense downlink: each node's own tensor, equal bits, one
    stored bytes object and one loaded tensor; a model that differs only in a zero's sign, or
    the same tensor changed in place, is stored anew."""
    model = torch.linspace(-1.0, 1.0, 64)
    contexts = [_context() for _ in range(3)]
    for ctx in contexts:
        NodeState(model.clone(), 1, []).save(ctx)
    stored = [ctx.state[STATE_RECORD][STATE_MODEL] for ctx in contexts]
    assert stored[0] is stored[1] is stored[2]
    loaded = [NodeState.load(ctx, 64).model for ctx in contexts]
    assert loaded[0] is loaded[1] is loaded[2] and torch.equal(loaded[0], model)
    signed = torch.zeros(64)
    NodeState(signed, 2, []).save(contexts[0])
    negative = -signed  # -0.0 everywhere: equal values, other bits
    NodeState(negative, 2, []).save(contexts[1])
    zero, minus = (ctx.state[STATE_RECORD][STATE_MODEL] for ctx in contexts[:2])
    assert zero is not minus and zero != minus
    assert torch.equal(
        NodeState.load(contexts[1], 64).model.view(torch.int32), negative.view(torch.int32)
    )
    negative.add_(1.0)  # changed in place after it was stored: not taken for the last copy
    NodeState(negative, 3, []).save(contexts[2])
    assert torch.equal(NodeState.load(contexts[2], 64).model, torch.ones(64))


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


def test_a_seeded_patch_regenerates_the_public_mask_once_per_process() -> None:
    from fedsparse.common import masks
    from fedsparse.common.masks import sample_mask

    held = torch.randn(1000)
    before = held.clone()
    mask = sample_mask(1000, keep=300, seed=11)
    values = torch.randn(300)
    patch = encode_update(values, dense_size=1000, round=2, mask_seed=11, encoding="seeded")
    masks._shared.cache_clear()
    for _ in range(3):  # three nodes of one worker: one mask
        out = apply_downlink(held, 1, patch, base_version=1, numel=1000, server_round=2)
        assert torch.equal(out[mask], values) and torch.equal(out[~mask], held[~mask])
    assert masks._shared.cache_info().misses == 1 and masks._shared.cache_info().hits == 2
    assert torch.equal(held, before)  # the stored copy is not patched in place


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


# --- state files: what a simulated node keeps on disk for a resumed run ---------------------


def _files(tmp_path: Path) -> StateFiles:
    return StateFiles(tmp_path / "state", 2)


def test_state_files_round_trip_the_history_exactly(tmp_path: Path) -> None:
    files = _files(tmp_path)
    history = [(1.1000000000000001, 0.0123456789, 4), (0.9, 0.25, 8)]
    files.save(NodeState(torch.zeros(3), 1, history[:1], last_round=1))
    files.save(NodeState(torch.zeros(3), 3, history, last_round=4))
    assert files.rounds() == [1, 4]
    assert sorted(p.name for p in files.folder.iterdir()) == ["round-1.json", "round-4.json"]
    back = files.restore(up_to=4)
    assert back == NodeState(history=history, last_round=4)  # no model: the server sends it
    assert files.restore(up_to=3) == NodeState(history=history[:1], last_round=1)
    assert files.restore(up_to=0) == NodeState()


def test_state_files_after_the_resume_point_are_discarded(tmp_path: Path) -> None:
    files = _files(tmp_path)
    for r in (1, 3, 4):
        files.save(NodeState(torch.zeros(3), r - 1, [(1.0, 0.5, r)], last_round=r))
    (files.folder / "notes.txt").write_text("not a state file")
    files.discard_after(3)
    assert files.rounds() == [1, 3]
    files.discard_after(0)  # a new run: nothing of an earlier one is kept
    assert files.rounds() == [] and (files.folder / "notes.txt").exists()


@pytest.mark.parametrize(
    "text, match",
    [
        ("{", "unreadable"),
        ('{"format": 2, "last-round": 3}', "format=2"),
        ('{"format": 1, "last-round": 2}', "last-round=2: expected 3"),
        ('{"format": 1, "last-round": 3, "acc-sigma": [0.0]}', "acc-q"),
    ],
)
def test_a_damaged_state_file_is_an_error_not_a_fresh_accountant(
    tmp_path: Path, text: str, match: str
) -> None:
    files = _files(tmp_path)
    files.folder.mkdir(parents=True)
    (files.folder / "round-3.json").write_text(text)
    with pytest.raises(ValueError, match=match):
        files.restore(up_to=5)


def test_resumed_from_is_read_from_the_train_config() -> None:
    assert resumed_from({}) == 0
    assert resumed_from({RESUMED_FROM: 7}) == 7
    for bad in (-1, True, "3", 2.0):
        with pytest.raises(ProtocolError, match="resumed-from="):
            resumed_from({RESUMED_FROM: bad})


def test_a_node_restores_its_files_only_on_first_contact(tmp_path: Path) -> None:
    files = _files(tmp_path)
    for r in (1, 2, 3):  # round 3: trained in the killed run after its last checkpoint
        files.save(NodeState(torch.zeros(3), r - 1, [(1.0, 0.5, r)], last_round=r))
    ctx = _context()
    state = _node_state(ctx, files, 2, numel=3)
    assert state == NodeState(history=[(1.0, 0.5, 2)], last_round=2)
    assert files.rounds() == [1, 2]
    NodeState(torch.ones(3), 3, [(0.7, 0.5, 9)], last_round=3).save(ctx)
    again = _node_state(ctx, files, 2, numel=3)  # the Context wins once it holds a state
    assert again.last_round == 3 and again.history == [(0.7, 0.5, 9)]
    fresh = _node_state(_context(), files, 0, numel=3)  # a new run: files of old runs go
    assert fresh == NodeState() and files.rounds() == []


def test_state_dir_is_a_simulation_only_policy() -> None:
    policy = NodePolicy.from_sources({"noise": "seeded", "state-dir": "/tmp/x"})
    assert policy.state_dir == "/tmp/x"
    with pytest.raises(ValueError, match="state-dir='/tmp/x': expected '' unless noise='seeded'"):
        NodePolicy.from_sources({"state-dir": "/tmp/x"})
