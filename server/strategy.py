"""``SparseFedAvg``: sparse-aware FedAvg with seed-shared masks, as a Flower ``Strategy``.

It implements Flower 1.39's ``flwr.serverapp.strategy.Strategy`` interface, so it can be
swapped like any Flower strategy and driven by Flower's own ``Strategy.start`` loop; the
fedsparse ServerApp drives the same two methods from its round loop (``server/loop.py``) to
add centralized evaluation, run records and checkpoints.

* ``configure_train`` computes the round's rate from the schedule and ``keep``, the round's
  mask seed (``protocol.round_seed``), samples clients (``Stream.CLIENT_SELECTION``), and
  builds one ``TrainInstruction`` per client whose ``model`` is what that node is missing of
  the global model (``DownlinkCache``). The global model travels as an ``ArrayRecord`` with
  one flat float32 array ``"flat"`` between the strategy and its caller.
* ``aggregate_train`` validates every reply (``server/validation.py``; a bad reply is dropped
  with its reason, never aggregated), applies ``SparseAggregator`` (per-coordinate weighted
  mean over the clients covering it; equal to FedAvg under one shared mask), and returns the
  new global model and the round's numbers as a ``MetricRecord``. ``last_round`` keeps the
  same numbers typed, plus the rejection reasons (strings do not fit a ``MetricRecord``).

Where Flower's interface does not reach: the strategy needs the previous global model to
apply a sparse mean (coordinates no client covered stay as they were), so it keeps the model
it was configured with; and client-side evaluation is not used (``configure_evaluate`` sends
nothing): clients hold only private training data, and the server evaluates centrally.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from logging import INFO, WARNING

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedsparse.common.aggregate import SparseAggregator
from fedsparse.common.config import FederatedConfig
from fedsparse.common.masks import keep_count
from fedsparse.common.protocol import TrainInstruction, client_mask_seed, round_seed
from fedsparse.common.seeds import Stream, stream_seed
from fedsparse.server.downlink import DownlinkCache
from fedsparse.server.messages import message_bytes, train_message
from fedsparse.server.validation import RejectedReply, check_reply

__all__ = ["ARRAY_KEY", "RoundStats", "SparseFedAvg", "flat_array", "flat_tensor"]

#: The key of the flat global model in the strategy's ``ArrayRecord``.
ARRAY_KEY = "flat"


def flat_array(weights: torch.Tensor) -> ArrayRecord:
    """The flat global model as the strategy's ``ArrayRecord``."""
    return ArrayRecord({ARRAY_KEY: Array(weights.detach().cpu().numpy())})


def flat_tensor(arrays: ArrayRecord) -> torch.Tensor:
    """The flat float32 global model held in ``arrays`` (a copy)."""
    return torch.from_numpy(np.array(arrays[ARRAY_KEY].numpy(), dtype=np.float32, copy=True))


@dataclass
class RoundStats:
    """What one round of training did: plan, bytes, replies, privacy."""

    server_round: int
    rate: float
    keep: int
    mask_seed: int
    selected: list[int]
    started: float  # perf_counter at configure_train
    started_at: float  # unix time at configure_train
    downlink_payload_bytes: int = 0
    downlink_message_bytes: int = 0
    uplink_payload_bytes: int = 0
    uplink_message_bytes: int = 0
    num_replies: int = 0
    answered: int = 0  # replies that were not client errors
    accepted: int = 0
    rejected: list[str] = field(default_factory=list)
    train_loss: float = math.nan  # weighted mean over accepted replies
    epsilon_max: float = 0.0
    epsilon_median: float = 0.0

    def metrics(self) -> MetricRecord:
        """The numeric part, as Flower's ``Strategy.aggregate_train`` returns it."""
        return MetricRecord(
            {
                "rate": self.rate,
                "keep": self.keep,
                "num-clients": len(self.selected),
                "num-replies": self.num_replies,
                "num-rejected": len(self.rejected),
                "train-loss": self.train_loss,
                "epsilon-max": self.epsilon_max,
                "epsilon-median": self.epsilon_median,
                "uplink-payload-bytes": self.uplink_payload_bytes,
                "uplink-message-bytes": self.uplink_message_bytes,
                "downlink-payload-bytes": self.downlink_payload_bytes,
                "downlink-message-bytes": self.downlink_message_bytes,
            }
        )


