"""``SparseFedAvg``: sparse-aware FedAvg with seed-shared masks, as a Flower ``Strategy``.

It implements Flower 1.39's ``Strategy`` interface, so it can be swapped like any Flower
strategy and driven by Flower's own ``Strategy.start`` loop; the fedsparse ServerApp drives
the same two methods from its loop (``server/loop.py``) to add evaluation, records, checkpoints.

* ``configure_train`` computes the round's rate from the schedule and ``keep``, the round's
  mask seed (``protocol.round_seed``), samples clients (``Stream.CLIENT_SELECTION``), and
  builds one ``TrainInstruction`` per client whose ``model`` is what that node is missing of
  the global model (``DownlinkCache``; each distinct payload is encoded once a round and
  shared by the nodes that need it). The global model travels as an ``ArrayRecord`` with
  one flat float32 array ``"flat"`` between the strategy and its caller.
* ``aggregate_train`` survives its clients, in this order: (1) every reply is validated
  (``server/round_updates.py``, ``server/validation.py``) as it is read; (2) the round's norm bound
  (``server/norm_bound.py``: the smallest of ``max-norm-ratio`` x the median norm,
  ``max-update-norm`` and ``dp-norm-bound``, which needs no honest majority) rejects or clips
  each update above it (``norm-action``); (3) the rest are aggregated (weight 1 each, or
  their claimed example counts: ``weighting``) by ``SparseAggregator`` or a coordinate-wise
  trimmed mean / median (``aggregator``), or under ``dp-level=user`` by DP-FedAvg's noisy
  clipped sum (``common/dp/central.py``); (4) a new model with a non-finite value is refused;
  (5) a lossy ``downlink-dtype`` moves it by the decoded change (``server/downlink.py``).
  The mean's sums are exact, so the model is the same in any order of arrival; without a
  rule over the round's own norms (``max-norm-ratio=0``) or ``dp-level=user``, each update
  is bounded and added as it is read, and the round holds none of the values (the robust
  aggregators keep theirs; each update's numbers and support are kept for the round's).
  A round that changes nothing is failed (``RoundStats.failure``) and ``max-failed-rounds``
  of them in a row raise ``FederationFailed``. It returns the new model and the round's
  numbers as a ``MetricRecord``; ``last_round`` keeps them typed, with the reasons.

``state_dict``/``load_state_dict`` carry what a resumed run needs of the strategy (the
client-sampling generator, the clients' last epsilons, the failed rounds in a row, a
calibrated central sigma) through the checkpoint (``server/checkpoint.py``); a resumed run's
train messages carry ``resumed-from``, the checkpoint's round (``client/state.py``).

Beyond Flower's interface: a sparse mean needs the previous model (coordinates no client
covered stay), so it keeps the model it was configured with; there is no client-side
evaluation (``configure_evaluate`` sends nothing): the server evaluates centrally.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable, Mapping
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedsparse.common.aggregation.norm_bounds import HonestClientBound
from fedsparse.common.config import FederatedConfig
from fedsparse.common.dp.central import central_noise_generator, poisson_sample, user_sample_rate
from fedsparse.common.dp.mechanisms import is_private
from fedsparse.common.layout import ParamLayout
from fedsparse.common.seeds import Stream, stream_seed
from fedsparse.common.wire.payload.indices import indices_to_bytes
from fedsparse.common.wire.protocol import TrainInstruction, round_seed
from fedsparse.server.downlink import DownlinkCache
from fedsparse.server.messages import train_messages
from fedsparse.server.norm_bound import (
    bound_norms,
    derived_bound,
    fixed_bound,
    train_split_size,
)
from fedsparse.server.round_stats import FederationFailed, RoundStats, UserLevel
from fedsparse.server.round_updates import (
    Candidate,
    aggregate,
    aggregate_bounded,
    aggregate_central,
    calibrated_sigma,
    checked_sigma,
    round_numbers,
    validated,
)
from fedsparse.server.strategy_log import log_configuration

__all__ = [
    "ARRAY_KEY",
    "SparseFedAvg",
    "flat_array",
    "flat_tensor",
]

#: The key of the flat global model in the strategy's ``ArrayRecord``.
ARRAY_KEY = "flat"

#: Rejection reasons quoted in ``FederationFailed``'s message.
_REASONS_SHOWN = 5


def flat_array(weights: torch.Tensor) -> ArrayRecord:
    """The flat global model as the strategy's ``ArrayRecord``."""
    return ArrayRecord({ARRAY_KEY: Array(weights.detach().cpu().numpy())})


