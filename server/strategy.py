"""``SparseFedAvg``: sparse-aware FedAvg with seed-shared masks, as a Flower ``Strategy``.

It implements Flower 1.39's ``flwr.serverapp.strategy.Strategy`` interface, so it can be
swapped like any Flower strategy and driven by Flower's own ``Strategy.start`` loop; the
fedsparse ServerApp drives the same two methods from its round loop (``server/loop.py``) to
add centralized evaluation, run records and checkpoints.

* ``configure_train`` computes the round's rate from the schedule and ``keep``, the round's
  mask seed (``protocol.round_seed``), samples clients (``Stream.CLIENT_SELECTION``), and
  builds one ``TrainInstruction`` per client whose ``model`` is what that node is missing of
  the global model (``DownlinkCache``; each distinct payload is encoded once a round and
  shared by the nodes that need it). The global model travels as an ``ArrayRecord`` with
  one flat float32 array ``"flat"`` between the strategy and its caller.
* ``aggregate_train`` survives its clients, in this order: (1) every reply is validated
  (``server/validation.py``; a bad reply, a reply from a node not selected and a second reply
  are dropped with their reason; selected nodes without a reply are counted missing); (2) the
  round's norm bound, the smallest of ``max-norm-ratio`` x the median norm of the valid
  updates (from 3 on), ``max-update-norm`` and ``dp-norm-bound`` (the largest norm an honest
  client's public DP parameters allow, ``common/aggregation/robust.py: HonestClientBound``: it
  needs no
  honest majority, so it bounds rounds of one or two updates too), rejects or clips each
  update above it (``norm-action``; ``RoundStats.norm_bound``/``norm_bound_how``); (3) the rest
  are aggregated with weight 1 each (``weighting="uniform"``) or their claimed example counts,
  by ``SparseAggregator`` (per-coordinate weighted mean over the clients covering it; equal to
  FedAvg under one shared mask) or a coordinate-wise trimmed mean / median (``aggregator``);
  (4) a new model with a non-finite value is refused. A round that changes nothing is failed
  (``RoundStats.failure``) and ``max-failed-rounds`` of them in a row raise
  ``FederationFailed``. It returns the new global model and the round's numbers as a
  ``MetricRecord``; ``last_round`` keeps them typed, with the reasons (strings do not fit a
  ``MetricRecord``).

``state_dict``/``load_state_dict`` carry what a resumed run needs of the strategy (the
client-sampling generator, the clients' last epsilons, the failed rounds in a row) through
the checkpoint (``server/checkpoint.py``); a resumed run's train messages also carry
``resumed-from``, the checkpoint's round (``client/state.py``).

Where Flower's interface does not reach: the strategy needs the previous global model to
apply a sparse mean (coordinates no client covered stay as they were), so it keeps the model
it was configured with; and client-side evaluation is not used (``configure_evaluate`` sends
nothing): clients hold only private training data, and the server evaluates centrally.
"""

from __future__ import annotations

import functools
import hashlib
import math
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedsparse.common.aggregation.robust import HonestClientBound, clip_to_norm, l2_norm
from fedsparse.common.aggregation.sparse import make_aggregator
from fedsparse.common.config import FederatedConfig
from fedsparse.common.data.datasets import load_eval_splits
from fedsparse.common.dp.accounting import compute_epsilon_of_history
from fedsparse.common.dp.central import (
    central_aggregate,
    central_noise_generator,
    poisson_sample,
    user_sample_rate,
)
from fedsparse.common.layout import ParamLayout
from fedsparse.common.masks import sample_mask
from fedsparse.common.seeds import Stream, stream_seed
from fedsparse.common.wire.payload.indices import indices_to_bytes
from fedsparse.common.wire.protocol import TrainInstruction, client_mask_seed, round_seed
from fedsparse.common.wire.run_log import NoiseOrigin, epsilon_stats, round_noise
from fedsparse.server.downlink import DownlinkCache
from fedsparse.server.messages import message_bytes, train_message
from fedsparse.server.validation import RejectedReply, ValidUpdate, check_reply

__all__ = [
    "ARRAY_KEY",
    "FederationFailed",
    "RoundStats",
    "SparseFedAvg",
    "flat_array",
    "flat_tensor",
]

#: The key of the flat global model in the strategy's ``ArrayRecord``.
ARRAY_KEY = "flat"

#: Rejection reasons quoted in ``FederationFailed``'s message.
_REASONS_SHOWN = 5


