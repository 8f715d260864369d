"""A round under ``secure-aggregation=true``: the server decodes the sum of the kept values only.

Distributed DP-FedAvg (``common/dp/central.py``) without a trusted server. The strategy plans
the round and Poisson-samples its users as under ``dp-level=user``; then:

1. **setup** travels with the train messages (``SECAGG_RECORD``): the ring of
   :func:`~fedsparse.common.aggregation.secure.choose_ring` for the ``n`` sampled users, the
   threshold ``t`` the smallest with ``2t - n > c`` (``secagg-colluders``), ``k`` the round's
   kept count, ``C = central-clip``, ``σ = central-noise-multiplier``. Each node trains, and
   replies its public keys and its train metrics, never its update (``client/secagg_node.py``).
   Under ``central-target-epsilon`` the strategy calibrates the central multiplier ``σ_c``
   from the public sampling plan as with a trusted server, and the ring's ``σ`` is the one
   whose fewest decodable survivors (``t``) still carry ``σ_c`` (``ring_for_central``); the
   round is accounted at ``σ_c``, a floor whoever drops out (more survivors carry more,
   which the figure leaves out: how many survived never chooses a later σ). Each node checks
   the ring's worst case (its share alone) against its own policy and charges its ledger
   that, whatever ``σ`` is.
2. **share_keys**, **collect_masked_vectors**, **unmask**: ``query.secagg`` messages, relayed by
   :class:`~fedsparse.server.secagg.SecAggServer`. A reply the state machine refuses
   (``SecAggError`` naming the node) is dropped as a dropout and the stage is received
   again; a client's error reply or silence is a dropout. Below ``t`` at any stage the round
   fails (``SecAggDropoutError``): nothing is decoded and the model is unchanged.
3. The decoded noisy sum of the ``m`` survivors moves the model as DP-FedAvg's does,
   ``w + sum / (q N)`` on the round's public support, and the round is accounted (without a
   target) at the central multiplier the ``m`` survivors' shares give
   (``central_noise_multiplier``: the shares of ``c`` colluders left out, the rounding's
   inflation counted): in the run's
   user-level history at the sampling rate ``q`` (``user_epsilon``, what the released models
   reveal), and at rate 1 (``central_epsilon``: the server knows whom it sampled).

A round with fewer than 2 sampled users, or whose ring cannot be built, sends nothing and
fails. The model then stays as it was, which the user-level figure does not account: whether
a round ran reveals whether ``n < 2``. The server can never release noise itself here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from collections.abc import Callable, Collection, Mapping
from logging import WARNING
from typing import TYPE_CHECKING, Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from fedsparse.common.aggregation.secure import (
    RingParams,
    central_noise_multiplier,
    choose_ring,
    ring_for_central,
    smallest_threshold,
)
from fedsparse.common.dp.accounting import compute_epsilon_of_history
from fedsparse.common.wire.protocol import METRICS_RECORD
from fedsparse.common.wire.run_log import round_noise
from fedsparse.common.wire.secagg import SECAGG_ACTION, SECAGG_RECORD, SecAggError
from fedsparse.server.messages import message_bytes
from fedsparse.server.round_stats import RoundStats
from fedsparse.server.round_updates import round_support
from fedsparse.server.secagg import SecAggDropoutError, SecAggServer
from fedsparse.server.strategy import flat_array

if TYPE_CHECKING:
    from fedsparse.server.strategy import SparseFedAvg

__all__ = ["secure_round"]


def secure_round(
    strategy: SparseFedAvg,
    grid: Grid,
    server_round: int,
    messages: list[Message],
    *,
    timeout: float,
) -> ArrayRecord:
    """Runs the round whose train ``messages`` ``configure_train`` built; the new model.

    Raises:
        FederationFailed: the ``max-failed-rounds``-th failed round in a row.
    """
    stats, weights = strategy.last_round, strategy.round_model
    if stats is None or weights is None or stats.server_round != server_round:
        raise RuntimeError(f"secure_round({server_round}) without configure_train")
    new_weights = weights
    try:
        noisy_sum, params, survivors = _run(strategy, grid, stats, messages, timeout)
        accounted = central_noise_multiplier(params, len(survivors))
        if strategy.cfg.central_target_epsilon:  # the plan's: the fewest survivors' floor
            assert strategy.central_sigma is not None
            accounted = strategy.central_sigma
        _account(strategy, stats, accounted)
        support = round_support(stats, strategy.d)
        step = noisy_sum.to(torch.float32) / strategy.users.expected
        new_weights = weights.clone()
        if support is None:
            new_weights += step
        else:
            new_weights[support] += step
        stats.accepted = len(survivors)
        if not bool(torch.isfinite(new_weights).all()):
            stats.failure, new_weights = "the decoded sum is not finite", weights
    except (SecAggError, ValueError) as err:
        stats.failure = f"secure aggregation: {err}"
        log(WARNING, "round %d: %s", server_round, stats.failure)
        _account(strategy, stats, None)  # nothing released: the figures so far
    touched = new_weights != weights
    if not stats.failed:  # ranked: the aggregate the next round ranks
        strategy.method.after_round(before=weights, after=new_weights, touched=touched)
    # the change lies on the round's seeded mask (when that is its support): nodes a version
    # behind are sent its values only (server/downlink.py), as in the clear
    seeded = not (stats.failed or stats.frozen or stats.explicit is not None)
    mask = (stats.mask_seed, stats.keep) if seeded and stats.keep < strategy.d else None
    strategy.downlink.record_version(server_round, touched, seeded=mask)
    strategy.count_failures(stats)
    return flat_array(new_weights)


def _run(
    strategy: SparseFedAvg,
    grid: Grid,
    stats: RoundStats,
    messages: list[Message],
    timeout: float,
) -> tuple[torch.Tensor, RingParams, list[int]]:
    """The four stages; (the decoded noisy sum, the ring, the survivors)."""
    cfg = strategy.cfg
    nodes = [int(m.metadata.dst_node_id) for m in messages]
    ring = functools.partial(
        ring_for_central if cfg.central_target_epsilon else choose_ring,
        clip=cfg.central_clip,
        clients=len(nodes),
        threshold=smallest_threshold(len(nodes), cfg.secagg_colluders),
        kept=stats.keep,
        colluders=cfg.secagg_colluders,
        bits=cfg.secagg_ring_bits,  # 0: the exact ring
    )
    if cfg.central_target_epsilon:  # the target's sigma for the fewest survivors, t
        assert strategy.central_sigma is not None  # calibrated by _sample
        params = ring(strategy.central_sigma)
    else:
        params = ring(sigma=cfg.central_noise_multiplier)
    if cfg.secagg_neighbours:  # a sparse ring (SecAgg+): ValueError for too few nodes
        params = dataclasses.replace(params, neighbours=cfg.secagg_neighbours)
    server = SecAggServer(params, nodes, round_id=stats.server_round)
    setup = server.setup_messages()
    for message in messages:
        message.content.config_records[SECAGG_RECORD] = ConfigRecord(
            setup[int(message.metadata.dst_node_id)]
        )
        stats.downlink_message_bytes += message_bytes(message)
    replies = grid.send_and_receive(messages, timeout=timeout)
    answered = _answers(stats, replies, nodes, train=strategy)
    _receive(stats, server.receive_setup, answered)
    keys = _stage(grid, stats, server.share_keys_messages(), timeout)
    _receive(stats, server.receive_share_keys, keys)
    masked = _stage(grid, stats, server.collect_messages(), timeout)
    _receive(stats, server.receive_collect, masked)
    if server.checks_consistency:  # the nodes sign: each survivor signs the survivor set
        signed = _stage(grid, stats, server.consistency_messages(), timeout)
        _receive(stats, server.receive_consistency, signed)
    unmask = _stage(grid, stats, server.unmask_messages(), timeout)
    ring_total = _receive(stats, server.receive_unmask, unmask)
    stats.secagg_bytes = {stage: dict(counts) for stage, counts in server.bytes.items()}
    stats.uplink_payload_bytes = sum(c["up"] for c in server.bytes.values())
    stats.downlink_payload_bytes += sum(c["down"] for c in server.bytes.values())
    stats.noise = round_noise([int(server.seeded_noise[n]) for n in server.survivors])
    return server.decode(ring_total), params, server.survivors


def _stage(
    grid: Grid, stats: RoundStats, payloads: Mapping[int, dict[str, Any]], timeout: float
) -> dict[int, dict[str, Any]]:
    """Sends one stage's payloads as ``query.secagg`` messages; the replies that came."""
    messages = [
        Message(
            RecordDict({SECAGG_RECORD: ConfigRecord(payload)}),
            dst_node_id=node,
            message_type=f"query.{SECAGG_ACTION}",
            group_id=str(stats.server_round),
        )
        for node, payload in payloads.items()
    ]
    stats.downlink_message_bytes += sum(message_bytes(m) for m in messages)
    return _answers(stats, grid.send_and_receive(messages, timeout=timeout), list(payloads))


