"""A node's training partition: the dataset and its partitioning, cached per process."""

from __future__ import annotations

import functools

import numpy as np
import torch

from fedsparse.common.config import FederatedConfig
from fedsparse.common.data import DatasetName, EvalSplit, Split, load_eval_splits
from fedsparse.common.methods import public_split
from fedsparse.common.partition import PartitionerName, partition_indices

__all__ = ["local_data", "private_examples", "public_test_data"]


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
    drawn from its private examples only (``common/methods.py``: ``public_split``)."""
    train, _ = _dataset(name, data_dir, seed, eval_split, split_seed)
    labels = train.y.numpy()
    pool = np.arange(len(labels))
    if public_fraction > 0:
        pool = private_examples(len(labels), public_fraction, seed)
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
    """This node's training partition (cached per process; keyed by every input)."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(
            f"partition-id={partition_id}: expected 0 <= id < num-partitions={num_partitions}"
        )
    train, _ = _dataset(cfg.dataset, cfg.data_dir, cfg.seed, cfg.eval_split, cfg.data_seed)
    public = cfg.public_fraction if cfg.method == "dpssgd" else 0.0
    parts = _partitions(
        cfg.dataset,
        cfg.data_dir,
        cfg.seed,
        num_partitions,
        cfg.partitioner,
        cfg.dirichlet_alpha,
        public,
        cfg.eval_split,
        cfg.data_seed,
    )
    idx = torch.from_numpy(parts[partition_id])
    return Split(x=train.x[idx], y=train.y[idx])


def public_test_data(cfg: FederatedConfig) -> Split:
    """The server's evaluation set (``eval-split``: the dataset's public test split, or the
    run's validation slice of the training split), never a node's partition."""
    return _dataset(cfg.dataset, cfg.data_dir, cfg.seed, cfg.eval_split, cfg.data_seed)[1]