def flat_tensor(arrays: ArrayRecord) -> torch.Tensor:
    """The flat float32 global model held in ``arrays`` (a copy)."""
    return torch.from_numpy(np.array(arrays[ARRAY_KEY].numpy(), dtype=np.float32, copy=True))


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
        self.downlink = DownlinkCache.for_run(cfg)
        self._rng = np.random.default_rng(stream_seed(cfg.seed, Stream.CLIENT_SELECTION))
        self.norm_bound = cfg.norm_bound()
        self.epsilons: dict[int, float] = {}  # node -> the epsilon it last reported
        self.round_model: torch.Tensor | None = None  # the model configure_train sent
        self._failed_in_a_row: list[int] = []  # rounds
        self.last_round: RoundStats | None = None
        self.resumed_from = 0  # the checkpoint round a resumed run continues (0: not resumed)
        # dp-level=user (common/dp/central.py): users' rate this round, history, sigma, noise
        self.user_level = cfg.dp_level == "user"
        self.users = UserLevel(expected=float(cfg.clients_per_round))
        self.central_sigma: float | None = (
            None if cfg.central_target_epsilon else cfg.central_noise_multiplier
        )
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
            "epsilons": dict(self.epsilons),
            "failed-in-a-row": list(self._failed_in_a_row),
        }
        # ranked: what the next round ranks; dpssgd: the selection (freeze keeps it)
        state.update(self.method.state_dict())
        if self.user_level:  # dp-level=user: the rounds accounted (the noise stays secret)
            state["user-history"] = [list(entry) for entry in self.users.history]
            state["central-sigma"] = self.central_sigma  # calibrated once, kept on resume
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
            sigma = checked_sigma(self.cfg, state.get("central-sigma", self.central_sigma))
            central_state = state.get("central-noise-state")
            user_sampling = state.get("user-sampling-rng")
        except KeyError as err:
            raise ValueError(f"strategy state: missing key {err}") from None
        except (TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"strategy state: {type(err).__name__}: {err}") from None
        self._rng = rng
        self.epsilons = epsilons
        self._failed_in_a_row = failed
        self.method.load_state_dict(state)
        self.users.history = user_history
        self.central_sigma = sigma
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
        self.epsilons = {n: eps for n, eps in self.epsilons.items() if n in connected}

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
                examples = cfg.max_client_examples or self._train_examples or train_split_size(cfg)
                caps = cfg.honest_client_bound(examples, dense_size=self.d)
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
        return derived_bound(
            caps,
            keep=self._noise_keep(stats),
            d=self.d,
            selects_per_step=self.method.selects_per_step,
        )

    def summary(self) -> None:
        """Logs the strategy's configuration (``log_configuration``)."""
        caps = None if self.user_level else self.honest_bound()
        log_configuration(self.cfg, d=self.d, norm_bound=self.norm_bound, caps=caps)

    def frozen_at(self, server_round: int) -> int:
        """The frozen coordinate prefix of ``server_round`` (lf; else 0)."""
        return self.method.frozen_at(server_round - 1, self.frozen_prefix)

    def _sample(self, grid: Grid) -> list[int]:
        nodes = sorted(grid.get_node_ids())
        if self.user_level:  # Poisson sampling of users: the accountant's subsampling
            self.users.rate = user_sample_rate(self.cfg.clients_per_round, len(nodes))
            if self.cfg.central_target_epsilon:  # the target holds at this round's rate
                history, sigma = self.users.history, self.central_sigma
                self.central_sigma = calibrated_sigma(self.cfg, self.users.rate, history, sigma)
            return poisson_sample(nodes, self.users.rate, self._user_rng)
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
        self.round_model = weights
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
        payloads = self.downlink.payloads(
            stats.selected, weights, version=version, server_round=server_round
        )
        addressed = []
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
            addressed.append((node, instruction, self.downlink.kind(base, version)))
            stats.downlink_payload_bytes += len(payload) + len(support_bytes)
        messages, sizes = train_messages(
            addressed, resumed_from=self.resumed_from, support=support_bytes
        )
        stats.downlink_message_bytes += sum(sizes)
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validates the replies, bounds their norms, aggregates; returns (model, numbers).

        Raises:
            FederationFailed: this is the ``max-failed-rounds``-th failed round in a row
                (``last_round`` holds the round's numbers; the model is unchanged).
        """
        stats, weights = self.last_round, self.round_model
        if stats is None or weights is None or stats.server_round != server_round:
            raise RuntimeError(f"aggregate_train({server_round}) without configure_train")
        # The sums are exact, so neither arrival order nor node ids move the model; with a
        # norm bound fixed before the round, each update is added as it is read, none held.
        candidates = validated(
            stats, replies, cfg=self.cfg, d=self.d, downlink=self.downlink, epsilons=self.epsilons
        )
        private = is_private(self.cfg.privacy().mechanism)  # else sigma is no privacy figure
        fixed = None if self.user_level else fixed_bound(self.norm_bound, self._derived(stats))
        if fixed is not None:
            new_weights, touched = aggregate_bounded(
                stats,
                weights,
                candidates,
                bound=fixed,
                cfg=self.cfg,
                d=self.d,
                epsilons=self.epsilons.values(),
                private=private,
            )
        else:  # the round's median norm, or dp-level=user's sum: hold the round's updates
            new_weights, touched = self._held_round(stats, weights, list(candidates), private)
        for reason in stats.rejected:
            log(WARNING, "round %d: dropped %s", server_round, reason)
        for reason in stats.clipped:
            log(WARNING, "round %d: clipped %s", server_round, reason)
        public = (  # the round's support is public: its seeded mask, or every coordinate
            self.cfg.mask_scope == "round"
            and not stats.frozen
            and stats.explicit is None
            and not stats.client_support
            and not stats.failed
        )
        seeded = public and stats.keep < self.d
        mask = (stats.mask_seed, stats.keep) if seeded else None
        lossy = None
        if public:  # a lossy downlink-dtype: the decoded change moves the model (downlink.py)
            lossy = self.downlink.lossy_round(server_round, weights, new_weights, mask=mask)
        if lossy is not None:
            new_weights, touched = lossy
        if not stats.failed:  # ranked: the aggregate the next round ranks
            self.method.after_round(before=weights, after=new_weights, touched=touched)
        self.downlink.record_version(server_round, touched, seeded=mask)
        self.count_failures(stats)
        return flat_array(new_weights), stats.metrics()

    def _held_round(
        self, stats: RoundStats, weights: torch.Tensor, accepted: list[Candidate], private: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The round from all its valid updates at once: bounded by the round's median norm
        (``bound_norms``), or summed by DP-FedAvg (``dp-level=user``)."""
        if not self.user_level and accepted:  # dp-level=user: the central clip bounds each
            derived, action = self._derived(stats), self.cfg.norm_action
            accepted = bound_norms(
                stats, accepted, norm_bound=self.norm_bound, derived=derived, norm_action=action
            )
        round_numbers(stats, accepted, self.epsilons.values(), private=private)
        if self.user_level:
            return self._aggregate_central(stats, weights, accepted)
        return aggregate(stats, weights, accepted, cfg=self.cfg, d=self.d)

    def _derived(self, stats: RoundStats) -> tuple[float, str] | None:
        """``_derived_bound``, logged when it changes."""
        derived = self._derived_bound(stats)
        if derived is not None and derived[1] != self._honest_how:
            log(INFO, "round %d: %s", stats.server_round, derived[1])
            self._honest_how = derived[1]
        return derived

    def _aggregate_central(
        self, stats: RoundStats, weights: torch.Tensor, accepted: list[Candidate]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """dp-level=user: DP-FedAvg's round (``aggregate_central``), accounted in the run's
        user-level history."""
        return aggregate_central(
            stats,
            weights,
            accepted,
            cfg=self.cfg,
            d=self.d,
            history=self.users.history,
            user_rate=self.users.rate,
            expected_users=self.users.expected,
            generator=self._central_gen,
            noise_multiplier=self.central_sigma,  # type: ignore[arg-type]  # set by _sample
        )

    def count_failures(self, stats: RoundStats) -> None:
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
