"""From a round's replies to its new model: validation, the round's numbers, aggregation.

``validated`` turns the replies into ``Candidate`` updates, one by one (``check_reply``,
``server/validation.py``; a bad reply, a reply from a node not selected and a second reply are
dropped with their reason; selected nodes without a reply are counted missing);
``round_numbers`` computes the round's train loss, epsilons and noise origin; ``aggregate``
averages the accepted updates (``SparseAggregator``, or a coordinate-wise trimmed mean or
median) into the new global model and refuses one with a non-finite value;
``aggregate_central`` is ``dp-level=user``'s round instead (DP-FedAvg's noisy clipped sum,
accounted whether or not anyone answered). The sums are exact (``common/aggregation/``), so the
model does not depend on arrival order or node ids, and ``validated`` and ``aggregate`` read a
stream of replies without holding their updates. The norm bound between validation and
aggregation is ``server/norm_bound.py``'s.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from logging import INFO

import torch
from flwr.app import Message
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.common.logger import log

from fedsparse.common.aggregation.norm_bounds import NormAction
from fedsparse.common.aggregation.robust import clip_to_norm, l2_norm
from fedsparse.common.aggregation.sparse import make_aggregator
from fedsparse.common.config import FederatedConfig
from fedsparse.common.dp.accounting import compute_epsilon_of_history
from fedsparse.common.dp.central import calibrate_central_noise, central_aggregate
from fedsparse.common.masks import seeded_support
from fedsparse.common.wire.protocol import client_mask_seed
from fedsparse.common.wire.run_log import epsilon_stats, noise_range, round_noise
from fedsparse.server.downlink import DownlinkCache
from fedsparse.server.messages import message_bytes
from fedsparse.server.round_stats import RoundStats
from fedsparse.server.validation import RejectedReply, ValidUpdate, check_reply

__all__ = [
    "Candidate",
    "aggregate",
    "aggregate_bounded",
    "bound_each",
    "aggregate_central",
    "calibrated_sigma",
    "checked_sigma",
    "round_numbers",
    "round_support",
    "validated",
    "without_values",
]


@dataclass(frozen=True)
class Candidate:
    """A reply that passed validation, before the norm bound."""

    node: int
    valid: ValidUpdate
    values: torch.Tensor  # the update's values (clipped, if the bound scaled it down)
    norm: float  # L2 norm of the values as received


_NO_VALUES = torch.zeros(0)


def without_values(candidate: Candidate) -> Candidate:
    """``candidate`` without its values (its numbers, weight and support kept)."""
    valid = replace(candidate.valid, values=_NO_VALUES)
    return replace(candidate, valid=valid, values=_NO_VALUES)


def validated(
    stats: RoundStats,
    replies: Iterable[Message],
    *,
    cfg: FederatedConfig,
    d: int,
    downlink: DownlinkCache,
    epsilons: dict[int, float],
) -> Iterator[Candidate]:
    """Each reply that passes ``check_reply``, as it is read; counts replies, errors and
    (once the replies are read to the end) missing nodes.

    Tells ``downlink`` which nodes applied the round's model (or are in an unknown state) and
    records each valid reply's epsilon in ``epsilons`` (node -> epsilon).
    """
    keep = stats.keep
    version = stats.server_round - 1
    selected, seen = set(stats.selected), set()
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
            downlink.forget(node)  # unknown state: dense next time
            stats.rejected.append(f"node {node}: client error: {reply.error.reason}")
            continue
        downlink.node_applied(node, version)  # it applied this round's downlink
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
            round_support = seeded_support(d, keep, scope_seed)
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
        epsilons[node] = valid.reply.epsilon
        if cfg.save_updates:
            stats.updates[node] = valid.reply.update
        # The values are decoded: the payload's bytes go with the reply's message (a round of
        # 10,000 dense updates would otherwise hold them twice until it is summed).
        valid = replace(valid, reply=replace(valid.reply, update=b""))
        yield Candidate(node, valid, valid.values, l2_norm(valid.values))
    stats.missing = len(selected - seen)


def round_numbers(
    stats: RoundStats,
    accepted: list[Candidate],
    epsilons: Iterable[float],
    *,
    private: bool = True,
) -> None:
    """Train loss, noise origin and sigma range of the accepted updates; epsilons of the valid
    replies. ``private``: the clients run dpsgd (else their sigma is no privacy figure)."""
    weighted = [(c.valid.reply.train_loss, c.valid.weight) for c in accepted]
    total = math.fsum(w for _, w in weighted)  # exactly rounded: the same in any order
    stats.train_loss = math.fsum(loss * w for loss, w in weighted) / total if total else math.nan
    stats.epsilon_max, stats.epsilon_median = epsilon_stats(list(epsilons))
    stats.noise = round_noise([c.valid.reply.seeded_noise for c in accepted])
    stats.noise_multiplier_min, stats.noise_multiplier_max = noise_range(
        [c.valid.reply.noise_multiplier for c in accepted], private=private
    )


def aggregate(
    stats: RoundStats,
    weights: torch.Tensor,
    accepted: Iterable[Candidate],
    *,
    cfg: FederatedConfig,
    d: int,
    added: list[Candidate] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the new global model, the coordinates that changed); the old one if it failed.

    ``accepted`` is read once, each update added as it comes (the mean's sums are exact, so
    their order does not matter: ``common/aggregation/sparse.py``); ``added``, when given,
    receives each added candidate without its values (what ``round_numbers`` reads), so a
    stream of updates is summed without holding them.
    """
    unchanged = torch.zeros(d, dtype=torch.bool)
    aggregator = make_aggregator(cfg.aggregator, d, trim_fraction=cfg.trim_fraction)
    for candidate in accepted:
        try:
            aggregator.add(
                candidate.values, support=candidate.valid.support, weight=candidate.valid.weight
            )
        except ValueError as err:  # checked already: only a bug lands here
            stats.rejected.append(f"node {candidate.node}: {err}")
            continue
        if added is not None:
            added.append(without_values(candidate))
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


