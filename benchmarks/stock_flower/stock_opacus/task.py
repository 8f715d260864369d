"""The stock app's work, without Flower: config, a node's partition, plain Opacus DP-SGD.

Model, data, partitioning and evaluation are fedsparse's own functions (``fedsparse.common``),
and the Poisson sampling and noise generators are seeded from fedsparse's seed streams for the
node and round, so a round here trains on the very batches fedsparse's client trains on, and
with a dense round (``final-rate=0``) reproduces its update: the benchmark compares the
frameworks around the same work. Seeded noise is for reproducible simulation only.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from opacus import PrivacyEngine
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedsparse.common.data.datasets import DATASET_NAMES, DatasetName, Split, load_dataset
from fedsparse.common.data.partition import PARTITIONER_NAMES, PartitionerName, partition_indices
from fedsparse.common.models.classifiers import DEFAULT_MODELS, build_model
from fedsparse.common.seeds import Stream, client_train_seed, stream_seed
from fedsparse.common.training.local import evaluate

__all__ = [
    "StockConfig",
    "TrainResult",
    "build_net",
    "evaluate",
    "load_partition",
    "test_split",
    "train_dp",
]

#: Opacus chatter (seeded RNG is the point here; fedsparse's client silences the same).
_QUIET = ("Secure RNG turned off", "Optimal order is the largest alpha", "Full backward hook")


@dataclass(frozen=True, kw_only=True)
class StockConfig:
    """The app's run config (field ``x_y`` is key ``x-y`` of ``[tool.flwr.app.config]``)."""

    num_rounds: int = 5
    min_nodes: int = 2  # FedAvg's min_available_nodes and min_train_nodes
    round_timeout: float = 600.0
    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.25
    # privacy: a fixed sigma (no calibration), as in Flower's examples/opacus
    noise_multiplier: float = 1.0
    max_grad_norm: float = 1.0
    delta: float = 1e-5
    #: Opacus's epsilon after each round, as Flower's examples/opacus reports it (fedsparse's
    #: client reports its epsilon every round too); false measures the framework without it.
    report_epsilon: bool = True
    dataset: DatasetName = "digits"
    partitioner: PartitionerName = "iid"
    dirichlet_alpha: float = 0.5
    seed: int = 0
    out_dir: str = ""

    def __post_init__(self) -> None:
        for name in ("num_rounds", "min_nodes", "local_epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{_key(name)}={getattr(self, name)}: expected >= 1")
        for name in ("lr", "max_grad_norm", "round_timeout"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{_key(name)}={value}: expected finite > 0")
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
            raise ValueError(f"noise-multiplier={self.noise_multiplier}: expected finite >= 0")
        if not 0 < self.delta < 1:
            raise ValueError(f"delta={self.delta}: expected 0 < delta < 1")
        if self.dataset not in DATASET_NAMES:
            raise ValueError(f"dataset={self.dataset!r}: expected one of {DATASET_NAMES}")
        if self.partitioner not in PARTITIONER_NAMES:
            raise ValueError(
                f"partitioner={self.partitioner!r}: expected one of {PARTITIONER_NAMES}"
            )

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> StockConfig:
        """Parses Flower's run config; unknown keys are an error naming the key."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in run_config.items():
            name = key.replace("-", "_")
            if name not in fields:
                raise ValueError(f"run config key {key!r} is unknown")
            kind: Any = type(fields[name].default)
            if kind is bool and isinstance(value, str):  # ``--run-config`` gives TOML values
                value = {"true": True, "false": False}.get(value.lower(), value)
            if kind is bool and not isinstance(value, bool):
                raise ValueError(f"{key}={value!r}: expected true or false")
            kwargs[name] = value if kind in (str, bool) else kind(value)
        return cls(**kwargs)

    def to_run_config(self) -> dict[str, Any]:
        """The dashed-key mapping (what ``[tool.flwr.app.config]`` holds)."""
        return {_key(k): v for k, v in dataclasses.asdict(self).items()}


def _key(name: str) -> str:
    return name.replace("_", "-")


@functools.lru_cache(maxsize=4)
def _dataset(name: DatasetName, seed: int) -> tuple[Split, Split]:
    return load_dataset(name, seed=seed)


@functools.lru_cache(maxsize=4)
def _partitions(
    name: DatasetName, seed: int, num_partitions: int, partitioner: PartitionerName, alpha: float
) -> tuple[np.ndarray, ...]:
    train, _ = _dataset(name, seed)
    labels = train.y.numpy()
    return tuple(
        partition_indices(
            labels,
            num_partitions=num_partitions,
            partitioner=partitioner,
            alpha=alpha,
            seed=seed,
        )
    )


def load_partition(cfg: StockConfig, partition_id: int, num_partitions: int) -> Split:
    """This node's training partition: fedsparse's (cached per process, as fedsparse does)."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(
            f"partition-id={partition_id}: expected 0 <= id < num-partitions={num_partitions}"
        )
    train, _ = _dataset(cfg.dataset, cfg.seed)
    parts = _partitions(cfg.dataset, cfg.seed, num_partitions, cfg.partitioner, cfg.dirichlet_alpha)
    idx = torch.from_numpy(parts[partition_id])
    return Split(x=train.x[idx], y=train.y[idx])


