"""``RoundStats``: what one round of training did (plan, bytes, replies, privacy), and
``FederationFailed``, raised when too many rounds in a row changed nothing; ``UserLevel``,
``dp-level=user``'s plan across rounds (the users' rate, DP-FedAvg's denominator, the rounds
accounted), which the round in the clear and the secure round both read and extend.

``SparseFedAvg`` (``server/strategy.py``) fills a ``RoundStats`` from ``configure_train`` to
``aggregate_train``; its numeric part is the ``MetricRecord`` Flower's ``Strategy`` returns, and
the round loop (``server/loop.py``) writes the rest to the run's records.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from flwr.app import MetricRecord

from fedsparse.common.wire.run_log import NoiseOrigin

__all__ = ["FederationFailed", "RoundStats", "UserLevel"]


class FederationFailed(RuntimeError):
    """``max-failed-rounds`` rounds in a row accepted no update: the run cannot go on."""


@dataclass
class UserLevel:
    """``dp-level=user`` across the run (``common/dp/central.py``).

    Attributes:
        expected: DP-FedAvg's fixed denominator, ``clients-per-round``.
        rate: the users' sampling rate of the round under way.
        history: the rounds accounted, the accountant's ``(sigma, rate, rounds)`` entries.
    """

    expected: float
    rate: float = 1.0
    history: list[tuple[float, float, int]] = field(default_factory=list)


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
    uplink_payload_bytes: int = 0  # of the replies that passed validation
    uplink_message_bytes: int = 0
    num_replies: int = 0
    answered: int = 0  # replies that were not client errors
    accepted: int = 0
    rejected: list[str] = field(default_factory=list)
    train_loss: float = math.nan  # weighted mean over accepted replies
    epsilon_max: float = 0.0
    epsilon_median: float = 0.0
    missing: int = 0  # selected nodes without a reply
    clipped: list[str] = field(default_factory=list)  # updates scaled down to the norm bound
    failure: str = ""  # why the model was left unchanged ("" if it was not)
    noise: NoiseOrigin = "none"  # the accepted updates' noise origin
    updates: dict[int, bytes] = field(default_factory=dict)  # save-updates: node -> payload
    #: the frozen coordinate prefix ``[0, frozen)`` (lf); replies carry ``[frozen, d)``
    frozen: int = 0
    #: the support the server chose (int64, increasing; ranked, dpssgd); replies carry its
    #: values
    explicit: torch.Tensor | None = None
    #: each reply carries its own support (the union of its DP steps' supports: gip,
    #: random-k), explicitly
    client_support: bool = False
    #: dp-level=user: the run's user-level epsilon after this round (None: sample-level run)
    user_epsilon: float | None = None
    #: the smallest and largest sigma the accepted updates' accountants calibrated (None: no
    #: accepted update, or a mechanism other than dpsgd)
    noise_multiplier_min: float | None = None
    noise_multiplier_max: float | None = None
    #: the L2 bound the round's updates were held to (inf: none, or no valid update) and how
    #: it was set (``NormBound.bound``: "dp-norm-bound=...", "max-norm-ratio=...", ...)
    norm_bound: float = math.inf
    norm_bound_how: str = ""
    #: secure-aggregation=true: the central epsilon at rate 1 and each stage's payload bytes
    #: (``RoundLog.central_epsilon``, ``secagg_bytes``)
    central_epsilon: float | None = None
    secagg_bytes: dict[str, dict[str, int]] | None = None
    #: dp-level=user: the sigma of the round's central noise (``RoundLog``'s field)
    central_noise_multiplier: float | None = None

    @property
    def failed(self) -> bool:
        """No update accepted, or the aggregate refused: the model did not change."""
        return bool(self.failure)

    def metrics(self) -> MetricRecord:
        """The numeric part, as Flower's ``Strategy.aggregate_train`` returns it."""
        return MetricRecord(
            {
                "rate": self.rate,
                "keep": self.keep,
                "num-clients": len(self.selected),
                "num-replies": self.num_replies,
                "num-rejected": len(self.rejected),
                "num-missing": self.missing,
                "num-accepted": self.accepted,
                "num-clipped": len(self.clipped),
                "norm-bound": self.norm_bound,
                "failed": int(self.failed),
                "train-loss": self.train_loss,
                "epsilon-max": self.epsilon_max,
                "epsilon-median": self.epsilon_median,
                "uplink-payload-bytes": self.uplink_payload_bytes,
                "uplink-message-bytes": self.uplink_message_bytes,
                "downlink-payload-bytes": self.downlink_payload_bytes,
                "downlink-message-bytes": self.downlink_message_bytes,
            }
        )