class SparseFedAvg(Strategy):
    """Sparse-aware FedAvg over values-only updates on seed-shared masks.

    Args:
        cfg: the run's configuration (schedule, codec, sampling, local hyperparameters).
        num_parameters: ``d``, the flat model size.
    """

    def __init__(self, cfg: FederatedConfig, *, num_parameters: int) -> None:
        self.cfg = cfg
        self.d = num_parameters
        self.schedule = cfg.sparsity().rate_schedule(cfg.num_rounds)
        self.downlink = DownlinkCache(codec=cfg.codec, compression=cfg.compression)
        self._rng = np.random.default_rng(stream_seed(cfg.seed, Stream.CLIENT_SELECTION))
        self._epsilons: dict[int, float] = {}
        self._weights: torch.Tensor | None = None
        self.last_round: RoundStats | None = None

    def summary(self) -> None:
        """Logs the strategy's configuration."""
        cfg = self.cfg
        log(
            INFO,
            "SparseFedAvg: d=%d, schedule=%s to r*=%.3f over %d rounds, mask-scope=%s, codec=%s",
            self.d,
            cfg.schedule,
            cfg.final_rate,
            cfg.num_rounds,
            cfg.mask_scope,
            cfg.codec,
        )

    def _sample(self, grid: Grid) -> list[int]:
        nodes = sorted(grid.get_node_ids())
        count = min(self.cfg.clients_per_round or len(nodes), len(nodes))
        # Sample positions, not ids: numpy would turn 64-bit node ids into floats.
        return sorted(
            nodes[int(i)] for i in self._rng.choice(len(nodes), size=count, replace=False)
        )

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One ``TrainInstruction`` per sampled client (``config`` is not used)."""
        started, started_at = time.perf_counter(), time.time()
        cfg = self.cfg
        weights = flat_tensor(arrays)
        if weights.numel() != self.d:
            raise ValueError(
                f"arrays[{ARRAY_KEY!r}] has {weights.numel()} values: expected {self.d}"
            )
        self._weights = weights
        rate = self.schedule.rate(server_round - 1)
        keep = keep_count(self.d, rate=rate)
        stats = RoundStats(
            server_round=server_round,
            rate=rate,
            keep=keep,
            mask_seed=round_seed(cfg.seed, server_round),
            selected=self._sample(grid),
            started=started,
            started_at=started_at,
        )
        self.last_round = stats
        version = server_round - 1
        messages = []
        for node in stats.selected:
            payload, base = self.downlink.payload(
                node, weights, version=version, server_round=server_round
            )
            instruction = TrainInstruction(
                server_round=server_round,
                num_rounds=cfg.num_rounds,
                mask_seed=stats.mask_seed,
                keep=keep,
                mask_scope=cfg.mask_scope,
                local_epochs=cfg.local_epochs,
                batch_size=cfg.batch_size,
                lr=cfg.lr,
                momentum=cfg.momentum,
                base_version=base,
                model_version=version,
                model=payload,
            )
            message = train_message(instruction, node=node)
            messages.append(message)
            stats.downlink_payload_bytes += len(payload)
            stats.downlink_message_bytes += message_bytes(message)
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validates the replies, aggregates the valid ones; returns (model, round numbers)."""
        stats, weights = self.last_round, self._weights
        if stats is None or weights is None or stats.server_round != server_round:
            raise RuntimeError(f"aggregate_train({server_round}) without configure_train")
        cfg, d, keep = self.cfg, self.d, stats.keep
        aggregator = SparseAggregator(d)
        losses: list[tuple[float, float]] = []
        version = server_round - 1
        for reply in replies:
            stats.num_replies += 1
            node = int(reply.metadata.src_node_id)
            if reply.has_error():
                self.downlink.forget(node)  # unknown state: dense next time
                stats.rejected.append(f"node {node}: client error: {reply.error.reason}")
                continue
            self.downlink.node_applied(node, version)  # it applied this round's downlink
            stats.answered += 1
            stats.uplink_message_bytes += message_bytes(reply)
            scope_seed = (
                stats.mask_seed
                if cfg.mask_scope == "round"
                else client_mask_seed(stats.mask_seed, node)
            )
            try:
                valid = check_reply(
                    reply,
                    d=d,
                    server_round=server_round,
                    expected_seed=None if keep == d else scope_seed,
                    keep=keep,
                    codec=cfg.codec,
                )
                aggregator.add(valid.values, support=valid.support, weight=valid.weight)
            except (RejectedReply, ValueError) as err:
                stats.rejected.append(f"node {node}: {err}")
                continue
            stats.accepted += 1
            stats.uplink_payload_bytes += valid.payload_bytes
            losses.append((valid.reply.train_loss, valid.weight))
            self._epsilons[node] = valid.reply.epsilon
        for reason in stats.rejected:
            log(WARNING, "round %d: dropped %s", server_round, reason)

        total = sum(w for _, w in losses)
        stats.train_loss = sum(loss * w for loss, w in losses) / total if total else math.nan
        epsilons = list(self._epsilons.values()) or [0.0]
        stats.epsilon_max = max(epsilons)
        stats.epsilon_median = float(statistics.median(epsilons))
        if aggregator.num_updates:
            touched = aggregator.apply_(weights)
        else:
            touched = torch.zeros(d, dtype=torch.bool)
        seeded = cfg.mask_scope == "round" and keep < d and aggregator.num_updates > 0
        self.downlink.record_version(
            server_round, touched, seeded=(stats.mask_seed, keep) if seeded else None
        )
        return flat_array(weights), stats.metrics()

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """No federated evaluation: clients hold only private training data (see module)."""
        return []

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Nothing to aggregate (``configure_evaluate`` sends nothing)."""
        return None
