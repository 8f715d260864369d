"""Tests for fedsparse.common.data.partition (flwr-datasets partitioners over in-memory labels)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from fedsparse.common.data.partition import PARTITIONER_NAMES, partition_indices

NUM_CLASSES = 10


def _labels(n: int = 1000, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, NUM_CLASSES, n)


def _assert_disjoint(parts: list[np.ndarray]) -> np.ndarray:
    union = np.concatenate(parts)
    assert len(np.unique(union)) == len(union), "partitions overlap"
    for part in parts:
        assert part.dtype == np.int64
        assert np.all(np.diff(part) > 0), "indices not sorted/unique"
    return union


def _mean_tv_from_global(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    """Mean total-variation distance of each partition's label distribution from the global."""
    global_dist = np.bincount(labels, minlength=NUM_CLASSES) / len(labels)
    distances = [
        0.5 * np.abs(np.bincount(labels[p], minlength=NUM_CLASSES) / len(p) - global_dist).sum()
        for p in parts
    ]
    return float(np.mean(distances))


@pytest.mark.parametrize("partitioner", ["iid", "dirichlet"])
@pytest.mark.parametrize(("n", "num_partitions", "seed"), [(1000, 10, 0), (997, 7, 3), (50, 50, 1)])
def test_disjoint_and_covering(partitioner: str, n: int, num_partitions: int, seed: int) -> None:
    labels = _labels(n, seed)
    parts = partition_indices(
        labels,
        num_partitions=num_partitions,
        partitioner=partitioner,
        alpha=1.0,
        min_partition_size=1 if n > num_partitions else 0,
        seed=seed,
    )
    assert len(parts) == num_partitions
    union = _assert_disjoint(parts)
    assert np.array_equal(np.sort(union), np.arange(n))


def test_iid_sizes_balanced() -> None:
    parts = partition_indices(_labels(997), num_partitions=10)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 997


def test_iid_is_shuffled_not_contiguous() -> None:
    # IidPartitioner alone takes contiguous blocks; label-sorted input must still mix.
    labels = np.repeat(np.arange(NUM_CLASSES), 100)
    parts = partition_indices(labels, num_partitions=10, seed=0)
    for part in parts:
        assert len(np.unique(labels[part])) == NUM_CLASSES
    assert _mean_tv_from_global(labels, parts) < 0.2


@pytest.mark.parametrize(
    ("n", "num_partitions", "shards"), [(1000, 10, 2), (59, 10, 2), (997, 7, 3)]
)
def test_shard_sizes_and_coverage(n: int, num_partitions: int, shards: int) -> None:
    labels = _labels(n)
    parts = partition_indices(
        labels, num_partitions=num_partitions, partitioner="shard", shards_per_partition=shards
    )
    union = _assert_disjoint(parts)
    shard_size = n // (num_partitions * shards)
    assert all(len(p) == shards * shard_size for p in parts)
    # Shards do not cover everything: n mod (partitions * shards) examples are unassigned.
    assert len(union) == n - n % (num_partitions * shards)
    assert set(union.tolist()) <= set(range(n))


def test_shard_partitions_have_few_classes() -> None:
    labels = _labels(2000)
    shards = 2
    parts = partition_indices(
        labels, num_partitions=10, partitioner="shard", shards_per_partition=shards
    )
    # Shards are runs of 100 consecutive label-sorted examples and every class has more
    # than 100 examples (~200), so a shard spans at most two classes.
    assert np.bincount(labels).min() > 100
    for part in parts:
        assert len(np.unique(labels[part])) <= 2 * shards


def test_shard_maps_back_to_original_indices() -> None:
    # 10 classes x 10 examples, in shuffled order; 10 partitions of 1 shard of 10: each
    # partition must be exactly one whole class, which only holds if the label-sorted rows
    # are mapped back to the caller's indices correctly.
    labels = np.random.default_rng(0).permutation(np.repeat(np.arange(NUM_CLASSES), 10))
    parts = partition_indices(
        labels, num_partitions=10, partitioner="pathological", shards_per_partition=1, seed=4
    )
    classes = []
    for part in parts:
        assert len(part) == 10
        (cls,) = np.unique(labels[part])
        assert np.array_equal(part, np.flatnonzero(labels == cls))
        classes.append(int(cls))
    assert sorted(classes) == list(range(NUM_CLASSES))


def test_dirichlet_maps_back_to_original_indices() -> None:
    # Two partitions, alpha=0.01: each class's Dirichlet share is ~(1, 0), so each class lands
    # almost whole in one partition -- visible only if indices map back to the right labels
    # (row positions of the shuffled table would split every class ~50/50).
    labels = _labels(2000)
    parts = partition_indices(
        labels, num_partitions=2, partitioner="dirichlet", alpha=0.01, min_partition_size=0
    )
    counts = np.stack([np.bincount(labels[p], minlength=NUM_CLASSES) for p in parts])
    majority_share = counts.max(axis=0) / counts.sum(axis=0)
    assert np.median(majority_share) > 0.95


@pytest.mark.parametrize("partitioner", PARTITIONER_NAMES)
def test_deterministic_by_seed(partitioner: str) -> None:
    labels = _labels()

    def run(seed: int) -> list[np.ndarray]:
        return partition_indices(labels, num_partitions=8, partitioner=partitioner, seed=seed)

    a, b, c = run(11), run(11), run(12)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(len(x) == len(z) and np.array_equal(x, z) for x, z in zip(a, c, strict=True))