def bound_each(
    stats: RoundStats,
    candidates: Iterable[Candidate],
    *,
    bound: float,
    how: str,
    norm_action: NormAction,
) -> Iterator[Candidate]:
    """Each candidate within ``bound`` (described by ``how``), as it comes; the others
    rejected or clipped (``norm_action``). A bound fixed before the round's updates
    (``norm_bound.fixed_bound``) holds a stream of them without gathering it."""
    for candidate in candidates:
        stats.norm_bound, stats.norm_bound_how = bound, how  # a round with an update
        if candidate.norm <= bound:
            yield candidate
            continue
        reason = f"node {candidate.node}: update norm={candidate.norm:.4g}: expected <= "
        reason += f"{bound:.4g} ({how})"
        if norm_action == "reject":
            stats.rejected.append(reason)
            continue
        stats.clipped.append(reason)
        yield replace(candidate, values=clip_to_norm(candidate.values, bound=bound))


def aggregate_bounded(
    stats: RoundStats,
    weights: torch.Tensor,
    candidates: Iterable[Candidate],
    *,
    bound: tuple[float, str],
    cfg: FederatedConfig,
    d: int,
    epsilons: Iterable[float],
    private: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``bound_each`` then ``aggregate`` then ``round_numbers``, one update at a time: a
    stream of candidates is held to ``bound`` (the round's and its description, set before
    it) and summed without holding their values."""
    accepted: list[Candidate] = []
    bounded = bound_each(
        stats, candidates, bound=bound[0], how=bound[1], norm_action=cfg.norm_action
    )
    new_weights, touched = aggregate(stats, weights, bounded, cfg=cfg, d=d, added=accepted)
    round_numbers(stats, accepted, epsilons, private=private)
    return new_weights, touched


def round_support(stats: RoundStats, d: int) -> torch.Tensor | None:
    """The round's public support (int64 indices; None: every coordinate)."""
    if stats.explicit is not None:
        return stats.explicit
    if stats.frozen:
        return torch.arange(stats.frozen, d, dtype=torch.int64)
    if stats.keep < d:
        return seeded_support(d, stats.keep, stats.mask_seed)
    return None


def calibrated_sigma(
    cfg: FederatedConfig,
    user_rate: float,
    history: list[tuple[float, float, int]],
    sigma: float | None,
) -> float:
    """``central-target-epsilon``'s sigma for the round about to run at ``user_rate`` after
    ``history``: ``sigma`` while the run still fits the target at this rate, else the one that
    makes it fit (``calibrate_central_noise``), logged with what it was calibrated from."""
    done = sum(rounds for _, _, rounds in history)
    chosen = calibrate_central_noise(
        target_epsilon=cfg.central_target_epsilon,
        sample_rate=user_rate,
        rounds=max(1, cfg.num_rounds - done),
        delta=cfg.delta,
        accountant=cfg.accountant,
        history=history,
        sigma=sigma,
    )
    if chosen != sigma:
        log(
            INFO,
            "central-target-epsilon=%g: central sigma %.6g for rounds %d-%d (q=%.6g, delta=%g)",
            cfg.central_target_epsilon,
            chosen,
            done + 1,
            max(done + 1, cfg.num_rounds),
            user_rate,
            cfg.delta,
        )
    return chosen


def checked_sigma(cfg: FederatedConfig, value: object) -> float | None:
    """A checkpoint's central sigma, checked against ``cfg`` (None: not calibrated yet).

    Raises:
        ValueError: not a finite number >= 0 (> 0 under ``central-target-epsilon``), or
            another than ``central-noise-multiplier`` without a target.
    """
    if value is None and cfg.central_target_epsilon:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"central-sigma={value!r}: expected a finite number")
    low = 0.0 if not cfg.central_target_epsilon else math.ulp(0.0)
    if value < low:
        raise ValueError(f"central-sigma={value!r}: expected a number >= {low:g}")
    if not cfg.central_target_epsilon and value != cfg.central_noise_multiplier:
        raise ValueError(
            f"central-sigma={value!r}: the run config's central-noise-multiplier is "
            f"{cfg.central_noise_multiplier!r}"
        )
    return float(value)


