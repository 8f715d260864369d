"""Split a labelled in-memory dataset across federated clients, via flwr-datasets partitioners.

The labels go into an in-memory Hugging Face ``datasets.Dataset`` with two columns, ``label``
and ``index`` (the example's position in the caller's arrays); a flwr-datasets partitioner
splits its rows, and each partition's ``index`` column maps it back to the caller's data. No
files are read or written and no network is used. ``flwr_datasets`` is imported lazily (it
takes seconds); it does not import ``flwr`` itself.

Partitioners:

* ``"iid"``: :class:`~flwr_datasets.partitioner.IidPartitioner` on a seeded shuffle of the rows
  (the partitioner itself takes contiguous blocks and has no seed, so the shuffle is what makes
  it IID). Partition sizes differ by at most one; the union covers every example.
* ``"dirichlet"``: :class:`~flwr_datasets.partitioner.DirichletPartitioner`, label skew of
  Hsu et al. 2019 (arXiv:1909.06335): for each class, the share of each client is drawn from
  ``Dirichlet(alpha)``; small ``alpha`` means few classes per client. The union covers every
  example. Resampled (up to 10 tries, with a warning each) until every partition has at least
  ``min_partition_size`` examples.
* ``"shard"`` (alias ``"pathological"``): :class:`~flwr_datasets.partitioner.ShardPartitioner`,
  McMahan et al. 2017 (arXiv:1602.05629): rows sorted by label, cut into
  ``num_partitions * shards_per_partition`` equal shards of ``n // (num_partitions *
  shards_per_partition)`` examples, each client gets ``shards_per_partition`` random shards.
  Every partition has the same size; the ``n mod (num_partitions * shards_per_partition)``
  examples outside the chosen shards are assigned to no client. (This is not flwr-datasets'
  ``PathologicalPartitioner``, which fixes the number of classes per client instead.)
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from fedsparse.common.known_warnings import quiet_known_warnings
from fedsparse.common.names import PARTITIONER_NAMES, PartitionerName

if TYPE_CHECKING:
    from flwr_datasets.partitioner import Partitioner

__all__ = ["PARTITIONER_NAMES", "PartitionerName", "partition_indices"]


def partition_indices(
    labels: np.ndarray,
    *,
    num_partitions: int,
    partitioner: PartitionerName = "iid",
    alpha: float = 0.5,
    shards_per_partition: int = 2,
    min_partition_size: int = 2,
    self_balancing: bool = False,
    seed: int = 0,
) -> list[np.ndarray]:
    """Assign example indices to ``num_partitions`` clients.

    Args:
        labels: 1-D integer array of class labels, one per example.
        num_partitions: Number of clients, ``1 <= num_partitions <= len(labels)``.
        partitioner: One of :data:`PARTITIONER_NAMES`.
        alpha: Dirichlet concentration (``"dirichlet"`` only), > 0; smaller is more skewed.
        shards_per_partition: Shards per client (``"shard"`` only), >= 1, with
            ``num_partitions * shards_per_partition <= len(labels)``.
        min_partition_size: Smallest acceptable partition (``"dirichlet"`` only), >= 0.
        self_balancing: ``"dirichlet"`` only: stop giving a client examples of later classes
            once it holds more than ``n / num_partitions`` (flwr-datasets' option, from the
            original paper's code). Evens out sizes at the cost of a less exact Dirichlet
            skew. Off by default.
        seed: Seed for the row shuffle and the partitioner; the same ``(labels, arguments,
            seed)`` always gives the same partitions.

    Returns:
        One sorted int64 index array per client, pairwise disjoint. Their union is every
        index for ``"iid"`` and ``"dirichlet"``, and all but ``n mod (num_partitions *
        shards_per_partition)`` of them for ``"shard"``.

    Raises:
        ValueError: Bad argument (the message names it and its value), an unknown
            partitioner (the message lists the valid ones), or Dirichlet sampling that
            cannot meet ``min_partition_size`` in 10 tries.
    """
    labels = _check_labels(labels)
    n = len(labels)
    _check_int("num_partitions", num_partitions, low=1)
    if num_partitions > n:
        raise ValueError(
            f"num_partitions={num_partitions}: expected at most the number of examples ({n})"
        )
    if partitioner not in PARTITIONER_NAMES:
        raise ValueError(
            f"partitioner={partitioner!r}: expected one of {', '.join(PARTITIONER_NAMES)}"
        )
    if not (math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha={alpha}: expected a finite value > 0")
    _check_int("shards_per_partition", shards_per_partition, low=1)
    _check_int("min_partition_size", min_partition_size, low=0)
    if partitioner in ("shard", "pathological") and num_partitions * shards_per_partition > n:
        raise ValueError(
            f"shards_per_partition={shards_per_partition}: num_partitions * "
            f"shards_per_partition = {num_partitions * shards_per_partition} exceeds the "
            f"number of examples ({n}), so shards would be empty"
        )

    rng = np.random.default_rng(seed)
    order = rng.permutation(n)
    partitioner_seed = int(rng.integers(2**32))
    if partitioner == "iid":  # IidPartitioner's contiguous shards (Dataset.shard), directly
        return [np.sort(order[rows]) for rows in _contiguous_shards(n, int(num_partitions))]

    from datasets import Dataset

    table = Dataset.from_dict({"label": labels[order].tolist(), "index": order.tolist()})
    part = _make_partitioner(
        partitioner,
        num_partitions=int(num_partitions),
        alpha=float(alpha),
        shards_per_partition=int(shards_per_partition),
        min_partition_size=int(min_partition_size),
        self_balancing=self_balancing,
        seed=partitioner_seed,
    )
    part.dataset = table
    try:
        with quiet_known_warnings():  # datasets' Dataset.sort trips a pyarrow deprecation
            first = part.load_partition(0)  # assigns every partition (and sorts for "shard")
            rows = getattr(part, "_partition_id_to_indices", None)
            if isinstance(rows, dict) and len(rows) == num_partitions:
                # the assignment's rows of the partitioner's (possibly sorted) table, mapped
                # to our indices at once: a Dataset.select per partition costs ~3 ms
                column = np.asarray(part.dataset["index"], dtype=np.int64)
                found = [
                    np.sort(column[np.asarray(rows[pid], dtype=np.int64)])
                    for pid in range(int(num_partitions))
                ]
                if np.array_equal(found[0], np.sort(np.asarray(first["index"], np.int64))):
                    return found
            return [  # another flwr-datasets: each partition through its public API
                np.sort(np.asarray(part.load_partition(pid)["index"], dtype=np.int64))
                for pid in range(int(num_partitions))
            ]
    except ValueError as e:
        raise ValueError(
            f"{partitioner} partitioning of {n} examples into {num_partitions} partitions "
            f"(alpha={alpha}, min_partition_size={min_partition_size}) failed: {e}"
        ) from e


def _contiguous_shards(n: int, shards: int) -> list[slice]:
    """The rows of ``Dataset.shard(shards, i, contiguous=True)`` for every ``i``: sizes differ
    by at most one, the larger first."""
    div, mod = divmod(n, shards)
    starts = [div * i + min(i, mod) for i in range(shards + 1)]
    return [slice(starts[i], starts[i + 1]) for i in range(shards)]


def _make_partitioner(
    name: str,
    *,
    num_partitions: int,
    alpha: float,
    shards_per_partition: int,
    min_partition_size: int,
    self_balancing: bool,
    seed: int,
) -> Partitioner:
    from flwr_datasets.partitioner import (
        DirichletPartitioner,
        IidPartitioner,
        ShardPartitioner,
    )

    if name == "iid":
        return IidPartitioner(num_partitions=num_partitions)
    if name == "dirichlet":
        return DirichletPartitioner(
            num_partitions=num_partitions,
            partition_by="label",
            alpha=alpha,
            min_partition_size=min_partition_size,
            self_balancing=self_balancing,
            shuffle=False,  # indices are sorted on the way out anyway
            seed=seed,
        )
    return ShardPartitioner(
        num_partitions=num_partitions,
        partition_by="label",
        num_shards_per_partition=shards_per_partition,
        shuffle=False,
        seed=seed,
    )


def _check_labels(labels: np.ndarray) -> np.ndarray:
    arr = np.asarray(labels)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"labels: expected a non-empty 1-D array, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"labels: expected integer class labels, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _check_int(field: str, value: int, *, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ValueError(f"{field}={value!r}: expected an integer >= {low}")
