"""A node's declared data and its content identity (what its ledger is keyed on)."""

import pytest
import torch

from fedsparse.client.node_data import NodeData, data_identity
from fedsparse.common.data.datasets import Split


def _split(n: int = 6, seed: int = 0) -> Split:
    g = torch.Generator().manual_seed(seed)
    return Split(x=torch.randn(n, 1, 2, 2, generator=g), y=torch.arange(n) % 3)


def test_a_declaration_needs_a_dataset_and_reads_only_data_keys() -> None:
    assert NodeData.from_sources({"partition-id": 1, "num-partitions": 2}) is None
    declared = NodeData.from_sources(
        {"dataset": "digits", "epsilon-budget": 3.0},  # a policy key: not the data's
        {"partition-id": 1, "num-partitions": "4", "data-seed": 7.0, "data-dir": "/d"},
    )
    assert declared == NodeData(
        dataset="digits", partition_id=1, num_partitions=4, data_seed=7, data_dir="/d"
    )


@pytest.mark.parametrize(
    ("entries", "match"),
    [
        ({"dataset": "imagenet"}, "dataset='imagenet': expected one of digits"),
        ({"dataset": "digits", "partition-id": 3, "num-partitions": 3}, "partition-id=3"),
        ({"dataset": "digits", "num-partitions": 0}, "num-partitions=0: expected >= 1"),
        ({"dataset": "digits", "partitioner": "zipf"}, "partitioner='zipf'"),
        ({"dataset": "digits", "dirichlet-alpha": 0}, "dirichlet-alpha=0.0: expected a value"),
        ({"dataset": "digits", "data-seed": 1.5}, "data-seed=1.5: expected int"),
        ({"dataset": "digits", "partition-id": True}, "partition-id=True: expected int"),
    ],
)
def test_a_bad_declaration_names_the_key_and_value(entries, match) -> None:
    with pytest.raises(ValueError, match=match):
        NodeData.from_sources(entries)


def test_the_identity_is_the_examples_whatever_their_name() -> None:
    split = _split()
    copy = Split(x=split.x.clone(), y=split.y.clone())
    assert data_identity(split) == data_identity(copy)  # another name, path or copy
    assert len(data_identity(split)) == 64
    changed = copy.x.clone()
    changed[3, 0, 1, 1] += 1e-6
    assert data_identity(Split(x=changed, y=split.y)) != data_identity(split)
    relabelled = split.y.clone()
    relabelled[0] = 2
    assert data_identity(Split(x=split.x, y=relabelled)) != data_identity(split)
    order = torch.tensor([1, 0, 2, 3, 4, 5])
    assert data_identity(Split(x=split.x[order], y=split.y[order])) != data_identity(split)
    assert data_identity(Split(x=split.x[:5], y=split.y[:5])) != data_identity(split)
    # A non-contiguous view of the same examples is the same data.
    wide = torch.randn(6, 1, 2, 4)
    wide[..., ::2] = split.x
    assert data_identity(Split(x=wide[..., ::2], y=split.y)) == data_identity(split)
