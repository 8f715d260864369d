"""A node's training partition: the dataset and its partitioning, cached per process.

What a node holds is a ``NodeData`` declaration (``client/node_data.py``), from one of two
sources (the ClientApp chooses, ``client/app.py``):

* **its owner** (node config): every deployed node (fresh noise) trains only on declared
  data; nothing in the run config chooses its examples.
* **the run config** (``run_declaration``): a simulated node (seeded noise, the experimenter
  playing every party) holds the partition the whole simulation is defined by.

Both go through ``holding``, so the same declaration gives the same examples either way, and
the node's privacy ledger is keyed on those examples' content (``Holding.identity``).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
import torch

from fedsparse.client.node_data import NodeData, data_identity
from fedsparse.common.config import FederatedConfig
from fedsparse.common.data.datasets import DatasetName, EvalSplit, Split, load_eval_splits
from fedsparse.common.data.partition import PartitionerName, partition_indices
from fedsparse.common.methods import public_split

__all__ = [
    "Holding",
    "holding",
    "largest_partition",
    "local_data",
    "private_examples",
    "public_test_data",
    "run_declaration",
    "test_data",
    "with_nominal_size",
]


@dataclass(frozen=True, eq=False)
class Holding:
    """The examples a node trains on, and the declaration they were read from."""

    train: Split
    declared: NodeData

    @functools.cached_property
    def identity(self) -> str:
        """``data_identity(train)``, computed once per process (what the ledger is keyed on)."""
        return data_identity(self.train)


@functools.lru_cache(maxsize=65536)
def run_declaration(cfg: FederatedConfig, partition_id: int, num_partitions: int) -> NodeData:
    """The declaration of a simulated node's partition: the run config's data keys (cached:
    both are frozen)."""
    return NodeData(
        dataset=cfg.dataset,
        data_dir=cfg.data_dir,
        partition_id=partition_id,
        num_partitions=num_partitions,
        partitioner=cfg.partitioner,
        dirichlet_alpha=cfg.dirichlet_alpha,
        data_seed=cfg.seed,
        split_seed=cfg.data_seed,
        hold_out_validation=cfg.eval_split == "validation",
        public_fraction=cfg.make_method().public_fraction,
        nominal_size=cfg.nominal_size,
    )


def holding(declared: NodeData) -> Holding:
    """The training examples ``declared`` names (cached per process: the latest ones up to
    ``HELD_BYTES`` in all, so that a process simulating many nodes copies each node's
    examples once, not once a round)."""
    global _HELD_TOTAL
    held = _HELD.pop(declared, None)
    if held is not None:
        _HELD_TOTAL -= _held_bytes(held)
    else:
        eval_split: EvalSplit = "validation" if declared.hold_out_validation else "test"
        seeds = (declared.data_seed, eval_split, declared.train_test_seed)
        train, _ = _dataset(declared.dataset, declared.data_dir, *seeds)
        idx = torch.from_numpy(_declared_partitions(declared)[declared.partition_id])
        held = Holding(Split(x=train.x[idx], y=train.y[idx]), declared)
    _HELD[declared] = held  # the most recent last
    _HELD_TOTAL += _held_bytes(held)
    while _HELD_TOTAL > HELD_BYTES and len(_HELD) > 4:  # the 4 latest stay, whatever their size
        _HELD_TOTAL -= _held_bytes(_HELD.pop(next(iter(_HELD))))
    return held


#: The most bytes of examples ``holding`` keeps (beyond the 4 latest nodes').
HELD_BYTES = 256 * 2**20
_HELD: dict[NodeData, Holding] = {}
_HELD_TOTAL = 0


def _held_bytes(held: Holding) -> int:
    split = held.train
    return split.x.numel() * split.x.element_size() + split.y.numel() * split.y.element_size()


def largest_partition(declared: NodeData) -> int:
    """The most examples any part of ``declared``'s partitioning holds (it loads the dataset):
    a public bound that whoever owns every node of a deployment (a loopback ``fedsparse
    deploy``, a compose file's nodes) can declare as each one's ``nominal-size``, since it
    depends on the partitioning only, never on which part a node holds (iid: ``ceil(train /
    num-partitions)``).

    Raises:
        ValueError: the dataset cannot be loaded here (its files are elsewhere): then the
            nominal size has to be given.
    """
    try:
        return max(len(part) for part in _declared_partitions(declared))
    except (OSError, ValueError) as err:
        raise ValueError(
            f"dataset={declared.dataset!r}: cannot count its partitions here ({err}); give the "
            "nodes' nominal size (the most examples a node may hold)"
        ) from None


def _declared_partitions(declared: NodeData) -> tuple[np.ndarray, ...]:
    """Every part of ``declared``'s partitioning (``_partitions``, cached)."""
    eval_split: EvalSplit = "validation" if declared.hold_out_validation else "test"
    return _partitions(
        declared.dataset,
        declared.data_dir,
        declared.data_seed,
        declared.num_partitions,
        declared.partitioner,
        declared.dirichlet_alpha,
        declared.public_fraction,
        eval_split,
        declared.train_test_seed,
    )


def with_nominal_size(declared: NodeData) -> NodeData:
    """``declared``, with ``largest_partition`` as its ``nominal-size`` where it declares none."""
    if declared.nominal_size:
        return declared
    return dataclasses.replace(declared, nominal_size=largest_partition(declared))


def test_data(declared: NodeData) -> Split:
    """The public test split of the dataset ``declared`` names (never its training split)."""
    seed, split_seed = declared.data_seed, declared.train_test_seed
    return _dataset(declared.dataset, declared.data_dir, seed, "test", split_seed)[1]


@functools.lru_cache(maxsize=4)
def _dataset(
    name: DatasetName,
    data_dir: str,
    seed: int,
    eval_split: EvalSplit = "test",
    split_seed: int | None = None,
) -> tuple[Split, Split]:
    return load_eval_splits(
        name, data_dir=data_dir or None, seed=seed, eval_split=eval_split, split_seed=split_seed
    )


@functools.lru_cache(maxsize=4)
def _partitions(
    name: DatasetName,
    data_dir: str,
    seed: int,
    num_partitions: int,
    partitioner: PartitionerName,
    alpha: float,
    public_fraction: float = 0.0,
    eval_split: EvalSplit = "test",
    split_seed: int | None = None,
) -> tuple[np.ndarray, ...]:
    """Each client's indices into the training set; with ``public_fraction`` > 0 (DP-SSGD)
    drawn from its private examples only (``common/methods/selection.py``: ``public_split``)."""
    train, _ = _dataset(name, data_dir, seed, eval_split, split_seed)
    labels = train.y.numpy()
    pool = np.arange(len(labels))
    if public_fraction > 0:
        pool = private_examples(len(labels), public_fraction, seed)
    if len(pool) == 0:  # a node's own loader that holds nothing: it trains on its padding alone
        return tuple(pool for _ in range(num_partitions))
    return tuple(
        pool[part]
        for part in partition_indices(
            labels[pool],
            num_partitions=num_partitions,
            partitioner=partitioner,
            alpha=alpha,
            seed=seed,
        )
    )


def private_examples(num_examples: int, public_fraction: float, seed: int) -> np.ndarray:
    """The training examples no one declared public (DP-SSGD's private side)."""
    return public_split(num_examples, public_fraction, run_seed=seed)[1]


def local_data(cfg: FederatedConfig, partition_id: int, num_partitions: int) -> Split:
    """A simulated node's training partition from the run config (cached per process).

    Raises:
        ValueError: a partition id outside ``[0, num_partitions)``, naming it.
    """
    if not 0 <= partition_id < num_partitions:
        raise ValueError(
            f"partition-id={partition_id}: expected 0 <= id < num-partitions={num_partitions}"
        )
    return holding(run_declaration(cfg, partition_id, num_partitions)).train


def public_test_data(cfg: FederatedConfig) -> Split:
    """The server's evaluation set (``eval-split``: the dataset's public test split, or the
    run's validation slice of the training split), never a node's partition."""
    return _dataset(cfg.dataset, cfg.data_dir, cfg.seed, cfg.eval_split, cfg.data_seed)[1]