class FederationFailed(RuntimeError):
    """``max-failed-rounds`` rounds in a row accepted no update: the run cannot go on."""


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
    #: the L2 bound the round's updates were held to (inf: none, or no valid update) and how
    #: it was set (``NormBound.bound``: "dp-norm-bound=...", "max-norm-ratio=...", ...)
    norm_bound: float = math.inf
    norm_bound_how: str = ""

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


@dataclass(frozen=True)
class _Candidate:
    """A reply that passed validation, before the norm bound."""

    node: int
    valid: ValidUpdate
    values: torch.Tensor  # the update's values (clipped, if the bound scaled it down)
    norm: float  # L2 norm of the values as received


def _canonical(candidate: _Candidate) -> bytes:
    """A key that orders updates by content alone (not by node id or arrival)."""
    return hashlib.sha256(candidate.values.numpy().tobytes()).digest()


class SparseFedAvg(Strategy):
    """Sparse-aware FedAvg over values-only updates on seed-shared masks.

    Args:
        cfg: the run's configuration (schedule, codec, sampling, local hyperparameters).
        num_parameters: ``d``, the flat model size.
        train_examples: the size of the training split the clients' partitions come from,
            the most examples an honest client holds (``dp-norm-bound``). None: the split
            is loaded (once per process) when the bound is first needed, unless
            ``max-client-examples`` > 0 replaces it.
    """

    def __init__(
        self,
        cfg: FederatedConfig,
        *,
        num_parameters: int,
        frozen_prefix: int = 0,
        layout: ParamLayout | None = None,
        train_examples: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.d = num_parameters
        self._train_examples = train_examples
        # dp-norm-bound's caps, resolved on first use (honest_bound); None: it does not apply
        self._honest: HonestClientBound | None = None
        self._honest_resolved = False
        self._honest_how = ""  # the last DP-derived bound logged
        self.layout = layout  # the model's layers (dpssgd selects per layer)
        # The run's method (common/methods/): the round's plan, and its state between rounds.
        self.method = cfg.make_method()
        # lf: the coordinates of the first freeze-layers layers (frozen from round
        # freeze-after + 1 on); 0 for the methods that freeze nothing.
        self.frozen_prefix = self.method.accept_frozen_prefix(frozen_prefix, num_parameters)
        self.schedule = cfg.sparsity().rate_schedule(cfg.num_rounds)
        self.downlink = DownlinkCache(codec=cfg.codec, compression=cfg.compression)
        self._rng = np.random.default_rng(stream_seed(cfg.seed, Stream.CLIENT_SELECTION))
        self.norm_bound = cfg.norm_bound()
        self._epsilons: dict[int, float] = {}
        self._weights: torch.Tensor | None = None
        self._failed_in_a_row: list[int] = []  # rounds
        self.last_round: RoundStats | None = None
        self.resumed_from = 0  # the checkpoint round a resumed run continues (0: not resumed)
        # dp-level=user (common/dp/central.py): the users' sampling rate of the round being
        # run, the accountant history of the rounds so far, and the server's noise stream.
        self.user_level = cfg.dp_level == "user"
        self._user_rate = 1.0
        self._user_expected = float(cfg.clients_per_round)  # DP-FedAvg's fixed denominator
        self._user_history: list[tuple[float, float, int]] = []
        self._central_gen = central_noise_generator(
            cfg.central_noise, seed=stream_seed(cfg.seed, Stream.CENTRAL_NOISE)
        )
        # Which users join a round must be as secret as the noise (the accountant's
        # amplification by subsampling assumes it): OS entropy unless the noise is seeded.
        self._user_rng = (
            np.random.default_rng(secrets.randbits(63))
            if cfg.central_noise == "fresh"
            else np.random.default_rng(stream_seed(cfg.seed, Stream.CENTRAL_NOISE, 1))
        )

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs of this strategy to continue exactly (plain values).

        The client-sampling generator runs through the rounds, so its state is kept; the
        downlink cache is not (see ``server/checkpoint.py``).
        """
        state: dict[str, Any] = {
            "sampling-rng": self._rng.bit_generator.state,
            "epsilons": dict(self._epsilons),
            "failed-in-a-row": list(self._failed_in_a_row),
        }
        # ranked: what the next round ranks; dpssgd: the selection (freeze keeps it)
        state.update(self.method.state_dict())
        if self.user_level:  # dp-level=user: the rounds accounted (the noise stays secret)
            state["user-history"] = [list(entry) for entry in self._user_history]
            if self.cfg.central_noise == "seeded":  # a resumed run continues the streams
                state["central-noise-state"] = self._central_gen.get_state()
                state["user-sampling-rng"] = self._user_rng.bit_generator.state
        return state

    def load_state_dict(self, state: Mapping[str, Any], *, resumed_from: int) -> None:
        """Restores ``state_dict()`` of the run being resumed at checkpoint ``resumed_from``.

        Raises:
            ValueError: ``state`` is not what ``state_dict`` writes (the key is named).
        """
        try:
            rng = np.random.default_rng()
            rng.bit_generator.state = state["sampling-rng"]
            epsilons = {int(k): float(v) for k, v in dict(state["epsilons"]).items()}
            failed = [int(r) for r in state["failed-in-a-row"]]
            self.method.check_state(state, numel=self.d)
            user_history = [
                (float(s), float(q), int(n)) for s, q, n in state.get("user-history", [])
            ]
            central_state = state.get("central-noise-state")
            user_sampling = state.get("user-sampling-rng")
        except KeyError as err:
            raise ValueError(f"strategy state: missing key {err}") from None
        except (TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"strategy state: {type(err).__name__}: {err}") from None
        self._rng = rng
        self._epsilons = epsilons
        self._failed_in_a_row = failed
        self.method.load_state_dict(state)
        self._user_history = user_history
        if central_state is not None:
            self._central_gen.set_state(central_state)
        if user_sampling is not None:
            self._user_rng.bit_generator.state = user_sampling
        self.resumed_from = resumed_from

    def drop_absent_nodes(self, nodes: Iterable[int]) -> None:
        """Forgets the epsilons of nodes not in ``nodes`` (the ones connected now).

        A restarted simulation names its nodes anew: a stale id would count twice.
        """
        connected = set(nodes)
        self._epsilons = {n: eps for n, eps in self._epsilons.items() if n in connected}

    def honest_bound(self) -> HonestClientBound | None:
        """``dp-norm-bound``'s public caps for this run (None: off, or it does not apply).

        Resolved once: the worst-case sigma, and the most examples a client holds
        (``max-client-examples``, else ``train_examples``, else the training split's size).

        Raises:
            ValueError: the training split does not load (the message says what to set
                instead), or the target epsilon is out of reach.
        """
        if not self._honest_resolved:
            cfg = self.cfg
            caps = None
            if cfg.dp_norm_bound_applies:
                examples = cfg.max_client_examples or self._train_examples
                caps = cfg.honest_client_bound(examples or _train_split_size(cfg))
            self._honest, self._honest_resolved = caps, True
        return self._honest

    def _noise_keep(self, stats: RoundStats) -> int:
        """How many coordinates each DP step's noise covers this round (``Method.noise_keep``:
        the round's ``keep``; under gip/random-k, ``keep_count`` per group)."""
        return self.method.noise_keep(self.d, keep=stats.keep, rate=stats.rate)

    def _derived_bound(self, stats: RoundStats) -> tuple[float, str] | None:
        """This round's ``dp-norm-bound`` and its description (None: it does not apply)."""
        caps = self.honest_bound()
        if caps is None:
            return None
        keep = self._noise_keep(stats)
        # gip, random-k: the payload holds the union of the steps' supports, up to d values
        bound = caps.bound(keep, sent=self.d if self.method.selects_per_step else None)
        how = (
            f"dp-norm-bound={bound:.4g}: sigma<={caps.noise_multiplier:.4g}, <={caps.max_steps} "
            f"steps, keep {keep}, clients of >={caps.smallest_covered_examples(keep)} of "
            f"<={caps.max_examples} examples"
        )
        return bound, how

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
        log(
            INFO,
            "SparseFedAvg: weighting=%s, aggregator=%s (trim-fraction %g), %s (%s), "
            "max-failed-rounds=%d",
            cfg.weighting,
            cfg.aggregator,
            cfg.trim_fraction,
            self.norm_bound,
            cfg.norm_action,
            cfg.max_failed_rounds,
        )
        caps = None if self.user_level else self.honest_bound()
        if caps is not None:
            log(
                INFO,
                "SparseFedAvg: dp-norm-bound=auto: lr %g, momentum %g, max-grad-norm %g, "
                "sigma <= %.4g, <= %d steps a round (batch-size %d, <= %d examples a client), "
                "value-dtype %s: %.4g at keep=d",
                caps.lr,
                caps.momentum,
                caps.max_grad_norm,
                caps.noise_multiplier,
                caps.max_steps,
                caps.batch_size,
                caps.max_examples,
                caps.value_dtype,
                caps.bound(self.d),
            )

    def frozen_at(self, server_round: int) -> int:
        """The frozen coordinate prefix of ``server_round`` (lf; else 0)."""
        return self.method.frozen_at(server_round - 1, self.frozen_prefix)

    def _sample(self, grid: Grid) -> list[int]:
        nodes = sorted(grid.get_node_ids())
        if self.user_level:  # Poisson sampling of users: the accountant's subsampling
            self._user_rate = user_sample_rate(self.cfg.clients_per_round, len(nodes))
            return poisson_sample(nodes, self._user_rate, self._user_rng)
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
        plan = self.method.plan_round(
            server_round=server_round,
            weights=weights,
            schedule=self.schedule,
            frozen=self.frozen_at(server_round),
            layout=self.layout,
            seed=cfg.seed,
        )
        keep = plan.keep
        support_bytes = (
            b""
            if plan.support is None
            else indices_to_bytes(plan.support.numpy(), "bitmap", self.d)
        )
        stats = RoundStats(
            server_round=server_round,
            rate=plan.rate,
            keep=keep,
            mask_seed=round_seed(cfg.seed, server_round),
            selected=self._sample(grid),
            started=started,
            started_at=started_at,
            frozen=plan.frozen,
            explicit=plan.support,
            client_support=self.method.selects_per_step,
        )
        self.last_round = stats
        version = server_round - 1
        messages = []
        payloads = self.downlink.payloads(
            stats.selected, weights, version=version, server_round=server_round
        )
        for node in stats.selected:
            payload, base = payloads[node]
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
            message = train_message(
                instruction, node=node, resumed_from=self.resumed_from, support=support_bytes
            )
            messages.append(message)
            stats.downlink_payload_bytes += len(payload) + len(support_bytes)
            stats.downlink_message_bytes += message_bytes(message)
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validates the replies, bounds their norms, aggregates; returns (model, numbers).

        Raises:
            FederationFailed: this is the ``max-failed-rounds``-th failed round in a row
                (``last_round`` holds the round's numbers; the model is unchanged).
        """
        stats, weights = self.last_round, self._weights
        if stats is None or weights is None or stats.server_round != server_round:
            raise RuntimeError(f"aggregate_train({server_round}) without configure_train")
        accepted = self._validate(stats, replies)
        if not self.user_level:  # dp-level=user: the central clip bounds every update
            accepted = self._bound_norms(stats, accepted)
        # Replies arrive in any order and node ids differ between runs: a canonical order
        # (by content) makes the float sums, and so the model, independent of both.
        accepted.sort(key=_canonical)
        self._round_numbers(stats, accepted)
        if self.user_level:
            new_weights, touched = self._aggregate_central(stats, weights, accepted)
        else:
            new_weights, touched = self._aggregate(stats, weights, accepted)
        for reason in stats.rejected:
            log(WARNING, "round %d: dropped %s", server_round, reason)
        for reason in stats.clipped:
            log(WARNING, "round %d: clipped %s", server_round, reason)
        seeded = (
            self.cfg.mask_scope == "round"
            and stats.keep < self.d
            and not stats.frozen
            and stats.explicit is None
            and not stats.client_support
            and not stats.failed
        )
        if not stats.failed:  # ranked: the aggregate the next round ranks
            self.method.after_round(before=weights, after=new_weights, touched=touched)
        self.downlink.record_version(
            server_round, touched, seeded=(stats.mask_seed, stats.keep) if seeded else None
        )
        self._count_failures(stats)
        return flat_array(new_weights), stats.metrics()

    def _validate(self, stats: RoundStats, replies: Iterable[Message]) -> list[_Candidate]:
        """The replies that pass ``check_reply``; counts replies, errors and missing nodes."""
        cfg, d, keep = self.cfg, self.d, stats.keep
        version = stats.server_round - 1
        selected, seen = set(stats.selected), set()
        candidates = []
        round_support = None  # the round's shared mask (mask-scope=round), sampled once
        for reply in replies:
            node = int(reply.metadata.src_node_id)
            if node == SUPERLINK_NODE_ID and reply.has_error() and node not in selected:
                # The SuperLink's word that a node went away (heartbeat lapsed): no client's
                # reply; the node stays counted as missing.
                log(INFO, "round %d: SuperLink: %s", stats.server_round, reply.error.reason)
                continue
            stats.num_replies += 1
            if node not in selected or node in seen:
                why = "a second reply" if node in seen else "a reply from an unselected node"
                stats.rejected.append(f"node {node}: {why} this round")
                continue
            seen.add(node)
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
            frozen = stats.frozen
            # lf: [frozen, d) dense; ranked, dpssgd: the keep values of the sent support
            explicit = stats.explicit is not None
            sub = d - frozen if not explicit else keep
            seeded = keep < d and not frozen and not explicit and not stats.client_support
            if round_support is None and cfg.mask_scope == "round" and seeded:
                round_support = torch.nonzero(sample_mask(d, keep=keep, seed=scope_seed)).flatten()
            try:
                # lf: the values of the unfrozen coordinates [frozen, d), dense.
                valid = check_reply(
                    reply,
                    d=sub,
                    server_round=stats.server_round,
                    expected_seed=scope_seed if seeded else None,
                    keep=keep,
                    codec=cfg.codec,
                    value_dtype=cfg.value_dtype,
                    value_block=cfg.value_block,
                    compression=cfg.compression,
                    weighting=cfg.weighting,
                    mask_support=round_support if cfg.mask_scope == "round" else None,
                    client_support=stats.client_support,
                )
            except RejectedReply as err:
                stats.rejected.append(f"node {node}: {err}")
                continue
            if frozen:
                valid = replace(valid, support=torch.arange(frozen, d, dtype=torch.int64))
            elif stats.explicit is not None:
                valid = replace(valid, support=stats.explicit)
            # A valid reply counts (payload bytes, epsilon) even if the norm bound drops it.
            stats.uplink_payload_bytes += valid.payload_bytes
            self._epsilons[node] = valid.reply.epsilon
            if cfg.save_updates:
                stats.updates[node] = valid.reply.update
            candidates.append(_Candidate(node, valid, valid.values, l2_norm(valid.values)))
        stats.missing = len(selected - seen)
        return candidates

    def _bound_norms(self, stats: RoundStats, candidates: list[_Candidate]) -> list[_Candidate]:
        """The candidates within the round's norm bound; the others rejected or clipped."""
        if not candidates:
            return []
        derived = self._derived_bound(stats)
        if derived is not None and derived[1] != self._honest_how:
            log(INFO, "round %d: %s", stats.server_round, derived[1])
            self._honest_how = derived[1]
        bound, how = self.norm_bound.bound([c.norm for c in candidates], honest=derived)
        stats.norm_bound, stats.norm_bound_how = bound, how
        kept = []
        for candidate in candidates:
            if candidate.norm <= bound:
                kept.append(candidate)
                continue
            reason = f"node {candidate.node}: update norm={candidate.norm:.4g}: expected <= "
            reason += f"{bound:.4g} ({how})"
            if self.cfg.norm_action == "reject":
                stats.rejected.append(reason)
                continue
            stats.clipped.append(reason)
            kept.append(replace(candidate, values=clip_to_norm(candidate.values, bound=bound)))
        return kept

    def _round_numbers(self, stats: RoundStats, accepted: list[_Candidate]) -> None:
        """Train loss and noise origin of the accepted updates; epsilons of the valid replies."""
        weighted = [(c.valid.reply.train_loss, c.valid.weight) for c in accepted]
        total = sum(w for _, w in weighted)
        stats.train_loss = sum(loss * w for loss, w in weighted) / total if total else math.nan
        stats.epsilon_max, stats.epsilon_median = epsilon_stats(list(self._epsilons.values()))
        stats.noise = round_noise([c.valid.reply.seeded_noise for c in accepted])

    def _aggregate(
        self, stats: RoundStats, weights: torch.Tensor, accepted: list[_Candidate]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the new global model, the coordinates that changed); the old one if it failed."""
        cfg, d = self.cfg, self.d
        unchanged = torch.zeros(d, dtype=torch.bool)
        aggregator = make_aggregator(cfg.aggregator, d, trim_fraction=cfg.trim_fraction)
        for candidate in accepted:
            try:
                aggregator.add(
                    candidate.values, support=candidate.valid.support, weight=candidate.valid.weight
                )
            except ValueError as err:  # checked already: only a bug lands here
                stats.rejected.append(f"node {candidate.node}: {err}")
        stats.accepted = aggregator.num_updates
        if not stats.accepted:
            stats.failure = (
                f"no update accepted ({len(stats.selected)} selected: "
                f"{len(stats.rejected)} rejected, {stats.missing} missing)"
            )
            return weights, unchanged
        new_weights = weights.clone()
        touched = aggregator.apply_(new_weights)
        bad = int((~torch.isfinite(new_weights)).sum())
        if bad:
            stats.failure = f"aggregate: {bad} non-finite model values (update refused)"
            return weights, unchanged
        return new_weights, touched

    def _round_support(self, stats: RoundStats) -> torch.Tensor | None:
        """The round's public support (int64 indices; None: every coordinate)."""
        if stats.explicit is not None:
            return stats.explicit
        if stats.frozen:
            return torch.arange(stats.frozen, self.d, dtype=torch.int64)
        if stats.keep < self.d:
            return torch.nonzero(sample_mask(self.d, keep=stats.keep, seed=stats.mask_seed))[:, 0]
        return None

    def _aggregate_central(
        self, stats: RoundStats, weights: torch.Tensor, accepted: list[_Candidate]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """dp-level=user: DP-FedAvg's clipped sum plus noise over q N (``central_dp.py``).

        Every round is accounted, whether or not anyone answered (conservative)."""
        cfg = self.cfg
        entry = (cfg.central_noise_multiplier, self._user_rate, 1)
        if self._user_history and self._user_history[-1][:2] == entry[:2]:
            sigma, rate, rounds = self._user_history[-1]
            self._user_history[-1] = (sigma, rate, rounds + 1)
        else:
            self._user_history.append(entry)
        stats.user_epsilon = (
            math.inf
            if cfg.central_noise_multiplier == 0
            else compute_epsilon_of_history(
                self._user_history, delta=cfg.delta, accountant=cfg.accountant
            )
        )
        stats.accepted = len(accepted)
        if stats.selected and not accepted:  # counted, but the round still releases noise
            stats.failure = (
                f"no update accepted ({len(stats.selected)} selected: "
                f"{len(stats.rejected)} rejected, {stats.missing} missing); the noise was "
                "released all the same (the accounted mechanism)"
            )
        # Always the mechanism's output, w + (sum + z) / (q N), even with nobody sampled or
        # nothing accepted: releasing w unchanged would not be the subsampled Gaussian.
        return central_aggregate(
            weights,
            [(c.values, c.valid.support) for c in accepted],
            support=self._round_support(stats),
            clip=cfg.central_clip,
            noise_multiplier=cfg.central_noise_multiplier,
            expected_users=self._user_expected,
            generator=self._central_gen,
            secure=cfg.secure_mode,
        )

    def _count_failures(self, stats: RoundStats) -> None:
        """Counts failed rounds in a row; raises ``FederationFailed`` at ``max-failed-rounds``."""
        if not stats.failed:
            self._failed_in_a_row = []
            return
        log(WARNING, "round %d failed: %s", stats.server_round, stats.failure)
        self._failed_in_a_row.append(stats.server_round)
        limit = self.cfg.max_failed_rounds
        if limit and len(self._failed_in_a_row) >= limit:
            first, last = self._failed_in_a_row[0], self._failed_in_a_row[-1]
            reasons = "; ".join(stats.rejected[:_REASONS_SHOWN]) or "none"
            if len(stats.rejected) > _REASONS_SHOWN:
                reasons += f"; ... ({len(stats.rejected) - _REASONS_SHOWN} more)"
            raise FederationFailed(
                f"max-failed-rounds={limit}: rounds {first} to {last} failed in a row, the model "
                f"is unchanged since round {first - 1}; round {last}: {stats.failure}; "
                f"its rejections: {reasons}"
            )

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


@functools.lru_cache(maxsize=8)
def _split_size(dataset: str, data_dir: str, seed: int, eval_split: str, split_seed: int) -> int:
    train, _ = load_eval_splits(
        dataset,  # type: ignore[arg-type]
        data_dir=data_dir or None,
        seed=seed,
        eval_split=eval_split,  # type: ignore[arg-type]
        split_seed=split_seed,
    )
    return len(train)


def _train_split_size(cfg: FederatedConfig) -> int:
    """The size of the whole training split (a validation slice held out or not: a deployed
    node may declare all of it).

    Raises:
        ValueError: it does not load; the message names the keys that replace it.
    """
    try:
        return _split_size(cfg.dataset, cfg.data_dir, cfg.seed, "test", cfg.data_seed)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"dp-norm-bound='auto' needs the most examples a client holds: dataset="
            f"{cfg.dataset!r} data-dir={cfg.data_dir!r} did not load ({err}); set "
            "max-client-examples, or dp-norm-bound='off'"
        ) from err