def test_dirichlet_small_alpha_more_skewed_than_iid() -> None:
    labels = _labels(2000)
    tv = {}
    for name, partitioner, alpha in [
        ("iid", "iid", 0.5),
        ("dir0.1", "dirichlet", 0.1),
        ("dir1", "dirichlet", 1.0),
        ("dir100", "dirichlet", 100.0),
    ]:
        values = [
            _mean_tv_from_global(
                labels,
                partition_indices(
                    labels, num_partitions=10, partitioner=partitioner, alpha=alpha, seed=s
                ),
            )
            for s in range(3)
        ]
        tv[name] = float(np.mean(values))
    # Measured at these seeds: iid ~0.08, alpha=0.1 ~0.70, alpha=1 ~0.33, alpha=100 ~0.04.
    assert tv["iid"] < 0.15
    assert tv["dir0.1"] > tv["iid"] + 0.35
    assert tv["dir0.1"] > tv["dir1"] + 0.15 > tv["dir100"] + 0.15


def test_self_balancing_evens_sizes() -> None:
    labels = _labels(2000)
    spread = {}
    for balancing in (False, True):
        sizes = [
            np.std([len(p) for p in parts])
            for s in range(8)
            for parts in [
                partition_indices(
                    labels,
                    num_partitions=10,
                    partitioner="dirichlet",
                    alpha=0.3,
                    self_balancing=balancing,
                    seed=s,
                )
            ]
        ]
        spread[balancing] = float(np.mean(sizes))
    # Measured: mean size std ~97 without balancing, ~65 with it (ratio ~0.67).
    assert spread[True] < 0.85 * spread[False]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_partitions": 0}, "num_partitions=0"),
        ({"num_partitions": 101}, r"num_partitions=101.*\(100\)"),
        ({"num_partitions": 2.0}, "num_partitions=2.0"),
        ({"num_partitions": 2, "alpha": 0.0}, "alpha=0.0"),
        ({"num_partitions": 2, "alpha": -1.0}, "alpha=-1.0"),
        ({"num_partitions": 2, "alpha": float("nan")}, "alpha=nan"),
        ({"num_partitions": 2, "shards_per_partition": 0}, "shards_per_partition=0"),
        ({"num_partitions": 2, "min_partition_size": -1}, "min_partition_size=-1"),
        (
            {"num_partitions": 20, "partitioner": "shard", "shards_per_partition": 6},
            "shards_per_partition=6",
        ),
    ],
)
def test_invalid_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        partition_indices(_labels(100), **kwargs)


def test_unknown_partitioner_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="'natural'") as info:
        partition_indices(_labels(100), num_partitions=2, partitioner="natural")
    for name in PARTITIONER_NAMES:
        assert name in str(info.value)


@pytest.mark.parametrize(
    "labels", [np.zeros((10, 2), dtype=np.int64), np.array([], dtype=np.int64), np.ones(10)]
)
def test_invalid_labels(labels: np.ndarray) -> None:
    with pytest.raises(ValueError, match="labels"):
        partition_indices(labels, num_partitions=2)


@pytest.mark.filterwarnings("ignore:The specified min_partition_size:UserWarning")
def test_dirichlet_unsatisfiable_min_size_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"dirichlet partitioning .*min_partition_size=90"):
        partition_indices(
            _labels(1000),
            num_partitions=10,
            partitioner="dirichlet",
            alpha=0.05,
            min_partition_size=90,
        )


def test_never_imports_flower_or_grpc() -> None:
    # common/ is framework-free: flwr_datasets (lazy) must not drag in flwr or grpc.
    code = (
        "import sys, numpy as np\n"
        "import fedsparse.common.data.partition as p\n"
        "assert 'flwr_datasets' not in sys.modules, 'flwr_datasets imported eagerly'\n"
        "p.partition_indices(np.arange(20) % 2, num_partitions=2, partitioner='shard')\n"
        "assert 'flwr_datasets' in sys.modules\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('flwr', 'grpc'))\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _through_flwr_datasets(labels: np.ndarray, num_partitions: int, name: str, seed: int) -> list:
    """Each partition read through the partitioner's public ``load_partition``, as
    ``partition_indices`` did before it read the assignment at once (and, for iid, before it
    cut the contiguous shards itself)."""
    from datasets import Dataset

    from fedsparse.common.data.partition import _make_partitioner
    from fedsparse.common.known_warnings import quiet_known_warnings

    rng = np.random.default_rng(seed)
    order = rng.permutation(len(labels))
    part = _make_partitioner(
        name,
        num_partitions=num_partitions,
        alpha=0.5,
        shards_per_partition=2,
        min_partition_size=2,
        self_balancing=False,
        seed=int(rng.integers(2**32)),
    )
    part.dataset = Dataset.from_dict({"label": labels[order].tolist(), "index": order.tolist()})
    with quiet_known_warnings():  # datasets' Dataset.sort trips a pyarrow deprecation
        return [
            np.sort(np.asarray(part.load_partition(pid)["index"], dtype=np.int64))
            for pid in range(num_partitions)
        ]


@pytest.mark.parametrize("name", ["iid", "dirichlet", "shard"])
@pytest.mark.parametrize(("n", "num_partitions", "seed"), [(1000, 10, 0), (997, 13, 3)])
def test_the_partitions_are_flwr_datasets_own(name: str, n: int, num_partitions: int, seed: int):
    """The fast paths (iid's shards cut here, the others' assignment read at once) give every
    partition exactly as flwr-datasets' ``load_partition`` gives it, so recorded runs keep
    their clients' data."""
    labels = _labels(n, seed)
    fast = partition_indices(labels, num_partitions=num_partitions, partitioner=name, seed=seed)
    slow = _through_flwr_datasets(labels, num_partitions, name, seed)
    assert len(fast) == len(slow) == num_partitions
    for mine, theirs in zip(fast, slow, strict=True):
        assert np.array_equal(mine, theirs)