def test_split(cfg: StockConfig) -> Split:
    """The held-out test split the server evaluates each new model on."""
    return _dataset(cfg.dataset, cfg.seed)[1]


def build_net(cfg: StockConfig) -> nn.Module:
    """The dataset's default fedsparse model, initialised from the run's seed."""
    return build_model(DEFAULT_MODELS[cfg.dataset], seed=cfg.seed)


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    """What one round of local training did."""

    steps: int  # optimizer steps (Poisson batches, empty ones included)
    examples: int  # examples in those batches
    loss: float  # mean training loss per example (nan if no example)
    epsilon: float  # Opacus's epsilon of this round's steps at ``delta`` (nan: not asked)


def train_dp(
    net: nn.Module,
    data: Split,
    *,
    cfg: StockConfig,
    server_round: int,
    partition_id: int,
) -> TrainResult:
    """``local-epochs`` of plain Opacus DP-SGD on ``data``; trains ``net`` in place.

    ``PrivacyEngine.make_private`` with a fixed ``noise-multiplier``, Poisson sampling at
    rate 1 / ceil(n / batch-size) and SGD without momentum, as fedsparse's client does. The
    batches and noise come from fedsparse's seed streams of (seed, round, partition).
    """
    seed = client_train_seed(cfg.seed, server_round, partition_id)
    loader = DataLoader(
        TensorDataset(data.x, data.y),
        batch_size=min(cfg.batch_size, len(data)),
        generator=torch.Generator().manual_seed(stream_seed(seed, Stream.POISSON_SAMPLING)),
    )
    optimizer = torch.optim.SGD(net.parameters(), lr=cfg.lr, momentum=0.0)
    with warnings.catch_warnings():
        for text in _QUIET:
            warnings.filterwarnings("ignore", message=text)
        engine = PrivacyEngine(accountant="rdp")
        module, optimizer, loader = engine.make_private(
            module=net,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=cfg.noise_multiplier,
            max_grad_norm=cfg.max_grad_norm,
            noise_generator=torch.Generator().manual_seed(stream_seed(seed, Stream.DP_NOISE)),
        )
        module.train()
        criterion = nn.CrossEntropyLoss()
        steps, examples, total = 0, 0, 0.0
        for _ in range(cfg.local_epochs):
            for xb, yb in loader:
                optimizer.zero_grad(set_to_none=True)
                loss = criterion(module(xb), yb)
                loss.backward()
                optimizer.step()
                steps += 1
                if len(xb):
                    total += float(loss.detach()) * len(xb)
                    examples += len(xb)
        epsilon = math.nan
        if cfg.report_epsilon:
            epsilon = engine.get_epsilon(cfg.delta) if cfg.noise_multiplier > 0 else math.inf
    return TrainResult(
        steps=steps,
        examples=examples,
        loss=total / examples if examples else math.nan,
        epsilon=float(epsilon),
    )