def _answers(
    stats: RoundStats,
    replies: Any,
    asked: Collection[int],
    *,
    train: SparseFedAvg | None = None,
) -> dict[int, dict[str, Any]]:
    """Node -> its stage payload; error replies and replies without one are dropouts."""
    answered: dict[int, dict[str, Any]] = {}
    losses = []
    seen: set[int] = set()
    for reply in replies:
        node = int(reply.metadata.src_node_id)
        if node not in asked or node in seen:  # a SuperLink notice, a stranger, a repeat
            continue
        seen.add(node)
        if train is not None:
            stats.num_replies += 1
        if reply.has_error():
            stats.rejected.append(f"node {node}: client error: {reply.error.reason}")
            if train is not None:
                train.downlink.forget(node)  # unknown state: dense next time
            continue
        if train is not None:  # it applied this round's downlink
            train.downlink.node_applied(node, stats.server_round - 1)
        record = reply.content.config_records.get(SECAGG_RECORD)
        if record is None:
            stats.rejected.append(f"node {node}: no {SECAGG_RECORD!r} record")
            continue
        stats.uplink_message_bytes += message_bytes(reply)
        answered[node] = dict(record)
        if train is not None:
            stats.answered += 1
            metrics = reply.content.metric_records.get(METRICS_RECORD, {})
            epsilon = float(metrics.get("epsilon", -1.0))
            epsilon = math.inf if epsilon == -1.0 else epsilon
            train.epsilons[node] = epsilon
            loss = float(metrics.get("train-loss", math.nan))
            if math.isfinite(loss):
                losses.append(loss)
    if train is not None:
        stats.missing = len(stats.selected) - stats.num_replies
        known = list(train.epsilons.values())
        if known:
            stats.epsilon_max = max(known)
            stats.epsilon_median = statistics.median(known)
        stats.train_loss = statistics.fmean(losses) if losses else math.nan
    return answered