def aggregate_central(
    stats: RoundStats,
    weights: torch.Tensor,
    accepted: list[Candidate],
    *,
    cfg: FederatedConfig,
    d: int,
    history: list[tuple[float, float, int]],
    user_rate: float,
    expected_users: float,
    generator: torch.Generator,
    noise_multiplier: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dp-level=user: DP-FedAvg's clipped sum plus noise over q N (``common/dp/central.py``),
    at ``noise_multiplier`` (``central-noise-multiplier``, or the one calibrated for
    ``central-target-epsilon``).

    Every round is accounted, whether or not anyone answered (conservative): the round is
    added to ``history`` (the accountant's ``(sigma, rate, rounds)`` entries, updated in
    place) at users' sampling rate ``user_rate``."""
    stats.central_noise_multiplier = noise_multiplier
    entry = (noise_multiplier, user_rate, 1)
    if history and history[-1][:2] == entry[:2]:
        sigma, rate, rounds = history[-1]
        history[-1] = (sigma, rate, rounds + 1)
    else:
        history.append(entry)
    stats.user_epsilon = (
        math.inf
        if noise_multiplier == 0
        else compute_epsilon_of_history(history, delta=cfg.delta, accountant=cfg.accountant)
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
        support=round_support(stats, d),
        clip=cfg.central_clip,
        noise_multiplier=noise_multiplier,
        expected_users=expected_users,
        generator=generator,
        secure=cfg.secure_mode,
    )
