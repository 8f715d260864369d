"""The data a node's owner declares it holds, and that data's identity.

In a deployment the server writes the run config, so nothing in it may decide which local
files a node reads or how they are split: two names, paths or seeds for the same examples
would open two privacy budgets for them, and a path would let the server point a node at
files it never meant to share. A deployed node therefore trains only on the data its owner
declares in its node config (or its policy file, or ``$FEDSPARSE_NODE_POLICY``):

=====================  ===========  ======================================================
key                    default      meaning
=====================  ===========  ======================================================
``dataset``            (required)   one of ``common/data/datasets.py``'s dataset names, or the
                                    node's own loader, ``package.module:loader``
``data-dir``           ""           the folder holding its files ("" for the embedded ones)
``partition-id``       0            which part of the dataset's training split this node
``num-partitions``     1            holds, and into how many parts it is split
``partitioner``        "iid"        ``common/data/partition.py``'s partitioners
``dirichlet-alpha``    0.5          label skew of ``partitioner="dirichlet"``
``data-seed``          0            seeds the partitioning and the slices below
``split-seed``         -1           seeds digits' train/test split (-1: ``data-seed``)
``hold-out-validation`` false       leave out the validation slice of the training split
                                    (``common/data/datasets.py: hold_out_validation``)
``public-fraction``    0.0          leave out this share of the training split, declared
                                    public (``common/methods/selection.py: public_split``)
``nominal-size``       0            the most examples this node may ever hold: public, the
                                    size its sampling rate, steps, calibration and reported
                                    numbers are computed from (below); 0 (simulated nodes
                                    only): the real count
=====================  ===========  ======================================================

**The count stays private.** DP protects the addition or removal of one example, so the
number of examples a node holds must not show in anything but the noisy update. A node with
fresh noise (a deployment) therefore requires ``nominal-size``, its owner's public bound ``N``
on its count ``n``: the Poisson rate ``q = 1 / ceil(N / b)``, the steps of an epoch, the
calibrated σ, every refusal and every number a reply carries are functions of ``N``, the run
config and the node's policy; the real ``n`` enters only the noisy sum (``q`` samples each of
its ``n`` examples; the sum is divided by ``int(N q)``). A node whose data exceeds ``N``
refuses every train request with one fixed line. The cost of a loose ``N``: the expected
batch holds ``n q`` examples instead of ``N q``, so the signal shrinks by ``n / N`` against the
same noise (``docs/explanation/nominal-size.md``). A simulated node (seeded noise, the
experimenter plays every owner) may leave it at 0: its real count, as before.

The run config's ``dataset`` must name the declared dataset (the model's input shape
follows it); its ``data-dir``, ``partitioner``, ``dirichlet-alpha``, ``seed``, ``eval-split``,
``split-seed`` and ``public-fraction`` choose nothing on such a node. A simulated node holds
exactly the examples of the declaration its run config makes (``client/data.py:
run_declaration``), so a loopback deployment that declares those (``fedsparse deploy``)
trains on the same data.

``data_identity`` is what the node's privacy ledger is keyed on: a SHA-256 digest of the
examples themselves (shape, dtype and bytes of the inputs and the labels, in order). Any
declaration that yields the same examples -- another name, another path, a symlink, a copy --
charges the same ledger; the server chooses none of it.

Pure Python (no Flower): the ClientApp passes the node config.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Final

from fedsparse.common import plugins
from fedsparse.common.coerce import coerce
from fedsparse.common.names import (
    DATASET_NAMES,
    PARTITIONER_NAMES,
    DatasetName,
    PartitionerName,
)

if TYPE_CHECKING:
    from fedsparse.common.data.datasets import Split

__all__ = ["DATA_KEYS", "NodeData", "data_identity", "format_node_config"]

#: Node config keys that declare the node's data (``NodeData``'s fields, kebab-case).
DATA_KEYS: Final = frozenset(
    {
        "dataset",
        "data-dir",
        "partition-id",
        "num-partitions",
        "partitioner",
        "dirichlet-alpha",
        "data-seed",
        "split-seed",
        "hold-out-validation",
        "public-fraction",
        "nominal-size",
    }
)


#: Field annotations (strings: ``from __future__ import annotations``) -> the type coerced to.
_KINDS: Final[dict[str, type]] = {
    "int": int,
    "float": float,
    "bool": bool,
    "str": str,
    "DatasetName": str,
    "PartitionerName": str,
}


@dataclass(frozen=True, kw_only=True)
class NodeData:
    """The data a node's owner declared (module table)."""

    dataset: DatasetName
    data_dir: str = ""
    partition_id: int = 0
    num_partitions: int = 1
    partitioner: PartitionerName = "iid"
    dirichlet_alpha: float = 0.5
    data_seed: int = 0
    split_seed: int = -1
    hold_out_validation: bool = False
    public_fraction: float = 0.0
    nominal_size: int = 0

    def __post_init__(self) -> None:
        def fail(key: str, value: Any, expected: str) -> None:
            raise ValueError(f"node data: {key}={value!r}: expected {expected}")

        if self.dataset not in DATASET_NAMES and not plugins.is_reference(self.dataset):
            fail(
                "dataset",
                self.dataset,
                f"one of {', '.join(DATASET_NAMES)} or {plugins.REFERENCE_FORMAT} (the node's "
                "own loader)",
            )
        if self.num_partitions < 1:
            fail("num-partitions", self.num_partitions, ">= 1")
        if not 0 <= self.partition_id < self.num_partitions:
            fail("partition-id", self.partition_id, f"0 <= id < {self.num_partitions}")
        if self.partitioner not in PARTITIONER_NAMES:
            fail("partitioner", self.partitioner, f"one of {', '.join(PARTITIONER_NAMES)}")
        if not self.dirichlet_alpha > 0:
            fail("dirichlet-alpha", self.dirichlet_alpha, "a value > 0")
        if self.data_seed < 0:
            fail("data-seed", self.data_seed, ">= 0")
        if self.split_seed < -1:
            fail("split-seed", self.split_seed, "-1 (data-seed) or >= 0")
        if not 0 <= self.public_fraction < 1:
            fail("public-fraction", self.public_fraction, "0 <= fraction < 1")
        if self.nominal_size < 0:
            fail("nominal-size", self.nominal_size, ">= 1, or 0 (simulated nodes: the real count)")

    @property
    def train_test_seed(self) -> int:
        """The seed of digits' train/test split: ``split-seed``, or ``data-seed``."""
        return self.data_seed if self.split_seed < 0 else self.split_seed

    def to_node_config(self) -> dict[str, Any]:
        """The declaration as node config entries (kebab-case keys)."""
        return {f.name.replace("_", "-"): getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_sources(cls, *sources: Mapping[str, Any]) -> NodeData | None:
        """The declaration in ``sources`` (later ones override earlier ones), or None when
        none of them names a ``dataset``. Keys other than ``DATA_KEYS`` are ignored.

        Raises:
            ValueError: a value of the wrong type or out of range, naming the key.
        """
        entries: dict[str, Any] = {}
        for source in sources:
            entries.update({k: v for k, v in source.items() if k in DATA_KEYS})
        if "dataset" not in entries:
            return None
        kinds = {f.name: _KINDS[str(f.type)] for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in entries.items():
            name = key.replace("-", "_")
            values[name] = coerce(key, value, kinds[name], where="node data")
        return cls(**values)


def data_identity(split: Split) -> str:
    """The SHA-256 hex digest of ``split``'s examples (inputs and labels, in order).

    Equal for equal examples however they were named or found; any changed, added, removed
    or reordered example changes it.
    """
    digest = hashlib.sha256()
    for tensor in (split.x, split.y):
        contiguous = tensor.detach().cpu().contiguous()
        digest.update(f"{contiguous.dtype}:{tuple(contiguous.shape)};".encode())
        digest.update(contiguous.numpy().tobytes())
    return digest.hexdigest()


def format_node_config(declared: NodeData, *, ledger_dir: str | None = None) -> str:
    """``flower-supernode --node-config`` text declaring ``declared`` (and ``ledger-dir``):
    ``partition-id``, ``num-partitions`` and ``dataset`` always, other keys only when they
    differ from their defaults.

    Raises:
        ValueError: a value with white space (node config entries are space-separated).
    """
    defaults = NodeData(dataset=declared.dataset).to_node_config()
    given = declared.to_node_config()
    always = ("partition-id", "num-partitions", "dataset")
    entries = {key: given[key] for key in always}
    entries.update({k: v for k, v in given.items() if k not in always and v != defaults[k]})
    if ledger_dir is not None:
        entries["ledger-dir"] = ledger_dir
    for key, value in entries.items():
        if isinstance(value, str) and any(c.isspace() for c in value):
            raise ValueError(f"{key}={value!r}: node config values cannot contain white space")
    return " ".join(f"{key}={_node_value(value)}" for key, value in entries.items())


def _node_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"'{value}'"
    return repr(value)