def _receive(
    stats: RoundStats, receive: Callable[[dict[int, Any]], Any], replies: dict[int, Any]
) -> Any:
    """``receive(replies)``; a reply it refuses by node is dropped and the rest received again."""
    replies = dict(replies)
    while True:
        try:
            return receive(replies)
        except SecAggDropoutError:
            raise
        except SecAggError as err:
            if err.node is None or err.node not in replies:
                raise
            stats.rejected.append(f"node {err.node}: {err}")
            log(WARNING, "round %d: dropped %s", stats.server_round, stats.rejected[-1])
            del replies[err.node]


def _account(strategy: SparseFedAvg, stats: RoundStats, sigma: float | None) -> None:
    """The round in the user-level history at the users' rate (``sigma`` None: nothing was
    released); the central figure takes the same rounds at rate 1 (the server knows whom it
    sampled). Both stay None until a round released something."""
    cfg = strategy.cfg
    history, rate = strategy.users.history, strategy.users.rate
    if sigma is not None and history and history[-1][:2] == (sigma, rate):
        history[-1] = (sigma, rate, history[-1][2] + 1)
    elif sigma is not None:
        history.append((sigma, rate, 1))
    if sigma is not None:
        stats.central_noise_multiplier = sigma
    if not history:
        return
    stats.user_epsilon = compute_epsilon_of_history(
        history, delta=cfg.delta, accountant=cfg.accountant
    )
    stats.central_epsilon = compute_epsilon_of_history(
        [(s, 1.0, n) for s, _, n in history], delta=cfg.delta, accountant=cfg.accountant
    )
